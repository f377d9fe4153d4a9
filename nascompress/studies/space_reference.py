"""Reference points of a search space: the uncompressed configuration and the papers' defaults as
Optuna params (:func:`reference_configs`, the study's first trials), and the FLOPs range of a space
over spread configurations without training (:func:`space_profile`)."""

from __future__ import annotations

import copy
from typing import Any
import itertools

from torch import nn

from ..errors import NascompressError
from ..methods import get_method
from ..profiling import count_flops
from .records import SpaceProfile
from .space_model import Space
from ..train.finetune import split_settings


def reference_configs(space: Space, model: nn.Module) -> list[tuple[str, dict[str, Any]]]:
    """The uncompressed configuration and the papers' defaults (one per choice of each group), as
    Optuna params of ``space``; configurations the space cannot express are left out.

    Uncompressed: every method that is always on at its ``off_config``, the optional ones left
    out. Paper: every method at its ``paper_config`` (one configuration per member of each group)."""
    groups = space.groups()
    choices = [members for members in groups.values()]
    out: list[tuple[str, dict[str, Any]]] = []
    for label, attr in (("uncompressed", "off_config"), ("paper", "paper_config")):
        picks = [[]] if label == "uncompressed" else list(itertools.product(*choices)) or [[]]
        for pick in picks:
            names = {m.name for m in pick}
            records = []
            for m in space.methods:
                in_group = m.group is not None
                if label == "uncompressed" and (m.optional or in_group):
                    continue
                if label == "paper" and in_group and m.name not in names:
                    continue
                cfg = getattr(get_method(m.name), attr)
                if cfg is None:
                    records = None
                    break
                resolved = get_method(m.name).config(copy.deepcopy(model), dict(cfg)).to_dict()
                records.append({"name": m.name, "config": _per_layer_lists(m, resolved)})
            if records is None:
                continue
            try:
                params = space.params_for(records)
            except NascompressError:
                continue  # the space does not contain this configuration
            if params not in [p for _, p in out]:
                out.append((label, params))
    return out


def _per_layer_lists(m: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """A scalar where the space declares a per-layer list becomes one value per chosen layer."""
    out = dict(cfg)
    for p in m.params:
        if p.kind == "per_layer" and not isinstance(out.get(p.name), (list, tuple)):
            layers = out.get(p.layers_ref) if p.layers_ref else p.layers_list
            if isinstance(layers, (list, tuple)) and p.name in out:
                out[p.name] = [out[p.name]] * len(layers)
    return out


def space_profile(
    ctx_like: dict[str, Any], space: Space, base: nn.Module, *, n: int = 12, max_flops: float | None = None
) -> SpaceProfile:
    """FLOPs ratio and params over ``n`` spread configurations of the space (structure only, no
    training): min / median / max, and whether a FLOPs constraint is satisfiable
    (:class:`~nascompress.studies.records.SpaceProfile`; empty when no configuration could be built)."""
    x, dense = ctx_like["x"], ctx_like["dense_flops"]
    ratios, params = [], []
    for p in space.grid(n):
        recs = [r for r in space.records(p) if r["name"] != "dcs"]
        model = copy.deepcopy(base)
        try:
            for r in recs:
                config, recipe = split_settings(r["name"], r["config"])
                model, _ = get_method(r["name"]).prepare_fresh(model, config, recipe or None)
        except NascompressError:
            continue
        rep = count_flops(model.eval(), x)
        ratios.append(rep.total / dense)
        params.append(rep.params)
    if not ratios:
        return SpaceProfile.new()
    ratios.sort()
    prof = SpaceProfile.new(
        configurations=len(ratios),
        flops_ratio_min=ratios[0],
        flops_ratio_median=ratios[len(ratios) // 2],
        flops_ratio_max=ratios[-1],
        params_min=min(params),
        params_max=max(params),
    )
    return prof if max_flops is None else prof.set(max_flops_satisfiable=ratios[0] <= max_flops)


__all__ = ["reference_configs", "space_profile"]
