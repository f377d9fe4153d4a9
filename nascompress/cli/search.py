"""``nascompress search ...``: architecture searches (a sub-app; ``dcs`` lives here)."""
from __future__ import annotations

import inspect
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from nascompress.cli.common import (SkipBadImages, command_signature, given_options, out, print_json, run,
                                    setting_params, setting_values, skip_bad, with_subsets)

search_app = typer.Typer(no_args_is_help=True, help="Architecture searches: dcs (channels), tokens and joint (Optuna).")


def _dcs_options(
    source: Annotated[str, typer.Argument(help="A dense run directory (train/import) or a timm model name.")],
    out_dir: Annotated[Path, typer.Option("--out", help="Search run directory to create.")] = Path("runs/dcs_search"),
    weights: Annotated[Optional[Path], typer.Option(help="Local weights when SOURCE is a timm name.")] = None,
    img_size: Annotated[Optional[int], typer.Option(help="Input size override when SOURCE is a timm name.")] = None,
    dataset: Annotated[Optional[str], typer.Option(
        help="'fashion-mnist', an ImageFolder root or 'synthetic' (default: the run's; fashion-mnist for a timm name)."
    )] = None,
    # (here: the options of the search's settings: DCSSearchConfig, DCSConfig, its training settings)
    train_limit: Annotated[Optional[int], typer.Option(help="Use a seeded, class-balanced subset of N training images.")] = None,
    eval_limit: Annotated[Optional[int], typer.Option(help="Use a seeded, class-balanced subset of N val/test images.")] = None,
    # (here: seed, device, amp, deterministic)
    skip_bad_images: SkipBadImages = False,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing --out.")] = False,
    resume: Annotated[bool, typer.Option("--resume", help="Continue the search in --out from its checkpoint.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print metrics as JSON.")] = False,
) -> None:
    """The command's own options (those of the library's settings are generated: :func:`_signature`)."""


def _signature() -> inspect.Signature:
    """``search dcs``'s parameters: those of :func:`_dcs_options` with, before ``--train-limit``,
    ``--target-flops``, the other user-facing fields of DCSSearchConfig and DCSConfig
    (:func:`nascompress.config.setting`: their help and user defaults) and the search's training
    settings (:data:`~nascompress.search.dcs.SEARCH_TRAIN_SETTINGS`), and before ``--skip-bad-images``
    the run settings (:data:`~nascompress.train.RUNTIME_SETTINGS`)."""
    from nascompress.methods.dcs import DCSConfig
    from nascompress.search import DCSSearchConfig
    from nascompress.search.dcs import SEARCH_TRAIN_SETTINGS
    from nascompress.train import RUNTIME_SETTINGS

    lib = setting_params(DCSSearchConfig) + setting_params(DCSConfig)
    lib = sorted(lib, key=lambda p: p.name != "target_flops")  # stable: the target first, then field order
    return command_signature(_dcs_options, {"train_limit": lib + setting_params(SEARCH_TRAIN_SETTINGS),
                                            "skip_bad_images": setting_params(RUNTIME_SETTINGS)})


def dcs(**kw: Any) -> None:
    """DCS: search Q/K channel masks and MLP channel gates on a dense ViT (FLOPs-aware)."""
    from dataclasses import replace

    from nascompress.api import run_data_config
    from nascompress.data import DataConfig
    from nascompress.methods.dcs import DCSConfig
    from nascompress.search import DCSSearchConfig, DCSSearchJob, search_dcs
    from nascompress.search.dcs import SEARCH_TRAIN_SETTINGS, search_train_config
    from nascompress.train import RUNTIME_SETTINGS

    source, out_dir, batch_size, seed = kw["source"], kw["out_dir"], kw["batch_size"], kw["seed"]

    def build() -> DCSSearchJob:
        cfg = DCSSearchConfig(**setting_values(DCSSearchConfig, kw), auto_batch=batch_size is None)
        method = DCSConfig.user(**setting_values(DCSConfig, kw))
        tc = search_train_config(**setting_values(SEARCH_TRAIN_SETTINGS, kw), **setting_values(RUNTIME_SETTINGS, kw))
        data = run_data_config(source) if Path(source).is_dir() else None
        data = data or DataConfig()
        if kw["dataset"] is not None:
            data = replace(data, dataset=kw["dataset"])
        data = with_subsets(data, train_limit=kw["train_limit"], eval_limit=kw["eval_limit"], seed=seed,
                            skip_bad_images=kw["skip_bad_images"])
        weights, img_size = kw["weights"], kw["img_size"]
        return DCSSearchJob(source=source, out=str(out_dir), method=method, search=cfg, train=tc, data=data,
                            weights=str(weights) if weights else None,
                            model_kwargs={"img_size": img_size} if img_size else {})

    job = run(build)  # with --resume the job recorded in OUT/config.json is continued instead
    metrics = run(search_dcs, job, force=kw["force"], resume=kw["resume"], explicit=given_options())
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


def _study_options(
    base: Annotated[Path, typer.Argument(help="The run every trial starts from (dense, imported or DCS-materialized).")],
    study: Annotated[str, typer.Option(help="Study name; an existing study is continued.")],
    space: Annotated[Optional[Path], typer.Option(
        help="Search-space file (default: tokens search_spaces/evit.yaml, joint search_spaces/joint.yaml).")] = None,
    dataset: Annotated[Optional[str], typer.Option(
        help="'fashion-mnist' or an ImageFolder root with train/ (val/, test/) (default: the base run's dataset).")] = None,
    # (here: the study's settings, SearchJob's user-facing fields: --storage --trials ... --no-enqueue,
    # then the run settings, RUNTIME_SETTINGS: --seed --device --amp --deterministic)
    skip_bad_images: SkipBadImages = False,
    json_out: Annotated[bool, typer.Option("--json", help="One JSON line per finished trial, then a summary.")] = False,
) -> None:
    """The command's own options (the study's settings are generated from SearchJob)."""


def _outer_search(kind: str, default_space: str):
    """The ``search tokens`` / ``search joint`` command (the same engine, another default space)."""
    from nascompress.search.trials import SearchJob
    from nascompress.train import RUNTIME_SETTINGS

    def command(**kw: Any) -> None:
        from nascompress.api import run_data_config
        from nascompress.search.trials import run_search

        base = kw["base"]

        def build() -> SearchJob:
            from nascompress.data import DataConfig

            data = DataConfig(dataset=kw["dataset"]) if kw["dataset"] is not None else None
            if kw["skip_bad_images"]:
                data = skip_bad(data or (run_data_config(base) if base.is_dir() else None), True)
            return SearchJob(**setting_values(SearchJob, kw), **setting_values(RUNTIME_SETTINGS, kw), base=str(base),
                             space=str(kw["space"] or default_space), study=kw["study"], data=data)

        job = run(build)
        res = run(run_search, job, progress=not kw["json_out"], json_progress=kw["json_out"])
        if kw["json_out"]:
            print_json(res)
            return
        out.print(f"study {res['study']} ({res['storage']}): {res['complete']}/{res['n_trials']} complete, "
                  f"{len(res['front'])} on the front; see `nascompress study show {res['study']}`")

    command.__doc__ = (f"Optuna search over a search-space file ({kind}): each trial applies the methods to the base "
                       "run, scores accuracy and FLOPs (or latency/throughput); resumable, several workers.")
    command.__signature__ = command_signature(_study_options, {  # type: ignore[attr-defined]
        "skip_bad_images": setting_params(SearchJob) + setting_params(RUNTIME_SETTINGS)})
    return command


# the project's shipped spaces, wherever the command runs from (setup.sh installs the checkout in place)
SPACES = Path(__file__).resolve().parents[2] / "search_spaces"  # the repository's search_spaces/
search_app.command("tokens")(_outer_search("tokens", str(SPACES / "evit.yaml")))
search_app.command("joint")(_outer_search("joint", str(SPACES / "joint.yaml")))


def register(app: typer.Typer) -> None:
    app.add_typer(search_app, name="search")
