"""The pipeline report's int8 rows (:func:`int8_rows`): dense and compressed models, fp32 and int8
(:func:`~nascompress.deploy.quantize.quantize_run`), with their test top-1, file size, latency and
throughput, timed interleaved in one process, as frozen records (:class:`Int8Section`, a
:class:`Int8Row` per model; the summary's ``int8``, :mod:`nascompress.pipeline.summary`)."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import NascompressError
from ..data import InputSpec, load_data
from ..runs.io import MODEL_FILE, load_typed
from ..runs.records import TypedRecord
from ..profiling import time_models_by_threads
from .config import QuantizeConfig
from .quantize import labelled_batches, quantize_run
from .verify import onnx_runner


class _Int8Record(TypedRecord):
    NEW_SOURCE = "the summary's {name}"  # (the pipeline summary's part)


@dataclass(frozen=True, kw_only=True)
class Int8Row(_Int8Record):
    """One row of the int8 comparison (``failed``: why the int8 model was not kept)."""

    model: str
    runtime: str
    failed: str | None = None
    test_top1: float | None = None
    test_n: int | None = None
    file_bytes: int | None = None
    latency_ms: float | None = None
    latency_threads: Any = None
    throughput: float | None = None
    throughput_threads: Any = None


@dataclass(frozen=True, kw_only=True)
class Int8Section(_Int8Record):
    """The dense and compressed models in fp32 and int8, timed interleaved (:func:`int8_rows`; its
    ``split``, ``images`` and ``iters`` kept as they are, in ``extra``)."""

    rows: tuple[Int8Row, ...] = ()
    latency_batch: int | None = None
    throughput_batch: int | None = None


def int8_rows(
    dense_run: str | Path,
    compressed_run: str | Path,
    *,
    compressed_int8: str | Path | None,
    data: Any,
    config: QuantizeConfig | None = None,
    export: Any = None,
    split: str = "test",
    batch: int = 64,
    iters: int = 10,
) -> Int8Section:
    """Dense fp32, dense int8, compressed fp32, compressed int8: test top-1, file size, latency at batch
    1 and throughput at ``batch``, all four timed interleaved in one process (fp32: PyTorch eager, as
    the pipeline's report times it; int8: ONNX Runtime on the CPU). Each batch is timed in one pass
    with both runtimes at their default thread counts and one with both on one thread; each row keeps
    its faster figure and records its count (``latency_threads``, ``throughput_threads``): a small
    model at batch 1 is often fastest on one thread.

    The dense int8 file is made here (:func:`quantize_run` with ``config`` and ``export``, into a
    temporary folder); ``compressed_int8`` is the export step's file (None: made here too). A model
    whose int8 file fails its check gets a row with the reason and no figures. The section's keys
    (the summary's ``int8``): ``split``, ``images``, ``latency_batch``, ``throughput_batch``,
    ``iters`` and the ``rows``, a :class:`Int8Row` each."""
    runs = {"dense": Path(dense_run), "compressed": Path(compressed_run)}
    rows: list[dict[str, Any]] = []  # (each filled in as it is timed, a record at the end)
    default = torch.get_num_threads()
    calls: dict[int, list[Any]] = {n: [] for n in dict.fromkeys((default, 1))}  # per thread count timed
    labels: list[int] = []
    with tempfile.TemporaryDirectory(prefix="nascompress-int8-rows-") as tmp:
        files: dict[str, Path | str] = {}
        for k, run in runs.items():
            model, arch = load_typed(run)
            spec = InputSpec.from_dict(dict(arch.input))
            ds = load_data(data, spec=spec, augment=False).split(split)
            idx = list(range(len(ds)))
            with torch.inference_mode():
                hits = sum(int((model(x).argmax(-1) == y).sum()) for x, y in labelled_batches(ds, idx, spec, batch))
            weights = run / MODEL_FILE if run.is_dir() else run
            rows.append(
                {
                    "model": f"{k} fp32",
                    "runtime": f"PyTorch {torch.__version__} (eager)",
                    "test_top1": 100 * hits / len(ds),
                    "test_n": len(ds),
                    "file_bytes": weights.stat().st_size,
                }
            )
            for n in calls:
                calls[n].append(lambda x, m=model: m(x))
            labels.append(len(rows) - 1)
            q = Path(compressed_int8) if k == "compressed" and compressed_int8 is not None else None
            if q is None:
                q = Path(tmp) / f"{k}.int8.onnx"
                try:
                    quantize_run(run, out=q, config=config, export=export, data=data, force=True)
                except NascompressError as e:
                    rows.append({"model": f"{k} int8", "runtime": "onnxruntime", "failed": str(e)})
                    continue
            runner, desc = onnx_runner(q, spinning=False)  # timed beside PyTorch (see onnx_runner)
            hits = sum(int((runner([x])[0].argmax(-1) == y).sum()) for x, y in labelled_batches(ds, idx, spec, batch))
            rows.append(
                {
                    "model": f"{k} int8",
                    "runtime": desc,
                    "test_top1": 100 * hits / len(ds),
                    "test_n": len(ds),
                    "file_bytes": q.stat().st_size,
                }
            )
            files[k] = q
            calls[default].append(lambda x, r=runner: r([x]))  # ORT's own default thread count
            if default != 1:
                one = onnx_runner(q, threads=1, spinning=False)[0]
                calls[1].append(lambda x, r=one: r([x]))
            labels.append(len(rows) - 1)
        shape = (spec.in_chans, *spec.img_size)
        g = torch.Generator().manual_seed(0)
        with torch.inference_mode():
            for bs, key, tkey in ((1, "latency_ms", "latency_threads"), (batch, "throughput", "throughput_threads")):
                times = time_models_by_threads(calls, torch.randn(bs, *shape, generator=g), warmup=2, iters=iters)
                for j, i in enumerate(labels):  # each row at its faster count (the default one on a tie)
                    n = min(calls, key=lambda n: times[n][j])
                    rows[i][key] = 1e3 * times[n][j] if key == "latency_ms" else bs / times[n][j]
                    rows[i][tkey] = "default" if n == default else n
    return Int8Section.new(
        split=split,
        images=len(ds),
        latency_batch=1,
        throughput_batch=batch,
        iters=iters,
        rows=tuple(Int8Row.new(**r) for r in rows),
    )


__all__ = ["Int8Row", "Int8Section", "int8_rows"]
