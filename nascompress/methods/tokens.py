"""Shared pieces of the token-pruning methods (EViT, DynamicViT): layer choice, validation,
gathering, and reading the CLS attention row beside a fused attention kernel.

Layers are numbered from 1 here, as in the papers and on the command line.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch
from timm.models.vision_transformer import Block, VisionTransformer
from torch import nn

from ..errors import NascompressError

# The papers prune DeiT-S (12 layers) at layers 4, 7 and 10.
REF_LAYERS = (4, 7, 10)
REF_DEPTH = 12


def scale_layers(depth: int, ref: Sequence[int] = REF_LAYERS, ref_depth: int = REF_DEPTH) -> list[int]:
    """The reference layers (1-based, of ``ref_depth``) scaled to ``depth``, deduplicated.

    ``scale_layers(12) == [4, 7, 10]``, ``scale_layers(6) == [2, 4, 5]``, ``scale_layers(2) == [1, 2]``.
    """
    out: list[int] = []
    for layer in ref:
        v = min(depth, max(1, round(layer * depth / ref_depth)))
        if v not in out:
            out.append(v)
    return out


def check_vit(model: nn.Module, method: str) -> VisionTransformer:
    """Raise a clear error unless ``model`` is a timm ViT with one CLS token and plain blocks."""
    if not isinstance(model, VisionTransformer):
        raise NascompressError(
            f"{method} needs a timm VisionTransformer (vit_*, deit_*), got {type(model).__name__}")
    if getattr(model, "cls_token", None) is None or model.num_prefix_tokens != 1:
        raise NascompressError(
            f"{method} needs a ViT with exactly one CLS token and no register tokens "
            f"(got num_prefix_tokens={model.num_prefix_tokens}, class_token={model.cls_token is not None})")
    for i, blk in enumerate(model.blocks):
        if not isinstance(blk, Block):
            raise NascompressError(f"{method} patches timm Block modules; blocks.{i} is a {type(blk).__name__}")
    return model


def check_rate(value: Any, name: str) -> float:
    """A keep rate in (0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < float(value) <= 1:
        raise NascompressError(f"{name} must be in (0, 1], got {value!r}")
    return float(value)


def check_layers(layers: Any, depth: int, name: str = "prune_layers") -> list[int]:
    """1-based, strictly increasing layer numbers within [1, depth]."""
    if isinstance(layers, int) and not isinstance(layers, bool):
        layers = [layers]
    if not isinstance(layers, (list, tuple)) or not layers or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in layers):
        raise NascompressError(f"{name} must be a non-empty list of layer numbers in [1, {depth}], got {layers!r}")
    bad = [v for v in layers if not 1 <= v <= depth]
    if bad:
        raise NascompressError(f"{name} {bad} outside the model's depth: valid layers are 1..{depth}")
    if list(layers) != sorted(set(layers)):
        raise NascompressError(f"{name} must be strictly increasing without repeats, got {list(layers)}")
    return list(layers)


def check_keys(config: dict[str, Any], valid: Sequence[str], method: str) -> None:
    unknown = sorted(set(config) - set(valid))
    if unknown:
        raise NascompressError(f"unknown {method} option(s) {unknown}; valid options: {', '.join(valid)}")


def gather_tokens(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Pick tokens per image: x (B, N, C), idx (B, K) int64 -> (B, K, C).

    One ``index_select`` on the flattened (B*N, C) tokens (about 2x faster on CPU than
    ``torch.gather`` with an expanded index); no Python loop over images.
    """
    B, N, C = x.shape
    flat = idx + torch.arange(B, device=idx.device).unsqueeze(1) * N
    return x.reshape(B * N, C).index_select(0, flat.reshape(-1)).view(B, idx.shape[1], C)


def keep_cls_and(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """[CLS, the non-CLS tokens idx] in one gather: x (B, N, C), idx (B, K) into x[:, 1:] -> (B, 1 + K, C)."""
    full = torch.cat([idx.new_zeros(idx.shape[0], 1), idx + 1], dim=1)
    return gather_tokens(x, full)


def cls_attention(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """Head-averaged attention of the CLS query to every token, O(N*d) per head.

    Args:
        q, k: (B, H, N, d) queries and keys after q_norm/k_norm (before scaling).
        scale: the attention's softmax scale (head_dim ** -0.5).
    Returns:
        (B, N) = mean over heads of softmax(q_cls . K^T * scale); entry 0 is CLS -> CLS.
    """
    logits = (q[:, :, :1] * scale) @ k.transpose(-2, -1)  # (B, H, 1, N)
    return logits.softmax(dim=-1).mean(dim=1).squeeze(1)


class ClsScore(nn.Module):
    """The CLS attention row as a module, so the FLOPs counter sees its cost (no parameters)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
        return cls_attention(q, k, scale)

    def matmul_macs(self, inputs: tuple, output: torch.Tensor) -> float:
        q, k = inputs[0], inputs[1]
        B, H, N, d = k.shape
        return float(B * H * N * d)


class QKCapture:
    """Mixin for a patched Block: keeps the q/k its own ``attn`` computed, via forward hooks, so
    the attention itself (fused SDPA, DCS or Sparsifiner variants) runs unchanged.

    Sources, in order: the outputs of ``attn.q_norm`` / ``attn.k_norm`` (timm Attention and
    subclasses that call them; for the DCS supernet these are the q/k BEFORE its channel mask);
    else the ``attn.qkv`` output split by ``attn.split_qk(qkv_out)`` if the attention defines it,
    or by the DCS-materialized layout (``qk_total`` + ``_heads``), whose q/k are the kept channels.
    """

    def _install_qk_capture(self) -> None:
        self._qk = {}
        attn = self.attn
        if not hasattr(attn, "scale") or not (hasattr(attn, "q_norm") or hasattr(attn, "qkv")):
            raise NascompressError(f"cannot read attention scores from {type(attn).__name__}: no q_norm/qkv/scale")
        if not getattr(attn, "_nc_qk_hooked", False):
            for name in ("q_norm", "k_norm", "qkv"):
                if hasattr(attn, name):
                    getattr(attn, name).register_forward_hook(getattr(self, f"_store_{name}"))
            attn._nc_qk_hooked = True

    def _store_q_norm(self, mod: nn.Module, inp: tuple, out: torch.Tensor) -> None:
        self._qk["q"] = out

    def _store_k_norm(self, mod: nn.Module, inp: tuple, out: torch.Tensor) -> None:
        self._qk["k"] = out

    def _store_qkv(self, mod: nn.Module, inp: tuple, out: torch.Tensor) -> None:
        self._qk["qkv"] = out

    def _pop_qk(self) -> tuple[torch.Tensor, torch.Tensor]:
        qk, self._qk = self._qk, {}
        if "q" in qk and "k" in qk:
            return qk["q"], qk["k"]
        attn = self.attn
        if "qkv" in qk and hasattr(attn, "split_qk"):
            return attn.split_qk(qk["qkv"])
        if "qkv" in qk and hasattr(attn, "qk_total") and hasattr(attn, "_heads"):
            q, k, _ = qk["qkv"].split([attn.qk_total, attn.qk_total, attn.attn_dim], dim=-1)
            return attn._heads(q), attn._heads(k)
        raise RuntimeError(f"{type(attn).__name__} did not expose q/k; cannot read the CLS attention row")


_PATCHED: dict[tuple[type, type], type] = {}


def patched_class(cls: type, mixin: type, prefix: str) -> type:
    """``class <prefix><cls>(mixin, cls)``, cached, so a method stacks on another method's Block
    subclass (DCS, materialized DCS) and ``super()`` in the mixin reaches that class."""
    key = (cls, mixin)
    if key not in _PATCHED:
        _PATCHED[key] = type(f"{prefix}{cls.__name__}", (mixin, cls), {"__module__": mixin.__module__})
    return _PATCHED[key]


def mlp_residual(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The second half of a (possibly patched) block: ``x + drop_path2(ls2(mlp(norm2(x))))``.

    A block class may define ``mlp_residual(x)`` itself. The two DCS block classes of this
    project are read by their attributes (kept in sync by tests/test_evit.py's stacking test):
    the supernet's ``mlp_gate()`` and the materialized ``mlp_keep`` channel index.
    """
    own = getattr(block, "mlp_residual", None)
    if own is not None:
        return own(x)
    if hasattr(block, "mlp_keep"):  # nascompress.materialize.MaterializedBlock
        keep = block.mlp_keep
        if keep.numel() == 0:
            return x
        return x.index_add(-1, keep, block.drop_path2(block.ls2(block.mlp(block.norm2(x).index_select(-1, keep)))))
    gate_fn = getattr(block, "mlp_gate", None)  # nascompress.methods.dcs.DCSBlock
    g = gate_fn() if gate_fn is not None else None
    y = block.mlp(block.norm2(x)) if g is None else block.mlp(block.norm2(x) * g) * g
    return x + block.drop_path2(block.ls2(y))


def ceil_keep(rate: float, n: int) -> int:
    """ceil(rate * n) with a guard against float error (0.7 * 140 = 98.00000000000001)."""
    return max(1, math.ceil(rate * n - 1e-6))
