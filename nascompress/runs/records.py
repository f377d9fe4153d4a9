"""Records whose field checks follow their annotations (:class:`TypedRecord`): the results the
library hands on in memory and writes as JSON (the pipeline's summary,
:mod:`nascompress.pipeline.summary`; the measuring jobs' results, :mod:`nascompress.profiling.records`).

A :class:`TypedRecord` is a :class:`~nascompress.runs.files.Record` (typed fields, any other key
kept as it is in ``extra``, the key order kept) whose ``CHECKS`` are derived from its annotations
(:func:`_check_for`) the first time one is read; :meth:`TypedRecord.new` builds one in memory,
its keys in the order given, null values included, so ``r.to_dict()`` is the dict of the same keys.
"""

from __future__ import annotations

import types
import typing
from dataclasses import fields
from typing import Any, Callable, ClassVar

from ..errors import NascompressError
from .files import Record, as_is, check_map, check_number, check_str, optional, plain


def _bool(v: Any, where: str) -> bool:
    if not isinstance(v, bool):
        raise NascompressError(
            f"{where} must be a boolean, got {type(v).__name__}; the file was damaged or edited: replace it"
        )
    return v


def _records(cls: type[Record]) -> Callable[[Any, str], tuple[Record, ...]]:
    def check(v: Any, where: str) -> tuple[Record, ...]:
        if not isinstance(v, list):
            raise NascompressError(
                f"{where} must be a list, got {type(v).__name__}; the file was damaged or edited: replace it"
            )
        return tuple(cls.from_dict(x, source=f"{where}[{i}]") for i, x in enumerate(v))

    return check


def _record_map(cls: type[Record]) -> Callable[[Any, str], dict[str, Record]]:
    def check(v: Any, where: str) -> dict[str, Record]:
        return {k: cls.from_dict(x, source=f"{where}: {k}") for k, x in check_map(v, where).items()}

    return check


def _check_for(hint: Any) -> Callable[[Any, str], Any]:
    """The reading check of a field annotated ``hint``: numbers, texts, booleans and records (alone, in a
    tuple or by name in a mapping) are checked, a field annotated ``Any``, a list or a plain mapping is
    kept as it is (a copy); ``X | None`` allows null."""
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        rest = [a for a in args if a is not type(None)]
        inner = _check_for(rest[0]) if len(rest) == 1 else as_is
        return optional(inner) if type(None) in args else inner
    if hint in (int, float):
        return check_number
    if hint is str:
        return check_str
    if hint is bool:
        return _bool
    if isinstance(hint, type) and issubclass(hint, Record):
        return lambda v, where: hint.from_dict(v, source=where)
    origin = typing.get_origin(hint)
    item = args[0] if origin is tuple and args[1:] == (Ellipsis,) else args[1] if len(args) == 2 else None
    if not (isinstance(item, type) and issubclass(item, Record)):
        return as_is
    return _records(item) if origin is tuple else _record_map(item)


class TypedRecord(Record):
    """A record whose ``CHECKS`` follow its annotations (:func:`_check_for`)."""

    NEW_SOURCE: ClassVar[str] = "the {name} record"  # how :meth:`new` names the record in a message

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._checks_done = False

    @classmethod
    def from_dict(cls, d: Any, *, source: str) -> Any:
        if not cls.__dict__.get("_checks_done"):  # the annotations resolve once every record is defined
            hints = typing.get_type_hints(cls)
            cls.CHECKS = {f.name: _check_for(hints[f.name]) for f in fields(cls) if f.name not in ("extra", "order")}
            cls._checks_done = True
        return super().from_dict(d, source=source)

    @classmethod
    def new(cls, **values: Any) -> Any:
        """A record of ``values`` (typed fields and other keys; a part given as a record or as its dict),
        written in the order given, null values included (as the dict of the same keys would be), and
        checked as the file is when read."""
        return cls.from_dict({k: plain(v) for k, v in values.items()}, source=cls.NEW_SOURCE.format(name=cls.__name__))


__all__ = ["TypedRecord"]
