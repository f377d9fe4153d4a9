"""``nascompress pipeline``: a tiny pipeline end to end (every stage), resume after SIGKILL with
the same result as an uninterrupted run, and bad configs refused before anything is written."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

import nascompress
from nascompress.errors import NascompressError
from nascompress.pipeline import STEPS, load_config, plan
from nascompress.profiling import count_flops

from .conftest import FMNIST, TINY_EVIT_SPACE, invoke

REPO = Path(__file__).resolve().parents[1]
ONE_STUDY = [s for s in STEPS if s != "tokens_search_dense"]  # the steps with also_dense off
SPACE = TINY_EVIT_SPACE


def tiny_config() -> dict:
    """Every stage, seconds each: a 2-block ViT on the synthetic 16 px dataset."""
    return {
        "format": "nascompress-pipeline/1",
        "seed": 0,
        "device": "cpu",
        "data": {"dataset": "synthetic"},
        "base": {
            "train": {
                "img_size": 16,
                "patch_size": 4,
                "embed_dim": 32,
                "depth": 2,
                "num_heads": 2,
                "in_chans": 1,
                "epochs": 1,
                "batch_size": 32,
                "lr": 2e-3,
            }
        },
        "goal": {"max_flops": 0.75},
        "stages": {
            "dcs": {
                "target_flops": 0.85,
                "epochs": 3,
                "batch_size": 32,
                "alpha_init": 0.5,
                "base_lr": 1e-3,
                "arch_lr": 0.15,
            },
            "tokens": {
                "space": "space.yaml",
                "trials": 4,
                "eval_images": 60,
                "train_images": 60,
                "calib_steps": 3,
                "batch_size": 30,
                "also_dense": False,
            },
            "retrain": {"epochs": 1, "eta": 0, "batch_size": 32},
        },
        "report": {"iters": 2, "batch_size": 8},
        "export": {"format": "torch-export"},
    }


def write_config(d: Path, cfg: dict, name: str = "tiny.yaml") -> Path:
    (d / "space.yaml").write_text(SPACE)
    path = d / name
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """One uninterrupted pipeline run (in-process, one thread)."""
    d = tmp_path_factory.mktemp("pipeline")
    cfg = write_config(d, tiny_config())
    out = d / "out"
    t0 = time.perf_counter()
    r = invoke("pipeline", cfg, "--out", out)
    assert r.exit_code == 0, r.output
    return {"dir": d, "config": cfg, "out": out, "seconds": time.perf_counter() - t0, "output": r.output}


def test_tiny_pipeline_end_to_end(ref):
    out = ref["out"]
    for sub in ("base", "dcs_search", "dcs_mat", "tokens", "tokens/picked", "final"):
        assert (out / sub / ("model.safetensors" if sub != "tokens" else "report.html")).is_file(), sub
    assert (out / "studies.db").is_file()
    assert sorted(p.stem for p in (out / "done").iterdir()) == sorted(ONE_STUDY)
    assert not (out / "tokens" / "pick.json").exists()  # also_dense off: one study
    s = json.loads((out / "summary.json").read_text())
    assert s["dense"]["test_n"] == s["final"]["test_n"] == 200  # the same test split for both
    cmp = s["comparison"]
    assert cmp["flops_ratio"] < 0.75 and s["goal"] == {"max_flops": 0.75, "value": cmp["flops_ratio"], "met": True}
    assert {"top1_change", "params_ratio", "file_ratio", "latency_speedup", "throughput_speedup"} <= set(cmp)
    assert s["final"]["params"] < s["dense"]["params"] and s["final"]["latency_ms"] > 0
    dec = s["decisions"]
    blocks = dec["dcs"]["blocks"]
    family = dec["dcs"]["mlp_gates"]  # chosen by the probe (mlp_gates: auto), and said why
    assert family in ("residual", "hidden") and dec["dcs"]["family_reason"].startswith(family)
    total = 32 if family == "residual" else 128  # of C, or of the hidden width
    assert len(blocks) == 2 and all(b["mlp_kept"] <= b["mlp_total"] == total for b in blocks)
    assert all(b["mlp_kept"] in (0, total) or b["mlp_kept"] % 8 == 0 for b in blocks)  # aligned widths
    assert all(len(b["qk_kept"]) == 2 and max(b["qk_kept"]) <= 16 for b in blocks)
    assert dec["dcs"]["target_flops"] == 0.85 and dec["dcs"]["dcs_outcome"] == "planned"
    # by default the channel stage lands near its target (either side), not under it
    assert json.loads((out / "dcs_search" / "config.json").read_text())["search"]["at_most"] is False
    tok = dec["tokens"]
    assert tok["pick_rule"] == "best-under-flops=0.75" and tok["trials_complete"] == 4
    assert tok["trial_flops_ratio"] <= 0.75 and tok["params"] and tok["methods"][0]["name"] == "evit"
    assert "keep_rate=" in tok["methods"][0]["summary"] and "prune_layers=" in tok["methods"][0]["summary"]
    assert dec["retrain"]["epochs"] == 1 and dec["retrain"]["teacher"] == "base"
    page = (out / "report.html").read_text()
    assert 'id="comparison"' in page and "dense base" in page and 'id="dcs-blocks"' in page
    assert 'id="study"' in page and "<script" in page and "https://" not in page.split("<script")[0]
    # the final model loads on its own and is cheaper than the base
    final, base = nascompress.load(out / "final"), nascompress.load(out / "base")
    x = torch.randn(2, 1, 16, 16)
    assert count_flops(final, x).total < 0.75 * count_flops(base, x).total
    assert final(x).shape == (2, 10)
    # the stored config is the normalized one and reads back to the same config
    assert load_config(out / "config.yaml") == load_config(ref["config"])
    assert "terminal" not in ref["output"] and "test top-1" in ref["output"]
    side = json.loads((out / "export" / "model.pt2.json").read_text())  # the deployable file, checked
    assert side["verification"]["passed"] and [m["name"] for m in side["methods"]] == ["dcs", "evit"]


def test_a_finished_pipeline_is_not_rerun(ref):
    out = ref["out"]
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    r = invoke("pipeline", ref["config"], "--out", out, "--json")
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    assert s["this_run"] == {"resumed": True, "ran": [], "skipped": ONE_STUDY}
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == before


def _cli(cfg: Path, out: Path) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return subprocess.Popen(
        [sys.executable, "-m", "nascompress.cli.main", "pipeline", str(cfg), "--out", str(out)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_kill_9_mid_run_then_resume_gives_the_same_result(ref, tmp_path):
    cfg = write_config(tmp_path, tiny_config())
    out = tmp_path / "out"
    proc = _cli(cfg, out)
    ckpt = out / "dcs_search" / "checkpoint.safetensors"
    deadline = time.time() + 120
    while not ckpt.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert ckpt.exists(), proc.communicate()[1][-2000:]
    os.kill(proc.pid, signal.SIGKILL)  # in the middle of the DCS search (its first epoch is checkpointed)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    assert (out / "done" / "base.json").is_file() and not (out / "done" / "report.json").exists()
    search_done = (out / "done" / "dcs_search.json").exists()
    kept = {p: p.stat().st_mtime_ns for p in [out / "done" / "base.json", *(out / "base").iterdir()]}

    proc = _cli(cfg, out)  # the same command again
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert "base: complete, skipped" in err
    if not search_done:
        assert "dcs_search: DCS channel search" in err and "continuing from its last checkpoint" in err
    assert {p: p.stat().st_mtime_ns for p in kept} == kept  # the finished stage was not rerun

    # the same result as the uninterrupted run
    a, b = (load_file(str(o / "final" / "model.safetensors")) for o in (ref["out"], out))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
    ra, rb = (json.loads((o / "summary.json").read_text()) for o in (ref["out"], out))
    assert rb["final"]["test_top1"] == pytest.approx(ra["final"]["test_top1"])
    assert rb["final"]["macs"] == ra["final"]["macs"]
    assert rb["decisions"]["dcs"]["blocks"] == ra["decisions"]["dcs"]["blocks"]
    assert rb["decisions"]["tokens"]["params"] == ra["decisions"]["tokens"]["params"]


def _running_trial(db: Path, at_least: int) -> bool:
    """Is a trial numbered >= ``at_least`` RUNNING in the study file (read-only, no lock held)?"""
    import sqlite3

    if not db.is_file():
        return False
    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=0.1)
        try:
            row = con.execute(
                "SELECT COUNT(*) FROM trials WHERE state = 'RUNNING' AND number >= ?", (at_least,)
            ).fetchone()
        finally:
            con.close()
    except sqlite3.Error:  # the schema is being created, or the file is locked for a write
        return False
    return bool(row and row[0])


def _study_trials(out: Path) -> list[tuple]:
    import optuna

    study = optuna.load_study(study_name="pipeline", storage=f"sqlite:///{out / 'studies.db'}")
    return [(t.number, t.state.name, t.params, t.values) for t in study.get_trials(deepcopy=False)]


def test_kill_9_during_the_study_then_resume_picks_the_same_trial(ref, tmp_path):
    """Killed mid-trial in the token study, the same command resumes the study in place (the killed
    trial is run again, the sampler continues from the seed and the trials told) and ends with
    the uninterrupted run's pick, accuracy and FLOPs."""
    cfg = write_config(tmp_path, tiny_config())
    out = tmp_path / "out"
    proc = _cli(cfg, out)
    deadline = time.time() + 240
    while not _running_trial(out / "studies.db", 2) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    assert proc.poll() is None, proc.communicate()[1][-2000:]
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate()
    assert (out / "done" / "dcs_mat.json").is_file() and not (out / "done" / "tokens_search.json").exists()

    proc = _cli(cfg, out)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert "tokens_search: search" in err and "continuing the study" in err
    # the study: trial for trial (numbers, params, values) what the uninterrupted run's study holds
    assert _study_trials(out) == _study_trials(ref["out"])
    ra, rb = (json.loads((o / "summary.json").read_text()) for o in (ref["out"], out))
    ta, tb = ra["decisions"]["tokens"], rb["decisions"]["tokens"]
    for k in ("picked_trial", "params", "trial_seed", "trial_accuracy", "trial_flops_ratio", "trials_complete"):
        assert tb[k] == ta[k], k
    assert rb["final"]["test_top1"] == pytest.approx(ra["final"]["test_top1"])
    assert (
        rb["final"]["macs"] == ra["final"]["macs"]
        and rb["comparison"]["flops_ratio"] == ra["comparison"]["flops_ratio"]
    )


def _bad(base: dict, path: str, value) -> dict:
    cfg = json.loads(json.dumps(base))
    *parents, last = path.split(".")
    node = cfg
    for p in parents:
        node = node.setdefault(p, {})
    node[last] = value
    return cfg


BAD = [
    ("stages.dcs.epoch", 2, "unknown key stages.dcs.epoch; valid: target_flops, epochs,"),
    # a command's option the stage does not take: where it goes (issue 49)
    (
        "stages.dcs.eval_limit",
        150,
        "unknown key stages.dcs.eval_limit: eval_limit is set once for every stage, "
        "under data: (data.eval_limit); valid: target_flops,",
    ),
    (
        "stages.retrain.dataset",
        "digits",
        "unknown key stages.retrain.dataset: dataset is set once for every stage, under data: (data.dataset)",
    ),
    (
        "stages.tokens.train_limit",
        100,
        "unknown key stages.tokens.train_limit: the study's training images are "
        "train_images (search tokens --train-images)",
    ),
    (
        "stages.tokens.eval_limit",
        100,
        "unknown key stages.tokens.eval_limit: the study's validation images are "
        "eval_images (search tokens --eval-images); the test images, for every "
        "stage, data.eval_limit",
    ),
    ("base.train.epochs", "two", "base.train.epochs: must be an integer, got 'two'"),
    (
        "stages.dcs.fallback",
        False,
        "key stages.dcs.fallback was renamed; write on_collapse: retry | stop; "
        "fallback: true is retry, fallback: false is stop",
    ),
    ("stages.retrain.teacher", "base", "key stages.retrain.teacher was renamed; write distil_from: base | none"),
    ("stages.dcs.target_flops", 1.5, "stages.dcs.target_flops: must be in (0, 1], got 1.5"),
    ("base.run", "/nonexistent/run", "base: give exactly one of run, train, import; got run, train"),
    (
        "base",
        {"import": {"model": "vit_tiny_patch16_224", "weights": "missing.safetensors"}},
        "base.import.weights: file ",
    ),
    ("stages.tokens.space", "nope.yaml", "stages.tokens.space: search space "),
    (
        "stages.tokens.sampler",
        "qmc",
        "stages.tokens.sampler: sampler qmc needs a space without conditional "
        "parameters, and space 'tiny-evit' has one: evit.keep_rate.1",
    ),
    ("goal", {"max_flops": 0.5, "max_latency_ms": 3}, "goal: give exactly one of max_flops, max_latency_ms"),
    ("format", "nascompress-pipeline/2", "format: must be nascompress-pipeline/1"),
    ("stages.retrain.lr", True, "stages.retrain.lr: must be a number, got True"),
    ("export.format", "tflite", "export.format: must be one of onnx, torch-export, aoti, got 'tflite'"),
    ("export.batch", 0, "export: batch must be 'dynamic' or an integer in [1, 65536], got 0"),
    ("export.batch", [8], "export.batch: must be a string or an integer, got a list"),
    ("amp", "fp16", "amp: must be one of off, bf16, auto, got 'fp16'"),
    ("report.dtype", "fp8", "report.dtype: must be one of fp32, bf16, fp16, got 'fp8'"),
    ("deterministic", "yes", "deterministic: must be true or false, got 'yes'"),
]


@pytest.mark.parametrize("path,value,match", BAD, ids=[b[0] for b in BAD])
def test_bad_config_is_one_line_naming_the_key_and_writes_nothing(tmp_path, path, value, match):
    cfg = write_config(tmp_path, _bad(tiny_config(), path, value))
    out = tmp_path / "out"
    r = invoke("pipeline", cfg, "--out", out)
    assert r.exit_code == 1
    line = r.output.strip()
    assert len(line.splitlines()) == 1 and line.startswith("error: ") and str(cfg) in line, line
    assert match in line, line
    assert not out.exists()


def test_more_bad_configs(tmp_path):
    def check(cfg: dict | str, match: str) -> None:
        path = write_config(tmp_path, cfg) if isinstance(cfg, dict) else tmp_path / "raw.yaml"
        if isinstance(cfg, str):
            path.write_text(cfg)
        r = invoke("pipeline", path, "--out", tmp_path / "out")
        assert r.exit_code == 1 and match in r.output and len(r.output.strip().splitlines()) == 1, r.output
        assert not (tmp_path / "out").exists()

    c = tiny_config()
    del c["stages"]["dcs"], c["stages"]["tokens"]
    check(c, "stages: give a dcs or a tokens stage")
    (tmp_path / "deep.yaml").write_text(SPACE.replace("range: [1, 2]", "range: [2, 5]"))
    check(_bad(tiny_config(), "stages.tokens.space", "deep.yaml"), "beyond the model's depth 2")
    check("format: nascompress-pipeline/1\nseed: [1\n", "not valid YAML at line")
    check("format: nascompress-pipeline/1\nseed: 1\nseed: 2\n", "duplicate key 'seed'")
    check(_bad(tiny_config(), "data.dataset", "no/such/folder"), "data.dataset: ")
    g = _bad(_bad(tiny_config(), "goal", {"max_latency_ms": 5.0}), "stages.tokens.objective", "flops")
    check(g, "stages.tokens.objective: flops trials record no latency")
    nt = _bad(_bad(tiny_config(), "stages.retrain.distil_from", "none"), "stages.retrain.feat_kd", 1.0)
    check(nt, "stages.retrain: feat_kd distils from a teacher's features; give the dense run with distil_from: base")
    # a headless checkpoint without linear_probe
    from safetensors.torch import save_file

    from nascompress.models.build import ModelSpec, build_model, custom_vit_spec

    m = build_model(
        custom_vit_spec(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=10, in_chans=1)
    )
    save_file({k: v for k, v in m.state_dict().items() if not k.startswith("head.")}, str(tmp_path / "bb.safetensors"))
    imp = {"model": "vit_tiny_patch16_224", "weights": "bb.safetensors", "img_size": 16}
    check(_bad(tiny_config(), "base", {"import": imp}), "base.import.linear_probe: the weights in")
    m = build_model(ModelSpec("vit_tiny_patch16_224", {"num_classes": 5, "img_size": 32}))
    save_file(dict(m.state_dict()), str(tmp_path / "five.safetensors"))
    imp = {"model": "vit_tiny_patch16_224", "weights": "five.safetensors"}
    check(_bad(tiny_config(), "base", {"import": imp}), "base.import.weights: the weights' head has 5 classes")


def test_an_existing_run_as_the_base(ref, tmp_path):
    c = tiny_config()
    del c["stages"]["dcs"]
    c["base"] = {"run": str(ref["out"] / "base")}
    p = plan(write_config(tmp_path, c), out=tmp_path / "out")
    assert [s.name for s in p.steps] == ["base", "tokens_search", "tokens_pick", "retrain"] + (
        ["export"] if c.get("export") else []
    ) + ["report"]
    assert p.base_dir == ref["out"] / "base" and p.final_dir == tmp_path / "out" / "final"
    c["base"] = {"run": str(ref["out"] / "dcs_mat")}
    with pytest.raises(nascompress.NascompressError, match=r"base.run: .*is not a dense run \(it applies dcs\)"):
        plan(write_config(tmp_path, c), out=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_another_config_into_the_same_out_is_refused(ref, tmp_path):
    out = ref["out"]
    stored = (out / "config.yaml").read_bytes()
    cfg = write_config(ref["dir"], _bad(tiny_config(), "stages.retrain.epochs", 2), name="other.yaml")
    r = invoke("pipeline", cfg, "--out", out)
    assert r.exit_code == 1 and len(r.output.strip().splitlines()) == 1
    assert "holds a pipeline run of another config (stages.retrain.epochs is 2 here but 1 there)" in r.output
    assert "--force" in r.output and (out / "config.yaml").read_bytes() == stored
    # a directory that is not a pipeline run is refused too
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "f.txt").write_text("x")
    r = invoke("pipeline", cfg, "--out", tmp_path / "other")
    assert r.exit_code == 1 and "holds no pipeline run" in r.output and (tmp_path / "other" / "f.txt").exists()


def test_a_run_written_before_a_key_existed_is_continued(ref, tmp_path):
    """A run whose config.yaml lacks keys that a later version added (with the default the run had)
    is continued by that version, not refused as another config."""
    out = tmp_path / "out"
    shutil.copytree(ref["out"], out)
    stored = yaml.safe_load((out / "config.yaml").read_text())
    for key in ("grad_balance", "min_lr"):
        del stored["stages"]["dcs"][key]
    (out / "config.yaml").write_text(yaml.safe_dump(stored, sort_keys=False))
    r = invoke("pipeline", ref["config"], "--out", out)
    assert r.exit_code == 0, r.output
    assert "holds a pipeline run of another config" not in r.output
    # a key whose value differs is still another config
    stored["stages"]["dcs"]["epochs"] = 99
    (out / "config.yaml").write_text(yaml.safe_dump(stored, sort_keys=False))
    r = invoke("pipeline", ref["config"], "--out", out)
    assert r.exit_code == 1 and "stages.dcs.epochs is 3 here but 99 there" in r.output
    assert f"give the new config base: {{run: {out / 'base'}}}" in r.output  # its finished base can be kept


def test_yaml_numbers_and_the_normalized_config(tmp_path):
    (tmp_path / "space.yaml").write_text(SPACE)
    text = yaml.safe_dump(tiny_config(), sort_keys=False).replace("lr: 0.002", "lr: 2e-3")
    assert "lr: 2e-3" in text
    (tmp_path / "c.yaml").write_text(text)
    cfg = load_config(tmp_path / "c.yaml", seed=7)
    assert cfg.base.train.lr == 2e-3 and cfg.seed == 7
    assert cfg.stages.tokens.space == str(tmp_path / "space.yaml")  # relative to the config file
    assert cfg.stages.retrain.eta == 0.0 and isinstance(cfg.stages.retrain.eta, float)
    d = cfg.to_dict()
    assert list(d["base"]) == ["train"] and "dcs" in d["stages"] and d["stages"]["retrain"]["distil_from"] == "base"


def test_help_shows_an_example():
    r = invoke("pipeline", "--help")
    assert r.exit_code == 0 and "Example: nascompress pipeline configs/fashion-mnist.yaml" in r.output


@pytest.mark.skipif(not FMNIST, reason="Debian package dataset-fashion-mnist not installed")
def test_shipped_fashion_mnist_config_is_valid(tmp_path):
    p = plan(REPO / "configs" / "fashion-mnist.yaml", out=tmp_path / "x")
    assert [s.name for s in p.steps] == list(STEPS) and not (tmp_path / "x").exists()
    assert p.cfg.goal.max_flops == 0.6 and p.cfg.stages.dcs.qk_mask == "static"
    assert p.cfg.stages.tokens.space == str(REPO / "nascompress" / "search_spaces" / "evit.yaml")  # by name


@pytest.mark.skipif(
    not (FMNIST and (REPO / "weights" / "dinov2_vits14_112.safetensors").is_file()),
    reason="needs Fashion-MNIST and the converted DINOv2 weights in weights/",
)
def test_shipped_dinov2_config_is_valid(tmp_path):
    p = plan(REPO / "configs" / "dinov2-fashion-mnist.yaml", out=tmp_path / "x")
    assert p.cfg.base.import_.linear_probe and p.cfg.stages.tokens.space.endswith("search_spaces/evit-12.yaml")
    assert p.cfg.base.import_.weights == str(REPO / "weights" / "dinov2_vits14_112.safetensors")
    assert [s.name for s in p.steps] == [s for s in STEPS if s != "export"] and p.cfg.stages.dcs.mlp_gates == "auto"
    assert p.cfg.goal.max_flops == 0.6 and not (tmp_path / "x").exists()


@pytest.mark.skipif(not FMNIST, reason="Debian package dataset-fashion-mnist not installed")
def test_shipped_latency_config_is_valid(tmp_path):
    """The main job for speed: the DCS search steered by the device's latency, heads and blocks, no token stage."""
    p = plan(REPO / "configs" / "fashion-mnist-latency.yaml", out=tmp_path / "x")
    dcs = p.cfg.stages.dcs
    assert dcs.cost == "latency" and dcs.target_latency == 0.7 and dcs.head_gates and dcs.depth_gates
    assert p.cfg.stages.tokens is None and "0.7x the dense predicted latency" in p.steps[1].describe
    assert not (tmp_path / "x").exists()


def test_shipped_configs_hold_no_machine_path():
    for cfg in (REPO / "configs").glob("*.yaml"):
        text = cfg.read_text()
        assert not re.search(r"/(work|tmp)/|\.\./shared", text), cfg.name


def test_a_second_run_into_a_busy_out_is_refused(ref):
    import fcntl

    fd = os.open(ref["out"] / ".pipeline.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a running pipeline holds it
        r = invoke("pipeline", ref["config"], "--out", ref["out"])
        assert r.exit_code == 1 and "another 'nascompress pipeline' is running in" in r.output
    finally:
        os.close(fd)


def test_a_run_stored_with_former_key_names_continues(tmp_path):
    """A run whose config.yaml an earlier version wrote (stages.retrain.teacher, stages.dcs.fallback)
    is continued: the stored keys are read under their new names; a user's file with them is refused."""
    from nascompress.pipeline.config_io import dump_config
    from nascompress.pipeline.run import CONFIG_FILE, _claim_out

    cfg = write_config(tmp_path, tiny_config())
    out = tmp_path / "out"
    pipe = plan(cfg, out=out)
    out.mkdir()
    text = dump_config(pipe.cfg)
    assert "distil_from: base" in text and "on_collapse: retry" in text
    old = text.replace("distil_from: base", "teacher: base").replace("on_collapse: retry", "fallback: true")
    (out / CONFIG_FILE).write_text(old)
    (out / "base").mkdir()  # a stage of the earlier run
    assert _claim_out(pipe, force=False) is True
    (out / CONFIG_FILE).write_text(old.replace("fallback: true", "fallback: false"))  # another behaviour: refused
    with pytest.raises(nascompress.NascompressError, match="stages.dcs.on_collapse is 'retry' here but 'stop' there"):
        _claim_out(pipe, force=False)


def test_the_pipeline_chooses_where_to_cut(tmp_path):
    """After a dcs stage the token space is also searched on the dense base (token-only models) and the
    goal's pick takes the better study's pick, scored on the same images; the report says which."""
    cfg = tiny_config()
    cfg["stages"]["tokens"].pop("also_dense")  # the default: on
    cfg["stages"]["retrain"]["epochs"] = 1
    cfg["stages"]["dcs"]["target_flops"] = cfg["goal"]["max_flops"]  # channels alone may meet the goal
    cfg["stages"]["dcs"]["at_most"] = True
    cfg["stages"]["dcs"]["max_calibration"] = 0.05  # the shift under the goal, wherever in its band the search lands
    out = tmp_path / "out"
    r = invoke("pipeline", write_config(tmp_path, cfg), "--out", out)
    assert r.exit_code == 0, r.output
    assert "tokens_search_dense: search" in r.output and "continuing the study" not in r.output  # a first run
    pick = json.loads((out / "tokens" / "pick.json").read_text())
    cands = pick["candidates"]
    assert set(cands) == {"pipeline", "pipeline-dense"} and pick["dense_study"] == "pipeline-dense"
    scored = {k: c["accuracy"] for k, c in cands.items() if c.get("trial") is not None}
    flops = {k: c["flops_ratio"] for k, c in cands.items() if c.get("trial") is not None}
    best = max(scored, key=lambda k: (scored[k], -flops[k], k == "pipeline"))  # ties: the cheaper, then the first
    assert scored and pick["picked_study"] == best
    picked = json.loads((out / "tokens" / "picked" / "metrics.json").read_text())
    assert picked["trial"] == cands[pick["picked_study"]]["trial"]
    methods = [m["name"] for m in json.loads((out / "final" / "arch.json").read_text())["methods"]]
    assert ("dcs" in methods) == (pick["picked_study"] == "pipeline")  # token-only: no channel cut
    rates = [v for k, v in cands[pick["picked_study"]]["params"].items() if "keep_rate" in k]
    assert ("evit" in methods) == any(v < 1.0 for v in rates), (methods, rates)  # every token kept: no EViT
    s = json.loads((out / "summary.json").read_text())
    assert s["decisions"]["tokens"]["picked_study"] == pick["picked_study"]
    html = (out / "report.html").read_text()
    assert "where to cut:" in html
    # the DCS stage's landing is reported whether or not its model is the one kept
    assert s["decisions"]["dcs"]["in_final_model"] == ("dcs" in methods)
    if s["decisions"]["dcs"]["dcs_outcome"] == "planned":
        assert s["decisions"]["dcs"]["flops_ratio"] is not None
        assert ("not in the final model" in html) == ("dcs" not in methods)
    assert s["comparison"]["flops_ratio"] <= 0.75
    # at_most: the channel stage at the goal lands at or under it, so the channel-only trial can be picked
    assert json.loads((out / "dcs_search" / "config.json").read_text())["search"]["at_most"] is True
    if s["decisions"]["dcs"]["dcs_outcome"] == "planned":
        assert json.loads((out / "dcs_search" / "metrics.json").read_text())["flops_ratio"] <= 0.75


def test_the_report_names_a_dcs_stage_whose_model_was_not_kept():
    """A token-only final model (the pick took the dense base's study): the DCS stage's landing is still a
    decision line, saying that its model is not the one kept; with its model kept, the usual line."""
    from nascompress.pipeline.report_format import decision_lines
    from nascompress.pipeline.summary import Summary

    dcs = {"in_final_model": False, "target_flops": 0.6, "flops_ratio": 0.59997, "val_top1": 88.25}
    lines = decision_lines(Summary.new(decisions={"dcs": dcs}))
    assert lines == [
        "dcs: target 0.6x the dense FLOPs, landed at 0.600x, validation top-1 88.25%; not in the final model: "
        "the pick across the token studies took a token-only model of the dense base"
    ]
    kept = dict(dcs, in_final_model=True, blocks=[], mlp_kept_total=8, mlp_total=16, config={"qk_mask": "auto"})
    assert not any("not in the final model" in ln for ln in decision_lines(Summary.new(decisions={"dcs": kept})))


def test_report_with_an_eval_limit_uses_the_same_images_everywhere(ref, tmp_path):
    """``data.eval_limit``: the table and the decisions line give the dense base's accuracy on the
    same images, with their count; the base's own (trained on all 200 test images) is labelled."""
    from dataclasses import replace
    from types import SimpleNamespace

    from nascompress.data import DataConfig
    from nascompress.pipeline.report_format import comparison_rows, decision_lines, models_note
    from nascompress.pipeline.report import write_summary

    cfg = load_config(ref["config"])
    cfg = replace(cfg, stages=replace(cfg.stages, tokens=None), export=None)
    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(ref["out"] / "config.yaml", out / "config.yaml")
    pipe = SimpleNamespace(
        cfg=cfg,
        out=out,
        source=str(ref["config"]),
        base_dir=ref["out"] / "base",
        storage=None,
        data=DataConfig(dataset="synthetic", eval_limit=50),
        steps=[],
        result_dir=lambda: ref["out"] / "final",
    )
    s = write_summary(pipe)
    assert s.dense.test_n == s.final.test_n == s.comparison.test_n == 50
    base = s.decisions.base
    assert (base.test_top1, base.test_n) == (s.dense.test_top1, 50)
    assert base.trained_test_n == 200
    assert s.to_dict() == json.loads((out / "summary.json").read_text())  # the record is the file
    rows = comparison_rows(s)
    assert rows[0][:2] == ("test top-1 (50 images)", f"{s.dense.test_top1:.2f}%")
    assert rows[2][3] == f"{s.comparison.flops_ratio:.3f}x the FLOPs" and "faster" in rows[5][3]
    line = next(ln for ln in decision_lines(s) if ln.startswith("base:"))
    assert f"test top-1 {s.dense.test_top1:.2f}% on 50 images" in line and "on 200 images" in line
    assert "The same 50 test images for both" in models_note(s) and str(ref["out"] / "base") in models_note(s)
    assert "The same 50 test images for both" in (out / "report.html").read_text()
    # the command's own output (the fixture's run: all 200 test images): counts, both runs, the convention
    text = ref["output"]
    assert "test top-1 (200 images)" in text and "x the FLOPs" in text and "x faster" in text
    assert any(
        f"dense base {ref['out'] / 'base'}; compressed {ref['out'] / 'final'}. The same 200 test images" in ln
        for ln in text.splitlines()
    )


def test_report_front_marks_the_picked_dense_and_final_models_and_the_goal(ref):
    """The study's front in the pipeline's report: the picked trial, the dense base, the final model
    and the goal line, each a named trace; nothing coloured by trial number."""
    import re

    s = json.loads((ref["out"] / "summary.json").read_text())
    picked = s["decisions"]["tokens"]["picked_trial"]
    for page in ((ref["out"] / "tokens" / "report.html").read_text(), (ref["out"] / "report.html").read_text()):
        figures = re.findall(r'Plotly\.newPlot\(\s*"(front-flops|pareto-objectives)",\s*(\[.*?\]),\s*\{', page, re.S)
        assert figures, "no front figure"
        div, data = figures[0]
        traces = json.loads(data)
        names = [t.get("name", "") for t in traces]
        assert f"picked: trial {picked}" in names and "Pareto front" in names, names
        assert any(n.startswith("dense base: 1x the FLOPs, test top-1") for n in names), names
        assert any(n.startswith(f"final model: {s['comparison']['flops_ratio']:.3f}x the FLOPs") for n in names)
        goal = next(t for t in traces if t.get("name") == "goal: <= 0.75x the dense FLOPs")
        assert goal["x"] == [0.75, 0.75] and goal["mode"] == "lines"
        assert all("colorbar" not in (t.get("marker") or {}) for t in traces)


def test_shipped_configs_by_name_from_another_directory_and_export_needs_onnx(tmp_path, monkeypatch):
    """`nascompress pipeline demo`: the shipped config by name (its space by name too), validated from
    a directory without a checkout; an export section without ONNX Runtime is refused before anything runs."""
    import importlib.util

    monkeypatch.chdir(tmp_path)
    (tmp_path / "demo").mkdir()  # a folder of that name here (the output of `pipeline demo --out demo`)
    p = plan("demo", out=tmp_path / "x")
    assert p.source == str(REPO / "nascompress" / "configs" / "demo.yaml") and p.cfg.data.dataset == "digits"
    assert p.cfg.stages.tokens.space == str(REPO / "nascompress" / "search_spaces" / "evit.yaml")
    assert [s.name for s in p.steps] == list(STEPS) and not (tmp_path / "x").exists()
    with pytest.raises(
        NascompressError,
        match=r"config file nope does not exist: give a YAML file or the name of "
        r"a shipped config file \(demo, dinov2-fashion-mnist, fashion-mnist, fashion-mnist-latency\)",
    ):
        plan("nope", out=tmp_path / "x")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda m, *a: None if m == "onnxruntime" else real(m, *a))
    with pytest.raises(
        NascompressError,
        match=r"demo.yaml: export: format onnx needs onnxruntime: pip install "
        r"'nascompress\[export\]'",
    ):
        plan("demo", out=tmp_path / "x")


def test_the_demo_runs_when_tokens_alone_cannot_reach_the_goal(tmp_path):
    """The shipped demo (4 blocks: EViT alone cannot reach 0.6x on the dense base): the token study on the
    dense base is skipped with its reason, the pick comes from the DCS model's study, the goal is met."""
    out = tmp_path / "out"
    r = invoke("pipeline", "demo", "--out", out)
    assert r.exit_code == 0, r.output
    pick = json.loads((out / "tokens" / "pick.json").read_text())
    assert pick["picked_study"] == "pipeline" and set(pick["candidates"]) == {"pipeline"}
    assert "no token-only model reaches the goal on the dense base" in pick["dense_skipped"]
    s = json.loads((out / "summary.json").read_text())
    assert s["goal"]["met"] and "where to cut:" in (out / "report.html").read_text()
