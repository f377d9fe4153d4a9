"""Sparsifiner: instance-dependent sparse attention from a low-rank connectivity predictor.

Per layer and head (METHODS.md section 4, seed 002)::

    A_down = softmax(Q (W_down K)^T / sqrt(d))      W_down (n_down, n) projects the TOKEN axis
    C      = A_down where A_down > tau, else 0      sparse coefficients
    S      = C @ W_up                               W_up (n_down, n), entries |w| <= w_thresh zeroed
    M      = top-B of each row of S,  B = ceil(attn_keep_ratio * n)
    out    = masked-softmax attention over M

Readings (where the paper or the official code leave a choice):
    - W_down / W_up are per layer AND per head, shape (H, n_down, n) (the official code shares
      them across heads; per-head costs no extra FLOPs). Q and K enter A_down at full head dim
      (the official code adds a channel-reducing Linear; the paper's Eq. 1 has none).
    - CLS (prefix) query rows attend to every key, as in the official code. A coefficient row
      whose entries are all <= tau keeps its largest entry, so no row of S is empty.
    - Fewer tokens than the model was built for (token pruning before this layer): the first n
      columns of W_down / W_up are used (position in the pruned sequence; trainable in stage 2).
    - Zero-shot init (no training): W_down averages the keys of n_down spatial regions (CLS is its
      own region) and W_up spreads each region's coefficient back over its tokens (1/|region|),
      so S[i, j] ~ the attention of query i to the mean key of j's region.
    - FLOPs (``matmul_macs``): predictor (W_down K, Q K_down^T, the nnz-based sparse product
      C @ W_up) + 2 d nnz(M) for QK^T and AV (the paper's accounting for a sparse kernel; on a
      CPU the unstructured path runs as a dense masked SDPA and saves no time). The block mode
      reports what it really computes: predictor, pooled tile scores, kept tiles, CLS rows.
    - Training (two stages, :class:`SparsifinerHooks`): stage 1 trains W_down/W_up on the
      un-thresholded product A_down @ W_up (the official code does the same) with dense attention;
      thresholds apply whenever the mask is predicted (eval, stage 2).
    - ``mode="block"`` (``_flex``): the patch tokens are cut into blocks, CLS rows and CLS keys stay
      dense, scores are pooled over (query block, key block) tiles (the same S summed over tiles,
      never built at n x n), and each query block keeps its top key blocks per head. At inference
      (no grad) ``kernel="gather"`` gathers each query block's kept keys straight from the qkv
      memory into one fused SDPA, ``kernel="flex"`` runs compiled FlexAttention on a BlockMask
      built from the block indices; training and ``kernel="masked"`` use the same mask in the
      masked path (all three tested equal). MACs/density are computed when read.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from timm.layers import Attention
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from ..distill import features_and_logits, kl_to_teacher
from ..errors import NascompressError
from ..finetune import Recipe, register_recipe
from ..train import TrainConfig, TrainHooks
from . import _flex
from . import register_method

MODES = ("unstructured", "block")
KERNELS = ("gather", "flex", "masked")


@dataclass(frozen=True)
class SparsifinerConfig:
    """Settings of the sparse attention (recorded in arch.json).

    Args:
        attn_keep_ratio: keep ratio in (0, 1]; budget B = ceil(ratio * n) keys per query.
        budget: a fixed budget B in [1, n] instead of the ratio (None: from the ratio).
        n_down: rank of the token-axis projection (capped at the model's token count).
        tau: threshold on A_down; w_thresh: magnitude threshold on W_up.
        mode: ``unstructured`` (the paper's per-query top-k) or ``block`` (top key blocks).
        block_size: block side in patch tokens for ``block`` (None: a divisor of the patch count
            near 1/8 of it, see ``_flex.auto_block_size``).
        kernel: ``block`` inference kernel: ``gather`` (gathered kept blocks + fused SDPA, the
            fastest on CPU), ``flex`` (compiled FlexAttention with a BlockMask) or ``masked``.
    """

    attn_keep_ratio: float = 0.25
    budget: int | None = None
    n_down: int = 32
    tau: float = 0.05
    w_thresh: float = 1e-2
    mode: str = "unstructured"
    block_size: int | None = None
    kernel: str = "gather"

    def __post_init__(self) -> None:
        r = self.attn_keep_ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r <= 1:
            raise NascompressError(f"attn_keep_ratio must be in (0, 1], got {r!r}")
        if self.budget is not None and (isinstance(self.budget, bool) or not isinstance(self.budget, int) or self.budget < 1):
            raise NascompressError(f"budget must be a positive integer (keys per query), got {self.budget!r}")
        if isinstance(self.n_down, bool) or not isinstance(self.n_down, int) or self.n_down < 1:
            raise NascompressError(f"n_down must be a positive integer, got {self.n_down!r}")
        if not 0 <= self.tau < 1:
            raise NascompressError(f"tau must be in [0, 1), got {self.tau!r}")
        if not self.w_thresh >= 0:
            raise NascompressError(f"w_thresh must be >= 0, got {self.w_thresh!r}")
        if self.mode not in MODES:
            raise NascompressError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.block_size is not None and (not isinstance(self.block_size, int) or self.block_size < 1):
            raise NascompressError(f"block_size must be a positive integer, got {self.block_size!r}")
        if self.kernel not in KERNELS:
            raise NascompressError(f"kernel must be one of {', '.join(KERNELS)}, got {self.kernel!r}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SparsifinerConfig":
        d = dict(d)
        if "flex" in d and "kernel" not in d:  # arch.json files written before the kernel option
            d["kernel"] = "gather" if d.pop("flex") else "masked"
        unknown = sorted(set(d) - set(cls.__dataclass_fields__))
        if unknown:
            raise NascompressError(f"unknown sparsifiner option(s) {unknown}; valid: {', '.join(cls.__dataclass_fields__)}")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, *, scale: float,
                     dropout_p: float = 0.0) -> torch.Tensor:
    """Softmax over the kept entries of each row only: q, k, v (B, H, n, d), mask (B, H, n, n) bool."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale)


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


def unstructured_macs(*, batch: int, heads: int, n: int, head_dim: int, n_down: int, budget: int, prefix: int,
                      product_macs: float) -> float:
    """MACs of one Sparsifiner attention (whole batch) in the paper's accounting.

    predictor: W_down K (r n d) + Q K_down^T (n r d) per head, plus ``product_macs`` (the sparse
    C @ W_up, over all heads and images); attention: QK^T and AV on nnz(M) entries.
    """
    nnz = (n - prefix) * budget + prefix * n
    return batch * heads * (2 * n_down * n * head_dim + 2 * head_dim * nnz) + product_macs


# ---------------------------------------------------------------------------------------------
# The patched attention


class SparsifinerAttention(Attention):
    """timm ``Attention`` (forward follows timm 1.0.31) with Sparsifiner's sparse attention.

    Modifications:
        - new parameters ``sp_w_down`` / ``sp_w_up`` (H, n_down, n_tokens); timm keys unchanged.
        - attention restricted to the predicted mask (``unstructured`` or ``block``); a budget
          >= n falls back to dense fused SDPA (identical to timm).
        - ``sp_recon`` (stage 1, training only): dense attention, and the predictor's
          reconstruction loss against it is left in ``sp_recon_loss``.
        - ``matmul_macs`` reports the last forward's attention + predictor MACs.
    """

    def _sp_budget(self, n: int) -> int:
        cfg: SparsifinerConfig = self.sp_cfg
        b = attention_budget(cfg.attn_keep_ratio, n, None if cfg.budget is None else min(cfg.budget, n))
        return b

    def _dense(self, q, k, v, B, n, attn_mask=None) -> torch.Tensor:
        self._sp_macs = float(B * self.num_heads * n * n * 2 * self.head_dim)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask,
                                              dropout_p=self.attn_drop.p if self.training else 0.0)

    def sparse_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """q, k, v (B, H, n, d) after q_norm/k_norm -> attention output (B, H, n, d).

        ``attn_mask`` (an external mask, e.g. DynamicViT's training policy; bool or additive,
        broadcastable to (B, H, n, n)) is combined with the sparse mask; it selects the masked path.
        """
        cfg: SparsifinerConfig = self.sp_cfg
        B, H, n, d = q.shape
        if n > self.sp_w_down.shape[-1]:
            raise NascompressError(f"sparsifiner was built for {self.sp_w_down.shape[-1]} tokens, got {n}")
        p = self.sp_prefix
        w_down, w_up = self.sp_w_down[..., :n], self.sp_w_up[..., :n]
        if self.training and self.sp_recon:  # stage 1: dense attention, train the predictor
            approx = lowrank_attention(q, k, w_down, self.scale) @ w_up
            with torch.no_grad():
                logits = (q * self.scale) @ k.transpose(-2, -1)
                if attn_mask is not None:  # the attention the model really computes (e.g. DynamicViT's policy)
                    logits = logits.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool \
                        else logits + attn_mask
                target = logits.softmax(-1)
            self.sp_recon_loss = (approx[:, :, p:] - target[:, :, p:]).pow(2).sum() / B
            return self._dense(q, k, v, B, n, attn_mask)
        budget = self._sp_budget(n)
        if budget >= n:
            return self._dense(q, k, v, B, n, attn_mask)
        r = w_down.shape[-2]
        drop = self.attn_drop.p if self.training else 0.0
        if cfg.mode == "unstructured":
            with torch.no_grad():  # the mask is discrete: no gradient flows through the predictor here
                coef = sparse_coefficients(lowrank_attention(q, k, w_down, self.scale), cfg.tau)
                basis = sparse_basis(w_up, cfg.w_thresh)
                mask = topk_mask(coef @ basis, budget, full_rows=p)
                prod = ((coef != 0).float() @ (basis != 0).float().sum(-1, keepdim=True)).sum().item()
                self._sp_macs = unstructured_macs(batch=B, heads=H, n=n, head_dim=d, n_down=r, budget=budget,
                                                  prefix=p, product_macs=prod)
                self.sp_density = budget / n
            return masked_attention(q, k, v, combine_masks(mask, attn_mask), scale=self.scale, dropout_p=drop)
        layout = _flex.plan_blocks(n, p, budget, cfg.block_size)
        if not layout.sparse:
            return self._dense(q, k, v, B, n, attn_mask)
        inference = not self.training and not torch.is_grad_enabled()
        basis = self._sp_pooled_basis(w_up, layout, cache=inference)
        if inference and cfg.kernel != "masked" and attn_mask is None:
            kernel = "flex" if cfg.kernel == "flex" and _flex.flex_usable() else "gather"
            out, idx = _flex.block_sparse_attention(q, k, v, w_down, basis, layout, scale=self.scale, tau=cfg.tau,
                                                    kernel=kernel)
        else:
            with torch.no_grad():  # the mask is discrete: no gradient flows through the predictor here
                idx = _flex.predict_blocks(q, k, w_down, basis, scale=self.scale, tau=cfg.tau, layout=layout)
            out = masked_attention(q, k, v, combine_masks(_flex.dense_block_mask(idx, layout), attn_mask),
                                   scale=self.scale, dropout_p=drop)
        # the statistics are read lazily (matmul_macs / sp_density): no .item() sync in the forward
        self._sp_block_stats = (idx, layout, r, d)
        self._sp_macs = None
        return out

    def _sp_pooled_basis(self, w_up: torch.Tensor, layout: "_flex.BlockLayout", *, cache: bool) -> torch.Tensor:
        """Thresholded W_up pooled per key block (H, r, nb); cached at inference (weights only)."""
        if not cache:
            return _flex.pooled_basis(w_up, self.sp_cfg.w_thresh, layout)
        key = (layout, self.sp_cfg.w_thresh, self.sp_w_up._version, self.sp_w_up.data_ptr(), w_up.device)
        hit = self.__dict__.get("_sp_basis_cache")
        if hit is None or hit[0] != key:
            hit = (key, _flex.pooled_basis(w_up, self.sp_cfg.w_thresh, layout))
            self.__dict__["_sp_basis_cache"] = hit
        return hit[1]

    def _sp_block_macs(self) -> None:
        idx, layout, r, d = self._sp_block_stats
        B, H, nb, _ = idx.shape
        n, n_p = layout.n, layout.n_patch
        with torch.no_grad():
            pairs = _flex.kept_pairs(idx, layout).sum().item()
        # predictor: W_down K (r n d) + Q_patch K_down^T (n_p r d) + tile scores (nb r nb); attention 2 d pairs
        self._sp_macs = float(B * H * (r * n * d + n_p * r * d + nb * r * nb) + 2 * d * pairs)
        self._sp_density = pairs / (B * H * n * n)

    @property
    def sp_density(self) -> float:
        """Fraction of (query, key) pairs attended in the last forward (block mode: computed on read)."""
        if getattr(self, "_sp_macs", 0.0) is None:
            self._sp_block_macs()
        return self._sp_density

    @sp_density.setter
    def sp_density(self, value: float) -> None:
        self._sp_density = value

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
        if is_causal:
            raise NotImplementedError("sparsifiner attention is for bidirectional ViTs (is_causal is not supported)")
        B, N, C = x.shape
        gate = self.gate(x).sigmoid() if self.gate is not None else None
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        x = self.sparse_attention(q, k, v, attn_mask)
        x = x.transpose(1, 2).reshape(B, N, self.attn_dim)
        x = self.norm(x)
        if gate is not None:
            x = x * gate
        return self.proj_drop(self.proj(x))

    def matmul_macs(self, inputs: tuple, output: torch.Tensor) -> float:
        if getattr(self, "_sp_macs", 0.0) is None:
            self._sp_block_macs()
        return float(getattr(self, "_sp_macs", 0.0))


def sparse_modules(model: nn.Module) -> list[SparsifinerAttention]:
    return [m for m in model.modules() if isinstance(m, SparsifinerAttention)]


def patch_model(model: nn.Module, cfg: SparsifinerConfig) -> tuple[int, int]:
    """Patch every block's attention in place; returns (n_tokens, effective n_down)."""
    if not isinstance(model, VisionTransformer):
        raise NascompressError(f"sparsifiner needs a timm VisionTransformer (vit_*, deit_*), got {type(model).__name__}")
    prefix = int(model.num_prefix_tokens)
    grid = tuple(model.patch_embed.grid_size) if getattr(model.patch_embed, "grid_size", None) else None
    n = int(model.patch_embed.num_patches) + prefix
    if cfg.budget is not None:
        attention_budget(cfg.attn_keep_ratio, n, cfg.budget)
    r = min(cfg.n_down, n)
    w_down, w_up = region_init(n, r, prefix=prefix, grid=grid)
    for i, blk in enumerate(model.blocks):
        attn = getattr(blk, "attn", None)
        if isinstance(attn, SparsifinerAttention):
            raise NascompressError(f"blocks.{i}.attn is already a Sparsifiner attention; apply sparsifiner once")
        if type(attn) is not Attention:
            raise NascompressError(f"sparsifiner patches timm Attention modules; blocks.{i}.attn is a {type(attn).__name__}")
        dev = attn.qkv.weight.device
        attn.__class__ = SparsifinerAttention
        H = attn.num_heads
        attn.sp_w_down = nn.Parameter(w_down.expand(H, -1, -1).clone().to(dev))
        attn.sp_w_up = nn.Parameter(w_up.expand(H, -1, -1).clone().to(dev))
        attn.sp_cfg, attn.sp_prefix, attn.sp_recon = cfg, prefix, False
    return n, r


@register_method("sparsifiner")
def apply(model: nn.Module, record: dict[str, Any]) -> nn.Module:
    """Patch ``model`` from its arch.json record ``{"name": "sparsifiner", "config": {...}}``."""
    cfg = SparsifinerConfig.from_dict(dict(record.get("config", {})))
    n, _ = patch_model(model, cfg)
    if "n_tokens" in record and int(record["n_tokens"]) != n:
        raise NascompressError(f"the sparsifiner record was made for {record['n_tokens']} tokens, the model has {n}")
    return model


# ---------------------------------------------------------------------------------------------
# Two-stage training (stage 1: predictor only, L_attn; stage 2: backbone, L_cls + L_token + L_cls_distill)

TRAIN_KEYS = {"stage1_epochs": 1, "predictor_lr_scale": 10.0, "lambda_attn": 1.0, "lambda_token": 0.5,
              "lambda_cls_distill": 0.5}


class SparsifinerHooks(TrainHooks):
    """Epochs < stage1_epochs: backbone frozen, dense attention, loss = lambda_attn * L_attn
    (mean over layers of the per-image sum of squared errors, as the official code sums); the
    frozen dense student's attention IS the teacher's there, so no teacher forward is needed.
    Later epochs: predictor frozen (its mask carries no gradient), loss = CE + lambda_token *
    MSE(final tokens, teacher's) + lambda_cls_distill * KL(student || teacher logits).
    """

    def __init__(self, teacher: nn.Module, settings: dict[str, Any]):
        self.teacher, self.s = teacher, settings

    def _stage1(self, epoch: int) -> bool:
        return epoch < self.s["stage1_epochs"]

    def param_groups(self, model: nn.Module, cfg: TrainConfig) -> list[dict[str, Any]]:
        pred, decay, no_decay = [], [], []
        for name, p in model.named_parameters():
            p.requires_grad_(True)
            if name.rsplit(".", 1)[-1] in ("sp_w_down", "sp_w_up"):
                pred.append(p)
            elif p.ndim <= 1 or name.endswith(("cls_token", "pos_embed", "reg_token")):
                no_decay.append(p)
            else:
                decay.append(p)
        return [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0},
                {"params": pred, "weight_decay": cfg.weight_decay, "lr_scale": self.s["predictor_lr_scale"]}]

    def on_epoch_start(self, model: nn.Module, *, epoch: int) -> None:
        stage1 = self._stage1(epoch)
        for name, p in model.named_parameters():
            is_pred = name.rsplit(".", 1)[-1] in ("sp_w_down", "sp_w_up")
            p.requires_grad_(is_pred == stage1)
        for m in sparse_modules(model):
            m.sp_recon = stage1

    def loss(self, model, x, y, *, epoch, cfg):
        if self._stage1(epoch):
            model(x)
            mods = sparse_modules(model)
            l_attn = sum(m.sp_recon_loss for m in mods) / len(mods)
            return self.s["lambda_attn"] * l_attn, {"l_attn": float(l_attn.detach())}
        feats, logits, t_feats, t_logits = features_and_logits(model, self.teacher, x)
        ce = F.cross_entropy(logits, y, label_smoothing=cfg.label_smoothing)
        kl = kl_to_teacher(logits, t_logits)
        p = int(getattr(model, "num_prefix_tokens", 1))
        # token pruning stacked before: token sets differ, so only the prefix (CLS) tokens are compared
        tok = F.mse_loss(feats, t_feats) if feats.shape == t_feats.shape else F.mse_loss(feats[:, :p], t_feats[:, :p])
        loss = ce + self.s["lambda_token"] * tok + self.s["lambda_cls_distill"] * kl
        return loss, {"ce": ce.item(), "l_token": tok.item(), "l_cls_distill": kl.item()}

    def on_epoch_end(self, model: nn.Module, *, epoch: int) -> dict[str, Any]:
        mods = sparse_modules(model)
        thr = mods[0].sp_cfg.w_thresh if mods else 0.0
        nz = sum(int((m.sp_w_up.abs() > thr).sum()) for m in mods)
        tot = sum(m.sp_w_up.numel() for m in mods)
        return {"stage": 1 if self._stage1(epoch) else 2, "w_up_density": nz / max(tot, 1)}


@register_recipe("sparsifiner")
class SparsifinerRecipe(Recipe):
    """``nascompress finetune RUN --method sparsifiner [--attn-keep-ratio R] [--opt key=value]``.

    Method keys: attn_keep_ratio, budget, n_down, tau, w_thresh, mode, block_size, kernel. Training
    keys: stage1_epochs (default 1), predictor_lr_scale (10), lambda_attn (1), lambda_token (0.5),
    lambda_cls_distill (0.5).
    """

    def prepare(self, model: nn.Module, config: dict[str, Any]) -> tuple[nn.Module, dict[str, Any]]:
        valid = list(SparsifinerConfig.__dataclass_fields__) + list(TRAIN_KEYS)
        unknown = sorted(set(config) - set(valid))
        if unknown:
            raise NascompressError(f"unknown sparsifiner option(s) {unknown}; valid options: {', '.join(valid)}")
        train = {k: config.pop(k, v) for k, v in TRAIN_KEYS.items()}
        if not isinstance(train["stage1_epochs"], int) or train["stage1_epochs"] < 0:
            raise NascompressError(f"stage1_epochs must be an integer >= 0, got {train['stage1_epochs']!r}")
        for k in ("predictor_lr_scale", "lambda_attn", "lambda_token", "lambda_cls_distill"):
            if not isinstance(train[k], (int, float)) or train[k] < 0:
                raise NascompressError(f"{k} must be a number >= 0, got {train[k]!r}")
        cfg = SparsifinerConfig.from_dict(config)
        n, r = patch_model(model, cfg)
        return model, {"name": "sparsifiner", "config": cfg.to_dict(), "n_tokens": n, "n_down": r, "training": train}

    def hooks(self, model: nn.Module, record: dict[str, Any], *, teacher: nn.Module, train_cfg: TrainConfig) -> TrainHooks:
        return SparsifinerHooks(teacher, dict(TRAIN_KEYS, **record.get("training", {})))
