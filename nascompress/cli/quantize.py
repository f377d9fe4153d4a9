"""``nascompress quantize RUN --out DIR``: an int8 ONNX file of a (compressed) model, checked on the
validation split (thin: options generated from QuantizeConfig)."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from nascompress.cli.common import command_signature, out, print_json, run, setting_params, setting_values

QUANTIZED_FILE = "model.int8.onnx"


def _options(
    run_dir: Annotated[Path, typer.Argument(
        help="A run directory (or model.safetensors) that nascompress.load reads.")],
    out_dir: Annotated[Path, typer.Option("--out", help=f"Directory to write {QUANTIZED_FILE} and its sidecar "
                                                        f"{QUANTIZED_FILE}.json into.")],
    # (here: QuantizeConfig's settings: --scheme --calib-images --max-drop --eval-images --no-fallback)
    dataset: Annotated[Optional[str], typer.Option(help="The dataset of the calibration and the check (default: "
                                                        "the run's).")] = None,
    data_dir: Annotated[Optional[str], typer.Option(
        help="Where Fashion-MNIST's IDX files are (with --dataset).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace existing files.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print the sidecar as JSON.")] = False,
) -> None:
    """``quantize``'s own options; QuantizeConfig's are generated before ``--dataset``."""


def quantize(**kw: Any) -> None:
    """Quantize a dense or compressed model to int8 ONNX (ONNX Runtime's tooling), check its top-1 on the
    validation split against the fp32 file, and keep it only within --max-drop (recorded in FILE.json)."""
    from nascompress.data import DataConfig
    from nascompress.export.quantize import QuantizeConfig, quantize_run

    cfg = run(lambda: QuantizeConfig(**setting_values(QuantizeConfig, kw)))
    data = None
    if kw["dataset"] is not None or kw["data_dir"] is not None:  # the run's data settings, another dataset
        from dataclasses import replace

        from nascompress.api import run_data_config

        given = {k: kw[k] for k in ("dataset", "data_dir") if kw[k] is not None}
        data = run(lambda: replace(run_data_config(kw["run_dir"]) or DataConfig(), **given))
    target = Path(kw["out_dir"]) / QUANTIZED_FILE
    side = run(quantize_run, kw["run_dir"], out=target, config=cfg, data=data, force=kw["force"])
    if kw["json_out"]:
        print_json(side)
        return
    q, v = side["quantization"], side["verification"]
    if q["fallback"]:
        out.print(f"fallback: {q['fallback']}", highlight=False, soft_wrap=True)
    kept = ", ".join(f"{n} {why}" for why, n in q["kept_fp32_summary"].items())
    calib = f", calibrated on {q['calibration']['images']} training images" if q["calibration"] else ""
    out.print(f"wrote {target} + {target.name}.json ({q['scheme']}{calib}; {q['quantized_nodes']} layers int8, kept "
              f"fp32: {kept})  check on {v['n']} {v['dataset']} validation images: top-1 {v['fp32_top1']:.2f}% fp32 "
              f"-> {v['int8_top1']:.2f}% int8 (drop {v['top1_drop']:.2f} pts <= {v['max_drop']:g}), agreement "
              f"{v['top1_agreement']:.1f}%, max |logit diff| {v['max_abs_logit_diff']:.3g}", highlight=False,
              soft_wrap=True)


def register(app: typer.Typer) -> None:
    from nascompress.export.quantize import QuantizeConfig

    sig = command_signature(_options, {"dataset": setting_params(QuantizeConfig)})
    quantize.__signature__ = sig  # type: ignore[attr-defined]
    app.command()(quantize)
