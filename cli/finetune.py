"""``nascompress finetune``: one command for every token/attention method (thin)."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from cli.common import out, print_json, run


def _floats(s: Optional[str]) -> Optional[list[float]]:
    return None if s is None else [float(v) for v in s.split(",") if v.strip()]


def _ints(s: Optional[str]) -> Optional[list[int]]:
    return None if s is None else [int(v) for v in s.split(",") if v.strip()]


def parse_opts(opts: list[str]) -> dict:
    """``key=value`` pairs; values parsed as JSON when possible (numbers, lists, booleans)."""
    import json

    from nascompress.errors import NascompressError

    d = {}
    for o in opts:
        if "=" not in o:
            raise NascompressError(f"--opt {o!r} must look like key=value")
        k, v = o.split("=", 1)
        try:
            d[k.strip()] = json.loads(v)
        except json.JSONDecodeError:
            d[k.strip()] = v
    return d


def register(app: typer.Typer) -> None:
    @app.command()
    def finetune(
        run_dir: Annotated[Path, typer.Argument(help="The dense nascompress run to start from (also the teacher).")],
        method: Annotated[str, typer.Option(help="evit, dynamicvit, sparsifiner or mgvit.")],
        out_dir: Annotated[Path, typer.Option("--out", help="Run directory to create.")],
        keep_rate: Annotated[Optional[float], typer.Option(help="EViT keep rate kappa in (0, 1].")] = None,
        rho: Annotated[Optional[float], typer.Option(help="DynamicViT keep ratio rho in (0, 1].")] = None,
        prune_layers: Annotated[Optional[str], typer.Option(help="Token pruning layers, 1-based, e.g. 4,7,10 (default: scaled from 4,7,10 of 12).")] = None,
        attn_keep_ratio: Annotated[Optional[float], typer.Option(help="Sparsifiner attention keep ratio in (0, 1].")] = None,
        r_h: Annotated[Optional[float], typer.Option(help="MG-ViT head ratio.")] = None,
        r_t: Annotated[Optional[float], typer.Option(help="MG-ViT tail ratio.")] = None,
        r_pos: Annotated[Optional[float], typer.Option(help="MG-ViT PPSM positive ratio.")] = None,
        r_neg: Annotated[Optional[float], typer.Option(help="MG-ViT PPSM negative ratio.")] = None,
        ppsm_layers: Annotated[Optional[str], typer.Option(help="MG-ViT PPSM layers, 1-based (default scaled from 3,7,10 of 12).")] = None,
        epsilon: Annotated[Optional[float], typer.Option(help="MG-ViT early-exit threshold in (0, 1].")] = None,
        opt: Annotated[Optional[list[str]], typer.Option(help="Any other method setting as key=value (repeatable).")] = None,
        zero_shot: Annotated[bool, typer.Option("--zero-shot", help="Apply without training and save.")] = False,
        epochs: Annotated[int, typer.Option()] = 2, batch_size: Annotated[int, typer.Option()] = 128,
        lr: Annotated[float, typer.Option()] = 1e-4, warmup_epochs: Annotated[float, typer.Option()] = 0.0,
        train_limit: Annotated[Optional[int], typer.Option(help="Use only N training images.")] = None,
        eval_limit: Annotated[Optional[int], typer.Option(help="Use only N val/test images.")] = None,
        seed: Annotated[int, typer.Option()] = 0, device: Annotated[str, typer.Option()] = "auto",
        force: Annotated[bool, typer.Option("--force")] = False, resume: Annotated[bool, typer.Option("--resume")] = False,
        json_out: Annotated[bool, typer.Option("--json")] = False,
    ) -> None:
        """Fine-tune (or apply zero-shot) EViT, DynamicViT, Sparsifiner or MG-ViT on a dense run."""
        from dataclasses import replace

        from nascompress.api import run_data_config
        from nascompress.data import DataConfig
        from nascompress.finetune import FinetuneJob, finetune as finetune_fn
        from nascompress.train import TrainConfig

        def build():
            cfg = dict(keep_rate=keep_rate, rho=rho, prune_layers=_ints(prune_layers), attn_keep_ratio=attn_keep_ratio,
                       r_h=r_h, r_t=r_t, r_pos=r_pos, r_neg=r_neg, ppsm_layers=_ints(ppsm_layers), epsilon=epsilon)
            cfg = {k: v for k, v in cfg.items() if v is not None}
            cfg.update(parse_opts(opt or []))
            data = run_data_config(run_dir) or DataConfig()
            data = replace(data, train_limit=train_limit if train_limit is not None else data.train_limit,
                           eval_limit=eval_limit if eval_limit is not None else data.eval_limit)
            tc = TrainConfig(epochs=epochs, batch_size=batch_size, lr=lr, warmup_epochs=warmup_epochs, seed=seed,
                             device=device, min_lr=min(1e-6, lr))
            return FinetuneJob(run_dir=str(run_dir), method=method, method_config=cfg, data=data, train=tc,
                               out=str(out_dir), zero_shot=zero_shot)

        job = run(build)
        metrics = run(finetune_fn, job, force=force, resume=resume)
        if json_out:
            print_json(metrics)
        else:
            out.print(f"{method}: test top-1 {metrics['test_top1']:.2f}%  -> {out_dir}")
