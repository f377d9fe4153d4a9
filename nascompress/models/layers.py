"""The one attention and the one block every method plugs into (the gather helpers that slice their
layers: :mod:`nascompress.models.slicing`).

:class:`NCAttention` is timm 1.0.31's ``Attention`` with hook points (a Q/K channel layout, a Q/K
mask, an attention kernel, and recorders of the CLS attention row and the values), so no method
copies the attention forward. :class:`NCBlock` is timm's ``Block`` with its two residual halves
as methods: a method overrides one half (DCS's MLP channels) or calls them with its own work
between them (token pruning), and the other method's half stays in force. :func:`to_core` turns a
plain timm ViT's blocks into these classes in place (state-dict keys unchanged); every method's
``apply`` starts with it.
"""

from __future__ import annotations

from .. import _compat  # noqa: F401  (before timm imports torchvision)


import torch
import torch.nn.functional as F
from timm.layers import Attention
from timm.layers.attention import maybe_add_mask, resolve_self_attn_mask
from timm.models.vision_transformer import Block, VisionTransformer
from torch import nn

from ..errors import NascompressError

_HOOKS = {
    "qk_dim": None,
    "qk_counts": None,
    "qk_layout": "auto",
    "qk_mask": None,
    "head_mask": None,
    "kernel": None,
    "record_cls": False,
    "record_values": False,
    "values": None,
    "_cls_inputs": None,
    "record_keys": False,
    "keys": None,
}

# ---------------------------------------------------------------------------------------------
# The Q/K layout of a head whose Q/K keep fewer channels than V (DCS, uniform pruning)
#
# torch's SDPA backends and the head dims they accept (aten/.../transformers, torch 2.11-2.13):
#   CPU fused (flash):   q, k and v of one head dim; otherwise the math path (QK^T materialized).
#   CUDA flash:          fp16/bf16, q, k and v of one head dim <= 256, no attn_mask.
#   CUDA cuDNN:          fp16/bf16, d_qk and d_v each a multiple of 8 and <= 128 (256 on sm90 with
#                        a recent cuDNN); d_qk != d_v accepted. First in torch's order on H100.
#   CUDA mem-efficient:  fp32/fp16/bf16, d_qk == d_k, d_qk and d_v each a multiple of 4 (fp32) or
#                        8 (fp16/bf16) on sm80+; d_qk != d_v accepted; attn_mask accepted.
# So a narrowed Q/K keeps a fused CUDA kernel (cuDNN / mem-efficient) when its width is a multiple
# of 8, and loses only flash; on the CPU it loses the fused kernel altogether.
QK_LAYOUTS = ("auto", "packed", "pad")
# "packed": SDPA gets q/k at their narrowed width qk_dim (the QK^T work shrinks);
# "pad": q/k are zero-padded after the projection to V's head dim (the projection still computes
#        only the kept channels; QK^T runs at the full head dim, the padding counted as computed),
#        so every backend that needs one head dim (CPU fused, CUDA flash) stays available;
# "auto": pad on the CPU (measured: bench/qk_layout.py, bench/results/qk_layout_cpu.json, the fused
#        kernel on padded q/k beats the math path on narrowed q/k at every size measured), and on CUDA
#        packed where the width suits cuDNN / mem-efficient (a multiple of 8; 4 in fp32), else pad.
CPU_PAD_QK = True


def qk_pads(layout: str, *, qk_dim: int, head_dim: int, device_type: str, dtype: torch.dtype) -> bool:
    """Whether a head with Q/K width ``qk_dim`` (V: ``head_dim``) runs zero-padded to ``head_dim``
    under ``layout`` on ``device_type`` in ``dtype`` (the rule of the comment above)."""
    if qk_dim >= head_dim or layout == "packed":
        return False
    if layout == "pad":
        return True
    if device_type == "cuda":
        need = 4 if dtype == torch.float32 else 8
        return qk_dim % need != 0
    return CPU_PAD_QK


def compute_dtype(x: torch.Tensor, weight_dtype: torch.dtype) -> torch.dtype:
    """The dtype a Linear on ``x`` computes in: the autocast dtype where autocast is on, else the weights'."""
    dev = x.device.type
    if dev in ("cpu", "cuda") and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return weight_dtype


def set_qk_layout(model: nn.Module, layout: str) -> None:
    """Set the Q/K layout (``auto``, ``packed`` or ``pad``) of every :class:`NCAttention` of ``model``."""
    if layout not in QK_LAYOUTS:
        raise NascompressError(f"qk_layout must be one of {', '.join(QK_LAYOUTS)}, got {layout!r}")
    for m in model.modules():
        if isinstance(m, NCAttention):
            m.qk_layout = layout


def qk_layout_summary(model: nn.Module, x: torch.Tensor) -> dict[str, int] | None:
    """How many narrowed attentions of ``model`` run padded / packed for input ``x`` (None: none is narrowed)."""
    counts = {"pad": 0, "packed": 0}
    for m in model.modules():
        if isinstance(m, NCAttention) and m.qk_dim is not None and m.qk_dim < m.head_dim:
            counts["pad" if m.pads_qk(x) else "packed"] += 1
    return counts if any(counts.values()) else None


def cls_row(q: torch.Tensor, k: torch.Tensor, scale: float, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The first query's attention row, O(N d) per head: q, k (B, H, N, d) -> (B, H, N).

    ``attn_mask`` (bool, True = attend, or additive; broadcastable to (B, H, N, N)) is applied to
    that row, so this is the row the attention really computes."""
    logits = (q[:, :, :1] * scale) @ k.transpose(-2, -1)  # (B, H, 1, N)
    if attn_mask is not None:
        row = attn_mask[..., :1, :]
        logits = logits.masked_fill(~row, float("-inf")) if row.dtype == torch.bool else logits + row
    return logits.softmax(dim=-1).squeeze(2)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float,
    dropout_p: float = 0.0,
    is_causal: bool = False,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention``, except where only the mask needs a gradient.

    CUDA's memory-efficient kernel keeps the log-sum-exp its backward needs only when q, k or v
    require grad; with a differentiable additive mask and frozen q/k/v (DynamicViT's policy in its
    predictor-only stage, backbone frozen) its backward stops with "LSE is not correctly aligned
    (strideH)". That case runs the math path here (the same attention, written out). q, k (B, H, N,
    d_qk), v (B, H, N, d_v), mask bool (True = attend) or additive, broadcastable to (B, H, N, N).
    """
    bias_only = (
        attn_mask is not None
        and attn_mask.requires_grad
        and torch.is_grad_enabled()
        and not (q.requires_grad or k.requires_grad or v.requires_grad)
    )
    if not bias_only:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale
        )
    scores = (q * scale) @ k.transpose(-2, -1)
    scores = maybe_add_mask(scores, resolve_self_attn_mask(q.shape[-2], scores, attn_mask, is_causal))
    return F.dropout(scores.softmax(dim=-1), p=dropout_p) @ v


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
        - ``qk_layout``: how a narrowed Q/K (``qk_dim < head_dim``) reaches the kernel: ``packed``
          at ``qk_dim``, or ``pad`` (zero-padded after the projection to ``head_dim``, so that the
          fused kernels that need one head dim run); ``auto`` chooses by device and dtype
          (:func:`qk_pads`). The result is the same either way (the padding is zeros).
        - ``qk_mask``: a module ``(x) -> mask | None`` multiplied into q and k after q_norm/k_norm,
          broadcastable to (B, H, N, d_qk) (DCS supernet). V is never masked.
        - ``head_mask``: a module ``() -> mask | None``, (H,), multiplied into each head's output
          (B, H, N, d_v) before the heads are merged and projected (DCS head gates).
        - ``kernel``: a module ``(q, k, v, *, attn_mask, scale, dropout_p) -> (B, H, N, d_v)`` that
          computes the attention instead of SDPA (Sparsifiner); it reports its MACs with ``last_macs()``.
        - ``record_cls``: keep the first query and the keys, so that :meth:`cls_attention` returns the
          class-token attention row as computed (masks included), for EViT and MG-ViT; O(N d) and
          only when asked for, so the fused kernel is kept and an unused row costs nothing.
        - ``record_values``: keep ``values`` (B, H, N, d_v) (MG-ViT's PPSM).
        - ``record_keys``: keep ``keys`` (B, H, N, d_qk) as computed (norm and masks applied), ToMe's
          matching metric.
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
        return (
            q.reshape(B, N, H, self.qk_dim).transpose(1, 2),
            k.reshape(B, N, H, self.qk_dim).transpose(1, 2),
            v.reshape(B, N, H, self.head_dim).transpose(1, 2),
        )

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
        B, N, _ = x.shape
        gate = self.gate(x).sigmoid() if self.gate is not None else None
        q, k, v = self.split_qkv(self.qkv(x))
        q, k = self.q_norm(q), self.k_norm(k)
        if self.qk_mask is not None:
            m = self.qk_mask(x)
            if m is not None:  # in q's precision (bf16 under autocast: an fp32 mask would promote q and k)
                m = m.to(q.dtype)
                q, k = q * m, k * m
        if self.record_cls:
            self._cls_inputs = (q[:, :, :1], k, None if attn_mask is None else attn_mask[..., :1, :])
        if self.record_values:
            self.values = v
        if self.record_keys:
            self.keys = k
        if self.qk_dim is not None and self.kernel is None and self.fused_attn and self.pads_qk(x):
            pad = (0, self.head_dim - self.qk_dim)
            q, k = F.pad(q, pad), F.pad(k, pad)
        drop = self.attn_drop.p if self.training else 0.0
        if self.kernel is not None:
            if is_causal:
                raise NotImplementedError(f"{type(self.kernel).__name__} is for bidirectional ViTs (no is_causal)")
            o = self.kernel(q, k, v, attn_mask=attn_mask, scale=self.scale, dropout_p=drop)
        elif self.fused_attn:
            o = attention(q, k, v, attn_mask=attn_mask, dropout_p=drop, is_causal=is_causal, scale=self.scale)
        else:
            scores = (q * self.scale) @ k.transpose(-2, -1)
            scores = maybe_add_mask(scores, resolve_self_attn_mask(N, scores, attn_mask, is_causal))
            o = self.attn_drop(scores.softmax(dim=-1)) @ v
        if self.head_mask is not None:
            hm = self.head_mask()
            if hm is not None:  # in o's precision (bf16 under autocast)
                o = o * hm.to(o.dtype).reshape(1, -1, 1, 1)
        o = self.norm(o.transpose(1, 2).reshape(B, N, self.attn_dim))
        if gate is not None:
            o = o * gate
        return self.proj_drop(self.proj(o))

    def pads_qk(self, x: torch.Tensor) -> bool:
        """Whether a forward on ``x`` zero-pads the narrowed q/k to ``head_dim`` (see ``qk_layout``)."""
        if self.qk_dim is None or self.kernel is not None or not self.fused_attn:
            return False
        return qk_pads(
            self.qk_layout,
            qk_dim=self.qk_dim,
            head_dim=self.head_dim,
            device_type=x.device.type,
            dtype=compute_dtype(x, self.qkv.weight.dtype),
        )

    def matmul_macs(self, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> float:
        """QK^T and AV (or what the kernel computed), whole batch; padded Q/K channels count as computed."""
        B, N, _ = inputs[0].shape
        d_qk = self.head_dim if self.pads_qk(inputs[0]) else (self.qk_dim or self.head_dim)
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

    def attn_half(
        self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False
    ) -> torch.Tensor:
        return x + self.drop_path1(self.ls1(self.attn(self.norm1(x), attn_mask=attn_mask, is_causal=is_causal)))

    def mlp_half(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))


def core_attention(attn: nn.Module, *, where: str = "attention") -> NCAttention:
    """Turn a timm ``Attention`` into an :class:`NCAttention` in place (no-op if it already is one)."""
    if isinstance(attn, NCAttention):
        return attn
    if type(attn) is not Attention:
        raise NascompressError(
            f"{where} is a {type(attn).__name__}; nascompress patches timm's Attention "
            "(vit_*/deit_* models with standard blocks)"
        )
    attn.__class__ = NCAttention
    for k, v in _HOOKS.items():
        setattr(attn, k, v)
    attn.cls_score = ClsScore()  # no parameters: the state dict is unchanged
    return attn


def require_vit(model: nn.Module, method: str) -> None:
    """Raise unless ``model`` is a timm VisionTransformer (what ``method`` patches)."""
    if not isinstance(model, VisionTransformer):
        raise NascompressError(f"{method} needs a timm VisionTransformer (vit_*, deit_*), got {type(model).__name__}")


def to_core(model: nn.Module, *, method: str) -> VisionTransformer:
    """Make every block of a timm ViT an :class:`NCBlock` with an :class:`NCAttention`, in place.

    Idempotent: blocks already patched by a method (subclasses of NCBlock) are kept as they are.
    """
    require_vit(model, method)
    for i, blk in enumerate(model.blocks):
        if not isinstance(blk, NCBlock):
            if type(blk) is not Block:
                raise NascompressError(
                    f"{method} patches timm's standard Block; blocks.{i} is a "
                    f"{type(blk).__name__} (parallel/post-norm blocks are not supported)"
                )
            blk.__class__ = NCBlock
        core_attention(blk.attn, where=f"blocks.{i}.attn")
    return model


def _ours(obj: object) -> bool:
    return type(obj).__module__.split(".")[0] == "nascompress"


def _plain_attention(m: nn.Module) -> bool:
    """Whether ``m`` is an :class:`NCAttention` (exactly) with every hook off: timm's forward."""
    if type(m) is not NCAttention or m.qk_dim is not None:
        return False
    off = ("qk_counts", "qk_mask", "head_mask", "kernel")
    return all(getattr(m, k, None) is None for k in off) and not (m.record_cls or m.record_values or m.record_keys)


def nascompress_modules(model: nn.Module) -> list[str]:
    """The modules of ``model`` that need nascompress at inference ('' names the model itself):
    every nascompress class except an :class:`NCBlock` and a hook-free :class:`NCAttention`, which
    :func:`to_plain` turns back into timm's ``Block`` and ``Attention``."""
    out = []
    for name, m in model.named_modules():
        if _ours(m) and type(m) not in (NCBlock, ClsScore) and not _plain_attention(m):
            out.append(name)
    return out


def to_plain(model: nn.Module) -> list[str]:
    """Give ``model`` back timm's own classes where nascompress's have nothing left to do, in place.

    When every nascompress module of ``model`` is an :class:`NCBlock` or a hook-free
    :class:`NCAttention` (per-block widths: DCS's hidden neurons and heads, uniform pruning
    without Q/K, blocks removed), they become timm's ``Block`` and ``Attention`` (their smaller
    Linears held as they are, the state dict unchanged) and the nascompress state a method left
    on a module (``dcs_state``) is removed: the model pickles and runs where nascompress cannot be
    imported. Otherwise (a residual-channel gather, a Q/K narrower than V, a constant half, a token
    method) nothing is changed. Returns :func:`nascompress_modules` (``[]``: the model is plain).
    """
    needs = nascompress_modules(model)
    if needs:
        return needs
    for m in list(model.modules()):
        if type(m) is NCAttention:
            m.__class__ = Attention
            del m.cls_score
            for k in _HOOKS:
                m.__dict__.pop(k, None)
        elif type(m) is NCBlock:
            m.__class__ = Block
        for k, v in list(vars(m).items()):
            if _ours(v):  # e.g. DCS's shared state (its gates are gone)
                delattr(m, k)
    return []


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


__all__ = [
    "attention",
    "DEFAULT_ALIGN",
    "aligned_width",
    "QK_LAYOUTS",
    "qk_pads",
    "set_qk_layout",
    "qk_layout_summary",
    "compute_dtype",
    "NCAttention",
    "NCBlock",
    "ClsScore",
    "to_core",
    "to_plain",
    "nascompress_modules",
    "core_attention",
    "cls_row",
]
