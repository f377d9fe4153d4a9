"""Data-parallel training over the processes that ``torchrun`` starts (one per GPU, or a few CPU
processes with gloo): ``torchrun --nproc-per-node N -m nascompress.cli.main train ...``.

torchrun sets ``WORLD_SIZE``, ``RANK`` and ``LOCAL_RANK``; :func:`init` reads them and joins the
process group (backend ``nccl`` when the job trains on CUDA, ``gloo`` otherwise; device
``cuda:LOCAL_RANK`` when the job's device is ``auto`` or ``cuda``). Without torchrun
(``WORLD_SIZE`` unset or 1) no process group is made and every helper here returns its input or
does nothing, so a single process runs exactly as before.

How :func:`~nascompress.train.run.fit` divides the work:

* **Gradients: torch's DistributedDataParallel** (:class:`DataParallel`). A recipe's step is
  ``hooks.loss(model, x, y, ...)``, which may call other methods of the model than ``forward``
  (``forward_features``/``forward_head`` for distillation, ``forward_both`` for MG-ViT) and read
  its state (``dvit_state``, ``dcs_state``). So the step itself is made the forward of one module
  (:class:`LossStep`: the model and the loss function, no teacher), and that module is what DDP
  wraps: DDP sees one forward per backward, and its reducer all-reduces the gradients in buckets
  while the backward pass is still running (each rank's loss is a mean over its ``batch_size``
  images, so the average is the gradient of the mean over the global batch of ``batch_size x
  world`` images). The checkpoints hold the unwrapped model's weights (no ``module.`` prefix).

  DDP's reducer manages the parameters that require a gradient when it is built, and expects each
  of them to get one in every backward. Recipes switch ``requires_grad`` between steps: DCS's
  weight steps (the weights) and architecture steps (the architecture logits), DynamicViT's and
  Sparsifiner's predictor-only stages. Each such set of trainable parameters gets its own DDP
  wrapper of the same :class:`LossStep`, built when the set first occurs: a DCS architecture step
  then all-reduces the architecture logits only, not the frozen weights' zeros, and no graph walk
  is needed. ``find_unused_parameters`` (a walk of the autograd graph every step) is set only for
  a recipe that says a step may leave trainable parameters out (``TrainHooks.unused_parameters``,
  e.g. DynamicViT with a stage that keeps every token, whose predictor then does not run); a
  recipe that leaves one out without saying so stops after its first step with one line naming
  the parameters. Buffers are not re-broadcast every forward (``forward_sync_buffers=False``):
  every rank applies the same updates, which ``NASCOMPRESS_CHECK_SYNC=1`` verifies.
  The short predictor-only stages before a token method's fine-tune (``calibrate``, their own
  small loop) are not data-parallel: every rank runs them on the same batches with the same seed.
  Only the student is wrapped: teachers run under ``no_grad`` beside it, on every rank. The
  weights start equal (:func:`broadcast_model` at the start of fit, before the first evaluation:
  it also evens out what non-deterministic GPU kernels may have made of those stages) and every
  rank runs the same clip and AdamW update on the same averaged gradients, so they stay equal.
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
import inspect
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ..errors import NascompressError
from ..runtime import resolve_device

CHECK_SYNC_ENV = "NASCOMPRESS_CHECK_SYNC"
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


_TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _env_size() -> int:
    raw = os.environ.get("WORLD_SIZE", "1")
    try:
        size = int(raw)
    except ValueError:
        size = 0
    if size < 1:
        raise NascompressError(f"WORLD_SIZE={raw!r} is not a process count; unset it (torchrun sets it)")
    return size


def local_device(device: str | None) -> torch.device:
    """:func:`~nascompress.runtime.resolve_device`, with ``auto``/``cuda`` taken as ``cuda:LOCAL_RANK``
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
    missing = [v for v in _TORCHRUN_VARS if not os.environ.get(v)]
    if missing:
        verb = "is" if len(missing) == 1 else "are"
        raise NascompressError(
            f"WORLD_SIZE={_env_size()} is set but {', '.join(missing)} {verb} not: the command was not started "
            "by torchrun; unset WORLD_SIZE to run in one process, "
            "or start it with torchrun (torchrun --nproc_per_node N $(which nascompress) ...)"
        )
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


# buffers are synced when a wrapper is built, not at every forward (the keyword's name since torch 2.13)
_NO_BUFFER_SYNC = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(nn.parallel.DistributedDataParallel).parameters
    else {"broadcast_buffers": False}
)


class LossStep(nn.Module):
    """A training step's forward as one module: ``forward(*args, **kw) = loss_fn(model, *args, **kw)``.

    Its only submodule is ``model`` (what the loss function uses besides, a teacher, stays outside),
    so DDP wrapping it sees exactly the student's parameters, and one forward per backward."""

    def __init__(self, model: nn.Module, loss_fn: Callable[..., Any]):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.loss_fn(self.model, *args, **kwargs)


class DataParallel:
    """The training step under torch's DistributedDataParallel (see the module docstring).

    Call it as the step's forward (``loss, logs = step(x, y, ...)``), then ``backward`` the loss
    and call :meth:`check` before the optimizer step. Without a process group it is the plain
    :class:`LossStep`. With one, each set of parameters that require a gradient (a recipe's phase)
    has its own DDP wrapper of the one :class:`LossStep`, built (a collective: every rank reaches it
    at the same step) the first time that set trains; a wrapper's reducer is idle while another
    wrapper's step runs. ``find_unused``: DDP's ``find_unused_parameters`` for every wrapper.

    Args:
        model: the student (the unwrapped module: the one to save and evaluate).
        loss_fn: ``loss_fn(model, *args, **kwargs) -> (loss, logs)``.

    The wrappers take no ``device_ids`` (allowed for a single-device module): the step's inputs
    are already on the model's device, and DDP would otherwise copy every argument there (and
    rebuild the config dataclasses) on every step.
    """

    def __init__(self, model: nn.Module, loss_fn: Callable[..., Any], *, find_unused: bool = False):
        self.model, self.step, self.find_unused = model, LossStep(model, loss_fn), find_unused
        self.active = dist.is_available() and dist.is_initialized()
        self.wrappers: dict[tuple[bool, ...], nn.Module] = {}
        self._new: tuple[bool, ...] | None = None  # a wrapper whose first backward is still to be checked

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.active:
            return self.step(*args, **kwargs)
        key = tuple(p.requires_grad for p in self.model.parameters())
        ddp = self.wrappers.get(key)
        if ddp is None:
            if not any(key):
                raise NascompressError(
                    "no parameter of the model requires a gradient at this step; the recipe froze everything"
                )
            ddp = self.wrappers[key] = nn.parallel.DistributedDataParallel(
                self.step, find_unused_parameters=self.find_unused, **_NO_BUFFER_SYNC
            )
            self._new = key
        return ddp(*args, **kwargs)

    def check(self) -> None:
        """After the first backward of a new wrapper: every trainable parameter got a gradient (else
        DDP without ``find_unused`` did not reduce them all; one line names them)."""
        if self._new is None:
            return
        self._new = None
        missing = [n for n, p in self.model.named_parameters() if p.requires_grad and p.grad is None]
        if missing and not self.find_unused:
            self.close()  # the wrapper's reduction is unfinished: its hooks must not see later backward passes
            raise NascompressError(
                f"{len(missing)} trainable parameter(s) took no part in the loss under torchrun "
                f"(e.g. {missing[0]}); the recipe must set TrainHooks.unused_parameters = True"
            )

    def close(self) -> None:
        """Drop the wrappers and the hooks their reducers put on the model's parameters (the model
        may train again later, e.g. a retrain after a search)."""
        for ddp in self.wrappers.values():
            ddp._remove_autograd_hooks()
        self.wrappers.clear()
        self._new = None


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


__all__ = [
    "World",
    "init",
    "world",
    "is_main",
    "barrier",
    "part",
    "all_sum",
    "merge_means",
    "gather_rows",
    "broadcast_",
    "broadcast_model",
    "local_device",
    "digest",
    "check_in_sync",
    "LossStep",
    "DataParallel",
    "CHECK_SYNC_ENV",
]
