"""How a job runs on its device: inference dtypes, mixed precision, TF32, determinism, RNG state.

* ``dtype`` (``--dtype fp32|bf16|fp16``; evaluate, profile, the pipeline's report,
  ``nascompress.load(dtype=)``): the model's weights and inputs in that dtype (inference only).
* ``amp`` (``--amp off|bf16|auto``; every training job through :class:`~nascompress.train.run.TrainConfig`):
  the forward and the loss under ``torch.autocast(device, bfloat16)``; weights, gradients and the
  optimizer stay float32 (bfloat16 has float32's range: no loss scaling). ``auto``
  (:func:`resolve_amp`, the default) is bf16 on a CPU with native bfloat16 dot products (AVX512-BF16
  or AMX), where the bench measured it faster at fp32's accuracy (bench/tool_speed.py), and off
  elsewhere (a CPU without them; a GPU: TF32). ``NASCOMPRESS_NATIVE_BF16=0`` (or ``1``) overrides the
  CPU's flags. Under bf16 on a CPU the attention runs as explicit matmuls (:func:`cpu_attention`).
* TF32: on CUDA, float32 matmuls and convolutions use TensorFloat-32 tensor cores
  (:func:`configured`), except under ``deterministic``.
* ``deterministic`` (``--deterministic``): ``torch.use_deterministic_algorithms(True)``, cuDNN's
  deterministic mode without autotuning, TF32 off, and ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (what
  cuBLAS needs to be reproducible on CUDA >= 10.2; set before the first cuBLAS call of the
  process where possible: a job calls :func:`prepare_deterministic` first). Same seed, same numbers on one
  machine, also on a GPU; slower there.
* The host allocator (:func:`keep_freed_memory`, every training job and the CLI): glibc's malloc
  keeps freed blocks for reuse instead of handing the activations' multi-MB buffers back to the
  system after every op (16,500 page faults per step of the main job's base, 1,900 after; measured
  1.09-1.11x faster steps on one thread, bench/results/tool_speed_amd-epyc.json). Numbers are unchanged.
  ``NASCOMPRESS_MALLOC=default`` leaves malloc alone.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import sys
from typing import Any, Iterator

import numpy as np
import torch

from .errors import NascompressError, SettingError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
AMP_MODES = ("off", "bf16", "auto")
CUBLAS_WORKSPACE = ":4096:8"


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype:
    """``fp32`` / ``bf16`` / ``fp16`` (or a torch dtype; None: float32) -> the torch dtype."""
    if name is None:
        return torch.float32
    if isinstance(name, torch.dtype):
        if name not in DTYPES.values():
            raise NascompressError(f"dtype must be one of {', '.join(DTYPES)}, got {name}")
        return name
    if name not in DTYPES:
        raise SettingError(f"{{dtype}} must be one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return next(k for k, v in DTYPES.items() if v == dtype)


@contextlib.contextmanager
def configured(device: torch.device, *, deterministic: bool = False) -> Iterator[None]:
    """Inside: TF32 for float32 on CUDA (off when ``deterministic``) and, with ``deterministic``,
    the deterministic mode (see the module docstring). The previous settings are restored on exit,
    so one job's choice does not leak into the next one of the same process."""
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
    )
    try:
        if deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
            torch.use_deterministic_algorithms(True)
            torch.backends.cudnn.deterministic = True
            torch.backends.cudnn.benchmark = False
        if device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = not deterministic
            torch.backends.cudnn.allow_tf32 = not deterministic
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0])
        (
            torch.backends.cudnn.deterministic,
            torch.backends.cudnn.benchmark,
            torch.backends.cuda.matmul.allow_tf32,
            torch.backends.cudnn.allow_tf32,
        ) = saved[1:]


def prepare_deterministic(deterministic: bool) -> None:
    """Set ``CUBLAS_WORKSPACE_CONFIG`` early (before a job's first cuBLAS call builds the workspace)."""
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)


_ONCE: dict[str, Any] = {}
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


def keep_freed_memory() -> bool:
    """glibc only (Linux), once per process: blocks up to 1 GiB come from the heap and freed memory
    is not trimmed back to the system, so the next step reuses it without page faults (see the
    module docstring). True when set (now or before); False elsewhere or with
    ``NASCOMPRESS_MALLOC=default``."""
    if "set" not in _ONCE:
        ok = False
        if sys.platform.startswith("linux") and os.environ.get("NASCOMPRESS_MALLOC", "") != "default":
            try:
                libc = ctypes.CDLL("libc.so.6")
                ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
            except (OSError, AttributeError):  # another C library (musl) or no mallopt: nothing to tune
                ok = False
        _ONCE["set"] = ok
    return _ONCE["set"]


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` computes bfloat16 dot products natively: a CPU with AVX512-BF16 or AMX
    (its /proc/cpuinfo flags; ``NASCOMPRESS_NATIVE_BF16=0|1`` overrides them). On CUDA False: the
    training steps of the main job and of DINOv2 ViT-S/14 on an H200 are bound by launching kernels
    (the GPU busy 14% of a step) and bf16 autocast made them slower, 0.85x and 0.82x
    (bench/results/tool_speed_nvidia-h200.json), so ``auto`` keeps fp32 (TF32) there."""
    if device.type != "cpu":
        return False
    forced = os.environ.get("NASCOMPRESS_NATIVE_BF16", "")
    if forced in ("0", "1"):
        return forced == "1"
    if "cpu_flags" not in _ONCE:
        try:
            text = open("/proc/cpuinfo").read()
        except OSError:
            text = ""
        _ONCE["cpu_flags"] = set(
            next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])
        )
    return bool({"avx512_bf16", "amx_bf16"} & _ONCE["cpu_flags"])


def resolve_amp(amp: str, device: torch.device) -> str:
    """``auto`` -> ``bf16`` where :func:`native_bf16`, else ``off``; other values as they are."""
    if amp == "auto":
        return "bf16" if native_bf16(device) else "off"
    return amp


@contextlib.contextmanager
def cpu_attention(model: torch.nn.Module, device: torch.device, amp: str) -> Iterator[None]:
    """Under bf16 autocast on a CPU: the model's attention modules (timm's ``fused_attn`` flag) run
    explicit bf16 matmuls instead of ``F.scaled_dot_product_attention``, whose CPU flash kernel is
    slower in bf16 at ViT token counts (the main job's step: bf16 alone 1.08x, bf16 with this 2.4-3.2x,
    fp32's own path unchanged; bench/results/tool_speed_amd-epyc.json). The flags are restored on exit."""
    mods = []
    if device.type == "cpu" and resolve_amp(amp, device) == "bf16":
        mods = [m for m in model.modules() if getattr(m, "fused_attn", None) is True]
    for m in mods:
        m.fused_attn = False
    try:
        yield
    finally:
        for m in mods:
            m.fused_attn = True


def adamw(params: Any, device: torch.device, **kw: Any) -> torch.optim.AdamW:
    """AdamW over ``params`` (tensors or groups; ``kw``: its arguments): on a CPU the fused kernel, one pass
    over every tensor instead of a Python loop per tensor (DINOv2 ViT-S/14, 22M weights in 176 tensors, 2
    threads: the optimizer step 23.7 -> 7.7 ms, the bf16 training step 1.07x; the main job's 0.7M weights
    1.02x); elsewhere PyTorch's default (CUDA: its multi-tensor kernel)."""
    return torch.optim.AdamW(params, **kw, **({"fused": True} if device.type == "cpu" else {}))


def autocast(device: torch.device, amp: str) -> contextlib.AbstractContextManager:
    """``torch.autocast`` in bfloat16 for ``amp="bf16"`` (and ``auto`` where it resolves to bf16,
    :func:`resolve_amp`), nothing for ``"off"``."""
    amp = resolve_amp(amp, device)
    if amp == "off":
        return contextlib.nullcontext()
    if amp != "bf16":
        raise SettingError(f"{{amp}} must be one of {', '.join(AMP_MODES)}, got {amp!r}")
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def to_device(t: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``t`` on ``device`` (a non-blocking copy from pinned memory on CUDA), cast to ``dtype`` there."""
    t = t.to(device, non_blocking=device.type == "cuda")
    return t if dtype is None or not t.is_floating_point() else t.to(dtype)


def cuda_rng_state() -> list[torch.Tensor] | None:
    """Every CUDA device's RNG state (checkpoints), None without CUDA."""
    return torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None


def restore_cuda_rng(state: Any) -> None:
    """Restore :func:`cuda_rng_state`'s states (ignored without CUDA or when the device count differs)."""
    if state is None or not torch.cuda.is_available():
        return
    states = list(state)
    if len(states) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(states)


def seed_everything(seed: int) -> torch.Generator:
    """Seed python, numpy and torch from one number; return a torch.Generator seeded with it."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def resolve_device(device: str | None) -> torch.device:
    if device in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise NascompressError(f"unknown device {device!r}: use cpu, cuda or cuda:N") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SettingError(f"device {device!r} requested but CUDA is not available; use {{device}} cpu")
    return dev


def machine_device(value: str | torch.device, *, field: str = "device") -> torch.device:
    """``value`` (a ``map_location``) as a device this machine has; anything else refused in one
    line naming ``field`` (not torch's AssertionError from a CPU build)."""
    try:
        dev = torch.device(value)
    except (RuntimeError, TypeError):
        raise SettingError(f"{{{field}}} {value!r} is not a device: use cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SettingError(
            f"{{{field}}} {value!r} needs CUDA, which this machine (or its torch build) has not; use {{{field}}} 'cpu'"
        )
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise SettingError(
            f"{{{field}}} {value!r}: this machine has {torch.cuda.device_count()} CUDA device(s); "
            f"use {{{field}}} 'cuda' or 'cpu'"
        )
    return dev


__all__ = [
    "DTYPES",
    "AMP_MODES",
    "parse_dtype",
    "dtype_name",
    "configured",
    "prepare_deterministic",
    "autocast",
    "to_device",
    "keep_freed_memory",
    "native_bf16",
    "resolve_amp",
    "cpu_attention",
    "cuda_rng_state",
    "restore_cuda_rng",
    "seed_everything",
    "resolve_device",
    "machine_device",
]
