"""Channel importance for the DCS gates: what orders their start, what the family probe and the
protection of pretrained models measure.

Three kinds of channels per block, each scored by weight magnitude (:func:`channel_importance`)
or by measured activations (:func:`activation_importance`, from :func:`activation_stats`):

* ``residual`` (C,): a residual channel's share of what the MLP reads (after LN2) and writes back
  (the ``residual`` gate family);
* ``hidden`` (Hm,): an MLP hidden neuron's output, rms(h_j) x ||fc2 column j|| (the ``hidden``
  family; Wanda-style: activation x weight);
* ``qk`` (H, d): a head's Q/K channel, rms(q) x rms(k).

Why activations: on a pretrained model weight magnitudes say little about what a channel carries.
On DINOv2 ViT-S/14 (112 px, Fashion-MNIST probe, 85.3% on 600 validation images) dropping the 20%
least important residual channels of every MLP gave 11.3% by weight magnitude and 50.0% by the
activation score; on the Fashion-MNIST base trained from scratch 88.7% and 88.2% (dense 89.0%)
(``bench/dcs_init_order.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from ..errors import NascompressError
from ..models.layers import NCAttention, NCBlock, to_core


def check_supported(model: nn.Module) -> None:
    to_core(model, method="dcs")
    for i, blk in enumerate(model.blocks):
        if type(blk) is not NCBlock:
            raise NascompressError(
                f"dcs must be the first method of a model; blocks.{i} is already a {type(blk).__name__}"
            )
        if not (hasattr(blk.mlp, "fc1") and hasattr(blk.mlp, "fc2")):
            raise NascompressError(f"DCS supports MLPs with fc1/fc2; block {i} has {type(blk.mlp).__name__}")


@dataclass(frozen=True)
class ChannelImportance:
    """One block's importance scores: ``residual`` (C,), ``hidden`` (Hm,), ``qk`` (H, d)."""

    residual: torch.Tensor
    hidden: torch.Tensor
    qk: torch.Tensor

    def mlp(self, family: str) -> torch.Tensor:
        """The scores of the MLP gate family ``family`` (``residual`` or ``hidden``)."""
        return self.hidden if family == "hidden" else self.residual


@dataclass(frozen=True)
class BlockStats:
    """Activation statistics of one block of the dense model over the calibration images.

    ``residual_rms`` / ``residual_absmax`` (C,): the residual stream entering the MLP half (the
    input of LN2); ``hidden_mean`` / ``hidden_rms`` (Hm,): the MLP's hidden activations (the input
    of fc2); ``tokens``: how many token vectors were seen.
    """

    importance: ChannelImportance
    residual_rms: torch.Tensor
    residual_absmax: torch.Tensor
    hidden_mean: torch.Tensor
    hidden_rms: torch.Tensor
    tokens: int


def spread(importance: torch.Tensor) -> torch.Tensor:
    """Importance scores -> z in [-1, 1]: standardised over the last dim, clipped at 2 sigma, halved."""
    z = (importance - importance.mean(-1, keepdim=True)) / importance.std(-1, keepdim=True).clamp_min(1e-12)
    return z.clamp(-2, 2) / 2


@torch.no_grad()
def channel_importance(blk: NCBlock) -> ChannelImportance:
    """Weight-magnitude importance of a block's channels: residual |LN2 gain| x ||fc1 column|| x
    ||fc2 row||, hidden ||fc1 row|| x ||fc2 column||, Q/K ||W_q row|| x ||W_k row||."""
    g = blk.norm2.weight.abs() if getattr(blk.norm2, "weight", None) is not None else 1.0
    fc1, fc2 = blk.mlp.fc1.weight, blk.mlp.fc2.weight
    residual = g * fc1.norm(dim=0) * fc2.norm(dim=1)
    hidden = fc1.norm(dim=1) * fc2.norm(dim=0)
    a = blk.attn
    w = a.qkv.weight
    qk = (w[: a.attn_dim].norm(dim=1) * w[a.attn_dim : 2 * a.attn_dim].norm(dim=1)).reshape(a.num_heads, a.head_dim)
    return ChannelImportance(residual.float(), hidden.float(), qk.float())


@torch.no_grad()
def activation_stats(model: nn.Module, batches: Iterable[torch.Tensor]) -> list[BlockStats]:
    """Pass ``batches`` of preprocessed images through the dense ``model`` (eval mode) and measure,
    per block, the activations every importance score and protection rule reads (:class:`BlockStats`)."""
    check_supported(model)
    keys = ("n", "x2", "xmax", "h2", "y2", "hid", "hid2", "q2", "k2")
    acc = [dict.fromkeys(keys, 0.0) for _ in model.blocks]

    def norm2_hook(i: int):
        def hook(mod, inp, out):
            x = inp[0].flatten(0, -2).float()
            acc[i]["n"] += x.shape[0]
            acc[i]["x2"] = acc[i]["x2"] + (x * x).sum(0)
            acc[i]["xmax"] = torch.maximum(torch.as_tensor(acc[i]["xmax"]), x.abs().amax(0))
            h = out.flatten(0, -2).float()
            acc[i]["h2"] = acc[i]["h2"] + (h * h).sum(0)

        return hook

    def mlp_hook(i: int, blk: nn.Module):
        def hook(mod, inp, out):
            y = blk.ls2(out).flatten(0, -2).float()
            acc[i]["y2"] = acc[i]["y2"] + (y * y).sum(0)

        return hook

    def fc2_hook(i: int):
        def hook(mod, inp):
            h = inp[0].flatten(0, -2).float()
            acc[i]["hid"] = acc[i]["hid"] + h.sum(0)
            acc[i]["hid2"] = acc[i]["hid2"] + (h * h).sum(0)

        return hook

    def qkv_hook(i: int, a: NCAttention):
        def hook(mod, inp, out):
            o = out.flatten(0, -2).float()
            q, k = o[:, : a.attn_dim], o[:, a.attn_dim : 2 * a.attn_dim]
            acc[i]["q2"] = acc[i]["q2"] + (q * q).sum(0)
            acc[i]["k2"] = acc[i]["k2"] + (k * k).sum(0)

        return hook

    handles = []
    for i, blk in enumerate(model.blocks):
        handles += [
            blk.norm2.register_forward_hook(norm2_hook(i)),
            blk.mlp.register_forward_hook(mlp_hook(i, blk)),
            blk.mlp.fc2.register_forward_pre_hook(fc2_hook(i)),
            blk.attn.qkv.register_forward_hook(qkv_hook(i, blk.attn)),
        ]
    was_training = model.training
    model.eval()
    try:
        for x in batches:
            model(x)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    if not acc[0]["n"]:
        raise NascompressError("activation importance needs at least one batch of images")
    out = []
    for blk, a in zip(model.blocks, acc):
        n = a["n"]
        inp = (a["h2"] / n).sqrt() * blk.mlp.fc1.weight.detach().float().norm(dim=0)
        outp = (a["y2"] / n).sqrt()
        residual = inp / inp.sum().clamp_min(1e-12) + outp / outp.sum().clamp_min(1e-12)
        hidden_rms = (a["hid2"] / n).sqrt()
        hidden = hidden_rms * blk.mlp.fc2.weight.detach().float().norm(dim=0)
        att = blk.attn
        qk = ((a["q2"] / n).sqrt() * (a["k2"] / n).sqrt()).reshape(att.num_heads, att.head_dim)
        out.append(
            BlockStats(
                ChannelImportance(residual, hidden, qk),
                residual_rms=(a["x2"] / n).sqrt(),
                residual_absmax=a["xmax"],
                hidden_mean=a["hid"] / n,
                hidden_rms=hidden_rms,
                tokens=int(n),
            )
        )
    return out


def activation_importance(model: nn.Module, batches: Iterable[torch.Tensor]) -> list[ChannelImportance]:
    """Data-driven importance of every block's channels (see the module docstring), measured on
    ``batches`` of preprocessed images through the dense ``model``."""
    return [s.importance for s in activation_stats(model, batches)]


__all__ = [
    "ChannelImportance",
    "BlockStats",
    "spread",
    "channel_importance",
    "activation_stats",
    "activation_importance",
]
