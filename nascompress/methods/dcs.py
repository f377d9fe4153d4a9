"""DCS: differentiable channel selection (seed 003, sections 3.1, 3.2, 3.4; METHODS.md section 1).

Two selections inside every timm ``Block``, searched jointly:

* Q/K channel masks for the attention weights (section 3.1): ``W = softmax((Q*M)(K*M)^T / sqrt(d))``,
  the same mask on Q and K, V untouched. ``qk_mask="input"`` is the paper's input-dependent
  mask, theta = Linear(x) per token; ``qk_mask="static"`` learns one theta per channel (as the
  official code does), the only kind that can be removed physically; ``"none"`` turns it off.
* MLP channel gates (section 3.2): architecture parameters alpha (C,) per block; the gate g
  multiplies the MLP's input and output features.

Both are binary Gumbel-sigmoid masks: hard 0/1 forward at 0.5, straight-through backward, no
noise at inference (so the mask is ``1[logit > 0]``). The model is patched ToMe-style by swapping
``__class__``: timm state-dict keys are kept, new parameters are ``dcs_alpha`` and ``dcs_theta``.

The ``arch.json`` record is ``{"name": "dcs", "config": DCSConfig, "stage": "supernet" |
"materialized", "tau": float, "blocks": [{"mlp_keep": [...], "qk_keep": [[...] per head]}]}``;
``apply`` rebuilds either stage from it (the materialized shapes come from ``blocks``).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from timm.layers import Attention
from timm.layers.attention import maybe_add_mask, resolve_self_attn_mask
from timm.models.vision_transformer import Block, VisionTransformer
from torch import nn

from ..errors import NascompressError
from . import register_method

QK_MODES = ("input", "static", "none")


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
class DCSConfig:
    """How the supernet is built.

    Args:
        qk_mask: ``input`` (the paper's theta = Linear(x)), ``static`` (one theta per channel,
            can be materialized) or ``none``.
        mlp_gates: search the MLP channel gates alpha.
        alpha_init: initial alpha (positive: gates start open, the dense model is the start).
        theta_init: initial theta (bias of the theta Linear, or the static theta).
    """

    qk_mask: str = "input"
    mlp_gates: bool = True
    alpha_init: float = 3.0
    theta_init: float = 3.0

    def __post_init__(self) -> None:
        if self.qk_mask not in QK_MODES:
            raise NascompressError(f"qk_mask must be one of {QK_MODES}, got {self.qk_mask!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DCSConfig":
        unknown = sorted(set(d) - set(cls.__dataclass_fields__))
        if unknown:
            raise NascompressError(f"unknown DCS settings {unknown}; known: {sorted(cls.__dataclass_fields__)}")
        return cls(**d)


@dataclass
class DCSState:
    """Shared by every patched module of one model (the search sets ``tau``).

    ``soft_gates[i]`` is block i's soft gate of the last forward (for the cost), ``tokens`` the
    sequence length seen by the attention (for the analytic FLOPs).
    """

    tau: float = 1.0
    force_dense: bool = False
    soft_gates: dict[int, torch.Tensor] = field(default_factory=dict)
    tokens: int = 0

    def __deepcopy__(self, memo: dict) -> "DCSState":  # the soft gates are graph tensors: not copied
        return DCSState(tau=self.tau, force_dense=self.force_dense, tokens=self.tokens)


# ---------------------------------------------------------------------------------------------
# Patched timm modules



def attend_and_project(attn: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                       attn_mask: torch.Tensor | None, is_causal: bool, gate: torch.Tensor | None) -> torch.Tensor:
    """The second half of timm 1.0.31's ``Attention.forward``, for attention subclasses that build q/k/v
    themselves: softmax(q k^T * attn.scale) v, then norm, gate, proj.

    q, k: (B, H, N, d_qk); v: (B, H, N, head_dim) -> (B, N, C). The scale is always the module's
    original ``head_dim ** -0.5`` (passed to SDPA explicitly: without ``scale=`` it would use d_qk).
    """
    B, _, N, _ = v.shape
    if attn.fused_attn:
        x = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=attn.scale,
                                           dropout_p=attn.attn_drop.p if attn.training else 0.0)
    else:
        scores = (q * attn.scale) @ k.transpose(-2, -1)
        scores = maybe_add_mask(scores, resolve_self_attn_mask(N, scores, attn_mask, is_causal))
        x = attn.attn_drop(scores.softmax(dim=-1)) @ v
    x = attn.norm(x.transpose(1, 2).reshape(B, N, attn.attn_dim))
    if gate is not None:
        x = x * gate
    return attn.proj_drop(attn.proj(x))


class DCSAttention(Attention):
    """timm ``Attention`` (forward copied from timm 1.0.31) with a DCS Q/K channel mask.

    Modifications:
        - ``q, k = q * M, k * M`` after q_norm/k_norm, M (B, H, N, d) from theta = dcs_theta(x)
          (input) or (1, H, 1, d) from the parameter dcs_theta (static); V is not masked.
        - the mask is 1 everywhere when the model's state has ``force_dense``.
    """

    def qk_mask(self, x: torch.Tensor) -> torch.Tensor | None:
        st: DCSState = self._dcs_state
        st.tokens = x.shape[1]
        if self.dcs_qk == "none" or st.force_dense:
            return None
        B, N, _ = x.shape
        if self.dcs_qk == "input":
            theta = self.dcs_theta(x)  # (B, N, A)
            m, _ = gumbel_sigmoid(theta, tau=st.tau, noise=self.training)
            return m.reshape(B, N, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, N, d)
        m, _ = gumbel_sigmoid(self.dcs_theta, tau=st.tau, noise=self.training)
        return m.reshape(1, self.num_heads, 1, self.head_dim)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
        B, N, C = x.shape
        gate = self.gate(x).sigmoid() if self.gate is not None else None
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        m = self.qk_mask(x)
        if m is not None:
            q, k = q * m, k * m
        return attend_and_project(self, q, k, v, attn_mask=attn_mask, is_causal=is_causal, gate=gate)


class DCSBlock(Block):
    """timm ``Block`` with DCS MLP channel gates.

    Modifications:
        - ``x = x + drop_path2(ls2(mlp(norm2(x) * g) * g))``, g (C,) a Gumbel-sigmoid gate of the
          architecture parameters ``dcs_alpha``; its soft value is stored in the shared state.
    """

    def mlp_gate(self) -> torch.Tensor | None:
        st: DCSState = self._dcs_state
        if getattr(self, "dcs_alpha", None) is None or st.force_dense:
            return None
        g, soft = gumbel_sigmoid(self.dcs_alpha, tau=st.tau, noise=self.training)
        st.soft_gates[self._dcs_index] = soft
        return g

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x), attn_mask=attn_mask, is_causal=is_causal)))
        g = self.mlp_gate()
        y = self.mlp(self.norm2(x)) if g is None else self.mlp(self.norm2(x) * g) * g
        return x + self.drop_path2(self.ls2(y))


# ---------------------------------------------------------------------------------------------
# Building, reading and recording


def check_supported(model: nn.Module) -> None:
    if not isinstance(model, VisionTransformer):
        raise NascompressError(f"DCS needs a timm VisionTransformer, got {type(model).__name__}")
    for i, blk in enumerate(model.blocks):
        if not isinstance(blk, Block) or not isinstance(blk.attn, Attention):
            raise NascompressError(f"DCS supports timm Block/Attention; block {i} is "
                                   f"{type(blk).__name__}/{type(getattr(blk, 'attn', None)).__name__}")
        if not (hasattr(blk.mlp, "fc1") and hasattr(blk.mlp, "fc2")):
            raise NascompressError(f"DCS supports MLPs with fc1/fc2; block {i} has {type(blk.mlp).__name__}")


def attach_state(model: nn.Module, *, tau: float = 1.0) -> DCSState:
    """Give the model (and each of its blocks and attentions) one shared :class:`DCSState`."""
    st = DCSState(tau=tau)
    model.dcs_state = st
    for i, blk in enumerate(model.blocks):
        blk._dcs_state, blk._dcs_index = st, i
        blk.attn._dcs_state = st
    return st


def patch_attention_qk(attn: Attention, mode: str, *, theta_init: float) -> None:
    """Turn a timm Attention into a :class:`DCSAttention` with a fresh theta (``mode``)."""
    attn.__class__ = DCSAttention
    attn.dcs_qk = mode
    w = attn.qkv.weight
    if mode == "input":
        attn.dcs_theta = nn.Linear(attn.qkv.in_features, attn.attn_dim, device=w.device, dtype=w.dtype)
        nn.init.zeros_(attn.dcs_theta.weight)
        nn.init.constant_(attn.dcs_theta.bias, theta_init)
    elif mode == "static":
        attn.dcs_theta = nn.Parameter(torch.full((attn.attn_dim,), theta_init, device=w.device, dtype=w.dtype))
    else:
        attn.dcs_theta = None


def make_supernet(model: VisionTransformer, cfg: DCSConfig, *, tau: float = 1.0) -> VisionTransformer:
    """Patch ``model`` in place into the DCS supernet; dense weights keep their keys."""
    check_supported(model)
    for blk in model.blocks:
        blk.__class__ = DCSBlock
        if cfg.mlp_gates:
            w = blk.mlp.fc1.weight
            blk.dcs_alpha = nn.Parameter(torch.full((blk.mlp.fc1.in_features,), cfg.alpha_init,
                                                    device=w.device, dtype=w.dtype))
        else:
            blk.dcs_alpha = None
        patch_attention_qk(blk.attn, cfg.qk_mask, theta_init=cfg.theta_init)
    attach_state(model, tau=tau)
    return model


def arch_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The architecture parameters: every alpha, and the static theta (updated on the 30% split)."""
    ps = []
    for blk in model.blocks:
        if getattr(blk, "dcs_alpha", None) is not None:
            ps.append(blk.dcs_alpha)
        if getattr(blk.attn, "dcs_qk", None) == "static" and isinstance(blk.attn.dcs_theta, nn.Parameter):
            ps.append(blk.attn.dcs_theta)
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
        attn = blk.attn
        if getattr(attn, "dcs_qk", None) == "static":
            th = attn.dcs_theta.reshape(attn.num_heads, attn.head_dim)
            rec["qk_keep"] = [torch.nonzero(t > 0).flatten().tolist() for t in th]
        out.append(rec)
    return out


def make_record(model: nn.Module, cfg: DCSConfig, *, stage: str) -> dict[str, Any]:
    """The ``arch.json`` method record of a supernet (stage ``supernet`` or ``materialized``)."""
    return {"name": "dcs", "config": cfg.to_dict(), "stage": stage, "tau": float(model.dcs_state.tau),
            "blocks": selection(model)}


@register_method("dcs")
def apply(model: nn.Module, record: dict[str, Any]) -> nn.Module:
    """Rebuild the DCS supernet or the materialized model that ``record`` describes."""
    cfg = DCSConfig.from_dict(dict(record.get("config", {})))
    stage = record.get("stage", "supernet")
    tau = float(record.get("tau", 1.0))
    if stage == "supernet":
        return make_supernet(model, cfg, tau=tau)
    if stage == "materialized":
        from ..materialize import build_materialized

        return build_materialized(model, cfg, record.get("blocks") or [], tau=tau)
    raise NascompressError(f"unknown DCS stage {stage!r} in arch.json (expected supernet or materialized)")


__all__ = ["DCSConfig", "DCSState", "DCSAttention", "DCSBlock", "gumbel_sigmoid", "gumbel_noise", "binary_entropy",
           "make_supernet", "arch_parameters", "selection", "make_record", "attach_state", "apply"]
