"""Sparsifiner's attention kernel (:mod:`.sparsifiner`'s method patches it into every
:class:`~nascompress.models.layers.NCAttention`, and re-exports these names): the settings it reads
(:class:`SparsifinerConfig`, the method's config), the pure tensor functions of the predictor and
the sparse attention, and :class:`SparsifinerKernel` itself."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..config import Config, check_choice, check_int, check_range, check_settings, field_name, setting
from ..errors import NascompressError
from ..models.layers import attention
from . import block_sparse

MODES = ("unstructured", "block")
KERNELS = ("gather", "flex", "masked")


@dataclass(frozen=True)
class SparsifinerConfig(Config):
    """Settings of the sparse attention (recorded in arch.json).

    Args:
        attn_keep_ratio: keep ratio in (0, 1]; budget B = ceil(ratio * n) keys per query.
        budget: a fixed budget B in [1, n] instead of the ratio (None: from the ratio).
        n_down: rank of the token-axis projection (capped at the model's token count).
        tau: threshold on A_down; w_thresh: magnitude threshold on W_up.
        mode: ``unstructured`` (the paper's per-query top-k) or ``block`` (top key blocks).
        block_size: block side in patch tokens for ``block`` (None: a divisor of the patch count
            near 1/8 of it, see ``block_sparse.auto_block_size``; with ``kernel="flex"`` a multiple of 16,
            and on CUDA an explicit value that is not is refused).
        kernel: ``block`` inference kernel: ``gather`` (gathered kept blocks + fused SDPA, the
            fastest on CPU), ``flex`` (compiled FlexAttention with a BlockMask) or ``masked``.
    """

    attn_keep_ratio: float = setting(
        0.25,
        lo=0,
        hi=1,
        lo_open=True,
        help=("Sparsifiner attention keep ratio in (0, 1]: keys kept per query = ceil(ratio x tokens)."),
    )
    budget: int | None = None
    n_down: int = 32
    tau: float = 0.05
    w_thresh: float = 1e-2
    mode: str = "unstructured"
    block_size: int | None = None
    kernel: str = "gather"

    def __post_init__(self) -> None:
        check_settings(self, name=field_name)  # every setting() against its declaration; below: the rest
        if self.budget is not None:
            check_int("budget", self.budget, 1)
        check_int("n_down", self.n_down, 1)
        check_range("tau", self.tau, 0, 1, hi_open=True)
        check_range("w_thresh", self.w_thresh, 0)
        check_choice("mode", self.mode, MODES)
        if self.block_size is not None:
            check_int("block_size", self.block_size, 1)
        check_choice("kernel", self.kernel, KERNELS)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None, *, what: str | None = None) -> "SparsifinerConfig":
        d = dict(d or {})
        if "flex" in d and "kernel" not in d:  # arch.json files written before the kernel option
            d["kernel"] = "gather" if d.pop("flex") else "masked"
        return super().from_dict(d, what=what or "sparsifiner")


# ---------------------------------------------------------------------------------------------
# Pure tensor functions


def attention_budget(keep_ratio: float, n: int, budget: int | None = None) -> int:
    """Keys kept per query: ``budget`` if given, else ceil(keep_ratio * n); must be in [1, n]."""
    if budget is None:
        if not 0 < keep_ratio <= 1:
            raise NascompressError(f"attn_keep_ratio must be in (0, 1], got {keep_ratio!r}")
        return max(1, math.ceil(keep_ratio * n - 1e-6))
    if not 1 <= budget <= n:
        raise NascompressError(f"attention budget {budget} is larger than the token count: valid range 1..{n}")
    return budget


def lowrank_attention(q: torch.Tensor, k: torch.Tensor, w_down: torch.Tensor, scale: float) -> torch.Tensor:
    """A_down = softmax(Q (W_down K)^T * scale): q, k (B, H, n, d), w_down (H, r, n) -> (B, H, n, r)."""
    k_down = w_down @ k  # (B, H, r, d)
    return ((q * scale) @ k_down.transpose(-2, -1)).softmax(dim=-1)


def sparse_coefficients(a_down: torch.Tensor, tau: float) -> torch.Tensor:
    """Zero entries of A_down (B, H, n, r) that are <= tau; each row keeps at least its maximum."""
    keep = (a_down > tau) | (a_down == a_down.amax(dim=-1, keepdim=True))
    return a_down * keep


def sparse_basis(w_up: torch.Tensor, thresh: float) -> torch.Tensor:
    """W_up (H, r, n) with entries |w| <= thresh set to zero."""
    return w_up * (w_up.abs() > thresh)


def topk_mask(scores: torch.Tensor, budget: int, *, full_rows: int = 0) -> torch.Tensor:
    """Bool connectivity mask (B, H, n, n): the ``budget`` best keys of each row of ``scores``.

    The first ``full_rows`` rows (CLS / prefix queries) keep every key.
    """
    n = scores.shape[-1]
    budget = attention_budget(1.0, n, budget)
    idx = scores.topk(budget, dim=-1, sorted=False).indices
    mask = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, idx, True)
    if full_rows:
        mask[..., :full_rows, :] = True
    return mask


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, *, scale: float, dropout_p: float = 0.0
) -> torch.Tensor:
    """Softmax over the kept entries of each row only: q, k, v (B, H, n, d), mask (B, H, n, n) bool
    (or additive, when an external mask is combined in)."""
    return attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale)


def combine_masks(mask: torch.Tensor, attn_mask: torch.Tensor | None) -> torch.Tensor:
    """The sparse bool mask (True = attend) AND an external bool / additive ``attn_mask``."""
    if attn_mask is None:
        return mask
    if attn_mask.dtype == torch.bool:
        return mask & attn_mask
    return torch.where(mask, attn_mask, float("-inf")).to(attn_mask.dtype)


def region_init(n: int, n_down: int, *, prefix: int, grid: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-shot predictor: (W_down, W_up), each (n_down, n), from spatial regions.

    Prefix tokens form region 0; patches are split into a gh x gw grid of regions (or contiguous
    runs when the tokens are not a grid). W_down averages each region's keys, W_up gives each
    token 1/|region| of its region's coefficient. Unused rows stay zero.
    """
    m = n_down - (1 if prefix and n_down > 1 else 0)
    n_patch = n - prefix
    if grid is not None and grid[0] * grid[1] == n_patch:
        H, W = grid
        gh = max(1, min(H, math.isqrt(m)))
        gw = max(1, min(W, m // gh))
        ys, xs = torch.meshgrid(torch.arange(H), torch.arange(W), indexing="ij")
        reg = ((ys * gh) // H) * gw + (xs * gw) // W
        reg = reg.flatten()
    else:
        reg = torch.arange(n_patch) * m // max(n_patch, 1)
    reg = reg + (n_down - m)
    reg = torch.cat([torch.zeros(prefix, dtype=torch.long), reg]) if prefix else reg
    onehot = F.one_hot(reg, n_down).T.float()  # (r, n)
    onehot = onehot / onehot.sum(-1, keepdim=True).clamp(min=1)
    return onehot.clone(), onehot.clone()


def unstructured_macs(
    *,
    batch: int,
    heads: int,
    n: int,
    head_dim: int,
    v_dim: int,
    n_down: int,
    budget: int,
    prefix: int,
    product_macs: float,
) -> float:
    """MACs of one Sparsifiner attention (whole batch) in the paper's accounting.

    predictor: W_down K (r n d) + Q K_down^T (n r d) per head, plus ``product_macs`` (the sparse
    C @ W_up, over all heads and images); attention: QK^T (d) and AV (d_v) on nnz(M) entries.
    """
    nnz = (n - prefix) * budget + prefix * n
    return batch * heads * (2 * n_down * n * head_dim + (head_dim + v_dim) * nnz) + product_macs


# ---------------------------------------------------------------------------------------------
# The attention kernel (plugged into NCAttention.kernel)


class SparsifinerKernel(nn.Module):
    """Sparsifiner's attention for one layer: the connectivity predictor and the sparse attention.

    Parameters ``w_down`` / ``w_up`` (H, n_down, n_tokens), so their keys are
    ``blocks.<i>.attn.kernel.w_down``. Called by :class:`~nascompress.models.layers.NCAttention` with the
    q/k/v it computed (after DCS masks, any head dims). A budget >= n falls back to dense fused
    SDPA (identical to timm). ``recon`` (stage 1, training only): dense attention, and the
    predictor's reconstruction loss against it is left in ``recon_loss``.
    """

    def __init__(self, cfg: SparsifinerConfig, w_down: torch.Tensor, w_up: torch.Tensor, prefix: int):
        super().__init__()
        self.w_down, self.w_up = nn.Parameter(w_down), nn.Parameter(w_up)
        self.cfg, self.prefix, self.recon = cfg, prefix, False
        self.recon_loss: torch.Tensor | None = None
        self._macs: float | None = 0.0
        self._density = 1.0
        self._block_stats: tuple | None = None
        self._unstructured_stats: tuple | None = None

    def _dense(self, q, k, v, attn_mask, scale, dropout_p) -> torch.Tensor:
        B, H, n, d = q.shape
        self._macs = float(B * H * n * n * (d + v.shape[-1]))
        self._density = 1.0
        return attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale)

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
        """q, k (B, H, n, d_qk), v (B, H, n, d_v) -> (B, H, n, d_v).

        ``attn_mask`` (an external mask, e.g. DynamicViT's training policy; bool or additive,
        broadcastable to (B, H, n, n)) is combined with the sparse mask; it selects the masked path.
        """
        cfg = self.cfg
        B, H, n, d = q.shape
        if n > self.w_down.shape[-1]:
            raise NascompressError(f"sparsifiner was built for {self.w_down.shape[-1]} tokens, got {n}")
        p = self.prefix
        w_down, w_up = self.w_down[..., :n], self.w_up[..., :n]
        if self.training and self.recon:  # stage 1: dense attention, train the predictor
            approx = lowrank_attention(q, k, w_down, scale) @ w_up
            with torch.no_grad():
                logits = (q * scale) @ k.transpose(-2, -1)
                if attn_mask is not None:  # the attention the model really computes (e.g. DynamicViT's policy)
                    logits = (
                        logits.masked_fill(~attn_mask, float("-inf"))
                        if attn_mask.dtype == torch.bool
                        else logits + attn_mask
                    )
                target = logits.softmax(-1)
            self.recon_loss = (approx[:, :, p:] - target[:, :, p:]).pow(2).sum() / B
            return self._dense(q, k, v, attn_mask, scale, dropout_p)
        budget = attention_budget(cfg.attn_keep_ratio, n, None if cfg.budget is None else min(cfg.budget, n))
        if budget >= n:
            return self._dense(q, k, v, attn_mask, scale, dropout_p)
        r = w_down.shape[-2]
        if cfg.mode == "unstructured":
            with torch.no_grad():  # the mask is discrete: no gradient flows through the predictor here
                coef = sparse_coefficients(lowrank_attention(q, k, w_down, scale), cfg.tau)
                basis = sparse_basis(w_up, cfg.w_thresh)
                mask = topk_mask(coef @ basis, budget, full_rows=p)
                # nnz-based product MACs, a device tensor read when asked for (no host sync here)
                prod = ((coef != 0).float() @ (basis != 0).float().sum(-1, keepdim=True)).sum()
                self._unstructured_stats = (
                    prod,
                    dict(batch=B, heads=H, n=n, head_dim=d, v_dim=v.shape[-1], n_down=r, budget=budget, prefix=p),
                )
                self._macs = None
                self._block_stats = None
                self._density = budget / n
            return masked_attention(q, k, v, combine_masks(mask, attn_mask), scale=scale, dropout_p=dropout_p)
        layout = block_sparse.plan_blocks(
            n, p, budget, cfg.block_size, multiple=block_sparse.flex_multiple(cfg.kernel, cfg.block_size, q.device)
        )
        if not layout.sparse:
            return self._dense(q, k, v, attn_mask, scale, dropout_p)
        inference = not self.training and not torch.is_grad_enabled()
        basis = self._pooled_basis(w_up, layout, cache=inference)
        if inference and cfg.kernel != "masked" and attn_mask is None:
            kernel = "flex" if cfg.kernel == "flex" and block_sparse.flex_usable() else "gather"
            out, idx = block_sparse.block_sparse_attention(
                q, k, v, w_down, basis, layout, scale=scale, tau=cfg.tau, kernel=kernel
            )
        else:
            with torch.no_grad():  # the mask is discrete: no gradient flows through the predictor here
                idx = block_sparse.predict_blocks(q, k, w_down, basis, scale=scale, tau=cfg.tau, layout=layout)
            out = masked_attention(
                q,
                k,
                v,
                combine_masks(block_sparse.dense_block_mask(idx, layout), attn_mask),
                scale=scale,
                dropout_p=dropout_p,
            )
        # the statistics are read lazily (last_macs / density): no .item() sync in the forward
        self._block_stats = (idx, layout, r, d, v.shape[-1])
        self._macs = None
        return out

    def _pooled_basis(self, w_up: torch.Tensor, layout: "block_sparse.BlockLayout", *, cache: bool) -> torch.Tensor:
        """Thresholded W_up pooled per key block (H, r, nb); cached at inference (weights only)."""
        if not cache:
            return block_sparse.pooled_basis(w_up, self.cfg.w_thresh, layout)
        key = (layout, self.cfg.w_thresh, self.w_up._version, self.w_up.data_ptr(), w_up.device)
        hit = self.__dict__.get("_basis_cache")
        if hit is None or hit[0] != key:
            hit = (key, block_sparse.pooled_basis(w_up, self.cfg.w_thresh, layout))
            self.__dict__["_basis_cache"] = hit
        return hit[1]

    def _read_block_stats(self) -> None:
        if self._block_stats is None:  # the unstructured mode's last forward
            prod, kw = self._unstructured_stats
            self._macs = unstructured_macs(product_macs=float(prod), **kw)
            return
        idx, layout, r, d, dv = self._block_stats
        B, H, nb, _ = idx.shape
        n, n_p = layout.n, layout.n_patch
        with torch.no_grad():
            pairs = block_sparse.kept_pairs(idx, layout).sum().item()
        # predictor: W_down K (r n d) + Q_patch K_down^T (n_p r d) + tile scores (nb r nb); attention d + dv per pair
        self._macs = float(B * H * (r * n * d + n_p * r * d + nb * r * nb) + (d + dv) * pairs)
        self._density = pairs / (B * H * n * n)

    def last_macs(self) -> float:
        """MACs of the last forward (whole batch): predictor + attention on the kept pairs."""
        if self._macs is None:
            self._read_block_stats()
        return float(self._macs)

    @property
    def density(self) -> float:
        """Fraction of (query, key) pairs attended in the last forward."""
        if self._macs is None:
            self._read_block_stats()
        return self._density

    def __deepcopy__(self, memo: dict) -> "SparsifinerKernel":
        new = SparsifinerKernel(self.cfg, self.w_down.detach().clone(), self.w_up.detach().clone(), self.prefix)
        new.w_down.requires_grad_(self.w_down.requires_grad)
        new.w_up.requires_grad_(self.w_up.requires_grad)
        new.train(self.training)
        new.recon = self.recon
        memo[id(self)] = new
        return new


def sparse_modules(model: nn.Module) -> list[SparsifinerKernel]:
    return [m for m in model.modules() if isinstance(m, SparsifinerKernel)]
