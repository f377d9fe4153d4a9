"""The pipeline's own JSON files, typed and read and written here only (the style of
:mod:`nascompress.runs.files`: typed fields, the rest in ``extra``, the file's key order kept, so a file
read and written again is the same bytes).

- ``OUT/done/<step>.json``, a step's completion marker (:mod:`nascompress.pipeline.run`):
  :class:`StepMarker`; :func:`find_step_marker` / :func:`write_step_marker`.
- ``OUT/tokens/pick.json``, each study's pick and which one was kept (:mod:`nascompress.pipeline.plan`):
  :class:`Pick`; :func:`find_pick` / :func:`write_pick`.
- ``OUT/summary.json``, the pipeline's summary (:mod:`nascompress.pipeline.report`): its records are
  :mod:`nascompress.pipeline.summary`'s (:class:`~nascompress.pipeline.summary.Summary`);
  :func:`read_summary` / :func:`write_summary_json`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ..runs.files import Record, as_is, check_map, check_number, check_str, optional, plain
from ..runs.json_io import read_json, write_json
from .summary import Summary


DONE_DIR = "done"
PICK_FILE = "pick.json"
SUMMARY_FILE = "summary.json"


@dataclass(frozen=True, kw_only=True)
class StepMarker(Record):
    """``done/<step>.json``: the step, how long it took, when it finished, its directory and its
    result (scalars only; the stage's own files hold the rest)."""

    step: str
    seconds: float | None = None
    finished: str | None = None
    dir: str | None = None
    result: Mapping[str, Any] = field(default_factory=dict)

    CHECKS = {
        "step": check_str,
        "seconds": optional(check_number),
        "finished": optional(check_str),
        "dir": optional(check_str),
        "result": lambda v, where: {} if v is None else check_map(v, where),
    }

    @classmethod
    def new(cls, step: str, *, seconds: float, finished: str, dir: str | None, result: Mapping[str, Any]) -> StepMarker:
        """A marker with every key written (``dir`` null for a step without a directory)."""
        return cls(
            step=step,
            seconds=seconds,
            finished=finished,
            dir=dir,
            result=dict(result),
            order=("step", "seconds", "finished", "dir", "result"),
        )

    @property
    def skipped(self) -> bool:
        """Whether the step was skipped (a DCS stage that collapsed twice, and the steps that then had
        nothing to do)."""
        return bool(self.result.get("skipped"))


@dataclass(frozen=True, kw_only=True)
class Pick(Record):
    """``tokens/pick.json``: the study whose pick was kept, the candidates, the study on the dense base
    and why it did not run (``dense_skipped``)."""

    picked_study: str | None = None
    candidates: Any = None
    dense_study: str | None = None
    dense_skipped: str | None = None

    CHECKS = {
        "picked_study": optional(check_str),
        "candidates": as_is,
        "dense_study": optional(check_str),
        "dense_skipped": optional(check_str),
    }

    @classmethod
    def new(
        cls, *, picked_study: str | None, candidates: Any, dense_study: str | None, dense_skipped: str | None
    ) -> Pick:
        """A pick with every key written (null where there is no value; ``candidates`` as their JSON
        values: each study's pick, a :class:`~nascompress.pipeline.summary.Candidate` or its dict)."""
        return cls(
            picked_study=picked_study,
            candidates=plain(candidates),
            dense_study=dense_study,
            dense_skipped=dense_skipped,
            order=("picked_study", "candidates", "dense_study", "dense_skipped"),
        )


def step_marker_path(out: str | Path, step: str) -> Path:
    return Path(out) / DONE_DIR / f"{step}.json"


def find_step_marker(out: str | Path, step: str) -> StepMarker | None:
    """The marker of ``step`` in the pipeline directory ``out``, None when the step has not finished."""
    path = step_marker_path(out, step)
    return StepMarker.from_dict(read_json(path), source=str(path)) if path.is_file() else None


def write_step_marker(out: str | Path, marker: StepMarker) -> Path:
    """Write ``out/done/<step>.json`` atomically (the directory created)."""
    path = step_marker_path(out, marker.step)
    path.parent.mkdir(exist_ok=True)
    write_json(path, marker.to_dict())
    return path


def find_pick(tokens_dir: str | Path) -> Pick | None:
    """``tokens_dir/pick.json``, None when there is none (a pipeline without a study on the dense base)."""
    path = Path(tokens_dir) / PICK_FILE
    return Pick.from_dict(read_json(path), source=str(path)) if path.is_file() else None


def write_pick(tokens_dir: str | Path, pick: Pick) -> None:
    write_json(Path(tokens_dir) / PICK_FILE, pick.to_dict())


def read_summary(out: str | Path) -> Summary:
    """``out/summary.json``; a missing or damaged file is one NascompressError line."""
    path = Path(out) / SUMMARY_FILE
    return Summary.from_dict(read_json(path), source=str(path))


def write_summary_json(out: str | Path, summary: Summary) -> Path:
    """Write ``out/summary.json`` atomically."""
    path = Path(out) / SUMMARY_FILE
    write_json(path, summary.to_dict())
    return path
