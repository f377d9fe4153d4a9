"""Data-parallel training over the processes that ``torchrun`` starts (one per GPU, or a few CPU
processes with gloo): ``torchrun --nproc-per-node N -m nascompress.cli.main train ...``.

torchrun sets ``WORLD_SIZE``, ``RANK`` and ``LOCAL_RANK``; :func:`init` reads them and joins the
process group (backend ``nccl`` when the job trains on CUDA, ``gloo`` otherwise; device
``cuda:LOCAL_RANK`` when the job's device is ``auto`` or ``cuda``). Without torchrun
(``WORLD_SIZE`` unset or 1) no process group is made and every helper here returns its input or
does nothing, so a single process runs exactly as before.

How :func:`~nascompress.train.fit` divides the work:

* **Gradients: an explicit all-reduce, not DistributedDataParallel.** DDP synchronises only the
  gradients of calls through its own ``forward``, but the recipes call other methods of the model
  (``forward_features``/``forward_head`` for distillation, ``forward_both`` for MG-ViT), read
  state it does not know (``dvit_state``, ``dcs_state``) and switch ``requires_grad`` per step
  (DCS's alternating weight/architecture steps), which DDP's fixed reducer does not allow. So
  after ``backward`` every rank averages its gradients with the others' (:func:`sync_grads`,
  bucketed all-reduces), then clips and steps. For synchronous SGD this is what DDP computes:
  each rank's loss is a mean over its ``batch_size`` images, so the average is the gradient of
  the mean over the global batch of ``batch_size x world`` images. It does not overlap the
  communication with the backward pass as DDP does; the price is one all-reduce of the gradients
  per step, paid after the backward instead of during it. It works with any hook. A parameter
  that has a gradient on some rank but not on another (a data-dependent path) gets zeros on the
  rank without; one with a gradient on no rank (e.g. the architecture logits on DCS weight
  steps, frozen by ``requires_grad``) stays without, as in one process, so AdamW skips it on
  every rank. Every rank runs the same steps with the same tags in the same order, and the
  same clip and AdamW update on the same averaged gradients, so the weights stay identical;
  :func:`broadcast_model` copies rank 0's weights to every rank once at the start.
* **Randomness**: every rank is seeded alike (the job's ``--seed``). Draws made once per step,
  such as DCS's Gumbel gate samples, are then shared, as one process with the global batch
  would draw them once; per-image draws (dropout, drop-path) repeat across the ranks' different
  images, which is harmless. A checkpoint stores rank 0's RNG state and every rank restores it,
  so ``--resume`` replays the run.
* **Data**: every rank draws the same (seed, epoch) order and takes every ``world``-th image of
  it (:func:`~nascompress.data.make_loader`'s ``shard``), the tail cut to a multiple of
  ``world`` (at most ``world - 1`` images an epoch, others each epoch), so all ranks take the
  same number of steps and step i of the ranks together reads the images one process with the
  global batch would read.
* **Evaluation** is split too: each rank evaluates its contiguous part (:func:`part`) and the
  counts are summed (:func:`all_sum`), so every rank gets the same top-1 and loss, the epoch's
  choice of the best model included; the training logs are averaged over ranks
  (:func:`merge_means`).
* **Files**: only rank 0 writes (:func:`is_main`); rank 0 creates the run directory between two
  :func:`barrier` calls, and on ``--resume`` every rank loads the checkpoint. With several
  machines the run directory must be on a filesystem every machine sees.

Debugging: with ``NASCOMPRESS_CHECK_SYNC=1`` fit compares a digest of every rank's weights,
optimizer and hook state after each epoch (:func:`check_in_sync`), fails if they differ and logs
the digest as ``state_digest``.
"""
from __future__ import annotations

import atexit
import hashlib
import os
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn

from .errors import NascompressError
from .utils import resolve_device

CHECK_SYNC_ENV = "NASCOMPRESS_CHECK_SYNC"
BUCKET_NUMEL = 1 << 23  # gradients are all-reduced in flat buckets of about this many elements (32 MiB fp32)
_DEVICE: torch.device | None = None  # where collective tensors live (cuda:LOCAL_RANK with nccl, else cpu)


@dataclass(frozen=True)
class World:
    """This process's place: ``rank`` of ``size`` processes (``local_rank`` on its machine)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0


def _env_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_device(device: str | None) -> torch.device:
    """:func:`~nascompress.utils.resolve_device`, with ``auto``/``cuda`` taken as ``cuda:LOCAL_RANK``
    under torchrun (an explicit ``cuda:N`` is kept)."""
    dev = resolve_device(device)
    if dev.type == "cuda" and dev.index is None and _env_size() > 1:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return dev


def init(device: str | None = "auto") -> torch.device:
    """Join torchrun's process group (once; later calls only resolve the device) and return the
    device this process trains on. Without torchrun: ``resolve_device(device)``, no group."""
    global _DEVICE
    dev = local_device(device)
    if _env_size() <= 1 or dist.is_initialized():
        return dev
    if not dist.is_available():
        raise NascompressError("this torch build has no torch.distributed; run without torchrun")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo")
    _DEVICE = dev if dev.type == "cuda" else torch.device("cpu")
    atexit.register(_shutdown)
    return dev


def _shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def world() -> World:
    """The process group :func:`init` joined, or a single process."""
    if not (dist.is_available() and dist.is_initialized()):
        return World()
    return World(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))


def is_main() -> bool:
    """Whether this process writes files and prints (rank 0, or the only process)."""
    return world().main


def barrier() -> None:
    """Wait until every rank gets here (nothing without a process group)."""
    if world().size > 1:
        if _DEVICE is not None and _DEVICE.type == "cuda":
            dist.barrier(device_ids=[_DEVICE.index])
        else:
            dist.barrier()


def part(n: int) -> torch.Tensor:
    """This rank's contiguous share of ``range(n)`` (shares differ by at most one; in rank order
    they are ``range(n)``)."""
    w = world()
    return torch.tensor_split(torch.arange(n), w.size)[w.rank]


def all_sum(values: list[float]) -> list[float]:
    """Sum each value over every rank (float64); the same list comes back to every rank."""
    w = world()
    if w.size == 1:
        return values
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=_DEVICE)
    dist.all_reduce(t)
    return t.tolist()


def merge_means(sums: dict[str, float], counts: dict[str, int]) -> dict[str, float]:
    """Per-key means of logged values over every rank's steps: ``sum of sums / sum of counts``
    (ranks may log different keys); identical on every rank."""
    if world().size == 1:
        return {k: v / counts[k] for k, v in sums.items()}
    parts: list[Any] = [None] * world().size
    dist.all_gather_object(parts, (sums, counts))
    tot: dict[str, float] = {}
    num: dict[str, int] = {}
    for s, c in parts:
        for k, v in s.items():
            tot[k], num[k] = tot.get(k, 0.0) + v, num.get(k, 0) + c[k]
    return {k: v / num[k] for k, v in tot.items()}


def gather_rows(t: torch.Tensor) -> torch.Tensor:
    """Every rank's ``t`` (N_r, ...) concatenated in rank order (sum N_r, ...), on every rank."""
    w = world()
    if w.size == 1:
        return t
    n = torch.tensor([t.shape[0]], device=t.device)
    sizes = [torch.zeros_like(n) for _ in range(w.size)]
    dist.all_gather(sizes, n)
    counts = [int(s) for s in sizes]
    padded = torch.cat([t, t.new_zeros((max(counts) - t.shape[0], *t.shape[1:]))]).contiguous()
    parts = [torch.empty_like(padded) for _ in range(w.size)]
    dist.all_gather(parts, padded)
    return torch.cat([p[:c] for p, c in zip(parts, counts)])


@torch.no_grad()
def broadcast_(*tensors: torch.Tensor) -> None:
    """Overwrite each tensor in place with rank 0's."""
    if world().size == 1:
        return
    for t in tensors:
        if t.is_contiguous():
            dist.broadcast(t, 0)
        else:  # a strided view: broadcast a contiguous copy
            c = t.contiguous()
            dist.broadcast(c, 0)
            t.copy_(c)


def broadcast_model(model: nn.Module) -> None:
    """Give every rank rank 0's parameters and buffers (they start equal anyway; this makes sure)."""
    broadcast_(*model.state_dict().values())


@torch.no_grad()
def sync_grads(params: Iterable[nn.Parameter]) -> None:
    """Average the gradients of ``params`` over every rank, in place (see the module docstring).

    Every rank must pass the same parameters in the same order; a parameter with a gradient on
    no rank keeps ``grad = None``.
    """
    w = world()
    if w.size == 1:
        return
    params = [p for p in params if p.requires_grad]
    if not params:
        return
    has = torch.tensor([float(p.grad is not None) for p in params], device=_DEVICE)
    dist.all_reduce(has)
    grads = []
    for p, h in zip(params, has.tolist()):
        if h > 0:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
    for bucket in _buckets(grads):
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat)
        flat.div_(w.size)
        for g, v in zip(bucket, flat.split([g.numel() for g in bucket])):
            g.copy_(v.view_as(g))


def digest(obj: Any) -> str:
    """sha256 of the tensors in nested state (dicts by key, lists in order; each tensor by dtype,
    shape and bytes). Other values are left out: a hook's state may hold timings."""
    h = hashlib.sha256()

    def add(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            t = x.detach().to("cpu").contiguous().reshape(-1)
            h.update(f"{t.dtype}{tuple(x.shape)}".encode())
            h.update(t.view(torch.uint8).numpy().tobytes())
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                h.update(repr(k).encode())
                add(x[k])
        elif isinstance(x, (list, tuple)):
            for v in x:
                add(v)

    add(obj)
    return h.hexdigest()


def check_in_sync(state: dict[str, Any], *, when: str) -> str | None:
    """With ``NASCOMPRESS_CHECK_SYNC=1`` under torchrun: the digest of ``state``, which must be the
    same on every rank (else NascompressError); None otherwise (nothing is computed)."""
    w = world()
    if w.size == 1 or os.environ.get(CHECK_SYNC_ENV, "") in ("", "0"):
        return None
    mine = digest(state)
    every: list[Any] = [None] * w.size
    dist.all_gather_object(every, mine)
    if len(set(every)) > 1:
        raise NascompressError(f"the processes' states differ {when}: digests {every}")
    return mine


def _buckets(grads: list[torch.Tensor]) -> Iterable[list[torch.Tensor]]:
    """Consecutive runs of gradients of one dtype and device, about BUCKET_NUMEL elements each."""
    bucket: list[torch.Tensor] = []
    size = 0
    for g in grads:
        if bucket and (g.dtype != bucket[0].dtype or g.device != bucket[0].device or size + g.numel() > BUCKET_NUMEL):
            yield bucket
            bucket, size = [], 0
        bucket.append(g)
        size += g.numel()
    if bucket:
        yield bucket


__all__ = ["World", "init", "world", "is_main", "barrier", "part", "all_sum", "merge_means", "gather_rows",
           "broadcast_", "broadcast_model", "sync_grads", "local_device", "digest", "check_in_sync", "BUCKET_NUMEL",
           "CHECK_SYNC_ENV"]
