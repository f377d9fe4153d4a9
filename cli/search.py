"""``nascompress search ...``: architecture searches (a sub-app; ``dcs`` lives here)."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from cli.common import out, print_json, run

search_app = typer.Typer(no_args_is_help=True, help="Architecture searches (dcs).")


@search_app.command("dcs")
def dcs(
    source: Annotated[str, typer.Argument(help="A dense run directory (nascompress train) or a timm model name.")],
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
        help="Q/K channel mask: input (paper), static (materializable) or none.")] = "input",
    alpha_init: Annotated[float, typer.Option(help="Initial gate logit alpha (> 0: gates start open).")] = 3.0,
    epochs: Annotated[int, typer.Option()] = 4,
    batch_size: Annotated[int, typer.Option()] = 128,
    lr: Annotated[float, typer.Option(help="Peak AdamW lr of the weights (cosine to --min-lr).")] = 1e-3,
    min_lr: Annotated[float, typer.Option()] = 1e-4,
    arch_lr: Annotated[Optional[float], typer.Option(help="Peak AdamW lr of alpha (default: --lr).")] = None,
    tau0: Annotated[float, typer.Option(help="Initial Gumbel temperature (x0.95 per epoch).")] = 4.5,
    round_mlp: Annotated[int, typer.Option(
        help="Not in the paper: at the end close block MLPs left with < K channels, open those with > C-K.")] = 0,
    train_limit: Annotated[Optional[int], typer.Option(help="Use only N training images.")] = None,
    eval_limit: Annotated[Optional[int], typer.Option(help="Use only N val/test images.")] = None,
    seed: Annotated[int, typer.Option()] = 0,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda[:N].")] = "auto",
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

    def build() -> DCSSearchJob:
        cfg = DCSSearchConfig(epochs=epochs, batch_size=batch_size, lr=lr, min_lr=min_lr, arch_lr=arch_lr, lam=lam,
                              entropy_weight=entropy_weight, tau0=tau0, target_flops=target_flops, seed=seed,
                              round_mlp=round_mlp,
                              device=device)
        data = run_data_config(source) if Path(source).is_dir() else None
        data = data or DataConfig()
        if dataset is not None:
            data = replace(data, dataset=dataset)
        data = replace(data, train_limit=train_limit if train_limit is not None else data.train_limit,
                       eval_limit=eval_limit if eval_limit is not None else data.eval_limit)
        return DCSSearchJob(source=source, out=str(out_dir), method=DCSConfig(qk_mask=qk_mask, alpha_init=alpha_init),
                            search=cfg, data=data, weights=str(weights) if weights else None,
                            model_kwargs={"img_size": img_size} if img_size else {})

    job = run(build)  # with --resume the job recorded in OUT/config.json is continued instead
    metrics = run(search_dcs, job, force=force, resume=resume)
    if json_out:
        print_json(metrics)
    else:
        out.print(f"DCS search: FLOPs {metrics['flops_ratio']:.3f}x dense, val top-1 {metrics['val_top1']:.2f}%, "
                  f"MLP channels kept {metrics['mlp_kept']}  -> {out_dir}")


def register(app: typer.Typer) -> None:
    app.add_typer(search_app, name="search")
