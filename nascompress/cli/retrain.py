"""``nascompress retrain``: retrain a compressed model with CE + eta * IBB (thin)."""
from __future__ import annotations

import inspect
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from nascompress.cli.common import (SkipBadImages, command_signature, given_options, out, print_json, run,
                                    setting_params, setting_values, with_subsets)


def _retrain_options(
    model_dir: Annotated[Path, typer.Argument(help="A compressed nascompress model (materialized or fine-tuned run).")],
    out_dir: Annotated[Path, typer.Option("--out", help="Run directory to create.")],
    dataset: Annotated[Optional[str], typer.Option(help="'fashion-mnist' or an ImageFolder root (default: the model's).")] = None,
    data_dir: Annotated[Optional[str], typer.Option(help="Where Fashion-MNIST's IDX files are.")] = None,
    teacher: Annotated[Optional[Path], typer.Option(help="A (dense) run to distil from (KL on logits); off by default.")] = None,
    # (here: the options of RetrainConfig's user-facing fields and of retrain's training settings)
    train_limit: Annotated[Optional[int], typer.Option(help="Use only N training images.")] = None,
    eval_limit: Annotated[Optional[int], typer.Option(help="Use only N val/test images.")] = None,
    # (here: seed, device, amp, deterministic)
    skip_bad_images: SkipBadImages = False,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing output directory.")] = False,
    resume: Annotated[bool, typer.Option("--resume", help="Continue the run in --out from its last checkpoint.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print metrics as JSON.")] = False,
) -> None:
    """``retrain``'s own options (those of the library's settings are generated: :func:`_signature`)."""


def _signature() -> inspect.Signature:
    """``retrain``'s parameters: those of :func:`_retrain_options` with, before ``--train-limit``, the
    user-facing fields of RetrainConfig (:func:`nascompress.config.setting`) and retrain's training
    settings (:data:`~nascompress.retrain.RETRAIN_TRAIN_SETTINGS`), and before ``--skip-bad-images``
    the run settings (:data:`~nascompress.train.RUNTIME_SETTINGS`)."""
    from nascompress.retrain import RETRAIN_TRAIN_SETTINGS, RetrainConfig
    from nascompress.train import RUNTIME_SETTINGS

    return command_signature(_retrain_options, {
        "train_limit": setting_params(RetrainConfig) + setting_params(RETRAIN_TRAIN_SETTINGS),
        "skip_bad_images": setting_params(RUNTIME_SETTINGS)})


def retrain(**kw: Any) -> None:
    """Retrain a compressed model with CE, then CE + eta * IBB (DCS Algorithm 1); save the slim model."""
    from dataclasses import replace

    from nascompress.data import DataConfig
    from nascompress.retrain import (RETRAIN_TRAIN_SETTINGS, RetrainConfig, RetrainJob, recorded_data_config,
                                     retrain as retrain_fn, retrain_train_config)
    from nascompress.train import RUNTIME_SETTINGS

    model_dir, out_dir, teacher, batch_size = kw["model_dir"], kw["out_dir"], kw["teacher"], kw["batch_size"]

    def build():
        data = recorded_data_config(model_dir) if model_dir.is_dir() else None
        if kw["dataset"] is not None or data is None:
            data = DataConfig(dataset=kw["dataset"] or "fashion-mnist")
        if kw["data_dir"] is not None:
            data = replace(data, data_dir=kw["data_dir"])
        data = with_subsets(data, train_limit=kw["train_limit"], eval_limit=kw["eval_limit"], seed=kw["seed"],
                            skip_bad_images=kw["skip_bad_images"])
        rc = RetrainConfig(**setting_values(RetrainConfig, kw))
        tc = retrain_train_config(**setting_values(RETRAIN_TRAIN_SETTINGS, kw), **setting_values(RUNTIME_SETTINGS, kw))
        return RetrainJob(model_dir=str(model_dir), out=str(out_dir), data=data, train=tc, retrain=rc,
                          teacher=str(teacher) if teacher else None, auto_batch=batch_size is None)

    job = run(build)
    metrics = run(retrain_fn, job, force=kw["force"], resume=kw["resume"], explicit=given_options())
    if kw["json_out"]:
        print_json(metrics)
    else:
        fin = metrics.get("final", {})
        out.print(f"retrained ({', '.join(metrics['methods'])}): test top-1 {metrics['test_top1']:.2f}%  "
                  f"IB loss {fin.get('ib', float('nan')):.4f}  -> {out_dir}")


retrain.__signature__ = _signature()  # type: ignore[attr-defined]


def register(app: typer.Typer) -> None:
    app.command()(retrain)
