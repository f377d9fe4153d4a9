"""The settings of every training run (:class:`TrainConfig`), below both the ``train`` job
(:mod:`nascompress.train.run`, which declares the stages' recipes and re-exports it) and the loop that reads
them (:func:`nascompress.train.loop.fit`)."""

from __future__ import annotations

from dataclasses import dataclass

from .. import runtime
from ..config import Config, check_choice, check_int, check_range, check_settings, setting
from ..errors import SettingError
from ..limits import MAX_BATCH, MAX_EPOCHS, MAX_LR, SEED_MAX

LR_REF_BATCH = 512  # base learning rates are given per 512 images (peak lr = base_lr * batch / 512)


@dataclass(frozen=True)
class TrainConfig(Config):
    """Optimisation settings shared by every training job.

    Args:
        epochs: passes over the training split.
        batch_size: images per step (per process under torchrun: the global batch is batch_size x world).
        lr: absolute peak AdamW learning rate; None: ``base_lr * global batch / 512`` (:meth:`peak_lr_for`).
        base_lr: peak learning rate per 512 images (used where ``lr`` is None: each stage's recipe and
            method has its own).
        min_lr: end of the cosine: at most ``lr`` (or, without it, ``base_lr``); a larger one is
            refused (the loop still caps it at the peak lr, which a small batch makes lower).
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
            optimizer stay float32); ``off`` (the default): float32 (TF32 matmuls on CUDA); ``auto``: bf16 on a CPU
            with native bfloat16 (AVX512-BF16/AMX; measured faster there), else off
            (:func:`nascompress.runtime.resolve_amp`; the choice is printed and kept in metrics.json).
        deterministic: reproducible kernels (:mod:`nascompress.runtime`): same seed, same numbers
            on one machine, also on a GPU (slower there).
        log_every: steps between two reads of the losses on the host (the progress bar, the
            non-finite loss check): the steps between them never wait for the device.
    """

    # The defaults are `nascompress train`'s from scratch (its command and the pipeline's base.train with
    # no options build TrainConfig()); the other stages' recipes are named instances next to each stage
    # (FINE_TUNE_TRAIN below, SEARCH_TRAIN, RETRAIN_TRAIN, FINETUNE_TRAIN). Fields declared with setting()
    # are the user's: options of `train`, `search dcs`, `retrain` and keys of their pipeline sections
    # (each stage offers some: StageSettings below and next to each stage); seed, device, amp and
    # deterministic are the pipeline's top-level keys.
    epochs: int = setting(8, lo=1, hi=MAX_EPOCHS, help="Passes over the training split.")
    batch_size: int = setting(128, lo=1, hi=MAX_BATCH, help="Images per step (per process under torchrun).")
    lr: float | None = setting(
        1e-3, lo=0, lo_open=True, hi=MAX_LR, help=("Absolute peak lr; without it the peak is --base-lr x batch / 512.")
    )
    base_lr: float = setting(4e-3, lo=0, lo_open=True, hi=MAX_LR, help="Peak lr per 512 images.")
    min_lr: float = setting(1e-5, lo=0, hi=MAX_LR, help="End of the cosine lr decay.")
    warmup_epochs: float = setting(1.0, lo=0, hi=MAX_EPOCHS, help="Linear lr warm-up, in epochs.")
    weight_decay: float = setting(0.05, lo=0, help="AdamW weight decay (not on biases, norms, tokens, positions).")
    layer_decay: float | None = setting(
        None, lo=0, hi=1, lo_open=True, help=("Layer-wise lr decay, timm's convention (1: off).")
    )
    label_smoothing: float = setting(0.1, lo=0, hi=1, hi_open=True, help="Cross-entropy label smoothing.")
    ema_decay: float | None = setting(
        None,
        lo=0,
        hi=1,
        lo_open=True,
        hi_open=True,
        help=("Keep an EMA of the weights (e.g. 0.999) and evaluate and save it."),
    )
    grad_clip: float = 1.0
    eval_batch_size: int = setting(256, lo=1, hi=MAX_BATCH, help="Images per evaluation batch.")
    eval_start: bool = True
    keep: str = "best"
    seed: int = setting(0, lo=0, hi=SEED_MAX, help="One seed for init, data order and every random draw.")
    device: str = setting("auto", help="auto, cpu or cuda[:N].")
    amp: str = setting(
        "auto",
        choices=runtime.AMP_MODES,
        help=(
            "Mixed precision: off, bf16 (autocast; weights and optimizer stay fp32) or auto (bf16 on a CPU "
            "with native bfloat16, else off)."
        ),
    )
    deterministic: bool = setting(
        False, help=("Deterministic kernels: same seed, same numbers, also on a GPU (slower there).")
    )
    log_every: int = 50

    def __post_init__(self) -> None:
        check_settings(self)  # every setting() against its declaration; below: the internal fields
        peak, which = (self.lr, "{lr}") if self.lr is not None else (self.base_lr, "{base_lr}")
        if self.min_lr > peak:  # the cosine would climb from the peak to it (the loop caps it there)
            raise SettingError(
                f"{{min_lr}} {self.min_lr:g} is above the peak learning rate, {which} {peak:g}: the cosine "
                f"decays from the peak to {{min_lr}}; give {{min_lr}} at most {peak:g} (e.g. {{min_lr}} 0)"
            )
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


__all__ = ["LR_REF_BATCH", "TrainConfig"]
