"""``nascompress finetune``: one command for every method with a recipe (thin).

The method options (``--keep-rate``, ``--rho``, ...) are not written here: they come from the method
registry (config and recipe fields with a ``help`` metadata), so a new method brings its own.
"""

from __future__ import annotations

import inspect
import json
import types
from pathlib import Path
from typing import Annotated, Any, Optional
import typing

import typer

from nascompress.cli.common import (
    Settings,
    SkipBadImages,
    given_options,
    out,
    print_json,
    run,
    setting_option,
    settings_command,
)
from nascompress.cli.options import EvalLimit, Force, JsonOut, Out, Resume, RunDataDir, RunDataset, TrainLimit
from nascompress.data.choose import data_config_for
from nascompress.errors import NascompressError
from nascompress.train.finetune import (
    FINETUNE_TRAIN_SETTINGS,
    FinetuneJob,
    build_job,
    finetune as finetune_fn,
    split_settings,
)
from nascompress.profiling.compare import dense_flops_text
from nascompress.train.run import RUNTIME_SETTINGS
from nascompress.runs.run_config import run_data_config
from nascompress.methods import available_methods, get_method


def parse_value(text: str) -> Any:
    """A CLI value: JSON when it parses (numbers, booleans, lists), a comma list of them, else the text."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    except RecursionError:
        raise NascompressError(f"value {text[:40]}... nests too deeply; give a number, a list or a word") from None
    if "," in text:
        return [parse_value(v.strip()) for v in text.split(",") if v.strip()]
    return text


def option_form(f: Any, owner: type) -> tuple[str, Any]:
    """A method option's metavar and parser, from the field's type (``owner``: its config class).

    ``tuple[int, ...]`` (layers): one or more integers, ``4,7,10`` or ``2``; ``float | tuple[float, ...]``
    (a rate or one per layer): one number or several; ``int`` / ``float``: one number; anything else as
    :func:`parse_value`. A value of the wrong form is refused naming the option and the forms it takes."""
    tp = typing.get_type_hints(owner)[f.name]
    args = [
        a
        for a in (typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,))
        if a is not type(None)
    ]
    scalars = [a for a in args if a in (int, float)]
    tuples = [typing.get_args(a)[0] for a in args if typing.get_origin(a) is tuple]
    opt = f"--{f.name.replace('_', '-')}"
    if not scalars and not tuples:  # a text: its declared choices shown, where it has some
        choices = f.metadata.get("choices")
        return (f"[{'|'.join(map(str, choices))}]" if choices else "VALUE"), parse_value
    elem = (tuples or scalars)[0]
    what = "integers" if elem is int else "numbers"
    if tuples and scalars:
        example = "8, or one per layer: 16,8,4" if elem is int else "0.5, or one per layer: 0.9,0.7"
        one = "integer" if elem is int else "number"
        metavar, forms = f"{elem.__name__.upper()}[,...]", f"one {one} or comma-separated {what}, e.g. {example}"
    elif tuples:
        metavar, forms = f"{elem.__name__.upper()}[,...]", f"comma-separated {what}, e.g. 4,7,10 (or one: 2)"
    else:
        metavar, forms = elem.__name__.upper(), f"one {'integer' if elem is int else 'number'}"

    def parse(text: str) -> Any:
        parts = [p.strip() for p in text.split(",")]
        try:
            vals = [elem(p) if elem is int else float(p) for p in parts]
        except ValueError:
            vals = []
        if not vals or (len(vals) > 1 and not tuples):
            raise NascompressError(f"{opt} takes {forms}, got {text!r}")
        if tuples and (len(vals) > 1 or not scalars):
            return tuple(vals)
        return vals[0]

    return metavar, parse


def parse_opts(opts: list[str]) -> dict[str, Any]:
    """``key=value`` pairs (values as :func:`parse_value`)."""
    d = {}
    for o in opts:
        if "=" not in o:
            raise NascompressError(f"--opt {o!r} must look like key=value")
        k, v = o.split("=", 1)
        d[k.strip()] = parse_value(v)
    return d


def method_option_fields() -> dict[str, tuple[Any, list[str]]]:
    """CLI-exposed fields of every registered method: name -> (a field, the methods that have it)."""
    fields: dict[str, tuple[Any, list[str]]] = {}
    for name in available_methods():
        for f in get_method(name).cli_fields():
            if f.name in fields:
                fields[f.name][1].append(name)
            else:
                fields[f.name] = (f, [name])
    return fields


def method_option_form(method: str, name: str) -> tuple[str, Any]:
    """:func:`option_form` of method ``method``'s option ``name`` (its config or recipe field)."""
    m = get_method(method)
    for owner in (m.config_cls, m.recipe_cls):
        if owner is not None and name in owner.__dataclass_fields__:
            return option_form(owner.__dataclass_fields__[name], owner)
    return "VALUE", parse_value


def _method_params() -> list[inspect.Parameter]:
    """One option per method setting (a config or recipe field declared with ``setting()``) of every
    registered method, read in the form its field's type takes (:func:`option_form`: a number, one
    or several; a bad form is one line naming the option) by the method it belongs to."""
    extra = []
    for name, (f, methods) in method_option_fields().items():
        help_text = f"{f.metadata['help']} (for {', '.join(methods)})"
        extra.append(
            inspect.Parameter(
                name,
                inspect.Parameter.KEYWORD_ONLY,
                default=None,
                annotation=Annotated[
                    Optional[str],
                    typer.Option(
                        f"--{name.replace('_', '-')}", help=help_text, metavar=method_option_form(methods[0], name)[0]
                    ),
                ],
            )
        )
    return extra


@settings_command(extra=_method_params(), recipe=FINETUNE_TRAIN_SETTINGS, runtime=RUNTIME_SETTINGS)
def finetune(
    run_dir: Annotated[
        Path, typer.Argument(help="The run to start from (dense, imported or DCS-materialized; also the teacher).")
    ],
    *,
    method: setting_option(FinetuneJob, "method"),
    out_dir: Out,
    opt: Annotated[
        Optional[list[str]], typer.Option(help="Any other method or recipe setting as key=value (repeatable).")
    ] = None,
    zero_shot: setting_option(FinetuneJob, "zero_shot") = False,
    dataset: RunDataset = None,
    data_dir: RunDataDir = None,
    recipe: Settings,  # FINETUNE_TRAIN_SETTINGS: --epochs --batch-size --lr ... (default: the method's recipe)
    train_limit: TrainLimit = None,
    eval_limit: EvalLimit = None,
    runtime: Settings,  # RUNTIME_SETTINGS: --seed --device --amp --deterministic
    skip_bad_images: SkipBadImages = False,
    force: Force = False,
    resume: Resume = False,
    json_out: JsonOut = False,
    **method_opts: Optional[str],  # --keep-rate --rho ... (every registered method's settings: _method_params)
) -> None:
    """Fine-tune (or apply zero-shot) a method on a run: EViT, DynamicViT, Sparsifiner, (Hierarchical) MG-ViT
    or ToMe."""
    fields = method_option_fields()

    def build() -> FinetuneJob:
        settings: dict[str, Any] = {}
        for name, value in method_opts.items():
            if value is None:
                continue
            if method not in fields[name][1]:
                raise NascompressError(
                    f"--{name.replace('_', '-')} is not a {method} option (it belongs to {', '.join(fields[name][1])})"
                )
            settings[name] = method_option_form(method, name)[1](value)
        settings.update(parse_opts(opt or []))
        config, recipe_settings = split_settings(method, settings)
        data = data_config_for(  # the run's data unless a dataset is named; no default dataset
            run_data_config(run_dir) if dataset is None else None,
            dataset=dataset,
            default=None,
            data_dir=data_dir,
            train_limit=train_limit,
            eval_limit=eval_limit,
            seed=runtime.seed,
            skip_bad_images=skip_bad_images,
        )
        if data is None:
            raise NascompressError(
                f"{run_dir} records no dataset (an import without --dataset); give finetune "
                "the dataset to train on with --dataset ('fashion-mnist' or an ImageFolder root)"
            )
        return build_job(
            run_dir,
            out_dir,
            method=method,
            config=config,
            recipe=recipe_settings,
            train={**vars(recipe), **vars(runtime)},
            data=data,
            zero_shot=zero_shot,
        )

    job = run(build)  # with --resume the job recorded in OUT/config.json is continued instead
    metrics = run(finetune_fn, job, force=force, resume=resume, explicit=given_options())
    if json_out:
        print_json(metrics.to_dict())
        return
    start = metrics.start_val_top1
    extra = (
        ""
        if start is None
        else f" (val: start {start:.2f}%, best {metrics.best_val_top1:.2f}% at epoch {metrics.best_epoch})"
    )
    out.print(
        f"{method}: test top-1 {metrics.test_top1:.2f}% ({metrics.test_n} images), "
        f"{metrics.flops / 1e6:.2f} MFLOPs/image, {dense_flops_text(metrics.flops_ratio)} "
        f"(mean of {metrics.flops_images} test images){extra}  -> {out_dir}",
        highlight=False,
    )


def register(app: typer.Typer) -> None:
    app.command("finetune")(finetune)
