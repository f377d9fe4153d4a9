"""``nascompress retrain``: retrain a compressed (or dense) model with CE + eta * IBB (thin)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated
import math

import typer

from nascompress.cli.common import (
    Settings,
    SkipBadImages,
    given_options,
    out,
    print_json,
    run,
    setting_option,
    settings_command,
)
from nascompress.cli.options import EvalLimit, Force, JsonOut, Out, Resume, RunDataDir, RunDataset, TrainLimit
from nascompress.data.choose import data_config_for
from nascompress.retraining.run import (
    RETRAIN_TRAIN_SETTINGS,
    RetrainJob,
    build_job,
    recorded_data_config,
    retrain as retrain_fn,
)
from nascompress.retraining.config import RetrainConfig
from nascompress.retraining.metrics import RetrainMetrics
from nascompress.train.run import RUNTIME_SETTINGS


@settings_command(settings=RetrainConfig, recipe=RETRAIN_TRAIN_SETTINGS, runtime=RUNTIME_SETTINGS)
def retrain(
    model_dir: Annotated[
        Path,
        typer.Argument(
            help="A nascompress model: compressed (a materialized or fine-tuned run), or dense (the reference "
            "at the same budget)."
        ),
    ],
    out_dir: Out,
    *,
    dataset: RunDataset = None,
    data_dir: RunDataDir = None,
    teacher: setting_option(RetrainJob, "teacher") = None,
    settings: RetrainConfig,  # --eta --warmup-frac --feature-tap --input-tap ... (RetrainConfig's settings)
    recipe: Settings,  # RETRAIN_TRAIN_SETTINGS: --epochs --batch-size --lr --base-lr ...
    train_limit: TrainLimit = None,
    eval_limit: EvalLimit = None,
    runtime: Settings,  # RUNTIME_SETTINGS: --seed --device --amp --deterministic
    skip_bad_images: SkipBadImages = False,
    force: Force = False,
    resume: Resume = False,
    json_out: JsonOut = False,
) -> None:
    """Retrain a compressed model with CE (+ KD from a teacher), optionally + eta * IBB (DCS Algorithm 1); save it.

    A dense model is retrained the same way: the yardstick for a compressed model at the same budget."""

    def build():
        data = data_config_for(  # the run's data unless a dataset is named
            recorded_data_config(model_dir) if model_dir.is_dir() else None,
            dataset=dataset,
            data_dir=data_dir,
            train_limit=train_limit,
            eval_limit=eval_limit,
            seed=runtime.seed,
            skip_bad_images=skip_bad_images,
        )
        return build_job(
            model_dir, out_dir, retrain=settings, train={**vars(recipe), **vars(runtime)}, data=data, teacher=teacher
        )

    job = run(build)
    metrics = run(retrain_fn, job, force=force, resume=resume, explicit=given_options())
    if json_out:
        print_json(metrics.to_dict())
    else:
        out.print(
            f"retrained ({', '.join(metrics.methods) or 'dense'}): test top-1 {metrics.test_top1:.2f}% "
            f"({metrics.test_n} images){ib_text(metrics)}  -> {out_dir}"
        )


def ib_text(metrics: RetrainMetrics) -> str:
    """The IB loss of the retrained model's last epoch when the bound was on (eta > 0) and measured;
    nothing otherwise (a bound that is off has no loss to show)."""
    ib = (metrics.final or {}).get("ib")
    if not metrics.eta or ib is None or not math.isfinite(ib):
        return ""
    return f"  IB loss {ib:.4f}"


def register(app: typer.Typer) -> None:
    app.command()(retrain)
