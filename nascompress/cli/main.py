"""The ``nascompress`` command line: parse, build a config, call one library function, print."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional
import importlib
from dataclasses import replace

import typer
from rich.table import Table

from nascompress.cli.common import (
    STATE,
    Settings,
    SkipBadImages,
    fail,
    given_options,
    out,
    print_json,
    run,
    setting_option,
    settings_command,
)
from nascompress.cli.options import EvalLimit, Force, JsonOut, Out, Resume, RunDataset
from nascompress.data import DataConfig, InputOverrides
from nascompress.profiling.evaluate import EvaluateSettings
from nascompress.models.build import ModelShape
from nascompress.profiling.config import PROFILE_CLASSES, PROFILE_MODEL_SETTINGS, ProfileConfig
from nascompress.train.run import RUNTIME_SETTINGS, TRAIN_SETTINGS, TrainJob, build_job, train as train_job
from nascompress.train.config import TrainConfig
from nascompress import __version__
from nascompress.data import count_classes
from nascompress.data.choose import data_config_for
from nascompress.profiling.jobs import epsilon_sweep, evaluate_run, profile as profile_fn
from nascompress.runs.run_config import run_data_config
from nascompress.profiling.compare import comparison_text
from nascompress.runtime import keep_freed_memory

app = typer.Typer(
    add_completion=True,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Make Vision Transformers cheaper without making them worse.",
)


def _print_version(value: bool) -> None:
    if value:
        out.print(f"nascompress {__version__}", highlight=False)
        raise typer.Exit()


@app.callback()
def main(
    debug: Annotated[bool, typer.Option("--debug", help="Show full tracebacks on errors.")] = False,
    version: Annotated[
        bool, typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """nascompress: search, materialize and retrain compressed timm ViTs."""
    STATE["debug"] = debug
    keep_freed_memory()  # every command's forwards reuse freed memory (nascompress.runtime)


@app.command()
@settings_command(
    shape=ModelShape, input=InputOverrides, data=DataConfig, recipe=TRAIN_SETTINGS, runtime=RUNTIME_SETTINGS
)
def train(
    out_dir: Out = Path("runs/base"),
    *,
    shape: ModelShape,  # --model --img-size --patch-size --embed-dim --depth --num-heads --in-chans --num-classes
    weights: setting_option(TrainJob, "weights") = None,
    reset_head: setting_option(TrainJob, "reset_head") = False,
    linear_probe: setting_option(TrainJob, "linear_probe") = False,
    input: InputOverrides,  # --mean --std --interpolation --crop-pct
    data: Settings,  # DataConfig: --dataset --data-dir --val-fraction --train-limit ...
    recipe: Settings,  # TRAIN_SETTINGS: --epochs --batch-size --lr --base-lr ...
    runtime: Settings,  # RUNTIME_SETTINGS: --seed --device --amp --deterministic
    force: Force = False,
    resume: Resume = False,
    json_out: JsonOut = False,
) -> None:
    """Train a timm ViT densely on a real dataset (the base model every method compresses), or with
    --linear-probe fit only a new head on a frozen pretrained backbone."""

    def build():
        data_cfg = data_config_for(dataset=data.dataset, settings=vars(data), seed=runtime.seed)
        spec = shape.spec(shape.num_classes if shape.num_classes is not None else count_classes(data_cfg))
        return build_job(
            spec,
            out_dir,
            data=data_cfg,
            train={**vars(recipe), **vars(runtime)},
            weights=weights,
            reset_head=reset_head,
            input=input,
            linear_probe=linear_probe,
        )

    job = run(build)
    metrics = run(train_job, job, force=force, resume=resume, explicit=given_options())
    if json_out:
        print_json(metrics.to_dict())
    elif metrics.linear_probe:
        out.print(
            f"linear probe: val top-1 {metrics.best_val_top1:.2f}%  test top-1 {metrics.test_top1:.2f}%  "
            f"L2 {metrics.l2:g}  features {metrics.feature_time_s:.0f}s  fit {metrics.fit_time_s:.1f}s"
            f"  -> {out_dir}"
        )
    else:
        out.print(
            f"best val top-1 {metrics.best_val_top1:.2f}%  test top-1 {metrics.test_top1:.2f}%  "
            f"train time {metrics.train_time_s:.0f}s  -> {out_dir}"
        )


@app.command()
@settings_command(settings=EvaluateSettings)
def evaluate(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (or model.safetensors).")],
    *,
    settings: EvaluateSettings,  # --split --teacher --epsilon
    dataset: RunDataset = None,
    data_dir: setting_option(DataConfig, "data_dir") = DataConfig.data_dir,
    eval_limit: EvalLimit = None,
    eval_batch_size: setting_option(TrainConfig, "eval_batch_size") = TrainConfig.eval_batch_size,
    device: setting_option(TrainConfig, "device") = TrainConfig.device,
    dtype: setting_option(ProfileConfig, "dtype") = ProfileConfig.dtype,
    skip_bad_images: SkipBadImages = False,
    json_out: JsonOut = False,
) -> None:
    """Top-1 accuracy and loss of a saved model on a split (and agreement with a teacher)."""
    split, epsilon = settings.split, settings.epsilon

    def data_config() -> DataConfig:
        # the run's data, or a named dataset's (--data-dir with it) drawn with the run's seed: a test
        # split it carved is the same images
        data = data_config_for(
            run_data_config(run_dir) if run_dir.is_dir() else None,
            dataset=dataset,
            settings={"data_dir": data_dir},
            keep_recorded_seed=True,
            eval_limit=eval_limit,
            skip_bad_images=skip_bad_images,
        )
        replace(TrainConfig(), eval_batch_size=eval_batch_size)  # its range checked, naming the option
        return data

    data = run(data_config)  # a bad value: one line naming its option
    if epsilon is not None:
        res = run(
            lambda: epsilon_sweep(
                run_dir, list(epsilon), data=data, split=split, device=device, batch_size=eval_batch_size
            )
        )
        if json_out:
            print_json(res.to_dict())
            return
        for r in res.rows:
            out.print(
                f"epsilon {r.epsilon:.3g}  {split} top-1 {r.top1:.2f}%  SGIS exit {100 * r.exit_share:.1f}%  "
                f"{r.mean_flops / 1e6:.2f} MFLOPs/image"
            )
        return
    res = run(
        evaluate_run,
        run_dir,
        data=data,
        split=split,
        teacher=settings.teacher,
        device=device,
        batch_size=eval_batch_size,
        dtype=dtype,
    )
    if json_out:
        print_json(res.to_dict())
        return
    msg = f"{split} top-1 {res.top1:.2f}%  loss {res.loss:.4f}  ({res.n} images)"
    if res.agreement is not None:
        msg += f"  agreement with teacher {res.agreement:.2f}%"
    if res.exit_share is not None:
        msg += (
            f"  SGIS exit {100 * res.exit_share:.1f}% (epsilon {res.epsilon:g})  "
            f"{res.mean_flops / 1e6:.2f} MFLOPs/image"
        )
    out.print(msg)


@app.command()
@settings_command(shape=PROFILE_MODEL_SETTINGS, measure=ProfileConfig)
def profile(
    run_dir: Annotated[Optional[Path], typer.Argument(help="A run directory; or use --model.")] = None,
    *,
    shape: ModelShape,  # --model --img-size ... --num-classes (PROFILE_MODEL_SETTINGS)
    compare: Annotated[
        Optional[Path],
        typer.Option(
            help="A reference run (e.g. the dense base), timed interleaved: RUN_DIR's FLOPs and parameters "
            "are given as 'x the reference's' (< 1: smaller), its speed as 'x faster' (> 1: faster)."
        ),
    ] = None,
    measure: ProfileConfig,  # --no-latency --iters --batch-size --dtype --compile (the pipeline's report: keys)
    device: setting_option(TrainConfig, "device") = TrainConfig.device,
    json_out: JsonOut = False,
) -> None:
    """Parameters, FLOPs (1 MAC = 1 FLOP, attention matmuls included) per block, latency, throughput."""
    if (run_dir is None) == (shape.model is None):
        fail("give either a RUN_DIR or --model NAME (not both)")
    target = run_dir if run_dir is not None else run(shape.spec, PROFILE_CLASSES)
    res = run(profile_fn, target, compare=compare, device=device, **measure.to_dict())
    if json_out:
        print_json(res.to_dict())
        return
    c = res.comparison
    for label, r in res.models.items():
        role = " (reference)" if c is not None and label == c.reference else ""
        out.print(
            f"{label}{role}: {r.gflops:.3f} GFLOPs, {r.params / 1e6:.2f} M params",
            highlight=False,
            soft_wrap=True,
        )  # the path whole, above a table that may be narrower
        t = Table()
        for col in ("block", "attn MFLOPs", "mlp MFLOPs", "other MFLOPs"):
            t.add_column(col, justify="right")
        for i, b in enumerate(r.blocks):
            t.add_row(str(i + 1), f"{b.attn / 1e6:.2f}", f"{b.mlp / 1e6:.2f}", f"{b.other / 1e6:.2f}")
        t.add_row("rest", "", "", f"{r.other_macs / 1e6:.2f}")
        out.print(t)
        if r.stages is not None:  # MG-ViT: the table's blocks are the SGIS; MGIS and PPSM are in "rest"
            st = r.stages
            ppsm = f" (PPSM {st.ppsm_flops / 1e6:.3f})" if st.ppsm_flops is not None else ""  # mgvit-h has none
            out.print(
                f"MG-ViT stages per image: SGIS {st.sgis_flops / 1e6:.2f} MFLOPs, MGIS "
                f"{st.mgis_flops / 1e6:.2f} MFLOPs{ppsm}; an image that exits at "
                f"SGIS costs the first, any other both (the table counts the random profiling images' paths)"
            )
        if r.latency_ms is not None:
            out.print(
                f"latency (batch {r.latency_batch}) {r.latency_ms:.2f} ms   "
                f"throughput (batch {r.throughput_batch}) {r.throughput:.1f} img/s   on {res.device} "
                f"({res.dtype})"
            )
        if r.latency_ms_compiled is not None:
            out.print(
                f"compiled: latency {r.latency_ms_compiled:.2f} ms   throughput {r.throughput_compiled:.1f} img/s"
            )
        if r.compile_note is not None:
            out.print(r.compile_note)
        if r.qk_layout is not None:
            out.print(
                f"narrowed Q/K heads: {r.qk_layout.pad} attention(s) zero-padded to V's head dim, "
                f"{r.qk_layout.packed} packed (see README, --align)"
            )
    if c is not None:
        for line in comparison_text(c):
            out.print(line, highlight=False, soft_wrap=True)


def _register_optional() -> None:
    """Method commands live in their own modules; each adds itself to ``app``."""
    for mod in (
        "nascompress.cli.finetune",
        "nascompress.cli.dcs",
        "nascompress.cli.retrain",
        "nascompress.cli.search",
        "nascompress.cli.importer",
        "nascompress.cli.study",
        "nascompress.cli.pipeline",
        "nascompress.cli.export",
        "nascompress.cli.quantize",
        "nascompress.cli.latency",
    ):
        try:
            importlib.import_module(mod).register(app)
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise


_register_optional()

if __name__ == "__main__":
    app()
