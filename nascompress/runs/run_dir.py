"""The life cycle of a job's run directory, one helper for every job that writes one (train, retrain,
finetune, the DCS search, materialize, a study trial's model, import, the linear probe):

1. :meth:`RunDir.prepare` (before anything is loaded or built): ``--resume`` reads the job recorded
   in ``OUT/config.json`` (:func:`~nascompress.runs.out_dir.recorded_job`); then ``OUT`` is checked without
   being created (:func:`~nascompress.runs.out_dir.prepare_out_dir`: a non-empty directory needs ``--force``
   or ``--resume``), so a refused job leaves nothing behind;
2. :meth:`RunDir.create` (once every check passed): rank 0 creates ``OUT`` (``--force`` empties it
   first, ``--resume`` keeps it) and records the job in ``config.json``; under torchrun every rank
   waits until every rank has checked ``OUT`` before, and until it is ready after;
3. :meth:`RunDir.finish`: rank 0 writes the stage's metrics (its record, e.g.
   :class:`~nascompress.train.metrics.TrainMetrics`) with the completion mark (``metrics.json``,
   :func:`~nascompress.runs.io.finish_run`), the run's last write.

:meth:`RunDir.removed_if_unwritable` wraps a job's work: a run this command created that cannot be
written (a full disk) before it has a checkpoint to continue from is removed again, so a failed
command leaves no half-written run (one with a checkpoint stays, for ``--resume``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, TypeVar

from ..train import distributed
from ..errors import WriteError
from .files import RunMetrics, plain
from .io import finish_run
from .owner import check_replaceable, clear_own
from .store import CHECKPOINT_FILE
from .run_config import write_run_config
from .out_dir import create_out_dir, prepare_out_dir, recorded_job

M = TypeVar("M", bound="RunMetrics | Mapping[str, Any]")


@dataclass(frozen=True)
class RunDir:
    """One job's run directory (make it with :meth:`prepare`)."""

    path: Path
    force: bool = False
    resume: bool = False

    @classmethod
    def prepare(cls, out: str | Path, *, force: bool = False, resume: bool = False, inputs: Any = ()) -> RunDir:
        """Check that ``out`` may be written (nothing is created yet); ``inputs``: the paths the job
        reads (an ``out`` that is or contains one is refused, even with ``force``)."""
        return cls(prepare_out_dir(out, force=force, resume=resume, inputs=inputs), force=force, resume=resume)

    @staticmethod
    def recorded(
        out: str | Path, job_cls: Any, command: str, *, given: Any = None, explicit: set[str] | None = None
    ) -> Any:
        """The job an earlier run of ``command`` recorded in ``out/config.json``, for ``--resume``
        (:func:`~nascompress.runs.out_dir.recorded_job`: ``explicit`` options that differ are refused)."""
        return recorded_job(Path(out), job_cls, command, given=given, explicit=explicit)

    def create(self, config: dict[str, Any], *, kind: str = "run") -> Path:
        """Create the directory, marked as a nascompress output of ``kind``, and record ``config`` in
        ``config.json`` (rank 0; every rank waits before and after)."""
        distributed.barrier()  # every rank has checked the directory before rank 0 creates it
        if distributed.is_main():
            create_out_dir(self.path, force=self.force, resume=self.resume, kind=kind)
            write_run_config(self.path, config)
        distributed.barrier()  # the directory is ready
        return self.path

    @contextlib.contextmanager
    def removed_if_unwritable(self) -> Iterator[None]:
        """Around the job's work (after :meth:`prepare`): when it fails because the run cannot be
        written (a full disk, a file size limit) and the run is new (not resumed, not replacing one)
        with no checkpoint yet, remove what it wrote (nascompress's files only) and advise a plain
        rerun; otherwise the error advises ``--resume``."""
        new = not self.path.exists()
        try:
            yield
        except WriteError as e:
            if not (new and distributed.is_main() and self.path.is_dir()):
                raise
            if (self.path / CHECKPOINT_FILE).is_file():
                raise
            with contextlib.suppress(Exception):
                check_replaceable(self.path)
                clear_own(self.path)
                self.path.rmdir()
            if self.path.exists():
                raise
            raise e.instead(f"then rerun the command (the unfinished {self.path} was removed)") from e

    def finish(self, metrics: M) -> M:
        """Mark the run complete (rank 0): write ``metrics`` (the stage's record, or its dict) as
        ``metrics.json`` with the completion mark, the run's last write. Returns the stage's results as
        written, without the mark (what the stage returns, and its command prints): a record as it
        is, a dict as its JSON values (a record in it as its dict)."""
        if distributed.is_main():
            finish_run(self.path, metrics)
        return metrics if isinstance(metrics, RunMetrics) else plain(metrics)


__all__ = ["RunDir"]
