"""``nascompress quantize RUN --out DIR``: an int8 ONNX file of a (compressed) model, checked on the
validation split (thin: options generated from QuantizeConfig)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from nascompress.cli.common import out, print_json, run, settings_command
from nascompress.cli.options import Force, JsonOut, RunDataDir, RunDataset, out_option
from nascompress.deploy.config import QuantizeConfig
from nascompress.deploy.quantize import quantize_run
from nascompress.deploy.verify import sidecar_check
from nascompress.runs.run_config import run_data_config
from nascompress.data.choose import data_config_for

QUANTIZED_FILE = "model.int8.onnx"


@settings_command(settings=QuantizeConfig)
def quantize(
    run_dir: Annotated[
        Path, typer.Argument(help="A run directory (or model.safetensors) that nascompress.load reads.")
    ],
    out_dir: out_option(f"Directory to write {QUANTIZED_FILE} and its sidecar {QUANTIZED_FILE}.json to."),
    *,
    settings: QuantizeConfig,  # --scheme --calib-images --max-drop --eval-images --no-fallback
    dataset: RunDataset = None,
    data_dir: RunDataDir = None,
    force: Force = False,
    json_out: JsonOut = False,
) -> None:
    """Quantize a dense or compressed model to int8 ONNX (ONNX Runtime's tooling), check its top-1 on the
    validation split against the fp32 file, and keep it only within --max-drop (recorded in FILE.json)."""
    data = None
    if dataset is not None or data_dir is not None:  # the run's data settings, another dataset
        data = run(
            lambda: data_config_for(run_data_config(run_dir), dataset=dataset, keep_recorded=True, data_dir=data_dir)
        )
    target = Path(out_dir) / QUANTIZED_FILE
    side = run(quantize_run, run_dir, out=target, config=settings, data=data, force=force)
    if json_out:
        print_json(side.to_dict())
        return
    q, v = side.quantization, sidecar_check(side)
    if q.fallback:
        out.print(f"fallback: {q.fallback}", highlight=False, soft_wrap=True)
    kept = ", ".join(f"{n} {why}" for why, n in q.kept_fp32_summary.items())
    calib = f", calibrated on {q.calibration['images']} training images" if q.calibration else ""
    out.print(
        f"wrote {target} + {target.name}.json ({q.scheme}{calib}; {q.quantized_nodes} layers int8, kept "
        f"fp32: {kept})  check on {v.n} {v.dataset} validation images: top-1 {v.fp32_top1:.2f}% fp32 "
        f"-> {v.int8_top1:.2f}% int8 (drop {v.top1_drop:.2f} pts <= {v.max_drop:g}), agreement "
        f"{v.top1_agreement:.1f}%, max |logit diff| {v.max_abs_logit_diff:.3g}",
        highlight=False,
        soft_wrap=True,
    )


def register(app: typer.Typer) -> None:
    app.command()(quantize)
