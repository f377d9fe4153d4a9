"""Reading a YAML file of the user's (a pipeline, a search space) with the strict loader
(:class:`~nascompress.config.StrictYamlLoader`): a missing, unreadable or invalid file is one line
naming the file (and the line of a YAML error)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from .config import StrictYamlLoader
from .errors import NascompressError


def read_yaml_file(path: str | Path, *, what: str) -> Any:
    """The parsed YAML of ``path`` (not validated); ``what`` names the file in messages
    (``config file``, ``search space``)."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise NascompressError(f"{what} {path} does not exist") from None
    except OSError as e:
        raise NascompressError(f"cannot read {what} {path}: {e.strerror or e}") from None
    try:
        return yaml.load(text, Loader=StrictYamlLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise NascompressError(f"{path}: not valid YAML{at}: {problem}") from None
