"""Data-parallel training under torchrun (CPU, gloo, 2 processes): ``train``, ``finetune``,
``retrain`` and ``search dcs`` each finish, write their run once (rank 0), keep the two processes'
states identical (``NASCOMPRESS_CHECK_SYNC=1`` makes fit compare them after every epoch and log
the digest) and train what one process trains on the global batch: 2 processes x batch 16 give
the weights of 1 process x batch 32 (same images per step, averaged gradients), up to rounding.
A 2-process run killed after its first checkpoint resumes to exactly the uninterrupted result.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import nascompress
from .conftest import invoke

ROOT = Path(__file__).resolve().parents[1]
MODEL = ["--img-size", 16, "--patch-size", 4, "--embed-dim", 32, "--depth", 2, "--num-heads", 2, "--in-chans", 1]
RUN_FILES = {"arch.json", "checkpoint.safetensors", "config.json", "last.safetensors", "log.jsonl", "metrics.json",
             "model.safetensors"}
pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without torch.distributed")


def torchrun_cmd(*args) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "nascompress.cli.main",
            *(str(a) for a in args)]


def torchrun_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                           "MASTER_PORT")}
    return dict(env, OMP_NUM_THREADS="1", NASCOMPRESS_CHECK_SYNC="1")


def torchrun(*args) -> str:
    """Run the CLI in 2 processes; return its stdout (rank 0's results)."""
    res = subprocess.run(torchrun_cmd(*args), cwd=ROOT, env=torchrun_env(), capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout


def train_args(out, batch_size: int) -> list:
    return ["train", "--out", out, *MODEL, "--dataset", "synthetic", "--epochs", 3, "--batch-size", batch_size,
            "--lr", 3e-3, "--warmup-epochs", 0.2, "--eval-limit", 128, "--device", "cpu"]


def read_log(run: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run / "log.jsonl").read_text().splitlines() if ln]


def check_run(run: Path, *, epochs: int) -> dict:
    """Every file once, no temp files, each epoch logged once and checked in sync; the model loads
    and its test top-1 (evaluated in one process) is the split evaluation's. Returns metrics."""
    assert {p.name for p in run.iterdir()} == RUN_FILES  # (atomic writes leave '.NAME.*.tmp' on failure)
    log = read_log(run)
    assert [r["epoch"] for r in log] == list(range(epochs + 1))
    assert all(len(r["state_digest"]) == 64 for r in log[1:])  # the processes' states were equal
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["processes"] == 2
    nascompress.load(run)
    res = invoke("evaluate", run, "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["top1"] == pytest.approx(metrics["test_top1"], abs=1e-9)
    return metrics


def assert_same_weights(a: Path, b: Path, *, atol: float) -> None:
    wa, wb = load_file(str(a / "last.safetensors")), load_file(str(b / "last.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=atol, msg=k)


def one_process(*args) -> Path:
    res = invoke(*args)
    assert res.exit_code == 0, res.output
    return Path(args[args.index("--out") + 1])


@pytest.fixture(scope="module")
def dense2(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp") / "dense"
    stdout = torchrun(*train_args(out, 16))
    assert stdout.count("best val top-1") == 1  # only rank 0 prints
    return out


@pytest.fixture(scope="module")
def evit2(dense2, tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp") / "evit"
    torchrun("finetune", dense2, "--method", "evit", "--keep-rate", 0.7, "--epochs", 1, "--batch-size", 16,
             "--base-lr", 1e-3, "--out", out, "--device", "cpu")
    return out


def test_shards_split_one_order_into_equal_parts():
    from nascompress.data import make_loader, synthetic_dataset

    ds = synthetic_dataset(101)
    whole = [y for _, ys in make_loader(ds, batch_size=8, shuffle=True, seed=3, epoch=2) for y in ys.tolist()]
    parts = [make_loader(ds, batch_size=8, shuffle=True, seed=3, epoch=2, shard=(r, 3)) for r in range(3)]
    assert len({len(p) for p in parts}) == 1  # every rank takes as many steps
    labels = [[y for _, ys in p for y in ys.tolist()] for p in parts]
    assert [y for trio in zip(*labels) for y in trio] == whole[:99]  # rank r: items r, r + 3, ... of one order


def test_train_two_processes_train_what_one_process_trains_on_the_global_batch(dense2, tmp_path):
    metrics = check_run(dense2, epochs=3)
    assert metrics["global_batch_size"] == 32 and metrics["peak_lr"] == 3e-3  # an absolute --lr is kept
    one = one_process(*train_args(tmp_path / "one", 32))
    assert_same_weights(dense2, one, atol=1e-3)
    single = json.loads((one / "metrics.json").read_text())
    assert metrics["test_top1"] > 50 and single["test_top1"] > 50  # chance: 10%


def test_a_killed_two_process_run_resumes_to_the_same_result(dense2, tmp_path):
    out = tmp_path / "killed"
    proc = subprocess.Popen(torchrun_cmd(*train_args(out, 16)), cwd=ROOT, env=torchrun_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not (out / "checkpoint.safetensors").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before its first checkpoint"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and both workers
        proc.wait()
    assert not (out / "metrics.json").exists()  # interrupted before the end
    torchrun(*train_args(out, 16), "--resume")
    check_run(out, epochs=3)
    assert_same_weights(out, dense2, atol=0)  # resume replays the uninterrupted run exactly


def test_finetune_evit(evit2, dense2, tmp_path):
    metrics = check_run(evit2, epochs=1)
    assert metrics["method"] == "evit" and metrics["peak_lr"] == pytest.approx(1e-3 * 32 / 512)  # base lr x global batch
    one = one_process("finetune", dense2, "--method", "evit", "--keep-rate", 0.7, "--epochs", 1, "--batch-size", 32,
                      "--base-lr", 1e-3, "--out", tmp_path / "one", "--device", "cpu")
    assert_same_weights(evit2, one, atol=1e-3)
    assert metrics["test_top1"] > 50 and json.loads((one / "metrics.json").read_text())["test_top1"] > 50


def test_retrain_clusters_the_whole_set_on_every_process(evit2, tmp_path):
    out = tmp_path / "retrained"
    args = ["--epochs", 2, "--warmup-frac", 0.5, "--lr", 1e-3, "--device", "cpu"]
    torchrun("retrain", evit2, "--out", out, "--batch-size", 16, *args)
    metrics = check_run(out, epochs=2)
    log = read_log(out)
    assert [r["ib_active"] for r in log[1:]] == [False, True]
    assert all(r["cluster_n"] == 540 for r in log[1:])  # each process passed its half; K-means saw all
    one = one_process("retrain", evit2, "--out", tmp_path / "one", "--batch-size", 32, *args)
    assert_same_weights(out, one, atol=1e-3)
    for r2, r1 in zip(log[1:], read_log(one)[1:]):
        assert r2["ib"] == pytest.approx(r1["ib"], abs=1e-4)
    assert metrics["test_top1"] > 50


def test_search_dcs_shards_both_subsets(dense2, tmp_path):
    out = tmp_path / "search"
    args = ["--epochs", 2, "--base-lr", 1e-3, "--arch-lr", 0.1, "--alpha-init", 0.5, "--target-flops", 0.7,
            "--device", "cpu"]
    torchrun("search", "dcs", dense2, "--out", out, "--batch-size", 16, *args)
    metrics = check_run(out, epochs=2)
    one = one_process("search", "dcs", dense2, "--out", tmp_path / "one", "--batch-size", 32, *args)
    assert_same_weights(out, one, atol=1e-3)  # the gates' Gumbel draws are shared, as in one process
    single = json.loads((one / "metrics.json").read_text())
    assert metrics["mlp_kept"] == single["mlp_kept"] and metrics["flops_ratio"] == pytest.approx(single["flops_ratio"])
    assert metrics["val_top1"] > 50
