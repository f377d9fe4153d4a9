"""Architecture searches. ``dcs``: the DCS differentiable channel search (``nascompress search dcs``)."""
from __future__ import annotations

from .dcs import CostModel, DCSSearchConfig, DCSSearchJob, search_dcs

__all__ = ["CostModel", "DCSSearchConfig", "DCSSearchJob", "search_dcs"]
