"""DCS materialization's physical gather (:mod:`.dcs` applies it per block, and re-exports it): the
residual family's :func:`slice_mlp` into a :class:`MaterializedBlock`, the hidden family's
:func:`slice_hidden_gates` (a :class:`ConstantMLP` where no neuron is left), and :func:`drop_gates`,
which removes a supernet block's gate parameters and buffers."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..models.layers import NCBlock
from ..models.slicing import as_index, slice_hidden, slice_layerscale, slice_linear_in, slice_linear_out


class ConstantMLP(nn.Module):
    """A hidden-gated MLP with no neuron left: its output is fc2's bias for every token (0 MACs)."""

    def __init__(self, bias: torch.Tensor):
        super().__init__()
        self.bias = nn.Parameter(bias.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, N, C) -> (B, N, C_out)
        # without autograd, a view of the detached bias: a view of a parameter made under no_grad requires
        # grad but has no grad_fn, which torch's module tracker (the FLOP counter, profile) cannot hook
        b = self.bias if torch.is_grad_enabled() else self.bias.detach()
        return b.expand(*x.shape[:-1], self.bias.numel())


class MaterializedBlock(NCBlock):
    """:class:`NCBlock` whose MLP reads and writes only the DCS-selected residual channels.

    Modifications: ``h = norm2(x)[..., keep]``; ``x = x.index_add(-1, keep, drop_path2(ls2(mlp(h))))``;
    fc1 has ``len(keep)`` inputs, fc2 ``len(keep)`` outputs, ls2 ``len(keep)`` channels; with no
    channel kept the MLP is gone (``mlp = ls2 = Identity``) and skipped.
    """

    def mlp_half(self, x: torch.Tensor) -> torch.Tensor:
        keep = self.mlp_keep
        if keep.numel() == 0:
            return x
        B, N, C = x.shape
        # Gather/scatter on a 2-D (B*N, C) view: several times faster on CPU than along dim -1 of 3-D.
        h = self.norm2(x).reshape(B * N, C).index_select(1, keep).reshape(B, N, -1)  # (B, N, len(keep))
        y = self.drop_path2(self.ls2(self.mlp(h))).reshape(B * N, -1).to(x.dtype)  # bf16 under autocast: x's dtype
        if torch.is_grad_enabled() and (x.requires_grad or y.requires_grad):
            return x.reshape(B * N, C).index_add(1, keep, y).reshape(B, N, C)
        return x.reshape(B * N, C).index_add_(1, keep, y).reshape(B, N, C)  # inference: x is this block's own


def drop_gates(block: NCBlock) -> None:
    for name in ("dcs_alpha", "dcs_fill", "dcs_protect", "dcs_depth"):
        if hasattr(block, name):
            delattr(block, name)


def slice_mlp(block: NCBlock, keep: Any) -> NCBlock:
    """Gather the MLP residual channels ``keep`` of ``block`` physically (see :class:`MaterializedBlock`).

    With every channel kept the block is a plain :class:`NCBlock` (no gather, no write-back).
    """
    C = block.mlp.fc1.in_features
    idx = as_index(keep, C, what="mlp_keep", device=block.mlp.fc1.weight.device)
    drop_gates(block)
    if len(idx) == C:
        block.__class__ = NCBlock
        return block
    if len(idx) == 0:
        block.mlp, block.ls2 = nn.Identity(), nn.Identity()
    else:
        block.mlp.fc1 = slice_linear_in(block.mlp.fc1, idx)
        block.mlp.fc2 = slice_linear_out(block.mlp.fc2, idx)
        block.ls2 = slice_layerscale(block.ls2, idx)
    block.__class__ = MaterializedBlock
    block.register_buffer("mlp_keep", idx, persistent=False)
    return block


@torch.no_grad()
def slice_hidden_gates(block: NCBlock, keep: Any) -> NCBlock:
    """Keep the MLP hidden neurons ``keep`` of ``block`` physically (fc1 rows, fc2 columns; a plain
    :class:`NCBlock`, no gather). A supernet block's ``dcs_fill`` of the closed neurons is folded
    into fc2's bias first, so the result equals the eval-mode supernet block."""

    fc1, fc2 = block.mlp.fc1, block.mlp.fc2
    idx = as_index(keep, fc1.out_features, what="hidden_keep", device=fc1.weight.device)
    fill = getattr(block, "dcs_fill", None)
    if fill is not None and len(idx) < fc1.out_features:
        closed = torch.ones(fc1.out_features, dtype=torch.bool, device=idx.device)
        closed[idx] = False
        shift = fc2.weight[:, closed] @ fill[closed]  # (C,)
        if fc2.bias is None:
            fc2.bias = nn.Parameter(torch.zeros(fc2.out_features, device=shift.device, dtype=fc2.weight.dtype))
        fc2.bias.add_(shift.to(fc2.bias.dtype))
    drop_gates(block)
    block.__class__ = NCBlock
    if len(idx) == 0:  # no hidden neuron left: the MLP is fc2's bias (the fill folded in), a constant
        block.mlp = ConstantMLP(fc2.bias.detach() if fc2.bias is not None else torch.zeros(fc2.out_features))
    elif len(idx) < fc1.out_features:
        slice_hidden(block, idx)
    return block
