"""``nascompress search ...``: architecture searches (a sub-app; ``dcs`` lives here)."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from nascompress.cli.common import Amp, Deterministic, SkipBadImages, out, print_json, run, skip_bad

search_app = typer.Typer(no_args_is_help=True, help="Architecture searches: dcs (channels), tokens and joint (Optuna).")


@search_app.command("dcs")
def dcs(
    source: Annotated[str, typer.Argument(help="A dense run directory (train/import) or a timm model name.")],
    out_dir: Annotated[Path, typer.Option("--out", help="Search run directory to create.")] = Path("runs/dcs_search"),
    weights: Annotated[Optional[Path], typer.Option(help="Local weights when SOURCE is a timm name.")] = None,
    img_size: Annotated[Optional[int], typer.Option(help="Input size override when SOURCE is a timm name.")] = None,
    dataset: Annotated[Optional[str], typer.Option(
        help="'fashion-mnist', an ImageFolder root or 'synthetic' (default: the run's; fashion-mnist for a timm name)."
    )] = None,
    target_flops: Annotated[Optional[float], typer.Option(
        help="Land within +-5% of this FLOPs ratio of the dense model, in (0, 1].")] = None,
    lam: Annotated[float, typer.Option(
        help="lambda of lambda*log(cost) (paper range 0.1-0.5); with --target-flops it is steered instead.")] = 0.2,
    entropy_weight: Annotated[float, typer.Option(help="Weight of the gates' entropy penalty.")] = 0.01,
    qk_mask: Annotated[str, typer.Option(
        help="Q/K channel mask: static (searched per channel, materializable), input (the paper's, kept at run "
             "time) or none.")] = "static",
    mlp_gates: Annotated[str, typer.Option(
        help="MLP gate family: residual (the paper's: the MLP's input/output residual channels), hidden (its hidden "
             "neurons: far less destructive on pretrained models), none, or auto (chosen by a short measured probe "
             "on the model: the family whose pruned models stay closer to the dense one).")] = "auto",
    align: Annotated[int, typer.Option(
        help="Every kept width (MLP channels per block, Q/K channels per head) is 0, full or a multiple of this "
             "(GPU kernels leave their fast paths below multiples of 8; 1: any width).")] = 8,
    hidden_fill: Annotated[str, typer.Option(
        help="Hidden family: a closed neuron contributes zero or its mean activation (folded into fc2's bias).")] = "mean",
    alpha_init: Annotated[float, typer.Option(help="Initial mean gate logit alpha/theta (> 0: gates start open).")] = 5.0,
    epochs: Annotated[int, typer.Option()] = 4,
    batch_size: Annotated[Optional[int], typer.Option(
        help="Default: from the training images, 16 to 128 for about 100 steps per epoch (16 for 2,000).")] = None,
    lr: Annotated[Optional[float], typer.Option(help="Absolute peak lr of the weights (default: --base-lr x batch / 512).")] = None,
    base_lr: Annotated[float, typer.Option(help="Peak lr of the weights per 512 images (pretrained-safe default).")] = 1e-4,
    min_lr: Annotated[float, typer.Option()] = 1e-6,
    warmup_epochs: Annotated[float, typer.Option(help="Linear lr warm-up, in epochs.")] = 0.2,
    layer_decay: Annotated[Optional[float], typer.Option(help="Layer-wise lr decay of the weights (0 or 1: off).")] = 0.75,
    arch_lr: Annotated[Optional[float], typer.Option(
        help="Peak AdamW lr of the architecture parameters (default: sized from the number of arch steps).")] = None,
    distill: Annotated[float, typer.Option(help="Weight of KL to the dense model's logits (0: off).")] = 0.5,
    feat_distill: Annotated[float, typer.Option(
        help="Weight of the relative error to the dense model's pre-logits feature (0: off).")] = 1.0,
    arch_loss: Annotated[str, typer.Option(
        help="The architecture steps' task loss: kd (the distillation terms) or ce (the paper's).")] = "kd",
    target_ramp: Annotated[float, typer.Option(
        help="Share of the search over which the target moves from 1.0 down to --target-flops (0: at once).")] = 0.5,
    protect_ratio: Annotated[float, typer.Option(
        help="Fix open the gates of outlier channels (activation > this x the block median, at most 5% of a "
             "block's gates; 0: off).")] = 5.0,
    no_block_weights: Annotated[bool, typer.Option(
        "--no-block-weights", help="Do not weight each block's cost by its measured sensitivity.")] = False,
    max_val_drop: Annotated[float, typer.Option(
        help="Stop when validation top-1 falls more than this many points below the dense model's.")] = 15.0,
    tau0: Annotated[float, typer.Option(help="Initial Gumbel temperature (x0.95 per epoch).")] = 4.5,
    round_mlp: Annotated[int, typer.Option(
        help="Not in the paper: close block MLPs left with < K channels, open those with > C-K (steered for).")] = 0,
    no_calibrate: Annotated[bool, typer.Option(
        "--no-calibrate", help="Fail instead of shifting the gate threshold when the search ends off target.")] = False,
    no_grad_balance: Annotated[bool, typer.Option(
        "--no-grad-balance", help="Keep lambda in absolute units (by default, with --target-flops, the cost term is "
                                  "scaled up where the CE gradient per gate outweighs it, as on pretrained models).")] = False,
    init_importance: Annotated[str, typer.Option(
        help="What orders the gates' start: weight (magnitude), activation (measured on 256 training images) or auto "
             "(activation where its 20%- and 40%-pruned models are clearly closer to the dense model, else weight).")] = "auto",
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
    """DCS: search Q/K channel masks and MLP channel gates on a dense ViT (FLOPs-aware)."""
    from dataclasses import replace

    from nascompress.api import run_data_config
    from nascompress.data import DataConfig
    from nascompress.methods.dcs import DCSConfig
    from nascompress.search import DCSSearchConfig, DCSSearchJob, search_dcs
    from nascompress.search.dcs import search_train_config

    def build() -> DCSSearchJob:
        cfg = DCSSearchConfig(arch_lr=arch_lr, lam=lam, entropy_weight=entropy_weight, tau0=tau0,
                              target_flops=target_flops, target_ramp=target_ramp, round_mlp=round_mlp,
                              distill=distill, feat_distill=feat_distill, arch_loss=arch_loss,
                              protect_ratio=protect_ratio, block_weights=not no_block_weights,
                              max_val_drop=max_val_drop, calibrate=not no_calibrate,
                              grad_balance=not no_grad_balance, init_importance=init_importance,
                              auto_batch=batch_size is None)
        tc = search_train_config(epochs=epochs, batch_size=batch_size, lr=lr, base_lr=base_lr, min_lr=min_lr,
                                 warmup_epochs=warmup_epochs, seed=seed, device=device, amp=amp,
                                 deterministic=deterministic)
        tc = tc.replace(layer_decay=None if not layer_decay or layer_decay == 1 else layer_decay)
        data = run_data_config(source) if Path(source).is_dir() else None
        data = data or DataConfig()
        if dataset is not None:
            data = replace(data, dataset=dataset)
        data = replace(data, train_limit=train_limit if train_limit is not None else data.train_limit,
                       eval_limit=eval_limit if eval_limit is not None else data.eval_limit)
        data = skip_bad(replace(data, subset_seed=seed), skip_bad_images)
        return DCSSearchJob(source=source, out=str(out_dir),
                            method=DCSConfig(qk_mask=qk_mask, mlp_gates=mlp_gates, align=align, hidden_fill=hidden_fill,
                                             alpha_init=alpha_init, theta_init=alpha_init),
                            search=cfg, train=tc, data=data, weights=str(weights) if weights else None,
                            model_kwargs={"img_size": img_size} if img_size else {})

    job = run(build)  # with --resume the job recorded in OUT/config.json is continued instead
    metrics = run(search_dcs, job, force=force, resume=resume)
    if json_out:
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
