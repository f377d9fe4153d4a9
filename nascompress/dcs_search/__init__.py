"""The DCS differentiable channel search (``nascompress search dcs``, :mod:`.search`, :mod:`.run`) and
the materialize job beside it (:mod:`.materialize`). Its parts: the cost model (:mod:`.cost`), the
training hooks (:mod:`.hooks`), preparing the supernet (:mod:`.prepare`, :mod:`.family`,
:mod:`.protect`), the teacher cache (:mod:`.teacher`) and the uniform baseline (:mod:`.baseline`)."""

from __future__ import annotations

from .cost import CostModel
from .search_config import DCSSearchConfig, DCSSearchJob
from .run import search_dcs
from .materialize import MaterializeJob, materialize_search

__all__ = ["CostModel", "DCSSearchConfig", "DCSSearchJob", "search_dcs", "MaterializeJob", "materialize_search"]
