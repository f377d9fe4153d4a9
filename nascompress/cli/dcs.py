"""``nascompress materialize``: a finished DCS search, or a study's trial, -> a model run (thin)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from nascompress.cli.common import fail, out, print_json, run, setting_option
from nascompress.cli.options import Force, JsonOut, Out
from nascompress.config import StageSettings
from nascompress.profiling.compare import dense_flops_text
from nascompress.dcs_search.materialize import build_job, materialize_search
from nascompress.studies.trial_model import TrialMaterializeJob, build_job as build_trial_job, materialize_trial

# materialize --study: TrialMaterializeJob's settings (or a DCS SEARCH_DIR instead)
FROM_STUDY = StageSettings(
    TrialMaterializeJob, ("study", "trial", "pick", "storage", "finetune_epochs"), no_default=("study",)
)


def register(app: typer.Typer) -> None:
    @app.command()
    def materialize(
        search_dir: Annotated[
            Optional[Path],
            typer.Argument(help="The --out directory of a finished 'nascompress search dcs' (or use --study)."),
        ] = None,
        out_dir: Out = Path("runs/dcs_mat"),
        study: setting_option(FROM_STUDY, "study") = None,
        trial: setting_option(FROM_STUDY, "trial") = None,
        pick: setting_option(FROM_STUDY, "pick") = None,
        storage: setting_option(FROM_STUDY, "storage") = None,
        finetune_epochs: setting_option(FROM_STUDY, "finetune_epochs") = 0,
        force: Force = False,
        json_out: JsonOut = False,
    ) -> None:
        """Gather a DCS search's channels into a smaller model, or rebuild a study trial's model."""
        if (search_dir is None) == (study is None):
            fail("give either a DCS SEARCH_DIR or --study NAME (with --trial N or --pick RULE)")
        if study is not None:
            job = run(
                build_trial_job,
                study,
                out_dir,
                trial=trial,
                pick=pick,
                storage=storage,
                finetune_epochs=finetune_epochs,
            )
            metrics = run(materialize_trial, job, force=force)
            if json_out:
                print_json(metrics.to_dict())
            else:
                out.print(
                    f"trial {metrics.trial} of {study}: rebuilt top-1 {metrics.rebuilt_accuracy:.2f}% "
                    f"(recorded {metrics.trial_accuracy:.2f}%), {dense_flops_text(metrics.flops_ratio)}"
                    f"  -> {out_dir}"
                )
            return
        metrics = run(materialize_search, run(build_job, search_dir, out_dir), force=force)
        if json_out:
            print_json(metrics.to_dict())
        else:
            ratio = metrics.flops_ratio_vs_dense
            out.print(
                f"materialized: {metrics.macs / 1e6:.2f} MFLOPs"
                + (f" ({dense_flops_text(ratio)})" if ratio else "")
                + f", {metrics.params / 1e6:.3f} M params, max logit diff vs supernet "
                f"{metrics.max_abs_logit_diff:.1e}  -> {out_dir}"
            )
