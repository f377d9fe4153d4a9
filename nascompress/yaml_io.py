"""YAML config files of the user's (pipelines, search spaces): the strict loader
(:class:`StrictYamlLoader`), and reading a file with it: a missing, unreadable or invalid file is one
line naming the file (and the line of a YAML error)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from .errors import NascompressError
from .limits import env_name, limits
from .utils import read_file_text


class StrictYamlLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys, reads ``1e-3`` as a number (YAML 1.1 wants ``1.0e-3``)
    and refuses nesting deeper than the ``max_yaml_depth`` limit (:mod:`nascompress.limits`; a
    deeper file would exhaust Python's recursion)."""

    _depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        try:
            limit = limits().max_yaml_depth
            if self._depth > limit:
                raise yaml.composer.ComposerError(
                    None,
                    None,
                    f"nested deeper than {limit} levels (the max_yaml_depth limit; raise it with "
                    f"{env_name('max_yaml_depth')}=N if it is intended)",
                    self.peek_event().start_mark,
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _mapping(loader: StrictYamlLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


StrictYamlLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)
StrictYamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?|[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+"
        r"|\.[0-9_]+(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+0123456789."),
)


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
