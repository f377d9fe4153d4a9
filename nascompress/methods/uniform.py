"""Uniform magnitude pruning: the Torch-Pruning-style baseline DCS is compared against.

Every block keeps the same share ``keep`` of its MLP hidden neurons and of each head's Q/K
channels (each count rounded up to a multiple of ``align``, :func:`~nascompress.models.layers.aligned_width`:
the widths the fast GPU kernels want), chosen by weight magnitude (Torch-Pruning's group L2 importance: a
hidden neuron j is scored by ||fc1.weight[j]||^2 + ||fc2.weight[:, j]||^2, a Q/K channel c of head h by
||W_q[c]||^2 + ||W_k[c]||^2). The pruned layers are gathered physically (fc1 rows / fc2 columns,
and the per-head Q/K rows of qkv), so the model is really smaller. :func:`keep_for_flops` finds
the share that meets a FLOPs target.

Record: ``{"name": "uniform", "config": {"keep": 0.6, "qk": true, "align": 8}, "blocks":
[{"hidden_keep": [...], "qk_keep": [[...] per head]}]}``; the model is rebuilt from the kept
indices, so records written before ``align`` existed load unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any
import copy

import torch
from torch import nn

from ..config import Config, check_bool, check_range, check_settings, field_name, setting
from ..errors import NascompressError
from ..models.layers import DEFAULT_ALIGN, NCBlock, aligned_width, to_core
from ..models.slicing import slice_hidden, slice_qk
from . import Method, check_index_list, get_method, register_method
from ..profiling import count_flops


@dataclass(frozen=True)
class UniformConfig(Config):
    """Args:
    keep: share of the MLP hidden neurons and of each head's Q/K channels every block keeps.
    qk: prune the Q/K channels too (else only the MLP hidden neurons).
    align: every kept count is rounded up to a multiple of this (1: exactly ``ceil(keep * n)``,
        the widths before alignment existed; 8 by default, what GPU kernels need).
    """

    keep: float = 0.6
    qk: bool = True
    align: int = setting(
        DEFAULT_ALIGN,
        lo=1,
        help=("Round every kept width up to a multiple of this (8: GPU-friendly; 1: exact shares)."),
    )

    def __post_init__(self) -> None:
        check_range("keep", self.keep, 0, 1, lo_open=True)
        check_bool("qk", self.qk)
        check_settings(self, name=field_name)  # every setting() against its declaration


def kept_count(keep: float, n: int, align: int) -> int:
    """Channels kept of ``n`` at share ``keep``: ``ceil(keep * n)`` (at least 1), rounded up to ``align``."""
    return aligned_width(max(1, math.ceil(keep * n - 1e-6)), align=align, full=n)


@torch.no_grad()
def importance(model: nn.Module, cfg: UniformConfig) -> list[dict[str, Any]]:
    """The kept indices per block (largest group L2 magnitude first), as the record stores them."""
    blocks = []
    for blk in model.blocks:
        fc1, fc2 = blk.mlp.fc1, blk.mlp.fc2
        score = fc1.weight.pow(2).sum(1) + fc2.weight.pow(2).sum(0)  # (hidden,)
        k = kept_count(cfg.keep, score.numel(), cfg.align)
        rec: dict[str, Any] = {"hidden_keep": score.topk(k).indices.sort().values.tolist(), "qk_keep": None}
        if cfg.qk:
            a = blk.attn
            w = a.qkv.weight
            q, kk = w[: a.attn_dim], w[a.attn_dim : 2 * a.attn_dim]
            s = (q.pow(2).sum(1) + kk.pow(2).sum(1)).reshape(a.num_heads, a.head_dim)
            kq = kept_count(cfg.keep, a.head_dim, cfg.align)
            rec["qk_keep"] = [row.topk(kq).indices.sort().values.tolist() for row in s]
        blocks.append(rec)
    return blocks


@register_method
class Uniform(Method):
    name = "uniform"
    summary = "uniform magnitude pruning of MLP hidden neurons and Q/K channels (Torch-Pruning-style baseline)"
    config_cls = UniformConfig
    stacks_on = frozenset()
    off_config = {"keep": 1.0}
    paper_config = None

    def resolve(self, model: nn.Module, cfg: UniformConfig) -> UniformConfig:
        to_core(model, method="uniform")
        for i, blk in enumerate(model.blocks):
            if type(blk) is not NCBlock:
                raise NascompressError(
                    f"uniform must be the first method of a model; blocks.{i} is a {type(blk).__name__}"
                )
        return cfg

    def check_record(self, record: dict[str, Any]) -> None:
        super().check_record(record)
        blocks = record.get("blocks")
        if not isinstance(blocks, list) or not all(isinstance(b, dict) for b in blocks):
            raise NascompressError("blocks must be a list of objects, one per block")
        for i, blk in enumerate(blocks):
            check_index_list(blk.get("hidden_keep"), f"blocks[{i}].hidden_keep")
            if blk.get("qk_keep") is not None:
                check_index_list(blk["qk_keep"], f"blocks[{i}].qk_keep", nested=True)

    def patch(self, model: nn.Module, cfg: UniformConfig, record: dict[str, Any]) -> nn.Module:
        blocks = record.get("blocks")
        if blocks is None or len(blocks) != len(model.blocks):
            raise NascompressError(
                f"the uniform record lists {len(blocks or [])} blocks but the model has {len(model.blocks)}"
            )
        for blk, rec in zip(model.blocks, blocks):
            slice_hidden(blk, rec["hidden_keep"])
            if rec.get("qk_keep") is not None:
                slice_qk(blk.attn, rec["qk_keep"])
        return model

    def prepare(self, model, cfg, recipe):
        record = dict(self.make_record(cfg), blocks=importance(model, cfg))
        return self.patch(model, cfg, record), record


def keep_for_flops(
    model: nn.Module, target: float, x: torch.Tensor, *, qk: bool = True, align: int = DEFAULT_ALIGN, tol: float = 0.002
) -> float:
    """The keep share whose uniformly pruned model has ``target`` x the FLOPs of ``model``.

    With aligned widths the FLOPs ratio is a step function of the share: the share returned is the
    smallest one whose ratio is nearest ``target`` (within ``tol`` when a step lands there; else the
    nearer of the two steps around it). Bisection over the share, one FLOPs count per probe."""
    dense = count_flops(model, x).total
    cache: dict[float, float] = {}

    def ratio(keep: float) -> float:
        if keep not in cache:
            m, _ = get_uniform().prepare_fresh(copy.deepcopy(model), UniformConfig(keep=keep, qk=qk, align=align))
            cache[keep] = count_flops(m, x).total / dense
        return cache[keep]

    lo, hi = 0.01, 1.0  # ratio(lo) < target <= ratio(hi) is kept (or the ends)
    for _ in range(30):
        mid = (lo + hi) / 2
        r = ratio(mid)
        if abs(r - target) <= tol:
            return mid
        lo, hi = (lo, mid) if r > target else (mid, hi)
    # no share within tol: the widths step over the target; take the nearer side
    return min((lo, hi), key=lambda k: (abs(ratio(k) - target), k))


def uniform_at_flops(
    model: nn.Module, target: float, x: torch.Tensor, *, qk: bool = True, align: int = DEFAULT_ALIGN
) -> tuple[nn.Module, dict[str, Any]]:
    """A uniformly pruned copy of ``model`` at ``target`` x its FLOPs on input ``x`` (the share from
    :func:`keep_for_flops`, kept by weight magnitude), and its method record (the share is
    ``record["config"]["keep"]``); ``model`` is left as it is."""
    keep = keep_for_flops(model, target, x, qk=qk, align=align)
    return get_uniform().prepare_fresh(copy.deepcopy(model), UniformConfig(keep=keep, qk=qk, align=align))


def uniform_from_keep(
    model: nn.Module, hidden_keep: list[list[int]], qk_keep: list[list[list[int]] | None] | None = None
) -> tuple[nn.Module, dict[str, Any]]:
    """A copy of ``model`` keeping, per block, the MLP hidden neurons ``hidden_keep[i]`` and the Q/K
    channels per head ``qk_keep[i]`` (None: every Q/K channel), chosen by any rule (an external
    pruner's, as indices of ``model``'s layers), with its ``uniform`` method record: such a model
    is a nascompress run like any other (saved, reloaded, exported). ``model`` is left as it is."""
    if qk_keep is None:
        qk_keep = [None] * len(hidden_keep)
    if len(qk_keep) != len(hidden_keep):
        raise NascompressError(f"{len(hidden_keep)} blocks of hidden neurons but {len(qk_keep)} of Q/K channels")
    cfg = UniformConfig(keep=1.0, qk=any(q is not None for q in qk_keep))
    method = get_uniform()
    blocks = [{"hidden_keep": list(h), "qk_keep": q} for h, q in zip(hidden_keep, qk_keep)]
    record = dict(method.make_record(cfg), blocks=blocks)
    return method.apply(copy.deepcopy(model), record), record


def get_uniform() -> Uniform:
    return get_method("uniform")  # type: ignore[return-value]


__all__ = [
    "Uniform",
    "UniformConfig",
    "importance",
    "keep_for_flops",
    "kept_count",
    "uniform_at_flops",
    "uniform_from_keep",
]
