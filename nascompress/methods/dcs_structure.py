"""DCS's structural gates (:mod:`.dcs` applies them): whole attention heads and whole blocks.

* Head gates (``DCSConfig.head_gates``): one logit per head of every block
  (``blocks.<i>.attn.head_mask.logits``, :class:`~.dcs_supernet.DCSHeadGate`); a closed head's output
  (B, H, N, d) is zeroed before the heads are merged, so materialization removes its q, k and v rows
  of qkv and its proj input columns together (:func:`~nascompress.models.slicing.slice_heads`; the attention
  keeps its head dim, ``num_heads`` becomes the kept count). With no head left the attention half is
  a constant, proj's bias through ls1, as the supernet computes it (:class:`ConstantAttention`).
* Block gates (``DCSConfig.depth_gates``): one logit per block (``blocks.<i>.dcs_depth`` (1,)) gating
  both residual branches; materialization removes a closed block from ``model.blocks``.

Both are the MLP gates' binary Gumbel-sigmoid gates (the same temperature, cost and entropy), not
aligned (a head or a block is a whole unit). Their logits start at ``alpha_init``, spread by weight
magnitude (:func:`head_scores`, :func:`block_scores`): the weakest heads and blocks reach the
threshold first.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import NascompressError, SettingError
from ..models.layers import NCAttention
from ..models.slicing import as_index, slice_heads
from .dcs_importance import spread
from .dcs_supernet import DCSHeadGate, DCSQKMask


@torch.no_grad()
def head_scores(attn: NCAttention) -> torch.Tensor:
    """(H,): per head the squared L2 norm of its q, k and v rows of qkv (weight and bias) and of its
    proj input columns (the weights a head removes)."""
    H, d, A = attn.num_heads, attn.head_dim, attn.attn_dim
    w = attn.qkv.weight.float()
    s = w.pow(2).sum(1)  # (3A,)
    if attn.qkv.bias is not None:
        s = s + attn.qkv.bias.float().pow(2)
    s = s[: 3 * A].reshape(3, H, d).sum((0, 2))
    return s + attn.proj.weight.float().pow(2).sum(0).reshape(H, d).sum(1)


@torch.no_grad()
def block_scores(model: nn.Module) -> torch.Tensor:
    """(depth,): per block the L2 norm of what its two residual branches write: proj's and fc2's
    weights, each scaled by its LayerScale where there is one."""
    out = []
    for blk in model.blocks:
        total = 0.0
        for lin, ls in ((blk.attn.proj, blk.ls1), (blk.mlp.fc2, blk.ls2)):
            w = lin.weight.float()
            gamma = getattr(ls, "gamma", None)
            if gamma is not None:
                w = w * gamma.float().unsqueeze(1)
            total += float(w.pow(2).sum())
        out.append(total**0.5)
    return torch.tensor(out)


def _spread(v: torch.Tensor) -> torch.Tensor:
    return spread(v) if v.numel() > 1 else torch.zeros_like(v)


def add_structure_gates(model: nn.Module, *, heads: bool, depth: bool, init: float, init_spread: float) -> None:
    """Give every block of a supernet being built head gates and/or a block gate (logits ``init``
    spread by :func:`head_scores` / :func:`block_scores` times ``init_spread``)."""
    if heads:
        for i, blk in enumerate(model.blocks):
            if not isinstance(blk.attn.norm, nn.Identity):
                raise SettingError(
                    f"{{head_gates}} needs attentions without a norm over the merged heads; block {i} has "
                    f"a {type(blk.attn.norm).__name__} (scale_attn_norm); search without {{head_gates}}"
                )
    z = _spread(block_scores(model)) if depth else None
    for j, blk in enumerate(model.blocks):
        w = blk.attn.qkv.weight
        if heads:
            logits = init + init_spread * _spread(head_scores(blk.attn))
            blk.attn.head_mask = DCSHeadGate(logits.to(device=w.device, dtype=w.dtype))
        if depth:
            blk.dcs_depth = nn.Parameter(
                torch.full((1,), init + init_spread * float(z[j]), device=w.device, dtype=w.dtype)
            )


class ConstantAttention(nn.Module):
    """An attention with no head left: its output is proj's bias for every token (0 MACs)."""

    qk_mask = None
    head_mask = None

    def __init__(self, bias: torch.Tensor):
        super().__init__()
        self.bias = nn.Parameter(bias.clone())

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
        # without autograd, a view of the detached bias: a view of a parameter made under no_grad requires
        # grad but has no grad_fn, which torch's module tracker (the FLOP counter, profile) cannot hook
        b = self.bias if torch.is_grad_enabled() else self.bias.detach()
        return b.expand(*x.shape[:-1], self.bias.numel())  # (B, N, C) -> (B, N, C_out)


@torch.no_grad()
def keep_heads(blk: nn.Module, keep: Any) -> None:
    """Keep the heads ``keep`` of ``blk``'s attention physically (its head gates removed): qkv's q, k
    and v rows, proj's input columns, a Q/K mask's theta of those heads; with none kept the attention
    is a :class:`ConstantAttention`."""
    a = blk.attn
    idx = as_index(keep, a.num_heads, what="heads_keep", device=a.qkv.weight.device)
    a.head_mask = None
    if len(idx) == a.num_heads:
        return
    if len(idx) == 0:
        p = a.proj
        bias = p.bias.detach() if p.bias is not None else torch.zeros(p.out_features, device=p.weight.device)
        blk.attn = ConstantAttention(bias)
        return
    qm, d = a.qk_mask, a.head_dim
    slice_heads(a, idx)
    if isinstance(qm, DCSQKMask):
        rows = (idx.unsqueeze(1) * d + torch.arange(d, device=idx.device)).flatten()
        if qm.mode == "input":
            qm.theta.weight = nn.Parameter(qm.theta.weight.detach().index_select(0, rows).clone())
            qm.theta.bias = nn.Parameter(qm.theta.bias.detach().index_select(0, rows).clone())
            qm.theta.out_features = len(rows)
        else:
            qm.theta = nn.Parameter(qm.theta.detach().index_select(0, rows).clone())
        qm.heads = len(idx)


def drop_skipped(model: nn.Module, blocks: list[dict[str, Any]]) -> None:
    """Remove the blocks whose record says ``skip`` from ``model.blocks`` (a shorter nn.Sequential)."""
    if any(rec.get("skip") for rec in blocks):
        model.blocks = nn.Sequential(*[b for b, rec in zip(model.blocks, blocks) if not rec.get("skip")])


def check_structure(rec: dict[str, Any], i: int) -> None:
    """An ``arch.json`` DCS block's ``heads_keep`` and ``skip`` (absent: all heads, not skipped)."""
    skip = rec.get("skip", False)
    if not isinstance(skip, bool):
        raise NascompressError(f"blocks[{i}].skip must be true or false, got {skip!r}")
    heads, qk = rec.get("heads_keep"), rec.get("qk_keep")
    if heads is not None and qk is not None and len(qk) != len(heads):
        raise NascompressError(
            f"blocks[{i}] keeps {len(heads)} heads (heads_keep) but qk_keep lists {len(qk)}; "
            "give one qk_keep per kept head"
        )


__all__ = [
    "ConstantAttention",
    "add_structure_gates",
    "block_scores",
    "check_structure",
    "drop_skipped",
    "head_scores",
    "keep_heads",
]
