"""``nascompress search ...``: architecture searches (a sub-app; ``dcs`` lives here)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from nascompress.cli.common import (
    Settings,
    SkipBadImages,
    cli_words,
    given_options,
    out,
    print_json,
    run,
    setting_option,
    settings_command,
)
from nascompress.cli.options import EvalLimit, Force, JsonOut, Out, Resume, RunDataset, TrainLimit, json_option
from nascompress.config import StageSettings, user_settings
from nascompress.data import DataConfig
from nascompress.data.choose import data_config_for
from nascompress.methods.dcs import SEARCH_DCS_SETTINGS
from nascompress.models.build import ModelShape
from nascompress.profiling.compare import dense_flops_text
from nascompress.dcs_search.search_config import SEARCH_TRAIN_SETTINGS, DCSSearchConfig
from nascompress.studies.trials import SearchJob, build_job as build_search_job, run_search
from nascompress.train.run import RUNTIME_SETTINGS, TrainJob
from nascompress.runs.run_config import run_data_config
from nascompress.dcs_search import DCSSearchJob, search_dcs
from nascompress.dcs_search.metrics import DCSMetrics
from nascompress.dcs_search.run import CONTINUE, build_job
from nascompress.errors import SettingError

search_app = typer.Typer(no_args_is_help=True, help="Architecture searches: dcs (channels), tokens and joint (Optuna).")


# search dcs's start: a timm SOURCE's weights and input size (a run directory records its own)
SOURCE_WEIGHTS = StageSettings(TrainJob, ("weights",), notes={"weights": "With a timm SOURCE."})
SOURCE_SIZE = StageSettings(ModelShape, ("img_size",), notes={"img_size": "With a timm SOURCE: its override."})
# the search's settings: the target first, then DCSSearchConfig's and DCSConfig's in field order
SEARCH = StageSettings(
    DCSSearchConfig, ("target_flops", *(f.name for f in user_settings(DCSSearchConfig) if f.name != "target_flops"))
)


@settings_command(search=SEARCH, method=SEARCH_DCS_SETTINGS, recipe=SEARCH_TRAIN_SETTINGS, runtime=RUNTIME_SETTINGS)
def dcs(
    source: Annotated[str, typer.Argument(help="A dense run directory (train/import) or a timm model name.")],
    out_dir: Out = Path("runs/dcs_search"),
    *,
    weights: setting_option(SOURCE_WEIGHTS, "weights") = None,
    img_size: setting_option(SOURCE_SIZE, "img_size") = None,
    dataset: RunDataset = None,
    search: Settings,  # --target-flops, DCSSearchConfig's settings: --arch-lr --lam ... --init-importance
    method: Settings,  # SEARCH_DCS_SETTINGS: --qk-mask --mlp-gates --align --hidden-fill --alpha-init
    recipe: Settings,  # SEARCH_TRAIN_SETTINGS: --epochs --batch-size --lr ...
    train_limit: TrainLimit = None,
    eval_limit: EvalLimit = None,
    runtime: Settings,  # RUNTIME_SETTINGS: --seed --device --amp --deterministic
    skip_bad_images: SkipBadImages = False,
    force: Force = False,
    resume: Resume = False,
    json_out: JsonOut = False,
) -> None:
    """DCS: search Q/K channel masks and MLP channel gates on a dense ViT (FLOPs-aware)."""

    def build() -> DCSSearchJob:
        data = data_config_for(  # the run's data, its dataset replaced by a named one
            run_data_config(source) if Path(source).is_dir() else None,
            dataset=dataset,
            keep_recorded=True,
            train_limit=train_limit,
            eval_limit=eval_limit,
            seed=runtime.seed,
            skip_bad_images=skip_bad_images,
        )
        return build_job(
            source,
            out_dir,
            search=vars(search),
            method=vars(method),
            train={**vars(recipe), **vars(runtime)},
            data=data,
            weights=weights,
            img_size=img_size,
        )

    job = run(build)  # with --resume the job recorded in OUT/config.json is continued instead
    metrics = DCSMetrics.of(run(search_dcs, job, force=force, resume=resume, explicit=given_options()))
    if json_out:
        print_json(metrics.to_dict())
    else:
        cal = metrics.calibration
        note = "" if cal is None else f" (calibrated from {cal.ratio_before:.3f})"
        if metrics.align_probe is not None:
            out.print(f"align auto: {metrics.align_probe.chosen} ({metrics.align_probe.reason})")
        if metrics.family_reason:
            out.print(f"MLP gates: {metrics.family_reason}")
        kept = "" if metrics.kept in (None, "dcs") else ", the magnitude-pruned model kept"
        out.print(
            f"DCS search ({metrics.mlp_gates} gates{kept}): {dense_flops_text(metrics.flops_ratio)}{note}, "
            f"val top-1 {metrics.val_top1:.2f}% "
            f"(dense {metrics.dense_val_top1:.2f}%), MLP channels kept {metrics.mlp_kept}, "
            f"Q/K channels kept {metrics.qk_kept}  -> {out_dir}"
        )
        reason = metrics.comparison.reason if metrics.comparison is not None else None
        if reason:
            out.print(f"kept: {reason}")
        if metrics.stopped is not None:
            out.print(f"the gates stopped early; {cli_words(SettingError(CONTINUE))}")


search_app.command("dcs")(dcs)


# search tokens|joint's study settings: SearchJob's (the space's default: the command's own)
STUDY = StageSettings(
    SearchJob,
    tuple(f.name for f in user_settings(SearchJob)),
    no_default=("space",),
    notes={"space": "Default: tokens evit, joint joint (shipped spaces, sized to the base's depth)."},
)


def _outer_search(kind: str, default_space: str):
    """The ``search tokens`` / ``search joint`` command (the same engine, another default space)."""

    @settings_command(study=STUDY, runtime=RUNTIME_SETTINGS)
    def command(
        base: Annotated[
            Path, typer.Argument(help="The run every trial starts from (dense, imported or DCS-materialized).")
        ],
        *,
        study: Settings,  # SearchJob's settings: --space --study --storage --trials ... --no-enqueue
        dataset: RunDataset = None,
        runtime: Settings,  # RUNTIME_SETTINGS: --seed (the samplers, the data subsets, the trials) --device --amp ...
        skip_bad_images: SkipBadImages = False,
        json_out: json_option("One JSON line per finished trial, then a summary.") = False,
    ) -> None:
        def build() -> SearchJob:
            # None: the job reads the run's data; --skip-bad-images sets it on the run's (or the default)
            recorded = run_data_config(base) if skip_bad_images and dataset is None and base.is_dir() else None
            data = data_config_for(
                recorded,
                dataset=dataset,
                default=DataConfig.dataset if skip_bad_images else None,
                skip_bad_images=skip_bad_images,
            )
            return build_search_job(
                base, search={**vars(study), "space": study.space or default_space}, runtime=vars(runtime), data=data
            )

        job = run(build)
        res = run(run_search, job, progress=not json_out, json_progress=json_out)
        if json_out:
            print_json(res.to_dict())
            return
        out.print(
            f"study {res.study} ({res.storage}): {res.complete}/{res.n_trials} complete, "
            f"{len(res.front)} on the front; see `nascompress study show {res.study}`"
        )

    command.__doc__ = (
        f"Optuna search over a search-space file ({kind}): each trial applies the methods to the base "
        "run, scores accuracy and FLOPs (or latency/throughput); resumable, several workers."
    )
    return command


# the default spaces: shipped ones, by name (nascompress/search_spaces/, found wherever the command runs)
search_app.command("tokens")(_outer_search("tokens", "evit"))
search_app.command("joint")(_outer_search("joint", "joint"))


def register(app: typer.Typer) -> None:
    app.add_typer(search_app, name="search")
