"""Physical slicing of layers: the gather helpers that build new layers with index_select and set
the layer's metadata in the same place (Torch-Pruning's mirrored prune-in / prune-out style), and
the slicing of a block's MLP hidden neurons, of an attention's heads and of its Q/K channels (the
gathers DCS's materialization and uniform pruning share)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import NascompressError, SettingError
from .layers import NCAttention, NCBlock


# ---------------------------------------------------------------------------------------------
# Gather helpers (new modules built with index_select; metadata set in the same place)


def as_index(keep: Any, size: int, *, what: str, device: torch.device | None = None) -> torch.Tensor:
    """Sorted, unique, in-range int64 indices; errors list the bad values."""
    idx = torch.as_tensor(keep, dtype=torch.long).flatten()
    bad = [int(i) for i in idx if not 0 <= int(i) < size]
    if bad:
        more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
        raise NascompressError(f"{what}: all indices should fall into [0, {size}). Invalid indices: {bad[:5]}{more}")
    if len(set(idx.tolist())) != len(idx):
        seen: set[int] = set()
        twice = next(i for i in idx.tolist() if i in seen or seen.add(i))
        raise NascompressError(f"{what}: indices must be unique, got {twice} twice (of {len(idx)} indices)")
    return idx.sort().values.to(device)


def slice_linear_out(layer: nn.Linear, keep: torch.Tensor) -> nn.Linear:
    """A new Linear with only the output rows ``keep`` (weight and bias)."""
    new = nn.Linear(
        layer.in_features, len(keep), bias=layer.bias is not None, device=layer.weight.device, dtype=layer.weight.dtype
    )
    with torch.no_grad():
        new.weight.copy_(layer.weight.index_select(0, keep))
        if layer.bias is not None:
            new.bias.copy_(layer.bias.index_select(0, keep))
    return new


def slice_linear_in(layer: nn.Linear, keep: torch.Tensor) -> nn.Linear:
    """A new Linear that reads only the input columns ``keep`` (the bias is unchanged)."""
    new = nn.Linear(
        len(keep), layer.out_features, bias=layer.bias is not None, device=layer.weight.device, dtype=layer.weight.dtype
    )
    with torch.no_grad():
        new.weight.copy_(layer.weight.index_select(1, keep))
        if layer.bias is not None:
            new.bias.copy_(layer.bias)
    return new


def slice_layerscale(ls: nn.Module, keep: torch.Tensor) -> nn.Module:
    """LayerScale with only channels ``keep`` (an Identity stays an Identity)."""
    if isinstance(ls, nn.Identity):
        return ls
    ls.gamma = nn.Parameter(ls.gamma.detach().index_select(0, keep).clone())
    return ls


def with_zero_row(layer: nn.Linear) -> nn.Linear:
    """``layer`` with one extra all-zero output row (weight and bias) at the end."""
    new = nn.Linear(
        layer.in_features,
        layer.out_features + 1,
        bias=layer.bias is not None,
        device=layer.weight.device,
        dtype=layer.weight.dtype,
    )
    with torch.no_grad():
        new.weight.zero_()[:-1].copy_(layer.weight)
        if layer.bias is not None:
            new.bias.zero_()[:-1].copy_(layer.bias)
    return new


# ---------------------------------------------------------------------------------------------
# Physical slicing of a block's MLP hidden neurons and of an attention's Q/K channels (the gathers
# DCS's materialization and uniform pruning share)


def slice_hidden(block: NCBlock, keep: Any) -> None:
    """Keep the MLP hidden neurons ``keep``: fc1 output rows and fc2 input columns."""
    fc1 = block.mlp.fc1
    idx = as_index(keep, fc1.out_features, what="hidden_keep", device=fc1.weight.device)
    block.mlp.fc1 = slice_linear_out(fc1, idx)
    block.mlp.fc2 = slice_linear_in(block.mlp.fc2, idx)
    if not isinstance(getattr(block.mlp, "norm", nn.Identity()), nn.Identity):
        raise NascompressError("uniform pruning does not support an MLP with a hidden norm")


def slice_heads(attn: NCAttention, keep: torch.Tensor) -> NCAttention:
    """Keep the heads ``keep`` (sorted indices) of ``attn``: their q, k and v rows of qkv (and of a
    gate Linear), their proj input columns; ``num_heads`` and ``attn_dim`` follow, the head dim and
    the softmax scale stay. Before any Q/K slicing (``qk_dim`` None)."""
    if attn.qk_dim is not None:
        raise NascompressError("heads are kept before the Q/K channels are sliced (qk_dim is already set)")
    d, A = attn.head_dim, attn.attn_dim
    dev = attn.qkv.weight.device
    keep = keep.to(dev)
    cols = (keep.unsqueeze(1) * d + torch.arange(d, device=dev)).flatten()  # the kept heads' channels
    attn.qkv = slice_linear_out(attn.qkv, torch.cat([cols, cols + A, cols + 2 * A]))
    if attn.gate is not None:
        attn.gate = slice_linear_out(attn.gate, cols)
    attn.proj = slice_linear_in(attn.proj, cols)
    attn.num_heads, attn.attn_dim = len(keep), len(keep) * d
    return attn


def slice_qk(attn: NCAttention, keep_per_head: list[Any], *, width: int | None = None) -> NCAttention:
    """Keep the query/key channels ``keep_per_head[h]`` of each head h (V untouched).

    The qkv projection then emits ``[q (H * qk_dim), k (H * qk_dim), v]`` with every head's kept
    channels zero-padded to ``qk_dim``: ``width`` (e.g. the largest count rounded up to the
    alignment, :func:`~nascompress.models.layers.aligned_width`), default the largest count. The padding
    rows are zero weights, so the heads stay one batched matmul (counted as computed); how q/k
    then reach the attention kernel is the attention's ``qk_layout``."""
    if not isinstance(attn.q_norm, nn.Identity):
        raise SettingError(
            "a static Q/K mask cannot be materialized on a model with qk_norm "
            "(the norm needs every channel); search with {qk_mask} input or none"
        )
    H, d = attn.num_heads, attn.head_dim
    if len(keep_per_head) != H:
        raise NascompressError(f"qk_keep has {len(keep_per_head)} heads but the attention has {H}")
    dev, A = attn.qkv.weight.device, attn.attn_dim
    keeps = [as_index(kh, d, what=f"qk_keep of head {h}", device=dev) for h, kh in enumerate(keep_per_head)]
    kmax = max(1, *(len(kh) for kh in keeps))
    if width is not None and not kmax <= width <= d:
        raise NascompressError(
            f"the padded Q/K width {width} must hold the largest kept count {kmax} and be at most the head dim {d}"
        )
    width = kmax if width is None else width
    zero = 3 * A  # index of an all-zero row appended below qkv's rows: the padding
    q_rows = torch.cat([torch.cat([h * d + kh, kh.new_full((width - len(kh),), zero)]) for h, kh in enumerate(keeps)])
    k_rows = torch.where(q_rows == zero, q_rows, q_rows + A)
    rows = torch.cat([q_rows, k_rows, torch.arange(2 * A, 3 * A, device=dev)])
    attn.qkv = (
        slice_linear_out(with_zero_row(attn.qkv), rows) if (q_rows == zero).any() else slice_linear_out(attn.qkv, rows)
    )
    attn.qk_counts, attn.qk_dim = [len(kh) for kh in keeps], width
    attn.qk_mask = None
    return attn
