"""The one attention and the one block every method plugs into, and the small gather helpers.

:class:`NCAttention` is timm 1.0.31's ``Attention`` with hook points (a Q/K channel layout, a Q/K
mask, an attention kernel, and recorders of the CLS attention row and the values), so no method
copies the attention forward. :class:`NCBlock` is timm's ``Block`` with its two residual halves
as methods: a method overrides one half (DCS's MLP channels) or calls them with its own work
between them (token pruning), and the other method's half stays in force. :func:`to_core` turns a
plain timm ViT's blocks into these classes in place (state-dict keys unchanged); every method's
``apply`` starts with it.

The gather helpers build new layers with ``index_select`` and set the layer's metadata in the same
place (Torch-Pruning's mirrored prune-in / prune-out style).
"""
from __future__ import annotations

from . import _compat  # noqa: F401  (before timm imports torchvision)

from typing import Any

import torch
import torch.nn.functional as F
from timm.layers import Attention
from timm.layers.attention import maybe_add_mask, resolve_self_attn_mask
from timm.models.vision_transformer import Block, VisionTransformer
from torch import nn

from .errors import NascompressError

_HOOKS = {"qk_dim": None, "qk_counts": None, "qk_mask": None, "kernel": None, "record_cls": False,
          "record_values": False, "values": None, "_cls_inputs": None}


def cls_row(q: torch.Tensor, k: torch.Tensor, scale: float, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The first query's attention row, O(N d) per head: q, k (B, H, N, d) -> (B, H, N).

    ``attn_mask`` (bool, True = attend, or additive; broadcastable to (B, H, N, N)) is applied to
    that row, so this is the row the attention really computes."""
    logits = (q[:, :, :1] * scale) @ k.transpose(-2, -1)  # (B, H, 1, N)
    if attn_mask is not None:
        row = attn_mask[..., :1, :]
        logits = logits.masked_fill(~row, float("-inf")) if row.dtype == torch.bool else logits + row
    return logits.softmax(dim=-1).squeeze(2)


class ClsScore(nn.Module):
    """The class-token attention row as a (parameter-free) module, so the profiler counts it when
    it is computed: q_cls (B, H, 1, d), k (B, H, N, d) -> (B, H, N)."""

    def forward(self, q_cls: torch.Tensor, k: torch.Tensor, scale: float, attn_mask: torch.Tensor | None = None):
        return cls_row(q_cls, k, scale, attn_mask)

    def matmul_macs(self, inputs: tuple, output: torch.Tensor) -> float:
        B, H, N, d = inputs[1].shape
        return float(B * H * N * d)


class NCAttention(Attention):
    """timm ``Attention`` (forward follows timm 1.0.31) with hook points for every method.

    Modifications (each off by default, and then the forward is timm's):
        - ``qk_dim`` / ``qk_counts``: the qkv projection emits ``[q (H * qk_dim), k (H * qk_dim),
          v (attn_dim)]`` (DCS materialized: head h keeps ``qk_counts[h]`` channels, zero-padded to
          ``qk_dim`` so the heads stay one batched matmul).
        - ``qk_mask``: a module ``(x) -> mask | None`` multiplied into q and k after q_norm/k_norm,
          broadcastable to (B, H, N, d_qk) (DCS supernet). V is never masked.
        - ``kernel``: a module ``(q, k, v, *, attn_mask, scale, dropout_p) -> (B, H, N, d_v)`` that
          computes the attention instead of SDPA (Sparsifiner); it reports its MACs with ``last_macs()``.
        - ``record_cls``: keep the first query and the keys, so that :meth:`cls_attention` returns the
          class-token attention row as computed (masks included), for EViT and MG-ViT; O(N d) and
          only when asked for, so the fused kernel is kept and an unused row costs nothing.
        - ``record_values``: keep ``values`` (B, H, N, d_v) (MG-ViT's PPSM).
        - the softmax scale is always the original ``head_dim ** -0.5``.
    """

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv output (B, N, ...) -> q, k (B, H, N, d_qk) and v (B, H, N, head_dim)."""
        B, N, _ = qkv.shape
        H = self.num_heads
        if self.qk_dim is None:  # timm's layout; q/k/v stay strided views of one tensor
            return qkv.reshape(B, N, 3, H, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        S = H * self.qk_dim
        q, k, v = qkv.split([S, S, self.attn_dim], dim=-1)
        return (q.reshape(B, N, H, self.qk_dim).transpose(1, 2), k.reshape(B, N, H, self.qk_dim).transpose(1, 2),
                v.reshape(B, N, H, self.head_dim).transpose(1, 2))

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
        B, N, _ = x.shape
        gate = self.gate(x).sigmoid() if self.gate is not None else None
        q, k, v = self.split_qkv(self.qkv(x))
        q, k = self.q_norm(q), self.k_norm(k)
        if self.qk_mask is not None:
            m = self.qk_mask(x)
            if m is not None:
                q, k = q * m, k * m
        if self.record_cls:
            self._cls_inputs = (q[:, :, :1], k, None if attn_mask is None else attn_mask[..., :1, :])
        if self.record_values:
            self.values = v
        drop = self.attn_drop.p if self.training else 0.0
        if self.kernel is not None:
            if is_causal:
                raise NotImplementedError(f"{type(self.kernel).__name__} is for bidirectional ViTs (no is_causal)")
            o = self.kernel(q, k, v, attn_mask=attn_mask, scale=self.scale, dropout_p=drop)
        elif self.fused_attn:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=drop, is_causal=is_causal,
                                               scale=self.scale)
        else:
            scores = (q * self.scale) @ k.transpose(-2, -1)
            scores = maybe_add_mask(scores, resolve_self_attn_mask(N, scores, attn_mask, is_causal))
            o = self.attn_drop(scores.softmax(dim=-1)) @ v
        o = self.norm(o.transpose(1, 2).reshape(B, N, self.attn_dim))
        if gate is not None:
            o = o * gate
        return self.proj_drop(self.proj(o))

    def matmul_macs(self, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> float:
        """QK^T and AV (or what the kernel computed), whole batch."""
        B, N, _ = inputs[0].shape
        d_qk = self.qk_dim or self.head_dim
        if self.kernel is not None:
            macs = float(self.kernel.last_macs())
        else:
            macs = float(B * self.num_heads * N * N * (d_qk + self.head_dim))
        return macs

    def cls_attention(self) -> torch.Tensor:
        """The class-token attention row of the last forward (B, H, N) (needs ``record_cls``)."""
        q_cls, k, mask = self._cls_inputs
        self._cls_inputs = None
        return self.cls_score(q_cls, k, self.scale, mask)


class NCBlock(Block):
    """timm ``Block`` (timm 1.0.31) with the two residual halves as methods.

    Modifications: ``forward(x) = mlp_half(attn_half(x))``; a subclass owns its halves (DCS's MLP
    channels), a method mixin calls them (token pruning between the halves).
    """

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
        return self.mlp_half(self.attn_half(x, attn_mask=attn_mask, is_causal=is_causal))

    def attn_half(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
        return x + self.drop_path1(self.ls1(self.attn(self.norm1(x), attn_mask=attn_mask, is_causal=is_causal)))

    def mlp_half(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))


def core_attention(attn: nn.Module, *, where: str = "attention") -> NCAttention:
    """Turn a timm ``Attention`` into an :class:`NCAttention` in place (no-op if it already is one)."""
    if isinstance(attn, NCAttention):
        return attn
    if type(attn) is not Attention:
        raise NascompressError(f"{where} is a {type(attn).__name__}; nascompress patches timm's Attention "
                               "(vit_*/deit_* models with standard blocks)")
    attn.__class__ = NCAttention
    for k, v in _HOOKS.items():
        setattr(attn, k, v)
    attn.cls_score = ClsScore()  # no parameters: the state dict is unchanged
    return attn


def to_core(model: nn.Module, *, method: str) -> VisionTransformer:
    """Make every block of a timm ViT an :class:`NCBlock` with an :class:`NCAttention`, in place.

    Idempotent: blocks already patched by a method (subclasses of NCBlock) are kept as they are.
    """
    if not isinstance(model, VisionTransformer):
        raise NascompressError(f"{method} needs a timm VisionTransformer (vit_*, deit_*), got {type(model).__name__}")
    for i, blk in enumerate(model.blocks):
        if not isinstance(blk, NCBlock):
            if type(blk) is not Block:
                raise NascompressError(f"{method} patches timm's standard Block; blocks.{i} is a "
                                       f"{type(blk).__name__} (parallel/post-norm blocks are not supported)")
            blk.__class__ = NCBlock
        core_attention(blk.attn, where=f"blocks.{i}.attn")
    return model


# ---------------------------------------------------------------------------------------------
# Hardware-aligned widths

DEFAULT_ALIGN = 8  # cuBLAS and the fused attention kernels leave their fast paths below multiples of 8


def aligned_width(n: int, *, align: int, full: int, mode: str = "up") -> int:
    """The width a kept count ``n`` (of ``full`` channels) becomes under alignment ``align``.

    Every width a compressed model gets is 0, ``full`` (the untouched layer) or a multiple of
    ``align``: ``mode="up"`` rounds up (never fewer channels than asked), ``"down"`` rounds down,
    ``"nearest"`` to the closer multiple (ties up). The result is clipped to ``[0, full]``, and a
    result of 0 is only returned for ``n == 0`` with ``mode="up"`` (a kept layer keeps at least one
    aligned group). ``align=1`` returns ``n`` unchanged.
    """
    if align < 1:
        raise NascompressError(f"align must be a positive integer, got {align!r}")
    if not 0 <= n <= full:
        raise NascompressError(f"a kept count must be in [0, {full}], got {n}")
    if align == 1 or n in (0, full):
        return n
    lo, hi = (n // align) * align, -(-n // align) * align
    if mode == "up":
        w = hi
    elif mode == "down":
        w = lo
    elif mode == "nearest":
        w = hi if n - lo >= hi - n else lo
    else:
        raise NascompressError(f"mode must be up, down or nearest, got {mode!r}")
    return min(w, full)


# ---------------------------------------------------------------------------------------------
# Gather helpers (new modules built with index_select; metadata set in the same place)


def as_index(keep: Any, size: int, *, what: str, device: torch.device | None = None) -> torch.Tensor:
    """Sorted, unique, in-range int64 indices; errors list the bad values."""
    idx = torch.as_tensor(keep, dtype=torch.long).flatten()
    bad = [int(i) for i in idx if not 0 <= int(i) < size]
    if bad:
        raise NascompressError(f"{what}: all indices should fall into [0, {size}). Invalid indices: {bad}")
    if len(set(idx.tolist())) != len(idx):
        raise NascompressError(f"{what}: indices must be unique, got {idx.tolist()}")
    return idx.sort().values.to(device)


def slice_linear_out(layer: nn.Linear, keep: torch.Tensor) -> nn.Linear:
    """A new Linear with only the output rows ``keep`` (weight and bias)."""
    new = nn.Linear(layer.in_features, len(keep), bias=layer.bias is not None,
                    device=layer.weight.device, dtype=layer.weight.dtype)
    with torch.no_grad():
        new.weight.copy_(layer.weight.index_select(0, keep))
        if layer.bias is not None:
            new.bias.copy_(layer.bias.index_select(0, keep))
    return new


def slice_linear_in(layer: nn.Linear, keep: torch.Tensor) -> nn.Linear:
    """A new Linear that reads only the input columns ``keep`` (the bias is unchanged)."""
    new = nn.Linear(len(keep), layer.out_features, bias=layer.bias is not None,
                    device=layer.weight.device, dtype=layer.weight.dtype)
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
    new = nn.Linear(layer.in_features, layer.out_features + 1, bias=layer.bias is not None,
                    device=layer.weight.device, dtype=layer.weight.dtype)
    with torch.no_grad():
        new.weight.zero_()[:-1].copy_(layer.weight)
        if layer.bias is not None:
            new.bias.zero_()[:-1].copy_(layer.bias)
    return new


__all__ = ["DEFAULT_ALIGN", "aligned_width", "NCAttention", "NCBlock", "ClsScore", "to_core", "core_attention", "cls_row", "as_index", "slice_linear_in",
           "slice_linear_out", "slice_layerscale", "with_zero_row"]
