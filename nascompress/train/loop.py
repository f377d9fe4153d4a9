"""The one training loop (dense training, and every method's fine-tune, retrain and search).

:func:`fit` runs AdamW with linear warm-up + cosine decay (peak lr scaled by batch size from a
base lr per 512 images, the DeiT/EViT/DynamicViT convention, unless an absolute lr is given),
optional layer-wise lr decay (timm's convention), gradient clipping, optional EMA, a checkpoint
every epoch (``checkpoint.safetensors``, no pickle) and exact ``resume``: the data order depends
only on (seed, epoch), so a resumed run replays what an uninterrupted one would have.

Never worse than the start: before training, the starting model is evaluated on the validation
split (logged as epoch 0) and saved as the first best model, so a fine-tune that only hurts
returns the model it started from. Method-specific work (losses, schedules, alternating batches,
stop checks) plugs in through :class:`~nascompress.train.hooks.TrainHooks`. Under ``torchrun`` it trains
data-parallel (:mod:`nascompress.train.distributed`: DistributedDataParallel, a shard of every epoch per
process, split evaluation, files written by rank 0 only). Its settings are a
:class:`~nascompress.train.config.TrainConfig` (re-exported by :mod:`nascompress.train.run`).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import distributed
from .. import runtime
from ..data import DataBundle, InputSpec, Subset, make_loader, preprocess
from ..errors import NascompressError, SettingError, WriteError
from ..profiling.evaluate import evaluate
from ..profiling.records import Evaluation
from .hooks import TrainHooks, as_floats
from ..runs.checkpoint import load_state
from ..runs.files import frozen_of
from ..runs.io import continue_advice, finish_run
from ..progress import make_progress, pipeline_left, say
from .config import TrainConfig
from .metrics import TrainMetrics
from ..runs.store import CHECKPOINT_FILE, RunStore, checked_int, checked_number, damaged_checkpoint, restore_model
from ..runtime import seed_everything


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


def _evaluate(
    model: nn.Module, ds, *, input_spec: InputSpec, device: torch.device, batch_size: int, amp: str = "off"
) -> Evaluation:
    """:func:`evaluate` over ``ds``; under torchrun each rank evaluates its part and the counts are
    summed, so every rank gets the same numbers."""
    if distributed.world().size == 1:
        return evaluate(model, ds, input_spec=input_spec, device=device, batch_size=batch_size, amp=amp)
    mine = evaluate(
        model,
        Subset(ds, distributed.part(len(ds))),
        input_spec=input_spec,
        device=device,
        batch_size=batch_size,
        amp=amp,
    )
    correct, loss, n = distributed.all_sum([round(mine.top1 * mine.n / 100), mine.loss * mine.n, mine.n])
    return Evaluation.new(top1=100.0 * correct / max(n, 1), loss=loss / max(n, 1), n=int(n))


def fit(
    model: nn.Module,
    *,
    data: DataBundle,
    input_spec: InputSpec,
    cfg: TrainConfig,
    out_dir: Path | None = None,
    arch: dict[str, Any] | None = None,
    hooks: TrainHooks | None = None,
    resume: bool = False,
    finish: bool = True,
    log: list[dict[str, Any]] | None = None,
    test: bool = True,
) -> TrainMetrics:
    """Train ``model`` on ``data.train``, validate on ``data.val`` each epoch, save into ``out_dir``.

    Without ``out_dir`` nothing is written: the run stays in memory and ``model`` ends holding the
    weights a run directory would have saved as ``model.safetensors`` (the best validation epoch,
    or the last with ``cfg.keep="last"``). ``log``, when given, receives every epoch's record
    (epoch 0, the start, first; after a resume the recorded epochs too), as ``log.jsonl`` holds them.

    With ``out_dir``, writes ``model.safetensors`` (the best validation epoch, the starting model included, or the
    last with ``cfg.keep="last"``), ``last.safetensors``, ``arch.json``, ``checkpoint.safetensors``
    (for resume), ``log.jsonl`` (epoch 0 = the start, then one line per epoch) and, last, with
    ``finish``, ``metrics.json`` (validation and test top-1 of the saved model, and of the start):
    the run's completion mark (:func:`~nascompress.runs.io.finish_run`; a caller that adds its own
    metrics passes ``finish=False`` and marks the run itself). ``test=False``: the saved model is not
    scored on the test split (a caller that scores another model in the end: the DCS search's kept
    one). Returns the metrics (:class:`~nascompress.train.metrics.TrainMetrics`: ``metrics.json``
    less its completion mark).
    """
    if out_dir is None and resume:
        raise ValueError("resume needs the run directory (out_dir)")
    runtime.prepare_deterministic(cfg.deterministic)
    runtime.keep_freed_memory()  # no page faults on every step's activations (a CPU step 1.1x faster)
    device = distributed.init(cfg.device)
    store = RunStore(out_dir, log)
    try:
        with runtime.configured(device, deterministic=cfg.deterministic), runtime.cpu_attention(model, device, cfg.amp):
            return _fit(
                model,
                device=device,
                data=data,
                input_spec=input_spec,
                cfg=cfg,
                store=store,
                arch=arch or {},
                hooks=hooks or TrainHooks(),
                resume=resume,
                finish=finish,
                test=test,
            )
    except WriteError as e:  # a full disk mid-run: say how this run continues (a plain rerun refuses its folder)
        if out_dir is None:
            raise
        raise e.instead(continue_advice(out_dir)) from e


class LossWatch:
    """The training losses of the last steps, kept on the device and read back in one host sync
    every ``every`` steps: the progress bar's loss, and the non-finite check (which names the first
    bad step, and its images when they were not finite; the epoch's checkpoint is written only after
    it passed)."""

    def __init__(self, every: int):
        self.every = every
        self.pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (step, loss, inputs finite)

    def add(self, step: int, loss: torch.Tensor, inputs: torch.Tensor | None = None) -> bool:
        """Keep ``loss`` (and whether the step's ``inputs`` were all finite); True when a read is due."""
        ok = torch.ones((), dtype=torch.bool, device=loss.device) if inputs is None else torch.isfinite(inputs).all()
        self.pending.append((step, loss.detach(), ok))
        return len(self.pending) >= self.every

    def read(self, *, epoch: int, peak_lr: float) -> float | None:
        """The last loss (None if none is pending); stops with one line at the first non-finite one."""
        if not self.pending:
            return None
        steps, losses, finite = zip(*self.pending)
        self.pending = []
        values = torch.stack([v.float().reshape(()) for v in losses]).tolist()
        inputs_ok = torch.stack(finite).tolist()
        for i, v, ok in zip(steps, values, inputs_ok):
            if not math.isfinite(v) and not ok:  # NaN/inf images (or normalisation): not the lr
                raise NascompressError(
                    f"the images of epoch {epoch + 1} step {i} hold values that are not finite (NaN or inf) "
                    "once normalised: check the data (a caller's tensors) and the normalisation's mean and std"
                )
            if not math.isfinite(v):
                raise SettingError(
                    f"loss became {v} at epoch {epoch + 1} step {i}; lower {{lr}} (the peak lr was {peak_lr:.3g})"
                )
        return values[-1]


def without_frozen(groups: list[dict[str, Any]], model: nn.Module, frozen: list[str] | None) -> list[dict[str, Any]]:
    """The optimizer's parameter ``groups`` without the parameters of ``model`` named in ``frozen``
    (``arch.json``'s ``frozen``: those the caller of the API froze), so that no stage updates them
    (nor decays them); a group left empty is dropped. A method's own parameters (DCS's gates, a
    predictor) have names of their own and stay."""
    if not frozen:
        return groups
    names = set(frozen)
    out = {id(p) for n, p in model.named_parameters() if n in names}
    kept = [dict(g, params=[p for p in g["params"] if id(p) not in out]) for g in groups]
    return [g for g in kept if g["params"]]


def _fit(
    model: nn.Module,
    *,
    device: torch.device,
    data: DataBundle,
    input_spec: InputSpec,
    cfg: TrainConfig,
    store: RunStore,
    arch: dict[str, Any],
    hooks: TrainHooks,
    resume: bool,
    finish: bool,
    test: bool = True,
) -> TrainMetrics:
    world, main = distributed.world(), distributed.is_main()
    amp = runtime.resolve_amp(cfg.amp, device)
    if cfg.amp == "auto" and main:  # the choice is printed, and recorded in metrics.json ("amp")
        say(f"precision: {'bf16 autocast (auto: this CPU has native bfloat16)' if amp == 'bf16' else 'fp32 (auto)'}")
    seed_everything(cfg.seed)
    model.to(device)
    distributed.broadcast_model(model)
    peak = cfg.peak_lr_for(world_size=world.size)
    min_lr = min(cfg.min_lr, peak)
    frozen = frozen_of(arch)  # the parameters the caller of the API froze: in no group, outside the clip's norm
    groups = without_frozen(hooks.param_groups(model, cfg), model, frozen)
    opt = runtime.adamw(groups, device, lr=peak, betas=(0.9, 0.999))
    clipped = [p for g in groups for p in g["params"]] if frozen else list(model.parameters())
    ema = Ema(model, cfg.ema_decay) if cfg.ema_decay else None
    # the step's forward + loss as one module, DistributedDataParallel under torchrun (checkpoints and
    # evaluation use `model` itself)
    step = distributed.DataParallel(model, hooks.loss, find_unused=hooks.unused_parameters)

    pin = device.type == "cuda"  # pinned host batches: non-blocking copies to the GPU

    def loader_for(epoch: int):
        return lambda ds, stream=0: make_loader(
            ds,
            batch_size=cfg.batch_size,
            shuffle=True,
            seed=cfg.seed + stream,
            epoch=epoch,
            shard=(world.rank, world.size),
            pin_memory=pin,
        )

    steps_per_epoch = hooks.batches(data, epoch=0, loader=loader_for(0))[1]
    if steps_per_epoch == 0 and world.size > 1:
        raise NascompressError(f"the training split ({len(data.train)} images) is too small for {world.size} processes")
    hooks.steps_per_epoch = steps_per_epoch
    total_steps, warmup_steps = cfg.epochs * steps_per_epoch, int(cfg.warmup_epochs * steps_per_epoch)
    start_epoch, best, best_epoch, train_time, start_rec = 0, -1.0, -1, 0.0, None
    ckpt_path = None if store.dir is None else store.dir / CHECKPOINT_FILE

    def validate() -> Evaluation:
        hooks.before_eval(model)
        return _evaluate(
            model, data.val, input_spec=input_spec, device=device, batch_size=cfg.eval_batch_size, amp=cfg.amp
        )

    if resume and ckpt_path is not None and ckpt_path.exists():
        st = load_state(ckpt_path)
        with damaged_checkpoint(ckpt_path):
            restore_model(model, st["model"], ckpt_path)
            opt.load_state_dict(st["optimizer"])
            if ema is not None and st.get("ema") is not None:
                ema.state = {k: v.to(device) for k, v in st["ema"].items()}
            hooks.load_state_dict(st.get("hooks", {}))
            torch.set_rng_state(st["rng"])
            runtime.restore_cuda_rng(st.get("cuda_rng"))
            start_epoch, best_epoch = checked_int(st, "epoch") + 1, checked_int(st, "best_epoch")
            best, train_time = checked_number(st, "best"), checked_number(st, "train_time")
            start_rec = st.get("start")
        store.start(resume_from=start_epoch)
    else:
        store.start(resume_from=None)
        if cfg.eval_start:  # epoch 0: the starting model is the first candidate for the best
            val = validate()
            start_rec = {"epoch": 0, "start": True, "val_top1": val.top1, "val_loss": val.loss}
            store.record(start_rec)
            if cfg.keep == "best":
                best, best_epoch = val.top1, 0
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
                    if (
                        "own_lr" in g
                    ):  # a group with its own cosine (architecture logits): own_lr -> own_lr_end x own_lr
                        g["lr"] = lr_at(
                            epoch * steps_per_epoch + i,
                            total=total_steps,
                            warmup=0,
                            lr=g["own_lr"],
                            min_lr=g["own_lr"] * g.get("own_lr_end", 1.0),
                        )
                    else:
                        g["lr"] = lr * g.get("lr_scale", 1.0)
                # the uint8 batch goes to the device as it is; resizing and normalising happen there
                x, y = preprocess(runtime.to_device(imgs, device), input_spec), runtime.to_device(labels, device)
                hooks.prepare_step(model, tag)
                with runtime.autocast(device, amp):  # (resolved once above)
                    loss, logs = step(x, y, epoch=epoch, cfg=cfg, tag=tag)  # hooks.loss(model, ...), under DDP
                due = watch.add(i, loss, x if torch.is_tensor(x) else None)
                opt.zero_grad(set_to_none=True)
                loss.backward()  # under torchrun DDP averages the gradients over the ranks meanwhile
                step.check()
                if cfg.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_([p for p in clipped if p.grad is not None], cfg.grad_clip)
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
            record.update(val_top1=val.top1, val_loss=val.loss)
            saved_arch = hooks.arch(model, arch)
            store.save(model, saved_arch, last=True)
            if cfg.keep == "last" or val.top1 > best:
                best, best_epoch = val.top1, epoch + 1
                store.save(model, saved_arch)
            if live is not None:
                model.load_state_dict(live)
            if world.size > 1:  # a debugging aid (NASCOMPRESS_CHECK_SYNC=1): every rank holds the same state
                digest = distributed.check_in_sync(
                    {"model": model.state_dict(), "optimizer": opt.state_dict(), "hooks": hooks.state_dict()},
                    when=f"after epoch {epoch + 1}",
                )
                if digest is not None:
                    record["state_digest"] = digest
            # the epoch's record before its checkpoint: a run killed between the two resumes from the
            # epoch before and drops the record (RunStore.start), so every epoch's record is written once
            store.record(record)
            if store.dir is not None and main:
                store.checkpoint(
                    {
                        "model": model.state_dict(),
                        "optimizer": opt.state_dict(),
                        "ema": ema.state if ema else None,
                        "hooks": hooks.state_dict(),
                        "rng": torch.get_rng_state(),
                        "cuda_rng": runtime.cuda_rng_state(),
                        "epoch": epoch,
                        "best": best,
                        "best_epoch": best_epoch,
                        "train_time": train_time,
                        "start": start_rec,
                    }
                )
            left = pipeline_left((epoch + 1) / cfg.epochs, since=start_epoch / cfg.epochs)  # "" outside a pipeline
            info = f"val {val.top1:.2f}% best {best:.2f}%" + (f"  {left}" if left else "")
            progress.update(ep_task, advance=1, info=info)
            hooks.check(record, start_rec)
    step.close()

    distributed.barrier()  # rank 0 has written the best model
    scored: Evaluation | None = None
    if test:
        best_model = store.saved_model(model, device)
        with runtime.cpu_attention(best_model, device, cfg.amp):  # as `model` runs (a reloaded copy, or itself)
            scored = _evaluate(
                best_model, data.test, input_spec=input_spec, device=device, batch_size=cfg.eval_batch_size, amp=cfg.amp
            )
    metrics = TrainMetrics.new(
        best_val_top1=best,
        best_epoch=best_epoch,
        test_top1=None if scored is None else scored.top1,
        test_loss=None if scored is None else scored.loss,
        test_n=0 if scored is None else scored.n,
        start_val_top1=None if start_rec is None else start_rec["val_top1"],
        epochs=cfg.epochs,
        peak_lr=peak,
        train_time_s=train_time,
        dataset=data.name,
        amp=amp,
    )
    if world.size > 1:
        metrics = metrics.set(processes=world.size, global_batch_size=cfg.batch_size * world.size)
    if data.extra.get("skipped_images"):  # unreadable images left out (--skip-bad-images), per folder
        metrics = metrics.set(skipped_images=data.extra["skipped_images"])
    if data.splits is not None:  # which images chose the best epoch, which measured it (data.carve)
        metrics = metrics.set(splits=data.splits.without_images())
    if main and finish and store.dir is not None:
        finish_run(store.dir, metrics)  # the last write: marks the run complete
    return metrics
