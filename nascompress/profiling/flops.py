"""FLOPs as the papers count them: one multiply-add = one FLOP, attention matmuls included.

The counter is analytic and hook based, so it follows whatever a forward really computes
(tokens dropped by a pruning method are not counted; images that exit early are not counted):

* every ``nn.Linear``: (rows of its input) x in_features x out_features;
* every ``nn.Conv2d``: output elements x in_channels/groups x kernel area;
* every attention module: its two matmuls QK^T and AV. A module may define
  ``matmul_macs(self, inputs, output) -> float`` (total over the batch) to report what it
  really computes (sparse attention, per-head channel counts, extra runtime work); otherwise
  a timm ``Attention`` is counted as ``B * H * N * N * 2 * head_dim``, a PVT v2 spatial-reduction
  attention as ``B * H * N * M * 2 * head_dim`` (M: the reduced key grid's tokens).

MACs are attributed to buckets by module name: ``blocks.<i>.attn``, ``blocks.<i>.mlp`` and
``blocks.<i>`` (anything else inside block i, e.g. a predictor) and ``other`` (patch
embedding, head, model-level predictors). Totals are reported per image (divided by batch), so
dynamic models get the mean over the images of the batch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any
import copy

import torch
from timm.layers import Attention
from torch import nn
from timm.models.pvt_v2 import Attention as PvtAttention
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

_BLOCK_RE = re.compile(r"^blocks\.(\d+)(?:\.(attn|mlp))?(?:\.|$)")


def default_attention_macs(module: nn.Module, x: torch.Tensor) -> float:
    """QK^T and AV of a dense multi-head attention over the input's N tokens (whole batch)."""
    B, N, _ = x.shape
    return float(B * module.num_heads * N * N * 2 * module.head_dim)


def pvt_attention_macs(module: nn.Module, inputs: tuple) -> float:
    """QK^T and AV of a PVT v2 spatial-reduction attention: N queries, M reduced keys (whole batch)."""
    x, (h, w) = inputs[0], inputs[1]
    if module.pool is not None:  # linear SRA: keys pooled to a fixed grid
        m = module.pool.output_size
        m = m * m if isinstance(m, int) else m[0] * m[1]
    elif module.sr is not None:
        r = module.sr.kernel_size[0]
        m = (h // r) * (w // r)
    else:
        m = h * w
    B, N, _ = x.shape
    return float(B * module.num_heads * N * m * 2 * module.head_dim)


@dataclass
class FlopReport:
    """Per-image MACs (= the papers' FLOPs) and parameter count."""

    total: float
    params: int
    blocks: list[dict[str, float]] = field(default_factory=list)  # per block: attn, mlp, other
    other: float = 0.0
    batch: int = 1

    @property
    def gflops(self) -> float:
        return self.total / 1e9

    def to_dict(self) -> dict[str, Any]:
        return {
            "macs": self.total,
            "gflops": self.gflops,
            "params": self.params,
            "other_macs": self.other,
            "blocks": self.blocks,
            "batch": self.batch,
        }


def _bucket(name: str) -> tuple[int | None, str]:
    m = _BLOCK_RE.match(name)
    if m is None:
        return None, "other"
    return int(m.group(1)), m.group(2) or "other"


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@torch.no_grad()
def count_flops(model: nn.Module, x: torch.Tensor) -> FlopReport:
    """Run ``model(x)`` once in eval mode and count per-image MACs by module hooks.

    Args:
        model: any (patched) timm VisionTransformer.
        x: a preprocessed input batch (B, C, H, W); the report is per image (total / B).
    """
    depth = len(getattr(model, "blocks", []))
    blocks = [{"attn": 0.0, "mlp": 0.0, "other": 0.0} for _ in range(depth)]
    totals = {"other": 0.0}

    def add(name: str, macs: float) -> None:
        idx, kind = _bucket(name)
        if idx is None or idx >= depth:
            totals["other"] += macs
        else:
            blocks[idx][kind] += macs

    handles = []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear):

            def hook(m, inp, out, name=name):
                add(name, inp[0].numel() / m.in_features * m.in_features * m.out_features)
        elif isinstance(mod, nn.Conv2d):

            def hook(m, inp, out, name=name):
                k = m.kernel_size[0] * m.kernel_size[1]
                add(name, out.numel() * (m.in_channels // m.groups) * k)
        elif hasattr(mod, "matmul_macs") or isinstance(mod, (Attention, PvtAttention)):

            def hook(m, inp, out, name=name):
                fn = getattr(m, "matmul_macs", None)
                if fn is not None:
                    add(name, fn(inp, out))
                elif isinstance(m, PvtAttention):
                    add(name, pvt_attention_macs(m, inp))
                else:
                    add(name, default_attention_macs(m, inp[0]))
        else:
            continue
        handles.append(mod.register_forward_hook(hook))
    was_training = model.training
    model.eval()
    p = next(model.parameters(), None)
    if p is not None and x.device != p.device:  # counting needs no particular device: the model's
        x = x.to(p.device)
    try:
        model(x)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    B = x.shape[0]
    per_block = [{k: v / B for k, v in b.items()} for b in blocks]
    other = totals["other"] / B
    total = other + sum(sum(b.values()) for b in per_block)
    return FlopReport(total=total, params=count_params(model), blocks=per_block, other=other, batch=B)


@torch.no_grad()
def flop_counter_macs(model: nn.Module, x: torch.Tensor) -> float:
    """Cross-check with torch's FlopCounterMode (per image MACs).

    FlopCounterMode has no formula for the CPU fused SDPA kernel, so it runs under the MATH
    backend, where attention decomposes into counted bmm's. It counts FLOPs = 2 x MACs.
    """
    was_training = model.training
    model.eval()
    try:
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
            model(x)
    finally:
        model.train(was_training)
    return fc.get_total_flops() / 2 / x.shape[0]


@torch.no_grad()
def thop_macs(model: nn.Module, x: torch.Tensor) -> float:
    """thop's per-image MACs, for comparison only: thop misses every attention matmul.

    Runs on a copy (thop attaches counters to the modules it profiles).
    """
    from thop import profile  # the fallback counter only; ~70 ms at start-up

    m = copy.deepcopy(model).eval()
    macs, _ = profile(m, inputs=(x,), verbose=False)
    return float(macs) / x.shape[0]
