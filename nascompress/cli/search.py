"""``nascompress search ...``: architecture searches (a sub-app; ``dcs`` lives here)."""
from __future__ import annotations

import inspect
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from nascompress.cli.common import (Amp, Deterministic, SkipBadImages, out, print_json, run, setting_params,
                                    setting_values, skip_bad)

search_app = typer.Typer(no_args_is_help=True, help="Architecture searches: dcs (channels), tokens and joint (Optuna).")


def _dcs_options(
    source: Annotated[str, typer.Argument(help="A dense run directory (train/import) or a timm model name.")],
    out_dir: Annotated[Path, typer.Option("--out", help="Search run directory to create.")] = Path("runs/dcs_search"),
    weights: Annotated[Optional[Path], typer.Option(help="Local weights when SOURCE is a timm name.")] = None,
    img_size: Annotated[Optional[int], typer.Option(help="Input size override when SOURCE is a timm name.")] = None,
    dataset: Annotated[Optional[str], typer.Option(
        help="'fashion-mnist', an ImageFolder root or 'synthetic' (default: the run's; fashion-mnist for a timm name)."
    )] = None,
    # (here: the options of DCSSearchConfig's and DCSConfig's user-facing fields, see _signature)
    epochs: Annotated[int, typer.Option()] = 4,
    batch_size: Annotated[Optional[int], typer.Option(
        help="Default: from the training images, 16 to 128 for about 100 steps per epoch (16 for 2,000).")] = None,
    lr: Annotated[Optional[float], typer.Option(help="Absolute peak lr of the weights (default: --base-lr x batch / 512).")] = None,
    base_lr: Annotated[float, typer.Option(help="Peak lr of the weights per 512 images (pretrained-safe default).")] = 1e-4,
    min_lr: Annotated[float, typer.Option()] = 1e-6,
    warmup_epochs: Annotated[float, typer.Option(help="Linear lr warm-up, in epochs.")] = 0.2,
    layer_decay: Annotated[Optional[float], typer.Option(help="Layer-wise lr decay of the weights (0 or 1: off).")] = 0.75,
    train_limit: Annotated[Optional[int], typer.Option(help="Use a seeded, class-balanced subset of N training images.")] = None,
    eval_limit: Annotated[Optional[int], typer.Option(help="Use a seeded, class-balanced subset of N val/test images.")] = None,
    seed: Annotated[int, typer.Option()] = 0,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda[:N].")] = "auto",
    skip_bad_images: SkipBadImages = False,
    amp: Amp = "off",
    deterministic: Deterministic = False,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing --out.")] = False,
    resume: Annotated[bool, typer.Option("--resume", help="Continue the search in --out from its checkpoint.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print metrics as JSON.")] = False,
) -> None:
    """The command's own options (those of the library's settings are generated: :func:`_signature`)."""


def _signature() -> inspect.Signature:
    """``search dcs``'s parameters: the first five of :func:`_dcs_options`, ``--target-flops``, the other
    user-facing fields of DCSSearchConfig and DCSConfig (:func:`nascompress.config.setting`: their help
    and user defaults), then the rest of :func:`_dcs_options`."""
    from nascompress.methods.dcs import DCSConfig
    from nascompress.search import DCSSearchConfig

    own = list(inspect.signature(_dcs_options, eval_str=True).parameters.values())
    own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own]
    lib = setting_params(DCSSearchConfig) + setting_params(DCSConfig)
    lib = sorted(lib, key=lambda p: p.name != "target_flops")  # stable: the target first, then field order
    return inspect.Signature(own[:5] + lib + own[5:])


def dcs(**kw: Any) -> None:
    """DCS: search Q/K channel masks and MLP channel gates on a dense ViT (FLOPs-aware)."""
    from dataclasses import replace

    from nascompress.api import run_data_config
    from nascompress.data import DataConfig
    from nascompress.methods.dcs import DCSConfig
    from nascompress.search import DCSSearchConfig, DCSSearchJob, search_dcs
    from nascompress.search.dcs import search_train_config

    source, out_dir, batch_size, seed = kw["source"], kw["out_dir"], kw["batch_size"], kw["seed"]

    def build() -> DCSSearchJob:
        cfg = DCSSearchConfig(**setting_values(DCSSearchConfig, kw), auto_batch=batch_size is None)
        method = DCSConfig(**setting_values(DCSConfig, kw))
        method = method.replace(theta_init=method.alpha_init)
        tc = search_train_config(epochs=kw["epochs"], batch_size=batch_size, lr=kw["lr"], base_lr=kw["base_lr"],
                                 min_lr=kw["min_lr"], warmup_epochs=kw["warmup_epochs"], seed=seed,
                                 device=kw["device"], amp=kw["amp"], deterministic=kw["deterministic"])
        layer_decay = kw["layer_decay"]
        tc = tc.replace(layer_decay=None if not layer_decay or layer_decay == 1 else layer_decay)
        data = run_data_config(source) if Path(source).is_dir() else None
        data = data or DataConfig()
        if kw["dataset"] is not None:
            data = replace(data, dataset=kw["dataset"])
        train_limit, eval_limit = kw["train_limit"], kw["eval_limit"]
        data = replace(data, train_limit=train_limit if train_limit is not None else data.train_limit,
                       eval_limit=eval_limit if eval_limit is not None else data.eval_limit)
        data = skip_bad(replace(data, subset_seed=seed), kw["skip_bad_images"])
        weights, img_size = kw["weights"], kw["img_size"]
        return DCSSearchJob(source=source, out=str(out_dir), method=method, search=cfg, train=tc, data=data,
                            weights=str(weights) if weights else None,
                            model_kwargs={"img_size": img_size} if img_size else {})

    job = run(build)  # with --resume the job recorded in OUT/config.json is continued instead
    metrics = run(search_dcs, job, force=kw["force"], resume=kw["resume"])
    if kw["json_out"]:
        print_json(metrics)
    else:
        cal = metrics.get("calibration")
        note = "" if not cal else f" (calibrated from {cal['ratio_before']:.3f})"
        if metrics.get("family_reason"):
            out.print(f"MLP gates: {metrics['family_reason']}")
        out.print(f"DCS search ({metrics['mlp_gates']} gates): FLOPs {metrics['flops_ratio']:.3f}x dense{note}, "
                  f"val top-1 {metrics['val_top1']:.2f}% "
                  f"(dense {metrics['dense_val_top1']:.2f}%), MLP channels kept {metrics['mlp_kept']}, "
                  f"Q/K channels kept {metrics['qk_kept']}  -> {out_dir}")


dcs.__signature__ = _signature()  # type: ignore[attr-defined]
search_app.command("dcs")(dcs)


def _outer_search(kind: str, default_space: str):
    """The ``search tokens`` / ``search joint`` command (the same engine, another default space)."""

    def command(
        base: Annotated[Path, typer.Argument(help="The run every trial starts from (dense, imported or DCS-materialized).")],
        study: Annotated[str, typer.Option(help="Study name; an existing study is continued.")],
        space: Annotated[Optional[Path], typer.Option(
            help="Search-space file (default: tokens search_spaces/evit.yaml, joint search_spaces/joint.yaml).")] = None,
        storage: Annotated[Optional[str], typer.Option(
            help="sqlite:///FILE, journal:FILE or postgresql://... (default: ./nascompress-studies.db; with several "
                 "--workers ./nascompress-studies.journal).")] = None,
        trials: Annotated[int, typer.Option(help="Complete trials the study should reach.")] = 50,
        workers: Annotated[int, typer.Option(help="Worker processes on this machine sharing the study.")] = 1,
        objective: Annotated[str, typer.Option(help="Second objective: flops, latency or throughput.")] = "flops",
        max_flops: Annotated[Optional[float], typer.Option(
            help="Single objective: accuracy with FLOPs <= this ratio of the uncompressed model.")] = None,
        max_latency: Annotated[Optional[float], typer.Option(
            help="Single objective: accuracy with batch-1 latency <= this many ms on --device.")] = None,
        sampler: Annotated[str, typer.Option(
            help="nsga2, tpe or qmc (scrambled Sobol' points; spaces without conditional parameters).")] = "nsga2",
        finetune_epochs: Annotated[float, typer.Option(help="0: zero-shot trials; else a short fine-tune each.")] = 0.0,
        train_images: Annotated[int, typer.Option(help="Class-balanced training images for predictor stages and fine-tunes.")] = 2000,
        eval_images: Annotated[int, typer.Option(help="Class-balanced validation images accuracy is measured on.")] = 2000,
        calib_steps: Annotated[int, typer.Option(help="Steps of the predictor-only stage (DynamicViT, Sparsifiner).")] = 50,
        dcs_epochs: Annotated[int, typer.Option(help="Epochs of the per-trial DCS search (spaces with a dcs entry).")] = 1,
        batch_size: Annotated[int, typer.Option()] = 64,
        no_enqueue: Annotated[bool, typer.Option("--no-enqueue", help="Do not run the uncompressed and paper configurations first.")] = False,
        seed: Annotated[int, typer.Option(help="One seed for the samplers, the data subsets and the trials.")] = 0,
        device: Annotated[str, typer.Option(help="auto, cpu or cuda[:N].")] = "auto",
        skip_bad_images: SkipBadImages = False,
        amp: Annotated[str, typer.Option(
            help="Trials' training (predictor stages, fine-tunes, DCS searches): off or bf16 autocast.")] = "off",
        deterministic: Annotated[bool, typer.Option(
            "--deterministic", help="Deterministic kernels in the trials (reproducible on a GPU; slower there).")] = False,
        json_out: Annotated[bool, typer.Option("--json", help="One JSON line per finished trial, then a summary.")] = False,
    ) -> None:
        from nascompress.api import run_data_config
        from nascompress.search.trials import SearchJob, run_search

        def build() -> SearchJob:
            data = skip_bad(run_data_config(base) if base.is_dir() else None, True) if skip_bad_images else None
            return SearchJob(base=str(base), space=str(space or default_space), study=study, storage=storage,
                             trials=trials, workers=workers, objective=objective, max_flops=max_flops,
                             max_latency_ms=max_latency, sampler=sampler, finetune_epochs=finetune_epochs,
                             train_images=train_images, eval_images=eval_images, calib_steps=calib_steps,
                             dcs_epochs=dcs_epochs, batch_size=batch_size, enqueue=not no_enqueue, seed=seed,
                             device=device, amp=amp, deterministic=deterministic, data=data)

        job = run(build)
        res = run(run_search, job, progress=not json_out, json_progress=json_out)
        if json_out:
            print_json(res)
            return
        out.print(f"study {res['study']} ({res['storage']}): {res['complete']}/{res['n_trials']} complete, "
                  f"{len(res['front'])} on the front; see `nascompress study show {res['study']}`")

    command.__doc__ = (f"Optuna search over a search-space file ({kind}): each trial applies the methods to the base "
                       "run, scores accuracy and FLOPs (or latency/throughput); resumable, several workers.")
    return command


# the project's shipped spaces, wherever the command runs from (setup.sh installs the checkout in place)
SPACES = Path(__file__).resolve().parents[2] / "search_spaces"  # the repository's search_spaces/
search_app.command("tokens")(_outer_search("tokens", str(SPACES / "evit.yaml")))
search_app.command("joint")(_outer_search("joint", str(SPACES / "joint.yaml")))


def register(app: typer.Typer) -> None:
    app.add_typer(search_app, name="search")
