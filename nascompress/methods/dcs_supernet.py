"""The DCS supernet's state and patched modules (:mod:`.dcs` builds them into a model, and re-exports
them): the shared :class:`DCSState`, the Q/K channel mask :class:`DCSQKMask`, the head gates
:class:`DCSHeadGate`, the gated block :class:`DCSBlock` (MLP gates, block gate), and what reads or
equips a supernet: the family check, the state and Q/K mask attachment, its architecture parameters
and its :func:`selection` (the channels, heads and blocks it keeps)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from timm.layers import Mlp
from torch import nn

from ..errors import NascompressError, SettingError
from ..models.layers import NCAttention, NCBlock
from .dcs_gates import aligned_mask, gumbel_sigmoid


@dataclass
class DCSState:
    """Shared by every patched module of one model (the search sets ``tau``).

    ``soft_gates[i]`` / ``soft_qk[i]`` / ``soft_heads[i]`` / ``soft_depth[i]`` are block i's soft
    MLP gate / static Q/K mask / head gates (H,) / block gate (1,) of the last forward (for the
    differentiable cost; a block a closed block gate skipped has none), ``tokens`` the sequence
    length the attention saw,
    ``family`` the MLP gate family and ``align`` the width alignment of the inference masks.
    """

    tau: float = 1.0
    force_dense: bool = False
    sample: bool = True  # training forwards draw Gumbel samples (False: the aligned mask, as at inference)
    soft_gates: dict[int, torch.Tensor] = field(default_factory=dict)
    soft_qk: dict[int, torch.Tensor] = field(default_factory=dict)
    soft_heads: dict[int, torch.Tensor] = field(default_factory=dict)
    soft_depth: dict[int, torch.Tensor] = field(default_factory=dict)
    depth_now: dict[int, torch.Tensor] = field(default_factory=dict)  # block gates of the forward under way
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


def gate_sample(
    logits: torch.Tensor, st: DCSState, training: bool, *, align: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask, soft) of gate logits: a Gumbel sample in training (where the state samples), else the
    aligned mask (inference, and a search's weight steps at the current architecture; ``align``:
    default the state's, 1 for the head and block gates, which gate whole units)."""
    if training and st.sample:
        return gumbel_sigmoid(logits, tau=st.tau, noise=True)
    m = aligned_mask(logits, align=st.align if align is None else align)
    return m, m


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
        m, soft = gate_sample(theta, st, self.training)
        st.soft_qk[self._dcs_index] = soft.reshape(-1)
        return m.reshape(1, self.heads, 1, self.head_dim)


class DCSHeadGate(nn.Module):
    """The head gates of one attention, plugged in as :attr:`NCAttention.head_mask`: one logit per
    head (``logits`` (H,)), a binary Gumbel-sigmoid gate (unaligned: a head is a whole unit) that
    multiplies that head's output before the heads are merged; all open under ``force_dense``."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.logits = nn.Parameter(logits)

    def forward(self) -> torch.Tensor | None:
        st: DCSState = self._dcs_state
        if st.force_dense:
            return None
        m, soft = gate_sample(self.logits, st, self.training, align=1)
        st.soft_heads[self._dcs_index] = soft
        return m


def _closed(g: torch.Tensor) -> bool:
    """A block gate that is hard 0 and needs no gradient: the block is skipped, not computed."""
    return not g.requires_grad and not bool(g.any())


class DCSBlock(NCBlock):
    """:class:`NCBlock` whose MLP half is gated by DCS channel gates of the state's family.

    Modifications: ``residual``: ``x + drop_path2(ls2(mlp(norm2(x) * g) * g))``, g (C,);
    ``hidden``: the MLP's hidden activations h (after fc1 and the activation) become
    ``h * g + (1 - g) * dcs_fill``, g (Hm,), ``dcs_fill`` 0 or the dense model's mean activation.
    g is a Gumbel-sigmoid gate of the architecture parameters ``dcs_alpha`` (aligned at
    inference); its soft value is stored in the shared state. With a block gate (``dcs_depth``
    (1,), one sample per forward, drawn in :meth:`attn_half`): ``x + b * attn_branch`` then
    ``+ b * mlp_branch``; a closed block (b = 0 without a gradient) is skipped, as removed.
    """

    def depth_gate(self) -> torch.Tensor | None:
        """This forward's block gate b (1,), or None without one."""
        st: DCSState = self._dcs_state
        logit = getattr(self, "dcs_depth", None)
        if logit is None or st.force_dense:
            return None
        g, soft = gate_sample(logit, st, self.training, align=1)
        st.soft_depth[self._dcs_index] = soft
        st.depth_now[self._dcs_index] = g
        return g

    def attn_half(
        self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False
    ) -> torch.Tensor:
        g = self.depth_gate()
        if g is None:
            return super().attn_half(x, attn_mask=attn_mask, is_causal=is_causal)
        if _closed(g):  # skipped: no soft value of this forward for the cost
            for d in (self._dcs_state.soft_gates, self._dcs_state.soft_qk, self._dcs_state.soft_heads):
                d.pop(self._dcs_index, None)
            return x
        y = self.drop_path1(self.ls1(self.attn(self.norm1(x), attn_mask=attn_mask, is_causal=is_causal)))
        return x + y * g.to(y.dtype)

    def mlp_half(self, x: torch.Tensor) -> torch.Tensor:
        st: DCSState = self._dcs_state
        if getattr(self, "dcs_depth", None) is None or st.force_dense:
            return x + self.mlp_branch(x)
        g = st.depth_now.pop(self._dcs_index, None)
        g = self.depth_gate() if g is None else g  # (called without attn_half)
        st.depth_now.pop(self._dcs_index, None)
        if _closed(g):
            return x
        y = self.mlp_branch(x)
        return x + y * g.to(y.dtype)

    def mlp_gate(self) -> torch.Tensor | None:
        st: DCSState = self._dcs_state
        if self.dcs_alpha is None or st.force_dense:
            return None
        g, soft = gate_sample(self.dcs_alpha, st, self.training)
        st.soft_gates[self._dcs_index] = soft
        return g

    def mlp_branch(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP half's residual branch (what ``mlp_half`` adds to x), gated by the MLP gates."""
        g = self.mlp_gate()
        if g is None:
            return self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
        if self._dcs_state.family == "hidden":
            m = self.mlp
            fill = getattr(self, "dcs_fill", None)
            if g.requires_grad or not self.training or not _compactable(m):
                h = m.drop1(m.act(m.fc1(self.norm2(x))))  # (B, N, Hm)
                g = g.to(h.dtype)  # h's precision (bf16 under autocast): an fp32 gate would promote h
                h = h * g if fill is None else h * g + (1 - g) * fill.to(h.dtype)
                return self.drop_path2(self.ls2(m.drop2(m.fc2(m.norm(h)))))
            # training under a hard 0/1 mask (the search's weight steps at the current architecture):
            # only the open neurons are computed, ``fc2(h * g + (1 - g) * fill)`` =
            # ``fc2[:, open](h[open]) + fc2((1 - g) * fill)``; the same function and gradients, fewer
            # MACs. (Inference keeps the masked form: the profiler counts the Linear modules it runs.)
            keep = g.nonzero().flatten()
            if keep.numel() == g.numel():  # every neuron open: the plain MLP (no gather, no scatter back)
                return self.drop_path2(self.ls2(m.drop2(m.fc2(m.act(m.fc1(self.norm2(x)))))))
            # index_select, whose backward is an index_add (advanced indexing's index_put is several times slower)
            w1, b1 = (
                m.fc1.weight.index_select(0, keep),
                None if m.fc1.bias is None else m.fc1.bias.index_select(0, keep),
            )
            h = m.act(F.linear(self.norm2(x), w1, b1))
            out = F.linear(h, m.fc2.weight.index_select(1, keep), m.fc2.bias)
            if fill is not None:
                out = out + F.linear((1 - g) * fill, m.fc2.weight)
            return self.drop_path2(self.ls2(m.drop2(out)))
        return self.drop_path2(self.ls2(self.mlp(self.norm2(x) * g) * g))


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


def check_align(align: Any) -> int:
    """``align`` is an integer width multiple (``auto`` is the search's to choose); returns it."""
    if isinstance(align, bool) or not isinstance(align, int) or align < 1:
        raise NascompressError(
            f"align {align!r} is not a width multiple: 'auto' is chosen by the search "
            "(nascompress.dcs_search.align); build a supernet with a positive integer align"
        )
    return align


def attach_state(model: nn.Module, *, tau: float = 1.0, family: str = "residual", align: int = 1) -> DCSState:
    """Give the model (and each of its blocks, Q/K masks and head gates) one shared :class:`DCSState`."""
    check_align(align)
    st = DCSState(tau=tau, family=family, align=align)
    model.dcs_state = st
    for i, blk in enumerate(model.blocks):
        blk._dcs_state, blk._dcs_index = st, i
        for hook in (getattr(blk.attn, "qk_mask", None), getattr(blk.attn, "head_mask", None)):
            if hook is not None:
                hook._dcs_state, hook._dcs_index = st, i
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


def arch_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The architecture parameters: every alpha, the static theta, the head and block gate logits
    (updated on the 30% split)."""
    ps = []
    for blk in model.blocks:
        if getattr(blk, "dcs_alpha", None) is not None:
            ps.append(blk.dcs_alpha)
        qm = blk.attn.qk_mask
        if qm is not None and qm.mode == "static":
            ps.append(qm.theta)
        hm = head_gates(blk)
        if hm is not None:
            ps.append(hm)
        if getattr(blk, "dcs_depth", None) is not None:
            ps.append(blk.dcs_depth)
    return ps


def head_gates(blk: nn.Module) -> nn.Parameter | None:
    """A supernet block's head gate logits (H,), or None."""
    hm = getattr(blk.attn, "head_mask", None)
    return hm.logits if isinstance(hm, DCSHeadGate) else None


def _kept(mask: torch.Tensor) -> list[int]:
    return torch.nonzero(mask > 0).flatten().tolist()


@torch.no_grad()
def selection(model: nn.Module) -> list[dict[str, Any]]:
    """The channels the eval-mode supernet keeps (its aligned masks), per block: ``mlp_keep``
    (residual family) or ``hidden_keep`` (hidden family) and, for the static Q/K mask, ``qk_keep``
    (per head; with head gates, per kept head). ``None`` means no selection. With head gates
    ``heads_keep`` (the open heads), with block gates ``skip`` (the block gate is closed); blocks
    without them have no such key (records as before)."""
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
        hg = head_gates(blk)
        heads = None if hg is None else _kept(hg)
        qm = blk.attn.qk_mask
        if qm is not None and qm.mode == "static":
            m = aligned_mask(qm.theta.reshape(qm.heads, qm.head_dim), align=st.align)
            rec["qk_keep"] = [_kept(row) for h, row in enumerate(m) if heads is None or h in heads]
        if hg is not None:
            rec["heads_keep"] = heads
        if getattr(blk, "dcs_depth", None) is not None:
            rec["skip"] = not bool((blk.dcs_depth > 0).any())
        out.append(rec)
    return out
