"""The import's results typed: :class:`ImportMetrics`, what
:func:`~nascompress.importer.run.import_model` returns and writes as the run's ``metrics.json`` (its
completion mark added: :meth:`~nascompress.runs.run_dir.RunDir.finish`), in the style of
:mod:`nascompress.train.metrics`, whose :class:`~nascompress.train.metrics.TrainMetrics` it extends
(an imported model is a base like a trained one: its ``best_val_top1`` and test figures are read the
same way).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ..train.metrics import TrainMetrics


@dataclass(frozen=True, kw_only=True)
class ImportMetrics(TrainMetrics):
    """An imported model's metrics: ``imported``, each shape read from the weights that differs from
    the model name's (``shapes_from_weights``: name -> [the weights', the name's]) and, evaluated on a
    dataset (else ``dataset`` is null), its validation and test figures (``best_val_top1`` is
    ``val_top1``: there are no epochs) and the evaluation time."""

    NEW_SOURCE = "the import's {name}"

    imported: bool | None = None
    shapes_from_weights: Mapping[str, Any] | None = None
    val_loss: float | None = None
    val_n: int | None = None
    eval_time_s: float | None = None


__all__ = ["ImportMetrics"]
