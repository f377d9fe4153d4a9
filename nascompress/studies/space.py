"""Search spaces as data: YAML files that declare what an Optuna study searches.

The space file format and its validation: :mod:`nascompress.studies.space_parser`. The modules:

- :mod:`~nascompress.studies.space_entries`: the normalized entries (``Param``, ``Method``);
- :mod:`~nascompress.studies.space_parser`: reading and validating a space file (the ``layers``
  kind: :mod:`~nascompress.studies.space_layers`);
- :mod:`~nascompress.studies.space_model`: :class:`Space` (structure, hash, ``suggest``,
  ``records``, ``distributions``) and :func:`load_space`;
- :mod:`~nascompress.studies.space_replay`: method records back to Optuna params (``params_for``);
- :mod:`~nascompress.studies.space_lattice`: the grid of evenly spread configurations (``grid``).

This module re-exports their public names.
"""

from __future__ import annotations
