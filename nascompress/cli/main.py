"""The ``nascompress`` command line: parse, build a config, call one library function, print."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.table import Table

from nascompress.cli.common import (STATE, SkipBadImages, command_signature, fail, given_options, input_overrides, out,
                                    print_json, run, setting_params, setting_values, skip_bad)
from nascompress.config import setting_help
from nascompress.data import FMNIST_DIR, DataConfig
from nascompress.models import ModelShape
from nascompress.profiling.config import PROFILE_CLASSES, PROFILE_MODEL_SETTINGS, ProfileConfig
from nascompress.train import RUNTIME_SETTINGS, TRAIN_SETTINGS, TrainConfig

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Make Vision Transformers cheaper without making them worse.")


@app.callback()
def main(debug: Annotated[bool, typer.Option("--debug", help="Show full tracebacks on errors.")] = False) -> None:
    """nascompress: search, materialize and retrain compressed timm ViTs."""
    STATE["debug"] = debug


Device = Annotated[str, typer.Option(help=setting_help(TrainConfig, "device"))]
Force = Annotated[bool, typer.Option("--force", help="Overwrite an existing output directory.")]
DataDir = Annotated[str, typer.Option(help=setting_help(DataConfig, "data_dir"))]
Mean = Annotated[Optional[str], typer.Option(help="Normalisation mean, comma-separated (default: the weights' pretrained config, else the dataset's).")]
Std = Annotated[Optional[str], typer.Option(help="Normalisation std, comma-separated (default: as --mean).")]
Interpolation = Annotated[Optional[str], typer.Option(help="Resize filter: bilinear, bicubic or nearest (default: as --mean).")]
CropPct = Annotated[Optional[float], typer.Option(help="ImageFolder eval crop: resize to size/crop_pct, centre-crop (default: as --mean).")]
DType = Annotated[str, typer.Option(help=setting_help(ProfileConfig, "dtype"))]


def _train_options(
    out_dir: Annotated[Path, typer.Option("--out", help="Run directory to create.")] = Path("runs/base"),
    # (here: the model's settings, ModelShape: --model --img-size ... --num-classes)
    weights: Annotated[Optional[Path], typer.Option(help="Local .safetensors/.pth weights to start from.")] = None,
    reset_head: Annotated[bool, typer.Option("--reset-head", help="A new head: the weights' is missing (backbone only) or has another class count.")] = False,
    linear_probe: Annotated[bool, typer.Option("--linear-probe", help="Freeze the --weights backbone; fit only a new head on its cached features (logistic regression).")] = False,
    mean: Mean = None, std: Std = None, interpolation: Interpolation = None, crop_pct: CropPct = None,
    # (here: the data settings (DataConfig), the training settings (TRAIN_SETTINGS), the run settings)
    force: Force = False,
    resume: Annotated[bool, typer.Option("--resume", help="Continue the run in --out from its last checkpoint.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print metrics as JSON.")] = False,
) -> None:
    """``train``'s own options; those of the library's settings are generated: ModelShape's before
    ``--weights``, DataConfig's, TRAIN_SETTINGS' and RUNTIME_SETTINGS' before ``--force``
    (``train.__signature__``)."""


def train(**kw: Any) -> None:
    """Train a timm ViT densely on a real dataset (the base model every method compresses), or with
    --linear-probe fit only a new head on a frozen pretrained backbone."""
    from nascompress.api import count_classes
    from nascompress.train import TrainJob, train as train_job, train_recipe

    out_dir, weights, linear_probe, seed = kw["out_dir"], kw["weights"], kw["linear_probe"], kw["seed"]

    def build():
        data = DataConfig(**setting_values(DataConfig, kw), split_seed=0, subset_seed=seed)
        shape = ModelShape(**setting_values(ModelShape, kw))
        spec = shape.spec(shape.num_classes if shape.num_classes is not None else count_classes(data))
        cfg = train_recipe(fine_tune=weights is not None and not linear_probe,  # a pretrained start: fine-tuning
                           **setting_values(TRAIN_SETTINGS, kw), **setting_values(RUNTIME_SETTINGS, kw))
        return TrainJob(model=spec, data=data, train=cfg, out=str(out_dir),
                        weights=str(weights) if weights else None, reset_head=kw["reset_head"],
                        input=input_overrides(kw["mean"], kw["std"], kw["interpolation"], kw["crop_pct"]),
                        linear_probe=linear_probe)

    job = run(build)
    metrics = run(train_job, job, force=kw["force"], resume=kw["resume"], explicit=given_options())
    if kw["json_out"]:
        print_json(metrics)
    elif metrics.get("linear_probe"):
        out.print(f"linear probe: val top-1 {metrics['best_val_top1']:.2f}%  test top-1 {metrics['test_top1']:.2f}%  "
                  f"L2 {metrics['l2']:g}  features {metrics['feature_time_s']:.0f}s  fit {metrics['fit_time_s']:.1f}s"
                  f"  -> {out_dir}")
    else:
        out.print(f"best val top-1 {metrics['best_val_top1']:.2f}%  test top-1 {metrics['test_top1']:.2f}%  "
                  f"train time {metrics['train_time_s']:.0f}s  -> {out_dir}")


train.__signature__ = command_signature(_train_options, {  # type: ignore[attr-defined]
    "weights": setting_params(ModelShape),
    "force": setting_params(DataConfig) + setting_params(TRAIN_SETTINGS) + setting_params(RUNTIME_SETTINGS)})
app.command()(train)


@app.command()
def evaluate(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (or model.safetensors).")],
    split: Annotated[str, typer.Option(help="train, val or test.")] = "test",
    dataset: Annotated[Optional[str], typer.Option(help="Override the run's dataset.")] = None,
    data_dir: DataDir = str(FMNIST_DIR),
    eval_limit: Annotated[Optional[int], typer.Option(help="Use only N images.")] = None,
    teacher: Annotated[Optional[Path], typer.Option(help="A run whose top-1 predictions to compare with.")] = None,
    batch_size: Annotated[int, typer.Option()] = 256, device: Device = "auto", dtype: DType = "fp32",
    epsilon: Annotated[Optional[str], typer.Option(help="MG-ViT: sweep early-exit thresholds, e.g. 0.5,0.7,0.9,1.")] = None,
    skip_bad_images: SkipBadImages = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Top-1 accuracy and loss of a saved model on a split (and agreement with a teacher)."""
    from dataclasses import replace

    from nascompress.api import evaluate_run, run_data_config
    from nascompress.data import DataConfig

    data = run_data_config(run_dir) if run_dir.is_dir() else None
    if dataset is not None or data is None:
        data = DataConfig(dataset=dataset or "fashion-mnist", data_dir=data_dir)
    if eval_limit is not None:
        data = replace(data, eval_limit=eval_limit)
    data = skip_bad(data, skip_bad_images)
    if epsilon is not None:
        from nascompress.api import epsilon_sweep
        from nascompress.methods.mgvit import parse_epsilons

        res = run(lambda: epsilon_sweep(run_dir, parse_epsilons(epsilon), data=data, split=split, device=device,
                                        batch_size=batch_size))
        if json_out:
            print_json(res)
            return
        for r in res["rows"]:
            out.print(f"epsilon {r['epsilon']:.3g}  {split} top-1 {r['top1']:.2f}%  SGIS exit {100 * r['exit_share']:.1f}%  "
                      f"{r['mean_flops'] / 1e6:.2f} MFLOPs/image")
        return
    res = run(evaluate_run, run_dir, data=data, split=split, teacher=teacher, device=device, batch_size=batch_size,
              dtype=dtype)
    if json_out:
        print_json(res)
        return
    msg = f"{split} top-1 {res['top1']:.2f}%  loss {res['loss']:.4f}  ({res['n']} images)"
    if "agreement" in res:
        msg += f"  agreement with teacher {res['agreement']:.2f}%"
    if "exit_share" in res:
        msg += f"  SGIS exit {100 * res['exit_share']:.1f}% (epsilon {res['epsilon']:g})  {res['mean_flops'] / 1e6:.2f} MFLOPs/image"
    out.print(msg)


def _profile_options(
    run_dir: Annotated[Optional[Path], typer.Argument(help="A run directory; or use --model.")] = None,
    # (here: the model's settings, PROFILE_MODEL_SETTINGS: --model --img-size ... --num-classes)
    compare: Annotated[Optional[Path], typer.Option(help="A second run measured interleaved; ratios vs the first.")] = None,
    # (here: the measurement's settings, ProfileConfig: --no-latency --iters --batch-size --dtype --compile)
    device: Device = "auto",
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """``profile``'s own options; ProfileConfig's (the pipeline's report: keys) are generated before ``--device``."""


def profile(**kw: Any) -> None:
    """Parameters, FLOPs (1 MAC = 1 FLOP, attention matmuls included) per block, latency, throughput."""
    from nascompress.api import profile as profile_fn
    from nascompress.profiling.config import ProfileConfig

    run_dir, model, json_out = kw["run_dir"], kw["model"], kw["json_out"]
    if (run_dir is None) == (model is None):
        fail("give either a RUN_DIR or --model NAME (not both)")
    target = run_dir if run_dir is not None else run(
        lambda: ModelShape(**setting_values(PROFILE_MODEL_SETTINGS, kw)).spec(PROFILE_CLASSES))
    settings = run(lambda: ProfileConfig(**setting_values(ProfileConfig, kw)))
    res = run(profile_fn, target, compare=kw["compare"], device=kw["device"], **settings.to_dict())
    if json_out:
        print_json(res)
        return
    for label, r in res["models"].items():
        t = Table(title=f"{label}  ({r['gflops']:.3f} GFLOPs, {r['params'] / 1e6:.2f} M params)")
        for col in ("block", "attn MFLOPs", "mlp MFLOPs", "other MFLOPs"):
            t.add_column(col, justify="right")
        for i, b in enumerate(r["blocks"]):
            t.add_row(str(i + 1), f"{b['attn'] / 1e6:.2f}", f"{b['mlp'] / 1e6:.2f}", f"{b['other'] / 1e6:.2f}")
        t.add_row("rest", "", "", f"{r['other_macs'] / 1e6:.2f}")
        out.print(t)
        if "stages" in r:  # MG-ViT: the table's blocks are the SGIS; MGIS and PPSM are in "rest"
            st = r["stages"]
            ppsm = f" (PPSM {st['ppsm_flops'] / 1e6:.3f})" if "ppsm_flops" in st else ""  # mgvit-h has none
            out.print(f"MG-ViT stages per image: SGIS {st['sgis_flops'] / 1e6:.2f} MFLOPs, MGIS "
                      f"{st['mgis_flops'] / 1e6:.2f} MFLOPs{ppsm}; an image that exits at "
                      f"SGIS costs the first, any other both (the table counts the random profiling images' paths)")
        if "latency_ms" in r:
            out.print(f"latency (batch {r['latency_batch']}) {r['latency_ms']:.2f} ms   "
                      f"throughput (batch {r['throughput_batch']}) {r['throughput']:.1f} img/s   on {res['device']} "
                      f"({res['dtype']})")
        if "latency_ms_compiled" in r:
            out.print(f"compiled: latency {r['latency_ms_compiled']:.2f} ms   throughput {r['throughput_compiled']:.1f} img/s")
        if "compile_note" in r:
            out.print(r["compile_note"])
        if "qk_layout" in r:
            out.print(f"narrowed Q/K heads: {r['qk_layout']['pad']} attention(s) zero-padded to V's head dim, "
                      f"{r['qk_layout']['packed']} packed (see README, --align)")
    for label, rr in res.get("ratios", {}).items():
        out.print(f"{label} vs reference: " + "  ".join(f"{k} {v:.3f}x" for k, v in rr.items()))


def _profile_signature() -> Any:
    return command_signature(_profile_options, {"compare": setting_params(PROFILE_MODEL_SETTINGS),
                                                "device": setting_params(ProfileConfig)})


profile.__signature__ = _profile_signature()  # type: ignore[attr-defined]
app.command()(profile)


def _register_optional() -> None:
    """Method commands live in their own modules; each adds itself to ``app``."""
    import importlib

    for mod in ("nascompress.cli.finetune", "nascompress.cli.dcs", "nascompress.cli.retrain", "nascompress.cli.search", "nascompress.cli.importer", "nascompress.cli.study",
                "nascompress.cli.pipeline", "nascompress.cli.export", "nascompress.cli.quantize"):
        try:
            importlib.import_module(mod).register(app)
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise


_register_optional()

if __name__ == "__main__":
    app()
