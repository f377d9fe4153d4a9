"""The shapes a plain ViT's weights have, read from the tensors (``nascompress import``): patch
size and input channels (the patch kernel ``patch_embed.proj.weight``, (E, C, ph, pw)), width E,
depth (the ``blocks.N`` entries), MLP width (``blocks.0.mlp.fc1.weight``), a qkv bias and Q/K norms
(present or not), heads where the weights
say (a ``q_norm`` of head_dim values; a fused qkv does not: ``num_heads`` is then the name's or the
user's) and the input size (the ``pos_embed`` grid times the patch size).

:func:`shape_kwargs` turns them into the build settings of the named timm architecture that differ
from its defaults, so the model built holds the file as it is: nothing is resampled that the user
did not ask for (an explicit ``img_size`` other than the grid resamples the position embedding, as
timm does, and is reported). What cannot be matched is refused, naming the file's real shapes."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import NascompressError, SettingError, literal, words
from ..progress import say


def read_shapes(sd: dict[str, torch.Tensor]) -> dict[str, Any] | None:
    """The ViT shapes of a state dict in timm's layout (None when it has no ``patch_embed.proj.weight``
    kernel: another layout, left to timm's checkpoint filter)."""
    w = sd.get("patch_embed.proj.weight")
    if w is None or w.ndim != 4:
        return None
    blocks = {int(k.split(".")[1]) for k in sd if k.startswith("blocks.") and k.split(".")[1].isdigit()}
    fc1, qn, pos = sd.get("blocks.0.mlp.fc1.weight"), sd.get("blocks.0.attn.q_norm.weight"), sd.get("pos_embed")
    embed = int(w.shape[0])
    return {
        "kernel": tuple(w.shape),
        "patch_size": (int(w.shape[2]), int(w.shape[3])),
        "in_chans": int(w.shape[1]),
        "embed_dim": embed,
        "depth": max(blocks) + 1 if blocks else 0,
        "mlp_hidden": int(fc1.shape[0]) if fc1 is not None and fc1.ndim == 2 else None,
        "num_heads": embed // int(qn.shape[0])
        if qn is not None and qn.ndim == 1 and embed % int(qn.shape[0]) == 0
        else None,
        "pos_tokens": int(pos.shape[1]) if pos is not None and pos.ndim == 3 else None,
        "qk_norm": qn is not None,
        "qkv_bias": "blocks.0.attn.qkv.bias" in sd if blocks else None,
    }


def describe(s: dict[str, Any]) -> str:
    """The file's shapes in words, for messages."""
    p = s["patch_size"]
    return (
        f"patch kernel {s['kernel']} (patch {p[0]}x{p[1]}, {s['in_chans']} channels), width {s['embed_dim']}, "
        f"depth {s['depth']}"
        + (f", MLP {s['mlp_hidden']}" if s["mlp_hidden"] else "")
        + (f", {s['pos_tokens']} position tokens" if s["pos_tokens"] else "")
    )


def shape_kwargs(
    name: str,
    named: nn.Module,
    sd: dict[str, torch.Tensor],
    *,
    img_size: int | None,
    num_heads: int | None,
    source: str,
) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """The build settings of timm ``name`` (``named``: it built with its defaults) that make it the
    model the weights ``sd`` describe, and the notes: each setting that differs from the name's,
    ``{setting: [the file's, the name's]}`` (``img_size`` with an explicit size: [the size, the grid's]).

    Args:
        img_size: an explicit input size (None: the position-embedding grid times the patch size).
        num_heads: the attention heads (None: read from a ``q_norm`` if there is one, else the name's,
            which is refused when the width differs from the name's).
        source: how messages name the weights file.
    """
    s = read_shapes(sd)
    kwargs: dict[str, Any] = {} if img_size is None else {"img_size": img_size}
    if s is None:
        return kwargs, {}
    pe, blk = named.patch_embed, named.blocks[0] if len(named.blocks) else None
    has = {
        "patch_size": tuple(pe.patch_size),
        "in_chans": pe.proj.in_channels,
        "embed_dim": named.embed_dim,
        "depth": len(named.blocks),
        "num_heads": blk.attn.num_heads if blk is not None else None,
        "qk_norm": blk is not None and not isinstance(blk.attn.q_norm, nn.Identity),
        "qkv_bias": blk is not None and blk.attn.qkv.bias is not None,
    }
    notes: dict[str, list[Any]] = {}
    for key in ("patch_size", "in_chans", "embed_dim", "depth", "qk_norm", "qkv_bias"):
        if key in ("qk_norm", "qkv_bias") and (blk is None or s[key] is None):
            continue
        if s[key] != has[key]:
            value = s[key][0] if key == "patch_size" and s[key][0] == s[key][1] else s[key]
            kwargs[key], notes[key] = value, [value, has[key][0] if key == "patch_size" else has[key]]
    heads = _heads(name, s, has, num_heads, source)
    if heads != has["num_heads"]:
        kwargs["num_heads"], notes["num_heads"] = heads, [heads, has["num_heads"]]
    named_ratio = blk.mlp.fc1.out_features / named.embed_dim if blk is not None else 4.0
    if s["mlp_hidden"] and s["mlp_hidden"] != int(s["embed_dim"] * named_ratio):
        ratio = s["mlp_hidden"] / s["embed_dim"]
        if int(s["embed_dim"] * ratio) != s["mlp_hidden"]:
            raise NascompressError(
                f"weights file {source}: its MLP width {s['mlp_hidden']} is no whole ratio of its "
                f"width {s['embed_dim']} that timm can build ({describe(s)})"
            )
        kwargs["mlp_ratio"], notes["mlp_ratio"] = ratio, [ratio, named_ratio]
    grid = _grid_size(named, s, source, explicit=img_size is not None)
    if img_size is None and grid is not None and (grid, grid) != tuple(pe.img_size):
        kwargs["img_size"], notes["img_size"] = grid, [grid, pe.img_size[0]]
    elif img_size is not None and grid is not None and grid != img_size:
        notes["img_size"] = [img_size, grid]  # asked for: the position embedding is resampled to it
    return kwargs, notes


def _heads(name: str, s: dict[str, Any], has: dict[str, Any], num_heads: int | None, source: str) -> int | None:
    embed = s["embed_dim"]
    if num_heads is not None:
        if embed % num_heads:
            raise SettingError(
                f"{{num_heads}} {num_heads} does not divide the weights' width {embed} ({source}: {describe(s)})"
            )
        if s["num_heads"] is not None and s["num_heads"] != num_heads:
            raise SettingError(
                f"{{num_heads}} {num_heads} contradicts the weights: their q_norm has head_dim "
                f"{embed // s['num_heads']}, so {s['num_heads']} heads ({source})"
            )
        return num_heads
    if s["num_heads"] is not None:
        return s["num_heads"]
    if embed != has["embed_dim"]:
        raise SettingError(
            f"weights file {source} is not {name}'s shape: {describe(s)} (the name has width {has['embed_dim']} with "
            f"{has['num_heads']} heads); the number of heads cannot be read from a fused qkv: give {{num_heads}} "
            f"(a divisor of {embed})"
        )
    return has["num_heads"]


def _grid_size(named: nn.Module, s: dict[str, Any], source: str, *, explicit: bool) -> int | None:
    """The square input size the file's position-embedding grid and patch size make (None: no
    position embedding); a grid that is not square is refused unless the size is given."""
    if s["pos_tokens"] is None or named.pos_embed is None:
        return None
    prefix = 0 if getattr(named, "no_embed_class", False) else getattr(named, "num_prefix_tokens", 1)
    n = s["pos_tokens"] - prefix
    side = math.isqrt(max(n, 0))
    if side < 1 or side * side != n:
        if explicit:
            return None
        raise SettingError(
            f"weights file {source}: its position embedding has {n} patch positions (after "
            f"{prefix} prefix tokens), no square grid ({describe(s)}); give {{img_size}}"
        )
    if s["patch_size"][0] != s["patch_size"][1]:
        return None if explicit else side * s["patch_size"][0]
    return side * s["patch_size"][0]


def check_resampling(raw: dict[str, torch.Tensor], model: nn.Module, path: str | Path) -> None:
    """What timm's filter would resample, never silently: a patch kernel of another size is refused (the
    model would compute another function), a position grid of another size is resampled and said."""
    kernel, own = raw.get("patch_embed.proj.weight"), getattr(getattr(model, "patch_embed", None), "proj", None)
    if (
        kernel is not None
        and own is not None
        and kernel.ndim == 4
        and tuple(kernel.shape[-2:]) != tuple(own.weight.shape[-2:])
    ):
        k = "x".join(map(str, kernel.shape[-2:]))
        raise SettingError(
            f"weights file {path} has {k} patches (patch kernel {tuple(kernel.shape)}) but the model "
            f"has {'x'.join(map(str, own.weight.shape[-2:]))}; build it with {{patch_size}} "
            f"{kernel.shape[-1]}, or bring the file in with `nascompress import`, which reads every "
            "shape from the weights"
        )
    pos, own_pos = raw.get("pos_embed"), getattr(model, "pos_embed", None)
    if pos is not None and own_pos is not None and pos.ndim == 3 and pos.shape[1] != own_pos.shape[1]:
        say(
            words(
                f"weights: the position embedding of {literal(str(path))} ({pos.shape[1]} positions) is resampled to "
                f"the model's {own_pos.shape[1]} (its input size); give the {{img_size}} the weights were made for to "
                "keep them as they are"
            )
        )


__all__ = ["check_resampling", "describe", "read_shapes", "shape_kwargs"]
