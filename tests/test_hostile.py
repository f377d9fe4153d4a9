"""Hostile inputs (issue 37): nothing hangs, nothing eats memory, no open door.

Each test fails on the code before the fix: dataset symlink loops, a model file that would build
a huge model, the dashboard's binding and write API, the trial budget across workers, NaN
weights and a forged completion mark, ImageFolder oddities, out-of-range pipeline values,
file identity independent of the output path, full disks in export.
"""

from __future__ import annotations

import json
import os

import pytest

import nascompress
from nascompress.errors import NascompressError

from .conftest import invoke
from .test_reliability import TINY, folder, one_line, plain_model_dir


# ---------------------------------------------------------------------------------------------
# 1, 9. ImageFolder: symlink loops, hidden folders, linked classes, huge images


def test_a_dataset_with_symlink_loops_is_refused_at_once(tmp_path):
    root = folder(tmp_path / "data", {"a": 4, "b": 4})
    os.symlink("..", root / "train" / "a" / "up")
    os.symlink("../../train", root / "train" / "a" / "again")
    out = tmp_path / "run"
    one_line(invoke("train", "--dataset", root, "--out", out, *TINY), "a folder that contains it (a loop)")
    assert not out.exists()
    # a link to a folder elsewhere is followed (its images count once)
    os.remove(root / "train" / "a" / "up")
    os.remove(root / "train" / "a" / "again")
    extra = folder(tmp_path / "extra", {"x": 3}, splits=("train",))
    os.symlink(extra / "train" / "x", root / "train" / "a" / "more")
    from nascompress.data import DataConfig, load_data

    b = load_data(DataConfig(dataset=str(root), num_workers=0), img_size=(16, 16))
    assert len(b.train) == 8 + 3 and b.classes == ["a", "b"]
    # two links into one folder: its images would count twice
    os.symlink(extra / "train" / "x", root / "train" / "a" / "twice")
    with pytest.raises(NascompressError, match="two links to one folder"):
        load_data(DataConfig(dataset=str(root), num_workers=0), img_size=(16, 16))


def test_hidden_folders_are_no_class_and_a_linked_class_is_refused(tmp_path):
    from nascompress.data import DataConfig, load_data

    root = folder(tmp_path / "data", {"a": 4, "b": 4})
    ck = root / "train" / ".ipynb_checkpoints"
    ck.mkdir()
    (root / "train" / "a" / ".ipynb_checkpoints").mkdir()
    (root / "train" / "a" / ".ipynb_checkpoints" / "0-checkpoint.png").write_bytes(
        (root / "train" / "a" / "0.png").read_bytes()
    )
    b = load_data(DataConfig(dataset=str(root), num_workers=0), img_size=(16, 16))
    assert b.classes == ["a", "b"] and len(b.train) == 8
    r = invoke("train", "--dataset", root, "--out", tmp_path / "run", *TINY, "--epochs", "1")  # the CLI counts 2 too
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "run" / "arch.json").read_text())["model"]["kwargs"]["num_classes"] == 2
    os.symlink("a", root / "train" / "c")
    os.symlink("a", root / "val" / "c")
    with pytest.raises(NascompressError, match="class folders 'a' and 'c' of .* are the same folder"):
        load_data(DataConfig(dataset=str(root), num_workers=0), img_size=(16, 16))


def test_a_huge_image_is_refused_from_its_header(tmp_path, monkeypatch, recwarn):
    from PIL import Image

    root = folder(tmp_path / "data", {"a": 4, "b": 4})
    big = root / "train" / "b" / "big.png"
    Image.new("L", (400, 300)).save(big)
    monkeypatch.setenv("NASCOMPRESS_MAX_IMAGE_PIXELS", "100000")  # 400 x 300 = 120,000 pixels
    msg = one_line(invoke("train", "--dataset", root, "--out", tmp_path / "run", *TINY), f"image {big} (too large")
    assert "400x300 = 120,000 pixels, above the limit of 100,000" in msg and "NASCOMPRESS_MAX_IMAGE_PIXELS" in msg
    assert msg.startswith("error: image") and not (tmp_path / "run").exists()
    # above PIL's own bomb limit: one line too, no raw DecompressionBombWarning
    monkeypatch.delenv("NASCOMPRESS_MAX_IMAGE_PIXELS")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 50_000)
    from nascompress.data import scan_images

    bad = scan_images([str(big)])
    assert bad[str(big)].startswith("too large: more than 100,000 pixels")
    assert not [w for w in recwarn if "DecompressionBomb" in type(w.message).__name__]


# ---------------------------------------------------------------------------------------------
# 2. A model file cannot make nascompress build a huge model


@pytest.mark.parametrize(
    "key,value,what",
    [
        ("depth", 1_000_000, "depth (blocks) is 1,000,000, above the limit of 256"),
        ("embed_dim", 1_000_000, "parameter count is"),
        ("img_size", 100_000, "tokens per image is 625,000,001"),
    ],
)
def test_an_arch_json_with_a_huge_model_is_refused_before_building(tmp_path, key, value, what):
    d = plain_model_dir(tmp_path / "m")
    arch = json.loads((d / "arch.json").read_text())
    arch["model"]["kwargs"][key] = value
    (d / "arch.json").write_text(json.dumps(arch))
    with pytest.raises(NascompressError, match="above the limit") as e:
        nascompress.load(d)
    assert what in str(e.value) and str(d / "arch.json") in str(e.value) and "NASCOMPRESS_MAX_MODEL_" in str(e.value)
    one_line(invoke("evaluate", d, "--dataset", "synthetic"), what)


def test_the_model_size_limits_are_settings(monkeypatch):
    from nascompress.models.build import ModelSpec, build_model, custom_vit_spec, model_size

    spec = custom_vit_spec(img_size=16, patch_size=4, embed_dim=32, depth=3, num_heads=2, num_classes=10, in_chans=1)
    built = build_model(spec)
    n = sum(p.numel() for p in built.parameters())
    size = model_size(spec)
    assert size["depth"] == 3 and size["tokens"] == 17 and 0.9 * n <= size["params"] <= n
    assert model_size(ModelSpec("vit_base_patch16_224", {}))["params"] == pytest.approx(86.6e6, rel=0.01)
    monkeypatch.setenv("NASCOMPRESS_MAX_MODEL_DEPTH", "2")
    with pytest.raises(NascompressError, match="depth \\(blocks\\) is 3, above the limit of 2 \\(max_model_depth\\)"):
        build_model(spec)
    monkeypatch.setenv("NASCOMPRESS_MAX_MODEL_DEPTH", "many")
    with pytest.raises(NascompressError, match="NASCOMPRESS_MAX_MODEL_DEPTH='many' must be an integer >= 1"):
        build_model(spec)


# ---------------------------------------------------------------------------------------------
# 3, 10. The dashboard: loopback by default, public only when asked, read-only unless asked


def _request(port: int, method: str, path: str) -> tuple[int, bytes]:
    import http.client

    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        c.putrequest(method, path, skip_accept_encoding=True)  # as curl: no Accept-Encoding header
        c.endheaders()
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def test_the_dashboard_is_local_and_read_only_unless_asked(tmp_path, capfd):
    from nascompress.studies import run_study
    from nascompress.studies.dashboard import is_loopback, start_dashboard

    from .study_toys import SPACE_INFO, TWO, toy_factory

    storage = f"journal:{tmp_path}/s.journal"  # served live: a DELETE would delete the study itself
    run_study(
        study_name="d",
        storage=storage,
        n_trials=1,
        objective_factory=toy_factory,
        space_info=SPACE_INFO,
        progress=False,
        **TWO,
    )
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")
    for host in ("0.0.0.0", "::"):
        with pytest.raises(NascompressError, match="has no login.*pass expose to serve it"):
            start_dashboard("d", storage=storage, host=host)
    r = invoke("study", "dashboard", "d", "--storage", storage, "--host", "0.0.0.0")
    one_line(r, "could read the studies of its storage")
    with start_dashboard("d", storage=storage) as h:
        assert _request(h.port, "GET", "/static/bundle.js")[0] == 200  # was 500: KeyError HTTP_ACCEPT_ENCODING
        assert _request(h.port, "GET", "/favicon.ico")[0] == 200
        status, body = _request(h.port, "DELETE", "/api/studies/0")
        assert status == 403 and b"--writable" in body
        assert _request(h.port, "GET", "/api/studies")[0] == 200
    assert "KeyError" not in capfd.readouterr().err
    import optuna

    assert [
        s.study_name
        for s in optuna.get_all_study_summaries(
            optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(f"{tmp_path}/s.journal"))
        )
    ] == ["d"]
    with start_dashboard("d", storage=storage, writable=True) as h:
        assert _request(h.port, "DELETE", "/api/studies/0")[0] in (200, 204)


# ---------------------------------------------------------------------------------------------
# 4. The trial budget holds across workers


def test_a_trial_that_reaches_the_storage_last_is_the_surplus_one():
    """A journal client stamps its trial's start before it gets the file's lock: trial 3 may carry
    an earlier start than trial 2 although it reached the storage after it. Trial 2 checked while
    alone (ran); trial 3 sees two complete trials and trial 2 running: with n_trials 3 it must not
    run too (it did: ordered by start time it counted only the complete ones)."""
    import datetime as dt
    from types import SimpleNamespace

    from optuna.trial import TrialState

    from nascompress.studies.loop import _surplus

    t0 = dt.datetime(2026, 1, 1, 10, 0, 0)
    done = [SimpleNamespace(_trial_id=i, number=i, state=TrialState.COMPLETE, datetime_start=t0) for i in (0, 1)]
    first = SimpleNamespace(
        _trial_id=2, number=2, state=TrialState.RUNNING, datetime_start=t0 + dt.timedelta(seconds=2)
    )
    second = SimpleNamespace(
        _trial_id=3, number=3, state=TrialState.RUNNING, datetime_start=t0 + dt.timedelta(seconds=1)
    )

    class Seen:
        def __init__(self, trials):
            self.trials = trials

        def get_trials(self, deepcopy=False, states=None):
            return [t for t in self.trials if states is None or t.state in states]

    assert not _surplus(Seen(done + [first]), first, 3)  # the second was not in the storage yet
    assert _surplus(Seen(done + [first, second]), second, 3)
    assert not _surplus(Seen(done[:1] + [first, second]), second, 3)  # room for both


@pytest.mark.parametrize("workers", [2, 4])
def test_workers_never_complete_more_than_n_trials(tmp_path, monkeypatch, workers):
    """``workers`` workers (threads running the worker loop, each with its own storage connection)
    on one journal study, with a slowed objective, a slowed ask (the window in which several
    workers start the last trials at once) and a journal that writes a new trial a random moment
    after stamping its start (as on a loaded machine): exactly n_trials complete, the extra
    starts released."""
    import random
    import threading
    import time

    import optuna
    from optuna.trial import TrialState

    from nascompress.studies import loop, runner
    from nascompress.studies.records import SURPLUS_KEY
    from nascompress.studies.seeding import Seeding, default_sampler
    from nascompress.studies.storage_open import open_storage
    from nascompress.studies.storage_url import parse_storage

    from .study_toys import SPACE_INFO, TWO, toy_factory

    storage, n = f"journal:{tmp_path}/s.journal", 4  # 1 complete first: 3 slots for 2 or 4 workers in step
    run_study = runner.run_study
    run_study(
        study_name="w",
        storage=storage,
        n_trials=1,
        objective_factory=toy_factory,
        space_info=SPACE_INFO,
        progress=False,
        **TWO,
    )  # creates the study (one trial complete)
    real_ask = optuna.Study.ask

    def slow_ask(self, *a, **kw):
        time.sleep(0.05)
        return real_ask(self, *a, **kw)

    monkeypatch.setattr(optuna.Study, "ask", slow_ask)
    from optuna.storages.journal import _storage as journal

    real_write, rng = journal.JournalStorage._write_log, random.Random(workers)

    def late_write(self, op_code, extra_fields):
        if op_code == journal.JournalOperation.CREATE_TRIAL:
            time.sleep(rng.uniform(0, 0.1))
        return real_write(self, op_code, extra_fields)

    monkeypatch.setattr(journal.JournalStorage, "_write_log", late_write)
    cfg = runner.LoopConfig(
        n_trials=n, deadline=time.time() + 120, heartbeat_interval=0.2, grace_period=60.0, max_retries=2, max_failures=3
    )
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            st = open_storage(parse_storage(storage), create=False)
            study = optuna.load_study(study_name="w", storage=st, sampler=default_sampler(0))
            loop.work(study, toy_factory(sleep=0.1), cfg, Seeding(default_sampler, 0, k))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    with loop.quiet_optuna():
        threads = [threading.Thread(target=worker, args=(k,)) for k in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(150)
    assert not errors
    st = open_storage(parse_storage(storage), create=False)
    trials = optuna.load_study(study_name="w", storage=st).get_trials(deepcopy=False)
    assert sum(t.state == TrialState.COMPLETE for t in trials) == n
    assert all(t.system_attrs.get(SURPLUS_KEY) for t in trials if t.state == TrialState.PRUNED)
    assert not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.FAIL)]


# ---------------------------------------------------------------------------------------------
# 8. NaN weights are refused; the completion mark is typed and tied to the files


def test_nan_weights_are_refused_by_the_loader(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    d = plain_model_dir(tmp_path / "m")
    sd = load_file(str(d / "model.safetensors"))
    sd["blocks.0.attn.qkv.weight"][0, 0] = float("nan")
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(NascompressError, match="not finite \\(NaN or inf\\) in blocks.0.attn.qkv.weight"):
        nascompress.load(d)
    one_line(invoke("evaluate", d, "--dataset", "synthetic"), "not finite")
    assert torch.isnan(sd["blocks.0.attn.qkv.weight"]).any()


def test_the_completion_mark_is_typed_and_tied_to_its_files(tmp_path, tiny_run):
    import shutil

    from nascompress.runs.io import run_state

    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["finished"] is True and set(metrics["finished_files"]) == {"model.safetensors", "arch.json"}
    assert run_state(run) == "complete"
    for forged in ("yes", 1, "true"):
        (run / "metrics.json").write_text(json.dumps(dict(metrics, finished=forged)))
        assert run_state(run) == "unfinished"
        with pytest.raises(NascompressError, match="unfinished run"):
            nascompress.load(run)
    (run / "metrics.json").write_text(json.dumps(metrics))
    other = plain_model_dir(tmp_path / "other")
    shutil.copy(other / "model.safetensors", run / "model.safetensors")  # another model, same run files
    assert run_state(run) == "altered"
    msg = one_line(invoke("evaluate", run, "--dataset", "synthetic"), "is a finished run whose files changed since")
    assert "model.safetensors is not the file the run finished with: its size or sha256 differs" in msg
    shutil.copy(tiny_run / "model.safetensors", run / "model.safetensors")
    assert run_state(run) == "complete" and nascompress.load(run) is not None


# ---------------------------------------------------------------------------------------------
# 11. A model file's bytes do not depend on where its run was written


def test_the_same_retrain_in_two_folders_writes_the_same_model_file(tmp_path):
    from nascompress.runs.io import file_sha256

    from .test_retrain import make_model_dir

    import shutil

    # as two pipelines in two folders: OUT/tokens/picked retrained into OUT/final
    srcs = [make_model_dir(tmp_path / "a" / "picked"), tmp_path / "elsewhere" / "picked"]
    shutil.copytree(srcs[0], srcs[1])
    outs = [tmp_path / "a" / "final", tmp_path / "elsewhere" / "final"]
    for src, out in zip(srcs, outs):
        r = invoke(
            "retrain",
            src,
            "--out",
            out,
            "--dataset",
            "synthetic",
            "--epochs",
            "1",
            "--eta",
            "0",
            "--batch-size",
            "64",
            "--lr",
            "1e-3",
            "--train-limit",
            "64",
            "--eval-limit",
            "32",
            "--device",
            "cpu",
        )
        assert r.exit_code == 0, r.output
    assert str(srcs[0]) not in (outs[0] / "arch.json").read_text()
    assert file_sha256(outs[0] / "model.safetensors") == file_sha256(outs[1] / "model.safetensors")
    assert file_sha256(outs[0] / "arch.json") == file_sha256(outs[1] / "arch.json")
    # the provenance stays in the run's metadata
    assert json.loads((outs[1] / "metrics.json").read_text())["source_model"] == str(srcs[1])


# ---------------------------------------------------------------------------------------------
# 7. Pipeline values out of any sensible range are refused before anything is written


@pytest.mark.parametrize(
    "path,value,match",
    [
        (
            "stages.tokens.trials",
            1_000_000_000,
            "stages.tokens.trials: the value is 1,000,000,000, above the limit of 100,000 (max_trials)",
        ),
        ("seed", 10**23, "seed: must be an integer in [0, 4294967295], got 100000000000000000000000"),
        ("base.train.lr", float("inf"), "base.train.lr: must be a finite number, got inf"),
        ("stages.retrain.lr", float("nan"), "stages.retrain.lr: must be a finite number, got nan"),
    ],
)
def test_out_of_range_pipeline_values_are_one_line_and_write_nothing(tmp_path, path, value, match):
    from .test_pipeline import _bad, tiny_config, write_config

    cfg = write_config(tmp_path, _bad(tiny_config(), path, value))
    out = tmp_path / "out"
    one_line(invoke("pipeline", cfg, "--out", out), match)
    assert not out.exists()


def test_deeply_nested_yaml_is_one_line(tmp_path, monkeypatch):
    from .test_pipeline import tiny_config, write_config

    cfg = write_config(tmp_path, tiny_config())
    deep = tmp_path / "deep.yaml"
    deep.write_text(cfg.read_text() + "extra: " + "[" * 5000 + "]" * 5000 + "\n")
    out = tmp_path / "out"
    one_line(invoke("pipeline", deep, "--out", out), "nested deeper than 50 levels (the max_yaml_depth limit")
    assert not out.exists()
    space = tmp_path / "space.yaml"
    space.write_text("format: nascompress-space/1\nname: x\nmethods: " + "[" * 60 + "]" * 60 + "\n")
    from nascompress.studies.space_model import load_space

    with pytest.raises(NascompressError, match="nested deeper than 50 levels"):
        load_space(space)
    monkeypatch.setenv("NASCOMPRESS_MAX_YAML_DEPTH", "100")
    with pytest.raises(NascompressError) as e:
        load_space(space)
    assert "nested deeper" not in str(e.value)


def test_cli_and_library_values_out_of_range(tmp_path):
    from nascompress.studies.trials import SearchJob
    from nascompress.train.config import TrainConfig

    with pytest.raises(NascompressError, match="lr must be a finite number in \\(0, 10\\], got inf"):
        TrainConfig(lr=float("inf"))
    with pytest.raises(NascompressError, match="seed must be an integer in \\[0, 4294967295\\]"):
        TrainConfig(seed=2**32)
    with pytest.raises(NascompressError, match="trials is 1,000,000,000, above the limit of 100,000"):
        SearchJob(base="b", space="s", study="x", trials=10**9)
    one_line(
        invoke("train", "--out", tmp_path / "run", "--dataset", "synthetic", *TINY, "--seed", str(10**23)),
        "--seed must be an integer in [0, 4294967295]",
    )
    assert not (tmp_path / "run").exists()
    from nascompress.data import DataConfig

    with pytest.raises(NascompressError, match="seed must be an integer in"):  # import's and evaluate's --seed
        DataConfig(subset_seed=10**23)


# ---------------------------------------------------------------------------------------------
# 5. A full disk during export is one line, whatever the format


@pytest.mark.parametrize("fmt", ["onnx", "torch-export"])
def test_a_full_disk_during_export_is_one_line(tmp_path, monkeypatch, fmt):
    import errno
    import io

    import torch

    from .test_export import make_run

    run = make_run(tmp_path, ())
    seen = []

    def full(*a, **kw):  # what the exporter's write raises when the disk fills up
        seen.append(a[1] if len(a) > 1 else None)
        raise OSError(errno.ENOSPC, "No space left on device")

    if fmt == "onnx":
        monkeypatch.setattr(torch.onnx.ONNXProgram, "save", full)
    else:
        monkeypatch.setattr(torch.export, "save", full)
    out = tmp_path / "out" / ("m.onnx" if fmt == "onnx" else "m.pt2")
    msg = one_line(
        invoke("export", run, "--out", out, "--format", fmt),
        f"cannot write the export into {out.parent}: no space is left on its disk",
    )
    assert "graph" not in msg and "Errno" not in msg and "then run the export again" in msg
    assert not out.exists() and not list(out.parent.glob("*"))
    if fmt == "torch-export":  # serialized in memory: torch's C++ writer never meets the full disk
        assert isinstance(seen[0], io.BytesIO)


# ---------------------------------------------------------------------------------------------
# 6. After a full disk mid-run, the advice given is what works


def test_a_full_disk_mid_training_advises_what_continues_it(tmp_path, monkeypatch):
    from safetensors import SafetensorError

    import nascompress.runs.checkpoint as nckpt
    import nascompress.runs.io as nio

    real, calls = nio.save_file, []

    def fills_up(*a, **kw):  # the disk fills up once the first epoch's checkpoint is written
        calls.append(a[1])
        if any("checkpoint" in str(c) for c in calls[:-1]):
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real(*a, **kw)

    monkeypatch.setattr(nio, "save_file", fills_up)  # the model files
    monkeypatch.setattr(nckpt, "save_file", fills_up)  # the checkpoints
    out = tmp_path / "run"
    args = ["train", "--out", out, "--dataset", "synthetic", "--train-limit", "128", *TINY]
    msg = one_line(invoke(*args), "no space is left on its disk")
    assert f"then continue it with 'nascompress train --resume --out {out}'" in msg
    monkeypatch.setattr(nio, "save_file", real)
    monkeypatch.setattr(nckpt, "save_file", real)
    one_line(invoke(*args), "already exists")  # what the old advice ("rerun the command") led to
    r = invoke(*args, "--resume")  # what the advice says
    assert r.exit_code == 0, r.output
    assert nascompress.load(out) is not None
    # nothing to continue (the disk full before the run's config was written): --force, not --resume
    from nascompress.runs.io import continue_advice

    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "model.safetensors").write_bytes(b"")
    assert "with force (it replaces the unfinished" in continue_advice(tmp_path / "bare")  # the field, outside a CLI
    from nascompress.cli.common import option_of
    from nascompress.errors import wording

    with wording(option_of):  # as the CLI's run() calls the library: its option
        assert "with --force (it replaces the unfinished" in continue_advice(tmp_path / "bare")


# ---------------------------------------------------------------------------------------------
# 10. A pickle given as --weights: one line, no raw torch warning before it


def test_a_pickle_as_weights_is_one_line_without_a_torch_warning(tmp_path, recwarn):
    import pickle

    (tmp_path / "w.pkl").write_bytes(pickle.dumps({"w": [1, 2]}, protocol=4))
    out = tmp_path / "new"
    msg = one_line(
        invoke("train", "--out", out, "--dataset", "synthetic", "--weights", tmp_path / "w.pkl", *TINY),
        f"weights file {tmp_path / 'w.pkl'} is corrupt or not a weights file",
    )
    assert "never unpickles" in msg and not out.exists()
    assert not [w for w in recwarn if "pickle protocol" in str(w.message)]
