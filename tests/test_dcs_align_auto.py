"""``align auto`` for the DCS search (issue 65): the chooser on synthetic latency curves, the setting's
one check in every front end (the CLI, the pipeline file, the Python API), a tiny search that records
the multiple it chose and why, and a resume that keeps it. Nothing here depends on real timing: the
MLP timer is replaced by step functions."""

from __future__ import annotations

import json
import math

import pytest
import torch

import nascompress.dcs_search.align as align_mod
import nascompress.profiling.latency as profiling_latency
from nascompress.dcs_search.align import (
    choose_align,
    fitted,
    known_align,
    probe_window,
    resolve_align,
    search_align,
)
from nascompress.dcs_search.metrics import AlignChoice, DCSMetrics
from nascompress.dcs_search.search_config import DCSSearchConfig, DCSSearchJob, search_train_config
from nascompress.errors import NascompressError, SettingError
from nascompress.methods.dcs import DCSConfig, make_supernet
from nascompress.models.build import build_model
from nascompress.models.layers import DEFAULT_ALIGN

from .conftest import interrupted_at_selection, invoke, tiny_spec_3_heads


def steps_at(m: int, *, base: float = 0.1, per: float = 0.01):
    """A latency that steps at multiples of ``m`` (a tiled kernel: the cost of the width rounded up to
    its tile, flat between steps)."""
    return lambda widths: [base + per * math.ceil(w / m) * m for w in widths]


def linear(widths):
    return [0.01 * w for w in widths]


def flat(widths):
    return [1.0 for _ in widths]


@pytest.fixture(autouse=True)
def fresh_memo(monkeypatch):
    """Every test starts with no choice remembered by the process."""
    monkeypatch.setattr(align_mod, "_CHOSEN", {})


# ---------------------------------------------------------------------------------------------
# The chooser


def test_the_window_ends_at_a_multiple_of_64_near_half_the_hidden_width():
    assert probe_window(384) == tuple(range(129, 193))  # the main job's model: half of 384 is 192
    assert probe_window(1536) == tuple(range(705, 769))  # DINOv2 ViT-S/14
    assert probe_window(128) == tuple(range(1, 65))  # a tiny model: the first 64 widths
    assert probe_window(40) == tuple(range(1, 41))  # clamped to the model
    with pytest.raises(NascompressError):
        probe_window(0)


@pytest.mark.parametrize("m", [64, 32, 16, 8])
def test_steps_at_m_choose_m(m):
    widths = probe_window(384)
    chosen, within = choose_align(widths, steps_at(m)(widths))
    assert chosen == m and within[m] == 1.0
    if m < 64:
        assert within[2 * m] < 0.9  # the next multiple would round many widths up a step


def test_steps_finer_than_the_tolerance_are_not_worth_keeping():
    """At widths 129-192 a step of 2 widths costs 1.4% here: the rule takes a coarser multiple, as the
    widths between those steps buy next to nothing."""
    widths = probe_window(384)
    assert choose_align(widths, steps_at(2)(widths))[0] == 4
    small = probe_window(64)  # widths 1-64: every step counts
    assert choose_align(small, steps_at(2, base=0.0)(small))[0] == 2


def test_flat_latency_chooses_64_and_linear_latency_a_small_multiple():
    widths = probe_window(384)
    assert choose_align(widths, flat(widths))[0] == 64
    chosen, within = choose_align(widths, linear(widths))
    assert chosen == 4 and within[8] < 0.9  # at 129-192 rounding up by 3 costs < 3%, by 7 does not
    assert choose_align(widths, linear(widths), tolerance=0.0)[0] == 1  # no extra cost allowed: every width


@pytest.mark.parametrize("m", [64, 16, 8])
def test_noisy_timings_still_show_their_steps(m):
    """Timings off by up to +-4% (seeded, not measured): the lines through each group see the steps
    that one width against another would miss."""
    widths = probe_window(384)
    g = torch.Generator().manual_seed(0)
    noise = (torch.rand(len(widths), generator=g) * 0.08 - 0.04).tolist()
    ms = [t * (1 + e) for t, e in zip(steps_at(m)(widths), noise)]
    assert choose_align(widths, ms)[0] == m


def test_fitted_lines_are_the_timings_where_they_are_straight():
    widths = probe_window(384)
    for m in (64, 16, 1):
        assert fitted(widths, linear(widths), m) == pytest.approx(dict(zip(widths, linear(widths))))
    fit = fitted(widths, steps_at(16)(widths), 16)  # flat within each group of 16
    assert fit[129] == pytest.approx(fit[144]) and fit[145] > fit[144]


def test_the_chooser_refuses_what_is_not_a_window_of_latencies():
    with pytest.raises(NascompressError, match="consecutive widths"):
        choose_align([1, 3, 4], [1.0, 1.0, 1.0])
    with pytest.raises(NascompressError, match="positive number"):
        choose_align([1, 2], [1.0, float("nan")])


def test_resolve_records_the_window_the_medians_the_rule_and_the_choice(capsys, monkeypatch):
    monkeypatch.setenv("NASCOMPRESS_PROGRESS", "plain")  # the choice's line
    dense = build_model(tiny_spec_3_heads())  # embed 48, 16 patches + the class token, hidden 192
    seen = []

    def measure(widths):
        seen.append(list(widths))
        return steps_at(16)(widths)

    why = resolve_align(dense, device="cpu", dtype="fp32", measure=measure)
    assert seen == [list(range(65, 129))]  # the 64 widths ending at 128 (half of 192 is 96: a tie, the larger)
    assert why.chosen == 16 and why.window == [65, 128] and len(why.ms) == 64
    assert (why.embed_dim, why.tokens, why.hidden, why.dtype, why.batch) == (48, 17, 192, "fp32", 1)
    assert why.tolerance == 0.03 and why.share == 0.9 and why.within["16"] == 1.0 and why.within["32"] < 0.9
    assert "latency steps at multiples of 16" in why.reason
    assert AlignChoice.from_dict(why.to_dict(), source="t").to_dict() == why.to_dict()  # the record round-trips
    err = capsys.readouterr().err
    assert "align auto: chose 16 (latency steps at multiples of 16 on " in err and len(err.splitlines()) == 1
    assert align_mod._CHOSEN == {}  # a given measure is not remembered for the process


def test_the_default_timer_runs_the_models_mlp_and_the_process_remembers_it(monkeypatch):
    """The default measure times the MLP pair of the model's geometry (here stubbed), once a process."""
    calls = []

    def fake(embed_dim, tokens, widths, *, device, dtype, batch=1, seed=0):
        calls.append((embed_dim, tokens, len(widths), str(device), dtype, batch))
        return steps_at(8)(widths)

    monkeypatch.setattr(align_mod, "measure_mlp_ms", fake)
    dense = build_model(tiny_spec_3_heads())
    assert resolve_align(dense, device="cpu", dtype="bf16").chosen == 8
    assert resolve_align(dense, device="cpu", dtype="bf16").chosen == 8
    assert calls == [(48, 17, 64, "cpu", "bf16", 1)]


def test_measure_mlp_ms_times_every_width_once_and_keeps_the_callers_rng(monkeypatch):
    """The real timer's plumbing, with time_models stubbed (no timing): one module per width, the
    lower of two passes, the random state untouched."""
    passes = iter([[3e-3, 1e-3], [2e-3, 4e-3]])
    shapes = []

    def fake_time(mods, x, *, warmup, iters):
        shapes.append(([m.fc1.out_features for m in mods], tuple(x.shape), x.dtype))
        return next(passes)

    monkeypatch.setattr(profiling_latency, "time_models", fake_time)  # the timer time_models_lower runs
    torch.manual_seed(5)
    before = torch.rand(1)
    torch.manual_seed(5)
    ms = align_mod.measure_mlp_ms(8, 5, [3, 4], device=torch.device("cpu"), dtype="bf16")
    assert torch.rand(1) == before
    assert ms == pytest.approx([2.0, 1.0])
    assert shapes == [([3, 4], (1, 5, 8), torch.bfloat16)] * 2


def test_the_search_times_in_its_own_dtype(monkeypatch):
    dense = build_model(tiny_spec_3_heads())
    got = {}

    def job(**search):
        return DCSSearchJob(
            source="x",
            out="y",
            method=DCSConfig.user(align="auto"),
            search=DCSSearchConfig(**{"target_flops": 0.7, **search}),
            train=search_train_config(device="cpu", amp="bf16"),
        )

    def resolve(dense, *, device, dtype, batch):
        got.update(dtype=dtype, batch=batch)
        return resolve_align(dense, device=device, dtype=dtype, batch=batch, measure=flat)

    monkeypatch.setattr(align_mod, "resolve_align", resolve)
    resolved, why = search_align(job(), dense, torch.device("cpu"))
    assert resolved.method.align == 64 and why.chosen == 64 and got == {"dtype": "bf16", "batch": 1}
    lat = job(cost="latency", target_flops=None, target_latency=0.8, latency_dtype="fp32", latency_batch=4)
    assert search_align(lat, dense, torch.device("cpu"))[0].method.align == 64
    assert got == {"dtype": "fp32", "batch": 4}  # the latency cost's dtype and batch
    fixed = job().replace(method=DCSConfig.user(align=4))
    assert search_align(fixed, dense, torch.device("cpu")) == (fixed, None)


# ---------------------------------------------------------------------------------------------
# The setting: one check, every front end


def test_the_setting_takes_a_positive_integer_or_auto_and_the_default_is_unchanged():
    assert DCSConfig().align == DEFAULT_ALIGN and DCSConfig.user().align == DEFAULT_ALIGN
    assert DCSConfig.user(align="auto").align == "auto" and DCSConfig.from_dict({"align": 16}).align == 16
    for bad in (0, -8, 2.5, "fast", True, "16"):
        with pytest.raises(SettingError) as e:
            DCSConfig.user(align=bad)
        assert e.value.worded(lambda f: f"--{f}") == f"--align must be a positive integer or auto, got {bad!r}"
    with pytest.raises(NascompressError, match="'auto' is chosen by the search"):
        make_supernet(build_model(tiny_spec_3_heads()), DCSConfig(align="auto", mlp_gates="hidden"))
    assert known_align("auto") == DEFAULT_ALIGN and known_align(16) == 16


def quick_args(tiny_run, out, *extra):
    """A search of seconds: 1 epoch, no baseline comparison, the residual family."""
    return [
        "search", "dcs", tiny_run, "--out", out, "--epochs", 1, "--batch-size", 32, "--train-limit", 320,
        "--eval-limit", 64, "--device", "cpu", "--amp", "off", "--mlp-gates", "residual",
        "--init-importance", "weight", "--no-baseline", *extra,
    ]  # fmt: skip


@pytest.mark.parametrize("value", ["0", "fast", "2.5", "-1"])
def test_cli_refuses_a_bad_align_in_one_line(tiny_run, tmp_path, value):
    out = tmp_path / "s"
    res = invoke(*quick_args(tiny_run, out, "--align", value))
    shown = repr(int(value)) if value.lstrip("-").isdigit() else repr(value)
    assert res.exit_code == 1, res.output
    assert f"--align must be a positive integer or auto, got {shown}" in res.output
    assert len(res.output.strip().splitlines()) == 1 and not out.exists()


def test_cli_help_shows_the_option_takes_an_integer_or_auto():
    res = invoke("search", "dcs", "--help")
    assert res.exit_code == 0 and "INTEGER|auto" in res.output


def test_pipeline_file_takes_auto_and_refuses_bad_values(tmp_path):
    from nascompress.pipeline import load_config

    from .test_pipeline import _bad, tiny_config

    cfg = tiny_config()
    cfg["stages"]["tokens"]["space"] = str(tmp_path / "space.yaml")
    (tmp_path / "space.yaml").write_text("format: nascompress-space/1\nname: x\nmethods: []\n")
    assert load_config(_bad(cfg, "stages.dcs.align", "auto"), source="p").stages.dcs.align == "auto"
    assert load_config(_bad(cfg, "stages.dcs.align", 16), source="p").stages.dcs.align == 16
    assert load_config(cfg, source="p").stages.dcs.align == DEFAULT_ALIGN
    for bad in (2.5, 0, "fast", True, [8]):
        with pytest.raises(NascompressError) as e:
            load_config(_bad(cfg, "stages.dcs.align", bad), source="p")
        assert str(e.value) == f"p: stages.dcs.align: must be a positive integer or auto, got {bad!r}"


def test_pipeline_cli_refuses_a_bad_align_in_one_line(tmp_path):
    from .test_pipeline import _bad, invoke, tiny_config, write_config

    cfg = write_config(tmp_path, _bad(tiny_config(), "stages.dcs.align", 2.5))
    r = invoke("pipeline", cfg, "--out", tmp_path / "out")
    line = r.output.strip()
    assert r.exit_code == 1 and len(line.splitlines()) == 1, r.output
    assert "stages.dcs.align: must be a positive integer or auto, got 2.5" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.filterwarnings("ignore:nc.compress")  # digits' 8 px images resized to the model's 16
def test_python_api_names_its_dict_entry(tiny_run):
    import nascompress as nc

    model = nc.load(tiny_run)
    with pytest.raises(NascompressError) as e:
        nc.compress(model, "digits", target_flops=0.6, dcs={"align": "fast"}, progress=False)
    msg = str(e.value)
    assert "dcs['align']" in msg and "positive integer or auto, got 'fast'" in msg and len(msg.splitlines()) == 1


def test_a_study_trials_dcs_settings_take_auto():
    """A study trial builds its DCS config as the search does (DCSConfig.user), and the space's check of
    a dcs entry's values asks that config."""
    from nascompress.studies.space_values import registry_value_error

    assert DCSConfig.user(**{"align": "auto"}).align == "auto"
    assert registry_value_error("dcs", "align", "auto") is None
    assert "positive integer or auto" in registry_value_error("dcs", "align", 0)


def test_a_space_file_takes_align_auto_for_dcs():
    from nascompress.studies.space_model import Space

    space = {"format": "nascompress-space/1", "name": "t", "methods": [{"name": "dcs", "params": {"align": "auto"}}]}
    assert Space.from_dict(space).methods[0].params[0].value == "auto"


# ---------------------------------------------------------------------------------------------
# A tiny search: the multiple chosen, recorded, and kept by a resume


def timer(monkeypatch, curve, calls: list):
    def fake(embed_dim, tokens, widths, *, device, dtype, batch=1, seed=0):
        calls.append(list(widths))
        return curve(widths)

    monkeypatch.setattr(align_mod, "measure_mlp_ms", fake)


def check_recorded(out, m: int) -> None:
    config = json.loads((out / "config.json").read_text())
    assert config["method"]["align"] == m  # the job as searched: the integer
    assert config["pre_search"]["align_probe"]["chosen"] == m
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["align"] == m and metrics["align_probe"]["chosen"] == m
    typed = DCSMetrics.from_dict(metrics, source="t")
    assert typed.align == m and typed.align_probe.window == [1, 64] and len(typed.align_probe.ms) == 64
    arch = json.loads((out / "arch.json").read_text())
    rec = next(r for r in arch["methods"] if r["name"] == "dcs")
    assert rec["config"]["align"] == m
    for b in rec["blocks"]:  # residual channels of 32, Q/K channels of 16 per head: 0, full or a multiple
        assert b["mlp_keep"] is None or len(b["mlp_keep"]) in (0, 32) or len(b["mlp_keep"]) % m == 0
        assert all(len(h) in (0, 16) or len(h) % m == 0 for h in b["qk_keep"] or [])


def test_search_align_auto_records_the_multiple_and_a_resume_keeps_it(tiny_run, tmp_path, monkeypatch):
    monkeypatch.setenv("NASCOMPRESS_PROGRESS", "plain")  # the choice's line
    calls: list = []
    timer(monkeypatch, steps_at(16), calls)
    out = tmp_path / "s"
    with interrupted_at_selection(2):  # the end of the second epoch, before its checkpoint
        res = invoke(*quick_args(tiny_run, out, "--align", "auto", "--epochs", 2))
    assert res.exit_code == 130, res.output
    assert "align auto: chose 16 (latency steps at multiples of 16 on " in res.output
    assert len(calls) == 1 and calls[0] == list(range(1, 65))  # the tiny model's hidden 128: widths 1-64
    assert json.loads((out / "config.json").read_text())["method"]["align"] == 16

    # the resume: the same command again (--align auto given), the device's curve now stepping at 32 and the
    # process's memory cleared: the run goes on at the multiple it chose, never timed again
    monkeypatch.setattr(align_mod, "_CHOSEN", {})
    calls.clear()
    timer(monkeypatch, steps_at(32), calls)
    res = invoke(*quick_args(tiny_run, out, "--align", "auto", "--epochs", 2, "--resume"))
    assert res.exit_code == 0, res.output
    assert calls == [] and "align auto: chose" not in res.output
    assert "align auto: 16 (latency steps at multiples of 16" in res.output  # the command's summary line
    check_recorded(out, 16)
    log = [json.loads(ln) for ln in (out / "log.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in log] == [0, 1, 2] and log[1]["align_probe"]["chosen"] == 16  # the first epoch's

    # a resume giving another align than the recorded one is refused as any other setting is
    res = invoke(*quick_args(tiny_run, out, "--align", 8, "--epochs", 2, "--resume"))
    assert res.exit_code == 1 and "method.align 8 (recorded 16)" in res.output, res.output


def test_resume_refuses_auto_where_the_run_was_given_its_multiple(tiny_run, tmp_path, monkeypatch):
    """--align auto on a resume means the multiple the run chose; a run given one did not choose."""
    out = tmp_path / "s"
    with interrupted_at_selection(1):
        assert invoke(*quick_args(tiny_run, out, "--align", 4)).exit_code == 130
    calls: list = []
    timer(monkeypatch, flat, calls)
    res = invoke(*quick_args(tiny_run, out, "--align", "auto", "--resume"))
    assert res.exit_code == 1 and "method.align 'auto' (recorded 4)" in res.output and calls == [], res.output
