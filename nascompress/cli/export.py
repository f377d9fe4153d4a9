"""``nascompress export RUN --format onnx|torch-export|aoti --out FILE``: a deployable, checked file (thin)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from nascompress.cli.common import Settings, out, print_json, run, settings_command
from nascompress.cli.options import Force, JsonOut, out_option
from nascompress.deploy import export_run, parse_batch
from nascompress.deploy.config import ExportConfig, build_config
from nascompress.deploy.verify import sidecar_check


def register(app: typer.Typer) -> None:
    @app.command("export")
    @settings_command(settings=ExportConfig)
    def export_cmd(
        run_dir: Annotated[
            Path, typer.Argument(help="A run directory (or model.safetensors) that nascompress.load reads.")
        ],
        out_file: out_option("The file to write (sidecar: FILE.json; MG-ViT's stage 2: <stem>.mgis<suffix>)."),
        *,
        # ExportConfig: --format --batch --dtype --opset --tolerance --verify-batch --seed --quantize
        settings: Settings,
        force: Force = False,
        json_out: JsonOut = False,
    ) -> None:
        """Write the model as an ONNX file or a torch.export program that runs without nascompress, run it
        (ONNX Runtime / torch.export.load) against the PyTorch model, and record the check in FILE.json."""
        cfg = run(lambda: build_config({**vars(settings), "batch": parse_batch(str(settings.batch))}))
        side = run(export_run, run_dir, out=out_file, config=cfg, force=force)
        if json_out:
            print_json(side.to_dict())
            return
        v = sidecar_check(side)
        if side.quantization is not None:
            q = side.quantization
            fallback = f", fallback: {q.fallback}" if q.fallback else ""
            out.print(
                f"wrote {side.file} ({q.scheme}{fallback}) + "
                f"{Path(out_file).name}.json  check on {v.n} validation images: top-1 {v.fp32_top1:.2f}% "
                f"fp32 -> {v.int8_top1:.2f}% int8, agreement {v.top1_agreement:.1f}%, max |logit diff| "
                f"{v.max_abs_logit_diff:.3g}",
                highlight=False,
                soft_wrap=True,
            )
            return
        files = ", ".join(f["file"] for f in side.files)
        out.print(
            f"wrote {files} ({side.runtime}, {side.dtype}, batch {side.batch}) + "
            f"{Path(out_file).name}.json"
            f"  check on {v.n} images with {v.runtime}: max |logit diff| {v.max_abs_diff:.2g}, "
            f"top-1 agreement {100 * v.top1_agreement:.1f}%",
            highlight=False,
            soft_wrap=True,
        )
