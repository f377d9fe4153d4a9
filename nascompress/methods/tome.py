"""ToMe: merge similar tokens by bipartite soft matching, training-free.

Paper: Bolya et al., ICLR 2023, "Token Merging: Your ViT But Faster". In every merging layer,
after the attention residual and before the MLP, the tokens are split alternately into two sets
A (even positions) and B (odd positions); each A token is matched to its most similar B token by
the cosine similarity of the attention's keys (mean over heads); the ``r`` most similar pairs are
merged (the A token is added into its B token, averaged by size), the other A tokens stay. The
number of tokens falls by ``r`` per layer (at most half of the patch tokens). Each token carries
its size (the patches it holds): merges are size-weighted averages, and the attention adds
``log(size)`` to every key's logit (proportional attention), so a merged token weighs as the
tokens it replaced. Prefix tokens (class, distillation, registers) are never merged: their rows
and columns of the matching are excluded, and they stay first, in their order.

The keys are read from :class:`~nascompress.models.layers.NCAttention`'s ``record_keys`` (as computed:
DCS masks and narrowed Q/K included); the proportional attention is an additive ``attn_mask``, so
the fused SDPA kernel is kept. The matching and merging (and the size bias) are parameter-free
modules that report their cost to the profiler (``matmul_macs``): ToMe's FLOPs include them.

Record (``arch.json``)::

    {"name": "tome", "config": {"r": 8, "merge_layers": [1, 2, ..., 12], "prop_attn": true},
     "recipe": {"distill": 0.0}}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..config import Config, check_bool, check_settings, field_name, setting
from ..errors import NascompressError, SettingError, literal
from ..limits import limits
from ..train.hooks import TrainHooks, features_and_logits, kl_to_teacher
from . import Method, TrainOverrides, register_method
from .tokens import distill_setting, patched_class, token_layers


# ---------------------------------------------------------------------------------------------
# Pure tensor functions
# ---------------------------------------------------------------------------------------------
class Matching(NamedTuple):
    """One layer's bipartite matching, as indices into the A set ``x[:, 0::2]`` and the B set
    ``x[:, 1::2]``: ``unmerged`` (B, |A| - r) A tokens kept (ascending, the prefix ones first),
    ``src`` (B, r) the A tokens merged, ``dst`` (B, r) the B token each of them is merged into."""

    unmerged: torch.Tensor
    src: torch.Tensor
    dst: torch.Tensor


def bipartite_soft_matching(metric: torch.Tensor, r: int, *, prefix: int = 1) -> Matching | None:
    """ToMe's bipartite soft matching on ``metric`` (B, N, d) (the head-mean keys), ``prefix`` first.

    A = even positions, B = odd positions; the score of an A token is its best cosine similarity
    to a B token; the ``r`` best-scored A tokens are merged into their B tokens. Prefix tokens take
    no part (their rows in A and columns in B are -inf). ``r`` is clipped to ``(N - prefix) // 2``;
    None when nothing is merged. Indices only (no gradient flows through the matching).
    """
    n = metric.shape[1]
    r = min(r, (n - prefix) // 2)
    if r <= 0:
        return None
    m = F.normalize(metric.detach(), dim=-1)
    scores = m[:, 0::2] @ m[:, 1::2].transpose(-1, -2)  # (B, |A|, |B|) cosine similarities
    pa, pb = (prefix + 1) // 2, prefix // 2  # prefix tokens in A and in B
    if pa:
        scores[:, :pa, :] = float("-inf")
    if pb:
        scores[:, :, :pb] = float("-inf")
    best, best_idx = scores.max(dim=-1)  # (B, |A|)
    order = best.argsort(dim=-1, descending=True)
    src = order[:, :r]
    return Matching(order[:, r:].sort(dim=-1).values, src, best_idx.gather(1, src))


def merge_targets(m: Matching, n: int, *, prefix: int = 1) -> torch.Tensor:
    """(B, n) int64: the output token each of the ``n`` input tokens goes to. The output is
    ``[prefix tokens, unmerged A tokens, B tokens]`` (each in its order); a merged A token goes to
    its B token."""
    B, r = m.src.shape
    dev = m.src.device
    na, nb = (n + 1) // 2, n // 2
    pa, pb = (prefix + 1) // 2, prefix // 2
    keep = torch.cat(
        [
            torch.arange(prefix, device=dev).expand(B, prefix),
            2 * m.unmerged[:, pa:],
            torch.arange(2 * pb + 1, 2 * nb, 2, device=dev).expand(B, nb - pb),  # the B tokens' positions
        ],
        dim=1,
    )  # (B, n - r)
    # every position is written once (kept or merged), so the buffer needs no zeroing
    target = torch.empty(B, n, dtype=torch.long, device=dev).scatter_(
        1, keep, torch.arange(n - r, device=dev).expand(B, n - r)
    )
    first_b = prefix + (na - pa - r)  # where the B tokens start in the output
    return target.scatter_(1, 2 * m.src, m.dst + (first_b - pb))


def merge_wavg(
    x: torch.Tensor, size: torch.Tensor | None, m: Matching, *, prefix: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Size-weighted merge: x (B, N, C), size (B, N, 1) (None: all ones) -> x' (B, N - r, C), size'.

    Each output token is the size-weighted mean of the input tokens it holds: ``x' = W x`` with
    ``W[k, t] = size[t] / size'[k]`` for the tokens t that go to k (:func:`merge_targets`), one
    batched matmul (on the CPU the gathers, scatter-adds and divisions it replaces cost more than
    the matmul; it exports as a plain MatMul). Its cost, (N - r) N C per image, is counted: about
    1.3% of a ViT-S block at 65 tokens, 4% at 197; at many hundreds of tokens it grows past what a
    gather-based merge would cost."""
    B, N, _ = x.shape
    n_out = N - m.src.shape[1]
    target = merge_targets(m, N, prefix=prefix)
    # (B, n_out, N): W[k, t] = size[t] (1 without sizes) where token t goes to k, one scatter
    w, into = x.new_zeros(B, n_out, N), target.unsqueeze(1)
    if size is None:
        w.scatter_(1, into, 1.0)
    else:
        w.scatter_(1, into, size.transpose(1, 2).to(w.dtype))
    new_size = w.sum(dim=-1, keepdim=True)  # (B, n_out, 1)
    return (w / new_size) @ x, new_size


def size_bias(size: torch.Tensor) -> torch.Tensor:
    """Proportional attention's additive logit bias: size (B, N, 1) -> log(size) (B, 1, 1, N)."""
    return size.log().transpose(1, 2).unsqueeze(1)


def token_counts(n_tokens: int, r: tuple[int, ...], *, prefix: int = 1) -> list[int]:
    """Tokens entering each block when block i merges ``r[i]`` (clipped as the matching clips)."""
    out, n = [], n_tokens
    for ri in r:
        out.append(n)
        n -= max(0, min(ri, (n - prefix) // 2))
    return out


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------
def _check_r(values: Any, n: int) -> tuple[int, ...]:
    """One r for every merging layer, or one per merging layer: integers >= 0."""
    vals = list(values) if isinstance(values, (list, tuple)) else [values]
    bad = [v for v in vals if isinstance(v, bool) or not isinstance(v, int) or v < 0]
    if bad:
        raise SettingError(
            f"{{r}} must be a whole number of tokens >= 0 (or one per merging layer), got {literal(repr(values))}"
        )
    most = limits().max_model_tokens  # no model has more tokens (a larger r is a typo, not more merging)
    if any(v > most for v in vals):
        raise SettingError(
            f"{{r}} {max(vals):,} is more tokens than any model has (at most {most:,}, the max_model_tokens "
            "limit; each layer merges at most half of its patch tokens): give a smaller {r}"
        )
    if len(vals) == 1:
        return (vals[0],) * n
    if len(vals) != n:
        raise NascompressError(
            f"r has {len(vals)} values but there are {n} merging layers; give one value or one per layer"
        )
    return tuple(vals)


@dataclass(frozen=True)
class ToMeConfig(Config):
    """ToMe settings (recorded in arch.json).

    Args:
        r: tokens merged away at each merging layer (one number, or one per merging layer: a
            per-layer schedule); each layer merges at most half of its patch tokens.
        merge_layers: 1-based layers that merge (default: every layer, as the paper).
        prop_attn: proportional attention (log size added to the attention logits; the paper's default).
    """

    r: int | tuple[int, ...] = setting(
        8, help="ToMe: tokens merged per layer (one value, or one per merging layer: 16,8,4)."
    )
    merge_layers: tuple[int, ...] | None = setting(
        None, help=("ToMe merging layers, 1-based, e.g. 1,2,3 (default: every layer).")
    )
    prop_attn: bool = True

    def __post_init__(self) -> None:
        _check_r(self.r, len(self.r) if isinstance(self.r, tuple) else 1)
        check_bool("prop_attn", self.prop_attn)


@dataclass(frozen=True)
class ToMeRecipe(Config):
    """ToMe fine-tuning (the paper trains with merging on, the same r): cross-entropy, plus
    ``distill`` x KL to the dense teacher (0: none)."""

    distill: float = distill_setting()

    def __post_init__(self) -> None:
        check_settings(self, name=field_name)  # every setting() against its declaration


# ---------------------------------------------------------------------------------------------
# Patch
# ---------------------------------------------------------------------------------------------
@dataclass
class ToMeState:
    """Shared by the patched blocks of one model: r per block and the token sizes of the forward
    in progress (reset by block 0, dropped after the last block)."""

    r: tuple[int, ...]  # per block (0: no merge)
    prefix: int = 1
    prop_attn: bool = True
    size: torch.Tensor | None = None  # (B, N, 1)


class ToMeMerge(nn.Module):
    """Matching and size-weighted merge of one block as a parameter-free module, so the profiler
    counts it: (x (B, N, C), keys (B, H, N, d), size (B, N, 1) or None, r) -> (x', size')."""

    def __init__(self, prefix: int):
        super().__init__()
        self.prefix = prefix

    def forward(
        self, x: torch.Tensor, keys: torch.Tensor, size: torch.Tensor | None, r: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        m = bipartite_soft_matching(keys.mean(dim=1), r, prefix=self.prefix)
        if m is None:
            return x, size
        return merge_wavg(x, size, m, prefix=self.prefix)

    def matmul_macs(self, inputs: tuple, output: tuple) -> float:
        """The head mean of the keys, their normalisation, the A x B similarities, and the
        size-weighted merge (the merge matrix's weights and the (N - r) x N matmul); whole batch."""
        x, keys = inputs[0], inputs[1]
        B, N, C = x.shape
        n_out = output[0].shape[1]
        if n_out >= N:
            return 0.0
        H, d = keys.shape[1], keys.shape[-1]
        na, nb = (N + 1) // 2, N // 2
        return float(B * (N * H * d + 2 * N * d + na * nb * d + 2 * n_out * N + n_out * N * C))


class ToMeBias(nn.Module):
    """Proportional attention's bias as a parameter-free module (counted by the profiler: one add
    per attention logit): size (B, N, 1) -> (B, 1, 1, N)."""

    def __init__(self, num_heads: int):
        super().__init__()
        self.num_heads = num_heads

    def forward(self, size: torch.Tensor) -> torch.Tensor:
        return size_bias(size)

    def matmul_macs(self, inputs: tuple, output: torch.Tensor) -> float:
        B, N, _ = inputs[0].shape
        return float(B * N + B * self.num_heads * N * N)


def _with_bias(attn_mask: torch.Tensor | None, bias: torch.Tensor) -> torch.Tensor:
    if attn_mask is None:
        return bias
    if attn_mask.dtype == torch.bool:
        return bias.masked_fill(~attn_mask, float("-inf"))
    return attn_mask + bias


class ToMeBlock:
    """Mixin over the block's class (:class:`~nascompress.models.layers.NCBlock` or a DCS block): ToMe.

    Modifications: the attention half runs with proportional attention (``log(size)`` added to the
    logits, once tokens have been merged); between the two residual halves ``r`` tokens are merged
    by :class:`ToMeMerge` on the keys the attention recorded. Block 0 starts every forward's sizes.
    """

    tome_state: ToMeState
    tome_index: int

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
        st = self.tome_state
        if self.tome_index == 0:
            st.size = None
        size = st.size
        if size is not None and st.prop_attn:
            attn_mask = _with_bias(attn_mask, self.tome_bias(size))
        x = self.attn_half(x, attn_mask=attn_mask, is_causal=is_causal)
        r = st.r[self.tome_index]
        if r > 0:
            keys, self.attn.keys = self.attn.keys, None
            x, st.size = self.tome_merge(x, keys, size, r)
        if self.tome_index == len(st.r) - 1:
            st.size = None
        return self.mlp_half(x)


@register_method
class ToMe(Method):
    token_stage = True
    name = "tome"
    summary = "merge similar tokens by bipartite soft matching, training-free (Bolya et al. 2023)"
    config_cls = ToMeConfig
    recipe_cls = ToMeRecipe
    train_overrides = TrainOverrides(base_lr=1e-4, warmup_epochs=0.2, epochs=2)
    stacks_on = frozenset({"dcs", "uniform", "sparsifiner"})
    off_config = {"r": 0}
    paper_config = {"r": 13}  # the paper's ViT-S/16 at 224 px (1.6x throughput without training)

    def resolve(self, model: nn.Module, cfg: ToMeConfig) -> ToMeConfig:
        layers = token_layers(
            model, "tome", cfg.merge_layers, name="merge_layers", default=lambda depth: list(range(1, depth + 1))
        )  # ToMe merges in every layer
        _check_r(cfg.r, len(layers))
        return cfg.replace(merge_layers=tuple(layers))

    def patch(self, model: nn.Module, cfg: ToMeConfig, record: dict[str, Any]) -> nn.Module:
        depth = len(model.blocks)
        per_layer = dict(zip(cfg.merge_layers, _check_r(cfg.r, len(cfg.merge_layers))))
        prefix = int(model.num_prefix_tokens)
        state = ToMeState(
            r=tuple(per_layer.get(i + 1, 0) for i in range(depth)), prefix=prefix, prop_attn=cfg.prop_attn
        )
        for i, blk in enumerate(model.blocks):
            if isinstance(blk, ToMeBlock):
                raise NascompressError(f"tome is already applied to blocks.{i}")
            blk.__class__ = patched_class(type(blk), ToMeBlock, "ToMe")
            blk.tome_state, blk.tome_index = state, i
            blk.tome_merge, blk.tome_bias = ToMeMerge(prefix), ToMeBias(blk.attn.num_heads)
            blk.attn.record_keys = state.r[i] > 0
        model.tome_state = state
        return model

    def hooks(self, model, record, *, teacher, train_cfg):
        return ToMeHooks(teacher, distill=ToMeRecipe.from_dict(record.get("recipe", {})).distill)


# ---------------------------------------------------------------------------------------------
# Fine-tuning recipe
# ---------------------------------------------------------------------------------------------
class ToMeHooks(TrainHooks):
    """CE (+ distill * KL to the dense teacher), merging on throughout (as the paper trains)."""

    def __init__(self, teacher: nn.Module | None, *, distill: float = 0.0):
        self.teacher, self.distill = teacher, distill

    def loss(self, model, x, y, *, epoch: int, cfg, tag=None):
        logs: dict[str, Any] = {}
        if self.distill > 0 and self.teacher is not None:
            _, logits, _, t_logits = features_and_logits(model, self.teacher, x)
            kl = kl_to_teacher(logits, t_logits)
            logs["kl"] = kl.detach()
        else:
            logits, kl = model(x), None
        ce = F.cross_entropy(logits, y, label_smoothing=cfg.label_smoothing)
        logs["ce"] = ce.detach()
        return (ce if kl is None else ce + self.distill * kl), logs


__all__ = [
    "ToMe",
    "ToMeConfig",
    "ToMeRecipe",
    "ToMeState",
    "ToMeBlock",
    "ToMeMerge",
    "ToMeBias",
    "Matching",
    "bipartite_soft_matching",
    "merge_targets",
    "merge_wavg",
    "size_bias",
    "token_counts",
]
