"""A stage's defaults live in one place: its config's dataclass defaults (or, where several stages
share a config, the stage's named recipe: ``SEARCH_TRAIN``, ``RETRAIN_TRAIN``, ``FINE_TUNE_TRAIN``,
``SEARCH_DCS``, a method's ``train_overrides``). Per stage, the config built with no options by the
CLI command and by the pipeline section (each through its own building path: the jobs they would
run are captured, nothing runs) equals that library default."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from nascompress.config import offered
from nascompress.data import DataConfig
from nascompress.deploy.config import ExportConfig
from nascompress.methods import available_methods, get_method
from nascompress.methods.dcs import SEARCH_DCS, DCSConfig
from nascompress.pipeline.schema import library_config
from nascompress.pipeline.sections import ReportSection
from nascompress.pipeline.stages.export import ExportSection
from nascompress.profiling.config import ProfileConfig
from nascompress.profiling.records import Profile
from nascompress.runs.files import Sidecar
from nascompress.retraining.run import RETRAIN_TRAIN, RetrainJob
from nascompress.retraining.config import RetrainConfig
from nascompress.dcs_search.search_config import SEARCH_TRAIN, DCSSearchConfig, DCSSearchJob, search_train_config
from nascompress.studies.trials import SearchJob
from nascompress.train.run import FINE_TUNE_TRAIN, TRAIN_SETTINGS, TrainJob
from nascompress.train.config import TrainConfig

from .conftest import invoke, patch_everywhere
from .study_toys import fake_run


@pytest.fixture
def jobs(monkeypatch):
    """The jobs the CLI commands and the pipeline's steps would run, by kind (nothing runs)."""
    import nascompress.profiling.jobs as api
    import nascompress.deploy as export
    import nascompress.train.finetune as finetune
    import nascompress.pipeline.fallback as fallback
    import nascompress.retraining.run as retrain
    import nascompress.dcs_search as search
    import nascompress.studies.trials as trials
    import nascompress.train.run as train

    seen: dict[str, list] = {}

    from nascompress.retraining.metrics import RetrainMetrics
    from nascompress.train.metrics import FinetuneMetrics, TrainMetrics

    records = {"train": TrainMetrics, "retrain": RetrainMetrics, "finetune": FinetuneMetrics}  # what each returns

    def keep(kind):
        def fake(job, **kw):
            seen.setdefault(kind, []).append(job)
            return (records[kind].new if kind in records else dict)(
                **{
                    "methods": ["x"],
                    "test_top1": 0.0,
                    "best_val_top1": 0.0,
                    "train_time_s": 0.0,
                    "study": "s",
                    "storage": "x",
                    "complete": 0,
                    "n_trials": 0,
                    "front": [],
                    "finished": True,
                }
            )

        return fake

    def keep_study(job, **kw):  # run_search: the study run's summary record
        seen.setdefault("study", []).append(job)
        return fake_run()

    patch_everywhere(monkeypatch, train, "train", keep("train"))
    patch_everywhere(monkeypatch, search, "search_dcs", keep("dcs"))
    patch_everywhere(monkeypatch, fallback, "run_dcs_with_fallback", keep("dcs"))
    patch_everywhere(monkeypatch, retrain, "retrain", keep("retrain"))
    patch_everywhere(monkeypatch, finetune, "finetune", keep("finetune"))
    patch_everywhere(monkeypatch, trials, "run_search", keep_study)
    patch_everywhere(monkeypatch, fallback, "current_model", lambda *a, **kw: Path("compressed"))
    exported = Sidecar(format="nascompress-export/1", file="m.onnx")
    patch_everywhere(
        monkeypatch,
        export,
        "export_run",
        lambda run_dir, *, config, **kw: seen.setdefault("export", []).append(config) or exported,
    )
    no_models = Profile.new(device="cpu", dtype="fp32", models={})
    patch_everywhere(
        monkeypatch, api, "profile", lambda target, **kw: seen.setdefault("profile", []).append(kw) or no_models
    )
    return seen


def _cli(jobs: dict, kind: str, *args) -> object:
    r = invoke(*args, "--json")
    assert r.exit_code == 0, r.output
    return jobs[kind].pop()


def _pipeline(tmp_path: Path, jobs: dict, kind: str, *, base_train: dict | None = None, **stages: dict) -> object:
    """The job of ``kind`` the pipeline's step runs, from a file with the given sections (a dcs stage
    with no keys unless given; the goal: 0.5 of the FLOPs)."""
    from nascompress.pipeline import plan

    cfg = {
        "format": "nascompress-pipeline/1",
        "data": {"dataset": "synthetic"},
        "base": {"train": base_train or {}},
        "goal": {"max_flops": 0.5},
        "stages": {"dcs": {}, **stages},
    }
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    steps = {"train": "base", "dcs": "dcs_search", "retrain": "retrain", "study": "tokens_search"}
    next(s for s in plan(path, out=tmp_path / "out").steps if s.name == steps[kind]).run(force=True, resume=False)
    return jobs[kind].pop()


# ---------------------------------------------------------------------------------------------
# train / base.train


def test_train_defaults_are_train_config(tmp_path, jobs):
    cli = _cli(jobs, "train", "train", "--out", tmp_path / "o", "--dataset", "synthetic")
    pipe = _pipeline(tmp_path, jobs, "train")
    assert isinstance(cli, TrainJob)
    assert cli.train == pipe.train == TrainConfig() == TrainJob(model=cli.model).train
    assert (TrainConfig().epochs, TrainConfig().lr) == (8, 1e-3)  # `nascompress train`'s, no second set
    # the generated options show the same values (where the recipe does not depend on --weights)
    shown = {f.name: d for f, d, _ in offered(TRAIN_SETTINGS) if f.name not in TRAIN_SETTINGS.no_default}
    assert shown == {name: getattr(TrainConfig(), name) for name in shown}


def test_train_with_weights_is_the_fine_tuning_recipe(tmp_path, jobs):
    weights = tmp_path / "w.safetensors"
    weights.write_bytes(b"")
    cli = _cli(jobs, "train", "train", "--out", tmp_path / "o", "--dataset", "synthetic", "--weights", weights)
    pipe = _pipeline(tmp_path, jobs, "train", base_train={"weights": "w.safetensors"})
    assert cli.train == pipe.train == FINE_TUNE_TRAIN


# ---------------------------------------------------------------------------------------------
# search dcs / stages.dcs


def test_dcs_search_defaults_are_the_search_job_defaults(tmp_path, jobs):
    cli = _cli(jobs, "dcs", "search", "dcs", "vit_tiny_patch16_224", "--out", tmp_path / "s")
    pipe = _pipeline(tmp_path, jobs, "dcs")
    default = DCSSearchJob(source="s", out="o")
    assert isinstance(cli, DCSSearchJob)
    assert cli.method == pipe.method == default.method == SEARCH_DCS == DCSConfig(mlp_gates="auto")
    assert cli.search == default.search == DCSSearchConfig()  # auto_batch: no --batch-size
    assert pipe.search == DCSSearchConfig(target_flops=0.5)  # the pipeline's target is its goal's
    assert cli.train == pipe.train == default.train == search_train_config()
    # the recipe, but layer_decay 1 (shown as the option's default) is no decay
    assert cli.train == SEARCH_TRAIN.replace(layer_decay=None)


# ---------------------------------------------------------------------------------------------
# retrain / stages.retrain


def test_retrain_defaults_are_the_retrain_job_defaults(tmp_path, jobs):
    cli = _cli(jobs, "retrain", "retrain", "compressed", "--out", tmp_path / "r")
    # distil_from none: the command has no teacher unless given one (the pipeline's default is its base)
    pipe = _pipeline(tmp_path, jobs, "retrain", retrain={"distil_from": "none"})
    default = RetrainJob(model_dir="m")
    assert isinstance(cli, RetrainJob)
    assert cli.retrain == pipe.retrain == default.retrain == RetrainConfig()
    assert cli.train == pipe.train == default.train == RETRAIN_TRAIN
    assert cli.auto_batch is pipe.auto_batch is default.auto_batch is True
    assert cli.teacher is pipe.teacher is default.teacher is None


# ---------------------------------------------------------------------------------------------
# finetune (every method's recipe), search tokens / stages.tokens, export, profile / report


@pytest.mark.parametrize("method", [m for m in available_methods() if get_method(m).recipe_cls is not None])
def test_finetune_defaults_are_the_methods_recipe(tmp_path, jobs, method):
    from nascompress.train.finetune import FINETUNE_TRAIN, method_train_config

    cli = _cli(
        jobs, "finetune", "finetune", tmp_path, "--method", method, "--out", tmp_path / "f", "--dataset", "synthetic"
    )
    recipe = method_train_config(method)
    assert cli.train == recipe == FINETUNE_TRAIN.replace(**get_method(method).train_overrides.changes())


def test_study_defaults_are_the_search_job_defaults(tmp_path, jobs):
    cli = _cli(jobs, "study", "search", "tokens", tmp_path, "--study", "s")
    pipe = _pipeline(tmp_path, jobs, "study", tokens={"space": "evit"})
    default = SearchJob(base="b", space="evit", study="s")
    own = {"base", "space", "study", "storage", "max_flops", "max_latency_ms", "data"}  # each sets its own
    for name in SearchJob.__dataclass_fields__:
        if name not in own:
            assert getattr(cli, name) == getattr(pipe, name) == getattr(default, name), name
    assert cli.space == default.space and pipe.study == "pipeline"  # the pipeline names its study


def test_export_defaults_are_export_config(tmp_path, jobs):
    cli = _cli(jobs, "export", "export", tmp_path, "--out", tmp_path / "m.onnx")
    assert cli == ExportConfig() == ExportSection().config(seed=0)


def test_profile_defaults_are_profile_config(tmp_path, jobs):
    r = invoke("profile", tmp_path, "--json")
    assert r.exit_code == 0, r.output
    kw = jobs["profile"].pop()
    cli = ProfileConfig(**{k: kw[k] for k in ProfileConfig.__dataclass_fields__})
    assert cli == ProfileConfig() == library_config(ReportSection(), ProfileConfig)


def test_no_stage_keeps_a_defaults_mapping():
    """The duplicate mechanisms are gone: no ``user_default`` in a field's metadata, no defaults
    mapping on a stage's settings, no loose recipe dicts on the methods."""
    import dataclasses

    import nascompress.cli.main  # noqa: F401  (every command module, with its settings)
    from nascompress.config import StageSettings
    from nascompress.pipeline.sections import PipelineConfig  # noqa: F401

    assert "defaults" not in {f.name for f in dataclasses.fields(StageSettings)}
    for cls in (
        TrainConfig,
        DCSConfig,
        DCSSearchConfig,
        RetrainConfig,
        SearchJob,
        DataConfig,
        ExportConfig,
        ProfileConfig,
    ):
        assert not [f.name for f in dataclasses.fields(cls) if "user_default" in f.metadata], cls
    for m in available_methods():
        assert not hasattr(get_method(m), "train_defaults"), m


# ---------------------------------------------------------------------------------------------
# one job builder per stage; its rules name fields, each front end words them


def test_search_dcs_and_retrain_jobs_are_built_by_their_stages_build_job(tmp_path, jobs, monkeypatch):
    """The command and the pipeline section both build through the stage's ``build_job`` (no second
    construction of the job anywhere)."""
    import nascompress.retraining.run as retrain
    import nascompress.dcs_search.run as dcs_run

    built = []
    for mod in (retrain, dcs_run):
        real = mod.build_job
        patch_everywhere(
            monkeypatch, mod, "build_job", lambda *a, _real=real, **kw: built.append(_real(*a, **kw)) or built[-1]
        )
    cli = [
        _cli(jobs, "dcs", "search", "dcs", "vit_tiny_patch16_224", "--out", tmp_path / "s"),
        _cli(jobs, "retrain", "retrain", "compressed", "--out", tmp_path / "r"),
    ]
    pipe = [_pipeline(tmp_path, jobs, "dcs"), _pipeline(tmp_path, jobs, "retrain", retrain={})]
    assert cli[0] is built[0] and cli[1] is built[1] and pipe[0] is built[2]  # the second plan: dcs, retrain
    assert pipe[1] == built[-1].replace(model_dir="compressed")  # the step starts from the model made before it


def test_a_rule_is_checked_once_and_worded_by_each_front_end(tmp_path, jobs):
    from nascompress.errors import SettingError
    from nascompress.retraining.run import build_job

    with pytest.raises(SettingError) as e:
        build_job("m", "o", retrain=RetrainConfig(feat_kd=1.0), train={})
    assert str(e.value) == (
        "feat_kd distils from a teacher's features; give the dense run with teacher, or leave feat_kd at 0"
    ) and e.value.fields == ("feat_kd", "teacher")
    r = invoke("retrain", "compressed", "--out", tmp_path / "r", "--feat-kd", "1")
    assert (
        r.exit_code == 1
        and "--feat-kd distils from a teacher's features; give the dense run with --teacher, or leave --feat-kd at 0"
        in r.output
    )
    with pytest.raises(Exception, match="stages.retrain: feat_kd distils .* with distil_from: base, or leave feat_kd"):
        _pipeline(tmp_path, jobs, "retrain", retrain={"distil_from": "none", "feat_kd": 1.0})
