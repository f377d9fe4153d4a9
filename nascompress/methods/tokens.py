"""Shared pieces of the token-pruning methods (EViT, DynamicViT): layer choice, validation,
gathering tokens, and the per-model checks.

Layers are numbered from 1 here, as in the papers and on the command line. Prefix tokens (the
class token, a distillation token, register tokens: timm's ``num_prefix_tokens``) are never
pruned; only the patch tokens after them are ranked.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from ..config import setting
from ..errors import NascompressError
from ..models.layers import to_core


def distill_setting() -> Any:
    """The recipe setting ``distill`` of the token methods that train on cross-entropy alone by
    default (EViT, ToMe): one declaration, so ``finetune --distill`` means the same for both."""
    return setting(
        0.0, lo=0, help="Weight of KL(student || dense teacher) added to the cross-entropy (0: none, the paper's)."
    )


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


def check_token_model(model: nn.Module, method: str) -> VisionTransformer:
    """A timm ViT with a class token read by the head (``global_pool='token'``): token pruning keeps
    the prefix tokens and ranks the patch tokens. Anything else is refused with the reason."""
    if not isinstance(model, VisionTransformer):
        raise NascompressError(f"{method} needs a timm VisionTransformer (vit_*, deit_*), got {type(model).__name__}")
    if getattr(model, "cls_token", None) is None:
        raise NascompressError(
            f"{method} ranks tokens by the class token's attention; this model has no class token "
            f"(class_token=False, global_pool={model.global_pool!r}): use dcs or sparsifiner"
        )
    if model.global_pool != "token":
        raise NascompressError(
            f"{method} needs a model whose head reads the class token (global_pool='token'); this "
            f"one pools {model.global_pool!r} over the tokens, which pruning would change: "
            "use dcs or sparsifiner"
        )
    to_core(model, method=method)
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
    if (
        not isinstance(layers, (list, tuple))
        or not layers
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in layers)
    ):
        raise NascompressError(f"{name} must be a non-empty list of layer numbers in [1, {depth}], got {layers!r}")
    bad = [v for v in layers if not 1 <= v <= depth]
    if bad:
        raise NascompressError(f"{name} {bad} outside the model's depth: valid layers are 1..{depth}")
    if list(layers) != sorted(set(layers)):
        raise NascompressError(f"{name} must be strictly increasing without repeats, got {list(layers)}")
    return list(layers)


def per_layer(values: Any, n: int, name: str) -> tuple[float, ...]:
    """A rate for each of ``n`` pruning layers: one number (the same everywhere) or a list of n."""
    if isinstance(values, (list, tuple)):
        if len(values) != n:
            raise NascompressError(
                f"{name} has {len(values)} values but there are {n} pruning layers; give one value or one per layer"
            )
        return tuple(check_rate(v, name) for v in values)
    return (check_rate(values, name),) * n


def gather_tokens(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Pick tokens per image: x (B, N, C), idx (B, K) int64 -> (B, K, C).

    One ``index_select`` on the flattened (B*N, C) tokens (about 2x faster on CPU than
    ``torch.gather`` with an expanded index); no Python loop over images, and no offsets to add
    for one image (the latency case, where every small kernel counts).
    """
    B, N, C = x.shape
    if B == 1:
        return x[0].index_select(0, idx[0]).unsqueeze(0)
    flat = idx + torch.arange(0, B * N, N, device=idx.device).unsqueeze(1)  # image b's tokens start at b * N
    return x.reshape(B * N, C).index_select(0, flat.reshape(-1)).view(B, idx.shape[1], C)


def keep_prefix_and(x: torch.Tensor, idx: torch.Tensor, prefix: int) -> torch.Tensor:
    """[the prefix tokens, the patch tokens idx] in one gather: x (B, N, C), idx (B, K) into
    x[:, prefix:] -> (B, prefix + K, C)."""
    if prefix == 0:
        return gather_tokens(x, idx)
    if prefix == 1:  # [0, idx + 1]: the class token's index is the pad value (two kernels, not three)
        return gather_tokens(x, F.pad(idx + 1, (1, 0)))
    head = torch.arange(prefix, device=idx.device).expand(idx.shape[0], prefix)
    return gather_tokens(x, torch.cat([head, idx + prefix], dim=1))


def ceil_keep(rate: float, n: int) -> int:
    """ceil(rate * n) with a guard against float error (0.7 * 140 = 98.00000000000001)."""
    return max(1, math.ceil(rate * n - 1e-6))


_PATCHED: dict[tuple[type, type], type] = {}


def patched_class(cls: type, mixin: type, prefix: str) -> type:
    """``class <prefix><cls>(mixin, cls)``, cached, so a method stacks on another method's Block
    subclass (a DCS block) and ``super()`` / the residual halves reach that class."""
    key = (cls, mixin)
    if key not in _PATCHED:
        _PATCHED[key] = type(f"{prefix}{cls.__name__}", (mixin, cls), {"__module__": mixin.__module__})
    return _PATCHED[key]


def token_layers(
    model: nn.Module,
    method: str,
    layers: Any,
    *,
    name: str = "prune_layers",
    default: Callable[[int], list[int]] = scale_layers,
) -> list[int]:
    """The start of every token method's ``resolve``: ``model`` checked (:func:`check_token_model`),
    then its layers: ``layers`` checked against the depth (:func:`check_layers`), or ``default(depth)``
    (the papers' layers scaled, :func:`scale_layers`) when None."""
    depth = len(check_token_model(model, method).blocks)
    return default(depth) if layers is None else check_layers(layers, depth, name)


__all__ = [
    "scale_layers",
    "check_token_model",
    "check_rate",
    "check_layers",
    "token_layers",
    "per_layer",
    "gather_tokens",
    "keep_prefix_and",
    "ceil_keep",
    "patched_class",
    "REF_LAYERS",
]
