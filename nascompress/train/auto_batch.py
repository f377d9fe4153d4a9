"""The batch size a training run takes when none is given (retrain, the DCS search): from the number
of training images (:func:`auto_batch_size`)."""

from __future__ import annotations

AUTO_BATCH_SIZES = (16, 32, 64, 128)
AUTO_BATCH_STEPS = 100
AUTO_BATCH_NOTE = "Default: from the training images, 16 to 128 for about 100 steps per epoch (16 for 2,000)."


def auto_batch_size(train_images: int) -> int:
    """The batch size for ``train_images`` training images when none is given (retrain, the DCS
    search): the largest of 16, 32, 64, 128 that still gives about 100 steps per epoch (16 for
    2,000 images, 128 from 12,800). Why: a pruned pretrained model recovers with many small steps
    (DINOv2 DCS, 3,000 images, one epoch: 83.30% at batch 16 against 81.35% at 32,
    ``bench/results/pretrained_dcs_retrain_sweep.json``); a large dataset keeps the batch of 128."""
    fits = [b for b in AUTO_BATCH_SIZES if train_images / b >= AUTO_BATCH_STEPS]
    return max(fits) if fits else AUTO_BATCH_SIZES[0]
