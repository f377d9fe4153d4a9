"""A pipeline stage is one registered object: a toy stage defined in one module (tests/toy_stage.py)
is planned in its order, run, marked done and skipped when the pipeline is continued, and reported
(its decision in summary.json, its line in the report), with no other file changed; its own key
(``stages.toy.scale``) is a key of the pipeline file, checked, written to OUT/config.yaml and
refused where no such stage is registered."""

from __future__ import annotations

import json

import pytest
import yaml

from nascompress.errors import NascompressError
from nascompress.pipeline import load_config, stage as stage_module
from nascompress.pipeline.plan import plan
from nascompress.pipeline.report_format import decision_lines
from nascompress.pipeline.run import run_pipeline
from nascompress.pipeline.stage import PipelineStage, register_stage, registered_stages, step_names

from .test_pipeline import tiny_config, write_config
from .toy_stage import STAGE, ToySection


@pytest.fixture
def toy_registered(monkeypatch):
    registered_stages()  # the built-in stages first
    monkeypatch.setattr(stage_module, "_STAGES", dict(stage_module._STAGES))  # undone after the test
    register_stage(STAGE)


def _config(tmp_path, **toy):
    cfg = tiny_config()
    del cfg["stages"]["tokens"], cfg["stages"]["retrain"], cfg["export"]
    cfg["goal"] = {"max_flops": 0.85}
    cfg["stages"]["dcs"]["epochs"] = 1
    cfg["stages"]["toy"] = {"scale": 0.001, **toy}
    return write_config(tmp_path, cfg)


def test_the_built_in_stages_are_the_registry(tmp_path):
    assert [s.name for s in registered_stages()] == ["dcs", "tokens", "retrain", "export"]
    names = step_names()
    assert names[0] == "base" and names[-1] == "report" and "toy_params" not in names


def test_a_stage_in_one_module_is_planned_run_and_resumed(tmp_path, toy_registered):
    assert "toy_params" in step_names()
    config, out = _config(tmp_path), tmp_path / "out"
    pipe = plan(config, out=out)
    assert [s.name for s in pipe.steps] == ["base", "dcs_search", "dcs_mat", "toy_params", "report"]
    summary = run_pipeline(config, out=out)
    got = json.loads((out / "toy" / "params.json").read_text())
    assert got["model"] == str(out / "dcs_mat") and got["params"] > 0
    assert got["scaled"] == got["params"] * 0.001  # its own key, stages.toy.scale
    written_config = yaml.safe_load((out / "config.yaml").read_text())
    assert list(written_config["stages"]) == ["dcs", "toy"] and written_config["stages"]["toy"] == {"scale": 0.001}
    assert (out / "done" / "toy_params.json").is_file()
    # its decision in summary.json, between the DCS stage's and the methods, and its line in the report
    written = json.loads((out / "summary.json").read_text())["decisions"]
    assert list(written) == ["base", "dcs", "toy", "methods"] and written["toy"] == got
    line = f"toy: {got['params']:,} parameters after the channel stage"
    assert line in decision_lines(summary) and line in (out / "report.html").read_text()
    lines = []
    run_pipeline(config, out=out, log=lines.append)
    assert "toy_params: complete, skipped" in lines


def test_a_stage_name_or_order_is_registered_once(toy_registered):
    with pytest.raises(ValueError, match="already registered"):
        register_stage(PipelineStage("toy", 16, (), section=lambda cfg: None, plan=lambda st, s: None))
    with pytest.raises(ValueError, match="order 15 is taken by 'toy'"):
        register_stage(PipelineStage("other", 15, (), section=lambda cfg: None, plan=lambda st, s: None))


def test_a_stage_s_own_key_is_checked_as_the_file_is_read(tmp_path, toy_registered):
    config = _config(tmp_path)
    assert load_config(config).stages.toy.scale == 0.001
    for value, why in (
        (-1, "must be in (0, inf], got -1.0"),
        ("x", "must be a number, got 'x'"),
        (None, "must not be empty"),
    ):
        with pytest.raises(NascompressError) as e:
            load_config(_config(tmp_path, scale=value))
        assert str(e.value) == f"{config}: stages.toy.scale: {why}"  # one line, naming the key
    with pytest.raises(NascompressError) as e:
        load_config(_config(tmp_path, bogus=1))
    assert str(e.value) == f"{config}: unknown key stages.toy.bogus; valid: scale"
    # given no toy section, the stage is off
    plain = yaml.safe_load(config.read_text())
    del plain["stages"]["toy"]
    assert "toy_params" not in [s.name for s in plan(write_config(tmp_path, plain), out=tmp_path / "o").steps]


def test_a_stage_s_section_is_unknown_where_the_stage_is_not_registered(tmp_path):
    with pytest.raises(NascompressError) as e:
        load_config(_config(tmp_path))
    assert str(e.value).endswith(": unknown key stages.toy; valid: dcs, tokens, retrain")


def test_a_stage_names_its_section():
    with pytest.raises(ValueError, match="give the class of its section"):
        PipelineStage("other", 99, (), plan=lambda st, s: None)
    with pytest.raises(ValueError, match="the file's key report is taken"):
        register_stage(PipelineStage("report", 99, (), plan=lambda st, s: None, config=ToySection, top_level=True))
