"""Sparsifiner's block layout and block predictor (pure functions of :mod:`.block_sparse`, which
re-exports them): :class:`BlockLayout` and its planning (:func:`plan_blocks`, :func:`auto_block_size`),
the per-block sums, and the predictor's tile scores and kept key blocks (:func:`predict_blocks`),
without ever building the n x n map."""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# ---------------------------------------------------------------------------------------------
# Layout


@dataclass(frozen=True)
class BlockLayout:
    """Blocks over the patch tokens of an ``n``-token sequence with ``prefix`` leading tokens.

    ``bs`` tokens per block, ``nb`` blocks (the last one ``last`` tokens long), ``keep`` kept key
    blocks per query block.
    """

    n: int
    prefix: int
    bs: int
    nb: int
    keep: int

    @property
    def n_patch(self) -> int:
        return self.n - self.prefix

    @property
    def last(self) -> int:
        return self.n_patch - (self.nb - 1) * self.bs

    @property
    def exact(self) -> bool:
        return self.last == self.bs

    @property
    def sparse(self) -> bool:
        """False when the layout keeps every block (then attention is dense)."""
        return self.nb >= 2 and self.keep < self.nb


CUDA_FLEX_MULTIPLE = 16  # Inductor's CUDA flex kernel tiles blocks by BLOCK_M / BLOCK_N >= 16 dividing them


def auto_block_size(n_patch: int, multiple: int = 1) -> int:
    """Block side for ``n_patch`` patch tokens: a divisor of ``n_patch`` near n_patch / 8 in [4, 128],
    a multiple of ``multiple`` (16 for the CUDA flex kernel).

    196 -> 28 (7 blocks), 784 -> 98 (8 blocks), 3136 -> 112 (28 blocks), 49 -> 7; with multiple 16:
    196 -> 32, 784 -> 112, 3136 -> 112. Without a divisor within a factor 1.5 of the target, the
    target itself rounded to ``multiple`` (the last block is then short).
    """
    target = min(128.0, max(4.0, n_patch / 8))
    divs = [b for b in range(max(4, multiple), min(128, n_patch) + 1) if n_patch % b == 0 and b % multiple == 0]
    if divs:
        best = min(divs, key=lambda b: abs(math.log(b / target)))
        if abs(math.log(best / target)) <= math.log(1.5):
            return best
    return max(multiple, min(n_patch, int(round(target / multiple)) * multiple))


def plan_blocks(n: int, prefix: int, budget: int, block_size: int | None = None, *, multiple: int = 1) -> BlockLayout:
    """The block layout for ``n`` tokens and a per-query budget of ``budget`` keys; the block side
    is ``block_size`` or :func:`auto_block_size` (a multiple of ``multiple``)."""
    n_patch = n - prefix
    bs = min(block_size or auto_block_size(n_patch, multiple), max(n_patch, 1))
    nb = math.ceil(n_patch / bs) if n_patch > 0 else 0
    keep = min(nb, max(1, math.ceil((budget - prefix) / bs - 1e-9)))
    return BlockLayout(n=n, prefix=prefix, bs=bs, nb=nb, keep=keep)


def block_sizes(layout: BlockLayout, *, device=None) -> torch.Tensor:
    s = torch.full((layout.nb,), float(layout.bs), device=device)
    s[-1] = layout.last
    return s


def pool_patch_rows(x: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """Sum the patch rows of ``x`` (..., n, r) per block -> (..., nb, r) (prefix rows dropped)."""
    return _block_sum(x[..., layout.prefix :, :], layout)


def _block_sum(x: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """(..., n_patch, r) -> (..., nb, r): rows summed per block."""
    pad = layout.nb * layout.bs - layout.n_patch
    if pad:
        x = F.pad(x, (0, 0, 0, pad))
    return x.reshape(*x.shape[:-2], layout.nb, layout.bs, x.shape[-1]).sum(-2)


# ---------------------------------------------------------------------------------------------
# Block predictor


def _strict_above(tau: float) -> float:
    """The smallest float32 strictly above float32(tau) >= 0: ``a > tau`` == ``a >= _strict_above(tau)``."""
    bits = struct.unpack("<I", struct.pack("<f", tau))[0]
    return struct.unpack("<f", struct.pack("<I", bits + 1))[0]


def pooled_basis(w_up: torch.Tensor, w_thresh: float, layout: BlockLayout) -> torch.Tensor:
    """W_up (H, r, n) thresholded (|w| <= w_thresh -> 0) and summed per patch key block -> (H, r, nb)."""
    basis = torch.where(w_up.abs() > w_thresh, w_up, 0.0)
    return pool_patch_rows(basis.transpose(-2, -1), layout).transpose(-2, -1)


def block_scores(coef: torch.Tensor, basis_pooled: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """Tile scores (B, H, nb, nb): S = coef @ W_up summed over (patch query block, patch key block).

    Args:
        coef: (B, H, n, r) thresholded coefficients (prefix rows ignored).
        basis_pooled: (H, r, nb) from :func:`pooled_basis`.
    """
    return pool_patch_rows(coef, layout) @ basis_pooled


def top_blocks(scores: torch.Tensor, keep: int) -> torch.Tensor:
    """Indices of the ``keep`` best key blocks per query block, ascending (B, H, nb, keep) int64."""
    return scores.topk(keep, dim=-1, sorted=False).indices.sort(dim=-1).values


def predict_blocks(
    q: torch.Tensor,
    k: torch.Tensor,
    w_down: torch.Tensor,
    basis_pooled: torch.Tensor,
    *,
    scale: float,
    tau: float,
    layout: BlockLayout,
) -> torch.Tensor:
    """Sparsifiner's predictor at block resolution -> kept key blocks (B, H, nb, keep).

    A_down = softmax(Q (W_down K)^T * scale) for the patch query rows only (prefix rows are dense);
    coefficients ``A_down > tau`` (a row keeps at least its maximum: one compare against
    ``min(row max, next float above tau)``); tile scores and top blocks as above. No n x n tensor.
    """
    k_down = (w_down @ k).mul_(scale)  # (B, H, r, d), the scale folded into the r rows
    a = (q[..., layout.prefix :, :] @ k_down.transpose(-2, -1)).softmax(-1)  # (B, H, n_p, r)
    thr = a.amax(-1, keepdim=True).clamp_(max=_strict_above(tau))
    coef = a.masked_fill_(a < thr, 0.0)
    return top_blocks(_block_sum(coef, layout) @ basis_pooled, layout.keep)
