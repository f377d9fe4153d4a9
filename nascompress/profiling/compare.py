"""One ratio convention for every comparison the tool prints: a model against its reference
(compressed against dense).

* size ratios are model / reference, written "0.703x the FLOPs" (below 1: the model is smaller);
* speed ratios are > 1 when the model is faster, written "2.20x faster" (below 1 the text adds
  "(slower)"): latency reference / model, throughput model / reference.

``profile RUN --compare REF``, the pipeline's report (:mod:`nascompress.pipeline.report`) and the
commands that state a FLOPs ratio against the dense model all use these keys and words.
"""

from __future__ import annotations

from .records import ModelProfile, ProfileComparison, ProfileRatios


def compare_records(model: ModelProfile, reference: ModelProfile) -> ProfileRatios:
    """The ratios of one profiled model (:func:`~.report.profile_models`' :class:`~.records.ModelProfile`)
    against another's (the fields a :class:`~.records.ProfileComparison` and the pipeline summary's
    comparison start from).

    Returns ``flops_ratio`` and ``params_ratio`` (model / reference: < 1 is smaller) and, where
    both were timed, ``latency_speedup`` and ``throughput_speedup`` (> 1 is faster; and their
    ``_compiled`` twins), in that order."""
    ratios = ProfileRatios.new(flops_ratio=model.macs / reference.macs, params_ratio=model.params / reference.params)
    timed = (
        ("", model.latency_ms, reference.latency_ms, model.throughput, reference.throughput),
        (
            "_compiled",
            model.latency_ms_compiled,
            reference.latency_ms_compiled,
            model.throughput_compiled,
            reference.throughput_compiled,
        ),
    )
    for suffix, lat, ref_lat, tp, ref_tp in timed:
        if lat and ref_lat:
            ratios = ratios.set(
                **{f"latency_speedup{suffix}": ref_lat / lat, f"throughput_speedup{suffix}": tp / ref_tp}
            )
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


def comparison_text(c: ProfileComparison) -> list[str]:
    """A profile's comparison (:func:`~nascompress.profiling.jobs.profile` with ``compare=``) as lines: both
    models named, what each figure was measured on."""
    lines = [
        f"{c.model} against the reference {c.reference}:",
        f"  {times_text(c.flops_ratio, 'FLOPs')} (per image, mean of {c.flops_images} random images), "
        f"{times_text(c.params_ratio, 'parameters')}",
    ]
    speeds = (
        ("", c.latency_speedup, c.throughput_speedup),
        (", compiled", c.latency_speedup_compiled, c.throughput_speedup_compiled),
    )
    for how, latency, throughput in speeds:
        if latency is not None:
            lines.append(
                f"  latency {speed_text(latency)} (batch {c.latency_batch}{how}), "
                f"throughput {speed_text(throughput)} "
                f"(batch {c.throughput_batch}{how}); timed interleaved in one process"
            )
    return lines
