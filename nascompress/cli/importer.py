"""``nascompress import``: a user's own timm ViT weights as a run directory, without training (thin)."""

from __future__ import annotations

from typing import Annotated

import typer

from nascompress.cli.common import Settings, out, print_json, run, settings_command
from nascompress.cli.options import Force, JsonOut, Out
from nascompress.config import StageSettings, setting_help
from nascompress.data import DataConfig, InputOverrides
from nascompress.data.choose import data_config_for
from nascompress.importer.run import ImportJob, build_job, import_model
from nascompress.train.config import TrainConfig

# The data and run settings ``nascompress import`` offers: the dataset to evaluate on (none: no
# evaluation), its val/test subset and the seed that draws it, the device
IMPORT_DATA_SETTINGS = StageSettings(
    DataConfig,
    ("dataset", "data_dir", "eval_limit", "skip_bad_images"),
    no_default=("dataset",),
    notes={"dataset": "Given: the import is evaluated on its val and test splits."},
)
IMPORT_RUN_SETTINGS = StageSettings(TrainConfig, ("seed", "device"))
# its own settings as options (MODEL is its argument)
IMPORT_SETTINGS = StageSettings(ImportJob, ("weights", "img_size", "num_classes", "num_heads", "eval_batch_size"))


def register(app: typer.Typer) -> None:
    @app.command("import")
    @settings_command(
        settings=IMPORT_SETTINGS, input=InputOverrides, data=IMPORT_DATA_SETTINGS, runtime=IMPORT_RUN_SETTINGS
    )
    def import_cmd(
        model: Annotated[str, typer.Argument(help=setting_help(ImportJob, "model"))],
        out_dir: Out,
        *,
        settings: Settings,  # IMPORT_SETTINGS: --weights --img-size --num-classes --num-heads --eval-batch-size
        input: InputOverrides,  # --mean --std --interpolation --crop-pct
        data: Settings,  # IMPORT_DATA_SETTINGS: --dataset --data-dir --eval-limit --skip-bad-images
        runtime: Settings,  # IMPORT_RUN_SETTINGS: --seed (of the --eval-limit subsets) --device
        force: Force = False,
        json_out: JsonOut = False,
    ) -> None:
        """Import a timm ViT's weights as a run directory (no training) that finetune, search, evaluate and
        nascompress.load accept; evaluate it if --dataset is given."""

        def build():
            evaluated = data_config_for(  # none without --dataset: nothing evaluated
                dataset=data.dataset, default=None, settings=vars(data), seed=runtime.seed
            )
            return build_job(
                {"model": model, **vars(settings)}, out_dir, data=evaluated, input=input, device=runtime.device
            )

        job = run(build)
        metrics = run(import_model, job, force=force)
        notes = metrics.shapes_from_weights or {}
        if notes and not json_out:  # the model built is the weights', not the name's defaults: said, not silent
            out.print(
                f"shapes read from the weights (not {model}'s): "
                + ", ".join(
                    f"{k} {v[0]} (name: {v[1]})"
                    if k != "img_size" or job.img_size is None
                    else f"img_size {v[0]} (given; the weights' grid makes {v[1]}: position embedding resampled)"
                    for k, v in notes.items()
                ),
                highlight=False,
                soft_wrap=True,
            )
        if json_out:
            print_json(metrics.to_dict())
        elif metrics.test_top1 is not None:
            out.print(f"val top-1 {metrics.val_top1:.2f}%  test top-1 {metrics.test_top1:.2f}%  -> {out_dir}")
        else:
            out.print(f"imported {model} -> {out_dir}")
