"""The ``layers`` kind of a space file: a set of 1-based layer numbers given as ``range: [lo, hi]``
(``hi`` < 0 counting from the model's last block), ``candidates`` with ``size``, or explicit
``choices`` (the format: :mod:`nascompress.studies.space_parser`'s docstring). :class:`LayersKind`
validates it; :class:`~nascompress.studies.space_parser.Parser` is built on it."""

from __future__ import annotations

import itertools
import math
from typing import Any, Mapping

from ..errors import NascompressError
from ..yaml_io import shown
from .space_entries import Param, is_int
from .space_values import layer_limit

MAX_LAYER_SETS = 10_000


class LayersKind:
    """Parses ``layers`` entries and layer lists for a space-file parser, whose errors
    (:meth:`err`) name ``source``, the entry and the problem; ``depth`` (the model's blocks, None when
    the space is not loaded for a model) resolves a range counting from the last block, ``pyramid``
    says why there is none."""

    source: str
    depth: int | None
    pyramid: bool

    def err(self, where: str, msg: str) -> NascompressError:
        return NascompressError(f"{self.source}: {where}: {msg}" if where else f"{self.source}: {msg}")

    def layer_list(self, x: Any, where: str) -> list[int]:
        if not isinstance(x, list) or not x:
            raise self.err(where, f"a non-empty list of layer numbers is required, got {shown(x)}")
        for v in x:
            if not is_int(v) or v < 1:
                raise self.err(where, f"layer numbers are integers >= 1 (1-based), got {shown(v)}")
            if v > layer_limit():
                raise self.err(
                    where,
                    f"layer {v:,} is beyond the deepest model nascompress builds ({layer_limit()} "
                    "blocks, the max_model_depth limit); give the model's layers",
                )
        if len(set(x)) != len(x):
            raise self.err(where, f"layer {next(v for i, v in enumerate(x) if v in x[:i])} appears twice")
        return sorted(x)

    def layers(self, pname: str, spec: Mapping[str, Any], where: str) -> Param:
        has = [k for k in ("range", "candidates", "choices") if k in spec]
        if len(has) != 1:
            raise self.err(
                where,
                "kind layers needs exactly one of range: [lo, hi], candidates: [...] "
                f"(both with size) or choices: [[...], ...]; got {has or 'none'}",
            )
        if has[0] == "choices":
            if "size" in spec:
                raise self.err(f"{where}.size", "size goes with range or candidates, not with choices")
            raw = spec["choices"]
            if not isinstance(raw, list) or not raw:
                raise self.err(f"{where}.choices", "a non-empty list of layer sets is required")
            sets = [tuple(self.layer_list(c, f"{where}.choices[{i}]")) for i, c in enumerate(raw)]
            if len(set(sets)) != len(sets):
                raise self.err(f"{where}.choices", "a layer set appears twice")
            return Param(
                pname,
                "layers",
                where,
                choices=tuple(sets),
                source={"kind": "layers", "choices": [list(s) for s in sets]},
            )
        relative = False
        if has[0] == "range":
            r = spec["range"]
            if not isinstance(r, list) or len(r) != 2 or not all(is_int(v) for v in r):
                raise self.err(f"{where}.range", f"an inclusive range is [lo, hi] with integers, got {shown(r)}")
            if 0 in r or r[0] < 0:
                raise self.err(
                    f"{where}.range",
                    "layer numbers are 1-based (>= 1; hi may count from the last block: -1 is the last), "
                    f"got {shown(r)}",
                )
            relative = r[1] < 0
            r = self.resolve_range(r, f"{where}.range") if relative else r
            if r[0] > r[1]:
                raise self.err(f"{where}.range", f"empty or inverted range [{r[0]}, {r[1]}]")
            if r[1] > layer_limit():
                raise self.err(
                    f"{where}.range",
                    f"layer {r[1]:,} is beyond the deepest model nascompress builds "
                    f"({layer_limit()} blocks, the max_model_depth limit); give the "
                    "model's layers",
                )
            cands = list(range(r[0], r[1] + 1))
            src: dict[str, Any] = {"kind": "layers", "range": list(r)}
        else:
            cands = self.layer_list(spec["candidates"], f"{where}.candidates")
            src = {"kind": "layers", "candidates": cands}
        if "size" not in spec:
            raise self.err(where, "kind layers with range or candidates needs size: k or size: [lo, hi]")
        size = spec["size"]
        if is_int(size):
            lo = hi = size
        elif isinstance(size, list) and len(size) == 2 and all(is_int(v) for v in size):
            lo, hi = size
        else:
            raise self.err(f"{where}.size", f"size is an integer or [lo, hi], got {shown(size)}")
        if lo < 1 or lo > hi:
            raise self.err(f"{where}.size", f"empty or inverted size range [{lo}, {hi}] (sizes are >= 1)")
        if relative:  # a range sized by the model: at most all of its layers
            lo, hi = min(lo, len(cands)), min(hi, len(cands))
        if hi > len(cands):
            hint = " (for an inclusive range of layers write range: [lo, hi])" if "candidates" in spec else ""
            raise self.err(f"{where}.size", f"size {hi} exceeds the {len(cands)} candidate layers{hint}")
        total = sum(math.comb(len(cands), k) for k in range(lo, hi + 1))
        if total > MAX_LAYER_SETS:
            raise self.err(
                where,
                f"{total} layer sets is too many (at most {MAX_LAYER_SETS}): narrow the "
                "candidates or the size, or list the sets with choices",
            )
        sets = tuple(c for k in range(lo, hi + 1) for c in itertools.combinations(cands, k))
        src["size"] = [lo, hi]
        return Param(pname, "layers", where, choices=sets, source=src)

    def resolve_range(self, r: list[int], where: str) -> list[int]:
        """``[lo, -k]`` (the k-th block from the last) as absolute layer numbers of the model's depth."""
        if self.depth is None:
            why = (
                (
                    "the base model is a pyramid ViT (stages of blocks), which no layer number can address; use "
                    "a space without layer settings (e.g. mgvit-h's)"
                )
                if self.pyramid
                else "load the space for a model (search tokens, the pipeline and load_space(path, model=...) do)"
            )
            raise self.err(where, f"range {r} counts from the model's last block: {why}")
        hi = self.depth + 1 + r[1]
        if hi < r[0]:
            raise self.err(
                where,
                f"range {r} selects no layer of this {self.depth}-block model (layers "
                f"{r[0]}..{hi}); give a deeper model or a space with lower layers",
            )
        return [r[0], hi]
