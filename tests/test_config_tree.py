"""One config tree: every setting of a DCS search is declared once, in the library's dataclasses
(:func:`nascompress.config.setting`), and found both as a ``search dcs`` option and as a
``stages.dcs`` pipeline key, or in an explicit exclusion list below (with the reason)."""
from __future__ import annotations

import dataclasses

import pytest
import typer

from nascompress.config import user_default, user_settings
from nascompress.methods.dcs import DCSConfig
from nascompress.pipeline import DCSStage, PipelineConfig
from nascompress.pipeline.schema import library_config
from nascompress.search.dcs import DCSSearchConfig, DCSSearchJob
from nascompress.train import TrainConfig

from .conftest import invoke

# Fields that are deliberately neither a `search dcs` option nor a `stages.dcs` key.
EXCLUDED = {
    DCSSearchConfig: {
        # internal tuning constants of the optimiser and the lambda controller (the module docstring's
        # numbers; no user has needed them, study trials do not search them)
        "arch_lr_end": "cosine end of the arch lr, internal constant",
        "arch_beta1": "Adam momentum of the arch parameters, internal constant",
        "tau_decay": "temperature factor per epoch, internal constant (the help of --tau0 says x0.95)",
        "tolerance": "the +-5% band around the target, internal constant (the help of --target-flops says it)",
        "steer_gain": "lambda controller gain, internal constant",
        "steer_rate": "lambda controller gain, internal constant",
        "weight_fraction": "W / arch split of the training images, internal constant",
        "init_images": "images of the pre-search measurements, internal constant (the help of --init-importance)",
        # set by the callers, not by the user
        "init_seed": "study trials give the study's seed; the CLI and the pipeline leave it to the job's seed",
        "auto_batch": "derived: true when batch_size is not given (CLI and pipeline)",
    },
    DCSConfig: {
        "theta_init": "follows alpha_init (the CLI and the pipeline set both from --alpha-init / alpha_init)",
        "init_spread": "internal constant of the gates' initial spread",
    },
    TrainConfig: {
        # the search's fixed training recipe (SEARCH_TRAIN_DEFAULTS)
        "weight_decay": "search recipe constant (SEARCH_TRAIN_DEFAULTS)",
        "keep": "the search keeps its last epoch (SEARCH_TRAIN_DEFAULTS)",
        "label_smoothing": "TrainConfig default, not a search setting",
        "ema_decay": "TrainConfig default, not a search setting",
        "grad_clip": "TrainConfig default, not a search setting",
        "eval_batch_size": "TrainConfig default, not a search setting",
        "eval_start": "TrainConfig default, not a search setting",
        "log_every": "TrainConfig default, not a search setting",
    },
}
# TrainConfig fields that are top-level pipeline keys (every training stage), not stages.dcs keys
PIPELINE_TOP_LEVEL = {"seed", "device", "amp", "deterministic"}


def _dcs_command():
    from nascompress.cli.main import app

    return typer.main.get_command(app).commands["search"].commands["dcs"]


def _cli_options() -> dict[str, object]:
    """Option name (``--lam``) -> the click parameter, for ``search dcs``."""
    return {o: p for p in _dcs_command().params if p.param_type_name == "option" for o in p.opts}


def _cli_name(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or f"--{f.name.replace('_', '-')}"


def _where(cls: type, f: dataclasses.Field) -> tuple[bool, bool]:
    cli = _cli_name(f) in _cli_options()
    keys = set(DCSStage.keys())
    if cls is TrainConfig:
        keys |= PIPELINE_TOP_LEVEL & set(PipelineConfig.keys())
    return cli, f.name in keys


@pytest.mark.parametrize("cls", [DCSSearchConfig, DCSConfig, TrainConfig], ids=lambda c: c.__name__)
def test_every_field_is_a_cli_option_and_a_pipeline_key_or_excluded(cls):
    missing = []
    for f in dataclasses.fields(cls):
        cli, pipe = _where(cls, f)
        if f.name in EXCLUDED[cls]:
            assert not (cli and pipe), f"{cls.__name__}.{f.name} is excluded but exposed in both: drop the exclusion"
            continue
        if not (cli and pipe):
            missing.append(f"{cls.__name__}.{f.name} (cli: {cli}, pipeline: {pipe})")
    assert not missing, "settings not in both the CLI and the pipeline: " + ", ".join(missing)


@pytest.mark.parametrize("cls", [DCSSearchConfig, DCSConfig], ids=lambda c: c.__name__)
def test_library_settings_give_the_cli_and_the_pipeline_the_same_default_and_checks(cls):
    opts = _cli_options()
    stage = {f.name: f for f in dataclasses.fields(DCSStage)}
    for f in user_settings(cls):
        p = opts[_cli_name(f)]
        if f.metadata.get("flag"):
            assert p.default is False and user_default(f) is True, f.name
        else:
            assert p.default == user_default(f) and p.help == f.metadata["help"], f.name
        assert stage[f.name].default == user_default(f), f.name
        assert stage[f.name].metadata is not None and dict(stage[f.name].metadata) == dict(f.metadata), f.name


def test_the_user_defaults_are_the_library_defaults_but_mlp_gates():
    # the DCS building block defaults to the paper's residual gates; the search's front ends to the probe
    differ = {f.name for cls in (DCSSearchConfig, DCSConfig) for f in user_settings(cls)
              if user_default(f) != f.default}
    assert differ == {"mlp_gates"}


def test_grad_balance_is_a_pipeline_key(tmp_path):
    s = DCSStage(grad_balance=False, block_weights=False)
    cfg = library_config(s, DCSSearchConfig, target_flops=0.5)
    assert cfg.grad_balance is False and cfg.block_weights is False and cfg.target_flops == 0.5
    assert library_config(DCSStage(), DCSConfig).mlp_gates == "auto"


def test_the_cli_builds_the_search_from_the_generated_options(tmp_path, monkeypatch):
    import nascompress.search as search

    seen = {}

    def fake(job: DCSSearchJob, **kw):
        seen["job"] = job
        return {"ok": True}

    monkeypatch.setattr(search, "search_dcs", fake)
    r = invoke("search", "dcs", "vit_tiny_patch16_224", "--out", tmp_path / "o", "--target-flops", "0.6",
               "--no-grad-balance", "--no-calibrate", "--lam", "0.3", "--mlp-gates", "hidden", "--alpha-init", "3",
               "--min-lr", "2e-6", "--json")
    assert r.exit_code == 0, r.output
    job = seen["job"]
    assert job.search == DCSSearchConfig(target_flops=0.6, grad_balance=False, calibrate=False, lam=0.3,
                                         auto_batch=True)
    assert job.method == DCSConfig(mlp_gates="hidden", alpha_init=3.0, theta_init=3.0)
    assert job.train.min_lr == 2e-6
