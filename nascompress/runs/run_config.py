"""A run's ``config.json``, the job its command recorded (:class:`nascompress.runs.run_dir.RunDir`):
:class:`RunConfig`, read and written here only (:func:`find_run_config` / :func:`write_run_config`), and
the dataset a run was made with (:func:`run_data_config`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ..data import DataConfig
from .files import Record, as_is
from .json_io import read_json, write_json


RUN_CONFIG_FILE = "config.json"


@dataclass(frozen=True, kw_only=True)
class RunConfig(Record):
    """A run's ``config.json``: the job its command recorded; its ``data`` section (the dataset) typed,
    the rest (the job's own sections) in ``extra``."""

    data: Any = None

    CHECKS = {"data": as_is}


def find_run_config(run_dir: str | Path) -> RunConfig | None:
    """``run_dir/config.json``, None when the run has none."""
    path = Path(run_dir) / RUN_CONFIG_FILE
    return RunConfig.from_dict(read_json(path), source=str(path)) if path.is_file() else None


def write_run_config(run_dir: str | Path, config: Mapping[str, Any] | RunConfig) -> Path:
    path = Path(run_dir) / RUN_CONFIG_FILE
    write_json(path, config.to_dict() if isinstance(config, RunConfig) else config)
    return path


def run_data_config(run_dir: str | Path) -> DataConfig | None:
    """The DataConfig a run was made with (its config.json ``data`` section), if recorded."""
    cfg = find_run_config(run_dir) if Path(run_dir).is_dir() else None
    return DataConfig(**cfg.data) if cfg is not None and cfg.data else None
