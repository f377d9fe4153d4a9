"""A plan's steps and the plan itself (:class:`Step`, :class:`Pipeline`), below both the planner
(:mod:`nascompress.pipeline.plan`, which builds them and re-exports them) and the runner and report
that read them; the result of a step that had nothing to do (:class:`SkippedStep`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..runs.files import Record
from ..runs.records import TypedRecord
from .fallback import current_model
from .sections import PipelineConfig


@dataclass(frozen=True, kw_only=True)
class SkippedStep(TypedRecord):
    """The result of a step that had nothing to do (a DCS stage that collapsed twice, and the steps that
    then had nothing to do): its marker says so (:attr:`~nascompress.pipeline.files.StepMarker.skipped`),
    and why (``reason``)."""

    NEW_SOURCE = "the skipped step's {name}"

    skipped: bool = True
    reason: str | None = None

    @classmethod
    def because(cls, reason: str) -> SkippedStep:
        """A skipped step's result, ``reason`` saying why."""
        return cls.new(skipped=True, reason=reason)


@dataclass
class Step:
    """One resumable unit of work.

    Args:
        name: its name in ``OUT/done/<name>.json``.
        dir: its output directory (None: nothing written by the step itself).
        mode: ``train`` (resumed from its checkpoint), ``redo`` (rebuilt from scratch when
            incomplete) or ``study`` (continued by name).
        run: does the work; returns the step's result, a record (the stage's metrics, a
            :class:`SkippedStep` ...) or a dict, whose scalars its marker keeps.
        outputs: files (relative to OUT) that must exist for the step to count as complete.
    """

    name: str
    dir: Path | None
    mode: str
    run: Callable[..., Record | dict[str, Any]]
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


__all__ = ["Step", "Pipeline", "SkippedStep"]
