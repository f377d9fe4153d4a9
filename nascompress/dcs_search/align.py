"""The width multiple of a DCS search, chosen by timing the user's model on the search's device
(``align="auto"``).

Every width the search keeps is 0, full or a multiple of ``align``. Which multiple pays depends on
the device: a GPU's matmul kernels run whole tiles, so between two tile boundaries a wider layer
costs the same and a narrower one saves nothing; a CPU's kernels step at their vector width, or
barely at all. Before the supernet is built (as ``mlp_gates="auto"`` is chosen),
:func:`resolve_align` times the model's own MLP pair (fc1, GELU, fc2 of its embed dim, at its token
count, batch 1; with the latency cost its ``latency_batch``) at a window of :data:`WINDOW`
consecutive hidden widths, the ones ending at the multiple of 64 nearest half the model's hidden
width (:func:`probe_window`), in the search's dtype (:func:`search_align`): the median of
interleaved timed rounds, the lower of :data:`PASSES` passes
(:func:`~nascompress.profiling.latency.time_models_lower`; under torchrun every rank takes rank 0's). Then
:func:`choose_align` takes the largest multiple m of :data:`MULTIPLES` such that rounding a width of
the window up to the next multiple of m costs at most :data:`TOLERANCE` more than the width itself
for at least :data:`SHARE` of the window's widths: where the latency steps at multiples of m, the
widths between the steps buy nothing, and the search may as well not keep them. Both latencies are
read from a least-squares line through the widths that round up to the same multiple
(:func:`fitted`): flat where the latency steps at m, and not decided by one timing (on a shared
CPU one width's median moves by several percent between passes, more than the 3% being judged).
The choice is only as steady as the device: on a CPU whose latency barely steps, two runs may choose
neighbouring multiples; it is recorded, and a resumed search keeps it.

The choice and why (:class:`~nascompress.dcs_search.metrics.AlignChoice`: the window, each width's
median, the rule) go into the search's metrics (``align_probe``) and its ``config.json``; the job
carries the chosen integer, so a resumed search keeps it (never measured again). A process measures
one model's geometry on one device and dtype once (:data:`_CHOSEN`): a study's trials on one base
search at the same multiple.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch
from timm.layers import Mlp
from torch import nn

from .. import runtime
from ..errors import NascompressError, SettingError
from ..methods.dcs import ALIGN_AUTO
from ..models.layers import DEFAULT_ALIGN
from ..profiling.latency import time_models_lower
from ..profiling.latency_table import device_fingerprint
from ..progress import say
from ..train import distributed
from .metrics import AlignChoice

MULTIPLES = (64, 32, 16, 8, 4, 2, 1)  # the multiples auto may choose, largest first
WINDOW = 64  # consecutive hidden widths timed
TOLERANCE = 0.03  # rounding a width up may cost this much more ...
SHARE = 0.9  # ... for this share of the window's widths
PASSES = 2  # timed passes over the window; each width's lower median is kept
WARMUP, ITERS = 5, 30  # per pass: warm-up calls and timed rounds (every width once a round)

# measure(widths) -> milliseconds per forward of the MLP pair at each hidden width (the timer a
# test replaces with a synthetic one: nothing here depends on real timing but the default)
Measure = Callable[[Sequence[int]], Sequence[float]]
_CHOSEN: dict[tuple, AlignChoice] = {}  # the choices of this process (see the module docstring)


def probe_window(hidden: int, window: int = WINDOW) -> tuple[int, ...]:
    """The consecutive hidden widths timed: the ``window`` widths ending at the multiple of ``window``
    nearest half of ``hidden`` (a tie: the larger; at least ``window``), clamped to 1 .. ``hidden``."""
    if hidden < 1:
        raise NascompressError(f"the MLP's hidden width must be positive, got {hidden}")
    end = min(hidden, max(window, math.floor(hidden / 2 / window + 0.5) * window))
    return tuple(range(max(1, end - window + 1), end + 1))


def fitted(widths: Sequence[int], ms: Sequence[float], m: int) -> dict[int, float]:
    """Each width's latency as a least-squares line through its group: the widths of the window that
    round up to the same multiple of ``m`` (at most the window's last width). Where the latency steps
    at multiples of ``m`` a group's line is flat; one width timed too fast or too slow moves its
    group's line a little, not the judgement of every width that rounds up onto it."""
    end = widths[-1]
    groups: dict[int, list[tuple[int, float]]] = {}
    for w, t in zip(widths, ms):
        groups.setdefault(min(-(-w // m) * m, end), []).append((w, t))
    fit: dict[int, float] = {}
    for pts in groups.values():
        mw, mt = sum(w for w, _ in pts) / len(pts), sum(t for _, t in pts) / len(pts)
        sxx = sum((w - mw) ** 2 for w, _ in pts)
        slope = sum((w - mw) * (t - mt) for w, t in pts) / sxx if sxx else 0.0
        fit.update({w: mt + slope * (w - mw) for w, _ in pts})
    return fit


def within_share(widths: Sequence[int], ms: Sequence[float], m: int, *, tolerance: float = TOLERANCE) -> float:
    """The share of ``widths`` (consecutive) whose latency rounded up to the next multiple of ``m``
    (at most the window's last width) is at most ``1 + tolerance`` times their own, both read from
    the lines :func:`fitted` through the timings."""
    fit, end = fitted(widths, ms, m), widths[-1]
    ok = sum(fit[min(-(-w // m) * m, end)] <= (1 + tolerance) * fit[w] for w in widths)
    return ok / len(widths)


def choose_align(
    widths: Sequence[int],
    ms: Sequence[float],
    *,
    tolerance: float = TOLERANCE,
    share: float = SHARE,
    multiples: Sequence[int] = MULTIPLES,
) -> tuple[int, dict[int, float]]:
    """``(m, within)``: the largest multiple ``m`` of ``multiples`` whose :func:`within_share` of the
    timed window (``widths`` consecutive, ``ms`` each one's latency) is at least ``share`` (1 when
    none is), and each multiple's share."""
    widths, ms = list(widths), [float(t) for t in ms]
    if not widths or len(widths) != len(ms) or widths != list(range(widths[0], widths[0] + len(widths))):
        raise NascompressError("align auto needs the latency of a window of consecutive widths, one value each")
    if not all(math.isfinite(t) and t > 0 for t in ms):
        raise NascompressError(f"align auto measured a latency that is not a positive number: {ms}")
    within = {m: within_share(widths, ms, m, tolerance=tolerance) for m in multiples}
    chosen = next((m for m in sorted(multiples, reverse=True) if within[m] >= share), 1)
    return chosen, within


def mlp_geometry(dense: nn.Module) -> tuple[int, int, int]:
    """``(embed_dim, tokens, hidden)`` of a timm ViT: its MLP's input width, its token count (patches
    and prefix tokens) and the hidden width of its first block's MLP."""
    blocks = getattr(dense, "blocks", None)
    mlp = getattr(blocks[0], "mlp", None) if blocks is not None and len(blocks) else None
    fc1, fc2 = getattr(mlp, "fc1", None), getattr(mlp, "fc2", None)
    patches = getattr(getattr(dense, "patch_embed", None), "num_patches", None)
    if not isinstance(fc1, nn.Linear) or not isinstance(fc2, nn.Linear) or not isinstance(patches, int):
        raise SettingError(
            "{align} auto times the model's MLP (fc1, fc2 of a timm ViT's blocks); this model has none: "
            "give {align} an integer"
        )
    return fc1.in_features, patches + int(getattr(dense, "num_prefix_tokens", 1)), fc1.out_features


@torch.inference_mode()
def measure_mlp_ms(
    embed_dim: int,
    tokens: int,
    widths: Sequence[int],
    *,
    device: torch.device,
    dtype: str,
    batch: int = 1,
    seed: int = 0,
) -> list[float]:
    """Milliseconds per forward of the MLP pair (timm's ``Mlp``: fc1, GELU, fc2, random weights) of
    ``embed_dim`` at each hidden width of ``widths`` on ``batch`` x ``tokens`` tokens, on ``device`` in
    ``dtype``: every width timed interleaved, the lower median of :data:`PASSES` passes
    (:func:`~nascompress.profiling.latency.time_models_lower`). The caller's random state is left as it was."""
    dt = runtime.parse_dtype(dtype)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        mods = [Mlp(embed_dim, hidden_features=w, act_layer=nn.GELU).eval().to(device, dt) for w in widths]
        x = torch.randn(batch, tokens, embed_dim).to(device, dt)
    with runtime.configured(device):
        return [1e3 * t for t in time_models_lower(mods, x, passes=PASSES, warmup=WARMUP, iters=ITERS)]


def resolve_align(
    dense: nn.Module,
    *,
    device: torch.device | str,
    dtype: str,
    batch: int = 1,
    measure: Measure | None = None,
    tolerance: float = TOLERANCE,
    share: float = SHARE,
) -> AlignChoice:
    """The width multiple of ``align auto`` for ``dense`` on ``device`` in ``dtype`` (see the module
    docstring) and why, as an :class:`~nascompress.dcs_search.metrics.AlignChoice`; says the choice
    in one line. ``measure(widths)``: the milliseconds of the MLP pair at each width (default:
    :func:`measure_mlp_ms` on ``device``; a test gives a synthetic one). Without ``measure`` a
    process measures one geometry on one device and dtype once."""
    dev = torch.device(device)
    embed_dim, tokens, hidden = mlp_geometry(dense)
    widths = probe_window(hidden)
    key = (embed_dim, tokens, hidden, str(dev), dtype, batch, tolerance, share)
    timed = measure is None  # on the device (remembered for the process), not a given measure
    if timed and key in _CHOSEN:
        why = _CHOSEN[key]
        say(f"DCS: align auto: {why.chosen}, as measured earlier in this process ({why.reason})")
        return why
    if measure is None:

        def measure(ws: Sequence[int]) -> Sequence[float]:
            return measure_mlp_ms(embed_dim, tokens, ws, device=dev, dtype=dtype, batch=batch)

    ms = [float(t) for t in measure(widths)]
    if timed and distributed.world().size > 1:  # under torchrun every rank takes rank 0's timings (one choice)
        t = torch.tensor(ms, dtype=torch.float64, device=dev)
        distributed.broadcast_(t)
        ms = t.tolist()
    chosen, within = choose_align(widths, ms, tolerance=tolerance, share=share)
    fp = device_fingerprint(dev)
    name = fp.gpu or fp.cpu or dev.type
    where = f"{name} ({dtype}, batch {batch})"
    if chosen == 1:
        reason = f"the latency grows with every hidden width on {where}"
    else:
        reason = f"latency steps at multiples of {chosen} on {where}"
    rule = (
        f"rounding a hidden width of {widths[0]}-{widths[-1]} up to a multiple of {chosen} costs at most "
        f"{tolerance:.0%} more for {within[chosen]:.0%} of them"
    )
    if 2 * chosen in within:
        rule += f", to a multiple of {2 * chosen} for {within[2 * chosen]:.0%}"
    reason = f"{reason}: {rule}"
    why = AlignChoice.new(
        chosen=chosen,
        device=str(dev),
        device_name=name,
        threads=torch.get_num_threads(),
        dtype=dtype,
        batch=batch,
        embed_dim=embed_dim,
        tokens=tokens,
        hidden=hidden,
        window=[widths[0], widths[-1]],
        ms=[round(t, 6) for t in ms],
        tolerance=tolerance,
        share=share,
        within={str(m): round(s, 4) for m, s in within.items()},
        reason=reason,
    )
    if timed:
        _CHOSEN[key] = why
    say(f"DCS: align auto: chose {chosen} ({reason})")
    return why


def known_align(align: int | str) -> int:
    """``align`` as an integer before the search has chosen one: ``auto`` as the default,
    :data:`~nascompress.models.layers.DEFAULT_ALIGN` (for a latency table built before the search,
    e.g. the pipeline's latency goal: the dense model's prediction, at full widths, is the same at
    any multiple)."""
    return DEFAULT_ALIGN if align == ALIGN_AUTO else int(align)


def search_align(job: Any, dense: nn.Module, device: torch.device) -> tuple[Any, AlignChoice | None]:
    """A DCS search job with ``align auto`` resolved on the search's ``device`` (and in its dtype: the
    latency cost's ``latency_dtype`` and batch, else the precision it trains in, bf16 where ``amp``
    resolves to it, else fp32) and why; a job with an integer ``align`` as it is, and None."""
    m, s = job.method, job.search
    if m.align != ALIGN_AUTO:
        return job, None
    if s.cost == "latency":
        dtype, batch = s.latency_dtype, s.latency_batch
    else:
        dtype, batch = ("bf16" if runtime.resolve_amp(job.train.amp, device) == "bf16" else "fp32"), 1
    why = resolve_align(dense, device=device, dtype=dtype, batch=batch)
    return job.replace(method=m.replace(align=why.chosen)), why


__all__ = [
    "MULTIPLES",
    "WINDOW",
    "TOLERANCE",
    "SHARE",
    "PASSES",
    "probe_window",
    "fitted",
    "within_share",
    "choose_align",
    "mlp_geometry",
    "measure_mlp_ms",
    "resolve_align",
    "known_align",
    "search_align",
]
