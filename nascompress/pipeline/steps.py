"""A plan's steps and the plan itself (:class:`Step`, :class:`Pipeline`), below both the planner
(:mod:`nascompress.pipeline.plan`, which builds them and re-exports them) and the runner and report
that read them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .fallback import current_model
from .sections import PipelineConfig


@dataclass
class Step:
    """One resumable unit of work.

    Args:
        name: its name in ``OUT/done/<name>.json``.
        dir: its output directory (None: nothing written by the step itself).
        mode: ``train`` (resumed from its checkpoint), ``redo`` (rebuilt from scratch when
            incomplete) or ``study`` (continued by name).
        outputs: files (relative to OUT) that must exist for the step to count as complete.
    """

    name: str
    dir: Path | None
    mode: str
    run: Callable[..., dict[str, Any]]
    outputs: tuple[str, ...] = ()
    describe: str = ""


@dataclass
class Pipeline:
    """A validated pipeline for one OUT: the config, the directories, and the steps."""

    cfg: PipelineConfig
    out: Path
    source: str
    steps: list[Step]
    base_dir: Path  # the dense base run
    final_dir: Path  # the model the pipeline ends with, as planned (see :meth:`result_dir`)
    storage: str | None = None
    data: Any = None

    def result_dir(self) -> Path | None:
        """The model the pipeline really ended with: :attr:`final_dir`, or the model before the
        skipped steps when the DCS stage fell back; None when no compressed model was made."""
        st = self.cfg.stages
        return current_model(
            self.out,
            base_dir=self.base_dir,
            dcs=st.dcs is not None,
            tokens=st.tokens is not None,
            retrain=st.retrain is not None,
            upto="final",
        )


__all__ = ["Step", "Pipeline"]
