"""Measuring a :class:`~.latency_table.LatencyTable` on the device, with real modules at the needed widths.

Each entry times a chain of ``depth`` distinct halves (random weights; one per block of the model, so
the weights meet the caches as in the whole model), interleaved with the other entries of its token
count (:func:`~.latency.time_models`: warm-up, rotating order, medians), and divides by ``depth``. The
fixed part is a ``VisionTransformer`` with no blocks; the per-block overhead is the dense model less
the fixed part and its halves, per block (never below 0).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from timm.layers import Attention, Mlp
from timm.models.vision_transformer import Block, VisionTransformer
from torch import nn

from .. import runtime
from ..errors import NascompressError
from ..models.layers import NCBlock, core_attention
from ..progress import say
from ..models.slicing import slice_qk
from ..runs.json_io import write_json
from ..runs.records import TypedRecord
from .latency import time_models_lower
from .latency_table import LatencyTable, ViTGeometry, cache_dir, device_fingerprint, read_table, table_key
from .latency_table_predict import predict_latency

CHUNK = 8  # chains timed interleaved at once (bounds the memory the weights take)


class ConstantHalf(nn.Module):
    """An attention or MLP that is gone: a learned constant for every token, (B, N, C) -> (B, N, C)."""

    def __init__(self, dim: int):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor, **_: object) -> torch.Tensor:
        return self.bias.expand_as(x)


class HalfChain(nn.Module):
    """``blocks[0].<half>`` then ``blocks[1].<half>`` ...: one residual half of each block, in a row."""

    def __init__(self, blocks: list[NCBlock], half: str):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.half = half

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = getattr(b, self.half)(x)
        return x


def table_grids(geometry: ViTGeometry, *, align: int) -> dict[str, tuple[int, ...]]:
    """The grid a table is measured on: token counts N, 0.7 N, 0.5 N; every head count up to 6 heads
    (else 0, 1, 2, H/4, H/2, 3H/4, H); Q/K widths that are multiples of ``align`` up to the head dim (at
    most five, the full width included); hidden widths 0, align, 2 and 4 x align and every eighth of
    the full width (multiples of ``align``)."""
    if not isinstance(align, int) or align < 1:
        raise NascompressError(f"align must be a positive integer, got {align!r}")
    N, H, d, Hm = geometry.tokens, geometry.num_heads, geometry.head_dim, geometry.mlp_hidden
    prefix = int(geometry.class_token) + geometry.reg_tokens
    tokens = sorted({max(prefix + 1, round(f * N)) for f in (0.5, 0.7)} | {N})
    heads = list(range(H + 1)) if H <= 6 else sorted({0, 1, 2, H // 4, H // 2, (3 * H) // 4, H})
    steps = list(range(align, d, align))
    if len(steps) > 4:
        steps = sorted({steps[round(i * (len(steps) - 1) / 3)] for i in range(4)})
    qk = sorted(set(steps) | {d})

    def snap(w: int) -> int:
        return min(Hm, max(align, (w // align) * align))

    hidden = sorted(
        {0, Hm} | {snap(w) for w in (align, 2 * align, 4 * align)} | {snap(i * Hm // 8) for i in range(1, 8)}
    )
    return {"tokens": tuple(tokens), "heads": tuple(heads), "qk": tuple(qk), "hidden": tuple(hidden)}


def make_block(geometry: ViTGeometry, *, heads: int, qk: int, hidden: int) -> NCBlock:
    """An :class:`~nascompress.models.layers.NCBlock` of ``geometry`` (timm's Block: LayerNorm, GELU) with
    ``heads`` heads of Q/K width ``qk`` (V: the head dim; 0 heads: a constant) and ``hidden`` MLP
    neurons (0: a constant), random weights."""
    C, d = geometry.embed_dim, geometry.head_dim
    blk = Block(
        dim=C,
        num_heads=1,
        mlp_ratio=1.0,
        qkv_bias=geometry.qkv_bias,
        init_values=1e-5 if geometry.layer_scale else None,
    )
    if heads == 0:
        blk.attn = ConstantHalf(C)
    else:
        blk.attn = Attention(C, num_heads=heads, attn_head_dim=d, qkv_bias=geometry.qkv_bias)
    blk.mlp = ConstantHalf(C) if hidden == 0 else Mlp(C, hidden_features=hidden, act_layer=nn.GELU)
    blk.__class__ = NCBlock
    if heads:
        attn = core_attention(blk.attn)
        if qk < d:
            slice_qk(attn, [range(qk)] * heads, width=qk)
    return blk


def make_vit(geometry: ViTGeometry, blocks: list[nn.Module]) -> VisionTransformer:
    """A ``VisionTransformer`` of ``geometry`` with ``blocks`` as its blocks (none: the fixed part)."""
    g = geometry
    m = VisionTransformer(
        img_size=g.img_size,
        patch_size=g.patch_size,
        in_chans=g.in_chans,
        num_classes=g.num_classes,
        global_pool=g.global_pool,
        embed_dim=g.embed_dim,
        depth=0,
        num_heads=1,
        class_token=g.class_token,
        reg_tokens=g.reg_tokens,
    )
    m.blocks = nn.Sequential(*blocks)
    return m


PASSES = 2  # passes per entry of the table; the lower median is kept (see _median_ms)


def _median_ms(
    makers: list[Callable[[], nn.Module]], x: torch.Tensor, *, per: int, dtype: torch.dtype, warmup: int, iters: int
) -> list[float]:
    """Median ms per forward / ``per`` of each made module on ``x``, interleaved CHUNK at a time, the
    lower of :data:`PASSES` such medians (each pass interleaved anew): other work on the machine only
    ever adds time, and a burst of it during one pass would otherwise stand in the table for good
    (a full-width entry measured twice too slow made a search prune what was cheap)."""
    out: list[float] = []
    for i in range(0, len(makers), CHUNK):
        mods = [mk().eval().to(x.device, dtype) for mk in makers[i : i + CHUNK]]
        out += [1e3 * t / per for t in time_models_lower(mods, x, passes=PASSES, warmup=warmup, iters=iters)]
        del mods
    return out


def measured_ms(model: nn.Module, table: LatencyTable, *, device: str | torch.device = "cpu", seed: int = 0) -> float:
    """Milliseconds per forward of ``model`` on ``device`` now, timed as ``table``'s entries were (its
    batch, dtype, warm-up and iterations; the lower of :data:`PASSES` medians), on a random input of
    the table's image size: what anchors a table measured earlier to the device's speed of this
    moment (a shared machine's speed drifts by tens of percent over hours, and a cached table keeps
    the speed of when it was built; the ratios between its entries hold)."""
    dev = torch.device(device) if not isinstance(device, torch.device) else device
    dt, geo = runtime.parse_dtype(table.dtype), table.geometry
    g = torch.Generator().manual_seed(seed)
    img = torch.randn(table.batch, geo.in_chans, *geo.img_size, generator=g).to(dev, dt)
    warmup, iters = int(table.settings.get("warmup", 2)), int(table.settings.get("iters", 7))
    clone = copy.deepcopy(model)  # timed in the table's dtype on the device: the caller's model is left as it is
    with runtime.configured(dev):
        return _median_ms([lambda: clone], img, per=1, dtype=dt, warmup=warmup, iters=iters)[0]


@dataclass(frozen=True, kw_only=True)
class TableAnchor(TypedRecord):
    """A model timed now against ``table``'s prediction of it (:func:`table_anchor`): ``dense_ms``
    (:func:`measured_ms`), ``table_dense_ms`` (the prediction) and ``anchor``, their ratio (1 where
    the table predicts 0): the factor that brings the table's milliseconds to this moment's speed."""

    NEW_SOURCE = "the latency table's {name}"

    dense_ms: float
    table_dense_ms: float
    anchor: float


def table_anchor(
    model: nn.Module, table: LatencyTable, *, device: str | torch.device = "cpu", seed: int = 0
) -> TableAnchor:
    """The :class:`TableAnchor` of ``model`` (the dense model a table was measured for) on ``device``."""
    now = measured_ms(model, table, device=device, seed=seed)
    predicted = float(predict_latency(table, model))
    return TableAnchor.new(dense_ms=now, table_dense_ms=predicted, anchor=now / predicted if predicted > 0 else 1.0)


def monotone(t: torch.Tensor, axis: int) -> torch.Tensor:
    """``t`` made non-decreasing along ``axis``: the mean of its running maximum from below and its
    running minimum from above (both monotone, each within the measured values' range), which
    smooths the noise of medians measured on a shared machine without moving a monotone table.
    Why: more tokens, heads or hidden neurons never run faster, but a noisy median can say so, and a
    search would then follow that slope the wrong way. The Q/K axis is left as measured: a narrowed
    Q/K can be slower than the full one where it leaves the fused kernel's fast path."""
    up = torch.cummax(t, dim=axis).values
    down = torch.flip(torch.cummin(torch.flip(t, (axis,)), dim=axis).values, (axis,))
    return (up + down) / 2


def build_table(
    geometry: ViTGeometry,
    *,
    device: torch.device,
    dtype: str = "fp32",
    batch: int = 1,
    align: int = 8,
    iters: int = 7,
    warmup: int = 2,
    seed: int = 0,
) -> LatencyTable:
    """Measure the latency table of ``geometry`` on ``device`` (see the module docstring)."""
    dt = runtime.parse_dtype(dtype)
    grids = table_grids(geometry, align=align)
    D, C, H, d, Hm = geometry.depth, geometry.embed_dim, geometry.num_heads, geometry.head_dim, geometry.mlp_hidden
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    n_entries = len(grids["tokens"]) * (len(grids["heads"]) * len(grids["qk"]) + len(grids["hidden"]))
    say(f"latency table: measuring {n_entries} entries on {device} ({dtype}, batch {batch}) ...")

    def chain(half: str, **widths: int) -> Callable[[], nn.Module]:
        return lambda: HalfChain([make_block(geometry, **widths) for _ in range(D)], half)

    attn_ms, mlp_ms = [], []
    with runtime.configured(device):
        for n in grids["tokens"]:
            x = torch.randn(batch, n, C, generator=g).to(device, dt)
            pairs = [(h, q) for h in grids["heads"] for q in (grids["qk"] if h else grids["qk"][-1:])]
            t = dict(
                zip(
                    pairs,
                    _median_ms(
                        [chain("attn_half", heads=h, qk=q, hidden=0) for h, q in pairs],
                        x,
                        per=D,
                        dtype=dt,
                        warmup=warmup,
                        iters=iters,
                    ),
                )
            )
            attn_ms.append([[t[(h, q if h else grids["qk"][-1])] for q in grids["qk"]] for h in grids["heads"]])
            makers = [chain("mlp_half", heads=0, qk=d, hidden=w) for w in grids["hidden"]]
            mlp_ms.append(_median_ms(makers, x, per=D, dtype=dt, warmup=warmup, iters=iters))
        img = torch.randn(batch, geometry.in_chans, *geometry.img_size, generator=g).to(device, dt)
        fixed_ms, dense_ms = _median_ms(
            [
                lambda: make_vit(geometry, []),
                lambda: make_vit(geometry, [make_block(geometry, heads=H, qk=d, hidden=Hm) for _ in range(D)]),
            ],
            img,
            per=1,
            dtype=dt,
            warmup=warmup,
            iters=iters,
        )
    attn_ms = monotone(monotone(torch.tensor(attn_ms), 0), 1).tolist()  # tokens, heads (not Q/K: see monotone)
    mlp_ms = monotone(monotone(torch.tensor(mlp_ms), 0), 1).tolist()  # tokens, hidden
    full = grids["tokens"].index(geometry.tokens)
    halves = attn_ms[full][-1][-1] + mlp_ms[full][-1]
    per_block = (dense_ms - fixed_ms) / D
    overhead, scale = max(0.0, per_block - halves), 1.0
    if per_block < halves and halves > 0:  # the halves timed alone cost more than in the model: scale them
        scale = max(per_block, 0.0) / halves  # to it, so the dense model predicts as measured
        attn_ms = (torch.tensor(attn_ms) * scale).tolist()
        mlp_ms = (torch.tensor(mlp_ms) * scale).tolist()
    return LatencyTable(
        fingerprint=device_fingerprint(device),
        dtype=dtype,
        batch=batch,
        geometry=geometry,
        attn_ms=attn_ms,
        mlp_ms=mlp_ms,
        fixed_ms=fixed_ms,
        block_overhead_ms=overhead,
        dense_ms=dense_ms,
        settings={
            "align": align,
            "iters": iters,
            "warmup": warmup,
            "chain": D,
            "monotone": True,
            "halves_scale": scale,
        },
        **grids,
    )


def latency_table(
    geometry: ViTGeometry,
    *,
    device: str | torch.device = "cpu",
    dtype: str = "fp32",
    batch: int = 1,
    cache: bool = True,
    rebuild: bool = False,
    align: int = 8,
    iters: int = 7,
    warmup: int = 2,
) -> LatencyTable:
    """The latency table of ``geometry`` on ``device`` in ``dtype`` at ``batch``: read from the cache,
    or measured (:func:`build_table`) and written there atomically when missing,
    damaged, or ``rebuild``. ``cache=False`` measures without reading or writing the cache."""
    table, _, _ = cached_table(
        geometry,
        device=device,
        dtype=dtype,
        batch=batch,
        cache=cache,
        rebuild=rebuild,
        align=align,
        iters=iters,
        warmup=warmup,
    )
    return table


def cached_table(
    geometry: ViTGeometry,
    *,
    device: str | torch.device,
    dtype: str,
    batch: int,
    cache: bool,
    rebuild: bool,
    align: int,
    iters: int,
    warmup: int,
) -> tuple[LatencyTable, Path | None, bool]:
    """:func:`latency_table`, the cache file it was read from or written to (None: no cache), and
    whether it was measured now."""
    dev = torch.device(device) if not isinstance(device, torch.device) else device
    dtype = runtime.dtype_name(runtime.parse_dtype(dtype))
    if not isinstance(batch, int) or batch < 1:
        raise NascompressError(f"batch must be a positive integer, got {batch!r}")
    key = table_key(geometry, fingerprint=device_fingerprint(dev), dtype=dtype, batch=batch, align=align)
    path = cache_dir() / f"{key}.json" if cache else None
    if path is not None and path.exists() and not rebuild:
        try:
            table = read_table(path)
            if (table.geometry, table.dtype, table.batch, table.settings.get("align")) != (
                geometry,
                dtype,
                batch,
                align,
            ):
                raise NascompressError(f"{path} holds the table of another geometry, dtype, batch or alignment")
            return table, path, False
        except NascompressError as e:
            say(f"latency table: {e}; measuring it again")
    table = build_table(geometry, device=dev, dtype=dtype, batch=batch, align=align, iters=iters, warmup=warmup)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, table.to_dict())
    return table, path, True


__all__ = [
    "build_table",
    "latency_table",
    "measured_ms",
    "TableAnchor",
    "table_anchor",
    "cached_table",
    "table_grids",
    "make_block",
    "make_vit",
    "ConstantHalf",
    "HalfChain",
]
