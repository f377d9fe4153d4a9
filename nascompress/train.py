"""The shared training engine (dense training, and every method's fine-tune/retrain).

:func:`fit` runs AdamW with linear warm-up + cosine decay, optional EMA, a checkpoint every
epoch (``checkpoint.safetensors``, no pickle) and exact ``resume``: the data order depends only on
(seed, epoch), so a resumed run replays what an uninterrupted one would have. Method-specific
work (extra losses, schedules, per-epoch statistics) plugs in through :class:`TrainHooks`.
:func:`train` is the ``nascompress train`` job: build a timm ViT, train it densely, save it.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .data import DataBundle, DataConfig, InputSpec, default_norm, load_data, make_loader, preprocess
from .errors import NascompressError
from .evaluate import evaluate
from .io import ARCH_FILE, MODEL_FILE, load_state, load_with_arch, make_arch, save_model, save_state
from .models import ModelSpec, build_model, input_size, load_pretrained
from .progress import make_progress
from .utils import (append_jsonl, create_out_dir, prepare_out_dir, recorded_job, resolve_device, seed_everything,
                    write_json)

CHECKPOINT_FILE = "checkpoint.safetensors"
LAST_FILE = "last.safetensors"
LOG_FILE = "log.jsonl"


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation settings shared by every training job.

    Args:
        epochs: passes over the training split.
        batch_size: images per step.
        lr: peak AdamW learning rate (after warm-up); ``min_lr`` is the end of the cosine.
        warmup_epochs: linear warm-up length, in epochs (may be fractional).
        weight_decay: AdamW decay (not applied to biases, norms, tokens, position embeddings).
        label_smoothing: cross-entropy label smoothing.
        ema_decay: keep an exponential moving average of the weights and evaluate/save it.
        grad_clip: max gradient norm (0 disables).
        seed: drives init, data order and every random draw.
        device: ``auto``, ``cpu`` or ``cuda[:N]``.
    """

    epochs: int = 5
    batch_size: int = 128
    lr: float = 1e-3
    min_lr: float = 1e-5
    warmup_epochs: float = 1.0
    weight_decay: float = 0.05
    label_smoothing: float = 0.1
    ema_decay: float | None = None
    grad_clip: float = 1.0
    eval_batch_size: int = 256
    seed: int = 0
    device: str = "auto"

    def __post_init__(self) -> None:
        if self.epochs < 1:
            raise NascompressError(f"--epochs must be at least 1, got {self.epochs}")
        if self.batch_size < 1:
            raise NascompressError(f"--batch-size must be at least 1, got {self.batch_size}")
        if not self.lr > 0:
            raise NascompressError(f"--lr must be positive, got {self.lr}")
        if self.ema_decay is not None and not 0 < self.ema_decay < 1:
            raise NascompressError(f"--ema-decay must be in (0, 1), got {self.ema_decay}")
        if not 0 <= self.label_smoothing < 1:
            raise NascompressError(f"--label-smoothing must be in [0, 1), got {self.label_smoothing}")


class TrainHooks:
    """Override to plug a method's training recipe into :func:`fit`. The defaults train densely."""

    steps_per_epoch: int = 0  # set by fit() before training, for per-step schedules

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, epoch: int, cfg: TrainConfig) -> tuple[torch.Tensor, dict[str, float]]:
        logits = model(x)
        loss = F.cross_entropy(logits, y, label_smoothing=cfg.label_smoothing)
        return loss, {"ce": loss.item()}

    def param_groups(self, model: nn.Module, cfg: TrainConfig) -> list[dict[str, Any]]:
        return decay_groups(model, cfg.weight_decay)

    def on_epoch_start(self, model: nn.Module, *, epoch: int) -> None:
        """Called before each epoch (temperature or keep-rate schedules)."""

    def on_epoch_end(self, model: nn.Module, *, epoch: int) -> dict[str, Any]:
        """Called after each epoch's training steps; returned values go into the log."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: no decay on biases, norm weights, tokens and position embeddings."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim <= 1 or name.endswith(("cls_token", "pos_embed", "reg_token")) else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def lr_at(step: int, *, total: int, warmup: int, lr: float, min_lr: float) -> float:
    """Linear warm-up to ``lr`` over ``warmup`` steps, then cosine down to ``min_lr``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * min(1.0, t)))


class Ema:
    """Exponential moving average of a model's state (floating tensors only)."""

    def __init__(self, model: nn.Module, decay: float):
        self.decay = decay
        self.state = {k: v.detach().clone() for k, v in model.state_dict().items()}

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        for k, v in model.state_dict().items():
            if v.dtype.is_floating_point:
                self.state[k].lerp_(v.detach(), 1 - self.decay)
            else:
                self.state[k].copy_(v)

    def swapped_into(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Load the EMA weights into model; return the live weights to restore afterwards."""
        live = {k: v.detach().clone() for k, v in model.state_dict().items()}
        model.load_state_dict(self.state)
        return live


def fit(model: nn.Module, *, data: DataBundle, input_spec: InputSpec, cfg: TrainConfig, out_dir: Path,
        arch: dict[str, Any], hooks: TrainHooks | None = None, resume: bool = False) -> dict[str, Any]:
    """Train ``model`` on ``data.train``, validate on ``data.val`` each epoch, save into ``out_dir``.

    Writes ``model.safetensors`` (best validation top-1), ``last.safetensors``, ``arch.json``,
    ``checkpoint.safetensors`` (for resume), ``log.jsonl`` (one line per epoch) and
    ``metrics.json`` (best val, and test top-1 of the best model). Returns the metrics.
    """
    hooks = hooks or TrainHooks()
    device = resolve_device(cfg.device)
    seed_everything(cfg.seed)
    model.to(device)
    opt = torch.optim.AdamW(hooks.param_groups(model, cfg), lr=cfg.lr, betas=(0.9, 0.999))
    ema = Ema(model, cfg.ema_decay) if cfg.ema_decay else None
    steps_per_epoch = math.ceil(len(data.train) / cfg.batch_size)
    hooks.steps_per_epoch = steps_per_epoch
    total_steps, warmup_steps = cfg.epochs * steps_per_epoch, int(cfg.warmup_epochs * steps_per_epoch)
    start_epoch, best, train_time = 0, -1.0, 0.0
    ckpt_path, log_path = out_dir / CHECKPOINT_FILE, out_dir / LOG_FILE
    if resume and ckpt_path.exists():
        st = load_state(ckpt_path)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["optimizer"])
        if ema is not None and st.get("ema") is not None:
            ema.state = {k: v.to(device) for k, v in st["ema"].items()}
        hooks.load_state_dict(st.get("hooks", {}))
        torch.set_rng_state(st["rng"])
        start_epoch, best, train_time = st["epoch"] + 1, st["best"], st["train_time"]
        if log_path.exists():  # drop log lines of an epoch that was interrupted
            lines = [ln for ln in log_path.read_text().splitlines() if ln and int(json.loads(ln)["epoch"]) < start_epoch]
            log_path.write_text("".join(ln + "\n" for ln in lines))
    elif log_path.exists():
        log_path.unlink()

    with make_progress() as progress:
        ep_task = progress.add_task("epochs", total=cfg.epochs, completed=start_epoch, info="")
        for epoch in range(start_epoch, cfg.epochs):
            hooks.on_epoch_start(model, epoch=epoch)
            model.train()
            loader = make_loader(data.train, batch_size=cfg.batch_size, shuffle=True, seed=cfg.seed, epoch=epoch)
            task = progress.add_task(f"epoch {epoch + 1}", total=len(loader), info="")
            t0, sums, n = time.perf_counter(), {}, 0
            for i, (imgs, labels) in enumerate(loader):
                lr = lr_at(epoch * steps_per_epoch + i, total=total_steps, warmup=warmup_steps, lr=cfg.lr, min_lr=cfg.min_lr)
                for g in opt.param_groups:
                    g["lr"] = lr * g.get("lr_scale", 1.0)
                x, y = preprocess(imgs, input_spec).to(device), labels.to(device)
                loss, logs = hooks.loss(model, x, y, epoch=epoch, cfg=cfg)
                if not torch.isfinite(loss):
                    raise NascompressError(f"loss became {loss.item()} at epoch {epoch + 1} step {i}; lower --lr")
                opt.zero_grad(set_to_none=True)
                loss.backward()
                if cfg.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                opt.step()
                if ema is not None:
                    ema.update(model)
                for k, v in logs.items():
                    sums[k] = sums.get(k, 0.0) + v
                n += 1
                progress.update(task, advance=1, info=f"loss {loss.item():.3f} lr {lr:.2e}")
            epoch_time = time.perf_counter() - t0
            train_time += epoch_time
            progress.remove_task(task)
            record: dict[str, Any] = {"epoch": epoch, "lr": lr, "epoch_time_s": epoch_time}
            record.update({f"train_{k}": v / max(n, 1) for k, v in sums.items()})
            record.update(hooks.on_epoch_end(model, epoch=epoch))
            live = ema.swapped_into(model) if ema is not None else None
            val = evaluate(model, data.val, input_spec=input_spec, device=device, batch_size=cfg.eval_batch_size)
            record.update(val_top1=val["top1"], val_loss=val["loss"])
            save_model(out_dir, model, arch, filename=LAST_FILE)
            if val["top1"] > best:
                best = val["top1"]
                save_model(out_dir, model, arch)
            if live is not None:
                model.load_state_dict(live)
            save_state(ckpt_path, {"model": model.state_dict(), "optimizer": opt.state_dict(),
                                   "ema": ema.state if ema else None, "hooks": hooks.state_dict(),
                                   "rng": torch.get_rng_state(), "epoch": epoch, "best": best,
                                   "train_time": train_time})
            append_jsonl(log_path, record)
            progress.update(ep_task, advance=1, info=f"val {val['top1']:.2f}% best {best:.2f}%")

    best_model, _ = load_with_arch(out_dir, map_location=device)
    test = evaluate(best_model, data.test, input_spec=input_spec, device=device, batch_size=cfg.eval_batch_size)
    metrics = {"best_val_top1": best, "test_top1": test["top1"], "test_loss": test["loss"], "test_n": test["n"],
               "epochs": cfg.epochs, "train_time_s": train_time, "dataset": data.name}
    write_json(out_dir / "metrics.json", metrics)
    return metrics


@dataclass(frozen=True)
class TrainJob:
    """Everything ``nascompress train`` needs. Written to ``config.json`` in the run directory."""

    model: ModelSpec
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    out: str = "runs/base"
    weights: str | None = None
    reset_head: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model.to_dict(), "data": asdict(self.data), "train": asdict(self.train),
                "out": self.out, "weights": self.weights, "reset_head": self.reset_head}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainJob":
        return cls(model=ModelSpec.from_dict(d["model"]), data=DataConfig(**d["data"]), train=TrainConfig(**d["train"]),
                   out=d["out"], weights=d.get("weights"), reset_head=d.get("reset_head", False))


def input_spec_for(model: nn.Module, dataset: str) -> InputSpec:
    c, h, w = input_size(model)
    mean, std = default_norm(dataset, c)
    return InputSpec((h, w), c, mean, std)


def check_classes(num_model_classes: int, data: DataBundle) -> None:
    if num_model_classes != data.num_classes:
        raise NascompressError(f"the model has {num_model_classes} classes but dataset {data.name} has "
                               f"{data.num_classes}; set --num-classes {data.num_classes}")


def train(job: TrainJob, *, force: bool = False, resume: bool = False) -> dict[str, Any]:
    """The ``nascompress train`` job: validate everything, then create the run and fit it.

    With ``resume`` the job stored in ``OUT/config.json`` is continued from its last checkpoint.
    """
    out = Path(job.out)
    if resume:
        job = recorded_job(out, TrainJob, "nascompress train")
    prepare_out_dir(out, force=force, resume=resume)
    seed_everything(job.train.seed)  # the seed drives the initialisation too
    model = build_model(job.model)
    if job.weights:
        load_pretrained(model, job.weights, reset_head=job.reset_head)
    data = load_data(job.data, img_size=input_size(model)[1:])
    check_classes(model.num_classes, data)
    spec = input_spec_for(model, job.data.dataset)
    arch = make_arch(job.model, input_spec=spec.to_dict())
    create_out_dir(out, force=force, resume=resume)
    write_json(out / "config.json", job.to_dict())
    if not (out / ARCH_FILE).exists():
        write_json(out / ARCH_FILE, arch)
    return fit(model, data=data, input_spec=spec, cfg=job.train, out_dir=out, arch=arch, resume=resume)


__all__ = ["TrainConfig", "TrainHooks", "TrainJob", "fit", "train", "decay_groups", "lr_at", "MODEL_FILE"]
