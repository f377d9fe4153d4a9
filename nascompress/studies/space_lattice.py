"""The grid's lattice: about ``n`` evenly spread configurations of a space (a rank-1 Korobov
lattice in the unit cube, one coordinate per Optuna parameter), for the spread configurations of a
conditional space (the space's FLOPs profile). An unconditional space has a fixed set of Optuna
distributions and takes Optuna's QMC points instead (:meth:`Space.grid
<nascompress.studies.space_model.Space.grid>`)."""

from __future__ import annotations

import json
import math
from typing import Any, Mapping, Sequence

from ..errors import NascompressError
from .space_entries import SpaceView


def grid(space: SpaceView, n: int) -> list[dict[str, Any]]:
    """About ``n`` evenly spread configurations, as Optuna params (enqueue-ready).

    Every Optuna parameter the space can produce (:meth:`Space.param_names`) is one coordinate of
    an ``n``-point rank-1 lattice in the unit cube (point ``i``, coordinate ``j``:
    ``((i * g_j + n // 2) mod n + 0.5) / n`` with the Korobov generator ``g = (1, a, a^2,
    ...) mod n``, ``a`` the integer coprime with ``n`` nearest ``n / golden ratio``). Each
    coordinate takes each of the ``n`` values ``(k + 0.5) / n`` exactly once, which is
    mapped into its parameter: floats and ints linearly (or in log space) and snapped to
    their step, categorical, layer-set and on/off parameters by equal-width bins. Points that
    give the same configuration are merged, so the result has ``n`` configurations, fewer
    only when the space has fewer distinct ones at that resolution (e.g. all-categorical
    spaces). Order: the lattice order (the first point is the middle of every range).

    Args:
        space: the space.
        n: the number of lattice points (>= 1).
    """
    if not isinstance(n, int) or n < 1:
        raise NascompressError(f"grid size must be an integer >= 1, got {n!r}")
    names = space.param_names()
    gen = _korobov(n, len(names))
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i in range(n):
        u = {name: ((i * g + n // 2) % n + 0.5) / n for name, g in zip(names, gen)}
        lt = _LatticeTrial(u)
        space.suggest(lt)
        key = json.dumps(lt.params, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(lt.params)
    return out


def _korobov(n: int, d: int) -> list[int]:
    """Generator ``(1, a, a^2, ...) mod n`` of an n-point rank-1 lattice in d dimensions."""
    if n == 1 or d == 0:
        return [1] * d
    target = n / ((1 + 5**0.5) / 2)
    a = min((c for c in range(1, n) if math.gcd(c, n) == 1), key=lambda c: (abs(c - target), c))
    gen, g = [], 1
    for _ in range(d):
        gen.append(g)
        g = (g * a) % n
    return gen


class _LatticeTrial:
    """A stand-in trial that answers each suggest from a lattice coordinate in [0, 1)."""

    def __init__(self, u: Mapping[str, float]) -> None:
        self.u = u
        self.params: dict[str, Any] = {}

    def _bin(self, name: str, n: int) -> int:
        return min(int(self.u[name] * n), n - 1)

    def suggest_float(
        self, name: str, low: float, high: float, *, step: float | None = None, log: bool = False
    ) -> float:
        u = self.u[name]
        if step is not None:
            n = int(round((high - low) / step)) + 1
            v = round(low + self._bin(name, n) * step, 12)
        elif log:
            v = math.exp(math.log(low) + u * (math.log(high) - math.log(low)))
        else:
            v = low + u * (high - low)
        self.params[name] = float(v)
        return float(v)

    def suggest_int(self, name: str, low: int, high: int, *, step: int = 1, log: bool = False) -> int:
        if log:
            v = int(round(math.exp(math.log(low) + self.u[name] * (math.log(high) - math.log(low)))))
            v = min(max(v, low), high)
        else:
            v = low + self._bin(name, (high - low) // step + 1) * step
        self.params[name] = v
        return v

    def suggest_categorical(self, name: str, choices: Sequence[Any]) -> Any:
        v = choices[self._bin(name, len(choices))]
        self.params[name] = v
        return v
