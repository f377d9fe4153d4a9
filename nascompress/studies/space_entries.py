"""The normalized entries of a search space: :class:`Param` (one entry of a method's ``params``),
:class:`Method`, and the small value helpers the parser, the model and replay share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, Sequence


@dataclass(frozen=True)
class Param:
    """One entry of a method's ``params`` (normalized)."""

    name: str
    kind: str
    where: str
    value: Any = None  # const
    low: float | int | None = None
    high: float | int | None = None
    step: float | int | None = None
    log: bool = False
    choices: tuple = ()  # categorical: scalars; layers: tuples of layer numbers
    layers_ref: str | None = None  # per_layer: sibling name
    layers_list: tuple[int, ...] | None = None  # per_layer: literal layers
    item: Param | None = None  # per_layer: the per-layer value entry
    when: tuple[tuple[str, tuple], ...] = ()
    source: Mapping[str, Any] = field(default_factory=dict)  # canonical form (for to_dict/hash)


@dataclass(frozen=True)
class Method:
    name: str
    group: str | None
    optional: bool
    params: tuple[Param, ...]
    where: str

    def param(self, name: str) -> Param | None:
        return next((p for p in self.params if p.name == name), None)


def encode_layers(layers: Sequence[int]) -> str:
    return ",".join(str(x) for x in layers)


def decode_layers(text: str) -> list[int]:
    return [int(x) for x in str(text).split(",") if x != ""]


def is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_scalar(x: Any) -> bool:
    return x is None or isinstance(x, (bool, int, float, str))


def plain_value(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {k: plain_value(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain_value(v) for v in x]
    return x


def is_layer_const_value(p: Param) -> bool:
    return (
        p.kind == "const" and isinstance(p.value, list) and bool(p.value) and all(is_int(v) and v >= 1 for v in p.value)
    )


def is_layer_const(m: Method, p: Param) -> bool:
    """A constant list that a per_layer entry uses as its layers (so it holds layer numbers)."""
    return is_layer_const_value(p) and any(q.kind == "per_layer" and q.layers_ref == p.name for q in m.params)


def max_len(m: Method, p: Param) -> int:
    if p.layers_list is not None:
        return len(p.layers_list)
    sib = m.param(p.layers_ref or "")
    assert sib is not None
    return max(len(c) for c in sib.choices) if sib.kind == "layers" else len(sib.value)


def is_active(p: Param, values: Mapping[str, Any]) -> bool:
    return all(name in values and values[name] in vals for name, vals in p.when)


class SpaceView(Protocol):
    """What the lattice (:func:`~nascompress.studies.space_lattice.grid`) and replay
    (:func:`~nascompress.studies.space_replay.params_for`) read of a space: the
    :class:`nascompress.studies.space_model.Space` that calls them (declared here, below both, so
    that neither imports its caller)."""

    name: str
    methods: list[Method]

    def groups(self) -> dict[str, list[Method]]: ...

    def param_names(self) -> list[str]: ...

    def suggest(self, trial: Any) -> Any: ...
