"""The one training engine (dense training, and every method's fine-tune, retrain and search).

:func:`fit` runs AdamW with linear warm-up + cosine decay (peak lr scaled by batch size from a
base lr per 512 images, the DeiT/EViT/DynamicViT convention, unless an absolute lr is given),
optional layer-wise lr decay (timm's convention), gradient clipping, optional EMA, a checkpoint
every epoch (``checkpoint.safetensors``, no pickle) and exact ``resume``: the data order depends
only on (seed, epoch), so a resumed run replays what an uninterrupted one would have.

Never worse than the start: before training, the starting model is evaluated on the validation
split (logged as epoch 0) and saved as the first best model, so a fine-tune that only hurts
returns the model it started from. Method-specific work (losses, schedules, alternating batches,
stop checks) plugs in through :class:`~nascompress.hooks.TrainHooks`. Under ``torchrun`` it trains
data-parallel (:mod:`nascompress.distributed`: DistributedDataParallel, a shard of every epoch per
process, split evaluation, files written by rank 0 only).
:func:`train` is the ``nascompress train`` job: build a timm ViT, train it densely, save it.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from . import distributed, runtime
from .config import Config, StageSettings, check_choice, check_int, check_range, check_settings, setting
from .limits import SEED_MAX
from .data import (DataBundle, DataConfig, InputOverrides, InputSpec, Subset, default_norm, load_data, make_loader,
                   preprocess)
from .errors import NascompressError, WriteError
from .evaluate import evaluate
from .hooks import TrainHooks, as_floats, param_groups
from .io import (ARCH_FILE, MODEL_FILE, continue_advice, finish_run, load_state, load_with_arch, make_arch,
                 recorded_input, save_model,
                 save_state)
from .models import ModelSpec, build_model, input_size, load_pretrained, pretrained_data_config
from .progress import make_progress
from .utils import append_jsonl, create_out_dir, prepare_out_dir, recorded_job, seed_everything, write_json

CHECKPOINT_FILE = "checkpoint.safetensors"
LAST_FILE = "last.safetensors"
LOG_FILE = "log.jsonl"
LR_REF_BATCH = 512  # base learning rates are given per 512 images (peak lr = base_lr * batch / 512)


@dataclass(frozen=True)
class TrainConfig(Config):
    """Optimisation settings shared by every training job.

    Args:
        epochs: passes over the training split.
        batch_size: images per step (per process under torchrun: the global batch is batch_size x world).
        lr: absolute peak AdamW learning rate; None: ``base_lr * global batch / 512`` (:meth:`peak_lr_for`).
        base_lr: peak learning rate per 512 images (each job and method has its own default).
        min_lr: end of the cosine (capped at the peak lr).
        warmup_epochs: linear warm-up length, in epochs (may be fractional).
        weight_decay: AdamW decay (not applied to biases, norms, tokens, position embeddings).
        layer_decay: layer-wise lr decay (timm's convention: block i of L at decay^(L - i)); None: off.
        label_smoothing: cross-entropy label smoothing.
        ema_decay: keep an exponential moving average of the weights and evaluate/save it.
        grad_clip: max gradient norm (0 disables).
        eval_start: evaluate the starting model first (epoch 0) and keep it as a best candidate.
        keep: save the ``best`` validation epoch (the start included) or the ``last`` one.
        seed: drives init, data order and every random draw.
        device: ``auto``, ``cpu`` or ``cuda[:N]``.
        amp: ``bf16``: the forward and the loss under bfloat16 autocast (weights, gradients and the
            optimizer stay float32); ``off``: float32 (TF32 matmuls on CUDA).
        deterministic: reproducible kernels (:mod:`nascompress.runtime`): same seed, same numbers
            on one machine, also on a GPU (slower there).
        log_every: steps between two reads of the losses on the host (the progress bar, the
            non-finite loss check): the steps between them never wait for the device.
    """

    # Fields declared with setting() are the user's: options of `train`, `search dcs`, `retrain` and keys
    # of their pipeline sections (each stage offers some, with its own recipe's defaults: StageSettings
    # below and next to each stage); seed, device, amp and deterministic are the pipeline's top-level keys.
    epochs: int = setting(5, lo=1, help="Passes over the training split.")
    batch_size: int = setting(128, lo=1, help="Images per step (per process under torchrun).")
    lr: float | None = setting(None, lo=0, lo_open=True, help=(
        "Absolute peak lr; without it the peak is --base-lr x batch / 512."))
    base_lr: float = setting(4e-3, lo=0, lo_open=True, user_default=None, help="Peak lr per 512 images.")
    min_lr: float = setting(1e-5, lo=0, help="End of the cosine lr decay.")
    warmup_epochs: float = setting(1.0, lo=0, help="Linear lr warm-up, in epochs.")
    weight_decay: float = setting(0.05, lo=0, help="AdamW weight decay (not on biases, norms, tokens, positions).")
    layer_decay: float | None = setting(None, lo=0, hi=1, lo_open=True, help=(
        "Layer-wise lr decay, timm's convention (1: off)."))
    label_smoothing: float = setting(0.1, lo=0, hi=1, hi_open=True, help="Cross-entropy label smoothing.")
    ema_decay: float | None = setting(None, lo=0, hi=1, lo_open=True, hi_open=True, help=(
        "Keep an EMA of the weights (e.g. 0.999) and evaluate and save it."))
    grad_clip: float = 1.0
    eval_batch_size: int = setting(256, lo=1, help="Images per evaluation batch.")
    eval_start: bool = True
    keep: str = "best"
    seed: int = setting(0, lo=0, hi=SEED_MAX, help="One seed for init, data order and every random draw.")
    device: str = setting("auto", help="auto, cpu or cuda[:N].")
    amp: str = setting("off", choices=runtime.AMP_MODES, help=(
        "Mixed precision: off or bf16 (autocast; weights and optimizer stay fp32)."))
    deterministic: bool = setting(False, help=(
        "Deterministic kernels: same seed, same numbers, also on a GPU (slower there)."))
    log_every: int = 50

    def __post_init__(self) -> None:
        check_settings(self)  # every setting() against its declaration; below: the internal fields
        check_range("grad_clip", self.grad_clip, 0)
        check_choice("keep", self.keep, ("best", "last"))
        check_int("log_every", self.log_every, 1)

    @property
    def peak_lr(self) -> float:
        """The peak lr of one process (:meth:`peak_lr_for` with ``world_size=1``)."""
        return self.peak_lr_for(world_size=1)

    def peak_lr_for(self, *, world_size: int) -> float:
        """The peak lr when ``world_size`` processes each take ``batch_size`` images per step: the
        base lr scales with the global batch ``batch_size x world_size``; an absolute ``lr`` is kept."""
        return self.lr if self.lr is not None else self.base_lr * self.batch_size * world_size / LR_REF_BATCH


def recipe_config(recipe: Mapping[str, Any], **given: Any) -> TrainConfig:
    """A stage's TrainConfig: its ``recipe`` (the stage's defaults) with every value ``given`` that
    is not None. A base_lr given without an lr replaces a recipe's absolute lr (the peak then scales
    with the batch); layer_decay 1 is no decay (None)."""
    d = dict(recipe)
    d.update({k: v for k, v in given.items() if v is not None})
    if given.get("base_lr") is not None and given.get("lr") is None:
        d.pop("lr", None)
    if d.get("layer_decay") == 1:
        d["layer_decay"] = None
    return TrainConfig.from_dict(d)


# `nascompress train`'s recipes (the command and the pipeline's base.train, through train_recipe):
# from scratch, and fine-tuning pretrained weights (the DeiT/EViT fine-tuning base lr, layer decay,
# a short warm-up)
SCRATCH_TRAIN_DEFAULTS: dict[str, Any] = {"epochs": 8, "batch_size": 128, "lr": 1e-3, "min_lr": 1e-5,
                                          "warmup_epochs": 1.0, "weight_decay": 0.05, "label_smoothing": 0.1}
FINE_TUNE_TRAIN_DEFAULTS: dict[str, Any] = {**{k: v for k, v in SCRATCH_TRAIN_DEFAULTS.items() if k != "lr"},
                                            "base_lr": 5e-4, "layer_decay": 0.75, "warmup_epochs": 0.2}


def train_recipe(*, fine_tune: bool, **given: Any) -> TrainConfig:
    """``nascompress train``'s TrainConfig: the fine-tuning recipe for a pretrained start
    (``fine_tune``), else the one from scratch, with the values ``given`` (None: the recipe's)."""
    return recipe_config(FINE_TUNE_TRAIN_DEFAULTS if fine_tune else SCRATCH_TRAIN_DEFAULTS, **given)


def _same_in_both(name: str) -> Any:
    scratch, tune = SCRATCH_TRAIN_DEFAULTS.get(name), FINE_TUNE_TRAIN_DEFAULTS.get(name)
    return scratch if scratch == tune else None


# The training settings `nascompress train` and base.train offer; None: the recipe's (train_recipe)
TRAIN_SETTINGS = StageSettings(
    TrainConfig, ("epochs", "batch_size", "lr", "base_lr", "layer_decay", "min_lr", "warmup_epochs", "weight_decay",
                  "label_smoothing", "ema_decay"),
    defaults={k: _same_in_both(k) for k in ("epochs", "batch_size", "min_lr", "warmup_epochs", "weight_decay",
                                            "label_smoothing")},
    notes={"lr": f"From scratch the default is {SCRATCH_TRAIN_DEFAULTS['lr']:g} (unless --base-lr is given).",
           "base_lr": f"Default with --weights: {FINE_TUNE_TRAIN_DEFAULTS['base_lr']:g} "
                      "(the DeiT/EViT fine-tuning base).",
           "layer_decay": f"Default with --weights: {FINE_TUNE_TRAIN_DEFAULTS['layer_decay']:g}; from scratch: off.",
           "warmup_epochs": f"Default: {SCRATCH_TRAIN_DEFAULTS['warmup_epochs']:g} from scratch, "
                            f"{FINE_TUNE_TRAIN_DEFAULTS['warmup_epochs']:g} with --weights."})
# Every training job's run settings (options of each training command; the pipeline's top-level keys)
RUNTIME_SETTINGS = StageSettings(TrainConfig, ("seed", "device", "amp", "deterministic"))


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


def _read_log(path: Path, *, upto: int) -> list[str]:
    """The log lines of epochs <= ``upto`` (lines of an interrupted epoch are dropped)."""
    if not path.exists():
        return []
    return [ln for ln in path.read_text().splitlines() if ln and int(json.loads(ln)["epoch"]) <= upto]


def _evaluate(model: nn.Module, ds, *, input_spec: InputSpec, device: torch.device, batch_size: int,
              amp: str = "off") -> dict[str, Any]:
    """:func:`evaluate` over ``ds``; under torchrun each rank evaluates its part and the counts are
    summed, so every rank gets the same numbers."""
    if distributed.world().size == 1:
        return evaluate(model, ds, input_spec=input_spec, device=device, batch_size=batch_size, amp=amp)
    mine = evaluate(model, Subset(ds, distributed.part(len(ds))), input_spec=input_spec, device=device,
                    batch_size=batch_size, amp=amp)
    correct, loss, n = distributed.all_sum([round(mine["top1"] * mine["n"] / 100), mine["loss"] * mine["n"], mine["n"]])
    return {"top1": 100.0 * correct / max(n, 1), "loss": loss / max(n, 1), "n": int(n)}


def fit(model: nn.Module, *, data: DataBundle, input_spec: InputSpec, cfg: TrainConfig, out_dir: Path | None = None,
        arch: dict[str, Any] | None = None, hooks: TrainHooks | None = None, resume: bool = False,
        finish: bool = True, log: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Train ``model`` on ``data.train``, validate on ``data.val`` each epoch, save into ``out_dir``.

    Without ``out_dir`` nothing is written: the run stays in memory and ``model`` ends holding the
    weights a run directory would have saved as ``model.safetensors`` (the best validation epoch,
    or the last with ``cfg.keep="last"``). ``log``, when given, receives every epoch's record
    (epoch 0, the start, first; after a resume the recorded epochs too), as ``log.jsonl`` holds them.

    With ``out_dir``, writes ``model.safetensors`` (the best validation epoch, the starting model included, or the
    last with ``cfg.keep="last"``), ``last.safetensors``, ``arch.json``, ``checkpoint.safetensors``
    (for resume), ``log.jsonl`` (epoch 0 = the start, then one line per epoch) and, last, with
    ``finish``, ``metrics.json`` (validation and test top-1 of the saved model, and of the start):
    the run's completion mark (:func:`~nascompress.io.finish_run`; a caller that adds its own
    metrics passes ``finish=False`` and marks the run itself). Returns the metrics.
    """
    if out_dir is None and resume:
        raise ValueError("resume needs the run directory (out_dir)")
    runtime.prepare_deterministic(cfg.deterministic)
    device = distributed.init(cfg.device)
    store = _RunStore(out_dir, log)
    try:
        with runtime.configured(device, deterministic=cfg.deterministic):
            return _fit(model, device=device, data=data, input_spec=input_spec, cfg=cfg, store=store, arch=arch or {},
                        hooks=hooks or TrainHooks(), resume=resume, finish=finish)
    except WriteError as e:  # a full disk mid-run: say how this run continues (a plain rerun refuses its folder)
        if out_dir is None:
            raise
        raise e.instead(continue_advice(out_dir)) from e


class _RunStore:
    """Where a training run keeps its saved model, its log and its checkpoint: a run directory
    (rank 0 writes it) or, without one, memory (the saved weights as a copy of the state)."""

    def __init__(self, out_dir: Path | None, log: list[dict[str, Any]] | None):
        self.dir, self.main = out_dir, distributed.is_main()
        self.log = log if log is not None else []
        self.saved: dict[str, torch.Tensor] | None = None  # in memory: the weights model.safetensors would hold

    def start(self, *, resume_from: int | None) -> None:
        """A fresh log, or after a resume the records of the epochs up to ``resume_from``."""
        self.log.clear()
        if self.dir is None or not self.main:
            return
        path = self.dir / LOG_FILE
        if resume_from is None:
            if path.exists():
                path.unlink()
            return
        for tmp in self.dir.glob(".*.tmp"):  # atomic writes (utils.atomic_path) of a killed run
            tmp.unlink()
        lines = _read_log(path, upto=resume_from)
        path.write_text("".join(ln + "\n" for ln in lines))
        self.log.extend(json.loads(ln) for ln in lines)

    def record(self, rec: dict[str, Any]) -> None:
        self.log.append(rec)
        if self.dir is not None and self.main:
            append_jsonl(self.dir / LOG_FILE, rec)

    def save(self, model: nn.Module, arch: dict[str, Any], *, last: bool = False) -> None:
        if self.dir is None:
            if not last:
                self.saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
        elif self.main:
            save_model(self.dir, model, arch, **({"filename": LAST_FILE} if last else {}))

    def checkpoint(self, state: dict[str, Any]) -> None:
        if self.dir is not None and self.main:
            save_state(self.dir / CHECKPOINT_FILE, state)

    def saved_model(self, model: nn.Module, device: torch.device) -> nn.Module:
        """The saved model: read back from the directory, or ``model`` given the saved weights."""
        if self.dir is not None:
            return load_with_arch(self.dir, map_location=device, complete=False)[0]  # not marked complete yet
        if self.saved is not None:
            model.load_state_dict(self.saved)
        return model


class LossWatch:
    """The training losses of the last steps, kept on the device and read back in one host sync
    every ``every`` steps: the progress bar's loss, and the non-finite check (which names the first
    bad step; the epoch's checkpoint is written only after it passed)."""

    def __init__(self, every: int):
        self.every = every
        self.pending: list[tuple[int, torch.Tensor]] = []

    def add(self, step: int, loss: torch.Tensor) -> bool:
        """Keep ``loss``; True when a read is due."""
        self.pending.append((step, loss.detach()))
        return len(self.pending) >= self.every

    def read(self, *, epoch: int, peak_lr: float) -> float | None:
        """The last loss (None if none is pending); stops with one line at the first non-finite one."""
        if not self.pending:
            return None
        steps, losses = zip(*self.pending)
        self.pending = []
        values = torch.stack([v.float().reshape(()) for v in losses]).tolist()
        for i, v in zip(steps, values):
            if not math.isfinite(v):
                raise NascompressError(f"loss became {v} at epoch {epoch + 1} step {i}; lower --lr "
                                       f"(the peak lr was {peak_lr:.3g})")
        return values[-1]


def _fit(model: nn.Module, *, device: torch.device, data: DataBundle, input_spec: InputSpec, cfg: TrainConfig,
         store: _RunStore, arch: dict[str, Any], hooks: TrainHooks, resume: bool, finish: bool) -> dict[str, Any]:
    world, main = distributed.world(), distributed.is_main()
    seed_everything(cfg.seed)
    model.to(device)
    distributed.broadcast_model(model)
    peak = cfg.peak_lr_for(world_size=world.size)
    min_lr = min(cfg.min_lr, peak)
    opt = torch.optim.AdamW(hooks.param_groups(model, cfg), lr=peak, betas=(0.9, 0.999))
    ema = Ema(model, cfg.ema_decay) if cfg.ema_decay else None
    # the step's forward + loss as one module, DistributedDataParallel under torchrun (checkpoints and
    # evaluation use `model` itself)
    step = distributed.DataParallel(model, hooks.loss, find_unused=hooks.unused_parameters)

    pin = device.type == "cuda"  # pinned host batches: non-blocking copies to the GPU

    def loader_for(epoch: int):
        return lambda ds, stream=0: make_loader(ds, batch_size=cfg.batch_size, shuffle=True, seed=cfg.seed + stream,
                                                epoch=epoch, shard=(world.rank, world.size), pin_memory=pin)

    steps_per_epoch = hooks.batches(data, epoch=0, loader=loader_for(0))[1]
    if steps_per_epoch == 0 and world.size > 1:
        raise NascompressError(f"the training split ({len(data.train)} images) is too small for {world.size} processes")
    hooks.steps_per_epoch = steps_per_epoch
    total_steps, warmup_steps = cfg.epochs * steps_per_epoch, int(cfg.warmup_epochs * steps_per_epoch)
    start_epoch, best, best_epoch, train_time, start_rec = 0, -1.0, -1, 0.0, None
    ckpt_path = None if store.dir is None else store.dir / CHECKPOINT_FILE

    def validate() -> dict[str, Any]:
        hooks.before_eval(model)
        return _evaluate(model, data.val, input_spec=input_spec, device=device, batch_size=cfg.eval_batch_size,
                         amp=cfg.amp)

    if resume and ckpt_path is not None and ckpt_path.exists():
        st = load_state(ckpt_path)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["optimizer"])
        if ema is not None and st.get("ema") is not None:
            ema.state = {k: v.to(device) for k, v in st["ema"].items()}
        hooks.load_state_dict(st.get("hooks", {}))
        torch.set_rng_state(st["rng"])
        runtime.restore_cuda_rng(st.get("cuda_rng"))
        start_epoch, best, best_epoch, train_time = st["epoch"] + 1, st["best"], st["best_epoch"], st["train_time"]
        start_rec = st.get("start")
        store.start(resume_from=start_epoch)
    else:
        store.start(resume_from=None)
        if cfg.eval_start:  # epoch 0: the starting model is the first candidate for the best
            val = validate()
            start_rec = {"epoch": 0, "start": True, "val_top1": val["top1"], "val_loss": val["loss"]}
            store.record(start_rec)
            if cfg.keep == "best":
                best, best_epoch = val["top1"], 0
                store.save(model, hooks.arch(model, arch))

    with make_progress(disable=None if main else True) as progress:
        ep_task = progress.add_task("epochs", total=cfg.epochs, completed=start_epoch, info="", each=True)
        for epoch in range(start_epoch, cfg.epochs):
            hooks.on_epoch_start(model, epoch=epoch)
            model.train()
            batches, n_steps = hooks.batches(data, epoch=epoch, loader=loader_for(epoch))
            task = progress.add_task(f"epoch {epoch + 1}", total=n_steps, info="")
            t0, sums, counts = time.perf_counter(), {}, {}
            watch = LossWatch(cfg.log_every)
            lr = peak
            for i, (imgs, labels, tag) in enumerate(batches):
                lr = lr_at(epoch * steps_per_epoch + i, total=total_steps, warmup=warmup_steps, lr=peak, min_lr=min_lr)
                for g in opt.param_groups:
                    if "own_lr" in g:  # a group with its own cosine (architecture logits): own_lr -> own_lr_end x own_lr
                        g["lr"] = lr_at(epoch * steps_per_epoch + i, total=total_steps, warmup=0, lr=g["own_lr"],
                                        min_lr=g["own_lr"] * g.get("own_lr_end", 1.0))
                    else:
                        g["lr"] = lr * g.get("lr_scale", 1.0)
                # the uint8 batch goes to the device as it is; resizing and normalising happen there
                x, y = preprocess(runtime.to_device(imgs, device), input_spec), runtime.to_device(labels, device)
                hooks.prepare_step(model, tag)
                with runtime.autocast(device, cfg.amp):
                    loss, logs = step(x, y, epoch=epoch, cfg=cfg, tag=tag)  # hooks.loss(model, ...), under DDP
                due = watch.add(i, loss)
                opt.zero_grad(set_to_none=True)
                loss.backward()  # under torchrun DDP averages the gradients over the ranks meanwhile
                step.check()
                if cfg.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], cfg.grad_clip)
                opt.step()
                hooks.after_step(model, tag)
                if ema is not None:
                    ema.update(model)
                for k, v in logs.items():  # floats or device tensors: read back once, at the epoch's end
                    sums[k] = sums.get(k, 0.0) + (v.detach().float() if torch.is_tensor(v) else v)
                    counts[k] = counts.get(k, 0) + 1
                last = watch.read(epoch=epoch, peak_lr=peak) if due else None
                progress.update(task, advance=1, **({} if last is None else {"info": f"loss {last:.3f} lr {lr:.2e}"}))
            watch.read(epoch=epoch, peak_lr=peak)
            epoch_time = time.perf_counter() - t0
            train_time += epoch_time
            progress.remove_task(task)
            record: dict[str, Any] = {"epoch": epoch + 1, "lr": lr, "epoch_time_s": epoch_time}
            record.update({f"train_{k}": v for k, v in distributed.merge_means(as_floats(sums), counts).items()})
            record.update(hooks.on_epoch_end(model, epoch=epoch))
            live = ema.swapped_into(model) if ema is not None else None
            val = validate()
            record.update(val_top1=val["top1"], val_loss=val["loss"])
            saved_arch = hooks.arch(model, arch)
            store.save(model, saved_arch, last=True)
            if cfg.keep == "last" or val["top1"] > best:
                best, best_epoch = val["top1"], epoch + 1
                store.save(model, saved_arch)
            if live is not None:
                model.load_state_dict(live)
            if world.size > 1:  # a debugging aid (NASCOMPRESS_CHECK_SYNC=1): every rank holds the same state
                digest = distributed.check_in_sync({"model": model.state_dict(), "optimizer": opt.state_dict(),
                                                    "hooks": hooks.state_dict()}, when=f"after epoch {epoch + 1}")
                if digest is not None:
                    record["state_digest"] = digest
            if store.dir is not None and main:
                store.checkpoint({"model": model.state_dict(), "optimizer": opt.state_dict(),
                                  "ema": ema.state if ema else None, "hooks": hooks.state_dict(),
                                  "rng": torch.get_rng_state(), "cuda_rng": runtime.cuda_rng_state(),
                                  "epoch": epoch, "best": best,
                                  "best_epoch": best_epoch, "train_time": train_time, "start": start_rec})
            store.record(record)
            progress.update(ep_task, advance=1, info=f"val {val['top1']:.2f}% best {best:.2f}%")
            hooks.check(record, start_rec)
    step.close()

    distributed.barrier()  # rank 0 has written the best model
    best_model = store.saved_model(model, device)
    test = _evaluate(best_model, data.test, input_spec=input_spec, device=device, batch_size=cfg.eval_batch_size,
                     amp=cfg.amp)
    metrics = {"best_val_top1": best, "best_epoch": best_epoch, "test_top1": test["top1"], "test_loss": test["loss"],
               "test_n": test["n"], "start_val_top1": None if start_rec is None else start_rec["val_top1"],
               "epochs": cfg.epochs, "peak_lr": peak, "train_time_s": train_time, "dataset": data.name}
    if world.size > 1:
        metrics.update(processes=world.size, global_batch_size=cfg.batch_size * world.size)
    if data.extra.get("skipped_images"):  # unreadable images left out (--skip-bad-images), per folder
        metrics["skipped_images"] = data.extra["skipped_images"]
    if main and finish and store.dir is not None:
        finish_run(store.dir, metrics)  # the last write: marks the run complete
    return metrics


@dataclass(frozen=True)
class TrainJob:
    """Everything ``nascompress train`` needs. Written to ``config.json`` in the run directory.

    Args:
        weights: local weights to start from; preprocessing then follows them (:func:`input_spec_for`).
        reset_head: a new classifier head (the file's is missing or has another class count).
        input: explicit preprocessing (``--mean/--std/--interpolation/--crop-pct``), winning over all.
        linear_probe: keep the backbone frozen and fit only a new head on its cached features
            (:mod:`nascompress.probe`); needs ``weights`` and implies ``reset_head``.
    """

    model: ModelSpec
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    out: str = "runs/base"
    weights: str | None = setting(None, path=True, help="Local .safetensors/.pth weights to start from.")
    reset_head: bool = setting(False, help=(
        "A new head: the weights' is missing (backbone only) or has another class count."))
    input: InputOverrides = field(default_factory=InputOverrides)
    linear_probe: bool = setting(False, help=(
        "Freeze the --weights backbone; fit only a new head on its cached features (logistic regression)."))

    def __post_init__(self) -> None:
        if self.linear_probe and not self.weights:
            raise NascompressError("--linear-probe needs --weights: a probe fits a head on a pretrained backbone")

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model.to_dict(), "data": asdict(self.data), "train": self.train.to_dict(),
                "out": self.out, "weights": self.weights, "reset_head": self.reset_head,
                "input": self.input.to_dict(), "linear_probe": self.linear_probe}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainJob":
        return cls(model=ModelSpec.from_dict(d["model"]), data=DataConfig(**d["data"]), train=TrainConfig.from_dict(d["train"]),
                   out=d["out"], weights=d.get("weights"), reset_head=d.get("reset_head", False),
                   input=InputOverrides.from_dict(d.get("input")), linear_probe=d.get("linear_probe", False))


def input_spec_for(model: nn.Module, dataset: str, *, weights: str | Path | None = None,
                   overrides: InputOverrides | None = None) -> InputSpec:
    """The one place that decides how images become ``model``'s input (arch.json ``input``).

    Size and channels always come from the model's own patch embedding. Normalisation,
    interpolation and crop:

    * with ``weights``: what the weights were made with: the ``input`` recorded in a nascompress
      file, else the timm model's pretrained config (``timm.data.resolve_data_config``; e.g.
      mean/std 0.5 and bicubic for augreg ``vit_small_patch16_224``, CLIP's own values for CLIP
      models, ImageNet's for DeiT and DINOv2; a ``name.tag`` selects that tag's config);
    * without (training from scratch): the dataset's (Fashion-MNIST mean/std, bilinear, the whole
      image), so such runs are unchanged;
    * ``overrides`` (explicit ``--mean/--std/--interpolation/--crop-pct``) win over both.

    Mean/std of another channel count are adapted: one value is repeated, three are averaged
    for a 1-channel model.
    """
    c, h, w = input_size(model)
    if weights is not None:
        base = dict(recorded_input(weights) or pretrained_data_config(model))
    else:
        mean, std = default_norm(dataset, c)
        base = dict(mean=mean, std=std, interpolation="bilinear", crop_pct=1.0, crop_mode="center")
    ov = overrides or InputOverrides()
    base.update({k: v for k, v in ov.to_dict().items() if v is not None})

    def chans(name: str) -> tuple[float, ...]:
        v = tuple(float(x) for x in base[name])
        if len(v) == c:
            return v
        if len(v) == 1 or c == 1:
            return (sum(v) / len(v),) * c
        raise NascompressError(f"--{name} has {len(v)} values but the model takes {c} channels")

    return InputSpec((h, w), c, chans("mean"), chans("std"), interpolation=base["interpolation"],
                     crop_pct=float(base["crop_pct"]), crop_mode=base["crop_mode"])


def check_classes(num_model_classes: int, data: DataBundle, *, fix: str | None = None) -> None:
    """Refuse a dataset whose class count is not the model's; ``fix``: the advice (default: --num-classes)."""
    if num_model_classes != data.num_classes:
        raise NascompressError(f"the model has {num_model_classes} classes but dataset {data.name} has "
                               f"{data.num_classes}; {fix or f'set --num-classes {data.num_classes}'}")


def train(job: TrainJob, *, force: bool = False, resume: bool = False, explicit: set[str] | None = None) -> dict[str, Any]:
    """The ``nascompress train`` job: validate everything, then create the run and fit it.

    With ``resume`` the job stored in ``OUT/config.json`` is continued from its last checkpoint.
    Under torchrun every process runs this; rank 0 alone writes the run directory. ``explicit``: the
    options given on the command line, each of which must agree with the recorded job on resume
    (:func:`~nascompress.utils.recorded_job`).
    """
    out = Path(job.out)
    if resume:
        job = recorded_job(out, TrainJob, "nascompress train", given=job, explicit=explicit)
    elif job.weights:  # recorded absolute: a resume from another directory finds them
        job = replace(job, weights=os.path.abspath(job.weights))
    runtime.prepare_deterministic(job.train.deterministic)
    distributed.init(job.train.device)
    if job.linear_probe and distributed.world().size > 1:
        raise NascompressError("--linear-probe runs in one process (it fits a head on cached features); run it "
                               "without torchrun")
    prepare_out_dir(out, force=force, resume=resume)
    seed_everything(job.train.seed)  # the seed drives the initialisation too
    model = build_model(job.model)
    if job.weights:
        load_pretrained(model, job.weights, reset_head=job.reset_head or job.linear_probe)
        if not job.linear_probe and not resume and distributed.is_main():  # not silently: the recipe changes
            from .progress import say

            t = job.train
            lr = f"lr {t.lr:g}" if t.lr is not None else f"base lr {t.base_lr:g} per 512 images"
            ld = "off" if t.layer_decay in (None, 1) else f"{t.layer_decay:g}"
            say(f"train: --weights given, so the fine-tuning recipe: {lr}, layer decay {ld}, {t.warmup_epochs:g} "
                "warm-up epochs (for weights that were never trained, leave out --weights)")
    spec = input_spec_for(model, job.data.dataset, weights=job.weights, overrides=job.input)
    data = load_data(job.data, spec=spec, augment=not job.linear_probe)  # a probe's features: no augmentation
    check_classes(model.num_classes, data)
    arch = make_arch(job.model, input_spec=spec.to_dict(), labels=data.classes)
    distributed.barrier()  # every rank has checked `out` before rank 0 creates it
    if distributed.is_main():
        create_out_dir(out, force=force, resume=resume)
        write_json(out / "config.json", job.to_dict())
    if job.linear_probe:  # not checkpointed: a resumed probe runs again (it is deterministic)
        from .probe import fit_linear_probe

        return fit_linear_probe(model, data=data, input_spec=spec, cfg=job.train, out_dir=out, arch=arch)
    if distributed.is_main() and not (out / ARCH_FILE).exists():
        write_json(out / ARCH_FILE, arch)
    distributed.barrier()  # the run directory is ready
    return fit(model, data=data, input_spec=spec, cfg=job.train, out_dir=out, arch=arch, resume=resume)


__all__ = ["TrainConfig", "TrainHooks", "TrainJob", "fit", "train", "lr_at", "MODEL_FILE", "LR_REF_BATCH"]
