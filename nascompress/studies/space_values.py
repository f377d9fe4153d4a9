"""Values of a search space checked when the file is loaded, not when a trial fails on them.

- every value an entry can take at its ends (a constant, each choice, a range's ``low`` and
  ``high``, a per-layer value's) must be one the method's config accepts on its own: a ToMe space
  with ``r: {low: -5}`` is refused naming the entry, instead of loading and then failing each trial
  (:func:`registry_value_error`);
- a stepped range has at most :data:`MAX_GRID_POINTS` values (``step: 1e-300`` would make
  Optuna's discrete distribution fail on a decimal overflow; an int range of 10^9 values is no
  setting of a ViT);
- layer numbers stop at the ``max_model_depth`` limit (a range [1, 10^9] would be listed).
"""

from __future__ import annotations

import re
from typing import Any

from ..errors import NascompressError
from .space_entries import Param
from .. import methods
from ..limits import limits
from ..dcs_search.search_config import DCSSearchConfig

MAX_GRID_POINTS = 1_000_000


def grid_points(low: float, high: float, step: float) -> float:
    """How many values a stepped range [low, high] holds (a float, so that no huge int is made)."""
    return (high - low) / step + 1


def check_grid(low: float, high: float, step: float | None, kind: str) -> str | None:
    """The problem with a numeric range's size, or None (``step`` None: an int's step is 1, a float
    without step is continuous)."""
    if step is None and kind == "float":
        return None
    n = grid_points(low, high, step or 1)
    if n > MAX_GRID_POINTS:
        what = f"step {step!r}" if step is not None else "the range"
        count = f"{n:,.0f}" if n < 1e15 else f"{n:.2e}"
        return (
            f"{what} gives {count} values from {low!r} to {high!r}, more than the {MAX_GRID_POINTS:,} a search "
            "entry may hold; use a larger step or a narrower range"
        )
    return None


def layer_limit() -> int:
    return limits().max_model_depth


def extremes(p: Param) -> list[Any]:
    """The values at the ends of entry ``p`` (layers entries: none, they are checked against the model)."""
    if p.kind == "const":
        return [p.value]
    if p.kind == "categorical":
        return list(p.choices)
    if p.kind in ("int", "float"):
        return [p.low, p.high]
    if p.kind == "per_layer" and p.item is not None:
        return extremes(p.item)
    return []


def registry_value_error(method: str, pname: str, value: Any) -> str | None:
    """Why the registered ``method``'s config (or recipe, or for ``dcs`` the search's settings) refuses
    ``pname = value`` on its own, or None. Only refusals that name ``pname`` count: another
    setting's default is not this entry's problem, so a refusal naming another setting too (e.g.
    ``r_pos + r_neg``, a combination) is left to the trial."""
    try:
        entry = methods.get_method(method)
    except NascompressError:
        return None
    classes = [entry.config_cls, entry.recipe_cls]
    if method == "dcs":
        classes.append(DCSSearchConfig)
    for cls in classes:
        if cls is None or pname not in getattr(cls, "__dataclass_fields__", {}):
            continue
        try:
            cls.from_dict({pname: value})
        except NascompressError as e:
            named = {f for f in cls.__dataclass_fields__ if re.search(rf"\b{re.escape(f)}\b", str(e))}
            if named == {pname}:  # about this value alone, not its combination with another default
                return str(e)
        except (TypeError, ValueError):
            continue
    return None


def check_values(method: str, param: Param) -> str | None:
    """The first value at the ends of ``param`` that ``method`` refuses, as a problem, or None."""
    for v in extremes(param):
        why = registry_value_error(method, param.name, v)
        if why is not None:
            return f"{param.name} may take {v!r}, which {method} refuses: {why}"
    return None


def registry_method_fields(name: str) -> set[str] | None:
    """The settings a space may give a registered method (None: no such method): its config and
    recipe fields; for ``dcs`` also the search's (``target_flops``, ...), since a ``dcs`` entry in
    a space runs a short DCS search in each trial (see :mod:`nascompress.studies.trials`)."""
    try:
        entry = methods.get_method(name)
    except NascompressError:
        return None
    fields = set(entry.config_cls.__dataclass_fields__)
    if entry.recipe_cls is not None:
        fields |= set(entry.recipe_cls.__dataclass_fields__)
    if name == "dcs":
        fields |= set(DCSSearchConfig.__dataclass_fields__)
    return fields


__all__ = [
    "registry_method_fields",
    "MAX_GRID_POINTS",
    "check_grid",
    "check_values",
    "extremes",
    "layer_limit",
    "registry_value_error",
]
