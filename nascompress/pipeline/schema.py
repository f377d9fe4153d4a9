"""The pipeline file's schema engine: frozen sections whose fields carry their own checks
(:func:`opt` metadata), built from YAML by :func:`build_section`, which names the key path in every error
(a :class:`ConfigError`: the keys it names are data, :class:`Key`, that a front end words its own way)."""

from __future__ import annotations

import dataclasses
import math
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..config import Config, check_meta, check_value, offered, settings_class, value_kind
from ..errors import NascompressError, SettingError
from ..yaml_io import shipped_path
from ..yaml_io import shown


@dataclass(frozen=True)
class Key:
    """A key of the config that an error names: its ``path`` (``stages.dcs.epochs``; a section's,
    ``stages.dcs``), data rather than text."""

    path: str


class ConfigError(NascompressError):
    """An error of a pipeline config: its message as text and the keys it names (:class:`Key`), so a
    front end names them its own way (:meth:`worded`; ``nc.compress`` names ``stages.dcs.epochs`` as
    its argument ``dcs['epochs']``); ``str()`` names them as the file does, by their key paths."""

    def __init__(self, *parts: str | Key):
        self.parts = parts
        super().__init__(self.worded())

    @property
    def keys(self) -> tuple[str, ...]:
        """The key paths the message names, in order."""
        return tuple(p.path for p in self.parts if isinstance(p, Key))

    def worded(self, name: Callable[[str], str] = str) -> str:
        """The message with every key named by ``name(its path)`` (default: the path)."""
        return "".join(name(p.path) if isinstance(p, Key) else p for p in self.parts)


class KeyProblem(NascompressError):
    """A problem with one key of a section (``key`` relative to the section)."""

    def __init__(self, key: str, msg: str):
        super().__init__(msg)
        self.key = key


def opt(
    default: Any = dataclasses.MISSING,
    *,
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
    hi_open: bool = False,
    choices: tuple[Any, ...] | None = None,
    path: bool = False,
    keywords: tuple[str, ...] = (),
) -> Any:
    """A field with checks: a number range, choices, or a path (resolved against the config's
    directory unless it is one of ``keywords``)."""
    return field(
        default=default,
        metadata=check_meta(
            lo=lo, hi=hi, lo_open=lo_open, hi_open=hi_open, choices=choices, path=path, keywords=keywords
        ),
    )


class Section(Config):
    """A section of the pipeline file; YAML key names may differ from field names (``import``)."""

    _yaml_names: typing.ClassVar[dict[str, str]] = {}  # field name -> YAML key
    # a former YAML key -> (its new key, {former value: new value} or None when the values are the same)
    renamed: typing.ClassVar[dict[str, tuple[str, dict[Any, Any] | None]]] = {}

    # a key this section does not take but a user may write here (a command's option of the same
    # stage) -> where it goes, e.g. ``{"train_limit": "write train_images (...)"}``
    elsewhere: typing.ClassVar[dict[str, str]] = {}

    @classmethod
    def keys(cls) -> dict[str, str]:
        """YAML key -> field name, in declaration order."""
        return {cls._yaml_names.get(f.name, f.name): f.name for f in dataclasses.fields(cls)}

    def to_dict(self) -> dict[str, Any]:
        """The normalized mapping (YAML names; absent optional sections left out)."""
        hints = typing.get_type_hints(type(self))
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is None and _section_type(hints[f.name]) is not None:
                continue
            out[self._yaml_names.get(f.name, f.name)] = v.to_dict() if isinstance(v, Section) else v
        return out


def library_keys(*specs: Any, lead: tuple[str, ...] = ()) -> Any:
    """Class decorator, under ``@dataclass``: a key for every user-facing field of the library configs
    ``specs`` (:func:`nascompress.config.setting`: its type, its user default and the checks in its
    metadata), so the section does not declare them again. A spec is a config class (all its
    user-facing fields) or a :class:`~nascompress.config.StageSettings` (the fields one stage offers,
    with that stage's defaults). Key order: ``lead``, the section's own keys, then the rest of the
    library keys (spec by spec, in field order)."""

    def deco(cls: type) -> type:
        own = dict(cls.__dict__.get("__annotations__", {}))
        added: dict[str, Any] = {}
        for spec in specs:
            hints = typing.get_type_hints(settings_class(spec))
            for f, default, _ in offered(spec):
                if f.name in own or f.name in added:
                    raise TypeError(f"{cls.__name__}: key {f.name} declared twice")
                tp = hints[f.name]
                added[f.name] = typing.Optional[tp] if default is None else tp  # null: the stage's default
                setattr(cls, f.name, field(default=default, metadata=dict(f.metadata)))
        merged = {**own, **added}
        order = [*lead, *(n for n in merged if n not in lead)]
        cls.__annotations__ = {n: merged[n] for n in order}
        return cls

    return deco


def library_values(section: Any, spec: Any) -> dict[str, Any]:
    """The section's values of the user-facing fields ``spec`` offers (see :func:`library_keys`)."""
    return {f.name: getattr(section, f.name) for f, _, _ in offered(spec)}


def library_config(section: Any, spec: Any, **extra: Any) -> Any:
    """The library config of ``spec`` built from the section's keys that are its user-facing fields,
    plus ``extra``."""
    return settings_class(spec)(**{**library_values(section, spec), **extra})


def _section_type(tp: Any) -> type[Section] | None:
    for a in (tp, *typing.get_args(tp)):
        if isinstance(a, type) and issubclass(a, Section):
            return a
    return None


def describe_value(v: Any) -> str:
    """A value of the file as a message shows it: a mapping or a list by its kind, anything else as
    :func:`~nascompress.yaml_io.shown` shows it (a long text by its size, never quoted)."""
    if isinstance(v, dict):
        return "a mapping"
    if isinstance(v, list):
        return "a list"
    return shown(v)


@dataclass(frozen=True)
class SchemaContext:
    source: str  # the config file, as named in messages
    base_dir: Path  # relative paths are resolved against it

    def err(self, path: str, *msg: str | Key) -> ConfigError:
        """The error of the key at ``path`` ("": of the whole config): ``msg``, its text and the keys it names."""
        return self.error(Key(path), ": ", *msg) if path else self.error(*msg)

    def error(self, *parts: str | Key) -> ConfigError:
        """An error of the config (named by its ``source``): ``parts``, its text and the keys it names."""
        return ConfigError(f"{self.source}: ", *parts)

    def resolve(self, p: str) -> str:
        q = Path(p).expanduser()
        return os.path.normpath(q if q.is_absolute() else self.base_dir / q)


def section_error(
    ctx: SchemaContext, path: str, section: Any, e: NascompressError, *, names: dict[str, str] | None = None
) -> ConfigError:
    """Error ``e``, raised by a stage's library while building the job of ``section`` (at ``path``),
    as the pipeline file words it: a :class:`~nascompress.errors.SettingError`'s fields named as the
    section's keys (``names``: a field the section sets another way, e.g. retrain's ``teacher``
    through ``distil_from: base``); any other error as it is."""
    if not isinstance(e, SettingError):
        return ctx.err(path, str(e))
    keys = {**{name: key for key, name in type(section).keys().items()}, **(names or {})}
    return ctx.err(path, e.worded(lambda f: keys.get(f, f)))


def key_path(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _coerce(v: Any, tp: Any, meta: dict[str, Any], path: str, ctx: SchemaContext) -> Any:
    args = typing.get_args(tp)
    optional = type(None) in args
    sub = _section_type(tp)
    if sub is not None:
        return build_section(sub, {} if v is None else v, path, ctx)  # `train:` with nothing under it: defaults
    if v is None:
        if optional:
            return None
        raise ctx.err(path, "must not be empty")
    if meta.get("words"):  # a number or one of its words (align: 16, align: auto): the setting's one check
        try:
            return check_value("", v, meta, value_kind(tp, meta)[0])
        except NascompressError as e:
            raise ctx.err(path, str(e)) from None
    kinds = [a for a in args if a is not type(None)]
    if len(kinds) > 1:  # e.g. export.batch: str | int (the library config checks which values it takes)
        if isinstance(v, bool) or not isinstance(v, tuple(kinds)):
            names = {str: "a string", int: "an integer", float: "a number"}
            raise ctx.err(
                path, f"must be {' or '.join(names.get(k, k.__name__) for k in kinds)}, got {describe_value(v)}"
            )
        kinds = []
    base = kinds[0] if kinds else (tp if not args else None)
    if base is bool:
        if not isinstance(v, bool):
            raise ctx.err(path, f"must be true or false, got {describe_value(v)}")
    elif base is int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ctx.err(path, f"must be an integer, got {describe_value(v)}")
    elif base is float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ctx.err(path, f"must be a number, got {describe_value(v)}")
        v = float(v)
        if not math.isfinite(v):
            raise ctx.err(path, f"must be a finite number, got {v!r}")
    elif base is str:
        if not isinstance(v, str) or not v.strip():
            raise ctx.err(path, f"must be a non-empty string, got {describe_value(v)}")
    try:  # the range, choices and limit: the one check of a declared setting (nascompress.config)
        check_value("", v, meta, base if base in (int, float) else None)
    except NascompressError as e:
        raise ctx.err(path, str(e)) from None
    if meta.get("path") and v not in meta.get("keywords", ()):
        found = ctx.resolve(v)
        named = shipped_path(meta["shipped"], v) if meta.get("shipped") else None
        v = str(named) if named is not None and not os.path.isfile(found) else found  # a shipped name: its file
    return v


def build_section(cls: type[Section], data: Any, path: str, ctx: SchemaContext) -> Any:
    """Build section ``cls`` from a YAML mapping; every error names the key path."""
    if not isinstance(data, dict):
        raise ctx.err(path, f"must be a mapping of settings, got {describe_value(data)}")
    keys = cls.keys()
    for k in data:
        if k in cls.renamed and k not in keys:
            new, values = cls.renamed[k]
            choices = next(f for f in dataclasses.fields(cls) if f.name == new).metadata.get("choices")
            what = f"{new}: {' | '.join(map(str, choices))}" if choices else new
            then = "; " + ", ".join(f"{k}: {str(a).lower()} is {b}" for a, b in values.items()) if values else ""
            raise ctx.error("key ", Key(key_path(path, str(k))), f" was renamed; write {what}{then}")
        if k not in keys:
            hint = f": {cls.elsewhere[k]}" if k in cls.elsewhere else ""
            raise ctx.error("unknown key ", Key(key_path(path, str(k))), f"{hint}; valid: {', '.join(keys)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    for key, name in keys.items():
        f = fields[name]
        if key not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:  # type: ignore[misc]
                raise ctx.err(key_path(path, key), "required")
            continue
        values[name] = _coerce(data[key], hints[name], dict(f.metadata), key_path(path, key), ctx)
    try:
        return cls(**values)
    except KeyProblem as e:
        raise ctx.err(key_path(path, e.key), str(e)) from None
    except NascompressError as e:
        raise ctx.err(path, str(e)) from None


def upgrade_keys(cls: type[Section], data: Any) -> Any:
    """``data`` (a section's YAML mapping, nested sections included) with every former key of
    ``cls.renamed`` written under its new name and value: how a run's stored config written by an
    earlier version is read (a user's file with a former key is refused, naming the new one)."""
    if not isinstance(data, dict):
        return data
    hints = typing.get_type_hints(cls)
    names = cls.keys()
    out = {}
    for k, v in data.items():
        if k in cls.renamed and k not in names:
            k, values = cls.renamed[k]
            v = values.get(v, v) if values and not isinstance(v, (dict, list)) else v
        sub = _section_type(hints[names[k]]) if k in names else None
        out[k] = upgrade_keys(sub, v) if sub is not None else v
    return out


def check_one_of(section: Any, names: dict[str, str], what: str) -> None:
    given = [key for name, key in names.items() if getattr(section, name) is not None]
    if len(given) != 1:
        raise NascompressError(
            f"give exactly one of {', '.join(names.values())}{what}; got {', '.join(given) if given else 'none'}"
        )


def check_lr_pair(section: Any) -> None:
    if section.lr is not None and section.base_lr is not None:
        raise KeyProblem("base_lr", "give lr (absolute peak) or base_lr (per 512 images), not both")
