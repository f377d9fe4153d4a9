"""One meaning per setting: the drifts issue 34 listed, each with the same default and meaning on the
command line, in the pipeline file and in study trials, and the one validator every config uses."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from types import SimpleNamespace

import pytest
import typer
import yaml
from torch import nn

from nascompress.config import check_value
from nascompress.data import DataConfig
from nascompress.errors import NascompressError
from nascompress.importer.run import ImportJob
from nascompress.methods.dcs import SEARCH_DCS, DCSConfig
from nascompress.models.build import CUSTOM_VIT, ModelShape, custom_vit_spec
from nascompress.pipeline import load_config
from nascompress.pipeline.sections import BaseImportSection, BaseTrainSection, DataSection
from nascompress.pipeline.stages.dcs import DCSStage
from nascompress.pipeline.stages.retrain import RetrainStage
from nascompress.pipeline.stages.tokens import TokensStage
from nascompress.studies.trial_model import TrialMaterializeJob
from nascompress.studies.trials import STORAGE_HELP, SearchJob
from nascompress.train.config import TrainConfig

from .conftest import invoke, patch_everywhere


def _command(*path: str):
    from nascompress.cli.main import app

    cmd = typer.main.get_command(app)
    for name in path:
        cmd = cmd.commands[name]
    return cmd


def _option(path: tuple[str, ...], opt: str):
    return next(p for p in _command(*path).params if opt in p.opts)


def _field(cls: type, name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(cls) if f.name == name)


def test_a_study_has_50_trials_by_default_on_the_cli_and_in_the_pipeline():  # was 50 and 30
    for kind in ("tokens", "joint"):
        assert _option(("search", kind), "--trials").default == 50
    assert TokensStage(space="x").trials == 50 == _field(SearchJob, "trials").default


def test_objective_goal_is_the_default_with_one_meaning_everywhere():  # was flops on the CLI, goal in the pipeline
    assert _option(("search", "tokens"), "--objective").default == "goal"
    assert _field(TokensStage, "objective").default == "goal" == _field(SearchJob, "objective").default
    assert dict(_field(TokensStage, "objective").metadata) == dict(_field(SearchJob, "objective").metadata)
    free = SearchJob(base="b", space="s", study="x")  # no constraint: accuracy x FLOPs, as before on the CLI
    assert free.objectives() == (["accuracy", "flops_ratio"], ["maximize", "minimize"])
    bound = SearchJob(base="b", space="s", study="x", max_flops=0.5)  # a constraint: accuracy under it
    assert bound.objectives() == (["accuracy"], ["maximize"])
    old = {"base": "b", "space": "s", "study": "x", "objective": "flops", "max_flops": 0.5}
    assert SearchJob.from_record(old).objective == "goal"  # a job recorded before the refusal reads as goal
    with pytest.raises(NascompressError, match="leave objective at goal"):  # a new one is refused
        SearchJob(**old)
    with pytest.raises(NascompressError, match="objective latency is a Pareto front"):
        SearchJob(base="b", space="s", study="x", objective="latency", max_flops=0.5)


def test_finetune_epochs_are_whole_epochs_in_studies_and_in_materialize():  # was a float in studies
    for cls in (SearchJob, TrialMaterializeJob):
        assert typing.get_type_hints(cls)["finetune_epochs"] is int
    for path in (("search", "tokens"), ("materialize",)):
        p = _option(path, "--finetune-epochs")
        assert p.type_descriptor.annotation is int and p.default == 0
    assert (
        _field(SearchJob, "finetune_epochs").metadata["help"]
        in _field(TrialMaterializeJob, "finetune_epochs").metadata["help"]
    )
    with pytest.raises(NascompressError, match="finetune_epochs must be an integer"):
        SearchJob(base="b", space="s", study="x", finetune_epochs=0.5)


def test_one_evaluation_batch_size_name():  # was import --batch-size, base.import.eval_batch_size, TrainConfig's
    tc = _field(TrainConfig, "eval_batch_size")
    for cls in (ImportJob, BaseImportSection):
        assert dict(_field(cls, "eval_batch_size").metadata) == dict(tc.metadata)
    for path in (("import",), ("evaluate",)):
        opts = {o for p in _command(*path).params for o in p.opts}
        assert "--eval-batch-size" in opts and "--batch-size" not in opts
        assert _option(path, "--eval-batch-size").default == tc.default


def test_the_custom_vit_defaults_are_written_once(tmp_path, monkeypatch):
    import nascompress.train.run as train

    expected = custom_vit_spec(**CUSTOM_VIT, num_classes=10)
    assert ModelShape().spec(10) == expected
    from nascompress.train.metrics import TrainMetrics

    seen, done = [], TrainMetrics.new(best_val_top1=0, test_top1=0, train_time_s=0)
    patch_everywhere(monkeypatch, train, "train", lambda job, **kw: seen.append(job) or done)
    r = invoke("train", "--out", tmp_path / "o", "--dataset", "synthetic", "--json")
    assert r.exit_code == 0, r.output
    assert seen[0].model.name == expected.name and {
        k: v for k, v in seen[0].model.kwargs.items() if k != "num_classes"
    } == {k: v for k, v in expected.kwargs.items() if k != "num_classes"}
    section = BaseTrainSection()
    assert ModelShape(**{f.name: getattr(section, f.name) for f in dataclasses.fields(ModelShape)}).spec(10) == expected
    for name, value in CUSTOM_VIT.items():  # the help says the default the code uses
        assert f"custom ViT default {value}" in _option(("train",), f"--{name.replace('_', '-')}").help


STUDY_COMMANDS = [
    ("search", "tokens"),
    ("search", "joint"),
    ("materialize",),
    ("study", "list"),
    ("study", "show"),
    ("study", "export"),
    ("study", "report"),
    ("study", "dashboard"),
]


def test_storage_has_one_help():  # was three texts
    helps = {_option(path, "--storage").help for path in STUDY_COMMANDS}
    assert helps == {STORAGE_HELP}


def test_alpha_init_drives_theta_init_and_mlp_gates_is_the_declared_default_in_study_trials(monkeypatch):
    import nascompress.dcs_search.search as dcs
    from nascompress.studies.trial_dcs import _search_dcs

    seen = []

    def stop(job, *a, **kw):
        seen.append(job)
        raise RuntimeError("stop")

    patch_everywhere(monkeypatch, dcs, "run_dcs_search", stop)
    ctx = SimpleNamespace(
        arch=SimpleNamespace(methods=()),
        job=SearchJob(base="b", space="s", study="x", dcs_epochs=1),
        data_cfg=DataConfig(dataset="synthetic"),
        base=nn.Linear(2, 2),
        search_data=lambda: None,
    )
    with pytest.raises(RuntimeError, match="stop"):
        _search_dcs(ctx, {"alpha_init": 3.0}, seed=0)
    method = seen[0].method
    assert method.theta_init == 3.0 and method.alpha_init == 3.0  # as `search dcs --alpha-init 3` and stages.dcs
    assert method.mlp_gates == SEARCH_DCS.mlp_gates == "auto"
    assert DCSConfig.user(alpha_init=2.0).theta_init == 2.0


def test_train_limit_has_one_help_and_one_check(tmp_path):  # was "class-stratified subset" and "use only N images"
    declared = _field(DataConfig, "train_limit")
    for path in (("train",), ("retrain",), ("finetune",), ("search", "dcs")):
        assert _option(path, "--train-limit").help.startswith(declared.metadata["help"]), path
    for section in (DataSection, DCSStage, RetrainStage):
        assert dict(_field(section, "train_limit").metadata) == dict(declared.metadata), section


def test_amp_modes_are_the_runtimes():
    from nascompress import runtime

    assert _field(TrainConfig, "amp").metadata["choices"] == runtime.AMP_MODES
    with pytest.raises(NascompressError) as study:
        SearchJob(base="b", space="s", study="x", amp="fp16")
    with pytest.raises(NascompressError) as train:
        TrainConfig(amp="fp16")
    assert str(study.value) == str(train.value) == "amp must be one of off, bf16, auto, got 'fp16'"
    assert '"bf16"' not in inspect.getsource(SearchJob)  # no literal list of the modes


def test_the_unused_cli_types_are_gone():
    import nascompress.cli.common as common

    assert not hasattr(common, "Amp") and not hasattr(common, "Deterministic")


def test_a_range_is_checked_by_one_function_for_the_cli_and_the_pipeline(tmp_path, monkeypatch):
    """The library's configs and the pipeline file check a setting's interval with the same function
    (config.check_value), so their messages are the same but for who is named."""
    import nascompress.config as config
    import nascompress.pipeline.schema as schema

    calls = []
    real = config.check_value

    def spy(name, v, meta, kind):
        calls.append((name, v))
        return real(name, v, meta, kind)

    monkeypatch.setattr(schema, "check_value", spy)
    cfg = {
        "format": "nascompress-pipeline/1",
        "data": {"dataset": "synthetic", "num_workers": -1},
        "base": {"train": {}},
        "goal": {"max_flops": 0.5},
        "stages": {"dcs": {"target_flops": 0.5}},
    }
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(NascompressError) as pipe:
        load_config(path)
    assert ("", -1) in calls
    with pytest.raises(NascompressError) as lib:
        DataConfig(num_workers=-1)
    assert str(pipe.value).endswith("data.num_workers: " + str(lib.value).removeprefix("num_workers "))
    with pytest.raises(NascompressError, match=r"^must be an integer in \[0, 1024\], got -1$"):
        check_value("", -1, _field(DataConfig, "num_workers").metadata, int)


def test_commands_show_their_options_in_their_signature():
    """Every command function lists its own options and its settings groups (typed) in its signature:
    no ``**kw`` read by string look-ups (but finetune's per-method options)."""
    for path in [
        (),
        *[
            tuple(p.split())
            for p in (
                "train",
                "import",
                "evaluate",
                "profile",
                "finetune",
                "retrain",
                "materialize",
                "search dcs",
                "search tokens",
                "pipeline",
                "export",
                "quantize",
                "study show",
                "study dashboard",
            )
        ],
    ]:
        if not path:
            continue
        fn = _command(*path).callback
        fn = getattr(fn, "__wrapped__", fn)
        kinds = [p.kind for p in inspect.signature(fn).parameters.values()]
        assert (inspect.Parameter.VAR_KEYWORD not in kinds) or path == ("finetune",), path
        assert len(kinds) > 1, path
