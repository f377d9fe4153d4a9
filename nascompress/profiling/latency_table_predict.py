"""A whole ViT's latency predicted from a :class:`~.latency_table.LatencyTable`.

``fixed_ms`` plus, per block present, ``block_overhead_ms``, the attention half at (tokens, kept
heads, Q/K width per head) and the MLP half at (tokens, hidden width), each interpolated
multilinearly in the table's grid (linear extrapolation past its edges). :func:`predict_arch` is the
differentiable form (piecewise linear: the gradient is the local slope) that a search uses as its
cost; :func:`predict_latency` reads a (pruned, materialized) model's module shapes.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from ..errors import NascompressError
from .latency_table import LatencyTable, ViTGeometry

ArchValue = float | int | torch.Tensor
# the methods whose models a table prices (widths, heads, blocks, and the tokens each block sees); the
# others (sparse attention, multi-granularity) change what a block computes, so they are measured
PRICED_METHODS = frozenset({"dcs", "uniform", "evit", "dynamicvit", "tome"})


def _segment(grid: Sequence[int], x: torch.Tensor) -> tuple[int, torch.Tensor]:
    """The segment [grid[i], grid[i+1]] that ``x`` falls into (the edge one outside the grid) and
    ``x``'s position in it (0..1 inside, beyond outside: linear extrapolation)."""
    if len(grid) == 1:
        return 0, torch.zeros_like(x)
    v = float(x.detach())
    i = 0
    while i < len(grid) - 2 and v > grid[i + 1]:
        i += 1
    return i, (x - grid[i]) / (grid[i + 1] - grid[i])


def interpolate(grids: Sequence[Sequence[int]], values: torch.Tensor, point: Sequence[torch.Tensor]) -> torch.Tensor:
    """Multilinear interpolation of ``values`` (one axis per grid) at ``point`` (0-d tensors)."""
    segs = [_segment(g, x) for g, x in zip(grids, point)]
    out = values.new_zeros(())
    for corner in range(1 << len(grids)):
        w, idx = values.new_ones(()), []
        for a, (i, t) in enumerate(segs):
            hi = (corner >> a) & 1
            if len(grids[a]) == 1:
                if hi:
                    break
                idx.append(0)
                continue
            w = w * (t if hi else 1 - t)
            idx.append(i + hi)
        else:
            out = out + w * values[tuple(idx)]
    return out


def _as_tensor(v: ArchValue, what: str, device: torch.device) -> torch.Tensor:
    """``v`` as a 0-d float64 tensor on ``device`` (differentiable where ``v`` is a tensor)."""
    t = v if isinstance(v, torch.Tensor) else torch.tensor(float(v), dtype=torch.float64)
    if t.numel() != 1:
        raise NascompressError(f"an arch entry's {what} must be a scalar, got shape {tuple(t.shape)}")
    return t.reshape(()).to(device, torch.float64)


def predict_arch(
    table: LatencyTable, arch: Sequence[dict[str, ArchValue]], tokens: ArchValue | Sequence[ArchValue] | None = None
) -> torch.Tensor:
    """Predicted latency (ms, a 0-d tensor) of a ViT of the table's geometry described per block.

    Args:
        table: the device's table.
        arch: one dict per block: ``present`` (0..1; 0: removed), ``heads`` (kept heads, 0: the
            attention gone), ``qk`` (Q/K channels per head), ``hidden`` (MLP hidden width, 0: a constant
            MLP); floats or 0-d tensors (expected values under a search's gates: the gradient flows
            through the interpolation). A missing key means its full width (present: 1).
        tokens: the token count at every block (one value), or one per block (a value, or a pair:
            the tokens its attention and its MLP see, which differ in a block that drops tokens
            between them, as EViT's do); None: the geometry's N.
    """
    g = table.geometry
    if isinstance(tokens, Sequence) and not isinstance(tokens, torch.Tensor):
        if len(tokens) != len(arch):
            raise NascompressError(f"tokens has {len(tokens)} entries but the arch has {len(arch)} blocks")
        per_block = list(tokens)
    else:
        per_block = [g.tokens if tokens is None else tokens] * len(arch)
    given = [v for blk in arch for v in blk.values() if isinstance(v, torch.Tensor)]
    dev = given[0].device if given else torch.device("cpu")
    attn = torch.tensor(table.attn_ms, dtype=torch.float64, device=dev)
    mlp = torch.tensor(table.mlp_ms, dtype=torch.float64, device=dev)
    total = torch.tensor(table.fixed_ms, dtype=torch.float64, device=dev)
    for b, (blk, n) in enumerate(zip(arch, per_block)):
        unknown = set(blk) - {"present", "heads", "qk", "hidden"}
        if unknown:
            raise NascompressError(f"arch block {b} has unknown keys {sorted(unknown)} (present, heads, qk, hidden)")
        n_attn, n_mlp = n if isinstance(n, (tuple, list)) else (n, n)
        n_t, n_m = _as_tensor(n_attn, "tokens", dev), _as_tensor(n_mlp, "tokens", dev)
        present = _as_tensor(blk.get("present", 1.0), "present", dev)
        heads = _as_tensor(blk.get("heads", g.num_heads), "heads", dev)
        qk = _as_tensor(blk.get("qk", g.head_dim), "qk", dev)
        hidden = _as_tensor(blk.get("hidden", g.mlp_hidden), "hidden", dev)
        a = interpolate((table.tokens, table.heads, table.qk), attn, (n_t, heads, qk)).clamp(min=0)
        m = interpolate((table.tokens, table.hidden), mlp, (n_m, hidden)).clamp(min=0)
        total = total + present * (table.block_overhead_ms + a + m)
    return total


def block_arch(block: nn.Module) -> dict[str, float]:
    """One block's entry of :func:`predict_arch` read from its modules: kept heads ``attn.num_heads``
    (0 where the attention is gone: no qkv), Q/K width ``attn.qk_dim`` (else the head dim), hidden
    ``mlp.fc1.out_features`` (0 where the MLP is a constant or gone)."""
    attn, mlp = getattr(block, "attn", None), getattr(block, "mlp", None)
    if hasattr(attn, "qkv") and getattr(attn, "num_heads", 0):
        heads, qk = int(attn.num_heads), int(getattr(attn, "qk_dim", None) or attn.head_dim)
    else:
        heads, qk = 0, 0
    hidden = int(mlp.fc1.out_features) if hasattr(mlp, "fc1") else 0
    return {"present": 1.0, "heads": heads, "qk": qk, "hidden": hidden}


def model_arch(model: nn.Module, geometry: ViTGeometry) -> list[dict[str, float]]:
    """The per-block entries of :func:`predict_arch` for ``model`` (its present blocks), checked
    against the table's geometry (the embedding width and head dim must be the table's)."""
    blocks = present_blocks(model)
    if not hasattr(model, "blocks"):
        raise NascompressError(f"latency prediction is for timm VisionTransformers, got {type(model).__name__}")
    if getattr(model, "embed_dim", None) != geometry.embed_dim:
        raise NascompressError(
            f"the model's embedding width {getattr(model, 'embed_dim', None)} is not the table's "
            f"{geometry.embed_dim}: build a table for this model (nascompress latency-table)"
        )
    arch = [block_arch(b) for b in blocks]
    for i, b in enumerate(blocks):
        hd = getattr(getattr(b, "attn", None), "head_dim", geometry.head_dim)
        if arch[i]["heads"] and hd != geometry.head_dim:
            raise NascompressError(f"block {i}'s head dim {hd} is not the table's {geometry.head_dim}")
    return arch


def present_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks of ``model`` that run (a removed block may stand as an ``nn.Identity``)."""
    return [b for b in getattr(model, "blocks", []) if not isinstance(b, nn.Identity)]


@torch.no_grad()
def block_tokens(model: nn.Module, x: torch.Tensor) -> list[tuple[int, int]]:
    """The tokens each present block's attention and MLP see on a forward of ``x`` (token methods
    drop or merge tokens: EViT between a block's attention and its MLP); a half that did not run
    reads as 0 tokens."""
    blocks = present_blocks(model)
    seen: list[list[int]] = [[0, 0] for _ in blocks]
    handles = []
    for i, b in enumerate(blocks):
        for half, name in enumerate(("attn", "mlp")):
            mod = getattr(b, name, None)
            if isinstance(mod, nn.Module):

                def pre(_m: nn.Module, args: tuple, i: int = i, half: int = half) -> None:
                    if args and isinstance(args[0], torch.Tensor) and args[0].dim() == 3:
                        seen[i][half] = int(args[0].shape[1])

                handles.append(mod.register_forward_pre_hook(pre))
    was = model.training
    try:
        model.eval()(x)
    finally:
        model.train(was)
        for h in handles:
            h.remove()
    return [(a, m) for a, m in seen]


def predict_latency(
    table: LatencyTable, model: nn.Module, *, tokens: Any = None, x: torch.Tensor | None = None
) -> float:
    """Predicted latency (ms) of ``model`` from its module shapes (see :func:`predict_arch`); with
    ``x`` (one input, no ``tokens``), the tokens per block are those a forward of ``x`` shows
    (:func:`block_tokens`: what a token method keeps)."""
    if tokens is None and x is not None:
        tokens = block_tokens(model, x)
    with torch.no_grad():
        return float(predict_arch(table, model_arch(model, table.geometry), tokens=tokens))


__all__ = [
    "PRICED_METHODS",
    "predict_arch",
    "predict_latency",
    "model_arch",
    "block_arch",
    "block_tokens",
    "present_blocks",
    "interpolate",
]
