"""Search spaces as data: YAML files that declare what an Optuna study searches.

The space file format and its validation: :mod:`nascompress.search.space_parser`. The modules:

- :mod:`~nascompress.search.space_entries`: the normalized entries (``Param``, ``Method``);
- :mod:`~nascompress.search.space_parser`: reading and validating a space file (the ``layers``
  kind: :mod:`~nascompress.search.space_layers`);
- :mod:`~nascompress.search.space_model`: :class:`Space` (structure, hash, ``suggest``,
  ``records``, ``distributions``) and :func:`load_space`;
- :mod:`~nascompress.search.space_replay`: method records back to Optuna params (``params_for``);
- :mod:`~nascompress.search.space_lattice`: the grid of evenly spread configurations (``grid``).

This module re-exports their public names.
"""

from __future__ import annotations

from .space_entries import Method, Param
from .space_model import Space, load_space
from .space_layers import MAX_LAYER_SETS
from .space_parser import FORMAT, KINDS, WIDTH_PARAMS, MethodFields
from .space_values import registry_method_fields

__all__ = [
    "FORMAT",
    "KINDS",
    "MAX_LAYER_SETS",
    "WIDTH_PARAMS",
    "Method",
    "MethodFields",
    "Param",
    "Space",
    "load_space",
    "registry_method_fields",
]
