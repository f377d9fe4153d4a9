"""The adversarial round of issue 53: nothing of the user's overwritten, every file read checked,
every number bounded, no advice that fails, nothing left behind.

Each test fails on the code before the fix.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from nascompress.errors import NascompressError

from .conftest import invoke
from .test_reliability import one_line, plain_model_dir


def _copy_run(tiny_run: Path, dst: Path) -> Path:
    shutil.copytree(tiny_run, dst)
    return dst


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


# ---------------------------------------------------------------------------------------------
# 1. An output that is or contains an input is refused, even with --force


def test_an_output_that_is_or_holds_an_input_is_refused_even_with_force(tmp_path, tiny_run):
    base = _copy_run(tiny_run, tmp_path / "runs" / "base")
    before = _files(base)
    for out in (base, tmp_path / "runs", tmp_path):
        r = invoke("finetune", base, "--method", "evit", "--zero-shot", "--out", out, "--force")
        msg = one_line(r, f"--out {out} ")
        assert ("is the command's input" if out == base else "contains the command's input") in msg
        assert "choose another --out" in msg
    assert _files(base) == before
    # export: neither the model file nor its arch.json (the sidecar is OUT.json) is replaced
    for out in (base / "model.safetensors", base / "arch"):
        r = invoke("export", base, "--out", out, "--force")
        one_line(r, "is the command's input")
    assert _files(base) == before
    # a train whose --out holds its dataset folder
    from .test_reliability import TINY, folder

    data = folder(tmp_path / "proj" / "data", {"a": 4, "b": 4})
    r = invoke("train", "--dataset", data, "--out", tmp_path / "proj", "--force", *TINY)
    one_line(r, f"contains the command's input {data}")
    assert (data / "train").is_dir()


def test_the_dashboard_refuses_writable_sqlite_saying_why(tmp_path):
    from nascompress.studies import run_study
    from nascompress.studies.dashboard import start_dashboard

    from .study_toys import SPACE_INFO, TWO, toy_factory

    storage = f"sqlite:///{tmp_path}/s.db"
    run_study(
        study_name="d",
        storage=storage,
        n_trials=1,
        objective_factory=toy_factory,
        space_info=SPACE_INFO,
        progress=False,
        **TWO,
    )
    with pytest.raises(NascompressError, match="writable cannot change SQLite storage .* snapshot copy"):
        start_dashboard("d", storage=storage, writable=True)
    one_line(invoke("study", "dashboard", "d", "--storage", storage, "--writable"), "leave out --writable")
    with start_dashboard("d", storage=storage) as h:  # the advice works: read-only, served
        assert h.snapshot is not None and not h.writable
    assert not list(tmp_path.glob(".s.db.dashboard-*"))


# ---------------------------------------------------------------------------------------------
# 2. arch.json's input section is checked


@pytest.mark.parametrize(
    "key,value,words",
    [
        ("img_size", [3000, 3000], "img_size is [3000, 3000] but the model takes [16, 16]"),
        ("img_size", [100000, 100000], "img_size is [100000, 100000] but the model takes [16, 16]"),
        ("img_size", [32, 32], "img_size is [32, 32] but the model takes [16, 16]"),
        ("img_size", [16, "x"], "img_size must be [H, W] of positive integers"),
        ("in_chans", 3, "in_chans is 3 but the model (and its weights) take 1 channels"),
        ("mean", [float("nan")], "mean must be a list of 1 or 1 (in_chans) finite numbers"),
        ("std", [0.0], "std values must be positive"),
        ("std", [1.0, 2.0], "std must be a list of 1 or 1 (in_chans) finite numbers"),
    ],
)
def test_the_input_section_of_arch_json_is_checked(tmp_path, key, value, words):
    import nascompress

    d = plain_model_dir(tmp_path / "m")
    arch = json.loads((d / "arch.json").read_text())
    arch["input"][key] = value
    (d / "arch.json").write_text(json.dumps(arch))
    with pytest.raises(NascompressError, match="arch.json: input ") as e:
        nascompress.load(d)
    assert words in str(e.value) and "\n" not in str(e.value)
    one_line(invoke("evaluate", d, "--dataset", "synthetic", "--device", "cpu"), words)


def test_a_dynamic_size_model_takes_multiples_of_its_patch_within_the_token_limit():
    from nascompress.data.input import check_input_section

    model = {"img_size": (16, 16), "patch_size": (4, 4), "in_chans": 1, "prefix": 1, "dynamic": True}
    inp = {"img_size": [24, 32], "in_chans": 1, "mean": [0.5], "std": [0.5]}
    check_input_section(inp, source="a", model=model)
    with pytest.raises(NascompressError, match="not a multiple of the model's patch size"):
        check_input_section(dict(inp, img_size=[30, 32]), source="a", model=model)
    with pytest.raises(NascompressError, match="tokens per image is 6,250,001, above the limit"):
        check_input_section(dict(inp, img_size=[10000, 10000]), source="a", model=model)


# ---------------------------------------------------------------------------------------------
# 3. Search-space files: bounded, steps checked, values the methods accept


_SPACE = "format: nascompress-space/1\nname: t\nmethods:\n  - name: {method}\n    params:\n      {params}\n"


@pytest.mark.parametrize(
    "method,params,words",
    [
        (
            "evit",
            "prune_layers: {kind: layers, range: [1, 1000000000], size: [1, 1000000]}",
            "prune_layers.range: layer 1,000,000,000 is beyond the deepest model nascompress builds (256 blocks",
        ),
        ("evit", "prune_layers: {kind: layers, candidates: [1, 999999999], size: 1}", "layer 999,999,999 is beyond"),
        (
            "evit",
            "keep_rate: {kind: float, low: 0.3, high: 1.0, step: 1.0e-300}",
            "keep_rate.step: step 1e-300 gives 7.00e+299 values from 0.3 to 1.0, more than the 1,000,000",
        ),
        ("evit", "keep_rate: {kind: float, low: 0.3, high: .inf}", "keep_rate.high: must be a number, got inf"),
        ("tome", "r: {kind: int, low: 0, high: 100000000000}", "the range gives 100,000,000,001 values"),
        (
            "tome",
            "r: {kind: int, low: -5, high: 2}",
            "params.r: r may take -5, which tome refuses: r must be a whole number of tokens >= 0",
        ),
        ("tome", "r: {kind: categorical, choices: [2, -1]}", "r may take -1, which tome refuses"),
        ("evit", "keep_rate: 1.5", "keep_rate may take 1.5, which evit refuses"),
    ],
)
def test_a_search_space_is_bounded_and_checked_when_loaded(tmp_path, method, params, words):
    from nascompress.studies.space_model import load_space

    f = tmp_path / "s.yaml"
    f.write_text(_SPACE.format(method=method, params=params))
    with pytest.raises(NascompressError) as e:
        load_space(f)
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_combination_refused_with_another_default_is_left_to_the_trial(tmp_path):
    from nascompress.studies.space_model import load_space

    load_space(Path(__file__).parent.parent / "search_spaces" / "mgvit-h.yaml")  # r_neg 0.1 with r_pos's 1.0


# ---------------------------------------------------------------------------------------------
# 4. Deep or huge JSON/YAML: one bounded reader, one line


def _deep(n: int) -> str:
    return "[" * n + "]" * n


def test_deep_or_huge_files_are_one_line(tmp_path, monkeypatch):
    import nascompress
    from nascompress.runs.json_io import nesting_depth, parse_json, read_json

    d = plain_model_dir(tmp_path / "m")
    (d / "arch.json").write_text('{"format": ' + _deep(1_000_000) + "}")
    with pytest.raises(NascompressError, match="arch.json nests deeper than 100 levels .*max_json_depth"):
        nascompress.load(d)
    one_line(invoke("evaluate", d, "--dataset", "synthetic"), "nests deeper than 100 levels")
    # 150 levels: within the parser's stack, above the limit (recursive readers would be next)
    with pytest.raises(NascompressError, match="nests deeper than 100 levels"):
        parse_json(_deep(150), source="x")
    monkeypatch.setenv("NASCOMPRESS_MAX_JSON_DEPTH", "200")
    assert nesting_depth(parse_json(_deep(150), source="x")) == 150  # the limit raised: read
    monkeypatch.delenv("NASCOMPRESS_MAX_JSON_DEPTH")
    monkeypatch.setenv("NASCOMPRESS_MAX_FILE_BYTES", "1000")
    (tmp_path / "big.json").write_text("[" + "0," * 1000 + "0]")
    with pytest.raises(NascompressError, match="big.json's size in bytes is 2,003, above the limit of 1,000"):
        read_json(tmp_path / "big.json")
    monkeypatch.delenv("NASCOMPRESS_MAX_FILE_BYTES")
    for bad, kind in ((tmp_path, "a directory"), (Path("/dev/zero"), "a device or socket")):  # never read to the end
        with pytest.raises(NascompressError, match=f"is {kind}, not a regular file"):
            read_json(bad)


def test_a_deep_config_json_or_checkpoint_metadata_is_one_line(tmp_path):
    from safetensors.torch import save_file

    from nascompress.runs.checkpoint import load_state

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(_deep(1_000_000))
    one_line(invoke("train", "--resume", "--out", run), "config.json nests deeper than 100 levels")
    import torch

    save_file({"a": torch.zeros(1)}, str(tmp_path / "c.safetensors"), metadata={"nascompress_state": _deep(100_000)})
    with pytest.raises(NascompressError, match="c.safetensors's metadata nests deeper than 100 levels"):
        load_state(tmp_path / "c.safetensors")


def test_a_deep_yaml_past_a_raised_limit_is_one_line(tmp_path, monkeypatch):
    from nascompress.studies.space_model import load_space

    f = tmp_path / "s.yaml"
    f.write_text("a: " + "[" * 5000 + "]" * 5000 + "\n")
    monkeypatch.setenv("NASCOMPRESS_MAX_YAML_DEPTH", "100000")
    with pytest.raises(NascompressError, match="nested too deeply for the YAML parser"):
        load_space(f)


# ---------------------------------------------------------------------------------------------
# 5. Damaged run files: a half-written last log line is dropped; the rest is one line


def _interrupted_train(out: Path) -> None:
    from nascompress.train.hooks import TrainHooks
    from nascompress.train.run import train

    from .conftest import interrupted_at_epoch
    from .test_reliability import _train_job

    with interrupted_at_epoch(TrainHooks, at=1), pytest.raises(KeyboardInterrupt):
        train(_train_job(out))


def test_a_half_written_last_log_line_does_not_stop_resume(tmp_path):
    out = tmp_path / "run"
    _interrupted_train(out)
    with open(out / "log.jsonl", "a") as f:
        f.write('{"epoch": 2, "lr": 0.00')  # a kill during the per-epoch append
    r = invoke("train", "--resume", "--out", out)
    assert r.exit_code == 0, r.output
    assert "dropping the half-written last line" in r.stderr
    epochs = [json.loads(ln)["epoch"] for ln in (out / "log.jsonl").read_text().splitlines()]
    assert epochs == [0, 1, 2] and json.loads((out / "metrics.json").read_text())["finished"] is True


def test_a_damaged_log_line_before_the_last_is_one_line(tmp_path):
    out = tmp_path / "run"
    _interrupted_train(out)
    (out / "log.jsonl").write_text('{"epoch": 1, "lr"\n' + (out / "log.jsonl").read_text())
    one_line(invoke("train", "--resume", "--out", out), "is damaged before its last line: delete it")
    (out / "log.jsonl").unlink()  # the advice works: the resumed run starts a new log
    assert invoke("train", "--resume", "--out", out).exit_code == 0


def _rewrite_checkpoint(path: Path, edit) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(path), "pt") as f:
        meta = dict(f.metadata())
    tensors = load_file(str(path))
    skeleton = json.loads(meta["nascompress_state"])
    edit(tensors, skeleton)
    save_file(tensors, str(path), metadata={"nascompress_state": json.dumps(skeleton)})


@pytest.mark.parametrize(
    "damage,words",
    [
        (
            "config",
            "config.json is not the record of a 'nascompress train' run (damaged or edited): it holds a JSON "
            "list, not an object",
        ),
        ("missing", "is damaged (its tensor '/model/head.bias' is missing"),
        ("epoch", "is damaged (its epoch is 'x', not an integer)"),
        ("shape", "is damaged: head.bias has shape (7,) in the file but (10,) in the model"),
    ],
)
def test_damaged_run_files_are_one_line_on_resume(tmp_path, damage, words):
    import torch

    out = tmp_path / "run"
    _interrupted_train(out)
    ckpt = out / "checkpoint.safetensors"
    if damage == "config":
        (out / "config.json").write_text("[1, 2, 3]")
    elif damage == "missing":
        _rewrite_checkpoint(ckpt, lambda t, s: t.pop("/model/head.bias"))
    elif damage == "epoch":
        _rewrite_checkpoint(ckpt, lambda t, s: s["__dict__"].__setitem__("epoch", "x"))
    else:
        _rewrite_checkpoint(ckpt, lambda t, s: t.__setitem__("/model/head.bias", torch.zeros(7)))
    msg = one_line(invoke("train", "--resume", "--out", out), words)
    if damage == "config":  # the advice works: the command again with --force starts over
        from .test_reliability import TINY

        assert "rerun 'nascompress train' with --force to start over" in msg
        assert invoke("train", "--out", out, "--dataset", "synthetic", *TINY, "--force").exit_code == 0
    else:
        assert "delete it" in msg
        ckpt.unlink()  # the advice works: --resume then starts the run over
        assert invoke("train", "--resume", "--out", out).exit_code == 0


# ---------------------------------------------------------------------------------------------
# 6. Every count, size and iteration option is bounded (nascompress.limits)


@pytest.mark.parametrize(
    "args,words",
    [
        (
            ["train", "--out", "{o}/t", "--dataset", "synthetic", "--epochs", "1000000000000"],
            "--epochs must be an integer in [1, 10000], got 1000000000000",
        ),
        (["train", "--out", "{o}/t", "--dataset", "synthetic", "--lr", "1e300"], "--lr must be in (0, 10], got 1e+300"),
        (
            ["train", "--out", "{o}/t", "--dataset", "synthetic", "--batch-size", "1000000000"],
            "--batch-size must be an integer in [1, 65536]",
        ),
        (["profile", "{run}", "--batch-size", "1000000000"], "--batch-size must be an integer in [1, 65536]"),
        (["profile", "{run}", "--iters", "1000000000000"], "--iters must be an integer in [1, 100000]"),
        (
            ["export", "{run}", "--out", "{o}/m.onnx", "--batch", "1000000000"],
            "batch must be 'dynamic' or an integer in [1, 65536]",
        ),
        (
            ["export", "{run}", "--out", "{o}/m.onnx", "--verify-batch", "1000000000"],
            "--verify-batch must be an integer in [1, 65536]",
        ),
        (
            [
                "search",
                "tokens",
                "{run}",
                "--space",
                "search_spaces/evit.yaml",
                "--study",
                "s",
                "--storage",
                "sqlite:///{o}/s.db",
                "--latency-iters",
                "1000000000000",
            ],
            "--latency-iters must be an integer in [1, 100000]",
        ),
        (
            [
                "search",
                "tokens",
                "{run}",
                "--space",
                "search_spaces/evit.yaml",
                "--study",
                "s",
                "--storage",
                "sqlite:///{o}/s.db",
                "--finetune-epochs",
                "1000000000",
            ],
            "--finetune-epochs must be an integer in [0, 10000]",
        ),
    ],
)
def test_count_size_and_iteration_options_are_bounded(tmp_path, tiny_run, args, words):
    r = invoke(*[a.format(o=tmp_path, run=tiny_run) for a in args])
    one_line(r, words)
    assert not any(tmp_path.iterdir())  # refused before anything is written


def test_the_option_bounds_are_stated_in_limits():
    import dataclasses

    from nascompress import limits
    from nascompress.profiling.config import ProfileConfig
    from nascompress.studies.trials import SearchJob
    from nascompress.train.config import TrainConfig

    for cls, name, bound in (
        (TrainConfig, "epochs", "epochs"),
        (TrainConfig, "lr", "lr"),
        (TrainConfig, "batch_size", "batch"),
        (ProfileConfig, "iters", "iters"),
        (SearchJob, "latency_iters", "iters"),
        (SearchJob, "workers", "workers"),
    ):
        f = next(f for f in dataclasses.fields(cls) if f.name == name)
        assert f.metadata["hi"] == limits.OPTION_BOUNDS[bound], (cls, name)


# ---------------------------------------------------------------------------------------------
# 7. Concurrency: two processes creating one new SQLite study at once


def _create_at_once(url: str, barrier, results) -> None:
    from nascompress.studies.opening import open_study
    from nascompress.studies.records import StudyInfo
    from nascompress.studies.storage_url import parse_storage

    barrier.wait()
    try:
        study, created = open_study(
            parse_storage(url),
            study_name="s",
            directions=["maximize"],
            metric_names=["accuracy"],
            info=StudyInfo.new(space_hash="h"),
            enqueue=[{"x": 1}],
        )
        results.put(("ok", created, len(study.trials)))
    except BaseException as e:  # noqa: BLE001 (reported to the parent)
        results.put(("error", f"{type(e).__name__}: {e}", 0))


def test_two_processes_creating_one_new_sqlite_study_both_succeed(tmp_path):
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    for attempt in range(3):
        url = f"sqlite:///{tmp_path}/s{attempt}.db"
        barrier, results = ctx.Barrier(2), ctx.Queue()
        procs = [ctx.Process(target=_create_at_once, args=(url, barrier, results)) for _ in range(2)]
        for p in procs:
            p.start()
        got = sorted(results.get(timeout=120) for _ in procs)
        for p in procs:
            p.join(timeout=60)
        assert [g[0] for g in got] == ["ok", "ok"], got
        assert sorted(g[1] for g in got) == [False, True] and all(g[2] == 1 for g in got), got  # one enqueued trial


# ---------------------------------------------------------------------------------------------
# 8. Wrong acceptances


def test_objective_flops_with_a_constraint_is_refused(tmp_path, tiny_run):
    r = invoke(
        "search",
        "tokens",
        tiny_run,
        "--study",
        "s",
        "--storage",
        f"sqlite:///{tmp_path}/s.db",
        "--objective",
        "flops",
        "--max-flops",
        "0.8",
    )
    one_line(r, "--objective flops is a Pareto front; with --max-flops or --max-latency the study is single-objective")
    from nascompress.studies.trials import SearchJob

    job = SearchJob(base="b", space="s.yaml", study="s", max_flops=0.8)
    old = dict(job.to_dict(), objective="flops")  # a job recorded when the constraint overrode it
    assert SearchJob.from_record(old).objective == "goal"


def test_a_pipeline_whose_space_does_not_fit_its_base_writes_nothing(tmp_path):
    import yaml

    from .test_pipeline import REPO, tiny_config

    cfg = tiny_config()
    cfg["stages"] = {"tokens": dict(cfg["stages"]["tokens"], space=str(REPO / "search_spaces" / "mgvit-h.yaml"))}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(cfg))
    out = tmp_path / "out"
    one_line(
        invoke("pipeline", tmp_path / "p.yaml", "--out", out),
        "method mgvit-h needs a pyramid ViT (PVT v2), and the base model is a plain ViT",
    )
    assert not out.exists()


def test_a_study_is_bound_to_its_base_model(tmp_path, tiny_run):
    from nascompress.data import DataConfig
    from nascompress.models.build import custom_vit_spec
    from nascompress.train.config import TrainConfig
    from nascompress.train.run import TrainJob, train

    from .conftest import TINY_EVIT_SPACE

    (tmp_path / "space.yaml").write_text(TINY_EVIT_SPACE)
    base = _copy_run(tiny_run, tmp_path / "base")
    other = tmp_path / "other"  # the same architecture, other weights
    train(
        TrainJob(
            model=custom_vit_spec(
                img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=10, in_chans=1
            ),
            data=DataConfig(dataset="synthetic"),
            train=TrainConfig(epochs=1, batch_size=32, lr=2e-3, seed=1),
            out=str(other),
        )
    )
    storage = f"sqlite:///{tmp_path}/s.db"
    common = [
        "--space",
        tmp_path / "space.yaml",
        "--storage",
        storage,
        "--study",
        "s1",
        "--eval-images",
        "20",
        "--train-images",
        "20",
        "--calib-steps",
        "0",
        "--no-enqueue",
        "--device",
        "cpu",
    ]
    r = invoke("search", "tokens", base, *common, "--trials", "1")
    assert r.exit_code == 0, r.output
    r = invoke("search", "tokens", other, *common, "--trials", "2")
    msg = r.stderr.strip().splitlines()[-1]  # after the space's summary line
    assert r.exit_code == 1 and msg.startswith("error: study 's1' in ") and "Traceback" not in r.output
    assert "was made on base model" in msg and "another model; a study keeps its base model" in msg
    copy = _copy_run(base, tmp_path / "copy")  # the same model elsewhere: the study continues
    r = invoke("search", "tokens", copy, *common, "--trials", "2")
    assert r.exit_code == 0, r.output
    # the base replaced in place: materialize names it, not "another machine"
    shutil.rmtree(base)
    shutil.copytree(other, base)
    r = invoke("materialize", "--study", "s1", "--storage", storage, "--trial", "0", "--out", tmp_path / "m")
    msg = one_line(r, "is not the model the study was made on")
    assert "another machine" not in msg and not (tmp_path / "m").exists()


# ---------------------------------------------------------------------------------------------
# 9. Advice after Ctrl-C that works, and no leftovers


def _interrupt(*a, **k):
    raise KeyboardInterrupt


def test_ctrl_c_in_train_advises_the_resume_that_continues_it(tmp_path):
    import shlex

    from nascompress.train.hooks import TrainHooks

    from .conftest import interrupted_at_epoch
    from .test_reliability import TINY

    out = tmp_path / "run"
    with interrupted_at_epoch(TrainHooks, at=1):
        r = invoke("train", "--out", out, "--dataset", "synthetic", *TINY)
    assert r.exit_code == 130
    advice = r.stderr.strip().splitlines()[-1]
    assert advice.startswith(
        "interrupted; the last finished epoch is checkpointed: continue with 'nascompress train --resume --out"
    ), advice
    cmd = shlex.split(advice.split("continue with ", 1)[1].strip("'"))
    assert cmd[:2] == ["nascompress", "train"]
    r = invoke(*cmd[1:])  # the advice, run
    assert r.exit_code == 0, r.output
    assert json.loads((out / "metrics.json").read_text())["finished"] is True


def test_ctrl_c_in_export_advises_no_resume_and_the_rerun_works(tmp_path, tiny_run, monkeypatch):
    import nascompress.deploy.run as export_run

    out = tmp_path / "m.pt2"
    with monkeypatch.context() as m:
        m.setattr(export_run, "verify", _interrupt)
        r = invoke("export", tiny_run, "--out", out, "--format", "torch-export")
    assert r.exit_code == 130
    advice = r.stderr.strip().splitlines()[-1]
    assert "--resume" not in advice and "rerun the command" in advice, advice
    assert not list(tmp_path.iterdir())  # nothing written
    assert invoke("export", tiny_run, "--out", out, "--format", "torch-export").exit_code == 0  # the advice, run


def test_ctrl_c_in_a_study_advises_rerunning_it(tmp_path, tiny_run, monkeypatch):
    import nascompress.studies.trials as trials

    from .conftest import TINY_EVIT_SPACE

    (tmp_path / "space.yaml").write_text(TINY_EVIT_SPACE)
    args = [
        "search",
        "tokens",
        tiny_run,
        "--space",
        tmp_path / "space.yaml",
        "--storage",
        f"sqlite:///{tmp_path}/s.db",
        "--study",
        "s",
        "--eval-images",
        "20",
        "--train-images",
        "20",
        "--calib-steps",
        "0",
        "--no-enqueue",
        "--device",
        "cpu",
        "--trials",
        "2",
    ]
    with monkeypatch.context() as m:
        m.setattr(trials, "build_trial", _interrupt)
        r = invoke(*args)
    assert r.exit_code == 130
    advice = r.stderr.strip().splitlines()[-1]
    assert "--resume" not in advice and "rerun the same command to continue it" in advice, advice
    r = invoke(*args)  # the advice, run
    assert r.exit_code == 0, r.output


def test_export_and_quantize_leave_nothing_outside_out_and_clear_a_killed_run(tmp_path, tiny_run, monkeypatch):
    import nascompress.deploy.quantize as quantize

    out = tmp_path / "q"  # quantize --out DIR writes DIR/model.int8.onnx
    out.mkdir()
    # what kill -9 left: atomic-write temp files and quantize's work folder beside the output
    (out / ".model.int8.onnx.abc123.tmp").write_bytes(b"x")
    (out / ".model.int8.onnx.json.def456.tmp").write_bytes(b"x")
    (out / ".model.int8.onnx.quantize-xyz").mkdir()
    (out / ".model.int8.onnx.quantize-xyz" / "fp32.onnx").write_bytes(b"x")
    seen = []

    def spy(src, dst, **kw):
        seen.append(Path(src).parent)
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(quantize, "quantize_file", spy)
        r = invoke("quantize", tiny_run, "--out", out)
    assert r.exit_code == 130 and "--resume" not in r.stderr
    assert seen and seen[0].parent == out and seen[0].name.startswith(".model.int8.onnx.quantize-")
    assert not list(out.iterdir())  # the killed run's leftovers and its own work folder are gone
    onnx = tmp_path / "e" / "m.onnx"
    onnx.parent.mkdir()
    (onnx.parent / ".m.onnx.zz9.tmp").write_bytes(b"x")
    assert invoke("export", tiny_run, "--out", onnx).exit_code == 0
    assert sorted(p.name for p in onnx.parent.iterdir()) == ["m.onnx", "m.onnx.json"]


# ---------------------------------------------------------------------------------------------
# 10. Minor: file-size limit, WORLD_SIZE without torchrun, finished_files, examples, --weights kinds


def test_the_file_size_limit_during_export_is_named(tmp_path, tiny_run):
    import resource
    import subprocess
    import sys

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (20 * 1024, 20 * 1024))

    out = tmp_path / "e" / "m.onnx"
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            "from nascompress.cli.main import app; app()",
            "export",
            str(tiny_run),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        preexec_fn=small_files,
        timeout=300,
        env={**__import__("os").environ, "NASCOMPRESS_PROGRESS": "off"},
    )
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert "the file size limit of this shell (ulimit -f) is exceeded; raise it (ulimit -f unlimited)" in lines[0]
    assert not out.parent.exists() or not list(out.parent.iterdir())


def test_world_size_without_torchrun_is_one_line(tmp_path, monkeypatch):
    from .test_reliability import TINY

    monkeypatch.setenv("WORLD_SIZE", "2")
    for v in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(v, raising=False)
    one_line(
        invoke("train", "--out", tmp_path / "r", "--dataset", "synthetic", *TINY),
        "WORLD_SIZE=2 is set but RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT are not: the command was not started "
        "by torchrun; unset WORLD_SIZE to run in one process",
    )
    monkeypatch.setenv("WORLD_SIZE", "two")
    one_line(invoke("train", "--out", tmp_path / "r", "--dataset", "synthetic", *TINY), "WORLD_SIZE='two' is not")
    monkeypatch.delenv("WORLD_SIZE")  # the advice, run
    assert invoke("train", "--out", tmp_path / "r", "--dataset", "synthetic", *TINY).exit_code == 0


def test_a_completion_mark_naming_a_file_outside_the_run_is_refused(tmp_path, tiny_run):
    import nascompress

    run = _copy_run(tiny_run, tmp_path / "run")
    (tmp_path / "x").write_bytes(b"secret")
    m = json.loads((run / "metrics.json").read_text())
    m["finished_files"]["../x"] = {"bytes": 6, "sha256": "0" * 64}
    (run / "metrics.json").write_text(json.dumps(m))
    with pytest.raises(NascompressError, match="its completion mark names '../x', not a file of the run"):
        nascompress.load(run)


def test_the_example_of_a_refused_per_layer_value_is_valid(tmp_path, tiny_run):
    import re

    msg = one_line(
        invoke("finetune", tiny_run, "--method", "tome", "--r", "1.5", "--zero-shot", "--out", tmp_path / "a"),
        "--r takes one integer or comma-separated integers, e.g. 8",
    )
    example = re.search(r"e\.g\. (\S+?),", msg).group(1)
    r = invoke("finetune", tiny_run, "--method", "tome", "--r", example, "--zero-shot", "--out", tmp_path / "b")
    assert r.exit_code == 0, r.output  # the example, run
    msg = one_line(
        invoke("finetune", tiny_run, "--method", "evit", "--keep-rate", "x", "--zero-shot", "--out", tmp_path / "c"),
        "--keep-rate takes one number",
    )
    example = re.search(r"e\.g\. (\S+?),", msg).group(1)
    r = invoke("finetune", tiny_run, "--method", "evit", "--keep-rate", example, "--zero-shot", "--out", tmp_path / "d")
    assert r.exit_code == 0, r.output


def test_weights_that_are_no_regular_file_are_named(tmp_path):
    import os

    from .test_reliability import TINY

    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    for path, kind in (
        (tmp_path / "dir", "a directory"),
        (tmp_path / "fifo", "a named pipe (FIFO)"),
        (Path("/dev/zero"), "a device or socket"),
    ):
        one_line(
            invoke("train", "--out", tmp_path / "r", "--dataset", "synthetic", "--weights", path, *TINY),
            f"weights file {path} is {kind}, not a regular file",
        )
    one_line(
        invoke("train", "--out", tmp_path / "r", "--dataset", "synthetic", "--weights", tmp_path / "none", *TINY),
        "does not exist",
    )


def test_a_study_export_or_report_never_replaces_the_study_file(tmp_path):
    from nascompress.studies import run_study

    from .study_toys import SPACE_INFO, TWO, toy_factory

    db = tmp_path / "s.db"
    run_study(
        study_name="s",
        storage=f"sqlite:///{db}",
        n_trials=1,
        objective_factory=toy_factory,
        space_info=SPACE_INFO,
        progress=False,
        **TWO,
    )
    before = db.read_bytes()
    one_line(
        invoke("study", "export", "s", "--storage", f"sqlite:///{db}", "--out", db, "--force"), "is the command's input"
    )
    one_line(
        invoke("study", "report", "s", "--storage", f"sqlite:///{db}", "--out", db, "--force"), "is the command's input"
    )
    assert db.read_bytes() == before


def test_an_allocation_failure_is_one_line(tiny_run, monkeypatch):
    import nascompress.runs.io as nio

    def fail(*a, **k):
        raise RuntimeError(
            "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: "
            "you tried to allocate 6553600000000 bytes."
        )

    monkeypatch.setattr(nio, "check_finite", fail)
    msg = one_line(invoke("evaluate", tiny_run, "--dataset", "synthetic"), "error: out of memory (")
    assert "lower the batch size" in msg and "RuntimeError" not in msg
