"""DCS: differentiable channel selection (seed 003, sections 3.1, 3.2, 3.4; METHODS.md section 1).

Two selections inside every block, searched jointly (the search is ``nascompress search dcs``):

* Q/K channel masks for the attention weights (section 3.1): ``W = softmax((Q*M)(K*M)^T / sqrt(d))``,
  the same mask on Q and K, V untouched, plugged into :class:`~nascompress.layers.NCAttention` as
  its ``qk_mask`` (:class:`DCSQKMask`). ``qk_mask="input"`` is the paper's input-dependent mask,
  theta = Linear(x) per token; ``"static"`` learns one theta per channel (as the official code
  does), the only kind that can be removed physically; ``"none"`` turns it off.
* MLP gates, one of two families (``mlp_gates``; :class:`DCSBlock` owns that MLP half):
  ``residual`` (section 3.2, the paper's): alpha (C,) per block, the gate g multiplies the MLP's
  input and output residual channels; ``hidden``: alpha (Hm,) per block gates the MLP's hidden
  neurons (fc1 rows / fc2 columns), which leaves the residual stream untouched (far less
  destructive on pretrained models, see :mod:`nascompress.dcs_search.family`).

Both are binary Gumbel-sigmoid masks: hard 0/1 forward at 0.5, straight-through backward. At
inference (no noise) the mask keeps the channels with ``logit > 0``, their count widened to the
alignment (:func:`aligned_mask`: 0, the full width or a multiple of ``align``, filled with the next
channels by logit), so the eval-mode supernet is exactly the model materialization builds. New
parameters: ``blocks.<i>.dcs_alpha`` and ``blocks.<i>.attn.qk_mask.theta``; timm's keys are kept.

Materialization gathers the selection physically: :func:`slice_mlp` (``residual``: the MLP reads
the kept residual channels after LN2 and writes them back with one ``index_add``:
:class:`MaterializedBlock`), :func:`slice_hidden_gates` (``hidden``: fc1 keeps its kept rows and fc2
its kept columns, a plain block) and :func:`slice_qk` (each head keeps its Q/K channels, zero-padded
to the largest count so the heads stay one batched matmul; the original ``1/sqrt(head_dim)`` scale
is kept). The input-dependent mask cannot be removed: its theta Linear stays (and is counted).

The ``arch.json`` record is ``{"name": "dcs", "config": DCSConfig, "stage": "supernet" |
"materialized", "tau": float, "blocks": [{"mlp_keep": [...] | None, "hidden_keep": [...] | None,
"qk_keep": [[...] per head]}]}``; DCS must be the first method of a model (it changes channels
that later methods read).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from timm.layers import Mlp
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from ..config import Config, StageSettings, check_choice, check_range, check_settings, setting, user_settings
from ..errors import NascompressError, SettingError
from ..layers import DEFAULT_ALIGN, NCAttention, NCBlock, aligned_width
from ..slicing import as_index, slice_hidden, slice_layerscale, slice_linear_in, slice_linear_out, slice_qk
from . import Method, register_method
from .dcs_importance import (
    BlockStats,
    ChannelImportance,
    activation_importance,
    activation_stats,
    channel_importance,
    check_supported,
    spread,
)

QK_MODES = ("input", "static", "none")
MLP_GATES = ("residual", "hidden", "none", "auto")
HIDDEN_FILLS = ("zero", "mean")
STAGES = ("supernet", "materialized")
PROTECT_LOGIT = 30.0  # a protected gate's logit: no Gumbel sample closes it (P < 1e-13), and its gradient is zeroed


# ---------------------------------------------------------------------------------------------
# Pure functions


def gumbel_noise(
    shape: torch.Size | tuple[int, ...], *, like: torch.Tensor, generator: torch.Generator | None = None
) -> torch.Tensor:
    """g1 - g2 with g1, g2 ~ Gumbel(0, 1) i.i.d. (a Logistic(0, 1) sample), shaped ``shape``."""
    u = torch.rand((2, *shape), generator=generator, device=like.device, dtype=like.dtype)
    g = -torch.log(-torch.log(u.clamp_min(1e-10)))
    return g[0] - g[1]


def gumbel_sigmoid(
    logits: torch.Tensor, *, tau: float, noise: bool = True, hard: bool = True, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
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


def aligned_counts(logits: torch.Tensor, *, align: int) -> list[int]:
    """The width each row of ``logits`` (..., n) keeps at inference: the count of positive logits,
    rounded up to the alignment (:func:`~nascompress.layers.aligned_width`, mode ``up``)."""
    n = logits.shape[-1]
    counts = (logits.detach() > 0).reshape(-1, n).sum(-1).tolist()
    return [aligned_width(int(c), align=align, full=n, mode="up") for c in counts]


def aligned_mask(logits: torch.Tensor, *, align: int) -> torch.Tensor:
    """The inference mask of gate ``logits`` (..., n): per row, its ``logit > 0`` channels, widened
    to the aligned count (:func:`aligned_counts`) with the next channels by logit (ties: the lower
    index). Every kept width is 0, n or a multiple of ``align``; ``align=1`` gives ``1[logit > 0]``."""
    z = logits.detach()
    if align == 1:
        return (z > 0).to(z.dtype)
    n = z.shape[-1]
    rows = z.reshape(-1, n)
    order = torch.sort(-rows, dim=-1, stable=True).indices  # channels by logit, highest first
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(n, device=z.device).expand_as(order))
    width = torch.tensor(aligned_counts(rows, align=align), device=z.device).unsqueeze(-1)
    return (rank < width).to(z.dtype).reshape(z.shape)


# ---------------------------------------------------------------------------------------------
# Config and shared state


@dataclass(frozen=True)
class DCSConfig(Config):
    """How the supernet is built.

    Args:
        qk_mask: ``input`` (the paper's theta = Linear(x)), ``static`` (one theta per channel,
            can be materialized) or ``none``.
        mlp_gates: the MLP gate family: ``residual`` (the paper's, the default of this building
            block: the MLP's input/output residual channels), ``hidden`` (the MLP's hidden neurons),
            ``none``, or ``auto`` (the search chooses from a short measured probe on the model,
            :mod:`nascompress.dcs_search.family`; ``search dcs``, the pipeline and study trials
            default to it: :data:`SEARCH_DCS`; a supernet is always built with the chosen family).
            ``true``/``false``
            (records of earlier versions) read as ``residual``/``none``.
        align: every width the search keeps (MLP residual or hidden channels per block, Q/K
            channels per head) is 0, the full width or a multiple of this (1: any width).
        hidden_fill: what a closed hidden neuron contributes: ``zero`` (nothing) or ``mean`` (its
            mean activation on the dense model, folded into fc2's bias when materialized; the
            bias correction of structured pruning, which keeps the MLP's output unbiased).
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

    # Fields declared with setting() are `search dcs` options and `stages.dcs` keys (the CLI's help, the
    # pipeline's checks; choices in the order the messages list them); theta_init follows alpha_init there.
    qk_mask: str = setting(
        "static",
        choices=("static", "input", "none"),
        help=(
            "Q/K channel mask: static (searched per channel, materializable), input (the paper's, kept at run "
            "time) or none."
        ),
    )
    mlp_gates: str = setting(
        "residual",
        choices=("auto", "residual", "hidden", "none"),
        help=(
            "MLP gate family: residual (the paper's: the MLP's input/output residual channels), hidden (its hidden "
            "neurons: far less destructive on pretrained models), none, or auto (chosen by a short measured probe "
            "on the model: the family whose pruned models stay closer to the dense one)."
        ),
    )
    align: int = setting(
        DEFAULT_ALIGN,
        lo=1,
        help=(
            "Every kept width (MLP channels per block, Q/K channels per head) is 0, full or a multiple of this "
            "(GPU kernels leave their fast paths below multiples of 8; 1: any width)."
        ),
    )
    hidden_fill: str = setting(
        "mean",
        choices=("mean", "zero"),
        help=("Hidden family: a closed neuron contributes zero or its mean activation (folded into fc2's bias)."),
    )
    alpha_init: float = setting(5.0, help="Initial mean gate logit alpha/theta (> 0: gates start open).")
    theta_init: float = 5.0
    init_spread: float = 1.0

    @classmethod
    def user(cls, **given: Any) -> "DCSConfig":
        """The config a user's settings make (``search dcs``, ``stages.dcs``, a study trial's dcs
        entry): the search's recipe (:data:`SEARCH_DCS`: ``mlp_gates`` auto) but those ``given``,
        ``theta_init`` following ``alpha_init`` unless given."""
        cfg = SEARCH_DCS.replace(**given)
        return cfg if "theta_init" in given else cfg.replace(theta_init=cfg.alpha_init)

    def __post_init__(self) -> None:
        if isinstance(self.mlp_gates, bool):  # records written before the gate families
            object.__setattr__(self, "mlp_gates", "residual" if self.mlp_gates else "none")
        check_settings(self)  # every setting() against its declaration; below: the internal fields
        check_range("theta_init", self.theta_init)
        check_range("init_spread", self.init_spread, 0)


# The DCS search's own settings (`search dcs` options, `stages.dcs` keys, a study trial's dcs entry):
# the building block's, but the gate family, chosen by the search's probe on the model
SEARCH_DCS = DCSConfig(mlp_gates="auto")
SEARCH_DCS_SETTINGS = StageSettings(DCSConfig, tuple(f.name for f in user_settings(DCSConfig)), recipe=SEARCH_DCS)


@dataclass
class DCSState:
    """Shared by every patched module of one model (the search sets ``tau``).

    ``soft_gates[i]`` / ``soft_qk[i]`` are block i's soft MLP gate / static Q/K mask of the last
    forward (for the differentiable cost), ``tokens`` the sequence length the attention saw,
    ``family`` the MLP gate family and ``align`` the width alignment of the inference masks.
    """

    tau: float = 1.0
    force_dense: bool = False
    sample: bool = True  # training forwards draw Gumbel samples (False: the aligned mask, as at inference)
    soft_gates: dict[int, torch.Tensor] = field(default_factory=dict)
    soft_qk: dict[int, torch.Tensor] = field(default_factory=dict)
    tokens: int = 0
    family: str = "residual"
    align: int = 1

    def __deepcopy__(self, memo: dict) -> "DCSState":  # the soft values are graph tensors: not copied
        return DCSState(
            tau=self.tau,
            force_dense=self.force_dense,
            sample=self.sample,
            tokens=self.tokens,
            family=self.family,
            align=self.align,
        )


def _gate(logits: torch.Tensor, st: DCSState, training: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask, soft) of gate logits: a Gumbel sample in training (where the state samples), else the
    aligned mask (inference, and a search's weight steps at the current architecture)."""
    if training and st.sample:
        return gumbel_sigmoid(logits, tau=st.tau, noise=True)
    m = aligned_mask(logits, align=st.align)
    return m, m


# ---------------------------------------------------------------------------------------------
# The supernet's modules


class DCSQKMask(nn.Module):
    """The Q/K channel mask of one attention, plugged in as :attr:`NCAttention.qk_mask`.

    ``input``: theta = Linear(C -> H * d)(x) per token, mask (B, H, N, d); ``static``: theta (H * d,)
    a parameter, mask (1, H, 1, d), per head aligned at inference. The mask is 1 everywhere when
    the state has ``force_dense``.
    """

    def __init__(
        self,
        mode: str,
        *,
        in_features: int,
        heads: int,
        head_dim: int,
        init: float,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ):
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
        theta = self.theta.reshape(self.heads, self.head_dim)
        m, soft = _gate(theta, st, self.training)
        st.soft_qk[self._dcs_index] = soft.reshape(-1)
        return m.reshape(1, self.heads, 1, self.head_dim)


class DCSBlock(NCBlock):
    """:class:`NCBlock` whose MLP half is gated by DCS channel gates of the state's family.

    Modifications: ``residual``: ``x + drop_path2(ls2(mlp(norm2(x) * g) * g))``, g (C,);
    ``hidden``: the MLP's hidden activations h (after fc1 and the activation) become
    ``h * g + (1 - g) * dcs_fill``, g (Hm,), ``dcs_fill`` 0 or the dense model's mean activation.
    g is a Gumbel-sigmoid gate of the architecture parameters ``dcs_alpha`` (aligned at
    inference); its soft value is stored in the shared state.
    """

    def mlp_gate(self) -> torch.Tensor | None:
        st: DCSState = self._dcs_state
        if self.dcs_alpha is None or st.force_dense:
            return None
        g, soft = _gate(self.dcs_alpha, st, self.training)
        st.soft_gates[self._dcs_index] = soft
        return g

    def mlp_half(self, x: torch.Tensor) -> torch.Tensor:
        g = self.mlp_gate()
        if g is None:
            return super().mlp_half(x)
        if self._dcs_state.family == "hidden":
            m = self.mlp
            fill = getattr(self, "dcs_fill", None)
            if g.requires_grad or not self.training or not _compactable(m):
                h = m.drop1(m.act(m.fc1(self.norm2(x))))  # (B, N, Hm)
                g = g.to(h.dtype)  # h's precision (bf16 under autocast): an fp32 gate would promote h
                h = h * g if fill is None else h * g + (1 - g) * fill.to(h.dtype)
                return x + self.drop_path2(self.ls2(m.drop2(m.fc2(m.norm(h)))))
            # training under a hard 0/1 mask (the search's weight steps at the current architecture):
            # only the open neurons are computed, ``fc2(h * g + (1 - g) * fill)`` =
            # ``fc2[:, open](h[open]) + fc2((1 - g) * fill)``; the same function and gradients, fewer
            # MACs. (Inference keeps the masked form: the profiler counts the Linear modules it runs.)
            keep = g.nonzero().flatten()
            if keep.numel() == g.numel():  # every neuron open: the plain MLP (no gather, no scatter back)
                return x + self.drop_path2(self.ls2(m.drop2(m.fc2(m.act(m.fc1(self.norm2(x)))))))
            # index_select, whose backward is an index_add (advanced indexing's index_put is several times slower)
            w1, b1 = (
                m.fc1.weight.index_select(0, keep),
                None if m.fc1.bias is None else m.fc1.bias.index_select(0, keep),
            )
            h = m.act(F.linear(self.norm2(x), w1, b1))
            out = F.linear(h, m.fc2.weight.index_select(1, keep), m.fc2.bias)
            if fill is not None:
                out = out + F.linear((1 - g) * fill, m.fc2.weight)
            return x + self.drop_path2(self.ls2(m.drop2(out)))
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x) * g) * g))


def _compactable(m: nn.Module) -> bool:
    """Whether a hidden-gated MLP can skip its closed neurons in training: fc1 -> act -> fc2 with no
    norm between and no dropout drawn on the hidden activations (its draws would change)."""
    drop = m.drop1
    return (
        isinstance(getattr(m, "norm", None), (nn.Identity, type(None)))
        and isinstance(m.fc1, nn.Linear)
        and isinstance(m.fc2, nn.Linear)
        and (isinstance(drop, nn.Identity) or getattr(drop, "p", 0.0) == 0.0)
    )


class ConstantMLP(nn.Module):
    """A hidden-gated MLP with no neuron left: its output is fc2's bias for every token (0 MACs)."""

    def __init__(self, bias: torch.Tensor):
        super().__init__()
        self.bias = nn.Parameter(bias.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, N, C) -> (B, N, C_out)
        return self.bias.expand(*x.shape[:-1], self.bias.numel())


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


# ---------------------------------------------------------------------------------------------
# Building, reading and recording


def check_family(model: nn.Module, family: str) -> None:
    """``family`` can gate ``model``'s MLPs (``hidden`` needs timm's plain Mlp without a hidden norm)."""
    if family == "auto":
        raise NascompressError(
            "mlp_gates 'auto' is chosen by the search (nascompress.dcs_search.family); "
            "build a supernet with residual, hidden or none"
        )
    if family != "hidden":
        return
    for i, blk in enumerate(model.blocks):
        if type(blk.mlp) is not Mlp or not isinstance(blk.mlp.norm, nn.Identity):
            raise SettingError(
                f"{{mlp_gates}} hidden needs timm's plain Mlp (fc1, act, fc2) in every block; block {i} "
                f"has a {type(blk.mlp).__name__}{' with a hidden norm' if type(blk.mlp) is Mlp else ''}"
                "; use {mlp_gates} residual"
            )


def attach_state(model: nn.Module, *, tau: float = 1.0, family: str = "residual", align: int = 1) -> DCSState:
    """Give the model (and each of its blocks and Q/K masks) one shared :class:`DCSState`."""
    st = DCSState(tau=tau, family=family, align=align)
    model.dcs_state = st
    for i, blk in enumerate(model.blocks):
        blk._dcs_state, blk._dcs_index = st, i
        if blk.attn.qk_mask is not None:
            blk.attn.qk_mask._dcs_state, blk.attn.qk_mask._dcs_index = st, i
    return st


def add_qk_mask(attn: NCAttention, mode: str, *, theta_init: float) -> None:
    """Plug a fresh DCS Q/K mask (``mode`` input or static) into ``attn``."""
    w = attn.qkv.weight
    attn.qk_mask = DCSQKMask(
        mode,
        in_features=attn.qkv.in_features,
        heads=attn.num_heads,
        head_dim=attn.head_dim,
        init=theta_init,
        device=w.device,
        dtype=w.dtype,
    )


def protect_gates(blk: NCBlock, mask: torch.Tensor) -> None:
    """Fix the gates ``mask`` (bool, alpha's shape) of ``blk`` open: their logit is set to
    :data:`PROTECT_LOGIT` and their gradient zeroed (Adam then never moves them; the arch group has
    no weight decay). Recorded as the non-persistent buffer ``dcs_protect``."""
    mask = mask.to(device=blk.dcs_alpha.device, dtype=torch.bool)
    with torch.no_grad():
        blk.dcs_alpha[mask] = PROTECT_LOGIT
    on = {mask.device: mask}  # the model may move (a search built on the CPU, trained on CUDA): the hook follows

    def zero_protected(g: torch.Tensor) -> torch.Tensor:
        if g.device not in on:
            on[g.device] = mask.to(g.device)
        return g.masked_fill(on[g.device], 0.0)

    blk.dcs_alpha.register_hook(zero_protected)
    blk.register_buffer("dcs_protect", mask, persistent=False)


def make_supernet(
    model: VisionTransformer,
    cfg: DCSConfig,
    *,
    tau: float = 1.0,
    importance: list[ChannelImportance] | None = None,
    fill: list[torch.Tensor] | None = None,
    protect: list[torch.Tensor | None] | None = None,
) -> VisionTransformer:
    """Patch ``model`` in place into the DCS supernet; dense weights keep their keys.

    Args:
        cfg: its family (``cfg.mlp_gates``, resolved: not ``auto``), alignment and initial logits.
        importance: per block (e.g. :func:`activation_importance`); the gate logits start open,
            spread by it (``cfg.init_spread``); default: weight magnitude (:func:`channel_importance`).
        fill: per block, the dense model's mean hidden activation (Hm,) (``BlockStats.hidden_mean``)
            for ``hidden_fill="mean"``; without it the buffer starts at 0 (a loaded record fills it).
        protect: per block, a bool mask of gates fixed open (:func:`protect_gates`), or None.
    """
    check_supported(model)
    check_family(model, cfg.mlp_gates)
    for what, v in (("importance", importance), ("fill", fill), ("protect", protect)):
        if v is not None and len(v) != len(model.blocks):
            raise NascompressError(f"{what} has {len(v)} blocks but the model has {len(model.blocks)}")
    for j, blk in enumerate(model.blocks):
        imp = channel_importance(blk) if importance is None else importance[j]
        blk.__class__ = DCSBlock
        blk.dcs_alpha = None
        if cfg.mlp_gates != "none":
            w = blk.mlp.fc1.weight
            alpha = cfg.alpha_init + cfg.init_spread * spread(imp.mlp(cfg.mlp_gates).to(w.device, torch.float32))
            blk.dcs_alpha = nn.Parameter(alpha.to(device=w.device, dtype=w.dtype))
            if protect is not None and protect[j] is not None:
                protect_gates(blk, protect[j])
        if cfg.mlp_gates == "hidden" and cfg.hidden_fill == "mean":
            f = torch.zeros(w.shape[0]) if fill is None else fill[j].float()
            blk.register_buffer("dcs_fill", f.to(device=w.device, dtype=w.dtype).clone())
        if cfg.qk_mask != "none":
            add_qk_mask(blk.attn, cfg.qk_mask, theta_init=cfg.theta_init)
            if cfg.qk_mask == "static":
                with torch.no_grad():
                    th = blk.attn.qk_mask.theta
                    th.add_(cfg.init_spread * spread(imp.qk.to(th.device, torch.float32)).flatten().to(th.dtype))
    attach_state(model, tau=tau, family=cfg.mlp_gates, align=cfg.align)
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


def _kept(mask: torch.Tensor) -> list[int]:
    return torch.nonzero(mask > 0).flatten().tolist()


@torch.no_grad()
def selection(model: nn.Module) -> list[dict[str, Any]]:
    """The channels the eval-mode supernet keeps (its aligned masks), per block: ``mlp_keep``
    (residual family) or ``hidden_keep`` (hidden family) and, for the static Q/K mask, ``qk_keep``
    (per head). ``None`` means no selection."""
    st: DCSState = model.dcs_state
    out = []
    for blk in model.blocks:
        alpha = getattr(blk, "dcs_alpha", None)
        keep = None if alpha is None else _kept(aligned_mask(alpha, align=st.align))
        rec: dict[str, Any] = {
            "mlp_keep": keep if st.family == "residual" else None,
            "hidden_keep": keep if st.family == "hidden" else None,
            "qk_keep": None,
        }
        qm = blk.attn.qk_mask
        if qm is not None and qm.mode == "static":
            m = aligned_mask(qm.theta.reshape(qm.heads, qm.head_dim), align=st.align)
            rec["qk_keep"] = [_kept(row) for row in m]
        out.append(rec)
    return out


def make_record(model: nn.Module, cfg: DCSConfig, *, stage: str) -> dict[str, Any]:
    """The ``arch.json`` method record of a supernet (stage ``supernet`` or ``materialized``)."""
    return {
        "name": "dcs",
        "config": cfg.to_dict(),
        "stage": stage,
        "tau": float(model.dcs_state.tau),
        "blocks": selection(model),
    }


# ---------------------------------------------------------------------------------------------
# Materialization


def _drop_gates(block: NCBlock) -> None:
    for name in ("dcs_alpha", "dcs_fill", "dcs_protect"):
        if hasattr(block, name):
            delattr(block, name)


def slice_mlp(block: NCBlock, keep: Any) -> NCBlock:
    """Gather the MLP residual channels ``keep`` of ``block`` physically (see :class:`MaterializedBlock`).

    With every channel kept the block is a plain :class:`NCBlock` (no gather, no write-back).
    """
    C = block.mlp.fc1.in_features
    idx = as_index(keep, C, what="mlp_keep", device=block.mlp.fc1.weight.device)
    _drop_gates(block)
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
    _drop_gates(block)
    block.__class__ = NCBlock
    if len(idx) == 0:  # no hidden neuron left: the MLP is fc2's bias (the fill folded in), a constant
        block.mlp = ConstantMLP(fc2.bias.detach() if fc2.bias is not None else torch.zeros(fc2.out_features))
    elif len(idx) < fc1.out_features:
        slice_hidden(block, idx)
    return block


def _apply_blocks(model: nn.Module, cfg: DCSConfig, blocks: list[dict[str, Any]]) -> None:
    if len(blocks) != len(model.blocks):
        raise NascompressError(f"arch.json records {len(blocks)} DCS blocks but the model has {len(model.blocks)}")
    for i, (blk, rec) in enumerate(zip(model.blocks, blocks)):
        if cfg.qk_mask == "static":
            if rec.get("qk_keep") is None:
                raise NascompressError(f"arch.json block {i} has no qk_keep for the static Q/K mask")
            slice_qk(blk.attn, rec["qk_keep"])
        if rec.get("hidden_keep") is not None:
            slice_hidden_gates(blk, rec["hidden_keep"])
        elif rec.get("mlp_keep") is not None:
            slice_mlp(blk, rec["mlp_keep"])
        elif isinstance(blk, DCSBlock):  # no MLP gates: plain block again
            _drop_gates(blk)
            blk.__class__ = NCBlock


def build_materialized(
    model: nn.Module, cfg: DCSConfig, blocks: list[dict[str, Any]], *, tau: float = 1.0
) -> nn.Module:
    """Shape a fresh dense timm ViT as the materialized model ``blocks`` describes (for loading)."""
    check_supported(model)
    if cfg.qk_mask == "input":
        for blk in model.blocks:
            add_qk_mask(blk.attn, "input", theta_init=cfg.theta_init)
    _apply_blocks(model, cfg, blocks)
    attach_state(model, tau=tau, family=cfg.mlp_gates, align=cfg.align)
    return model


def materialize(supernet: nn.Module, cfg: DCSConfig) -> tuple[nn.Module, dict[str, Any]]:
    """A materialized copy of ``supernet`` (eval-mode masks) and its ``arch.json`` record."""
    record = make_record(supernet, cfg, stage="materialized")
    model = copy.deepcopy(supernet)
    _apply_blocks(model, cfg, record["blocks"])
    attach_state(model, tau=supernet.dcs_state.tau, family=cfg.mlp_gates, align=cfg.align)
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
        if "align" not in (record.get("config") or {}):  # a record of before the alignment: widths as kept
            cfg = cfg.replace(align=1)
        if stage == "supernet":
            return make_supernet(model, cfg, tau=tau)
        return build_materialized(model, cfg, record.get("blocks") or [], tau=tau)

    def prepare(self, model, cfg, recipe):
        model = make_supernet(model, cfg)
        return model, make_record(model, cfg, stage="supernet")

    def cli_fields(self) -> list:
        return []  # not a finetune method: its settings' options belong to `search dcs`

    def hooks(self, model, record, *, teacher, train_cfg):
        raise NascompressError(
            "dcs is trained by `nascompress search dcs` (then `materialize` and `retrain`), not by finetune"
        )


__all__ = [
    "DCS",
    "DCSConfig",
    "SEARCH_DCS",
    "SEARCH_DCS_SETTINGS",
    "DCSState",
    "DCSQKMask",
    "DCSBlock",
    "MaterializedBlock",
    "gumbel_sigmoid",
    "ChannelImportance",
    "BlockStats",
    "channel_importance",
    "activation_importance",
    "activation_stats",
    "spread",
    "aligned_mask",
    "aligned_counts",
    "protect_gates",
    "check_family",
    "MLP_GATES",
    "PROTECT_LOGIT",
    "gumbel_noise",
    "binary_entropy",
    "make_supernet",
    "arch_parameters",
    "selection",
    "make_record",
    "attach_state",
    "slice_mlp",
    "slice_hidden_gates",
    "ConstantMLP",
    "slice_qk",
    "build_materialized",
    "materialize",
    "check_supported",
]
