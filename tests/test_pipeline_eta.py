"""The whole pipeline's time left (issue 67): the estimator on a fake clock, the lines a tiny
pipeline prints with it, and the report reusing a training's test scores where they are provably
the same (each model tested once on the test split instead of twice)."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest

import nascompress.profiling.evaluate as evaluate_module
from nascompress.profiling.jobs import evaluate_run
from nascompress.pipeline import load_config, plan
from nascompress.pipeline.eta import PER_IMAGE_S, PipelineEta, step_estimates
from nascompress.pipeline.test_scores import recorded_scores
from nascompress.progress import pipeline_eta, pipeline_left

from .conftest import invoke, patch_everywhere
from .test_pipeline import tiny_config, write_config

LEFT = r"pipeline: about \d+:\d\d left"
BENCH = Path(__file__).resolve().parents[1] / "bench"


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_eta_measures_the_rate_of_this_run():
    clock = FakeClock()
    eta = PipelineEta({"base": 100.0, "dcs_search": 300.0}, clock=clock)
    eta.start("base")
    assert eta.left(0.0) is None and eta.text(0.0) == ""  # nothing measured yet
    clock.t += 50  # half the base in 50 s: the estimates' own pace
    assert eta.left(0.5) == pytest.approx(50 + 300)
    assert eta.text(0.5) == "pipeline: about 5:50 left"
    clock.t += 150  # the base's second half took 150 s: 2 s per estimated second
    eta.finish("base")
    assert eta.left() == pytest.approx(300 * 2)
    eta.start("dcs_search")
    clock.t += 100
    # measured: 200 s for base + 100 s for a quarter of dcs_search (75 estimated s): 300 / 175
    assert eta.left(0.25) == pytest.approx(225 * 300 / 175)
    clock.t += 500
    eta.finish("dcs_search")
    assert eta.text() == ""  # nothing left


def test_eta_leaves_out_what_an_earlier_run_did():
    clock = FakeClock()
    eta = PipelineEta({"base": 100.0, "retrain": 40.0, "report": 10.0}, clock=clock)
    eta.skip("report")  # found complete
    eta.start("base")
    clock.t += 10
    # resumed at half the base: only the fraction done in this process counts towards the rate
    assert eta.left(0.6, since=0.5) == pytest.approx((40 + 40) * 10 / 10)
    clock.t += 10
    eta.finish("base")  # 20 s for the base's second half (50 estimated s)
    assert eta.left() == pytest.approx(40 * 20 / 50)


def test_pipeline_left_is_empty_outside_a_pipeline():
    assert pipeline_left(0.5) == ""
    with pipeline_eta(lambda f, since: f"{f:g} {since:g}"):
        assert pipeline_left(0.5, since=0.25) == "0.5 0.25"
    assert pipeline_left(0.5) == ""


def test_estimates_reproduce_the_main_jobs_bench_steps():
    cfg = load_config("nascompress/configs/fashion-mnist.yaml")
    names = ["base", "dcs_search", "dcs_mat", "tokens_search", "tokens_search_dense", "retrain", "report"]
    est = step_estimates(cfg, names)
    assert list(est) == names
    assert est["base"] == pytest.approx(308.5) and est["dcs_search"] == pytest.approx(51.0)
    assert est["retrain"] == pytest.approx(80.9)
    assert est["tokens_search"] + est["tokens_search_dense"] == pytest.approx(20.5 + 24.2)
    assert all(v >= 0 for v in est.values()) and set(PER_IMAGE_S) == {"base", "dcs_search", "tokens", "retrain"}


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    """The tiny pipeline (fp32: amp off) with plain progress lines, every evaluation counted."""
    d = tmp_path_factory.mktemp("eta")
    cfg = write_config(d, {**tiny_config(), "amp": "off"})
    calls: list[int] = []
    real = evaluate_module.evaluate

    def counting(model, ds, **kw):
        calls.append(len(ds))
        return real(model, ds, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NASCOMPRESS_PROGRESS", "plain")
        patch_everywhere(mp, evaluate_module, "evaluate", counting)
        r = invoke("pipeline", cfg, "--out", d / "out")
    assert r.exit_code == 0, r.output
    return {"config": cfg, "out": d / "out", "output": r.output, "calls": calls}


def test_progress_lines_say_the_pipelines_time_left(plain_run):
    text = plain_run["output"]
    assert re.search(r"^epochs:\s+1/1 \(100%\)  val [\d.]+% best [\d.]+%  " + LEFT, text, re.M), text
    assert re.search(r"^pipeline base: done in [\d.]+ s; " + LEFT + "$", text, re.M), text
    assert re.search(r"^pipeline report: done in [\d.]+ s$", text, re.M), text  # nothing left after it


def test_report_tests_each_model_once_with_the_same_numbers(plain_run):
    out = plain_run["out"]
    s = json.loads((out / "summary.json").read_text())
    n = s["dense"]["test_n"]
    # the base's and the retrained model's training test them; the DCS search its supernet; the
    # report reuses the two records (before: it tested base and final again, 5 passes)
    assert plain_run["calls"].count(n) == 3
    for key, run in (("dense", out / "base"), ("final", out / "final")):
        again = evaluate_run(run, split="test", device="cpu", dtype="fp32")
        assert (s[key]["test_top1"], s[key]["test_loss"], s[key]["test_n"]) == (again.top1, again.loss, again.n)


def test_recorded_scores_only_where_provably_the_same(plain_run):
    out = plain_run["out"]
    pipe = plan(plain_run["config"], out=out)
    assert recorded_scores(pipe, out / "base") is not None
    copy = out / "base_bf16"
    shutil.copytree(out / "base", copy)
    m = json.loads((copy / "metrics.json").read_text())
    (copy / "metrics.json").write_text(json.dumps({**m, "amp": "bf16"}))  # tested under autocast
    assert recorded_scores(pipe, copy) is None
    shutil.rmtree(copy)
    cfg = json.loads((out / "base" / "config.json").read_text())
    assert cfg["train"]["eval_batch_size"] == 256


def _bench_module(name: str):
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return __import__(name)


def test_cpu_class_names_a_result_file(tmp_path):
    cpu = _bench_module("_cpu")
    assert cpu.cpu_class("Intel(R) Xeon(R) Processor", ["avx512f", "amx_tile"]) == "Intel Xeon AMX"
    assert cpu.cpu_class("AMD EPYC 9B14 96-Core Processor", ["avx512_bf16"]) == "AMD EPYC"
    info = tmp_path / "cpuinfo"
    info.write_text("model name\t: Intel(R) Xeon(R) Processor\nflags\t\t: fpu avx512f amx_tile amx_bf16 sse\n")
    assert cpu.cpu_info(info) == {
        "cpu_model": "Intel(R) Xeon(R) Processor",
        "cpu_flags_of_note": ["avx512f", "amx_bf16", "amx_tile"],
        "cpu_class": "Intel Xeon AMX",
    }


def test_time_section_has_a_column_per_cpu_class():
    make_results = _bench_module("make_results")
    section = _bench_module("_time_section")
    data = make_results.read_all()
    names = [n for n, _ in section.cpu_files(data)]
    assert names == ["tool_speed_amd-epyc.json", "tool_speed_intel-xeon-amx.json"]
    assert "provenance" in data["tool_speed_intel-xeon-amx.json"]
    lines = section.time_section(data)
    assert "|  | AMD EPYC | Intel Xeon (AMX) |" in lines
    main_fp32 = next(line for line in lines if line.startswith("| main job step, fp32 |"))
    amd, intel = (data[n]["steps"]["main"]["fp32"] for n in names)
    assert f"{amd['step_s']:.3f} s, {100 * amd['share_of_peak']:.0f}%" in main_fp32
    assert f"{intel['step_s']:.3f} s, {100 * intel['share_of_peak']:.0f}%" in main_fp32
