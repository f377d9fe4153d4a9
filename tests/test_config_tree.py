"""One config tree: every setting of a stage is declared once, in the library's dataclasses
(:func:`nascompress.config.setting`), and found both as an option of the stage's command and as a
key of its pipeline section, or in an explicit exclusion list below (with the reason):
``search dcs`` / ``stages.dcs``, ``train`` / ``base.train`` and ``data``, ``retrain`` /
``stages.retrain``, ``search tokens`` / ``stages.tokens``, ``finetune``'s training options,
``profile`` / ``report``, ``export`` / ``export``. The CLI and the pipeline give the same defaults, and build
the same jobs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import typer
import yaml

from nascompress.config import user_settings
from nascompress.data import FMNIST_DIR, DataConfig
from nascompress.errors import NascompressError
from nascompress.methods.dcs import SEARCH_DCS, SEARCH_DCS_SETTINGS, DCSConfig
from nascompress.deploy.config import ExportConfig
from nascompress.pipeline import (
    BaseTrainSection,
    DataSection,
    DCSStage,
    ExportSection,
    PipelineConfig,
    ReportSection,
    RetrainStage,
    TokensStage,
    load_config,
)
from nascompress.profiling.config import ProfileConfig
from nascompress.pipeline.schema import library_config
from nascompress.retraining.config import RetrainConfig
from nascompress.retraining.run import RetrainJob
from nascompress.dcs_search.search_config import DCSSearchConfig, DCSSearchJob
from nascompress.studies.trials import STUDY_SETTINGS, SearchJob
from nascompress.train.config import TrainConfig
from nascompress.train.run import TrainJob

from .conftest import invoke, needs_fmnist, patch_everywhere
from .study_toys import fake_run

# TrainConfig fields no stage offers: the training loop's internal constants (and what a stage sets itself)
TRAIN_INTERNAL = {
    "grad_clip": "TrainConfig default (max gradient norm 1), not a user setting",
    "eval_batch_size": "TrainConfig default, not a user setting",
    "eval_start": "TrainConfig default (the start is always a best candidate), not a user setting",
    "keep": "each stage's own choice (the search keeps its last epoch), not a user setting",
    "log_every": "TrainConfig default, not a user setting",
}
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
        "project_band": (
            "relative distance from the moving target beyond which --budget project shifts the gates, internal constant"
        ),
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
        # the search's fixed training recipe (SEARCH_TRAIN)
        "weight_decay": "search recipe constant (SEARCH_TRAIN)",
        "label_smoothing": "TrainConfig default, not a search setting",
        "ema_decay": "TrainConfig default, not a search setting",
        **TRAIN_INTERNAL,
    },
}
# Fields deliberately not both an option of `train` and a key of base.train / data.
TRAIN_EXCLUDED = {
    TrainConfig: TRAIN_INTERNAL,
    DataConfig: {
        "split_seed": "fixed 0: every run of a dataset holds out the same validation images",
        "subset_seed": "the run's seed (--seed, the pipeline's seed) draws the train/eval subsets",
    },
}
# Fields deliberately not both a `retrain` option and a stages.retrain key.
RETRAIN_EXCLUDED = {
    RetrainConfig: {
        "input_pool": "internal constant of the image input feature (7x7, the module docstring)",
        "kmeans_iters": "internal constant of the K-means",
        "kmeans_init": "internal constant of the K-means",
    },
    TrainConfig: {
        "weight_decay": "retrain recipe: TrainConfig default, not a retrain setting",
        "label_smoothing": "retrain recipe: TrainConfig default, not a retrain setting",
        "ema_decay": "not a retrain setting",
        **TRAIN_INTERNAL,
    },
}
# Fields deliberately not both a `search tokens` option and a stages.tokens key.
STUDY_EXCLUDED = {
    SearchJob: {
        "base": "the command's BASE argument; the pipeline's current model (the base or the DCS stage's output)",
        "storage": "the pipeline keeps its study in OUT (one SQLite file, a journal with several workers)",
        "max_flops": "the pipeline's constraint is its goal (goal.max_flops, with objective: goal)",
        "max_latency_ms": "the pipeline's constraint is its goal (goal.max_latency_ms); the command's --max-latency",
        "data": "the command reads the base run's data; the pipeline its data section",
    },
}
# Stage defaults that differ from the command's, on purpose (the pipeline section's own key)
# (the study's trials are 50 in both: they were 30 in the pipeline; the space: the command's kind's own
# file, a pipeline names one; the study: named on the command line, "pipeline" in a pipeline)
STAGE_DEFAULTS = {TokensStage: {"space": dataclasses.MISSING, "study": "pipeline"}}
# TrainConfig / SearchJob fields that are top-level pipeline keys (every training stage), not a stage's keys
PIPELINE_TOP_LEVEL = {"seed", "device", "amp", "deterministic"}

# (command, pipeline section, library classes, exclusions): the pairs the tree covers
PAIRS = [
    (("search", "dcs"), DCSStage, EXCLUDED),
    (("train",), BaseTrainSection, {TrainConfig: TRAIN_EXCLUDED[TrainConfig]}),
    (("train",), DataSection, {DataConfig: TRAIN_EXCLUDED[DataConfig]}),
    (("retrain",), RetrainStage, RETRAIN_EXCLUDED),
    (("search", "tokens"), TokensStage, STUDY_EXCLUDED),
    (("search", "joint"), TokensStage, STUDY_EXCLUDED),
    (("profile",), ReportSection, {ProfileConfig: {}}),
    (("export",), ExportSection, {ExportConfig: {"seed": "the check's seed is the pipeline's (its top-level seed)"}}),
]
CASES = [(cmd, section, cls) for cmd, section, excluded in PAIRS for cls in excluded]


def _case_id(case) -> str:
    cmd, section, cls = case
    return f"{' '.join(cmd)}-{section.__name__}-{cls.__name__}"


def _command(path: tuple[str, ...] = ("search", "dcs")):
    from nascompress.cli.main import app

    cmd = typer.main.get_command(app)
    for name in path:
        cmd = cmd.commands[name]
    return cmd


def _cli_options(path: tuple[str, ...] = ("search", "dcs")) -> dict[str, object]:
    """Option name (``--lam``) -> the click parameter, for a command (``search dcs`` by default)."""
    return {o: p for p in _command(path).params if p.param_type_name == "option" for o in p.opts}


def _cli_name(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or f"--{f.name.replace('_', '-')}"


def _excluded(cmd: tuple[str, ...], section: type, cls: type) -> dict[str, str]:
    return next(excluded for c, s, excluded in PAIRS if c == cmd and s is section)[cls]


def _pipeline_fields(section: type, cls: type) -> dict[str, dataclasses.Field]:
    """The section's fields, and for TrainConfig the pipeline's top-level ones (seed, device, ...)."""
    fields = {f.name: f for f in dataclasses.fields(section)}
    if cls in (TrainConfig, SearchJob):
        fields.update({f.name: f for f in dataclasses.fields(PipelineConfig) if f.name in PIPELINE_TOP_LEVEL})
    return fields


def _where(cmd: tuple[str, ...], section: type, cls: type, f: dataclasses.Field) -> tuple[bool, bool]:
    return _cli_name(f) in _cli_options(cmd), f.name in _pipeline_fields(section, cls)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_every_field_is_a_cli_option_and_a_pipeline_key_or_excluded(case):
    cmd, section, cls = case
    excluded, missing = _excluded(cmd, section, cls), []
    for f in dataclasses.fields(cls):
        cli, pipe = _where(cmd, section, cls, f)
        if f.name in excluded:
            assert not (cli and pipe), f"{cls.__name__}.{f.name} is excluded but exposed in both: drop the exclusion"
            continue
        if not (cli and pipe):
            missing.append(f"{cls.__name__}.{f.name} (cli: {cli}, pipeline: {pipe})")
    assert not missing, "settings not in both the CLI and the pipeline: " + ", ".join(missing)
    assert not set(excluded) - {f.name for f in dataclasses.fields(cls)}, "an exclusion names no field"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_library_settings_give_the_cli_and_the_pipeline_the_same_default_help_and_checks(case):
    cmd, section, cls = case
    opts, keys = _cli_options(cmd), _pipeline_fields(section, cls)
    shared = [f for f in user_settings(cls) if _cli_name(f) in opts and f.name in keys]
    assert shared
    for f in shared:
        p, key = opts[_cli_name(f)], keys[f.name]
        if f.metadata.get("flag"):
            assert p.default is False and key.default is True, f.name
        else:
            stage = STAGE_DEFAULTS.get(section, {})
            assert key.default == stage.get(f.name, p.default), (
                f"{f.name}: CLI default {p.default!r}, pipeline {key.default!r}"
            )
            assert p.help.startswith(f.metadata["help"]), f.name  # (and the stage's note on its default)
        assert dict(key.metadata) == dict(f.metadata), f"{f.name}: the pipeline's checks are not the library's"


def test_the_search_offers_the_dcs_building_block_but_its_gate_family():
    # the DCS building block defaults to the paper's residual gates; the search's recipe to its probe
    assert {
        f.name for f in user_settings(DCSConfig) if getattr(SEARCH_DCS, f.name) != getattr(DCSConfig(), f.name)
    } == {"mlp_gates"}
    assert SEARCH_DCS.mlp_gates == "auto" and DCSSearchJob(source="s", out="o").method == SEARCH_DCS


def test_grad_balance_is_a_pipeline_key(tmp_path):
    s = DCSStage(grad_balance=False, block_weights=False)
    cfg = library_config(s, DCSSearchConfig, target_flops=0.5)
    assert cfg.grad_balance is False and cfg.block_weights is False and cfg.target_flops == 0.5
    assert library_config(DCSStage(), SEARCH_DCS_SETTINGS).mlp_gates == "auto"


def test_the_cli_builds_the_search_from_the_generated_options(tmp_path, monkeypatch):
    import nascompress.dcs_search as search

    seen = {}

    def fake(job: DCSSearchJob, **kw):
        seen["job"] = job
        return {"ok": True}

    patch_everywhere(monkeypatch, search, "search_dcs", fake)
    r = invoke(
        "search",
        "dcs",
        "vit_tiny_patch16_224",
        "--out",
        tmp_path / "o",
        "--target-flops",
        "0.6",
        "--no-grad-balance",
        "--no-calibrate",
        "--lam",
        "0.3",
        "--mlp-gates",
        "hidden",
        "--alpha-init",
        "3",
        "--min-lr",
        "2e-6",
        "--json",
    )
    assert r.exit_code == 0, r.output
    job = seen["job"]
    assert job.search == DCSSearchConfig(
        target_flops=0.6, grad_balance=False, calibrate=False, lam=0.3, auto_batch=True
    )
    assert job.method == DCSConfig(mlp_gates="hidden", alpha_init=3.0, theta_init=3.0)
    assert job.train.min_lr == 2e-6


# ---------------------------------------------------------------------------------------------
# The CLI and the pipeline build the same jobs from their defaults (and the same recipes)


def _pipeline_config(tmp_path: Path, base_train: dict, **stages: dict) -> Path:
    cfg = {
        "format": "nascompress-pipeline/1",
        "data": {"dataset": "synthetic"},
        "base": {"train": base_train},
        "goal": {"max_flops": 0.5},
        "stages": {"dcs": {}, **stages},
    }
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


@pytest.fixture
def captured(monkeypatch):
    """The jobs the CLI commands and the pipeline's steps would run (nothing runs)."""
    import nascompress.pipeline.fallback as fallback
    import nascompress.retraining.run as retrain
    import nascompress.dcs_search as search
    import nascompress.train.run as train

    jobs: dict[str, list] = {"train": [], "dcs": [], "retrain": []}

    from nascompress.retraining.metrics import RetrainMetrics
    from nascompress.train.metrics import TrainMetrics

    records = {"train": TrainMetrics, "retrain": RetrainMetrics}  # what each returns

    def keep(kind):
        def fake(job, **kw):
            jobs[kind].append(job)
            done = {"methods": ["x"], "test_top1": 0.0, "best_val_top1": 0.0, "train_time_s": 0.0}
            return records[kind].new(**done) if kind in records else done

        return fake

    patch_everywhere(monkeypatch, train, "train", keep("train"))
    patch_everywhere(monkeypatch, search, "search_dcs", keep("dcs"))
    patch_everywhere(monkeypatch, fallback, "run_dcs_with_fallback", keep("dcs"))
    patch_everywhere(monkeypatch, retrain, "retrain", keep("retrain"))
    patch_everywhere(monkeypatch, fallback, "current_model", lambda *a, **kw: Path("compressed"))
    return jobs


def _pipeline_jobs(path: Path, captured: dict) -> None:
    from nascompress.pipeline import plan

    for step in plan(path, out=path.parent / "out").steps:
        if step.name in ("base", "dcs_search", "retrain"):
            step.run(force=True, resume=False)


# what `train` from scratch and the main pipeline's base.train ran before the recipe moved into the library
SCRATCH = TrainConfig(
    epochs=8, batch_size=128, lr=1e-3, min_lr=1e-5, warmup_epochs=1.0, weight_decay=0.05, label_smoothing=0.1
)


def test_train_from_scratch_is_the_same_in_the_cli_and_the_pipeline(tmp_path, captured):
    assert invoke("train", "--out", tmp_path / "o", "--dataset", "synthetic", "--json").exit_code == 0
    _pipeline_jobs(_pipeline_config(tmp_path, {}), captured)
    cli, pipe = captured["train"]
    assert isinstance(cli, TrainJob) and cli.train == pipe.train == SCRATCH
    assert cli.data == pipe.data == DataConfig(dataset="synthetic", data_dir=str(FMNIST_DIR))
    # a base_lr (per 512 images) replaces the absolute 1e-3 in both
    assert invoke("train", "--out", tmp_path / "o", "--dataset", "synthetic", "--base-lr", "2e-3").exit_code == 0
    _pipeline_jobs(_pipeline_config(tmp_path, {"base_lr": 2e-3}), captured)
    assert captured["train"][2].train == captured["train"][3].train == SCRATCH.replace(lr=None, base_lr=2e-3)


@needs_fmnist
def test_the_main_pipeline_trains_its_base_as_before(tmp_path, captured):
    from nascompress.pipeline import plan

    main = Path(__file__).resolve().parents[1] / "configs" / "fashion-mnist.yaml"
    next(s for s in plan(main, out=tmp_path / "out").steps if s.name == "base").run(force=True, resume=False)
    assert captured["train"][0].train == SCRATCH.replace(amp="auto")  # its precision: bf16 where the CPU has it


def test_train_with_weights_uses_the_fine_tuning_recipe_in_the_cli_and_the_pipeline(tmp_path, captured):
    weights = tmp_path / "w.safetensors"
    weights.write_bytes(b"")
    assert invoke("train", "--out", tmp_path / "o", "--dataset", "synthetic", "--weights", weights).exit_code == 0
    _pipeline_jobs(_pipeline_config(tmp_path, {"weights": "w.safetensors"}), captured)
    cli, pipe = captured["train"]
    tuned = SCRATCH.replace(lr=None, base_lr=5e-4, layer_decay=0.75, warmup_epochs=0.2)
    assert cli.train == pipe.train == tuned
    assert load_config(tmp_path / "p.yaml").base.train.layer_decay == 0.75  # written out in OUT/config.yaml
    # layer_decay 1 is off in both
    assert (
        invoke(
            "train", "--out", tmp_path / "o", "--dataset", "synthetic", "--weights", weights, "--layer-decay", "1"
        ).exit_code
        == 0
    )
    _pipeline_jobs(_pipeline_config(tmp_path, {"weights": "w.safetensors", "layer_decay": 1}), captured)
    assert captured["train"][2].train == captured["train"][3].train == tuned.replace(layer_decay=None)


def test_the_search_and_retrain_defaults_are_the_same_in_the_cli_and_the_pipeline(tmp_path, captured):
    assert (
        invoke(
            "search", "dcs", "vit_tiny_patch16_224", "--out", tmp_path / "s", "--target-flops", "0.5", "--json"
        ).exit_code
        == 0
    )
    assert invoke("retrain", "compressed", "--out", tmp_path / "r", "--json").exit_code == 0
    _pipeline_jobs(_pipeline_config(tmp_path, {}, retrain={"distil_from": "none"}), captured)
    (cli_dcs, pipe_dcs), (cli_re, pipe_re) = captured["dcs"], captured["retrain"]
    assert isinstance(cli_dcs, DCSSearchJob) and isinstance(cli_re, RetrainJob)
    assert cli_dcs.search == pipe_dcs.search and cli_dcs.method == pipe_dcs.method
    assert cli_dcs.train == pipe_dcs.train and cli_dcs.train.layer_decay is None and cli_dcs.train.base_lr == 1e-3
    assert cli_re.retrain == pipe_re.retrain == RetrainConfig()
    assert cli_re.train == pipe_re.train and cli_re.train.base_lr == 5e-4 and cli_re.auto_batch and pipe_re.auto_batch


@pytest.mark.parametrize(
    "path,value,match",
    [
        ("stages.retrain.eta", -1, "stages.retrain.eta: must be in [0, inf], got -1.0"),
        ("stages.retrain.input_tap", "pixels", "stages.retrain.input_tap: must be one of image, patch_embed"),
        ("stages.retrain.log_ib", "yes", "stages.retrain.log_ib: must be true or false"),
        ("stages.retrain.layer_decay", 0, "stages.retrain.layer_decay: must be in (0, 1], got 0"),
        ("base.train.layer_decay", 1.5, "base.train.layer_decay: must be in (0, 1], got 1.5"),
        ("base.train.warmup_epochs", -1, "base.train.warmup_epochs: must be in [0, 10000], got -1.0"),
        ("data.val_fraction", 1, "data.val_fraction: must be in (0, 1), got 1"),
        ("data.num_workers", -1, "data.num_workers: must be an integer in [0, 1024], got -1"),  # one check (config.py)
        ("seed", -1, "seed: must be an integer in [0, 4294967295], got -1"),
    ],
)
def test_the_library_checks_name_the_pipeline_key(tmp_path, path, value, match):
    cfg = yaml.safe_load(_pipeline_config(tmp_path, {}, retrain={}).read_text())
    *parents, last = path.split(".")
    node = cfg
    for k in parents:
        node = node[k]
    node[last] = value
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(cfg))
    with pytest.raises(NascompressError) as e:
        load_config(bad)
    assert match in str(e.value) and len(str(e.value).splitlines()) == 1, str(e.value)


def test_data_paths_are_resolved_against_the_config_but_for_the_keywords(tmp_path):
    (tmp_path / "imgs").mkdir()
    path = _pipeline_config(tmp_path, {})
    assert load_config(path).data.dataset == "synthetic"
    path.write_text(path.read_text().replace("dataset: synthetic", "dataset: imgs"))
    assert load_config(path).data.dataset == str(tmp_path / "imgs")


@pytest.mark.parametrize(
    "args,pattern",
    [
        (["--layer-decay", "0"], "--layer-decay must be in (0, 1], got 0.0"),
        (["--val-fraction", "1"], "--val-fraction must be in (0, 1), got 1.0"),
        (["--seed", "-1"], "--seed must be an integer in [0, 4294967295], got -1"),
    ],
)
def test_train_cli_errors_are_one_line(tmp_path, args, pattern):
    r = invoke("train", "--out", tmp_path / "o", "--dataset", "synthetic", *args)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.exit_code == 1 and len(lines) == 1 and pattern in lines[0], r.output


def test_the_study_settings_build_the_same_search_job_in_the_cli_and_the_pipeline(tmp_path, monkeypatch):
    """``search tokens`` options and ``stages.tokens`` keys are the same SearchJob fields: given the
    same values, both build the same job (but the pipeline's own storage, base and data)."""
    import nascompress.studies.trials as trials

    seen = []

    def fake(job, **kw):
        seen.append(job)
        return fake_run(job.study)

    patch_everywhere(monkeypatch, trials, "run_search", fake)
    values = {
        "trials": 7,
        "workers": 1,
        "sampler": "nsga2",
        "finetune_epochs": 1,
        "train_images": 300,
        "eval_images": 200,
        "calib_steps": 4,
        "batch_size": 16,
        "dcs_epochs": 2,
        "latency_iters": 3,
        "latency_source": "measured",
        "enqueue": False,
        "objective": "latency",
    }
    assert set(values) == {f.name for f in user_settings(SearchJob)} - set(STUDY_EXCLUDED[SearchJob]) - {
        "space",
        "study",
    }
    args = [a for k, v in values.items() if k != "enqueue" for a in (f"--{k.replace('_', '-')}", v)]
    r = invoke("search", "tokens", tmp_path, "--study", "s", "--seed", 3, "--no-enqueue", *args)
    assert r.exit_code == 0, r.output
    cli_job = seen.pop()
    space = Path(__file__).resolve().parents[1] / "nascompress" / "search_spaces" / "evit.yaml"
    cfg = {
        "format": "nascompress-pipeline/1",
        "seed": 3,
        "data": {"dataset": "synthetic"},
        "base": {"run": str(tmp_path)},
        "goal": {"max_flops": 0.5},
        "stages": {"tokens": {"space": str(space), "study": "s", **values}},
    }
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    pipe = load_config(path)
    assert library_config(pipe.stages.tokens, STUDY_SETTINGS, base="b", space="s", study="s") == SearchJob(
        base="b", space="s", study="s", **values
    )
    for f in user_settings(SearchJob):
        if f.name not in ("space", "study"):  # the command's own default space; its --study
            assert getattr(cli_job, f.name) == values.get(f.name, f.default), f.name
    assert (cli_job.objective, cli_job.seed) == ("latency", 3)
    assert TokensStage(space="x").trials == 50 and SearchJob(base="b", space="s", study="s").trials == 50


def test_finetune_training_options_are_the_library_settings_with_the_methods_recipe(tiny_run, tmp_path, monkeypatch):
    """``finetune``'s training options are generated from TrainConfig's fields (FINETUNE_TRAIN_SETTINGS):
    not given, each is the method's recipe (finetune_train_config); given, it wins."""
    import nascompress.train.finetune as finetune
    from nascompress.train.finetune import FINETUNE_TRAIN_SETTINGS, finetune_train_config

    opts = _cli_options(("finetune",))
    for f in user_settings(TrainConfig):
        if f.name in FINETUNE_TRAIN_SETTINGS.names:
            p = opts[_cli_name(f)]
            assert p.default is None and p.help.startswith(f.metadata["help"]), f.name
    seen = []
    from nascompress.train.metrics import FinetuneMetrics

    done = FinetuneMetrics.new(test_top1=1.0)
    patch_everywhere(monkeypatch, finetune, "finetune", lambda job, **kw: seen.append(job) or done)
    for extra in ([], ["--epochs", 3, "--layer-decay", 0.8]):
        r = invoke("finetune", tiny_run, "--method", "evit", "--out", tmp_path / "o", "--seed", 4, *extra, "--json")
        assert r.exit_code == 0, r.output
    recipe = finetune_train_config("evit", seed=4)
    assert seen[0].train == recipe
    assert seen[1].train == recipe.replace(epochs=3, layer_decay=0.8)
