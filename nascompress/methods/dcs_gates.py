"""DCS's gates as pure functions (:mod:`.dcs` re-exports them): the Gumbel-sigmoid sample and its
noise, the binary entropy of the gate probabilities, the aligned inference mask (:func:`aligned_mask`,
:func:`aligned_counts`: every kept width 0, full or a multiple of ``align``), and the protection of
gates fixed open (:func:`protect_gates`, :data:`PROTECT_LOGIT`)."""

from __future__ import annotations

import torch

from ..models.layers import NCBlock, aligned_width

PROTECT_LOGIT = 30.0  # a protected gate's logit: no Gumbel sample closes it (P < 1e-13), and its gradient is zeroed


def gumbel_noise(
    shape: torch.Size | tuple[int, ...], *, like: torch.Tensor, generator: torch.Generator | None = None
) -> torch.Tensor:
    """g1 - g2 with g1, g2 ~ Gumbel(0, 1) i.i.d. (a Logistic(0, 1) sample), shaped ``shape``."""
    u = torch.rand((2, *shape), generator=generator, device=like.device, dtype=like.dtype)
    g = -torch.log(-torch.log(u.clamp_min(1e-10)))
    return g[0] - g[1]


def gumbel_sigmoid(
    logits: torch.Tensor, *, tau: float, noise: bool = True, hard: bool = True, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Binary Gumbel-sigmoid mask of ``logits`` (any shape).

    soft = sigmoid((logits + g1 - g2) / tau); with ``hard`` the forward value is ``1[soft > 0.5]``
    and the gradient is that of ``soft`` (straight-through). Without ``noise`` (inference)
    the mask is ``1[logits > 0]``.

    Returns:
        (mask, soft), both shaped like ``logits``; without autograd (inference) soft is the mask.
    """
    z = logits + gumbel_noise(logits.shape, like=logits, generator=generator) if noise else logits
    if hard and not (torch.is_grad_enabled() and z.requires_grad):  # inference: no soft values needed
        mask = (z > 0).to(z.dtype)
        return mask, mask
    soft = torch.sigmoid(z / tau)
    if not hard:
        return soft, soft
    mask = (z > 0).to(soft.dtype)
    # Straight-through: forward value exactly mask (1 - soft is exact for soft >= 0.5), gradient of soft.
    return (mask - soft).detach() + soft, soft


def binary_entropy(p: torch.Tensor) -> torch.Tensor:
    """Mean binary entropy (nats) of probabilities ``p``; 0 when every p is 0 or 1."""
    p = p.clamp(1e-6, 1 - 1e-6)
    return -(p * p.log() + (1 - p) * (1 - p).log()).mean()


def aligned_counts(logits: torch.Tensor, *, align: int) -> list[int]:
    """The width each row of ``logits`` (..., n) keeps at inference: the count of positive logits,
    rounded up to the alignment (:func:`~nascompress.models.layers.aligned_width`, mode ``up``)."""
    n = logits.shape[-1]
    counts = (logits.detach() > 0).reshape(-1, n).sum(-1).tolist()
    return [aligned_width(int(c), align=align, full=n, mode="up") for c in counts]


def aligned_mask(logits: torch.Tensor, *, align: int) -> torch.Tensor:
    """The inference mask of gate ``logits`` (..., n): per row, its ``logit > 0`` channels, widened
    to the aligned count (:func:`aligned_counts`) with the next channels by logit (ties: the lower
    index). Every kept width is 0, n or a multiple of ``align``; ``align=1`` gives ``1[logit > 0]``."""
    z = logits.detach()
    if align == 1:
        return (z > 0).to(z.dtype)
    n = z.shape[-1]
    rows = z.reshape(-1, n)
    order = torch.sort(-rows, dim=-1, stable=True).indices  # channels by logit, highest first
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(n, device=z.device).expand_as(order))
    width = torch.tensor(aligned_counts(rows, align=align), device=z.device).unsqueeze(-1)
    return (rank < width).to(z.dtype).reshape(z.shape)


def protect_gates(blk: NCBlock, mask: torch.Tensor) -> None:
    """Fix the gates ``mask`` (bool, alpha's shape) of ``blk`` open: their logit is set to
    :data:`PROTECT_LOGIT` and their gradient zeroed (Adam then never moves them; the arch group has
    no weight decay). Recorded as the non-persistent buffer ``dcs_protect``."""
    mask = mask.to(device=blk.dcs_alpha.device, dtype=torch.bool)
    with torch.no_grad():
        blk.dcs_alpha[mask] = PROTECT_LOGIT
    on = {mask.device: mask}  # the model may move (a search built on the CPU, trained on CUDA): the hook follows

    def zero_protected(g: torch.Tensor) -> torch.Tensor:
        if g.device not in on:
            on[g.device] = mask.to(g.device)
        return g.masked_fill(on[g.device], 0.0)

    blk.dcs_alpha.register_hook(zero_protected)
    blk.register_buffer("dcs_protect", mask, persistent=False)
