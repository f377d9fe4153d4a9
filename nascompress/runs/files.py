"""The JSON files of a run directory, typed and read and written here only.

- ``arch.json`` (the model format, :mod:`nascompress.runs.io`): :class:`Arch` (format, model spec,
  input spec, labels, method records as :class:`MethodRecord`); :func:`nascompress.runs.io.read_arch`
  gives it for a run directory (also a plain model directory or a weights file), validated in one
  place (:func:`validate_arch`: a damaged file is one NascompressError line);
  :func:`nascompress.runs.io.load_typed` gives it with the model. Records are frozen: a stage that adds a
  decision makes a new one (:meth:`Arch.with_method`, :meth:`Arch.with_labels`, :meth:`Record.set`,
  :meth:`Record.without`), written as the dict edited the same way would be.
- ``metrics.json`` (the completion mark, :func:`nascompress.runs.io.finish_run`, and each stage's
  results): :class:`RunMetrics`, the fields every stage writes typed (``test_top1``, ``val_top1``,
  ``flops_ratio``, ``macs``, ``dense_macs``, ``finished``) and the stage's own in ``extra``;
  :func:`read_metrics` / :func:`find_metrics`.
- an export's sidecar ``FILE.json``: :class:`Sidecar` (its ``quantization``: :class:`Quantization`);
  :func:`read_sidecar`.

The pipeline's own files and a run's ``config.json`` are typed the same way in
:mod:`nascompress.pipeline.files`. Every record keeps the keys it does not type (``extra``) and the
order of the file, so ``Record.from_dict(d).to_dict() == d`` and a file read and written again is
the same bytes.
"""

from __future__ import annotations

import copy
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, ClassVar, Mapping, Sequence

from ..errors import NascompressError
from ..methods import check_records
from ..models.build import ModelSpec, check_model_kwargs, check_model_size, model_size
from .json_io import read_json, write_json

ARCH_FORMAT = "nascompress-arch/2"
# /1: written before the method contract; its new-parameter names differ (io's _upgrade_v1)
READ_FORMATS = ("nascompress-arch/1", ARCH_FORMAT)
ARCH_FILE = "arch.json"
METRICS_FILE = "metrics.json"


def validate_arch(arch: Any, *, source: str) -> dict[str, Any]:
    """Check an arch read from a file: its format, that ``model`` holds a timm name and only the
    build settings nascompress writes (:data:`~nascompress.models.build.MODEL_KWARGS`): the file is data,
    and its settings go to ``timm.create_model``; its input section; and each method record
    (:func:`~nascompress.methods.check_records`: its config, the channels it keeps, ...)."""
    from ..data.input import check_input_section  # lazy: nascompress.data's Splits is a Record of this module

    if not isinstance(arch, dict) or arch.get("format") not in READ_FORMATS or not isinstance(arch.get("model"), dict):
        raise NascompressError(f"{source} is not a nascompress arch (expected format {ARCH_FORMAT!r})")
    model = arch["model"]
    if not isinstance(model.get("name"), str) or set(model) - {"name", "kwargs"}:
        raise NascompressError(
            f'{source}: model must be {{"name": <timm name>, "kwargs": {{...}}}}, got keys {sorted(model)}'
        )
    check_model_kwargs(model.get("kwargs", {}), source=source)
    spec = ModelSpec(model["name"], dict(model.get("kwargs", {})))
    check_model_size(spec, source=source)
    geometry = model_size(spec)  # None: a model nascompress cannot count (a pyramid ViT)
    if geometry is not None:
        geometry["dynamic"] = bool(spec.kwargs.get("dynamic_img_size"))
    check_input_section(arch.get("input"), source=source, model=geometry)
    if not isinstance(arch.setdefault("methods", []), list):
        raise NascompressError(f"{source}: methods must be a list of method records")
    check_records(arch["methods"], source=source)  # each method's record: its config, kept channels, ...
    return arch


# ----------------------------------------------------------------------------------------------
# Typed records: the typed fields, the rest in ``extra``, the file's key order in ``order``.


def _plain(v: Any) -> Any:
    """``v`` as JSON values (records as their dicts, tuples as lists), copied."""
    if isinstance(v, Record):
        return v.to_dict()
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, Mapping):
        return {k: _plain(x) for k, x in v.items()}
    return v


def _number(v: Any, where: str) -> float | int:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise NascompressError(
            f"{where} must be a number, got {type(v).__name__}; the file was damaged or edited: replace it"
        )
    return v


def _kind(kind: type, what: str) -> Callable[[Any, str], Any]:
    def check(v: Any, where: str) -> Any:
        if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
            raise NascompressError(
                f"{where} must be {what}, got {type(v).__name__}; the file was damaged or edited: replace it"
            )
        return copy.deepcopy(v)

    return check


def _optional(check: Callable[[Any, str], Any]) -> Callable[[Any, str], Any]:
    return lambda v, where: None if v is None else check(v, where)


_str, _map, _list, _bool = (
    _kind(str, "a string"),
    _kind(dict, "an object"),
    _kind(list, "a list"),
    _kind(bool, "a boolean"),
)
# the field checks and the JSON values of fields, for records typed beside these (nascompress.pipeline)
check_str, check_map, check_number, optional, plain = _str, _map, _number, _optional, _plain


def as_is(v: Any, where: str) -> Any:
    """A field kept as it is (a copy), for a record whose field has no fixed type."""
    return copy.deepcopy(v)


@dataclass(frozen=True, kw_only=True)
class Record:
    """A JSON object with some fields typed (the subclass's) and the rest kept as they are."""

    extra: Mapping[str, Any] = field(default_factory=dict)  # the keys this record does not type
    order: tuple[str, ...] = field(default=(), repr=False, compare=False)  # the file's key order

    CHECKS: ClassVar[dict[str, Callable[[Any, str], Any]]] = {}  # typed field -> check(value, where) -> value

    @classmethod
    def typed_fields(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls) if f.name not in ("extra", "order"))

    @classmethod
    def from_dict(cls, d: Any, *, source: str) -> Any:
        """The record of the JSON object ``d`` (from ``source``, named in messages)."""
        if not isinstance(d, Mapping):
            raise NascompressError(
                f"{source} must be a JSON object, got {type(d).__name__}; the file was damaged or edited: replace it"
            )
        typed = cls.typed_fields()
        missing = [
            f.name for f in fields(cls) if f.name not in d and f.default is MISSING and f.default_factory is MISSING
        ]
        if missing:
            raise NascompressError(f"{source} has no {missing[0]}; the file was damaged or edited: replace it")
        kwargs = {k: cls.CHECKS[k](d[k], f"{source}: {k}") for k in typed if k in d}
        return cls(**kwargs, extra=copy.deepcopy({k: v for k, v in d.items() if k not in typed}), order=tuple(d))

    def to_dict(self) -> dict[str, Any]:
        """The JSON object: the file's keys in its order, then fields set since (None or empty: left out)."""
        typed = self.typed_fields()
        keys = [
            *self.order,
            *(k for k in typed if k not in self.order and getattr(self, k) not in (None, ())),
            *(k for k in self.extra if k not in self.order),
        ]
        return {
            k: _plain(getattr(self, k) if k in typed else self.extra[k]) for k in keys if k in typed or k in self.extra
        }

    def set(self, **changes: Any) -> Any:
        """A copy with ``changes`` (typed fields or other keys), as a dict assigned them: a new key goes last."""
        typed, keys = self.typed_fields(), tuple(self.to_dict())
        return replace(
            self,
            **{k: v for k, v in changes.items() if k in typed},
            extra={**self.extra, **{k: copy.deepcopy(v) for k, v in changes.items() if k not in typed}},
            order=(*keys, *(k for k in changes if k not in keys)),
        )

    def without(self, *keys: str) -> Any:
        """A copy without the untyped ``keys`` (as popped from a dict)."""
        return replace(
            self,
            extra={k: v for k, v in self.extra.items() if k not in keys},
            order=tuple(k for k in self.order if k not in keys),
        )

    def get(self, key: str, default: Any = None) -> Any:
        """The value of ``key`` (typed or not), ``default`` when the file has none."""
        if key in self.typed_fields():
            v = getattr(self, key)
            return default if v is None and key not in self.order else v
        return self.extra.get(key, default)

    def __contains__(self, key: str) -> bool:
        return key in self.extra or (
            key in self.typed_fields() and (key in self.order or getattr(self, key) is not None)
        )


@dataclass(frozen=True, kw_only=True)
class MethodRecord(Record):
    """One compression decision of ``arch.json`` (``{"name", "config", "stage"?, ...}``; the rest,
    e.g. DCS's ``blocks``, in ``extra``)."""

    name: str
    config: Mapping[str, Any] | None = None
    stage: str | None = None

    CHECKS = {"name": _str, "config": _optional(_map), "stage": _optional(_str)}


def frozen_of(arch: Mapping[str, Any] | Arch) -> tuple[str, ...]:
    """The parameters ``arch`` records as frozen by the caller of the Python API (:attr:`Arch.frozen`;
    none: ``()``), from a complete ``arch.json`` or the partial one a training job is given."""
    if isinstance(arch, Arch):
        return arch.frozen
    return _names(arch.get("frozen", ()), "arch: frozen")


def _record(record: Mapping[str, Any] | MethodRecord) -> MethodRecord:
    return record if isinstance(record, MethodRecord) else MethodRecord.from_dict(record, source="method record")


def _methods(v: Any, where: str) -> tuple[MethodRecord, ...]:
    return tuple(MethodRecord.from_dict(m, source=f"{where}[{i}]") for i, m in enumerate(_list(v, where)))


def _labels(v: Any, where: str) -> tuple[str, ...]:
    if not isinstance(v, list) or not all(isinstance(c, str) for c in v):
        raise NascompressError(f"{where} must be a list of class names; the file was damaged or edited: replace it")
    return tuple(v)


def _names(v: Any, where: str) -> tuple[str, ...]:
    if not isinstance(v, (list, tuple)) or not all(isinstance(c, str) for c in v):
        raise NascompressError(f"{where} must be a list of parameter names; the file was damaged or edited: replace it")
    return tuple(v)


@dataclass(frozen=True, kw_only=True)
class Arch(Record):
    """``arch.json``: the model format (:mod:`nascompress.runs.io`)."""

    format: str
    model: Mapping[str, Any]
    input: Mapping[str, Any] | None = None
    labels: tuple[str, ...] | None = None
    methods: tuple[MethodRecord, ...] = ()
    frozen: tuple[str, ...] = ()  # the parameters the caller of the Python API froze: no stage trains them

    CHECKS = {
        "format": _str,
        "model": _map,
        "input": _optional(_map),
        "labels": _optional(_labels),
        "methods": _methods,
        "frozen": _names,
    }

    @property
    def spec(self) -> ModelSpec:
        """The timm model (name and build settings)."""
        return ModelSpec.from_dict(dict(self.model))

    @property
    def method_names(self) -> tuple[str, ...]:
        return tuple(m.name for m in self.methods)

    def method(self, name: str) -> MethodRecord | None:
        """The (first) record of method ``name``, None if the model has none."""
        return next((m for m in self.methods if m.name == name), None)

    @classmethod
    def of(cls, arch: Mapping[str, Any] | Arch, *, source: str = "arch") -> Arch:
        """``arch`` typed (an :class:`Arch` as it is, a dict read with :meth:`from_dict`)."""
        return arch if isinstance(arch, Arch) else cls.from_dict(arch, source=source)

    def with_method(self, *records: Mapping[str, Any] | MethodRecord) -> Arch:
        """A copy with ``records`` applied last, in order (compression decisions added)."""
        return self.set(methods=(*self.methods, *map(_record, records)))

    def with_last_method(self, record: Mapping[str, Any] | MethodRecord) -> Arch:
        """A copy whose last method record is ``record`` (e.g. a DCS supernet's, materialized)."""
        return self.set(methods=(*self.methods[:-1], _record(record)))

    def with_labels(self, labels: Sequence[Any] | None) -> Arch:
        """A copy recording ``labels`` (class names by output index); None: ``self``."""
        return self if labels is None else self.set(labels=tuple(str(c) for c in labels))


@dataclass(frozen=True, kw_only=True)
class RunMetrics(Record):
    """``metrics.json``: what every stage writes typed (None: the stage writes no such value), the rest in
    ``extra`` (``get`` reads either); a stage's own record extends it (e.g. ``train.metrics.TrainMetrics``)."""

    test_top1: float | None = None
    val_top1: float | None = None
    flops_ratio: float | None = None
    macs: float | None = None
    dense_macs: float | None = None
    finished: bool | None = None  # the completion mark (nascompress.runs.io.finish_run)
    finished_files: Mapping[str, Any] | None = None  # size and sha256 of the files it vouches for

    CHECKS = {
        **{k: _optional(_number) for k in ("test_top1", "val_top1", "flops_ratio", "macs", "dense_macs")},
        "finished": _optional(_bool),
        "finished_files": _optional(_map),
    }

    def results(self) -> dict[str, Any]:
        """The metrics without the completion mark (``finished``, ``finished_files``)."""
        return {k: v for k, v in self.to_dict().items() if k not in ("finished", "finished_files")}


@dataclass(frozen=True, kw_only=True)
class Quantization(Record):
    """An int8 sidecar's ``quantization``: the scheme kept, why another was (``fallback``), the
    calibration, and which layers stayed fp32 (``kept_fp32_summary``: reason -> count)."""

    scheme: str
    fallback: str | None = None
    calibration: Mapping[str, Any] | None = None
    quantized_nodes: int | None = None
    kept_fp32_summary: Mapping[str, int] | None = None

    CHECKS = {
        "scheme": _str,
        "fallback": _optional(_str),
        "calibration": _optional(_map),
        "quantized_nodes": _optional(_kind(int, "an integer")),
        "kept_fp32_summary": _optional(_map),
    }


@dataclass(frozen=True, kw_only=True)
class Sidecar(Record):
    """An export's sidecar ``FILE.json`` (:mod:`nascompress.deploy`)."""

    format: str
    file: str
    runtime: str | None = None
    dtype: str | None = None
    batch: Any = None
    files: tuple[Mapping[str, Any], ...] = ()
    verification: Mapping[str, Any] | None = None
    quantization: Quantization | None = None

    CHECKS = {
        "format": _str,
        "file": _str,
        "runtime": _optional(_str),
        "dtype": _optional(_str),
        "batch": lambda v, where: copy.deepcopy(v),
        "files": lambda v, where: tuple(_list(v, where)),
        "verification": _optional(_map),
        "quantization": _optional(lambda v, where: Quantization.from_dict(v, source=where)),
    }


# ----------------------------------------------------------------------------------------------
# The one place each file is read and written.


def read_arch_json(path: str | Path) -> dict[str, Any]:
    """The validated arch of the ``arch.json`` file ``path``, as its dict (:func:`validate_arch`)."""
    return validate_arch(read_json(path), source=str(path))


def write_arch_json(run_dir: str | Path, arch: Mapping[str, Any] | Arch) -> Path:
    """Write ``run_dir/arch.json`` atomically."""
    path = Path(run_dir) / ARCH_FILE
    write_json(path, arch.to_dict() if isinstance(arch, Arch) else arch)
    return path


def read_metrics_json(run_dir: str | Path) -> Any:
    """The JSON of ``run_dir/metrics.json`` as it is (the completion mark's reader checks it itself)."""
    return read_json(Path(run_dir) / METRICS_FILE)


def write_metrics_json(run_dir: str | Path, metrics: Mapping[str, Any] | RunMetrics) -> Path:
    """Write ``run_dir/metrics.json`` atomically (the run's last write: :func:`nascompress.runs.io.finish_run`)."""
    path = Path(run_dir) / METRICS_FILE
    write_json(path, metrics.to_dict() if isinstance(metrics, RunMetrics) else metrics)
    return path


def has_metrics(run_dir: str | Path) -> bool:
    """Whether ``run_dir`` holds a ``metrics.json`` (a finished stage, or one marked by its guard)."""
    return (Path(run_dir) / METRICS_FILE).is_file()


def read_metrics(run_dir: str | Path) -> RunMetrics:
    """The :class:`RunMetrics` of ``run_dir/metrics.json``; a missing or damaged file is one line."""
    path = Path(run_dir) / METRICS_FILE
    return RunMetrics.from_dict(read_json(path), source=str(path))


def find_metrics(run_dir: str | Path) -> RunMetrics | None:
    """:func:`read_metrics`, or None when ``run_dir`` has no ``metrics.json``."""
    return read_metrics(run_dir) if has_metrics(run_dir) else None


def sidecar_path(out: str | Path) -> Path:
    """``FILE.json`` beside ``FILE``."""
    out = Path(out)
    return out.with_name(out.name + ".json")


def write_sidecar_json(path: str | Path, side: Mapping[str, Any] | Sidecar) -> None:
    """Write the sidecar JSON ``side`` to ``path`` (the sidecar itself, or its atomic temp file)."""
    write_json(path, side.to_dict() if isinstance(side, Sidecar) else side)


def read_sidecar(path: str | Path) -> Sidecar:
    """The :class:`Sidecar` of an exported file ``path`` (``FILE`` or ``FILE.json``)."""
    p = Path(path)
    p = p if p.suffix == ".json" else sidecar_path(p)
    return Sidecar.from_dict(read_json(p), source=str(p))


__all__ = [
    "ARCH_FILE",
    "ARCH_FORMAT",
    "METRICS_FILE",
    "READ_FORMATS",
    "Arch",
    "MethodRecord",
    "Quantization",
    "Record",
    "RunMetrics",
    "Sidecar",
    "as_is",
    "check_map",
    "check_number",
    "check_str",
    "find_metrics",
    "frozen_of",
    "has_metrics",
    "optional",
    "plain",
    "read_arch_json",
    "read_metrics",
    "read_metrics_json",
    "read_sidecar",
    "sidecar_path",
    "validate_arch",
    "write_arch_json",
    "write_metrics_json",
    "write_sidecar_json",
]
