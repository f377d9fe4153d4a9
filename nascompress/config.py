"""One config style for every method and job: frozen dataclasses, validated in ``__post_init__``,
round-tripped through plain dicts (JSON) with :class:`Config`.

``Config.from_dict`` rejects unknown keys (naming them and the valid ones), builds nested config
fields from their type annotations and turns JSON lists back into tuples where a field is a tuple.
Validation errors are :class:`~nascompress.errors.NascompressError` (one line for the user).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from functools import lru_cache
from typing import Any, Callable, Mapping, TypeVar

from .errors import NascompressError, SettingError, literal
from .limits import check_limited

C = TypeVar("C", bound="Config")


@lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _dataclass_type(tp: Any) -> type | None:
    """The dataclass inside an annotation (``X``, ``X | None``, ``Optional[X]``), if any."""
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return tp
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        for a in typing.get_args(tp):
            if isinstance(a, type) and dataclasses.is_dataclass(a):
                return a
    return None


def _is_tuple(tp: Any) -> bool:
    if typing.get_origin(tp) is tuple:
        return True
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return any(typing.get_origin(a) is tuple for a in typing.get_args(tp))
    return False


class Config:
    """Mixin for frozen dataclasses: ``to_dict``, strict ``from_dict``, ``replace``."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            if isinstance(v, Config):
                v = v.to_dict()
            elif dataclasses.is_dataclass(v):
                v = dataclasses.asdict(v)
            elif isinstance(v, tuple):
                v = list(v)
            elif isinstance(v, dict):
                v = dict(v)
            out[f.name] = v
        return out

    @classmethod
    def from_dict(cls: type[C], d: dict[str, Any] | None, *, what: str | None = None) -> C:
        d = dict(d or {})
        names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
        unknown = sorted(set(d) - set(names))
        if unknown:
            label = what or getattr(cls, "config_name", cls.__name__)
            raise NascompressError(
                f"unknown {label} setting(s) {', '.join(map(str, unknown))}; valid: {', '.join(names)}"
            )
        hints = _hints(cls)
        for k, v in list(d.items()):
            sub = _dataclass_type(hints.get(k))
            if sub is not None and isinstance(v, dict):
                d[k] = sub.from_dict(v) if issubclass(sub, Config) else sub(**v)
            elif isinstance(v, list) and _is_tuple(hints.get(k)):
                d[k] = tuple(v)
        return cls(**d)

    def replace(self: C, **changes: Any) -> C:
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]


# ---------------------------------------------------------------------------------------------
# User-facing settings: one declaration that the CLI and the pipeline file read


def check_meta(
    *,
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
    hi_open: bool = False,
    choices: tuple[Any, ...] | None = None,
    path: bool = False,
    keywords: tuple[str, ...] = (),
    limit: str | None = None,
    shipped: str | None = None,
    words: tuple[str, ...] = (),
) -> dict[str, Any]:
    """The checks a field's metadata carries for the pipeline file: a number range, choices, a
    path (resolved against the config's directory unless it is one of ``keywords``; ``shipped``: the
    kind of :mod:`nascompress.yaml_io` file a name that is no such path means, ``search space``),
    a limit of :mod:`nascompress.limits` (its name) the value must not exceed, or ``words``: the
    words a number setting also takes (annotated ``int | str``: ``align`` is a positive integer or
    ``auto``; the range applies to the number, the messages list both)."""
    return {
        "lo": lo,
        "hi": hi,
        "lo_open": lo_open,
        "hi_open": hi_open,
        "choices": choices,
        "path": path,
        "keywords": keywords,
        "limit": limit,
        "shipped": shipped,
        "words": words,
    }


def setting(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
    hi_open: bool = False,
    choices: tuple[Any, ...] | None = None,
    path: bool = False,
    keywords: tuple[str, ...] = (),
    flag: str | None = None,
    option: str | None = None,
    limit: str | None = None,
    shipped: str | None = None,
    words: tuple[str, ...] = (),
) -> Any:
    """A config field a user sets (``search dcs`` options, ``stages.dcs`` keys): its ``help`` (the CLI
    option's), the range, ``choices`` or ``path`` the pipeline file checks (the same metadata as
    :func:`nascompress.pipeline.schema.opt`), ``flag``: the CLI flag of a bool that defaults to True
    (``--no-...``, whose help ``help`` is), ``option``: the CLI option where it is not ``--name``
    (``--max-latency`` of ``max_latency_ms``), ``limit``: the limit of
    :mod:`nascompress.limits` the value must not exceed (checked by the pipeline file and
    :func:`nascompress.limits.check_limited`), ``words``: the words a number setting also takes
    (its annotation ``int | str``; the CLI option takes text, ``--align 16`` or ``--align auto``)."""
    meta: dict[str, Any] = {
        "help": help,
        **check_meta(
            lo=lo,
            hi=hi,
            lo_open=lo_open,
            hi_open=hi_open,
            choices=choices,
            path=path,
            keywords=keywords,
            limit=limit,
            shipped=shipped,
            words=words,
        ),
    }
    if flag is not None:
        meta["flag"] = flag
    if option is not None:
        meta["option"] = option
    return dataclasses.field(default=default, metadata=meta)


def shared(cls: type, name: str, *, default: Any = dataclasses.MISSING) -> Any:
    """A field that is setting ``name`` of config ``cls`` again (the same checks and help, and the
    same default unless a ``default`` of its own is given: a pipeline section's own choice): another
    job's field with that meaning, still declared once (``ImportJob.eval_batch_size``)."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return dataclasses.field(default=f.default if default is dataclasses.MISSING else default, metadata=f.metadata)


def user_settings(cls: type) -> list[dataclasses.Field]:
    """The fields of config class ``cls`` declared with :func:`setting` (those with a ``help``), in order."""
    return [f for f in dataclasses.fields(cls) if f.metadata.get("help")]


def setting_help(cls: type, name: str) -> str:
    """The help text of field ``name`` of ``cls``."""
    return next(f.metadata["help"] for f in dataclasses.fields(cls) if f.name == name)


@dataclasses.dataclass(frozen=True)
class StageSettings:
    """The user-facing fields of library config ``cls`` that one stage offers (its CLI command's
    options and its pipeline section's keys, in ``names``' order) and their defaults there.
    ``recipe``: the stage's own instance of ``cls`` (``nascompress train``'s is ``TrainConfig()``,
    the DCS search's, retrain's and the fine-tunes' are named instances declared next to the stage),
    whose values are the stage's defaults; None: ``cls``'s dataclass defaults. ``no_default``: the
    fields offered without one (None: the stage decides when it builds its job, from the other
    settings or the data, e.g. the batch size from the training images); ``notes``: what that
    default is, added to the option's help. A stage's defaults are never written anywhere else."""

    cls: type
    names: tuple[str, ...]
    recipe: Any = None
    no_default: tuple[str, ...] = ()
    notes: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        known = {f.name for f in user_settings(self.cls)}
        bad = [n for n in (*self.names, *self.no_default, *self.notes) if n not in known or n not in self.names]
        if bad:
            raise TypeError(f"{self.cls.__name__}: {', '.join(bad)} not among the offered user settings")
        if self.recipe is not None and not isinstance(self.recipe, self.cls):
            raise TypeError(f"{self.cls.__name__}: the recipe is a {type(self.recipe).__name__}")

    def default(self, f: dataclasses.Field) -> Any:
        """The stage's default of offered field ``f`` (:class:`dataclasses.MISSING`: a required one)."""
        if f.name in self.no_default:
            return None
        return f.default if self.recipe is None else getattr(self.recipe, f.name)


def settings_class(spec: type | StageSettings) -> type:
    """The library config class of ``spec`` (a config class, or a :class:`StageSettings`' class)."""
    return spec.cls if isinstance(spec, StageSettings) else spec


def offered(spec: type | StageSettings) -> list[tuple[dataclasses.Field, Any, str]]:
    """``(field, default, help)`` of every setting ``spec`` offers: a config class's user-facing
    fields (:func:`user_settings`) with their defaults (the user's: a config's defaults are its
    CLI command's and pipeline section's), or a :class:`StageSettings`' fields with the stage's
    defaults and notes."""
    if not isinstance(spec, StageSettings):
        return [(f, f.default, f.metadata["help"]) for f in user_settings(spec)]
    fields = {f.name: f for f in user_settings(spec.cls)}
    out = []
    for name in spec.names:
        f, note = fields[name], spec.notes.get(name)
        out.append((f, spec.default(f), f"{f.metadata['help']} {note}" if note else f.metadata["help"]))
    return out


# ---------------------------------------------------------------------------------------------
# Small validators shared by the configs (one message style: the setting, the rule, the value)


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _must(name: str, rule: str) -> str:
    """``"NAME must RULE"``, or ``"must RULE"`` without a name (the pipeline file puts the key path first)."""
    return f"{name} must {rule}" if name else f"must {rule}"


def check_range(
    name: str, v: Any, lo: float | None = None, hi: float | None = None, *, lo_open: bool = False, hi_open: bool = False
) -> float:
    """``v`` must be a finite number in the given interval; returns it as a float."""
    ok = is_number(v) and math.isfinite(v)
    if ok and lo is not None:
        ok = v > lo if lo_open else v >= lo
    if ok and hi is not None:
        ok = v < hi if hi_open else v <= hi
    if not ok:
        left = "(" if lo_open else "["
        right = ")" if hi_open else "]"
        span = f"{left}{'-inf' if lo is None else f'{lo:g}'}, {'inf' if hi is None else f'{hi:g}'}{right}"
        finite = "a finite number " if is_number(v) and not math.isfinite(v) else ""
        raise NascompressError(_must(name, f"be {finite}in {span}, got {v!r}"))
    return float(v)


def check_int(name: str, v: Any, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or (lo is not None and v < lo) or (hi is not None and v > hi):
        span = f"[{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}]"
        raise NascompressError(_must(name, f"be an integer in {span}, got {v!r}"))
    return v


def check_choice(name: str, v: Any, choices: typing.Sequence[Any]) -> Any:
    if v not in choices:
        raise NascompressError(_must(name, f"be one of {', '.join(map(str, choices))}, got {v!r}"))
    return v


def check_bool(name: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise NascompressError(_must(name, f"be true or false, got {v!r}"))
    return v


def value_kind(tp: Any, meta: Mapping[str, Any] | None = None) -> tuple[type | None, bool]:
    """(the one value type of annotation ``tp``: bool, int, float, str or None for anything else,
    whether None is allowed). A setting with ``words`` in its metadata (``meta``; ``int | str``):
    its number type, the words being its other values."""
    args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    kinds = [a for a in args if a is not type(None)]
    if meta and meta.get("words"):
        kinds = [a for a in kinds if a is not str]
    base = kinds[0] if len(kinds) == 1 and kinds[0] in (bool, int, float, str) else None
    return base, type(None) in args


def tuple_item_type(tp: Any) -> type | None:
    """The number type of a ``tuple[int, ...]`` / ``tuple[float, ...]`` annotation (or of one in a
    union: a setting of one value per layer), else None."""
    args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    items = [typing.get_args(a)[0] for a in args if typing.get_origin(a) is tuple and typing.get_args(a)]
    return items[0] if items and items[0] in (int, float) else None


def _int_bounds(meta: Mapping[str, Any]) -> tuple[int | None, int | None]:  # open ends made closed
    lo, hi = meta.get("lo"), meta.get("hi")
    lo_i = None if lo is None else math.floor(lo) + 1 if meta.get("lo_open") else math.ceil(lo)
    hi_i = None if hi is None else math.ceil(hi) - 1 if meta.get("hi_open") else math.floor(hi)
    return lo_i, hi_i


def _number_rule(meta: Mapping[str, Any], kind: type | None) -> str:
    """What a number setting takes, in words: ``a positive integer``, ``an integer in [2, 8]``,
    ``a number in (0, 1]``."""
    if kind is int:
        lo, hi = _int_bounds(meta)
        if hi is None and lo in (0, 1):
            return "a positive integer" if lo == 1 else "a non-negative integer"
        return f"an integer in [{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}]"
    lo, hi = meta.get("lo"), meta.get("hi")
    left, right = "(" if meta.get("lo_open") else "[", ")" if meta.get("hi_open") else "]"
    return f"a number in {left}{'-inf' if lo is None else f'{lo:g}'}, {'inf' if hi is None else f'{hi:g}'}{right}"


def check_value(name: str, v: Any, meta: Mapping[str, Any], kind: type | None) -> Any:
    """The one check of a declared setting's value (``meta``: the :func:`setting` / :func:`check_meta`
    metadata; ``kind``: its value type, bool, int, float, str or None): the type, the range (an
    integer range for an int), the choices and the limit; a setting with ``words`` takes one of
    them, or a number as ``kind`` in its range (refused naming both: ``must be a positive integer or
    auto``). ``name`` starts the message (the CLI option; empty: the pipeline file prefixes its key
    path). Returns ``v``."""
    words = tuple(meta.get("words") or ())
    if words:
        if isinstance(v, str) and v in words:
            return v
        number = {**meta, "words": (), "limit": None, "choices": None}
        try:  # the type and range, refused naming the words too; then the limit and choices as ever
            check_value(name, v, number, kind)
        except NascompressError:
            rule = f"{_number_rule(meta, kind)} or {' or '.join(words)}"
            raise NascompressError(_must(name, f"be {rule}, got {v!r}")) from None
        return check_value(name, v, {**meta, "words": ()}, kind)
    lo, hi = meta.get("lo"), meta.get("hi")
    if kind is bool:
        check_bool(name, v)
    elif kind is int:
        check_int(name, v, *_int_bounds(meta))
    elif kind is float or lo is not None or hi is not None:
        check_range(name, v, lo, hi, lo_open=bool(meta.get("lo_open")), hi_open=bool(meta.get("hi_open")))
    if meta.get("limit"):
        check_limited(name or "the value", v, meta["limit"])
    if meta.get("choices"):
        check_choice(name, v, meta["choices"])
    return v


def option_name(f: dataclasses.Field) -> str:
    """The CLI option of setting ``f`` (``--name`` or its declared ``option``; a True-by-default bool's
    ``flag`` negates the value, so messages name the value's option)."""
    return f.metadata.get("option") or f"--{f.name.replace('_', '-')}"


def field_name(f: dataclasses.Field) -> str:
    """A setting's name in messages where it is a config key (a method's ``keep_rate``), not an option."""
    return f.name


def check_settings(obj: Any, *, name: Callable[[dataclasses.Field], str] | None = None) -> None:
    """Check every declared setting of config ``obj`` (the fields with :func:`setting` or
    :func:`check_meta` metadata) against its declaration (:func:`check_value`); None passes where
    the field's type allows it. Config classes call it first in ``__post_init__``, so a range is
    written once, in the field's declaration. ``name``: a field's name in messages (default: a
    :class:`~nascompress.errors.SettingError` naming the field, which each front end words its own
    way: the CLI as the command's option, ``--name``)."""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        if "lo" not in f.metadata:  # not a declared setting
            continue
        v = getattr(obj, f.name)
        kind, optional = value_kind(hints[f.name], f.metadata)
        if v is None and optional:
            continue
        item = tuple_item_type(hints[f.name])
        if item is not None and isinstance(v, tuple):  # one value per layer / threshold: each checked
            for x in v:
                _check_setting(f, x, item, name)
            continue
        _check_setting(f, v, kind, name)


def _check_setting(
    f: dataclasses.Field, v: Any, kind: type | None, name: Callable[[dataclasses.Field], str] | None
) -> None:
    if name is not None:
        check_value(name(f), v, f.metadata, kind)
        return
    check_field(f.name, check_value, v, f.metadata, kind)


def check_field(field: str, check: Callable[..., Any], v: Any, *args: Any) -> None:
    """``check(name, v, *args)`` (:func:`check_value`, :func:`check_int`, ...) refusing ``v`` in a
    :class:`~nascompress.errors.SettingError` that names ``field`` (worded by each front end)."""
    try:
        check("\0", v, *args)
    except SettingError:
        raise
    except NascompressError as e:  # the message names the field as a template does: {field}
        raise SettingError(literal(str(e)).replace("\0", "{%s}" % field)) from None


__all__ = [
    "Config",
    "check_meta",
    "setting",
    "user_settings",
    "setting_help",
    "shared",
    "StageSettings",
    "settings_class",
    "offered",
    "check_range",
    "check_int",
    "check_choice",
    "check_bool",
    "is_number",
    "check_value",
    "value_kind",
    "check_settings",
    "option_name",
    "field_name",
    "tuple_item_type",
    "check_field",
]
