"""Equivalent forms of inference paths that do not export well, swapped in at export time.

Every other inference path is traced as it is (EViT's sort and token gathers, DynamicViT's top-k,
uniform's and DCS's sliced layers, DCS's channel gathers): the selections become real ``TopK`` /
``Gather`` ops. Three paths are replaced, each by one that computes the same values:

* DCS's MLP write-back ``x.index_add(-1, keep, y)`` traces to a ``ScatterND`` with ``reduction="add"``,
  which ONNX Runtime's CPU provider does not run in fp16. :class:`GatherAddMLP` writes the same
  values with a gather: ``x + [y, 0][..., place]`` (``place[c]``: the position of channel c in
  ``keep``, or the zero column); measured as fast as the scatter in fp32 (DeiT-S, ORT CPU).
* Sparsifiner's block mode at inference reads K and V straight from the qkv projection's memory
  (``as_strided`` over the untyped storage), gathers into per-thread reused buffers (``out=``)
  and caches the pooled W_up basis keyed on data pointers: none of it can be traced.
  :class:`TraceableBlockSparse` computes the same attention with the same kept blocks from plain
  ops: the same block predictor (:func:`~nascompress.methods.block_sparse.predict_blocks` on the pooled
  basis, computed in the graph), then :func:`gathered_block_attention` (one ``index_select`` of each
  query block's prefix keys and kept key blocks from contiguous K / V, one SDPA over the query
  blocks, the prefix query rows dense). The unstructured mode and training are the kernel's own.
* PPSM's boundary merge (``mgvit``'s :class:`~nascompress.methods.mgvit.PPSM`, ``mgvit-h``'s
  :class:`~nascompress.methods.mgvit_h.GroupSlim`) adds each A token into its B token with
  ``scatter_add``: an ONNX ``ScatterElements`` with ``reduction="add"``, which ONNX Runtime's CPU
  provider does not run in fp16 either. :class:`ScatterFreeMerge` makes them add with a one-hot
  matmul (:func:`~nascompress.methods.mgvit_ops.match_merge` with ``scatter=False``: the same sums).

:func:`traceable_copy` returns an eval-mode copy of a model with these mixins put over the
classes they replace (``__class__`` only: parameters, buffers and state-dict keys are the model's;
a token method's class over a DCS block keeps its own forward).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from ..methods import block_sparse
from ..methods.dcs_materialize import MaterializedBlock
from ..methods.mgvit_modules import PPSM
from ..methods.mgvit_h_modules import GroupSlim
from ..methods.sparsifiner_kernel import SparsifinerKernel, attention_budget, combine_masks, masked_attention
from ..methods.tokens import patched_class


def gathered_block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    idx: torch.Tensor,
    layout: "block_sparse.BlockLayout",
    *,
    scale: float,
) -> torch.Tensor:
    """Attention over the prefix keys and the kept key blocks ``idx`` with plain ops.

    Args:
        q, k: (B, H, n, d); v: (B, H, n, d_v); idx: (B, H, nb, keep) kept key blocks per query block.
    Returns:
        (B, H, n, d_v), equal to ``block_sparse.masked_block_attention`` with the same ``idx``.
    """
    B, H, n, d = q.shape
    dv = v.shape[-1]
    p, bs, nb = layout.prefix, layout.bs, layout.nb
    rows, pad_mask = block_sparse.gather_index(idx, layout, (H * n, n, 1))  # row strides of contiguous (B, H, n)
    L = rows.numel() // (B * H * nb)
    ks = k.reshape(B * H * n, d).index_select(0, rows).view(B, H * nb, L, d)
    vs = v.reshape(B * H * n, dv).index_select(0, rows).view(B, H * nb, L, dv)
    qp = q[:, :, p:]
    if not layout.exact:  # a short last block: padding query rows, discarded below
        qp = F.pad(qp, (0, 0, 0, nb * bs - layout.n_patch))
    o = F.scaled_dot_product_attention(qp.reshape(B, H * nb, bs, d), ks, vs, attn_mask=pad_mask, scale=scale)
    o = o.view(B, H, nb * bs, dv)[:, :, : layout.n_patch]
    if p:
        o = torch.cat([F.scaled_dot_product_attention(q[:, :, :p], k, v, scale=scale), o], dim=2)
    return o


class GatherAddMLP:
    """Mixin over :class:`MaterializedBlock` (or a token method's class over it): the MLP result is
    added back by a gather instead of a scatter.

    Modifications: ``mlp_half(x) = x + pad(mlp(norm2(x)[..., keep]), 1 zero column)[..., place]``
    with the non-persistent buffer ``mlp_place`` (C,) set by :func:`traceable_copy`; equal to
    ``x.index_add(-1, keep, y)`` value for value (the other channels add an exact 0).
    """

    def mlp_half(self, x: torch.Tensor) -> torch.Tensor:
        keep = self.mlp_keep
        if keep.numel() == 0:
            return x
        y = self.drop_path2(self.ls2(self.mlp(self.norm2(x).index_select(-1, keep))))  # (B, N, len(keep))
        return x + F.pad(y, (0, 1)).index_select(-1, self.mlp_place)


def _place(keep: torch.Tensor, channels: int) -> torch.Tensor:
    """(C,) int64: the position of each channel in ``keep``, or ``len(keep)`` (the zero column)."""
    place = torch.full((channels,), len(keep), dtype=torch.long, device=keep.device)
    place[keep] = torch.arange(len(keep), device=keep.device)
    return place


class ScatterFreeMerge:
    """Mixin over mgvit's ``PPSM`` and mgvit-h's ``GroupSlim``: PPSM's boundary merge by a one-hot
    matmul instead of ``scatter_add`` (the same sums; module docstring)."""

    merge_scatter = False


class TraceableBlockSparse:
    """Mixin over :class:`SparsifinerKernel`: its block-mode inference path traces (see the module docstring).

    Modifications: in eval mode, ``mode="block"`` computes the pooled basis in the graph and attends
    with :func:`gathered_block_attention` (with an external mask, e.g. ToMe's size bias, the
    kernel's masked path on the same kept blocks); anything else is the kernel's own forward.
    """

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        attn_mask: torch.Tensor | None = None,
        scale: float,
        dropout_p: float = 0.0,
    ) -> torch.Tensor:
        cfg = self.cfg
        if cfg.mode != "block" or self.training:
            return super().forward(q, k, v, attn_mask=attn_mask, scale=scale, dropout_p=dropout_p)
        n = q.shape[2]
        budget = attention_budget(cfg.attn_keep_ratio, n, None if cfg.budget is None else min(cfg.budget, n))
        layout = block_sparse.plan_blocks(n, self.prefix, budget, cfg.block_size)
        if budget >= n or not layout.sparse:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)
        basis = block_sparse.pooled_basis(self.w_up[..., :n], cfg.w_thresh, layout)
        idx = block_sparse.predict_blocks(q, k, self.w_down[..., :n], basis, scale=scale, tau=cfg.tau, layout=layout)
        if attn_mask is not None:  # an external mask (ToMe's size bias): the kernel's masked path, traced
            return masked_attention(
                q, k, v, combine_masks(block_sparse.dense_block_mask(idx, layout), attn_mask), scale=scale
            )
        return gathered_block_attention(q, k, v, idx, layout, scale=scale)


_SWAPS = (
    (MaterializedBlock, GatherAddMLP),
    (SparsifinerKernel, TraceableBlockSparse),
    (PPSM, ScatterFreeMerge),
    (GroupSlim, ScatterFreeMerge),
)
TraceableSparsifiner = patched_class(SparsifinerKernel, TraceableBlockSparse, "Traceable")


def x_channels(block: nn.Module) -> int:
    """The residual width C of a block (what its attention projects back to)."""
    return block.attn.proj.out_features


def traceable_copy(model: nn.Module, *, dtype: torch.dtype = torch.float32) -> nn.Module:
    """An eval-mode, gradient-free copy of ``model`` in ``dtype`` with the traceable forms swapped in."""
    m = copy.deepcopy(model).eval().to(dtype)
    for p in m.parameters():
        p.requires_grad_(False)
    for mod in m.modules():
        for base, mixin in _SWAPS:
            if isinstance(mod, base) and not isinstance(mod, mixin):
                mod.__class__ = patched_class(type(mod), mixin, "Traceable")
                if mixin is GatherAddMLP:
                    mod.register_buffer("mlp_place", _place(mod.mlp_keep, x_channels(mod)), persistent=False)
    return m


__all__ = [
    "GatherAddMLP",
    "ScatterFreeMerge",
    "TraceableBlockSparse",
    "TraceableSparsifiner",
    "gathered_block_attention",
    "traceable_copy",
]
