"""Replay: the Optuna params that make :meth:`Space.suggest <nascompress.studies.space_model.Space.suggest>`
return given method records (stored records, the dense model's or a paper's configuration), each
value checked against the space."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from ..errors import NascompressError
from .space_entries import Method, Param, SpaceView, is_active, encode_layers, is_int, is_num


def params_for(space: SpaceView, records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The Optuna params that make ``space.suggest`` return ``records`` (for ``enqueue_trial``).

    Config keys the space does not declare are ignored; a value outside the space is an error.

    Args:
        space: the space.
        records: method records ``[{"name": m, "config": {...}}]``, e.g. the dense model's
            or a paper's configuration.
    """
    by_name: dict[str, Mapping[str, Any]] = {}
    for i, r in enumerate(records):
        name = r.get("name") if isinstance(r, Mapping) else None
        if not isinstance(name, str):
            raise NascompressError(f"records[{i}] needs a method name ({{'name': ..., 'config': {{...}}}})")
        if name in by_name:
            raise NascompressError(f"records: method {name!r} appears twice")
        by_name[name] = r
    known = {m.name for m in space.methods}
    extra = sorted(set(by_name) - known)
    if extra:
        raise NascompressError(
            f"records: method {extra[0]!r} is not in space {space.name!r} (its methods: {', '.join(sorted(known))})"
        )
    params: dict[str, Any] = {}
    for g, members in space.groups().items():
        present = [m.name for m in members if m.name in by_name]
        if len(present) > 1:
            raise NascompressError(
                f"records: {present[0]!r} and {present[1]!r} are alternatives (group {g!r}); give at most one"
            )
        if not present and not members[0].optional:
            raise NascompressError(f"records: group {g!r} needs one of {[m.name for m in members]}")
        params[f"group.{g}"] = present[0] if present else "none"
    for m in space.methods:
        if m.group is None and m.optional:
            params[f"{m.name}.on"] = m.name in by_name
        elif m.group is None and m.name not in by_name:
            raise NascompressError(f"records: method {m.name!r} is always on in space {space.name!r}; give its record")
        if m.name in by_name:
            cfg = by_name[m.name].get("config") or {}
            params.update(_params_for_method(m, cfg))
    return params


def _check_value(p: Param, v: Any, where: str) -> Any:
    if p.kind == "categorical":
        if not any(v == c and type(v) is type(c) or (is_num(v) and is_num(c) and v == c) for c in p.choices):
            raise NascompressError(f"{where}: {v!r} is not one of the space's choices {list(p.choices)}")
        return next(c for c in p.choices if c == v)
    check = is_int if p.kind == "int" else is_num
    if not check(v):
        raise NascompressError(f"{where}: expected {'an integer' if p.kind == 'int' else 'a number'}, got {v!r}")
    assert p.low is not None and p.high is not None
    tol = 1e-9 * max(1.0, abs(p.high - p.low))
    if not p.low - tol <= v <= p.high + tol:
        raise NascompressError(f"{where}: {v} is outside the space's range [{p.low}, {p.high}]")
    if p.step is not None:
        k = (v - p.low) / p.step
        if abs(k - round(k)) > 1e-6:
            raise NascompressError(f"{where}: {v} is not on the space's step {p.step} from {p.low}")
    return int(v) if p.kind == "int" else float(v)


def _params_for_method(m: Method, cfg: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    values: dict[str, Any] = {}
    for p in m.params:
        if not is_active(p, values):
            continue
        name, where = f"{m.name}.{p.name}", f"records: {m.name}.config.{p.name}"
        if p.kind == "const":
            if (
                p.name in cfg
                and cfg[p.name] != p.value
                and not (isinstance(cfg[p.name], tuple) and list(cfg[p.name]) == p.value)
            ):
                raise NascompressError(f"{where} is {cfg[p.name]!r} but the space fixes it to {p.value!r}")
            values[p.name] = p.value
            continue
        if p.kind == "per_layer":
            layers = list(p.layers_list) if p.layers_list is not None else values.get(p.layers_ref or "")
            if layers is None:
                continue
        if p.name not in cfg:
            raise NascompressError(f"{where} is missing; the space searches it")
        v = cfg[p.name]
        if p.kind == "layers":
            if not isinstance(v, (list, tuple)) or not all(is_int(x) for x in v):
                raise NascompressError(f"{where}: expected a list of layer numbers, got {v!r}")
            key = tuple(sorted(v))
            if key not in p.choices:
                raise NascompressError(f"{where}: layers {list(key)} are not one of the space's layer sets")
            out[name] = encode_layers(key)
            values[p.name] = list(key)
        elif p.kind == "per_layer":
            assert p.item is not None
            if not isinstance(v, (list, tuple)) or len(v) != len(layers):
                raise NascompressError(f"{where}: expected {len(layers)} values (one per layer of {layers}), got {v!r}")
            for i, x in enumerate(v):
                out[f"{name}.{i}"] = _check_value(p.item, x, f"{where}[{i}]")
            values[p.name] = list(v)
        else:
            out[name] = _check_value(p, v, where)
            values[p.name] = out[name]
    return out
