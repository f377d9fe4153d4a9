"""Architecture searches: ``dcs`` (the DCS differentiable channel search, ``nascompress search dcs``)
and the materialize job beside it."""
from __future__ import annotations

from .dcs import CostModel, DCSSearchConfig, DCSSearchJob
from .dcs_run import search_dcs
from .materialize import MaterializeJob, materialize_search

__all__ = ["CostModel", "DCSSearchConfig", "DCSSearchJob", "search_dcs", "MaterializeJob", "materialize_search"]
