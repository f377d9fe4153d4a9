"""``export_run``: a saved model -> a checked deployment file and its sidecar (see the package doc)."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator
import shutil

import torch

from ..errors import NascompressError, SettingError, literal, require_extra
from ..limits import check_path_names
from ..runs.io import ARCH_FILE, MODEL_FILE, file_sha256, load_with_arch, read_arch
from ..data import InputSpec, eval_steps
from ..progress import say
from ..runs.files import Sidecar, sidecar_path, write_sidecar_json
from ..runs.json_io import atomic_path
from ..runs.out_dir import refuse_overwriting_inputs
from .config import ExportConfig
from .graphs import TWO_STAGE, check_exportable, graphs_for, write_graph
from .paths import traceable_copy
from .verify import runner_for, verify, with_exit_rule
from ..models.build import input_size
from ..profiling import count_flops
from ..profiling.records import StageFlops
from ..runs.records import TypedRecord
from ..profiling.latency import compile_problem

SIDECAR_FORMAT = "nascompress-export/1"
TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
ONNX_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def stage_path(out: str | Path, role: str) -> Path:
    """Where a graph of ``role`` goes: ``FILE`` itself, or MG-ViT's second stage ``<stem>.mgis<suffix>``."""
    out = Path(out)
    return out if role in ("model", "sgis") else out.with_name(f"{out.stem}.{role}{out.suffix}")


BESIDE_BYTES = 19  # what the files written beside FILE add to its name: ``.json``, ``.<name>.XXXXXXXX.tmp``


def check_out_file(out: str | Path) -> Path:
    """``out`` as the file an export writes, refused in one line (naming ``{out}``) when it names no
    file (``/``, ``.``, ``dir/..``) or a name its file system cannot hold with the files written beside
    it (the sidecar ``FILE.json``, MG-ViT's ``<stem>.mgis<suffix>``, the atomic writes' temp files)."""
    out = Path(out)
    if out.name in ("", ".", ".."):
        raise SettingError(
            f"{{out}} {literal(str(out))} is a directory, not a file to write; give a file name such as "
            f"{literal(str(out / 'model.onnx'))}"
        )
    check_path_names(out, extra=BESIDE_BYTES)
    return out


def check_outputs(paths: list[Path], *, force: bool, run: str | Path | None = None) -> list[Path]:
    """Refuse existing files (without force), unwritable places and (even with force) a file of the
    model ``run`` being read; return the folders to create."""
    for p in paths:  # (each name as its atomic write's temp file makes it longer: ".<name>.XXXXXXXX.tmp")
        check_path_names(p, extra=BESIDE_BYTES - len(".json"))
    if run is not None:
        d = Path(run) if Path(run).is_dir() else Path(run).parent
        inputs = (run, d / MODEL_FILE, d / ARCH_FILE) if Path(run).is_dir() else (run, d / ARCH_FILE)
        for p in paths:
            refuse_overwriting_inputs(p, inputs)
    for p in paths:
        if p.exists() and (not force or not p.is_file()):
            why = "is not a file" if not p.is_file() else "already exists; pass {force} to replace it"
            raise SettingError(f"{p} {why}")
    parent = paths[0].parent
    missing = []
    while not parent.exists():
        missing.append(parent)
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise SettingError(f"cannot write {paths[0]}: {parent} is not a writable directory; choose another {{out}}")
    return missing[::-1]


def clear_stale(out: Path) -> None:
    """Remove what an export or quantize of ``out`` killed mid-write (kill -9) left beside it: the
    temp files of its atomic writes (``.<name>.*.tmp``, the sidecar's too) and quantize's work
    folder (``.<name>.quantize-*``)."""
    if not out.parent.is_dir():
        return
    for p in out.parent.glob(f".{out.name}.*"):
        if p.name.endswith(".tmp") and p.is_file():
            p.unlink(missing_ok=True)
        elif p.name.startswith(f".{out.name}.quantize-") and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)


@contextlib.contextmanager
def new_folders(created: list[Path]) -> Iterator[None]:
    """Create the missing folders of an output (:func:`check_outputs`) and remove them again if
    writing the output fails, so a failed command leaves nothing behind."""
    for p in created:
        p.mkdir()
    try:
        yield
    except BaseException:
        for p in reversed(created):
            with contextlib.suppress(OSError):
                p.rmdir()
        raise


@dataclass(frozen=True, kw_only=True)
class ExportFlops(TypedRecord):
    """The exported model's cost (the sidecar's ``flops``): MACs and GFLOPs per image, parameters, the
    counting convention, and an MG-ViT's per-stage MACs (an exiting image pays stage 1 only)."""

    NEW_SOURCE = "the export's {name}"

    macs_per_image: float
    gflops_per_image: float
    params: int
    convention: str
    stages: StageFlops | None = None


def _flops(model: torch.nn.Module, x1: torch.Tensor) -> ExportFlops:
    rep = count_flops(model, x1)
    flops = ExportFlops.new(
        macs_per_image=rep.total,
        gflops_per_image=rep.gflops,
        params=rep.params,
        convention="1 multiply-add = 1 FLOP, attention matmuls included",
    )
    if hasattr(model, "stage_flops"):  # MG-ViT: per-stage costs (an exiting image pays stage 1 only)
        flops = flops.set(stages=StageFlops.new(**model.stage_flops()))
    return flops


def _io_spec(names: tuple[str, ...], tensors: tuple[torch.Tensor, ...], batch: Any, dtype: str) -> list[dict]:
    return [
        {
            "name": n,
            "shape": [batch, *t.shape[1:]],
            "dtype": ONNX_DTYPES[dtype] if t.is_floating_point() else str(t.dtype).replace("torch.", ""),
        }
        for n, t in zip(names, tensors)
    ]


def _both_stages(model: torch.nn.Module) -> Any:
    """MG-ViT in PyTorch: (stage 1 logits; stage 2 logits) of every image, stacked (2B, classes)."""
    return lambda x: torch.cat(model.forward_both(x), 0)


def _both_files(stage1: Any, stage2: Any) -> Any:
    """The two stage files run on every image, stacked as :func:`_both_stages`."""

    def run(inputs):
        (x,) = inputs
        logits, *carry = stage1([x])
        return [torch.cat([logits, stage2([x, *carry])[0]], 0)]

    return run


def export_run(run: str | Path, *, out: str | Path, config: ExportConfig | None = None, force: bool = False) -> Sidecar:
    """Export the model saved in ``run`` to ``out`` and check it; returns the sidecar, as written to
    ``out + ".json"`` (its ``verification``: the :class:`~nascompress.deploy.verify.Check`'s dict).

    Args:
        run: a run directory (or ``model.safetensors``) that :func:`nascompress.load` reads.
        out: the file to write (``.onnx``, or ``.pt2`` for torch-export and aoti, by convention); the
            sidecar is ``out + ".json"`` (MG-ViT: stage 1 in ``out``, stage 2 in ``<stem>.mgis<suffix>``).
        config: format, batch, dtype, opset, tolerance, verification batch.
        force: replace existing files.

    A ``config.quantize`` is refused here: :func:`nascompress.deploy.export_run` sends such a config to
    :func:`~nascompress.deploy.quantize.quantize_run`, which exports through this function first.
    """
    cfg = config or ExportConfig()
    if cfg.quantize != "none":
        raise NascompressError(
            "nascompress.deploy.run.export_run writes fp32/fp16/bf16 files; quantized files come "
            "from nascompress.deploy.export_run or nascompress.deploy.quantize.quantize_run"
        )
    if cfg.format == "onnx":
        require_extra("export", ("onnx", "onnxscript", "onnxruntime"), what="ONNX export")
    if cfg.format == "aoti" and (why := compile_problem(torch.device("cpu"))):
        raise SettingError(f"{{format}} aoti compiles the model to C++ like torch.compile: {literal(why)}")
    recorded = read_arch(run)  # a missing or unreadable run is reported here, before anything else
    weights = Path(run) / MODEL_FILE if Path(run).is_dir() else Path(run)
    check_exportable(recorded, dynamic=cfg.dynamic)
    roles = ("sgis", "mgis") if any(name in TWO_STAGE for name in recorded.method_names) else ("model",)
    out = check_out_file(out)
    files = [stage_path(out, r) for r in roles]
    created = check_outputs([*files, sidecar_path(out)], force=force, run=run)
    for f in files:
        clear_stale(f)
    model, _ = load_with_arch(run)
    dtype = TORCH_DTYPES[cfg.dtype]
    shape = input_size(model)
    g = torch.Generator().manual_seed(cfg.seed)
    x = torch.randn(cfg.verify_batch if cfg.dynamic else cfg.batch, *shape, generator=g)  # the check's batch
    example = torch.randn(2 if cfg.dynamic else cfg.batch, *shape, generator=g)  # traced (2: no size-1 special case)
    flops = _flops(model, x[:1])
    ref = traceable_copy(model, dtype=dtype)  # what is traced, and the PyTorch side of the check
    say(f"export: tracing the model for {cfg.format} ...")
    graphs, rule = graphs_for(ref, example.to(dtype))
    t0 = time.perf_counter()
    with new_folders(created):
        with contextlib.ExitStack() as stack:
            tmps = [stack.enter_context(atomic_path(f)) for f in files]
            side_tmp = stack.enter_context(atomic_path(sidecar_path(out)))  # every file appears together
            written = [
                write_graph(gr, tmp, fmt=cfg.format, dynamic=cfg.dynamic, opset=cfg.opset)
                for gr, tmp in zip(graphs, tmps)
            ]
            export_s = time.perf_counter() - t0
            say(f"export: written in {export_s:.1f} s; checking the file against the PyTorch model ...")
            runners = [runner_for(tmp, cfg.format) for tmp in tmps]
            run_fn = runners[0][0] if rule is None else with_exit_rule(runners[0][0], runners[1][0], rule.epsilon)
            batches = [x.to(dtype), x[:1].to(dtype)] if cfg.dynamic and len(x) > 1 else [x.to(dtype)]
            model.to(dtype)
            check = verify(model, run_fn, batches, tolerance=cfg.tol)
            if rule is not None:  # each stage on every image, whatever the exit rule picked
                stages = verify(
                    _both_stages(model), _both_files(runners[0][0], runners[1][0]), batches, tolerance=cfg.tol
                )
                check = check.set(stages=stages, passed=check.passed and stages.passed)
            check = check.set(
                runtime=runners[0][1], seed=cfg.seed, inputs="standard normal images (already normalised)"
            )
            if not check.passed:
                hint = (
                    "; a top-k over tied scores (e.g. an uncalibrated Sparsifiner predictor) can select other "
                    "tokens in another runtime"
                    if recorded.methods
                    else ""
                )
                raise NascompressError(
                    f"the exported file differs from the PyTorch model: max |logit difference| "
                    f"{check.max_abs_diff:.3g} > {cfg.tol:g} x max(1, {check.logit_scale:.3g}), top-1 "
                    f"agreement {100 * check.top1_agreement:.1f}%{hint}; nothing was written"
                )
            batch = "batch" if cfg.dynamic else cfg.batch
            side = {  # the file's keys in its order (a record keeps them)
                "format": SIDECAR_FORMAT,
                "file": files[0].name,
                "runtime": cfg.format,
                "files": [
                    {
                        "file": f.name,
                        "stage": gr.role,
                        "inputs": _io_spec(gr.input_names, gr.inputs, batch, cfg.dtype),
                        "outputs": list(gr.output_names),
                        **w.to_dict(),
                    }
                    for f, gr, w in zip(files, graphs, written)
                ],
                "batch": cfg.batch,
                "dtype": cfg.dtype,
                "input": {
                    **recorded.input,
                    "layout": "NCHW",
                    "value": "(pixel / 255 - mean) / std per channel, "
                    "after resizing to img_size with interpolation (ImageFolder: crop_pct / crop_mode first)",
                    "steps": eval_steps(InputSpec.from_dict(dict(recorded.input))),
                },
                "num_classes": int(model.num_classes),
                "id2label": ({str(i): name for i, name in enumerate(recorded.labels)} if recorded.labels else None),
                "flops": flops.to_dict(),
                "model": dict(recorded.model),
                "methods": [
                    {"name": m.name, "config": m.get("config", {}), **({"stage": m.stage} if "stage" in m else {})}
                    for m in recorded.methods
                ],
                "exit_rule": None if rule is None else rule.to_dict(),
                "source": {"run": str(run), "weights": weights.name, "sha256": file_sha256(weights)},
                "verification": check.to_dict(),
                "exporter": {
                    "torch": torch.__version__,
                    "export_seconds": round(export_s, 2),
                    "settings": cfg.to_dict(),
                },
                "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            }
            sidecar = Sidecar.from_dict(side, source=str(sidecar_path(out)))
            write_sidecar_json(side_tmp, sidecar)
    return sidecar


__all__ = ["ExportFlops", "export_run", "stage_path", "SIDECAR_FORMAT"]
