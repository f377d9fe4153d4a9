"""DCS: differentiable channel selection (seed 003, sections 3.1, 3.2, 3.4; METHODS.md section 1).

Two selections inside every block, searched jointly (the search is ``nascompress search dcs``):

* Q/K channel masks for the attention weights (section 3.1): ``W = softmax((Q*M)(K*M)^T / sqrt(d))``,
  the same mask on Q and K, V untouched, plugged into :class:`~nascompress.layers.NCAttention` as
  its ``qk_mask`` (:class:`DCSQKMask`). ``qk_mask="input"`` is the paper's input-dependent mask,
  theta = Linear(x) per token; ``"static"`` learns one theta per channel (as the official code
  does), the only kind that can be removed physically; ``"none"`` turns it off.
* MLP channel gates (section 3.2): architecture parameters alpha (C,) per block; the gate g
  multiplies the MLP's input and output features (:class:`DCSBlock` owns that MLP half).

Both are binary Gumbel-sigmoid masks: hard 0/1 forward at 0.5, straight-through backward, no
noise at inference (so the mask is ``1[logit > 0]``). New parameters: ``blocks.<i>.dcs_alpha`` and
``blocks.<i>.attn.qk_mask.theta``; timm's keys are kept.

Materialization gathers the selection physically: :func:`slice_mlp` (the MLP reads the kept
residual channels after LN2 and writes them back with one ``index_add``: :class:`MaterializedBlock`)
and :func:`slice_qk` (each head keeps its Q/K channels, zero-padded to the largest count so the
heads stay one batched matmul; the original ``1/sqrt(head_dim)`` scale is kept). The
input-dependent mask cannot be removed: its theta Linear stays (and is counted by the profiler).

The ``arch.json`` record is ``{"name": "dcs", "config": DCSConfig, "stage": "supernet" |
"materialized", "tau": float, "blocks": [{"mlp_keep": [...], "qk_keep": [[...] per head]}]}``; DCS
must be the first method of a model (it changes channels that later methods read).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from ..config import Config, check_bool, check_choice, check_range
from ..errors import NascompressError
from ..layers import (NCAttention, NCBlock, as_index, slice_layerscale, slice_linear_in, slice_linear_out, to_core,
                      with_zero_row)
from . import Method, register_method

QK_MODES = ("input", "static", "none")
STAGES = ("supernet", "materialized")


# ---------------------------------------------------------------------------------------------
# Pure functions


def gumbel_noise(shape: torch.Size | tuple[int, ...], *, like: torch.Tensor,
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """g1 - g2 with g1, g2 ~ Gumbel(0, 1) i.i.d. (a Logistic(0, 1) sample), shaped ``shape``."""
    u = torch.rand((2, *shape), generator=generator, device=like.device, dtype=like.dtype)
    g = -torch.log(-torch.log(u.clamp_min(1e-10)))
    return g[0] - g[1]


def gumbel_sigmoid(logits: torch.Tensor, *, tau: float, noise: bool = True, hard: bool = True,
                   generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Binary Gumbel-sigmoid mask of ``logits`` (any shape).

    soft = sigmoid((logits + g1 - g2) / tau); with ``hard`` the forward value is ``1[soft > 0.5]``
    and the gradient is that of ``soft`` (straight-through). Without ``noise`` (inference)
    the mask is ``1[logits > 0]``.

    Returns:
        (mask, soft), both shaped like ``logits``; without autograd (inference) soft is the mask.
    """
    z = logits + gumbel_noise(logits.shape, like=logits, generator=generator) if noise else logits
    if hard and not (torch.is_grad_enabled() and z.requires_grad):  # inference: no soft values needed
        mask = (z > 0).to(z.dtype)
        return mask, mask
    soft = torch.sigmoid(z / tau)
    if not hard:
        return soft, soft
    mask = (z > 0).to(soft.dtype)
    # Straight-through: forward value exactly mask (1 - soft is exact for soft >= 0.5), gradient of soft.
    return (mask - soft).detach() + soft, soft


def binary_entropy(p: torch.Tensor) -> torch.Tensor:
    """Mean binary entropy (nats) of probabilities ``p``; 0 when every p is 0 or 1."""
    p = p.clamp(1e-6, 1 - 1e-6)
    return -(p * p.log() + (1 - p) * (1 - p).log()).mean()


# ---------------------------------------------------------------------------------------------
# Config and shared state


@dataclass(frozen=True)
class DCSConfig(Config):
    """How the supernet is built.

    Args:
        qk_mask: ``input`` (the paper's theta = Linear(x)), ``static`` (one theta per channel,
            can be materialized) or ``none``.
        mlp_gates: search the MLP channel gates alpha.
        alpha_init: initial alpha (positive: gates start open, the dense model is the start). The
            hard Gumbel sample is on iff alpha + L > 0 with L ~ Logistic(0, 1) whatever the
            temperature, so a gate at alpha drops its channel with probability sigmoid(-alpha) at
            every training step: 5 keeps that under 2% at the start (a pretrained model does not
            tolerate 10-30% of its channels dropped at random, as alpha 1-2 would).
        theta_init: initial theta (bias of the theta Linear, or the static theta).
        init_spread: the initial logits are ``init + init_spread * z`` with z in [-1, 1] the channel's
            importance within its block (weight magnitude, or the scores given to
            :func:`make_supernet`, e.g. :func:`activation_importance`) (standardised, clipped at 2 sigma, halved):
            the least important channels reach the threshold first, so the FLOPs fall gradually
            instead of every equal logit crossing at the same step (Adam moves all logits alike
            when cross-entropy barely tells channels apart). 0: every logit starts at ``init``.
    """

    qk_mask: str = "static"
    mlp_gates: bool = True
    alpha_init: float = 5.0
    theta_init: float = 5.0
    init_spread: float = 1.0

    def __post_init__(self) -> None:
        check_choice("qk_mask", self.qk_mask, QK_MODES)
        check_bool("mlp_gates", self.mlp_gates)
        check_range("alpha_init", self.alpha_init)
        check_range("theta_init", self.theta_init)
        check_range("init_spread", self.init_spread, 0)


@dataclass
class DCSState:
    """Shared by every patched module of one model (the search sets ``tau``).

    ``soft_gates[i]`` / ``soft_qk[i]`` are block i's soft MLP gate / static Q/K mask of the last
    forward (for the differentiable cost), ``tokens`` the sequence length the attention saw.
    """

    tau: float = 1.0
    force_dense: bool = False
    soft_gates: dict[int, torch.Tensor] = field(default_factory=dict)
    soft_qk: dict[int, torch.Tensor] = field(default_factory=dict)
    tokens: int = 0

    def __deepcopy__(self, memo: dict) -> "DCSState":  # the soft values are graph tensors: not copied
        return DCSState(tau=self.tau, force_dense=self.force_dense, tokens=self.tokens)


# ---------------------------------------------------------------------------------------------
# The supernet's modules


class DCSQKMask(nn.Module):
    """The Q/K channel mask of one attention, plugged in as :attr:`NCAttention.qk_mask`.

    ``input``: theta = Linear(C -> H * d)(x) per token, mask (B, H, N, d); ``static``: theta (H * d,)
    a parameter, mask (1, H, 1, d). The mask is 1 everywhere when the state has ``force_dense``.
    """

    def __init__(self, mode: str, *, in_features: int, heads: int, head_dim: int, init: float,
                 device: torch.device | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.mode, self.heads, self.head_dim = mode, heads, head_dim
        if mode == "input":
            self.theta = nn.Linear(in_features, heads * head_dim, device=device, dtype=dtype)
            nn.init.zeros_(self.theta.weight)
            nn.init.constant_(self.theta.bias, init)
        else:
            self.theta = nn.Parameter(torch.full((heads * head_dim,), init, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        st: DCSState = self._dcs_state
        st.tokens = x.shape[1]
        if st.force_dense:
            return None
        B, N, _ = x.shape
        if self.mode == "input":
            m, _ = gumbel_sigmoid(self.theta(x), tau=st.tau, noise=self.training)
            return m.reshape(B, N, self.heads, self.head_dim).transpose(1, 2)  # (B, H, N, d)
        m, soft = gumbel_sigmoid(self.theta, tau=st.tau, noise=self.training)
        st.soft_qk[self._dcs_index] = soft
        return m.reshape(1, self.heads, 1, self.head_dim)


class DCSBlock(NCBlock):
    """:class:`NCBlock` whose MLP half is gated by DCS channel gates.

    Modifications: ``x + drop_path2(ls2(mlp(norm2(x) * g) * g))``, g (C,) a Gumbel-sigmoid gate of
    the architecture parameters ``dcs_alpha``; its soft value is stored in the shared state.
    """

    def mlp_gate(self) -> torch.Tensor | None:
        st: DCSState = self._dcs_state
        if self.dcs_alpha is None or st.force_dense:
            return None
        g, soft = gumbel_sigmoid(self.dcs_alpha, tau=st.tau, noise=self.training)
        st.soft_gates[self._dcs_index] = soft
        return g

    def mlp_half(self, x: torch.Tensor) -> torch.Tensor:
        g = self.mlp_gate()
        if g is None:
            return super().mlp_half(x)
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x) * g) * g))


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
        y = self.drop_path2(self.ls2(self.mlp(h))).reshape(B * N, -1)
        if torch.is_grad_enabled() and (x.requires_grad or y.requires_grad):
            return x.reshape(B * N, C).index_add(1, keep, y).reshape(B, N, C)
        return x.reshape(B * N, C).index_add_(1, keep, y).reshape(B, N, C)  # inference: x is this block's own


# ---------------------------------------------------------------------------------------------
# Building, reading and recording


def check_supported(model: nn.Module) -> None:
    to_core(model, method="dcs")
    for i, blk in enumerate(model.blocks):
        if type(blk) is not NCBlock:
            raise NascompressError(f"dcs must be the first method of a model; blocks.{i} is already a {type(blk).__name__}")
        if not (hasattr(blk.mlp, "fc1") and hasattr(blk.mlp, "fc2")):
            raise NascompressError(f"DCS supports MLPs with fc1/fc2; block {i} has {type(blk.mlp).__name__}")


def attach_state(model: nn.Module, *, tau: float = 1.0) -> DCSState:
    """Give the model (and each of its blocks and Q/K masks) one shared :class:`DCSState`."""
    st = DCSState(tau=tau)
    model.dcs_state = st
    for i, blk in enumerate(model.blocks):
        blk._dcs_state, blk._dcs_index = st, i
        if blk.attn.qk_mask is not None:
            blk.attn.qk_mask._dcs_state, blk.attn.qk_mask._dcs_index = st, i
    return st


def add_qk_mask(attn: NCAttention, mode: str, *, theta_init: float) -> None:
    """Plug a fresh DCS Q/K mask (``mode`` input or static) into ``attn``."""
    w = attn.qkv.weight
    attn.qk_mask = DCSQKMask(mode, in_features=attn.qkv.in_features, heads=attn.num_heads, head_dim=attn.head_dim,
                             init=theta_init, device=w.device, dtype=w.dtype)


def spread(importance: torch.Tensor) -> torch.Tensor:
    """Importance scores -> z in [-1, 1]: standardised over the last dim, clipped at 2 sigma, halved."""
    z = (importance - importance.mean(-1, keepdim=True)) / importance.std(-1, keepdim=True).clamp_min(1e-12)
    return z.clamp(-2, 2) / 2


@torch.no_grad()
def channel_importance(blk: NCBlock) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight-magnitude importance of a block's residual channels for its MLP (|LN2 gain| x ||fc1
    column|| x ||fc2 row||) and of each head's Q/K channels (||W_q row|| x ||W_k row||): (C,), (H, d)."""
    g = blk.norm2.weight.abs() if getattr(blk.norm2, "weight", None) is not None else 1.0
    mlp = g * blk.mlp.fc1.weight.norm(dim=0) * blk.mlp.fc2.weight.norm(dim=1)
    a = blk.attn
    w = a.qkv.weight
    qk = (w[:a.attn_dim].norm(dim=1) * w[a.attn_dim:2 * a.attn_dim].norm(dim=1)).reshape(a.num_heads, a.head_dim)
    return mlp, qk


@torch.no_grad()
def activation_importance(model: nn.Module, batches: Iterable[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Data-driven importance of every block's channels, measured on ``batches`` of (preprocessed)
    images through the dense ``model`` (eval mode): per residual channel c, its share of the MLP's
    input (rms of LN2's output c x ||fc1 column c||, normalised to sum 1 over the block) plus its
    share of the MLP's output (rms of the written channel c after ls2, normalised likewise); per
    Q/K channel, rms(q) x rms(k). Per block ``(mlp (C,), qk (H, d))``, as :func:`channel_importance`.

    Why: on a pretrained model weight magnitudes say little about what the channels carry. On
    DINOv2 ViT-S/14 (112 px, Fashion-MNIST probe, 85.3% on 600 validation images) dropping the
    20% least important residual channels of every MLP gave 11.3% by weight magnitude and 50.0%
    by this score; on the Fashion-MNIST base trained from scratch 88.7% and 88.2% (dense 89.0%)
    (``bench/dcs_init_order.py``)."""
    check_supported(model)
    acc = [dict(n=0, h2=0.0, y2=0.0, q2=0.0, k2=0.0) for _ in model.blocks]  # n: tokens seen by the block

    def mlp_hook(i: int, blk: nn.Module):
        def hook(mod, inp, out):
            h = inp[0].flatten(0, -2).float()
            acc[i]["n"] += h.shape[0]
            acc[i]["h2"] = acc[i]["h2"] + (h * h).sum(0)
            y = blk.ls2(out).flatten(0, -2).float()
            acc[i]["y2"] = acc[i]["y2"] + (y * y).sum(0)
        return hook

    def qkv_hook(i: int, a: NCAttention):
        def hook(mod, inp, out):
            o = out.flatten(0, -2).float()
            q, k = o[:, :a.attn_dim], o[:, a.attn_dim:2 * a.attn_dim]
            acc[i]["q2"] = acc[i]["q2"] + (q * q).sum(0)
            acc[i]["k2"] = acc[i]["k2"] + (k * k).sum(0)
        return hook

    handles = []
    for i, blk in enumerate(model.blocks):
        handles.append(blk.mlp.register_forward_hook(mlp_hook(i, blk)))
        handles.append(blk.attn.qkv.register_forward_hook(qkv_hook(i, blk.attn)))
    was_training = model.training
    model.eval()
    try:
        for x in batches:
            model(x)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    if not acc[0]["n"]:
        raise NascompressError("activation importance needs at least one batch of images")
    out = []
    for blk, a in zip(model.blocks, acc):
        n = a["n"]
        inp = (a["h2"] / n).sqrt() * blk.mlp.fc1.weight.detach().float().norm(dim=0)
        outp = (a["y2"] / n).sqrt()
        mlp = inp / inp.sum().clamp_min(1e-12) + outp / outp.sum().clamp_min(1e-12)
        att = blk.attn
        qk = ((a["q2"] / n).sqrt() * (a["k2"] / n).sqrt()).reshape(att.num_heads, att.head_dim)
        out.append((mlp, qk))
    return out


def make_supernet(model: VisionTransformer, cfg: DCSConfig, *, tau: float = 1.0,
                  importance: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> VisionTransformer:
    """Patch ``model`` in place into the DCS supernet; dense weights keep their keys. The gate
    logits start open, spread by importance (``cfg.init_spread``): ``importance`` per block
    (e.g. :func:`activation_importance`), else weight magnitude (:func:`channel_importance`)."""
    check_supported(model)
    if importance is not None and len(importance) != len(model.blocks):
        raise NascompressError(f"importance has {len(importance)} blocks but the model has {len(model.blocks)}")
    for j, blk in enumerate(model.blocks):
        mlp_imp, qk_imp = channel_importance(blk) if importance is None else importance[j]
        blk.__class__ = DCSBlock
        blk.dcs_alpha = None
        if cfg.mlp_gates:
            w = blk.mlp.fc1.weight
            alpha = cfg.alpha_init + cfg.init_spread * spread(mlp_imp.to(w.device, torch.float32))
            blk.dcs_alpha = nn.Parameter(alpha.to(device=w.device, dtype=w.dtype))
        if cfg.qk_mask != "none":
            add_qk_mask(blk.attn, cfg.qk_mask, theta_init=cfg.theta_init)
            if cfg.qk_mask == "static":
                with torch.no_grad():
                    th = blk.attn.qk_mask.theta
                    th.add_(cfg.init_spread * spread(qk_imp.to(th.device, torch.float32)).flatten().to(th.dtype))
    attach_state(model, tau=tau)
    return model


def arch_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The architecture parameters: every alpha, and the static theta (updated on the 30% split)."""
    ps = []
    for blk in model.blocks:
        if getattr(blk, "dcs_alpha", None) is not None:
            ps.append(blk.dcs_alpha)
        qm = blk.attn.qk_mask
        if qm is not None and qm.mode == "static":
            ps.append(qm.theta)
    return ps


@torch.no_grad()
def selection(model: nn.Module) -> list[dict[str, Any]]:
    """The channels the eval-mode supernet keeps, per block: ``mlp_keep`` (alpha > 0) and, for
    the static Q/K mask, ``qk_keep`` (per head, theta > 0). ``None`` means no selection."""
    out = []
    for blk in model.blocks:
        alpha = getattr(blk, "dcs_alpha", None)
        rec: dict[str, Any] = {"mlp_keep": None if alpha is None else torch.nonzero(alpha > 0).flatten().tolist(),
                               "qk_keep": None}
        qm = blk.attn.qk_mask
        if qm is not None and qm.mode == "static":
            rec["qk_keep"] = [torch.nonzero(t > 0).flatten().tolist() for t in qm.theta.reshape(qm.heads, qm.head_dim)]
        out.append(rec)
    return out


def make_record(model: nn.Module, cfg: DCSConfig, *, stage: str) -> dict[str, Any]:
    """The ``arch.json`` method record of a supernet (stage ``supernet`` or ``materialized``)."""
    return {"name": "dcs", "config": cfg.to_dict(), "stage": stage, "tau": float(model.dcs_state.tau),
            "blocks": selection(model)}


# ---------------------------------------------------------------------------------------------
# Materialization


def slice_mlp(block: NCBlock, keep: Any) -> NCBlock:
    """Gather the MLP channels ``keep`` of ``block`` physically (see :class:`MaterializedBlock`).

    With every channel kept the block is a plain :class:`NCBlock` (no gather, no write-back).
    """
    C = block.mlp.fc1.in_features
    idx = as_index(keep, C, what="mlp_keep", device=block.mlp.fc1.weight.device)
    if getattr(block, "dcs_alpha", None) is not None or hasattr(block, "dcs_alpha"):
        del block.dcs_alpha
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


def slice_qk(attn: NCAttention, keep_per_head: list[Any], *, width: int | None = None) -> NCAttention:
    """Keep the query/key channels ``keep_per_head[h]`` of each head h (V untouched).

    The qkv projection then emits ``[q (H * qk_dim), k (H * qk_dim), v]`` with every head's kept
    channels zero-padded to ``qk_dim``: ``width`` (e.g. the largest count rounded up to the
    alignment, :func:`~nascompress.layers.aligned_width`), default the largest count. The padding
    rows are zero weights, so the heads stay one batched matmul (counted as computed); how q/k
    then reach the attention kernel is the attention's ``qk_layout``."""
    if not isinstance(attn.q_norm, nn.Identity):
        raise NascompressError("a static Q/K mask cannot be materialized on a model with qk_norm "
                               "(the norm needs every channel); search with --qk-mask input or none")
    H, d = attn.num_heads, attn.head_dim
    if len(keep_per_head) != H:
        raise NascompressError(f"qk_keep has {len(keep_per_head)} heads but the attention has {H}")
    dev, A = attn.qkv.weight.device, attn.attn_dim
    keeps = [as_index(kh, d, what=f"qk_keep of head {h}", device=dev) for h, kh in enumerate(keep_per_head)]
    kmax = max(1, *(len(kh) for kh in keeps))
    if width is not None and not kmax <= width <= d:
        raise NascompressError(f"the padded Q/K width {width} must hold the largest kept count {kmax} and "
                               f"be at most the head dim {d}")
    width = kmax if width is None else width
    zero = 3 * A  # index of an all-zero row appended below qkv's rows: the padding
    q_rows = torch.cat([torch.cat([h * d + kh, kh.new_full((width - len(kh),), zero)]) for h, kh in enumerate(keeps)])
    k_rows = torch.where(q_rows == zero, q_rows, q_rows + A)
    rows = torch.cat([q_rows, k_rows, torch.arange(2 * A, 3 * A, device=dev)])
    attn.qkv = slice_linear_out(with_zero_row(attn.qkv), rows) if (q_rows == zero).any() else \
        slice_linear_out(attn.qkv, rows)
    attn.qk_counts, attn.qk_dim = [len(kh) for kh in keeps], width
    attn.qk_mask = None
    return attn


def _apply_blocks(model: nn.Module, cfg: DCSConfig, blocks: list[dict[str, Any]]) -> None:
    if len(blocks) != len(model.blocks):
        raise NascompressError(f"arch.json records {len(blocks)} DCS blocks but the model has {len(model.blocks)}")
    for i, (blk, rec) in enumerate(zip(model.blocks, blocks)):
        if cfg.qk_mask == "static":
            if rec.get("qk_keep") is None:
                raise NascompressError(f"arch.json block {i} has no qk_keep for the static Q/K mask")
            slice_qk(blk.attn, rec["qk_keep"])
        if rec.get("mlp_keep") is not None:
            slice_mlp(blk, rec["mlp_keep"])
        elif isinstance(blk, DCSBlock):  # mlp_gates off: plain block again
            del blk.dcs_alpha
            blk.__class__ = NCBlock


def build_materialized(model: nn.Module, cfg: DCSConfig, blocks: list[dict[str, Any]], *,
                       tau: float = 1.0) -> nn.Module:
    """Shape a fresh dense timm ViT as the materialized model ``blocks`` describes (for loading)."""
    check_supported(model)
    if cfg.qk_mask == "input":
        for blk in model.blocks:
            add_qk_mask(blk.attn, "input", theta_init=cfg.theta_init)
    _apply_blocks(model, cfg, blocks)
    attach_state(model, tau=tau)
    return model


def materialize(supernet: nn.Module, cfg: DCSConfig) -> tuple[nn.Module, dict[str, Any]]:
    """A materialized copy of ``supernet`` (eval-mode masks) and its ``arch.json`` record."""
    record = make_record(supernet, cfg, stage="materialized")
    model = copy.deepcopy(supernet)
    _apply_blocks(model, cfg, record["blocks"])
    attach_state(model, tau=supernet.dcs_state.tau)
    return model.eval(), record


# ---------------------------------------------------------------------------------------------
# The method


@register_method
class DCS(Method):
    name = "dcs"
    summary = "differentiable channel selection: Q/K channel masks and MLP channel gates (seed 003)"
    config_cls = DCSConfig
    stacks_on = frozenset()  # first: it changes the channels every later method reads

    def patch(self, model: nn.Module, cfg: DCSConfig, record: dict[str, Any]) -> nn.Module:
        stage = check_choice("stage", record.get("stage", "supernet"), STAGES)
        tau = float(record.get("tau", 1.0))
        if stage == "supernet":
            return make_supernet(model, cfg, tau=tau)
        return build_materialized(model, cfg, record.get("blocks") or [], tau=tau)

    def prepare(self, model, cfg, recipe):
        model = make_supernet(model, cfg)
        return model, make_record(model, cfg, stage="supernet")

    def hooks(self, model, record, *, teacher, train_cfg):
        raise NascompressError("dcs is trained by `nascompress search dcs` (then `materialize` and `retrain`), "
                               "not by finetune")


__all__ = ["DCS", "DCSConfig", "DCSState", "DCSQKMask", "DCSBlock", "MaterializedBlock", "gumbel_sigmoid",
           "channel_importance", "activation_importance",
           "gumbel_noise", "binary_entropy", "make_supernet", "arch_parameters", "selection", "make_record",
           "attach_state", "slice_mlp", "slice_qk", "build_materialized", "materialize", "check_supported"]
