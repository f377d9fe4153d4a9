"""Where a training run keeps its saved model, its log and its checkpoint (:class:`RunStore`): a run
directory, which rank 0 alone writes, or memory when :func:`nascompress.train.fit` runs without one."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import distributed
from .io import load_with_arch, save_model, save_state
from .utils import append_jsonl

CHECKPOINT_FILE = "checkpoint.safetensors"
LAST_FILE = "last.safetensors"
LOG_FILE = "log.jsonl"


def _read_log(path: Path, *, upto: int) -> list[str]:
    """The log lines of epochs <= ``upto`` (lines of an interrupted epoch are dropped)."""
    if not path.exists():
        return []
    return [ln for ln in path.read_text().splitlines() if ln and int(json.loads(ln)["epoch"]) <= upto]


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
        if resume_from is None:
            if path.exists():
                path.unlink()
            return
        for tmp in self.dir.glob(".*.tmp"):  # atomic writes (utils.atomic_path) of a killed run
            tmp.unlink()
        lines = _read_log(path, upto=resume_from)
        path.write_text("".join(ln + "\n" for ln in lines))
        self.log.extend(json.loads(ln) for ln in lines)

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

    def saved_model(self, model: nn.Module, device: torch.device) -> nn.Module:
        """The saved model: read back from the directory, or ``model`` given the saved weights."""
        if self.dir is not None:
            return load_with_arch(self.dir, map_location=device, complete=False)[0]  # not marked complete yet
        if self.saved is not None:
            model.load_state_dict(self.saved)
        return model
