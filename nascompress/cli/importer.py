"""``nascompress import``: a user's own timm ViT weights as a run directory, without training (thin)."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from nascompress.cli.common import SkipBadImages, input_overrides, out, print_json, run
from nascompress.data import FMNIST_DIR


def register(app: typer.Typer) -> None:
    @app.command("import")
    def import_cmd(
        model: Annotated[str, typer.Argument(help="timm model name, e.g. vit_small_patch16_224 (a .tag picks its pretrained config).")],
        weights: Annotated[Path, typer.Option(help="Local .safetensors/.pth weights, with a classifier head.")],
        out_dir: Annotated[Path, typer.Option("--out", help="Run directory to create.")],
        img_size: Annotated[Optional[int], typer.Option(help="Input size (default: from the weights' position embedding).")] = None,
        num_classes: Annotated[Optional[int], typer.Option(help="Classes (default: the weights' head).")] = None,
        dataset: Annotated[Optional[str], typer.Option(help="Evaluate on this dataset's val and test splits: 'fashion-mnist' or an ImageFolder root.")] = None,
        data_dir: Annotated[str, typer.Option(help="Where Fashion-MNIST's IDX files are.")] = str(FMNIST_DIR),
        mean: Annotated[Optional[str], typer.Option(help="Normalisation mean, comma-separated (default: the model's pretrained config).")] = None,
        std: Annotated[Optional[str], typer.Option(help="Normalisation std, comma-separated (default: the model's pretrained config).")] = None,
        interpolation: Annotated[Optional[str], typer.Option(help="bilinear, bicubic or nearest (default: the pretrained config).")] = None,
        crop_pct: Annotated[Optional[float], typer.Option(help="ImageFolder eval crop (default: the pretrained config).")] = None,
        eval_limit: Annotated[Optional[int], typer.Option(help="Evaluate on N val/test images (class-stratified, drawn with --seed).")] = None,
        batch_size: Annotated[int, typer.Option(help="Evaluation batch size.")] = 256,
        seed: Annotated[int, typer.Option(help="Seed of the --eval-limit subsets.")] = 0,
        skip_bad_images: SkipBadImages = False,
        device: Annotated[str, typer.Option(help="auto, cpu or cuda[:N].")] = "auto",
        force: Annotated[bool, typer.Option("--force", help="Overwrite an existing output directory.")] = False,
        json_out: Annotated[bool, typer.Option("--json", help="Print metrics as JSON.")] = False,
    ) -> None:
        """Import a timm ViT's weights as a run directory (no training) that finetune, search, evaluate and
        nascompress.load accept; evaluate it if --dataset is given."""
        from nascompress.data import DataConfig
        from nascompress.importer import ImportJob, import_model

        def build():
            data = None
            if dataset is not None:
                data = DataConfig(dataset=dataset, data_dir=data_dir, eval_limit=eval_limit, subset_seed=seed,
                                  skip_bad_images=skip_bad_images)
            return ImportJob(model=model, weights=str(weights), out=str(out_dir), img_size=img_size,
                             num_classes=num_classes, data=data, input=input_overrides(mean, std, interpolation, crop_pct),
                             eval_batch_size=batch_size, device=device)

        job = run(build)
        metrics = run(import_model, job, force=force)
        if json_out:
            print_json(metrics)
        elif metrics.get("test_top1") is not None:
            out.print(f"val top-1 {metrics['val_top1']:.2f}%  test top-1 {metrics['test_top1']:.2f}%  -> {out_dir}")
        else:
            out.print(f"imported {model} -> {out_dir}")
