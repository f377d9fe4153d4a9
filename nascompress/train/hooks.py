"""The hook interface between the one training loop (:func:`nascompress.train.run.fit`) and a
method's recipe, plus the optimizer parameter groups every recipe shares.

This module imports only torch and the runtime's settings (:mod:`nascompress.runtime`): method modules
define their recipes against it without importing the training engine, so loading a saved model never
pulls in training code.
"""

from __future__ import annotations

import math

import re
from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ..runtime import adamw

_BLOCK = re.compile(r"^(?:.*\.)?blocks\.(\d+)\.")
_EMBED = ("cls_token", "pos_embed", "reg_token", "dist_token", "patch_embed.")
NO_DECAY_SUFFIXES = ("cls_token", "pos_embed", "reg_token", "dist_token")


def layer_id(name: str, num_layers: int) -> int:
    """timm's layer-decay convention: embeddings 0, ``blocks.i`` i + 1, the rest (norm, head) L + 1."""
    if name.startswith(_EMBED):
        return 0
    m = _BLOCK.match(name)
    if m is not None:
        return int(m.group(1)) + 1
    return num_layers + 1


def param_groups(
    model: nn.Module,
    *,
    weight_decay: float,
    layer_decay: float | None = None,
    is_new: Callable[[str], bool] | None = None,
    scale: Callable[[str], float] | None = None,
) -> list[dict[str, Any]]:
    """AdamW parameter groups: no weight decay on biases, norms, tokens and position embeddings;
    with ``layer_decay`` (timm's convention) block i's lr is scaled by ``decay ** (L + 1 - (i + 1))``.

    Args:
        is_new: names of a method's new, randomly initialised parameters: trained at the full lr
            (no layer decay, no ``scale``).
        scale: a multiplier on every other parameter's lr (e.g. DynamicViT's backbone at 0.01).
    Returns:
        groups with ``params``, ``weight_decay`` and ``lr_scale`` (read by :func:`~nascompress.train.run.fit`).
    """
    n_layers = len(getattr(model, "blocks", []))
    groups: dict[tuple[float, float], list[nn.Parameter]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        wd = 0.0 if p.ndim <= 1 or name.endswith(NO_DECAY_SUFFIXES) else weight_decay
        if is_new is not None and is_new(name):
            lr_scale = 1.0
        else:
            lr_scale = 1.0
            if layer_decay is not None and layer_decay != 1.0:
                lr_scale = layer_decay ** (n_layers + 1 - layer_id(name, n_layers))
            if scale is not None:
                lr_scale *= scale(name)
        groups.setdefault((wd, lr_scale), []).append(p)
    return [{"params": ps, "weight_decay": wd, "lr_scale": s} for (wd, s), ps in groups.items()]


def own_group(groups: list[dict[str, Any]], params: list[nn.Parameter], **options: Any) -> list[dict[str, Any]]:
    """``groups`` with ``params`` moved into a group of their own (e.g. a predictor's lr and decay)."""
    ids = {id(p) for p in params}
    rest = [dict(g, params=[p for p in g["params"] if id(p) not in ids]) for g in groups]
    return [g for g in rest if g["params"]] + [dict(options, params=list(params))]


Batch = tuple[torch.Tensor, torch.Tensor, Any]


def as_floats(logs: dict[str, Any]) -> dict[str, float]:
    """Log values (floats, or 0-d tensors on any device) as floats: the tensors are read back in
    one host sync, the one place a training loop waits for the device to log."""
    keys = [k for k, v in logs.items() if torch.is_tensor(v)]
    out = {k: float(v) for k, v in logs.items() if not torch.is_tensor(v)}
    if keys:
        dev = logs[keys[0]].device
        vals = torch.stack([logs[k].detach().float().reshape(()).to(dev) for k in keys]).tolist()
        out.update(zip(keys, vals))
    return {k: out[k] for k in logs}


class TrainHooks:
    """A recipe's plug-ins for :func:`~nascompress.train.run.fit`. The defaults train with cross-entropy.

    ``fit`` calls, per run: :meth:`param_groups`; per epoch: :meth:`on_epoch_start`, then for each
    item of :meth:`batches` :meth:`prepare_step`, :meth:`loss`, backward/step and :meth:`after_step`;
    then :meth:`on_epoch_end` (logged), :meth:`before_eval` (and validation), :meth:`arch` (the
    arch.json saved with the weights) and :meth:`check` (may stop the run). ``state_dict`` is
    checkpointed every epoch for ``--resume``.
    """

    steps_per_epoch: int = 0  # set by fit() before training, for per-step schedules
    new_param_markers: tuple[str, ...] = ()  # names of a method's new parameters: trained at the full lr
    # True when a step's loss may leave some trainable parameters out: under torchrun DDP then walks
    # the autograd graph every step (find_unused_parameters). Parameters frozen by requires_grad for
    # a step (prepare_step, on_epoch_start) do not count: each trainable set has its own DDP wrapper.
    unused_parameters: bool = False

    def param_groups(self, model: nn.Module, cfg: Any) -> list[dict[str, Any]]:
        markers = self.new_param_markers
        return param_groups(
            model,
            weight_decay=cfg.weight_decay,
            layer_decay=cfg.layer_decay,
            is_new=lambda name: any(m in name for m in markers),
        )

    def batches(self, data: Any, *, epoch: int, loader: Callable[..., Iterable]) -> tuple[Iterable[Batch], int]:
        """The epoch's training batches as ``(images, labels, tag)`` and their count.

        ``loader(dataset, stream=0)`` returns the epoch's shuffled loader over ``dataset``
        (``stream`` selects an independent order for a second dataset)."""
        it = loader(data.train)
        return ((imgs, labels, None) for imgs, labels in it), len(it)

    def prepare_step(self, model: nn.Module, tag: Any) -> None:
        """Before a step's forward (e.g. choose which parameters this step differentiates)."""

    def loss(
        self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, epoch: int, cfg: Any, tag: Any = None
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """The step's loss and its logs: floats or detached 0-d tensors (left on the device: ``fit``
        reads them back once per epoch, :func:`as_floats`; never call ``.item()`` here)."""
        logits = model(x)
        loss = F.cross_entropy(logits, y, label_smoothing=cfg.label_smoothing)
        return loss, {"ce": loss.detach()}

    def after_step(self, model: nn.Module, tag: Any) -> None:
        """After the optimizer step (e.g. steer a Lagrange multiplier)."""

    def on_epoch_start(self, model: nn.Module, *, epoch: int) -> None:
        """Before each epoch (temperature or keep-rate schedules)."""

    def on_epoch_end(self, model: nn.Module, *, epoch: int) -> dict[str, Any]:
        """After each epoch's training steps; the returned values go into the log."""
        return {}

    def before_eval(self, model: nn.Module) -> None:
        """Put the model at the settings it is evaluated and saved with (e.g. the target keep rate)."""

    def arch(self, model: nn.Module, arch: dict[str, Any]) -> dict[str, Any]:
        """The arch.json saved beside the current weights (a search records its current choice)."""
        return arch

    def check(self, record: dict[str, Any], start: dict[str, Any] | None) -> None:
        """Stop the run by raising NascompressError (e.g. a search that collapsed); ``start`` is the
        epoch-0 record of the starting model."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def short_stage(
    model: nn.Module,
    params: list[nn.Parameter],
    batches: Iterable[tuple[torch.Tensor, ...]],
    loss_fn: Callable[..., tuple[torch.Tensor, dict[str, Any]]],
    *,
    steps: int,
    lr: float,
    decay: bool = False,
) -> dict[str, float]:
    """A short stage that trains only ``params`` (a method's new predictors; the caller freezes the
    rest): ``steps`` AdamW steps (linear warm-up over the first tenth; with ``decay`` then a cosine to 0)
    of ``loss_fn(x, y, *rest)`` over ``batches`` of ``(x, y, *rest)`` (cycled). Returns the mean logs
    of the last 10 steps and ``steps``, the optimizer steps taken; the model is left in eval mode.

    A loss the parameters take no part in (a method configured to keep everything, e.g. DynamicViT
    at rho 1: no predictor runs) trains nothing: the stage stops after its first step."""
    if not params or steps <= 0:
        return {}
    opt = adamw(params, params[0].device, lr=lr, weight_decay=0.0)
    model.train()
    tail: list[dict[str, float]] = []
    taken = 0
    try:
        it = iter(batches)
        for step in range(steps):
            try:
                x, y, *rest = next(it)
            except StopIteration:
                it = iter(batches)
                x, y, *rest = next(it)
            warm = max(1, steps // 10)
            scale = min(1.0, (step + 1) / warm)
            if decay and step >= warm:
                scale = 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, steps - warm)))
            for g in opt.param_groups:
                g["lr"] = lr * scale
            loss, logs = loss_fn(x, y, *rest)
            tail = (tail + [logs])[-10:]
            if not loss.requires_grad:
                break
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            taken += 1
    finally:
        model.eval()
    if not tail:
        return {}
    sums = {k: sum(d[k] for d in tail) for k in tail[0]}  # device tensors: one host sync below
    return {**{k: v / len(tail) for k, v in as_floats(sums).items()}, "steps": taken}


def kl_to_teacher(logits: torch.Tensor, teacher_logits: torch.Tensor, *, tau: float = 1.0) -> torch.Tensor:
    """``tau^2 KL(teacher || student)`` on softmax(logits / tau), averaged over the batch. (B, K), (B, K)."""
    return (
        F.kl_div(
            F.log_softmax(logits / tau, -1),
            F.log_softmax(teacher_logits / tau, -1),
            reduction="batchmean",
            log_target=True,
        )
        * tau
        * tau
    )


def features_and_logits(model: nn.Module, teacher: nn.Module, x: torch.Tensor):
    """Student tokens and logits (with grad) and the teacher's (without): the distillation inputs.

    Returns (feats (B, N, C), logits (B, K), teacher_feats (B, N_t, C_t), teacher_logits (B, K)).
    """
    feats = model.forward_features(x)
    logits = model.forward_head(feats)
    with torch.no_grad():
        t_feats = teacher.forward_features(x)
        t_logits = teacher.forward_head(t_feats)
    return feats, logits, t_feats, t_logits


__all__ = [
    "TrainHooks",
    "as_floats",
    "param_groups",
    "own_group",
    "short_stage",
    "layer_id",
    "kl_to_teacher",
    "features_and_logits",
]
