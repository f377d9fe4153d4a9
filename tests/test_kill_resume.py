"""kill -9 at known points, then the same command again: the pipeline's confirm step and a DCS search
continue to the files an uninterrupted run writes; and what a killed process leaves outside its
output (ONNX Runtime's quantizer folders, the Python API's temporary workspaces) is cleaned up.

The kills land where the run is, not when: ``NASCOMPRESS_TEST_KILL_AFTER_CHECKPOINT=NAME:N``
(:data:`nascompress.runs.store.TEST_KILL_ENV`) makes the process SIGKILL itself right after the run
directory NAME wrote the checkpoint of its epoch N; the others come from inside the call that is
interrupted."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from nascompress.pipeline import confirm
from nascompress.pyapi.workspace import Workspace
from nascompress.runs.store import TEST_KILL_ENV

from .test_pipeline_confirm import _cfg, _write

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
# what differs between two runs of the same job whatever happens: the time taken
TIMES = {"epoch_time_s", "train_time_s", "search_time_s", "epoch_time_s_mean", "kmeans_s_mean"}
TIMES |= {"feature_pass_s_mean", "kmeans_vs_epoch"}


def _cli(*args, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "nascompress.cli.main", *map(str, args)],
        cwd=REPO,
        env={**ENV, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc: subprocess.Popen, timeout: float = 600) -> str:
    _, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return err


def _killed(proc: subprocess.Popen) -> None:
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == -signal.SIGKILL, err[-3000:]


def _untimed(d: dict) -> dict:
    return {k: v for k, v in d.items() if k not in TIMES}


def _log(run: Path) -> list[dict]:
    return [_untimed(json.loads(ln)) for ln in (run / "log.jsonl").read_text().splitlines()]


def _files(run: Path) -> dict:
    """What two runs of the same job hold alike: the model's and arch's bytes, the log and metrics
    without their times, config.json without the run's own path."""
    config = json.loads((run / "config.json").read_text())
    config.pop("out", None)
    return {
        "model": (run / "model.safetensors").read_bytes(),
        "arch": (run / "arch.json").read_bytes(),
        "log": _log(run),
        "metrics": _untimed(json.loads((run / "metrics.json").read_text())),
        "config": config,
    }


# ---------------------------------------------------------------------------------------------
# The pipeline's confirm step (OUT/final_channel), killed during its epochs


@pytest.fixture(scope="module")
def confirmed(tmp_path_factory):
    """An uninterrupted tiny pipeline whose confirm step retrains the channel-only model for 2 epochs."""
    d = tmp_path_factory.mktemp("confirm")
    cfg = _cfg(epochs=2)
    cfg.pop("export")
    path, out = _write(d, cfg), d / "out"
    _finish(_cli("pipeline", path, "--out", out))
    marker = json.loads((out / "done" / "confirm.json").read_text())["result"]
    if marker.get("skipped"):  # the DCS stage fell back: no channel-only model (a tiny search)
        pytest.skip(marker["reason"])
    summary = json.loads((out / "summary.json").read_text())
    return {
        "config": path,
        "out": out,
        "files": _files(out / confirm.CHANNEL_DIR),
        "marker": marker,
        "summary": summary,
    }


@pytest.mark.parametrize("epochs_done", [1, 2])
def test_a_pipeline_killed_in_its_confirm_step_continues_to_the_uninterrupted_result(confirmed, epochs_done):
    """kill -9 right after the checkpoint of the confirm step's first epoch, or of its last (before
    the run is marked complete): the same command continues it from that checkpoint and ends with
    the uninterrupted run's model, log (every epoch's record once), metrics and decision."""
    out, path = confirmed["out"], confirmed["config"]
    run = out / confirm.CHANNEL_DIR
    shutil.rmtree(run)  # the confirm step and the report again, the other steps stay done
    for step in ("confirm", "report"):
        (out / "done" / f"{step}.json").unlink()
    _killed(_cli("pipeline", path, "--out", out, env={TEST_KILL_ENV: f"{confirm.CHANNEL_DIR}:{epochs_done}"}))
    assert (run / "checkpoint.safetensors").is_file() and not (run / "metrics.json").exists()
    err = _finish(_cli("pipeline", path, "--out", out))
    assert "retrain: complete, skipped" in err and "confirm: when the pick cuts tokens" in err
    assert "continuing from its last checkpoint" in err
    got = _files(run)
    assert {k for k in got if got[k] != confirmed["files"][k]} == set()
    assert json.loads((out / "done" / "confirm.json").read_text())["result"] == confirmed["marker"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["decisions"]["confirm"] == confirmed["summary"]["decisions"]["confirm"]
    assert summary["final"]["run"] == confirmed["summary"]["final"]["run"]


# ---------------------------------------------------------------------------------------------
# A DCS search killed after an epoch, resumed with --resume


def _dcs(base: Path, out: Path, *extra, env: dict | None = None) -> subprocess.Popen:
    # no --batch-size and no --mlp-gates: the batch rule and the gate family are the pre-search choices
    args = ("search", "dcs", base, "--out", out, "--epochs", 2, "--arch-lr", 0.05, "--alpha-init", 0.5)
    return _cli(*args, "--device", "cpu", *extra, env=env)


@pytest.fixture(scope="module")
def searched(tiny_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("dcs") / "full"
    _finish(_dcs(tiny_run, out))
    return _files(out)


@pytest.mark.parametrize("epochs_done", [1, 2])
def test_a_dcs_search_killed_after_an_epoch_resumes_to_the_uninterrupted_files(
    tiny_run, searched, tmp_path, epochs_done
):
    """Killed after the checkpoint of its first or its last epoch (then no epoch is left to run), the
    resumed search writes the uninterrupted one's files: the same model and arch.json bytes (the
    temperature the last epoch ended with), the same log, and metrics.json with the pre-search
    choices (the batch rule, the gate family's probe) as the first run made them."""
    out = tmp_path / "part"
    _killed(_dcs(tiny_run, out, env={TEST_KILL_ENV: f"part:{epochs_done}"}))
    assert (out / "checkpoint.safetensors").is_file() and not (out / "metrics.json").exists()
    _finish(_dcs(tiny_run, out, "--resume"))
    got = _files(out)
    assert {k for k in got if got[k] != searched[k]} == set()
    assert "batch_rule" in got["metrics"] and "family_reason" in got["metrics"]


# ---------------------------------------------------------------------------------------------
# Leftovers of a killed process outside its output


def test_onnx_runtimes_quantizer_folders_stay_in_the_work_folder_the_next_run_removes(tiny_run, tmp_path):
    """A quantize killed with kill -9 while ONNX Runtime calibrates leaves its folders (the augmented
    model) in quantize's work folder beside the output, none in $TMPDIR; the next run removes them."""
    pytest.importorskip("onnxruntime")
    tmpdir, out = tmp_path / "tmp", tmp_path / "q" / "model.int8.onnx"
    tmpdir.mkdir()
    code = (
        "import os, signal, sys\n"
        "import nascompress.deploy.quantize as q\n"
        "from nascompress.deploy.config import QuantizeConfig\n"
        "real = q._reader\n"
        "def reader(name, batches):  # kill -9 as ONNX Runtime reads the first calibration batch\n"
        "    r = real(name, batches)\n"
        "    r.get_next = lambda: os.kill(os.getpid(), signal.SIGKILL)\n"
        "    return r\n"
        "q._reader = reader\n"
        "q.quantize_run(sys.argv[1], out=sys.argv[2], config=QuantizeConfig(calib_images=16, eval_images=16))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tiny_run), str(out)],
        cwd=REPO,
        env={**ENV, "TMPDIR": str(tmpdir)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert not list(tmpdir.glob("ort.quant.*"))
    left = list(out.parent.glob(f".{out.name}.quantize-*/ort.quant.*/augmented_model.onnx"))
    assert len(left) == 1, sorted(p.name for p in out.parent.rglob("*"))

    from nascompress.deploy.config import QuantizeConfig
    from nascompress.deploy.quantize import quantize_run

    side = quantize_run(tiny_run, out=out, config=QuantizeConfig(calib_images=16, eval_images=16))
    assert side.quantization.scheme == "int8-static"
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name, f"{out.name}.json"]


def test_the_temporary_workspace_of_a_killed_api_call_is_removed_by_the_next_one(tmp_path, monkeypatch):
    """A Workspace's temporary directory records its owner; the next Workspace removes one whose
    process was killed, and never one without a valid record, of a live process or of another host."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    code = (
        "import os, signal\n"
        "from nascompress.pyapi.workspace import Workspace\n"
        "ws = Workspace(None).__enter__()\n"
        "(ws.root / 'base').mkdir()\n"
        "print(ws.root, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env={**ENV, "TMPDIR": str(tmp_path)}, capture_output=True, text=True
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    dead = Path(proc.stdout.strip())
    assert dead.parent == tmp_path and (dead / "base").is_dir()

    def keep(name: str, owner: object | None) -> Path:
        d = tmp_path / name
        d.mkdir()
        (d / "notes.txt").write_text("mine")
        if owner is not None:
            (d / Workspace.OWNER_FILE).write_text(json.dumps(owner))
        return d

    gone = json.loads((dead / Workspace.OWNER_FILE).read_text())
    kept = [
        keep("nascompress-no-record", None),
        keep("nascompress-damaged", "{"),
        keep("nascompress-live", {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": None}),
        keep("nascompress-other-host", {**gone, "host": gone["host"] + "-elsewhere"}),
        keep("nascompress-bad-pid", {**gone, "pid": "1"}),
    ]
    (tmp_path / "nascompress-link").symlink_to(dead, target_is_directory=True)
    with Workspace(None) as ws:
        mine = ws.root
        assert json.loads((mine / Workspace.OWNER_FILE).read_text())["pid"] == os.getpid()
        assert not dead.exists()
        assert all((d / "notes.txt").is_file() for d in kept)
    assert not mine.exists() and (tmp_path / "nascompress-link").is_symlink()
