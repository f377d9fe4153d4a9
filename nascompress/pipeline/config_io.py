"""Reading and writing pipeline files: :func:`read_yaml`, :func:`load_config` (validated),
:func:`dump_config` (the normalized ``OUT/config.yaml``) and :func:`config_diff` (how two configs differ)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import yaml

from .schema import build_section, SchemaContext, key_path, upgrade_keys
from .sections import PipelineConfig
from .stage import config_class
from ..yaml_io import resolve_file
from ..yaml_io import read_yaml_file


def read_yaml(path: str | Path) -> Any:
    """The parsed pipeline file (not validated yet): a mapping; a missing, unreadable or invalid one,
    or one that is no mapping, is one line naming the file (never quoting it)."""
    return read_yaml_file(path, what="config file", mapping="a mapping of sections (format, data, base, goal, stages)")


# a pipeline file, a shipped config's name, its sections as data, or the typed config read from them
PipelineSource = str | Path | Mapping[str, Any] | PipelineConfig


def given_as_data(config: PipelineSource) -> bool:
    """Whether ``config`` is no file: its sections as data, or the typed config (the Python API's)."""
    return isinstance(config, (Mapping, PipelineConfig))


def config_context(config: PipelineSource, *, source: str = "the pipeline config") -> SchemaContext:
    """How a config's errors are named and its relative paths resolved: a file's by its path and
    against its folder (``configs/x.yaml``: the link's folder); sections given as data (the Python API)
    by ``source`` and against the working directory (a typed config: its paths resolved already)."""
    if given_as_data(config):
        return SchemaContext(source, Path.cwd())
    path = resolve_file(config, what="config file")  # a path, or a shipped config's name (fashion-mnist)
    return SchemaContext(str(path), Path(os.path.abspath(path)).parent)


def load_config(
    config: PipelineSource, *, seed: int | None = None, upgrade: bool = False, source: str = "the pipeline config"
) -> PipelineConfig:
    """Read and validate a pipeline config (schema only: types, ranges, unknown keys): a file, or its
    sections as data (named ``source`` in errors; a typed config is returned as it is, validated when
    it was read); ``seed`` overrides the config's; ``upgrade``: former
    key names read as their new ones (a run's stored config), else refused. Errors name the file (or
    ``source``) and the key path."""
    return read_config(config, config_context(config, source=source), seed=seed, upgrade=upgrade)


def read_config(
    config: PipelineSource, ctx: SchemaContext, *, seed: int | None = None, upgrade: bool = False
) -> PipelineConfig:
    """:func:`load_config` with the config's context already made (:func:`config_context`)."""
    if isinstance(config, PipelineConfig):  # read (and validated) already: with another seed, read again
        if seed is None:
            return config
        config = config.to_dict()
    data = dict(config) if isinstance(config, Mapping) else read_yaml(ctx.source)
    if seed is not None:
        data = dict(data, seed=seed)
    cls = config_class()  # PipelineConfig with the registered stages' sections
    return build_section(cls, upgrade_keys(cls, data) if upgrade else data, "", ctx)


def dump_config(cfg: PipelineConfig) -> str:
    head = (
        "# nascompress pipeline: the validated config of this run (defaults filled in, paths absolute).\n"
        "# Rerun (resumes where it stopped): nascompress pipeline THIS_FILE --out THIS_DIRECTORY\n"
    )
    return head + yaml.safe_dump(cfg.to_dict(), sort_keys=False, default_flow_style=False)


def config_diff(a: Any, b: Any, path: str = "") -> list[tuple[str, Any, Any]]:
    """Where the configs (their plain data) ``a`` and ``b`` differ: ``(key path, value in a, value in
    b)`` for each leaf, in ``a``'s key order (``<absent>``: a key one of them lacks; path "": the whole
    file)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in list(a) + [k for k in b if k not in a]:
            out += config_diff(a.get(k, "<absent>"), b.get(k, "<absent>"), key_path(path, str(k)))
        return out
    return [] if a == b else [(path, a, b)]
