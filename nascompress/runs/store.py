"""Where a training run keeps its saved model, its log and its checkpoint (:class:`RunStore`): a run
directory, which rank 0 alone writes, or memory when :func:`nascompress.train.run.fit` runs without one.

A run killed during the per-epoch append of ``log.jsonl`` leaves a half-written last line: a resume
drops it (with a note; the epoch's record is written again when the epoch is), whereas a damaged
line before the last, or a damaged checkpoint (a missing tensor, an epoch of the wrong type, a
tensor of the wrong shape), is one line saying what is wrong (:func:`damaged_checkpoint`).

For the kill -9 tests, ``NASCOMPRESS_TEST_KILL_AFTER_CHECKPOINT=NAME:N`` (:data:`TEST_KILL_ENV`) kills
the process with SIGKILL right after the run directory named NAME wrote the checkpoint of its epoch N:
a kill at a known point of a run, whatever the machine's speed."""

from __future__ import annotations

import json
import math
import os
import signal
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from ..train import distributed
from ..errors import NascompressError, SettingError
from .checkpoint import save_state
from .io import load_with_arch, save_model
from .json_io import append_jsonl, atomic_path, parse_json, read_file_text
from ..models.weights import mismatch_report, state_mismatches

CHECKPOINT_FILE = "checkpoint.safetensors"
LAST_FILE = "last.safetensors"
LOG_FILE = "log.jsonl"
TEST_KILL_ENV = "NASCOMPRESS_TEST_KILL_AFTER_CHECKPOINT"


_START_OVER = "delete it (a {resume} then starts the run over) or rerun with {force}"  # a SettingError template


@contextmanager
def damaged_checkpoint(path: Path) -> Iterator[None]:
    """Turn what a damaged checkpoint raises while it is restored (a missing entry, a value of the
    wrong type or shape) into one line naming it."""
    try:
        yield
    except NascompressError:
        raise
    except KeyError as e:
        raise SettingError(f"checkpoint {path} is damaged: it lacks {e}; {_START_OVER}") from None
    except (TypeError, ValueError, RuntimeError, IndexError) as e:
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SettingError(f"checkpoint {path} is damaged ({why}); {_START_OVER}") from None


def restore_model(model: nn.Module, sd: Any, path: Path) -> None:
    """Load a checkpoint's model state, a tensor missing or of another shape named in one line."""
    if not isinstance(sd, dict):
        raise SettingError(f"checkpoint {path} is damaged: its model state is no tensor dict; {_START_OVER}")
    bad = state_mismatches(model, sd)
    if bad:
        raise SettingError(f"checkpoint {path} is damaged: {mismatch_report(bad)}; {_START_OVER}")
    model.load_state_dict(sd, strict=True)


def checked_int(state: dict[str, Any], key: str) -> int:
    v = state[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"its {key} is {v!r}, not an integer")
    return v


def checked_number(state: dict[str, Any], key: str) -> float:
    v = state[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
        raise TypeError(f"its {key} is {v!r}, not a number")
    return float(v)


def _read_log(path: Path, *, upto: int) -> list[str]:
    """The log lines of epochs <= ``upto`` (lines of an interrupted epoch are dropped, and so is a
    half-written last line, with a note)."""
    if not path.exists():
        return []
    lines = [ln for ln in read_file_text(path).splitlines() if ln.strip()]
    kept = []
    for i, ln in enumerate(lines):
        try:
            rec = parse_json(ln, source=f"{path} line {i + 1}")
            epoch = rec["epoch"] if isinstance(rec, dict) else None
            if isinstance(epoch, bool) or not isinstance(epoch, int):
                raise NascompressError(f"{path} line {i + 1} has no integer epoch")
        except NascompressError as e:
            if i == len(lines) - 1:  # what a kill during the per-epoch append leaves
                if distributed.is_main():  # shown even without progress lines: a record is dropped
                    print(
                        f"note: dropping the half-written last line of {path} (the run stopped while writing it)",
                        file=sys.stderr,
                        flush=True,
                    )
                break
            raise SettingError(
                f"{e}; {path} is damaged before its last line: delete it (the resumed run starts "
                "a new log) or rerun with {force}"
            ) from None
        if epoch <= upto:
            kept.append(ln)
    return kept


class RunStore:
    """Where a training run keeps its saved model, its log and its checkpoint: a run directory
    (rank 0 writes it) or, without one, memory (the saved weights as a copy of the state)."""

    def __init__(self, out_dir: Path | None, log: list[dict[str, Any]] | None):
        self.dir, self.main = out_dir, distributed.is_main()
        self.log = log if log is not None else []
        self.saved: dict[str, torch.Tensor] | None = None  # in memory: the weights model.safetensors would hold

    def start(self, *, resume_from: int | None) -> None:
        """A fresh log, or after a resume the records of the epochs up to ``resume_from``."""
        self.log.clear()
        if self.dir is None or not self.main:
            return
        path = self.dir / LOG_FILE
        for tmp in self.dir.glob(".*.tmp"):  # atomic writes (utils.atomic_path) of a killed run
            tmp.unlink()
        if resume_from is None:
            if path.exists():
                path.unlink()
            return
        lines = _read_log(path, upto=resume_from)
        with atomic_path(path) as tmp:  # a kill meanwhile leaves the log as it was, not a part of it
            tmp.write_text("".join(ln + "\n" for ln in lines))
        self.log.extend(json.loads(ln) for ln in lines)  # checked by _read_log

    def record(self, rec: dict[str, Any]) -> None:
        self.log.append(rec)
        if self.dir is not None and self.main:
            append_jsonl(self.dir / LOG_FILE, rec)

    def save(self, model: nn.Module, arch: dict[str, Any], *, last: bool = False) -> None:
        if self.dir is None:
            if not last:
                self.saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
        elif self.main:
            save_model(self.dir, model, arch, **({"filename": LAST_FILE} if last else {}))

    def checkpoint(self, state: dict[str, Any]) -> None:
        if self.dir is not None and self.main:
            save_state(self.dir / CHECKPOINT_FILE, state)
            kill = os.environ.get(TEST_KILL_ENV)
            if kill and kill == f"{self.dir.name}:{state['epoch'] + 1}":
                os.kill(os.getpid(), signal.SIGKILL)  # the kill -9 tests' hook (the module docstring)

    def saved_model(self, model: nn.Module, device: torch.device) -> nn.Module:
        """The saved model: read back from the directory, or ``model`` given the saved weights."""
        if self.dir is not None:
            return load_with_arch(self.dir, map_location=device, complete=False)[0]  # not marked complete yet
        if self.saved is not None:
            model.load_state_dict(self.saved)
        return model
