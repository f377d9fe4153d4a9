"""The CLI's plumbing options are declared once (nascompress/cli/options.py) with one help text each,
the quantize schemes once (the library's), and the token methods' recipe fields are options with
help like every other setting."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import typer

import nascompress.cli as cli_pkg
from nascompress.cli import options
from nascompress.methods import get_method

from .conftest import invoke, patch_everywhere

CLI = Path(cli_pkg.__file__).parent
PLUMBING = ("--out", "--force", "--resume", "--json")


def _commands():
    """Every leaf command of the app as ("search dcs", click command)."""
    from nascompress.cli.main import app

    stack = [((), typer.main.get_command(app))]
    while stack:
        path, cmd = stack.pop()
        subs = getattr(cmd, "commands", None)
        if subs is None:
            yield " ".join(path), cmd
        else:
            stack += [((*path, name), sub) for name, sub in subs.items()]


def _helps(option: str) -> dict[str, str]:
    """Command -> the help of its ``option``, for every command that has it."""
    return {
        name: p.help
        for name, cmd in _commands()
        for p in cmd.params
        if p.param_type_name == "option" and option in p.opts
    }


@pytest.mark.parametrize("option", PLUMBING)
def test_each_plumbing_option_is_declared_once_in_the_cli_sources(option):
    """Only options.py writes ``typer.Option("--out", ...)`` (and --force, --resume, --json)."""
    where = [p.name for p in sorted(CLI.glob("*.py")) if re.search(rf'typer\.Option\(\s*"{option}"', p.read_text())]
    assert where == ["options.py"], where


def test_a_runs_data_options_are_declared_once_in_the_cli_sources():
    pattern = re.compile(r"setting_option\(\s*RUN_DATA\s*,")
    where = [p.name for p in sorted(CLI.glob("*.py")) if pattern.search(p.read_text())]
    assert where == ["options.py"], where


def test_resume_has_one_help_everywhere():
    helps = _helps("--resume")
    assert set(helps) == {"train", "finetune", "retrain", "search dcs"}
    assert set(helps.values()) == {options.RESUME_HELP}


def test_force_and_json_have_one_help_but_where_the_command_means_more():
    force, json_ = _helps("--force"), _helps("--json")
    assert len(force) >= 10 and len(json_) >= 14  # every writing / printing command
    assert {c for c, h in force.items() if h != options.FORCE_HELP} == {"pipeline"}  # it otherwise continues
    assert {c for c, h in json_.items() if h != options.JSON_HELP} == {"search tokens", "search joint"}  # per trial


def test_out_says_what_it_holds_and_is_a_run_directory_otherwise():
    out = _helps("--out")
    own = {c for c, h in out.items() if h != options.OUT_HELP}
    assert own == {"pipeline", "export", "quantize", "study export", "study report", "latency-table"}
    assert {"train", "import", "finetune", "retrain", "materialize", "search dcs"} <= set(out) - own


def test_a_runs_data_options_have_one_help():
    for option in ("--dataset", "--data-dir", "--train-limit", "--eval-limit"):
        run_helps = {h for c, h in _helps(option).items() if c not in ("train", "import", "evaluate")}
        assert len(run_helps) == 1, (option, run_helps)


def test_the_quantize_schemes_are_declared_once_and_the_cli_shows_them():
    from nascompress.deploy import config as export_config

    scheme = next(f for f in dataclasses.fields(export_config.QuantizeConfig) if f.name == "scheme")
    assert scheme.metadata["choices"] is export_config.SCHEMES
    quantize = next(f for f in dataclasses.fields(export_config.ExportConfig) if f.name == "quantize")
    assert quantize.metadata["choices"] is export_config.QUANTIZE == ("none", "int8", *export_config.SCHEMES)
    assert export_config.QuantizeConfig().scheme == export_config.SCHEMES[0] == "int8-static"
    assert export_config.config_for("int8") == export_config.QuantizeConfig()
    (metavar,) = {
        p.metavar for name, cmd in _commands() if name == "quantize" for p in cmd.params if "--scheme" in p.opts
    }
    assert metavar == "[int8-static|int8-dynamic]"


# the recipes' defaults before they became settings (the defaults must not move)
RECIPES = {
    "evit": {"shrink_start_epoch": 0.0, "shrink_epochs": 0.0, "linearized_temperature": None, "distill": 0.0},
    "dynamicvit": {
        "w_kl": 0.5,
        "w_distill": 0.5,
        "w_ratio": 2.0,
        "gumbel_tau": 1.0,
        "backbone_lr_scale": 0.01,
        "predictor_epochs": 0.0,
        "predictor_steps": 100,
    },
    "sparsifiner": {
        "stage1_epochs": 1,
        "stage1_steps": 100,
        "predictor_lr_scale": 10.0,
        "lambda_attn": 1.0,
        "lambda_token": 0.5,
        "lambda_cls_distill": 0.5,
    },
    "tome": {"distill": 0.0},
}


@pytest.mark.parametrize("method", sorted(RECIPES))
def test_the_token_methods_recipe_fields_are_settings_in_finetune_help(method):
    recipe_cls = get_method(method).recipe_cls
    assert recipe_cls().to_dict() == RECIPES[method]
    (finetune,) = [cmd for name, cmd in _commands() if name == "finetune"]
    opts = {o: p for p in finetune.params for o in p.opts}
    for f in dataclasses.fields(recipe_cls):
        assert f.metadata.get("help"), f"{recipe_cls.__name__}.{f.name} has no help"
        p = opts[f"--{f.name.replace('_', '-')}"]
        assert p.help.startswith(f.metadata["help"]) and method in p.help and p.default is None, f.name
    text = invoke("finetune", "--help").output
    assert all(f"--{f.name.replace('_', '-')}" in text for f in dataclasses.fields(recipe_cls))


def test_recipe_options_and_opt_reach_the_same_recipe(tmp_path, monkeypatch):
    import nascompress.train.finetune as finetune

    seen = []
    from nascompress.train.metrics import FinetuneMetrics

    done = FinetuneMetrics.new(test_top1=1.0)
    patch_everywhere(monkeypatch, finetune, "finetune", lambda job, **kw: seen.append(job) or done)
    base = ("finetune", tmp_path, "--method", "dynamicvit", "--dataset", "synthetic", "--out", tmp_path / "o", "--json")
    for extra in (["--w-ratio", "4", "--predictor-steps", "5"], ["--opt", "w_ratio=4", "--opt", "predictor_steps=5"]):
        r = invoke(*base, *extra)
        assert r.exit_code == 0, r.output
    assert seen[0].recipe == seen[1].recipe == {"w_ratio": 4.0, "predictor_steps": 5}
    from nascompress.errors import NascompressError
    from nascompress.methods.dynamicvit import DynamicViTRecipe

    with pytest.raises(NascompressError, match=r"gumbel_tau must be in \(0, inf\], got 0"):  # the declared range
        DynamicViTRecipe(gumbel_tau=0)
    r = invoke(*base[:3], "evit", *base[4:], "--w-ratio", "4")  # another method's option
    assert r.exit_code == 1 and "--w-ratio is not a evit option" in r.output
