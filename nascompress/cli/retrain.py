"""``nascompress retrain``: retrain a compressed model with CE + eta * IBB (thin)."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from nascompress.cli.common import Amp, Deterministic, SkipBadImages, out, print_json, run, skip_bad


def register(app: typer.Typer) -> None:
    @app.command()
    def retrain(
        model_dir: Annotated[Path, typer.Argument(help="A compressed nascompress model (materialized or fine-tuned run).")],
        out_dir: Annotated[Path, typer.Option("--out", help="Run directory to create.")],
        dataset: Annotated[Optional[str], typer.Option(help="'fashion-mnist' or an ImageFolder root (default: the model's).")] = None,
        data_dir: Annotated[Optional[str], typer.Option(help="Where Fashion-MNIST's IDX files are.")] = None,
        epochs: Annotated[int, typer.Option()] = 10,
        eta: Annotated[float, typer.Option(help="Weight of the IB bound IBB (>= 0; 0 = CE only).")] = 50.0,
        warmup_frac: Annotated[float, typer.Option(help="Share of epochs on CE only before IBB is added, in [0, 1).")] = 0.3,
        teacher: Annotated[Optional[Path], typer.Option(help="A (dense) run to distil from (KL on logits); off by default.")] = None,
        kd_alpha: Annotated[float, typer.Option(help="KD weight alpha: (1 - alpha) CE + alpha KD.")] = 0.5,
        kd_temperature: Annotated[float, typer.Option(help="KD temperature.")] = 1.0,
        feat_kd: Annotated[Optional[float], typer.Option(
            help="With --teacher: weight of the feature distillation term, ||s - t||^2 / ||t||^2 on the --feature-tap "
                 "feature (0: off; default: 1 with a teacher whose feature has the model's width, else 0).")] = None,
        feature_tap: Annotated[str, typer.Option(help="Learned feature X~: 'pre_logits' or 'module:<name>'.")] = "pre_logits",
        input_tap: Annotated[str, typer.Option(help="Input feature X: 'image' (pooled image) or 'patch_embed'.")] = "image",
        cluster_samples: Annotated[Optional[int], typer.Option(help="Cluster a fixed random subset of N training images.")] = None,
        log_ib: Annotated[Optional[bool], typer.Option("--log-ib/--no-log-ib", help="Cluster and log the IB metrics every epoch (default: only when --eta > 0).")] = None,
        batch_size: Annotated[Optional[int], typer.Option(
            help="Default: from the training images, 16 to 128 for about 100 steps per epoch (16 for 2,000).")] = None,
        lr: Annotated[Optional[float], typer.Option(help="Absolute peak lr (default: --base-lr x batch / 512).")] = None,
        base_lr: Annotated[Optional[float], typer.Option(
            help="Peak lr per 512 images (default 5e-4: safe on pretrained weights).")] = None,
        layer_decay: Annotated[Optional[float], typer.Option(help="Layer-wise lr decay, timm's convention; default off.")] = None,
        warmup_epochs: Annotated[float, typer.Option(help="Learning-rate warm-up, in epochs.")] = 0.2,
        train_limit: Annotated[Optional[int], typer.Option(help="Use only N training images.")] = None,
        eval_limit: Annotated[Optional[int], typer.Option(help="Use only N val/test images.")] = None,
        seed: Annotated[int, typer.Option()] = 0, device: Annotated[str, typer.Option(help="auto, cpu or cuda[:N].")] = "auto",
        skip_bad_images: SkipBadImages = False,
        amp: Amp = "off",
        deterministic: Deterministic = False,
        force: Annotated[bool, typer.Option("--force", help="Overwrite an existing output directory.")] = False,
        resume: Annotated[bool, typer.Option("--resume", help="Continue the run in --out from its last checkpoint.")] = False,
        json_out: Annotated[bool, typer.Option("--json", help="Print metrics as JSON.")] = False,
    ) -> None:
        """Retrain a compressed model with CE, then CE + eta * IBB (DCS Algorithm 1); save the slim model."""
        from dataclasses import replace

        from nascompress.data import DataConfig
        from nascompress.retrain import (RetrainConfig, RetrainJob, recorded_data_config, retrain as retrain_fn,
                                         retrain_train_config)

        def build():
            data = recorded_data_config(model_dir) if model_dir.is_dir() else None
            if dataset is not None or data is None:
                data = DataConfig(dataset=dataset or "fashion-mnist")
            if data_dir is not None:
                data = replace(data, data_dir=data_dir)
            data = replace(data, train_limit=train_limit if train_limit is not None else data.train_limit,
                           eval_limit=eval_limit if eval_limit is not None else data.eval_limit, subset_seed=seed)
            data = skip_bad(data, skip_bad_images)
            rc = RetrainConfig(eta=eta, warmup_frac=warmup_frac, feature_tap=feature_tap, input_tap=input_tap,
                               cluster_samples=cluster_samples, kd_alpha=kd_alpha, kd_temperature=kd_temperature,
                               feat_kd=feat_kd, log_ib=log_ib)
            tc = retrain_train_config(epochs=epochs, batch_size=batch_size, lr=lr, base_lr=base_lr, layer_decay=layer_decay,
                                      warmup_epochs=warmup_epochs, seed=seed, device=device, amp=amp,
                                      deterministic=deterministic)
            return RetrainJob(model_dir=str(model_dir), out=str(out_dir), data=data, train=tc, retrain=rc,
                              teacher=str(teacher) if teacher else None, auto_batch=batch_size is None)

        job = run(build)
        metrics = run(retrain_fn, job, force=force, resume=resume)
        if json_out:
            print_json(metrics)
        else:
            fin = metrics.get("final", {})
            out.print(f"retrained ({', '.join(metrics['methods'])}): test top-1 {metrics['test_top1']:.2f}%  "
                      f"IB loss {fin.get('ib', float('nan')):.4f}  -> {out_dir}")
