"""A lookup table of measured block latencies for one device, dtype and batch size, and its cache.

A ViT's latency is the table's ``fixed_ms`` (patch embedding, position embedding, final norm and
head) plus, per block present, ``block_overhead_ms`` and its two residual halves: the attention half
(norm1 + qkv + attention + proj + residual add) at its kept heads and Q/K width per head, and the
MLP half (norm2 + fc1 + GELU + fc2 + residual add) at its hidden width, each at a token count.
:mod:`.latency_table_build` measures the entries with real modules (:class:`~nascompress.models.layers.NCBlock`
at the needed widths, random weights); :mod:`.latency_table_predict` interpolates them.

Tables are plain JSON (``format: nascompress-latency-table/1``) cached under
``<cache>/nascompress/latency/<key>.json``, ``<cache>`` being ``$NASCOMPRESS_CACHE``, else
``$XDG_CACHE_HOME``, else ``~/.cache``; ``key`` is a short hash of the device fingerprint, the dtype,
the batch size, the geometry and the grid alignment (:func:`~.latency_table_build.latency_table`
reads and writes them; a damaged cached table is measured again).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import NascompressError
from ..runs.json_io import read_json
from ..runs.records import TypedRecord

TABLE_FORMAT = "nascompress-latency-table/1"
CPU_FLAGS = ("avx512f", "avx512_bf16", "amx_tile", "amx_bf16")  # the flags that change CPU kernels


@dataclass(frozen=True)
class ViTGeometry:
    """The shape of a timm ViT that a latency table is measured for (the full, unpruned widths).

    Args:
        img_size, patch_size: (height, width) of the input and of a patch.
        in_chans: input channels; num_classes: the head's outputs.
        embed_dim: the residual width C; depth: the number of blocks.
        num_heads: full heads H; head_dim: d (V's width per head, the full Q/K width).
        mlp_hidden: the full MLP hidden width.
        class_token, reg_tokens: the prefix tokens; global_pool: timm's pooling ("token", "avg", ...).
        qkv_bias, layer_scale: as in timm's Block (LayerScale: DINOv2's ``init_values``).
    """

    img_size: tuple[int, int]
    patch_size: tuple[int, int]
    in_chans: int
    embed_dim: int
    depth: int
    num_heads: int
    head_dim: int
    mlp_hidden: int
    num_classes: int
    class_token: bool = True
    reg_tokens: int = 0
    global_pool: str = "token"
    qkv_bias: bool = True
    layer_scale: bool = False

    def __post_init__(self) -> None:
        for name in ("in_chans", "embed_dim", "depth", "num_heads", "head_dim", "mlp_hidden", "num_classes"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < (0 if name == "num_classes" else 1):
                raise NascompressError(f"a latency geometry's {name} must be a positive integer, got {v!r}")
        for name in ("img_size", "patch_size"):
            v = getattr(self, name)
            if len(v) != 2 or any(not isinstance(s, int) or s < 1 for s in v):
                raise NascompressError(f"a latency geometry's {name} must be two positive integers, got {v!r}")
        if any(i % p for i, p in zip(self.img_size, self.patch_size)):
            raise NascompressError(f"img_size {self.img_size} is not a multiple of patch_size {self.patch_size}")

    @property
    def tokens(self) -> int:
        """N: patches plus prefix tokens."""
        grid = (self.img_size[0] // self.patch_size[0]) * (self.img_size[1] // self.patch_size[1])
        return grid + int(self.class_token) + self.reg_tokens

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["img_size"], d["patch_size"] = list(self.img_size), list(self.patch_size)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ViTGeometry":
        names = {f.name for f in fields(cls)}
        if not isinstance(d, dict) or set(d) - names:
            raise NascompressError(f"not a latency geometry: {d!r:.120}")
        d = dict(d)
        for k in ("img_size", "patch_size"):
            if k in d:
                d[k] = tuple(d[k])
        try:
            return cls(**d)
        except TypeError as e:
            raise NascompressError(f"not a latency geometry ({e})") from e


def geometry_of(model: nn.Module) -> ViTGeometry:
    """The geometry of a timm ``VisionTransformer`` (for a pruned one: the widest block's widths)."""
    # timm's VisionTransformer: one class whatever method patched it (its blocks are subclasses)
    from timm.models.vision_transformer import VisionTransformer

    if not isinstance(model, VisionTransformer):
        raise NascompressError(
            f"latency tables are for timm VisionTransformers (vit_*, deit_*), got {type(model).__name__}"
        )
    blocks = list(model.blocks)
    attns = [b.attn for b in blocks if hasattr(getattr(b, "attn", None), "qkv")]
    mlps = [b.mlp for b in blocks if hasattr(getattr(b, "mlp", None), "fc1")]
    if not attns or not mlps:
        raise NascompressError("this model has no block with an attention and an MLP: no latency geometry to measure")
    pe = model.patch_embed
    return ViTGeometry(
        img_size=tuple(int(s) for s in pe.img_size),
        patch_size=tuple(int(s) for s in pe.patch_size),
        in_chans=int(pe.proj.in_channels),
        embed_dim=int(model.embed_dim),
        depth=len(blocks),
        num_heads=max(int(a.num_heads) for a in attns),
        head_dim=int(attns[0].head_dim),
        mlp_hidden=max(int(m.fc1.out_features) for m in mlps),
        num_classes=int(model.num_classes),
        class_token=model.cls_token is not None,
        reg_tokens=int(getattr(model, "num_reg_tokens", 0)),
        global_pool=str(model.global_pool),
        qkv_bias=attns[0].qkv.bias is not None,
        layer_scale=not isinstance(blocks[0].ls1, nn.Identity),
    )


def cpu_info() -> tuple[str, set[str]]:
    """The CPU's model name and flags (from /proc/cpuinfo; elsewhere platform.processor(), no flags)."""
    name, flags = "", set()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, val = line.partition(":")
        key = key.strip()
        if key == "model name" and not name:
            name = val.strip()
        elif key == "flags" and not flags:
            flags = set(val.split())
    return name or platform.processor() or platform.machine(), flags


@dataclass(frozen=True, kw_only=True)
class DeviceFingerprint(TypedRecord):
    """What a table's timings depend on (:func:`device_fingerprint`; a table's ``fingerprint``, part of
    its cache key): the device type, the CPU model and its kernel flags, logical cores, threads, the
    torch version, and on CUDA the GPU's name and compute capability (None: not recorded)."""

    NEW_SOURCE = "the device's {name}"

    device_type: str
    cpu: str | None = None
    cpu_flags: list[str] | None = None
    logical_cores: int | None = None
    threads: int | None = None
    torch: str | None = None
    gpu: str | None = None
    capability: str | None = None


def device_fingerprint(device: torch.device) -> DeviceFingerprint:
    """The :class:`DeviceFingerprint` of ``device`` in this process."""
    name, flags = cpu_info()
    fp = DeviceFingerprint.new(
        device_type=device.type,
        cpu=name,
        cpu_flags=[f for f in CPU_FLAGS if f in flags],
        logical_cores=os.cpu_count(),
        threads=torch.get_num_threads(),
        torch=torch.__version__,
    )
    if device.type == "cuda":
        fp = fp.set(
            gpu=torch.cuda.get_device_name(device),
            capability="%d.%d" % torch.cuda.get_device_capability(device),
        )
    return fp


def _check_grid(name: str, v: Any) -> tuple[int, ...]:
    if not isinstance(v, list) or not v or any(not isinstance(x, int) or x < 0 for x in v) or v != sorted(set(v)):
        raise NascompressError(f"a latency table's {name} grid must be increasing non-negative integers, got {v!r:.80}")
    return tuple(v)


def _check_ms(name: str, v: Any, shape: tuple[int, ...]) -> list:
    t = torch.tensor(v, dtype=torch.float64) if isinstance(v, list) else None
    if t is None or tuple(t.shape) != shape or not torch.isfinite(t).all() or (t < 0).any():
        raise NascompressError(f"a latency table's {name} must be finite non-negative ms of shape {shape}")
    return v


@dataclass(frozen=True)
class LatencyTable:
    """Median milliseconds per forward, for one device, dtype, batch and geometry.

    ``attn_ms[i][j][k]``: the attention half at ``tokens[i]`` tokens, ``heads[j]`` heads and
    ``qk[k]`` Q/K channels per head (heads 0: the attention gone, a constant; the same for every
    ``qk``); ``mlp_ms[i][j]``: the MLP half at ``tokens[i]`` tokens and ``hidden[j]`` neurons (0: a
    constant MLP); ``fixed_ms``: patch embed, position embedding, final norm and head;
    ``block_overhead_ms``: what a block costs beyond its halves (the dense model measured, less
    ``fixed_ms`` and its halves, per block; where the halves timed alone cost more than that, the
    halves are scaled down to it instead, ``settings["halves_scale"]``, so the dense model always
    predicts as measured); ``dense_ms``: the dense model as measured.
    """

    fingerprint: DeviceFingerprint
    dtype: str
    batch: int
    geometry: ViTGeometry
    tokens: tuple[int, ...]
    heads: tuple[int, ...]
    qk: tuple[int, ...]
    hidden: tuple[int, ...]
    attn_ms: list
    mlp_ms: list
    fixed_ms: float
    block_overhead_ms: float
    dense_ms: float
    settings: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = {"format": TABLE_FORMAT}
        for f in fields(self):
            v = getattr(self, f.name)
            typed = isinstance(v, (ViTGeometry, DeviceFingerprint))
            d[f.name] = v.to_dict() if typed else list(v) if isinstance(v, tuple) else v
        return d

    @classmethod
    def from_dict(cls, d: Any) -> "LatencyTable":
        """Read a table's JSON, checked (a damaged or foreign one raises :class:`NascompressError`)."""
        if not isinstance(d, dict) or d.get("format") != TABLE_FORMAT:
            raise NascompressError(f"not a latency table (format {TABLE_FORMAT} expected)")
        missing = {f.name for f in fields(cls)} - set(d)
        if missing:
            raise NascompressError(f"a latency table misses {', '.join(sorted(missing))}")
        grids = {k: _check_grid(k, d[k]) for k in ("tokens", "heads", "qk", "hidden")}
        nt = len(grids["tokens"])
        scalars = {k: d[k] for k in ("fixed_ms", "block_overhead_ms", "dense_ms")}
        if any(not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 for v in scalars.values()):
            raise NascompressError("a latency table's fixed, overhead and dense times must be finite non-negative ms")
        if not isinstance(d["batch"], int) or d["batch"] < 1 or not isinstance(d["fingerprint"], dict):
            raise NascompressError("a latency table's batch or fingerprint is damaged")
        return cls(
            fingerprint=DeviceFingerprint.from_dict(d["fingerprint"], source="a latency table's fingerprint"),
            dtype=str(d["dtype"]),
            batch=d["batch"],
            geometry=ViTGeometry.from_dict(d["geometry"]),
            attn_ms=_check_ms("attn_ms", d["attn_ms"], (nt, len(grids["heads"]), len(grids["qk"]))),
            mlp_ms=_check_ms("mlp_ms", d["mlp_ms"], (nt, len(grids["hidden"]))),
            settings=dict(d.get("settings") or {}),
            **grids,
            **{k: float(v) for k, v in scalars.items()},
        )


def cache_dir() -> Path:
    """``<cache>/nascompress/latency``: ``$NASCOMPRESS_CACHE``, else ``$XDG_CACHE_HOME``, else ``~/.cache``."""
    base = os.environ.get("NASCOMPRESS_CACHE") or os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "nascompress" / "latency"


def table_key(geometry: ViTGeometry, *, fingerprint: DeviceFingerprint, dtype: str, batch: int, align: int) -> str:
    """A short hash of what a table's timings depend on."""
    what = {
        "format": TABLE_FORMAT,
        "fingerprint": fingerprint.to_dict(),
        "dtype": dtype,
        "batch": batch,
        "geometry": geometry.to_dict(),
        "align": align,
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def read_table(path: str | Path) -> LatencyTable:
    """A latency table's JSON file, checked (one line on a damaged one)."""
    try:
        return LatencyTable.from_dict(read_json(path))
    except NascompressError as e:
        raise NascompressError(f"{path}: {e}") from e


__all__ = [
    "TABLE_FORMAT",
    "ViTGeometry",
    "DeviceFingerprint",
    "LatencyTable",
    "geometry_of",
    "device_fingerprint",
    "cpu_info",
    "cache_dir",
    "table_key",
    "read_table",
]
