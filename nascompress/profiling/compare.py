"""One ratio convention for every comparison the tool prints: a model against its reference
(compressed against dense).

* size ratios are model / reference, written "0.703x the FLOPs" (below 1: the model is smaller);
* speed ratios are > 1 when the model is faster, written "2.20x faster" (below 1 the text adds
  "(slower)"): latency reference / model, throughput model / reference.

``profile RUN --compare REF``, the pipeline's report (:mod:`nascompress.pipeline.report`) and the
commands that state a FLOPs ratio against the dense model all use these keys and words.
"""

from __future__ import annotations

from typing import Any

SIZE_KEYS = {"flops_ratio": "macs", "params_ratio": "params"}  # model / reference of these record fields


def compare_records(model: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    """The ratios of one profile record (:func:`~.report.profile_models`) against another's.

    Returns ``flops_ratio`` and ``params_ratio`` (model / reference: < 1 is smaller) and, where
    both were timed, ``latency_speedup`` and ``throughput_speedup`` (> 1 is faster; and their
    ``_compiled`` twins)."""
    ratios = {k: model[f] / reference[f] for k, f in SIZE_KEYS.items()}
    for suffix in ("", "_compiled"):
        lat, tp = f"latency_ms{suffix}", f"throughput{suffix}"
        if model.get(lat) and reference.get(lat):
            ratios[f"latency_speedup{suffix}"] = reference[lat] / model[lat]
            ratios[f"throughput_speedup{suffix}"] = model[tp] / reference[tp]
    return ratios


def times_text(ratio: float, what: str) -> str:
    """``0.703x the FLOPs``: a model / reference size ratio."""
    return f"{ratio:.3f}x the {what}"


def dense_flops_text(ratio: float) -> str:
    """A FLOPs ratio against the dense model, as every command writes it."""
    return times_text(ratio, "dense FLOPs")


def speed_text(speedup: float) -> str:
    """``2.20x faster``; a speed-up below 1 says it is slower (``0.45x faster (slower)``)."""
    return f"{speedup:.2f}x faster" + (" (slower)" if speedup < 1 else "")


def comparison_text(c: dict[str, Any], *, model: str, reference: str) -> list[str]:
    """A profile's comparison (:func:`~nascompress.profiling.jobs.profile` with ``compare=``) as lines: both
    models named, what each figure was measured on."""
    lines = [
        f"{model} against the reference {reference}:",
        f"  {times_text(c['flops_ratio'], 'FLOPs')} (per image, mean of {c['flops_images']} random images), "
        f"{times_text(c['params_ratio'], 'parameters')}",
    ]
    for suffix, how in (("", ""), ("_compiled", ", compiled")):
        if c.get(f"latency_speedup{suffix}") is not None:
            lines.append(
                f"  latency {speed_text(c[f'latency_speedup{suffix}'])} (batch {c['latency_batch']}{how}), "
                f"throughput {speed_text(c[f'throughput_speedup{suffix}'])} "
                f"(batch {c['throughput_batch']}{how}); timed interleaved in one process"
            )
    return lines
