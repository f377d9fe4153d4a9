"""YAML config files of the user's (pipelines, search spaces): the strict loader
(:class:`StrictYamlLoader`), and reading a file with it: a missing, unreadable, invalid or too large
file is one line naming the file (and the line of a YAML error), never quoting its content
(:func:`shown`: a value as a message shows it).

The files shipped inside the package: the search spaces (``nascompress/search_spaces/*.yaml``) and the
pipeline configs (``nascompress/configs/*.yaml``). A user names one by its file name without ``.yaml``
(``--space evit``, ``nascompress pipeline fashion-mnist``) or gives a path; an existing file always wins
over a shipped name (a folder does not): :func:`resolve_file`. They are package data, so they are found
the same way from a checkout and from an installed wheel (the repository's top-level ``search_spaces/``
and ``configs/`` are links to these folders)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from .errors import NascompressError
from .limits import env_name, limits
from .runs.json_io import read_file_text


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


SHOWN_CHARS = 32  # the longest text a message quotes (a word the user wrote at a key, not a file's content)


def shown(v: Any) -> str:
    """A value read from a file as a message shows it: a number, a bool, a short one-line text or a
    short list of such as written, anything else by its kind (a long text could be the first line
    of whatever file was given: it is never quoted)."""
    if isinstance(v, str) and (len(v) > SHOWN_CHARS or not v.isprintable()):
        return f"a text of {len(v):,} characters"
    if isinstance(v, (dict, list)):
        text = repr(v)
        short = len(text) <= 2 * SHOWN_CHARS and all(
            shown(x) == repr(x) for x in (v.values() if isinstance(v, dict) else v)
        )
        items = f"{len(v):,} item{'' if len(v) == 1 else 's'}"
        return text if short else "a mapping" if isinstance(v, dict) else f"a list of {items}"
    return repr(v)


_VALUES = (yaml.ScalarEvent, yaml.SequenceStartEvent, yaml.MappingStartEvent, yaml.AliasEvent)


def _check_values(text: str, path: Path) -> None:
    """Refuse a file of more values than the ``max_yaml_values`` limit, counted by libyaml's C parser
    (where PyYAML has it) before the strict loader, whose pure-Python reading takes about 50 us a
    value, reads it; a syntax error is left to that loader to report."""
    limit, n = limits().max_yaml_values, 0
    try:
        for event in yaml.parse(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
            n += isinstance(event, _VALUES)
            if n > limit:
                raise NascompressError(
                    f"{path} holds more than {limit:,} values (the max_yaml_values limit): it is no pipeline "
                    f"or search-space file, or lists far too many choices; shorten it (or raise the limit "
                    f"with {env_name('max_yaml_values')}=N if it is intended)"
                )
    except yaml.YAMLError:
        return


def read_yaml_file(path: str | Path, *, what: str, mapping: str | None = None) -> Any:
    """The parsed YAML of ``path`` (not validated); ``what`` names the file in messages
    (``config file``, ``search space``); ``mapping``: what its top level must be, a mapping
    (e.g. ``a mapping of sections (format, ...)``), refused naming the line where it starts."""
    path = Path(path)
    text = read_file_text(path, what=what)  # bounded in size (max_file_bytes)
    _check_values(text, path)
    loader = StrictYamlLoader(text)
    try:
        node = loader.get_single_node()
        data = None if node is None else loader.construct_document(node)
    except RecursionError:  # the max_yaml_depth limit raised above what the parser's stack holds
        raise NascompressError(
            f"{path}: nested too deeply for the YAML parser; lower its nesting (or the "
            "NASCOMPRESS_MAX_YAML_DEPTH limit)"
        ) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or "unreadable"  # (the text of e would quote the file)
        raise NascompressError(f"{path}: not valid YAML{at}: {problem}") from None
    finally:
        loader.dispose()
    if mapping is not None and not isinstance(data, dict):
        at = f"line {node.start_mark.line + 1}" if node is not None else "line 1"
        found = "nothing" if data is None else "a list" if isinstance(data, list) else shown(data)
        raise NascompressError(f"{path}: {at}: expected {mapping}, found {found}; is it a {what}?")
    return data


PACKAGE_DIR = Path(__file__).resolve().parent


FOLDERS = {"search space": PACKAGE_DIR / "search_spaces", "config file": PACKAGE_DIR / "configs"}


def shipped_names(what: str) -> list[str]:
    """The names of the shipped files of kind ``what`` (``search space`` or ``config file``), sorted."""
    return sorted(p.stem for p in FOLDERS[what].glob("*.yaml"))


def shipped_path(what: str, name: str) -> Path | None:
    """The shipped file of kind ``what`` called ``name`` (``evit`` or ``evit.yaml``), None if none is."""
    stem = name.removesuffix(".yaml")
    if not stem or "/" in stem or "\\" in stem or stem.startswith("."):
        return None
    p = FOLDERS[what] / f"{stem}.yaml"
    return p if p.is_file() else None


def resolve_file(value: str | Path, *, what: str) -> Path:
    """The file a user means by ``value``: an existing path as given, else the shipped file of that
    name; neither is one error naming the shipped files."""
    p = Path(value).expanduser()
    if p.is_file():
        return p
    found = shipped_path(what, str(value))
    if found is not None:  # also where a folder of that name is here (pipeline demo --out demo, rerun)
        return found
    if p.exists():
        return p  # not a file: its reader says so
    raise NascompressError(
        f"{what} {value} does not exist: give a YAML file or the name of a shipped "
        f"{what} ({', '.join(shipped_names(what))})"
    )
