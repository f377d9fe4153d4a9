"""Reliability: model files are data, runs are complete only when marked so, bad datasets and
unwritable outputs are refused in one line, and leftovers of a killed run are recovered."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import nascompress
from nascompress.errors import NascompressError
from nascompress.runs.io import make_arch, save_model
from nascompress.models.build import ModelSpec, build_model, custom_vit_spec

from .conftest import invoke

SPEC = custom_vit_spec(img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2, num_classes=3, in_chans=1)
INPUT = {"img_size": [16, 16], "in_chans": 1, "mean": [0.5], "std": [0.5]}


def plain_model_dir(d: Path) -> Path:
    """model.safetensors + arch.json, as a user assembles them (no run files)."""
    save_model(d, build_model(SPEC), make_arch(SPEC, input_spec=INPUT))
    return d


# ---------------------------------------------------------------------------------------------
# arch.json's model settings are an allow-list


@pytest.mark.parametrize(
    "key,value,match",
    [
        ("checkpoint_path", "TEXT", "model setting 'checkpoint_path' is not one nascompress accepts"),
        ("pretrained_cfg_overlay", {"file": "x.bin"}, "model setting 'pretrained_cfg_overlay' is not one"),
        ("act_layer", "os.system", "model setting 'act_layer' is not one nascompress accepts"),
        ("img_size", "16", "model setting img_size must be a positive integer or \\[H, W\\], got '16'"),
        ("global_pool", "os.system", "model setting global_pool must be one of"),
        ("qkv_bias", "yes", "model setting qkv_bias must be true or false"),
    ],
)
def test_arch_json_model_settings_are_an_allow_list(tmp_path, key, value, match):
    d = plain_model_dir(tmp_path / "m")
    text = tmp_path / "notes.txt"
    text.write_text("not weights\n")
    arch = json.loads((d / "arch.json").read_text())
    arch["model"]["kwargs"][key] = str(text) if value == "TEXT" else value
    (d / "arch.json").write_text(json.dumps(arch))
    with pytest.raises(NascompressError, match=match) as e:
        nascompress.load(d)
    assert str(d / "arch.json") in str(e.value) and "\n" not in str(e.value)
    r = invoke("evaluate", d, "--dataset", "synthetic")
    assert r.exit_code == 1 and "error:" in r.output and "Traceback" not in r.output
    # the same arch embedded in the weights file alone (no arch.json beside it)
    sd = {k: v.contiguous() for k, v in build_model(SPEC).state_dict().items()}
    lone = tmp_path / "lone.safetensors"
    save_file(sd, str(lone), metadata={"nascompress_arch": json.dumps(arch)})
    with pytest.raises(NascompressError, match=match):
        nascompress.load(lone)


def test_every_setting_the_project_writes_is_allowed():
    build_model(SPEC)  # custom ViT: img_size, patch_size, embed_dim, depth, num_heads, mlp_ratio, classes, chans
    for kw in (
        {"reg_tokens": 2, "class_token": True},
        {"class_token": False, "global_pool": "avg"},
        {"init_values": 0.1, "qk_norm": True, "qkv_bias": False},
        {"img_size": [16, 20], "patch_size": 4},
        {"no_embed_class": True, "dynamic_img_size": True, "fc_norm": None, "pre_norm": True},
    ):
        build_model(
            ModelSpec(
                "vit_tiny_patch16_224",
                dict(
                    kw,
                    depth=1,
                    embed_dim=32,
                    num_heads=2,
                    num_classes=3,
                    **({} if "img_size" in kw else {"img_size": 16}),
                    **({} if "patch_size" in kw else {"patch_size": 4}),
                ),
            )
        )
    with pytest.raises(NascompressError, match="'drop_path_rate' is not one"):
        build_model(ModelSpec("vit_tiny_patch16_224", {"drop_path_rate": 0.1}))


def test_a_text_file_as_weights_is_one_line(tmp_path):
    bad = tmp_path / "w.safetensors"
    bad.write_text("hello\n")
    with pytest.raises(NascompressError, match="is not a readable safetensors file"):
        nascompress.load(bad)
    from nascompress.models.weights import read_weights_file

    for name in ("w.safetensors", "w.pth"):
        (tmp_path / name).write_text("hello\n")
        with pytest.raises(
            NascompressError,
            match="corrupt or not a weights file \\(it holds text, not tensors\\); "
            "give a .safetensors or .pth state dict",
        ):
            read_weights_file(tmp_path / name)
    # truncated files: the reader's words, never a bare exception name (KeyError: 101, IndexError)
    good = tmp_path / "good.pth"
    torch.save({"a": torch.zeros(1000)}, good)
    (tmp_path / "cut.pth").write_bytes(good.read_bytes()[:900])
    save_file({"a": torch.zeros(1000)}, str(tmp_path / "good.safetensors"))
    (tmp_path / "cut.safetensors").write_bytes((tmp_path / "good.safetensors").read_bytes()[:900])
    for name, words in (
        ("cut.pth", "neither a complete PyTorch zip checkpoint nor a pickle of tensors"),
        ("cut.safetensors", "not a complete safetensors file"),
    ):
        with pytest.raises(NascompressError, match=words) as e:
            read_weights_file(tmp_path / name)
        assert "Error:" not in str(e.value)
    r = invoke("train", "--out", tmp_path / "run", "--dataset", "synthetic", "--weights", tmp_path / "w.pth", *TINY)
    one_line(r, "it holds text, not tensors")
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------------
# A run is complete only once metrics.json (finished=true) is written; readers check it


TINY = [
    "--img-size",
    "16",
    "--patch-size",
    "4",
    "--embed-dim",
    "32",
    "--depth",
    "1",
    "--num-heads",
    "2",
    "--epochs",
    "2",
    "--batch-size",
    "64",
    "--device",
    "cpu",
]


def one_line(r, pattern: str) -> str:
    assert r.exit_code == 1, r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in r.output, r.output
    assert pattern in lines[0], lines[0]
    return lines[0]


def _train_job(out: Path, **data):
    from nascompress.data import DataConfig
    from nascompress.train.config import TrainConfig
    from nascompress.train.run import TrainJob

    spec = custom_vit_spec(img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2, num_classes=10, in_chans=1)
    return TrainJob(
        model=spec,
        data=DataConfig(**{"dataset": "synthetic", "train_limit": 128, **data}),
        train=TrainConfig(epochs=2, batch_size=64, lr=2e-3, device="cpu"),
        out=str(out),
    )


def test_an_interrupted_run_is_refused_until_resumed(tmp_path):
    from nascompress.train.hooks import TrainHooks
    from nascompress.train.run import train

    from .conftest import interrupted_at_epoch

    out = tmp_path / "run"
    with interrupted_at_epoch(TrainHooks, at=1), pytest.raises(KeyboardInterrupt):
        train(_train_job(out))
    # the files a reader used to accept: weights and arch of epoch 1, but no metrics
    assert (out / "model.safetensors").is_file() and (out / "arch.json").is_file()
    assert not (out / "metrics.json").exists() and (out / "checkpoint.safetensors").is_file()
    with pytest.raises(NascompressError, match="unfinished run.*'nascompress train --resume --out"):
        nascompress.load(out)
    with pytest.raises(NascompressError, match="unfinished run"):
        nascompress.load(out / "model.safetensors")
    one_line(invoke("evaluate", out), "continue it with 'nascompress train --resume")
    one_line(invoke("finetune", out, "--method", "evit", "--out", tmp_path / "ft", "--epochs", "1"), "unfinished run")
    one_line(invoke("search", "dcs", out, "--out", tmp_path / "dcs", "--epochs", "1"), "unfinished run")
    one_line(invoke("retrain", out, "--out", tmp_path / "rt", "--epochs", "1"), "unfinished run")
    assert not any((tmp_path / d).exists() for d in ("ft", "dcs", "rt"))
    nascompress.load(out / "last.safetensors")  # an explicit epoch file is still readable
    metrics = train(_train_job(out), resume=True)
    assert json.loads((out / "metrics.json").read_text())["finished"] is True
    assert nascompress.load(out).num_classes == 10 and metrics.epochs == 2


def test_a_run_without_checkpoint_says_what_to_delete(tmp_path):
    from nascompress.train.hooks import TrainHooks
    from nascompress.train.run import train

    from .conftest import interrupted_at_epoch

    out = tmp_path / "run"
    with interrupted_at_epoch(TrainHooks, at=0), pytest.raises(KeyboardInterrupt):
        train(_train_job(out))
    assert (out / "model.safetensors").is_file() and not (out / "checkpoint.safetensors").exists()
    msg = one_line(invoke("evaluate", out), "no checkpoint to continue from")
    assert f"delete {out}" in msg and "nascompress train" in msg


def test_plain_model_directories_and_older_runs_load(tmp_path, tiny_run):
    plain = plain_model_dir(tmp_path / "plain")  # model.safetensors + arch.json made by hand: accepted
    assert nascompress.load(plain).num_classes == 3
    old = tmp_path / "old"  # a run written before the mark: metrics.json without "finished"
    old.mkdir()
    for f in ("model.safetensors", "arch.json", "config.json", "log.jsonl"):
        (old / f).write_bytes((tiny_run / f).read_bytes())
    m = json.loads((tiny_run / "metrics.json").read_text())
    assert m.pop("finished") is True
    (old / "metrics.json").write_text(json.dumps(m))
    nascompress.load(old)


def test_an_unfinished_pipeline_stage_names_the_pipeline(tmp_path, tiny_run):
    pipe = tmp_path / "out"
    (pipe / "done").mkdir(parents=True)
    (pipe / "config.yaml").write_text("format: nascompress-pipeline/1\n")
    base = pipe / "base"
    base.mkdir()
    for f in ("model.safetensors", "arch.json", "config.json"):
        (base / f).write_bytes((tiny_run / f).read_bytes())
    with pytest.raises(NascompressError, match=f"unfinished stage of the pipeline in {pipe}.*nascompress pipeline"):
        nascompress.load(base)


# ---------------------------------------------------------------------------------------------
# ImageFolders: unreadable images, and datasets that cannot train a classifier


def folder(root: Path, counts: dict[str, int], splits=("train", "val")) -> Path:
    from .test_data import make_folder

    return make_folder(root, counts=counts, size=(16, 16), splits=splits)


def test_a_corrupt_image_is_named_before_anything_is_written(tmp_path):
    root = folder(tmp_path / "data", {"a": 6, "b": 6})
    bad = root / "train" / "b" / "3.png"
    bad.write_bytes(bad.read_bytes()[:60])  # truncated: PIL's "Truncated File Read" when decoded
    (root / "train" / "a" / "notes.txt").write_text("not an image, not listed")
    (root / "val" / "a" / "x.png").write_text("a text file named .png")
    out = tmp_path / "run"
    msg = one_line(invoke("train", "--dataset", root, "--out", out, *TINY), f"unreadable image {bad}")
    assert "--skip-bad-images" in msg and not out.exists() and "Error" not in msg  # the problem, not the exception
    r = invoke("train", "--dataset", root, "--out", out, *TINY, "--skip-bad-images", "--json")
    assert r.exit_code == 0, r.output
    metrics = json.loads(r.stdout)
    assert metrics["skipped_images"] == {str(root / "train"): 1, str(root / "val"): 1}
    assert "skipped 1 unreadable image(s) in" in r.stderr
    # every command that reads the folder refuses it the same way (the run records the option)
    one_line(invoke("evaluate", out, "--dataset", root), f"unreadable image {bad}")
    assert invoke("evaluate", out).exit_code == 0


@pytest.mark.parametrize(
    "counts,splits,match",
    [
        ({"only": 6}, ("train", "val"), "has 1 class (only): a classifier needs at least two"),
        ({"a": 6, "b": 6, "c": 0}, ("train",), "class 'c' of dataset"),
        ({"a": 6, "b": 1}, ("train",), "class 'b' of dataset"),  # one image: none left for the carved val split
    ],
)
def test_datasets_that_cannot_train_a_classifier(tmp_path, counts, splits, match):
    root = folder(tmp_path / "data", counts, splits)
    out = tmp_path / "run"
    one_line(invoke("train", "--dataset", root, "--out", out, *TINY), match)
    assert not out.exists()


def test_a_class_with_no_image_in_one_split_is_named(tmp_path):
    root = folder(tmp_path / "data", {"a": 4, "b": 4})
    for p in (root / "val" / "b").iterdir():
        p.unlink()
    one_line(
        invoke("train", "--dataset", root, "--out", tmp_path / "run", *TINY),
        f"class 'b' of dataset {root} has no image in {root}/val",
    )


# ---------------------------------------------------------------------------------------------
# Leftovers of kill -9: a journal's lock, a dashboard's snapshot


def _dead_pid() -> int:
    import subprocess

    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_a_journal_lock_left_by_a_killed_writer_is_recovered_at_once(tmp_path, caplog):
    import logging
    import os
    import socket
    import threading
    import time

    from nascompress.studies import run_study

    from .study_toys import SPACE_INFO, TWO, toy_factory

    storage = f"journal:{tmp_path}/s.journal"
    kw = dict(
        study_name="j",
        storage=storage,
        objective_factory=toy_factory,
        space_info=SPACE_INFO,
        progress=False,
        heartbeat_interval=1.0,
        **TWO,
    )
    run_study(n_trials=2, **kw)
    lock = tmp_path / "s.journal.lock"
    assert not os.path.lexists(lock)
    # what a writer killed in the middle of an append leaves: the lock, naming its (dead) owner
    os.symlink(f"{tmp_path}/s.journal.owner=" + json.dumps([socket.gethostname(), _dead_pid(), None]), lock)
    t0 = time.perf_counter()
    with caplog.at_level(logging.WARNING):
        assert run_study(n_trials=4, **kw).complete == 4
    assert time.perf_counter() - t0 < 15  # Optuna's own lock waits 30 s (grace period) here
    assert not any("lock" in r.getMessage() for r in caplog.records) and not os.path.lexists(lock)
    # a live owner's lock is waited for, not broken
    os.symlink(f"{tmp_path}/s.journal.owner=" + json.dumps([socket.gethostname(), os.getpid(), None]), lock)
    threading.Timer(1.0, lambda: os.unlink(lock)).start()
    t0 = time.perf_counter()
    assert run_study(n_trials=5, **kw).complete == 5
    assert time.perf_counter() - t0 >= 0.9


def test_the_dashboard_snapshot_lives_beside_the_study_and_is_cleaned(tmp_path):
    import os
    import signal
    import subprocess
    import sys

    from nascompress.studies import run_study
    from nascompress.studies.dashboard import start_dashboard

    from .study_toys import SPACE_INFO, TWO, toy_factory

    db = tmp_path / "studies.db"
    run_study(
        study_name="d",
        storage=f"sqlite:///{db}",
        n_trials=2,
        objective_factory=toy_factory,
        space_info=SPACE_INFO,
        progress=False,
        **TWO,
    )
    snaps = lambda: sorted(tmp_path.glob(".studies.db.dashboard-*"))  # noqa: E731
    with start_dashboard("d", storage=f"sqlite:///{db}") as h:
        assert h.snapshot is not None and h.snapshot.parent.parent == tmp_path and len(snaps()) == 1
    assert snaps() == []
    # a dashboard killed with kill -9 leaves its snapshot; the next start removes it
    code = (
        "import sys, time; from nascompress.studies.dashboard import start_dashboard; "
        f"h = start_dashboard('d', storage={f'sqlite:///{db}'!r}); print('up', flush=True); time.sleep(120)"
    )
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert p.stdout.readline().strip() == "up"
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    left = snaps()
    assert len(left) == 1
    with start_dashboard("d", storage=f"sqlite:///{db}") as h:
        assert left[0] not in snaps() and h.snapshot.exists()
    assert snaps() == []


# ---------------------------------------------------------------------------------------------
# A full disk or an unwritable output: one line naming the path and what to do, nothing half-written


def _refuse_writes_in(monkeypatch, folder: Path, code: int) -> None:
    """Make ``folder`` behave as read-only (EROFS), not ours (EACCES) or full (ENOSPC) for the files
    created in it: tests run as root on some machines, where chmod does not stop a write."""
    import errno
    import os
    import tempfile

    real_mkstemp, real_open = tempfile.mkstemp, os.open

    def mkstemp(*a, dir=None, **kw):
        if dir is not None and Path(dir).resolve() == folder.resolve():
            raise OSError(code, os.strerror(code), str(Path(dir) / "x.tmp"))
        return real_mkstemp(*a, dir=dir, **kw)

    def os_open(path, flags, *a, **kw):
        if Path(path).parent.resolve() == folder.resolve() and flags & os.O_CREAT:
            raise OSError(code, os.strerror(code), str(path))
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    monkeypatch.setattr(os, "open", os_open)
    assert code in (errno.EROFS, errno.EACCES, errno.ENOSPC)


@pytest.mark.parametrize("code,words", [(30, "the file system is read-only"), (13, "permission denied")])
def test_study_export_into_an_unwritable_folder_is_one_line(tmp_path, monkeypatch, code, words):
    from nascompress.studies import run_study

    from .study_toys import SPACE_INFO, TWO, toy_factory

    db = f"sqlite:///{tmp_path}/studies.db"
    run_study(
        study_name="e",
        storage=db,
        n_trials=2,
        objective_factory=toy_factory,
        space_info=SPACE_INFO,
        progress=False,
        **TWO,
    )
    ro = tmp_path / "ro"
    ro.mkdir()
    _refuse_writes_in(monkeypatch, ro, code)
    for cmd in (("export", "e", "--out", ro / "e.csv"), ("report", "e", "--out", ro / "e.html")):
        line = one_line(invoke("study", *cmd, "--storage", db), f"cannot write {ro / cmd[-1].name}: {words}")
        assert "Error" not in line and "choose" in line
    assert list(ro.iterdir()) == []


def test_a_pipeline_resumed_in_a_read_only_folder_is_one_line(tmp_path, monkeypatch):
    from nascompress.pipeline import LOCK_FILE, dump_config, load_config

    from .conftest import TINY_EVIT_SPACE

    cfg = tmp_path / "p.yaml"
    (tmp_path / "space.yaml").write_text(TINY_EVIT_SPACE)
    cfg.write_text(
        "format: nascompress-pipeline/1\ndevice: cpu\ndata: {dataset: synthetic}\n"
        "base: {train: {img_size: 16, patch_size: 4, embed_dim: 32, depth: 2, num_heads: 2, epochs: 1}}\n"
        "goal: {max_flops: 0.75}\nstages: {tokens: {space: space.yaml, trials: 2}}\n"
    )
    out = tmp_path / "out"
    out.mkdir()  # what an earlier (killed) run left: its config, no lock
    (out / "config.yaml").write_text(dump_config(load_config(cfg)))
    _refuse_writes_in(monkeypatch, out, 30)
    line = one_line(invoke("pipeline", cfg, "--out", out), f"cannot write pipeline directory {out}")
    assert "read-only" in line and "continue the pipeline" in line and LOCK_FILE not in line
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml"]


def test_a_full_disk_during_a_study_stops_it_in_one_line_and_the_rerun_continues(tmp_path):
    """SQLite's max_page_count makes a real 'database or disk is full' mid-study; the trial it hit
    is not failed (no retries spent), and once there is room the same command finishes the study
    with the same trials as a run that never stopped."""
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    from nascompress.errors import WriteError
    from nascompress.studies import run_study

    from .study_toys import SPACE_INFO, TWO, toy_factory

    def study(name, n):
        return run_study(
            study_name=name,
            storage=f"sqlite:///{tmp_path}/{name}.db",
            n_trials=n,
            seed=3,
            objective_factory=toy_factory,
            space_info=SPACE_INFO,
            progress=False,
            **TWO,
        )

    study("full", 2)
    pages = (tmp_path / "full.db").stat().st_size // 4096

    def small_disk(dbapi_conn, _record):
        dbapi_conn.execute(f"PRAGMA max_page_count = {pages + 1}")

    event.listen(Engine, "connect", small_disk)
    try:
        with pytest.raises(WriteError, match="cannot write study storage sqlite:///.*full.db: no space is left") as e:
            study("full", 30)
    finally:
        event.remove(Engine, "connect", small_disk)
    msg = str(e.value)
    assert "\n" not in msg and "StorageInternalError" not in msg and "rerun the same command" in msg
    from tests.test_studies import trials_of

    before = trials_of("full", f"sqlite:///{tmp_path}/full.db")
    k = sum(t.state.name == "COMPLETE" for t in before)
    assert 2 <= k < 30 and not any(t.state.name == "FAIL" for t in before)
    done = study("full", k + 3)
    assert done.complete == k + 3 and done.counts.get("FAIL", 0) == 0
    assert study("ref", k + 3).complete == k + 3

    def params(name):
        return [t.params for t in trials_of(name, f"sqlite:///{tmp_path}/{name}.db") if t.state.name == "COMPLETE"]

    assert params("full") == params("ref")


def test_a_full_disk_while_saving_a_model_leaves_nothing(tmp_path, monkeypatch):
    from safetensors import SafetensorError

    import nascompress.runs.io as nio

    def full(*a, **kw):  # what safetensors raises when the disk fills up
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(nio, "save_file", full)
    d = tmp_path / "m"
    with pytest.raises(
        NascompressError,
        match=f"cannot write {d / 'model.safetensors'}: no space is left on its disk; free space there",
    ):
        save_model(d, build_model(SPEC), make_arch(SPEC, input_spec=INPUT))
    assert list(d.iterdir()) == []
    r = invoke("evaluate", d, "--dataset", "synthetic")
    assert r.exit_code == 1 and "holds no model.safetensors" in r.output


def test_write_errors_are_recognised_in_every_form():
    import errno
    import sqlite3

    from nascompress.errors import write_error

    assert write_error(ValueError("x")) is None and write_error(NascompressError("cannot write")) is None
    e = OSError(errno.ENOSPC, "No space left on device", "a/b.json")
    assert str(write_error(e)).startswith("cannot write a/b.json: no space is left on its disk;")
    try:
        try:
            raise sqlite3.OperationalError("attempt to write a readonly database")
        except sqlite3.OperationalError as inner:
            raise RuntimeError("An exception is raised during the commit") from inner
    except RuntimeError as outer:
        assert "read-only" in str(write_error(outer, what="study storage s.db"))
    assert "permission denied" in str(write_error(PermissionError(errno.EACCES, "Permission denied", "x")))
    assert write_error(OSError(errno.ENOENT, "No such file", "x")) is None
