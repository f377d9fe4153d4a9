"""``nascompress quantize``: int8 ONNX on top of the (compressed) model, checked on real data.

:func:`quantize_run` exports the model as fp32 ONNX (:func:`~nascompress.deploy.export_run`: the
file is checked against PyTorch first), quantizes it with ONNX Runtime's quantization tooling and
keeps the result only when its accuracy on the run's validation split is within ``max_drop`` top-1
points of the fp32 file it came from.

Schemes (ONNX Runtime's names in brackets):

* ``int8-static``: weights int8 per output channel, activations uint8 with scales calibrated
  (min/max) on ``calib_images`` images of the run's own training split, preprocessed exactly as the
  model is evaluated (QDQ format; each linear layer becomes one ``Gemm`` with its bias, which ORT runs
  as an int8 ``QGemm`` with an fp32 output: no requantization between the GEMM and its bias).
* ``int8-dynamic``: weights int8 per output channel, activation scales computed per batch at run time
  (``DynamicQuantizeLinear`` + ``MatMulInteger``): no calibration, usually milder.

What is quantized: the linear layers (MatMul/Gemm with a constant weight) of the blocks; also a
token method's predictor layers where they are in the blocks. What stays fp32 (each recorded by
node and module in the sidecar): the patch embedding (Conv), the classifier head, the attention
matmuls between activations (QK^T, AV), Softmax, LayerNorm, GELU and the token selection ops
(TopK, Gather, DCS's channel gathers). When the check fails and ``fallback`` is on, milder levels are
tried in turn: the first and last blocks' linear layers kept fp32 as well, then the dynamic scheme
(with the same two levels); the sidecar records every attempt and which one was kept. When no
attempt is within ``max_drop`` the command fails with the figures and writes nothing.

The sidecar (``FILE.json``) is the export's (input and preprocessing, FLOPs, methods, source) with
``dtype: int8``, a ``quantization`` section (scheme, calibration set, kept-fp32 layers, attempts)
and ``verification``: the accuracy check on the validation split (top-1 of both, the drop, top-1
agreement, max |logit difference|). The fp32 export's own check is under ``fp32_verification``.

MG-ViT (two graphs and an exit rule that reads softmax confidences) is refused: int8 logits move the
exit decisions, which this check does not cover.
"""

from __future__ import annotations

import contextlib
import re
import tempfile
import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from ..errors import NascompressError, SettingError
from .config import ExportConfig, QuantizeConfig  # declared once there
from .graphs import TWO_STAGE, quiet
from .precision import LINEAR_OPS, linears_as_gemm, plan_precision, summarise_kept  # noqa: F401 (plan_precision: read from here too)
from ..runs.run_config import run_data_config
from ..data import InputSpec, Subset, dataset_labels, load_data, make_loader, preprocess, stratified_indices
from ..runs.io import read_arch
from ..runs.files import Quantization, Record, Sidecar, as_is, sidecar_path, write_sidecar_json
from ..runs.json_io import atomic_path
from .run import check_out_file, check_outputs, clear_stale, export_run, new_folders
from .verify import AccuracyCheck, accuracy_check, onnx_runner


# ---------------------------------------------------------------------------------------------
# Data: calibration images and the validation split, with the run's preprocessing


def _run_data(run: str | Path, data: Any) -> Any:
    d = data or run_data_config(run)
    if d is None:
        raise SettingError(
            f"{run} records no dataset (its config.json has no 'data'); give the dataset the "
            "model was trained on ({dataset})"
        )
    return d


def labelled_batches(
    ds: Any, idx: list[int], spec: Any, batch_size: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The images ``idx`` of ``ds`` in batches, preprocessed as the model is evaluated, with their labels."""
    loader = make_loader(Subset(ds, torch.as_tensor(idx)), batch_size=batch_size, shuffle=False)
    for xb, yb in loader:
        yield preprocess(xb, spec), torch.as_tensor(yb)


def calibration_batches(bundle: Any, spec: Any, cfg: QuantizeConfig) -> tuple[list[np.ndarray], int]:
    """``calib_images`` class-stratified training images (eval transform), preprocessed, as batches."""
    n = min(cfg.calib_images, len(bundle.train))
    idx = (
        stratified_indices(dataset_labels(bundle.train), n, seed=cfg.seed).tolist()
        if n < len(bundle.train)
        else list(range(n))
    )
    return [x.numpy() for x, _ in labelled_batches(bundle.train, idx, spec, cfg.batch_size)], n


def _reader(name: str, batches: list[np.ndarray]) -> Any:
    """ONNX Runtime's CalibrationDataReader over preprocessed batches (input ``name``)."""
    from onnxruntime.quantization import CalibrationDataReader  # optional (nascompress[export])

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self._it = iter([{name: b} for b in batches])

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self._it, None)

    return Reader()


# ---------------------------------------------------------------------------------------------
# Quantizing and checking


# ONNX Runtime 1.30's int8 kernels refuse the per-channel graphs written here (QLinearMatMul: "weight zero
# point must be a scalar"; the static scheme fails shape inference); 1.32 is the oldest version that passes
# the tests (the GPU image's 1.30 showed it)
ORT_MIN = (1, 32)


def check_onnxruntime() -> None:
    """A one-line error unless ONNX Runtime's quantization tools are installed at :data:`ORT_MIN` or newer."""
    try:
        import onnx  # noqa: F401  optional (nascompress[export])
        import onnxruntime  # optional (nascompress[export])
        import onnxruntime.quantization  # noqa: F401  optional (nascompress[export])
    except ModuleNotFoundError:
        raise NascompressError("onnxruntime is not installed; pip install 'nascompress[export]'") from None
    have = tuple(int(p) for p in re.findall(r"\d+", onnxruntime.__version__)[:2])
    if have < ORT_MIN:
        need = ".".join(map(str, ORT_MIN))
        raise NascompressError(
            f"onnxruntime {onnxruntime.__version__} is older than {need}, whose int8 kernels this "
            f"quantization needs; pip install 'onnxruntime>={need}'"
        )


@contextlib.contextmanager
def temp_folders_in(folder: Path) -> Iterator[None]:
    """Python's temporary folders made in ``folder`` meanwhile instead of ``$TMPDIR``: ONNX Runtime's
    quantizer makes its own (``ort.quant.*``, the augmented model of the calibration in it) and takes
    no folder for them, so a quantize killed with kill -9 leaves them in nascompress's work folder,
    which the next run removes (:func:`~nascompress.deploy.run.clear_stale`)."""
    saved = tempfile.tempdir
    tempfile.tempdir = str(folder)
    try:
        yield
    finally:
        tempfile.tempdir = saved


def quantize_file(
    src: Path,
    dst: Path,
    *,
    scheme: str,
    nodes: list[str],
    calib: list[np.ndarray] | None,
    work: Path | None = None,
) -> None:
    """Quantize the fp32 ONNX file ``src`` into ``dst`` (only ``nodes``), with ORT's tooling, its
    temporary folders in ``work`` (default: ``dst``'s folder; :func:`temp_folders_in`)."""
    import onnx  # optional (nascompress[export])
    from onnxruntime.quantization import (
        QuantFormat,
        QuantType,
        quantize_dynamic,
        quantize_static,
    )  # optional (nascompress[export])

    with quiet(), temp_folders_in(work or Path(dst).parent):
        if scheme == "int8-dynamic":
            quantize_dynamic(
                src,
                dst,
                op_types_to_quantize=list(LINEAR_OPS),
                nodes_to_quantize=nodes,
                per_channel=True,
                weight_type=QuantType.QInt8,
            )
            return
        model = onnx.load(str(src))
        linears_as_gemm(model, nodes)  # one QGemm per linear layer, bias inside (see linears_as_gemm)
        prepared = Path(dst).with_name(Path(dst).name + ".gemm.onnx")
        onnx.save(model, str(prepared))
        try:
            quantize_static(
                prepared,
                dst,
                _reader(model.graph.input[0].name, calib or []),
                quant_format=QuantFormat.QDQ,
                op_types_to_quantize=list(LINEAR_OPS),
                nodes_to_quantize=nodes,
                per_channel=True,
                activation_type=QuantType.QUInt8,
                weight_type=QuantType.QInt8,
                extra_options={
                    "WeightSymmetric": True,
                    "ActivationSymmetric": False,
                    # fp32 out of the int8 GEMM: no requantize + dequantize pair
                    # (a MatMul left as it is keeps its pair: ORT's fused
                    # MatMulIntegerToFloat refuses per-channel weights of some)
                    "OpTypesToExcludeOutputQuantization": ["Gemm"],
                },
            )
        finally:
            prepared.unlink(missing_ok=True)


def _logits(runner: Any, batches: Any) -> torch.Tensor:
    return torch.cat([runner([x])[0].float() for x, _ in batches])


@dataclass(frozen=True, kw_only=True)
class Attempt(Record):
    """One scheme and level tried: the layers it quantized, those kept fp32, its time and its check
    (the sidecar's ``quantization.attempts``, without ``kept_fp32``)."""

    scheme: str
    level: int
    quantized_nodes: int
    kept_fp32: list[dict[str, Any]]
    seconds: float
    check: AccuracyCheck

    CHECKS = {
        **{k: as_is for k in ("scheme", "level", "quantized_nodes", "kept_fp32", "seconds")},
        "check": lambda v, where: AccuracyCheck.from_dict(v, source=where),
    }

    def describe(self) -> str:
        """The attempt and its figures in one line (the error of a quantize that keeps none)."""
        c = self.check
        return (
            f"{self.scheme} (level {self.level}): top-1 {c.fp32_top1:.2f}% -> {c.int8_top1:.2f}% "
            f"(drop {c.top1_drop:.2f} pts), agreement {c.top1_agreement:.1f}%, max |logit diff| "
            f"{c.max_abs_logit_diff:.3g}"
        )


def quantize_run(
    run: str | Path,
    *,
    out: str | Path,
    config: QuantizeConfig | None = None,
    export: Any = None,
    data: Any = None,
    force: bool = False,
) -> Sidecar:
    """Quantize the model saved in ``run`` to the int8 ONNX file ``out`` and check it; returns the
    sidecar, as written to ``out + ".json"``.

    Args:
        run: a run directory (or ``model.safetensors``) that :func:`nascompress.load` reads.
        out: the int8 ONNX file to write; its sidecar is ``out + ".json"``.
        config: scheme, calibration images, allowed drop, check images, fallback.
        export: the :class:`~nascompress.deploy.ExportConfig` of the fp32 export it starts from (format
            onnx, dtype fp32; None: the defaults).
        data: the dataset (a :class:`~nascompress.data.DataConfig`) of the calibration and the check
            (None: the run's, from its config.json).
        force: replace existing files.
    """
    cfg = config or QuantizeConfig()
    ecfg = replace(export or ExportConfig(), quantize="none")
    if ecfg.format != "onnx" or ecfg.dtype != "fp32":
        raise SettingError("int8 quantization starts from the fp32 ONNX export: use {format} onnx {dtype} fp32")
    arch = read_arch(run)
    two_stage = [name for name in arch.method_names if name in TWO_STAGE]
    if two_stage:  # mgvit, mgvit-h: two graphs and an exit rule
        raise NascompressError(
            f"MG-ViT is not quantized ({two_stage[0]}: two graphs and an exit rule): the rule reads "
            "the softmax confidence, which int8 moves and this check does not cover; export it in "
            "fp32 or fp16 (nascompress export)"
        )
    check_onnxruntime()
    import onnx  # optional (nascompress[export])

    out = check_out_file(out)  # a file name (not "/"), one its file system holds
    created = check_outputs([out, sidecar_path(out)], force=force, run=run)
    data_cfg = _run_data(run, data)
    if cfg.eval_images is not None:
        data_cfg = replace(data_cfg, eval_limit=cfg.eval_images, subset_seed=cfg.seed)
    spec = InputSpec.from_dict(dict(arch.input))
    bundle = load_data(data_cfg, spec=spec, augment=False)
    t0 = time.perf_counter()
    clear_stale(out)  # what a quantize of this output killed with kill -9 left
    with new_folders(created), tempfile.TemporaryDirectory(prefix=f".{out.name}.quantize-", dir=out.parent) as tmp:
        # (beside the output: a killed run leaves nothing outside --out, and the next run removes it)
        fp32 = Path(tmp) / "fp32.onnx"
        side = export_run(run, out=fp32, config=ecfg, force=True)
        if (classes := side.get("num_classes")) != bundle.num_classes:
            raise SettingError(
                f"the model has {classes} classes but dataset {bundle.name} has "
                f"{bundle.num_classes}; give the dataset it was trained on ({{dataset}})"
            )

        def val() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:  # preprocessed again per pass (memory)
            return labelled_batches(bundle.val, list(range(len(bundle.val))), spec, cfg.batch_size)

        labels = torch.cat([y for _, y in val()])
        ref = _logits(onnx_runner(fp32)[0], val())
        calib, n_calib = None, 0
        proto = onnx.load(str(fp32))
        attempts: list[Attempt] = []
        with atomic_path(out) as tmp_out, atomic_path(sidecar_path(out)) as tmp_side:
            chosen = None
            for scheme, level in cfg.attempts():
                nodes, kept = plan_precision(proto, level)
                if not nodes:  # nothing left to quantize at this level (level 1 of a 2-block model)
                    if level == 0:
                        raise NascompressError("the model has no linear layer with constant weights to quantize")
                    continue
                if scheme == "int8-static" and calib is None:
                    calib, n_calib = calibration_batches(bundle, spec, cfg)
                q = Path(tmp) / f"{scheme}.{level}.onnx"
                t1 = time.perf_counter()
                quantize_file(
                    fp32,
                    q,
                    scheme=scheme,
                    nodes=nodes,
                    calib=calib if scheme == "int8-static" else None,
                    work=Path(tmp),
                )
                got = _logits(onnx_runner(q)[0], val())
                a = Attempt(
                    scheme=scheme,
                    level=level,
                    quantized_nodes=len(nodes),
                    kept_fp32=kept,
                    seconds=round(time.perf_counter() - t1, 2),
                    check=accuracy_check(ref, got, labels, max_drop=cfg.max_drop),
                )
                attempts.append(a)
                if a.check.passed:
                    chosen = (a, q)
                    break
            if chosen is None:
                tried = "; ".join(a.describe() for a in attempts)
                raise SettingError(
                    f"int8 costs more than {{max_drop}} {cfg.max_drop:g} top-1 points on the validation split "
                    f"({len(labels)} images): {tried}; nothing was written (allow a larger {{max_drop}}, or deploy "
                    "the fp32 export)"
                )
            a, q = chosen
            tmp_out.write_bytes(q.read_bytes())
            fallback = None
            if (a.scheme, a.level) != (cfg.scheme, 0):
                fallback = (
                    f"{cfg.scheme} dropped {attempts[0].check.top1_drop:.2f} top-1 points "
                    f"(> {cfg.max_drop:g}); kept the milder {a.scheme} at level {a.level}"
                    f"{' (first and last blocks fp32)' if a.level else ''}"
                )
            side = _sidecar(
                side, out, run, cfg, ecfg, a, attempts, fallback, bundle, data_cfg, n_calib, time.perf_counter() - t0
            )
            write_sidecar_json(tmp_side, side)
    return side


def _sidecar(
    side: Sidecar,
    out: Path,
    run: Any,
    cfg: QuantizeConfig,
    ecfg: Any,
    chosen: Attempt,
    attempts: list[Attempt],
    fallback: str | None,
    bundle: Any,
    data_cfg: Any,
    n_calib: int,
    seconds: float,
) -> Sidecar:
    """The int8 file's sidecar from the fp32 export's ``side``: its keys in their places, its
    ``verification`` as ``fp32_verification``, then the int8 check and the ``quantization``."""
    import onnxruntime as ort  # optional (nascompress[export])

    check = chosen.check.set(
        split="val",
        dataset=bundle.name,
        reference="the fp32 ONNX export of the same run (checked against PyTorch: fp32_verification)",
        runtime=f"onnxruntime {ort.__version__} (CPUExecutionProvider)",
    )
    static = chosen.scheme == "int8-static"
    quantization = {
        "scheme": chosen.scheme,
        "level": chosen.level,
        "requested": cfg.scheme,
        "fallback": fallback,
        "weights": "int8, symmetric, per output channel",
        "activations": (
            "uint8, asymmetric, scales calibrated (min/max) and fixed"
            if static
            else "uint8, scales computed per batch at run time (DynamicQuantizeLinear)"
        ),
        "format": (
            "QDQ (QuantizeLinear/DequantizeLinear pairs); linear layers as Gemm with the bias, fp32 outputs "
            "(ONNX Runtime: QGemm)"
        )
        if static
        else "MatMulInteger",
        "calibration": (
            {
                "split": "train",
                "images": n_calib,
                "seed": cfg.seed,
                "dataset": bundle.name,
                "train_limit": data_cfg.train_limit,
                "method": "MinMax",
                "preprocessing": "the model's own (the sidecar's input), no augmentation",
            }
            if static
            else None
        ),
        "quantized_nodes": chosen.quantized_nodes,
        "kept_fp32": chosen.kept_fp32,
        "kept_fp32_summary": summarise_kept(chosen.kept_fp32),
        "also_fp32": "GELU, residual adds and the token selection ops (TopK, Gather): only MatMul/Gemm are quantized",
        "attempts": [{k: v for k, v in a.to_dict().items() if k != "kept_fp32"} for a in attempts],
        "settings": cfg.to_dict(),
        "tool": f"onnxruntime.quantization {ort.__version__}",
    }
    fp32 = replace(side, verification=None).without("verification")  # (after the others: fp32_verification)
    return fp32.set(
        file=out.name,
        files=tuple(dict(f, file=out.name) for f in side.files),
        dtype="int8",
        fp32_verification=side.verification,
        verification=check.to_dict(),
        quantization=Quantization.from_dict(quantization, source=f"{sidecar_path(out)}: quantization"),
        exporter=dict(side.get("exporter"), settings=ecfg.to_dict(), quantize_seconds=round(seconds, 2)),
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        source=dict(side.get("source"), run=str(run)),
    )


__all__ = ["Attempt", "quantize_run", "quantize_file", "temp_folders_in", "calibration_batches"]
