"""Reading and writing pipeline files: :func:`read_yaml`, :func:`load_config` (validated),
:func:`dump_config` (the normalized ``OUT/config.yaml``) and :func:`config_diff` (how two configs differ)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from .schema import build_section, SchemaContext, key_path, upgrade_keys
from .sections import PipelineConfig
from ..resources import resolve_file
from ..yaml_io import read_yaml_file


def read_yaml(path: str | Path) -> Any:
    """The parsed pipeline file (not validated yet): a mapping; a missing, unreadable or invalid one,
    or one that is no mapping, is one line naming the file (never quoting it)."""
    return read_yaml_file(path, what="config file", mapping="a mapping of sections (format, data, base, goal, stages)")


def load_config(path: str | Path, *, seed: int | None = None, upgrade: bool = False) -> PipelineConfig:
    """Read and validate a pipeline file (schema only: types, ranges, unknown keys); ``seed``
    overrides the file's; ``upgrade``: former key names read as their new ones (a run's stored
    config), else refused. Errors name the file and the key path."""
    path = resolve_file(path, what="config file")  # a path, or a shipped config's name (fashion-mnist)
    data = read_yaml(path)
    ctx = SchemaContext(str(path), Path(os.path.abspath(path)).parent)  # configs/x.yaml: the link's folder
    if seed is not None:
        data = dict(data, seed=seed)
    return build_section(PipelineConfig, upgrade_keys(PipelineConfig, data) if upgrade else data, "", ctx)


def dump_config(cfg: PipelineConfig) -> str:
    head = (
        "# nascompress pipeline: the validated config of this run (defaults filled in, paths absolute).\n"
        "# Rerun (resumes where it stopped): nascompress pipeline THIS_FILE --out THIS_DIRECTORY\n"
    )
    return head + yaml.safe_dump(cfg.to_dict(), sort_keys=False, default_flow_style=False)


def config_diff(a: Any, b: Any, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in list(a) + [k for k in b if k not in a]:
            out += config_diff(a.get(k, "<absent>"), b.get(k, "<absent>"), key_path(path, str(k)))
        return out
    return [] if a == b else [f"{path or '(whole file)'} is {a!r} here but {b!r} there"]
