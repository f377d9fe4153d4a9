"""Batches of a dataset in an order that depends only on (seed, epoch) (:func:`make_loader`), so a
resumed run replays the same order; sharded for data-parallel training; decoded in the worker
processes a loaded split asks for.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset


def collate_batch(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch as (images, labels): datasets with ``__getitems__`` already give that tuple; an
    ImageFolder (or a Subset of one) gives a list of (image, label) pairs, stacked here."""
    if isinstance(batch, tuple):
        return batch
    xs, ys = zip(*batch)
    return torch.stack(xs), torch.as_tensor(ys)


class Indexed:
    """A view of a training split whose batches also carry their images' indices in it."""

    def __init__(self, base: Any):
        self.base, self.classes = base, base.classes
        if hasattr(base, "num_workers"):
            self.num_workers = base.num_workers

    def __len__(self) -> int:
        return len(self.base)

    def __getitems__(self, idx: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        got = self.base.__getitems__(idx) if hasattr(self.base, "__getitems__") else [self.base[i] for i in idx]
        imgs, labels = collate_batch(got)  # an in-memory split's batch, or an ImageFolder's (image, label) pairs
        return imgs, labels, torch.as_tensor(idx, dtype=torch.long)


def make_loader(
    ds: Dataset,
    *,
    batch_size: int,
    shuffle: bool,
    seed: int = 0,
    epoch: int = 0,
    drop_last: bool = False,
    num_workers: int | None = None,
    shard: tuple[int, int] = (0, 1),
    pin_memory: bool = False,
) -> DataLoader:
    """A DataLoader whose order depends only on (seed, epoch): resuming replays the same order.

    ``shard=(rank, world)`` (data-parallel training, :mod:`nascompress.train.distributed`): this rank's
    part of that order, every ``world``-th item from ``rank``, the order first cut to a multiple of
    ``world`` so that every rank gets as many items (and batches).

    ``num_workers`` None (the default) takes the ``num_workers`` attribute that :func:`load_data`
    sets on every split (from :attr:`DataConfig.num_workers`: worker processes for ImageFolder,
    none for in-memory datasets), else 0; so every loader over a split decodes images in
    parallel without its caller knowing. With workers, their random augmentation draws are
    seeded from (seed, epoch) too. ``pin_memory``: batches in page-locked memory, for non-blocking
    copies to a GPU (set by the callers that train or evaluate on CUDA).
    """
    if num_workers is None:
        num_workers = int(getattr(ds, "num_workers", 0) or 0)
    if shuffle:
        g = torch.Generator().manual_seed(seed * 100_003 + epoch)
        order = torch.randperm(len(ds), generator=g).tolist()
    else:
        order = list(range(len(ds)))
    rank, world = shard
    if world > 1:
        order = order[: len(order) - len(order) % world][rank::world]
    sampler = BatchSampler(order, batch_size=batch_size, drop_last=drop_last)
    extra: dict[str, Any] = {}
    if num_workers > 0:  # (without workers the generator is not passed: the global RNG stream stays as before)
        extra["generator"] = torch.Generator().manual_seed(seed * 100_003 + epoch + 7_919 + rank * 1_000_003)
    return DataLoader(
        ds,
        batch_sampler=sampler,
        collate_fn=collate_batch,
        num_workers=num_workers,
        pin_memory=pin_memory and torch.cuda.is_available(),
        **extra,
    )
