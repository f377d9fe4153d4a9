"""Reading a YAML file of the user's (a pipeline, a search space) with the strict loader
(:class:`~nascompress.config.StrictYamlLoader`): a missing, unreadable or invalid file is one line
naming the file (and the line of a YAML error)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from .config import StrictYamlLoader
from .errors import NascompressError
from .utils import read_file_text


def read_yaml_file(path: str | Path, *, what: str) -> Any:
    """The parsed YAML of ``path`` (not validated); ``what`` names the file in messages
    (``config file``, ``search space``)."""
    path = Path(path)
    text = read_file_text(path, what=what)  # bounded in size (max_file_bytes)
    try:
        return yaml.load(text, Loader=StrictYamlLoader)  # noqa: S506 (a SafeLoader subclass)
    except RecursionError:  # the max_yaml_depth limit raised above what the parser's stack holds
        raise NascompressError(
            f"{path}: nested too deeply for the YAML parser; lower its nesting (or the "
            "NASCOMPRESS_MAX_YAML_DEPTH limit)"
        ) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise NascompressError(f"{path}: not valid YAML{at}: {problem}") from None
