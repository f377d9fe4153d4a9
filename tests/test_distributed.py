"""Data-parallel training under torchrun (CPU, gloo, 2 processes): ``train``, ``finetune``,
``retrain`` and ``search dcs`` each finish, write their run once (rank 0), keep the two processes'
states identical (``NASCOMPRESS_CHECK_SYNC=1`` makes fit compare them after every epoch and log
the digest) and train what one process trains on the global batch: 2 processes x batch 16 give
the weights of 1 process x batch 32 (same images per step, gradients averaged by DDP), up to
rounding. A 2-process run killed after its first checkpoint resumes to exactly the uninterrupted
result. The gradients go through torch's DistributedDataParallel (DDP logs its construction on
every rank); in one process, a one-process gloo group covers every recipe's use of DDP.
"""

from __future__ import annotations

import inspect
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import nascompress
from nascompress.train.hooks import TrainHooks
from .conftest import invoke

ROOT = Path(__file__).resolve().parents[1]
MODEL = ["--img-size", 16, "--patch-size", 4, "--embed-dim", 32, "--depth", 2, "--num-heads", 2, "--in-chans", 1]
RUN_FILES = {
    ".nascompress",  # the output marker (nascompress.runs.owner)
    "arch.json",
    "checkpoint.safetensors",
    "config.json",
    "last.safetensors",
    "log.jsonl",
    "metrics.json",
    "model.safetensors",
}
pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without torch.distributed")


def torchrun_cmd(*args) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "nascompress.cli.main",
        *(str(a) for a in args),
    ]


def torchrun_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    return dict(env, OMP_NUM_THREADS="1", NASCOMPRESS_CHECK_SYNC="1")


def torchrun(*args, ddp_wrappers: int | None = 1) -> str:
    """Run the CLI in 2 processes; return its stdout (rank 0's results). The gradients must go
    through ``ddp_wrappers`` DistributedDataParallel wrappers of the loss step on each rank (DDP's
    own log of its construction, TORCH_DISTRIBUTED_DEBUG=INFO; None: not checked)."""
    env = dict(torchrun_env(), TORCH_DISTRIBUTED_DEBUG="INFO", TORCH_CPP_LOG_LEVEL="INFO")
    res = subprocess.run(torchrun_cmd(*args), cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for rank in (0, 1) if ddp_wrappers is not None else ():
        built = res.stderr.split(f"[Rank {rank}]: DDP Initialized with:")[1:]
        assert len(built) == ddp_wrappers, res.stderr[-3000:]
        assert all(
            "module_name: LossStep" in b and "world_size: 2" in b and "find_unused_parameters: 0" in b for b in built
        )
    return res.stdout


def train_args(out, batch_size: int) -> list:
    return [
        "train",
        "--out",
        out,
        *MODEL,
        "--dataset",
        "synthetic",
        "--epochs",
        3,
        "--batch-size",
        batch_size,
        "--lr",
        3e-3,
        "--warmup-epochs",
        0.2,
        "--eval-limit",
        128,
        "--device",
        "cpu",
    ]


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
    torchrun(
        "finetune",
        dense2,
        "--method",
        "evit",
        "--keep-rate",
        0.7,
        "--epochs",
        1,
        "--batch-size",
        16,
        "--base-lr",
        1e-3,
        "--out",
        out,
        "--device",
        "cpu",
    )
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
    proc = subprocess.Popen(
        torchrun_cmd(*train_args(out, 16)),
        cwd=ROOT,
        env=torchrun_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not (out / "checkpoint.safetensors").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before its first checkpoint"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and both workers
        proc.wait()
    assert not (out / "metrics.json").exists()  # interrupted before the end
    torchrun(*train_args(out, 16), "--resume", ddp_wrappers=None)  # none if it was killed after the last epoch
    check_run(out, epochs=3)
    assert_same_weights(out, dense2, atol=0)  # resume replays the uninterrupted run exactly


def test_finetune_evit(evit2, dense2, tmp_path):
    metrics = check_run(evit2, epochs=1)
    assert metrics["method"] == "evit" and metrics["peak_lr"] == pytest.approx(
        1e-3 * 32 / 512
    )  # base lr x global batch
    one = one_process(
        "finetune",
        dense2,
        "--method",
        "evit",
        "--keep-rate",
        0.7,
        "--epochs",
        1,
        "--batch-size",
        32,
        "--base-lr",
        1e-3,
        "--out",
        tmp_path / "one",
        "--device",
        "cpu",
    )
    assert_same_weights(evit2, one, atol=1e-3)
    assert metrics["test_top1"] > 50 and json.loads((one / "metrics.json").read_text())["test_top1"] > 50


def test_retrain_clusters_the_whole_set_on_every_process(evit2, tmp_path):
    out = tmp_path / "retrained"
    args = ["--epochs", 2, "--eta", 50, "--warmup-frac", 0.5, "--lr", 1e-3, "--device", "cpu"]
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
    args = [
        "--epochs",
        2,
        "--base-lr",
        1e-3,
        "--arch-lr",
        0.1,
        "--alpha-init",
        0.5,
        "--target-flops",
        0.7,
        "--device",
        "cpu",
    ]
    torchrun("search", "dcs", dense2, "--out", out, "--batch-size", 16, *args, ddp_wrappers=2)  # W- and arch-steps
    metrics = check_run(out, epochs=2)
    one = one_process("search", "dcs", dense2, "--out", tmp_path / "one", "--batch-size", 32, *args)
    assert_same_weights(out, one, atol=1e-3)  # the gates' Gumbel draws are shared, as in one process
    single = json.loads((one / "metrics.json").read_text())
    assert metrics["mlp_kept"] == single["mlp_kept"] and metrics["flops_ratio"] == pytest.approx(single["flops_ratio"])
    assert metrics["val_top1"] > 50


# ---------------------------------------------------------------------------------------------
# DistributedDataParallel in this process: a one-process gloo group (world size 1) makes fit train
# through DDP as under torchrun, cheaply enough to cover every recipe; the wrappers DDP builds are
# recorded, and one process without a group must give bit-identical weights.


@pytest.fixture
def ddp_group(tmp_path, monkeypatch):
    """A one-process gloo group for the test; yields the list of (DDP wrapper, names of the
    parameters it manages) that training builds."""
    import torch.distributed as dist

    built = []
    real = torch.nn.parallel.DistributedDataParallel

    class Recorded(real):
        def __init__(self, module, **kwargs):
            super().__init__(module, **kwargs)
            built.append((self, {n for n, p in module.named_parameters() if p.requires_grad}))

    Recorded.__signature__ = inspect.signature(real)  # nascompress.train.distributed reads DDP's keywords

    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel", Recorded)
    dist.init_process_group("gloo", init_method=(tmp_path / "store").as_uri(), rank=0, world_size=1)
    try:
        yield built
    finally:
        dist.destroy_process_group()


def same_files(a: Path, b: Path, name: str = "last.safetensors") -> None:
    wa, wb = load_file(str(a / name)), load_file(str(b / name))
    assert wa.keys() == wb.keys() and not any(k.startswith("module.") for k in wa)  # the unwrapped model's state
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def dcs_args(tiny_run, out) -> list:
    return [
        "search",
        "dcs",
        tiny_run,
        "--out",
        out,
        "--epochs",
        2,
        "--batch-size",
        32,
        "--train-limit",
        256,
        "--eval-limit",
        64,
        "--arch-lr",
        0.05,
        "--alpha-init",
        0.5,
        "--target-flops",
        0.7,
        "--device",
        "cpu",
    ]


def test_dcs_search_reduces_weights_and_architecture_through_two_ddp_wrappers(tiny_run, tmp_path, ddp_group):
    from nascompress.methods.dcs_supernet import arch_parameters

    out = one_process(*dcs_args(tiny_run, tmp_path / "ddp"))
    # one wrapper for the weight steps, one for the architecture steps (each reduces only what its steps
    # train: no frozen zeros all-reduced, no find_unused_parameters graph walk)
    assert len(ddp_group) == 2
    (w_ddp, w_names), (a_ddp, a_names) = ddp_group
    assert w_names and a_names and not w_names & a_names
    sup = w_ddp.module.model
    arch_ids = {id(p) for p in arch_parameters(sup)}
    named = dict(sup.named_parameters())
    assert {id(named[n.removeprefix("model.")]) for n in a_names} == arch_ids
    assert {id(named[n.removeprefix("model.")]) for n in w_names} == {id(p) for p in sup.parameters()} - arch_ids
    assert not w_ddp.find_unused_parameters and not a_ddp.find_unused_parameters
    torch.distributed.destroy_process_group()  # the same search in one process without DDP: the same weights
    plain = one_process(*dcs_args(tiny_run, tmp_path / "plain"))
    torch.distributed.init_process_group("gloo", init_method=(tmp_path / "store2").as_uri(), rank=0, world_size=1)
    same_files(out, plain)
    same_files(out, plain, "model.safetensors")


@pytest.mark.parametrize(
    "method,config,recipe,phases,find_unused",
    [
        ("evit", {"keep_rate": 0.5}, {}, 1, False),
        ("dynamicvit", {"rho": 0.5}, {"predictor_epochs": 0.5}, 2, False),  # predictors alone, then everything
        ("dynamicvit", {"rho": 1.0}, {}, 1, True),  # keeps every token: the predictors take no part
        ("sparsifiner", {"attn_keep_ratio": 0.5}, {"stage1_epochs": 1}, 2, False),  # predictor, then the rest
        ("mgvit", {"grid": 2}, {}, 1, False),  # SGIS and MGIS in one forward_both
    ],
)
def test_every_fine_tune_recipe_trains_under_ddp(
    tiny_run, tmp_path, ddp_group, method, config, recipe, phases, find_unused
):
    """Each recipe's trainable sets get their own wrapper; no trainable parameter is left out of a
    step's loss unless the recipe says so; the teacher is never wrapped; the weights are one
    process's, bit for bit."""
    from nascompress.data import DataConfig
    from nascompress.train.finetune import FinetuneJob, finetune
    from nascompress.train.config import TrainConfig

    def job(out: Path) -> FinetuneJob:
        return FinetuneJob(
            run_dir=str(tiny_run),
            method=method,
            config=config,
            recipe=recipe,
            out=str(out),
            data=DataConfig(dataset="synthetic", train_limit=128, eval_limit=32),
            train=TrainConfig(epochs=2, batch_size=32, lr=1e-3, warmup_epochs=0.0, device="cpu"),
        )

    finetune(job(tmp_path / "ddp"))
    assert len(ddp_group) == phases
    teacher_free = all(
        type(w.module).__name__ == "LossStep" and len(list(w.module.children())) == 1 for w, _ in ddp_group
    )
    assert teacher_free and all(w.find_unused_parameters == find_unused for w, _ in ddp_group)
    torch.distributed.destroy_process_group()
    finetune(job(tmp_path / "plain"))
    torch.distributed.init_process_group("gloo", init_method=(tmp_path / "store2").as_uri(), rank=0, world_size=1)
    same_files(tmp_path / "ddp", tmp_path / "plain")


class HeadlessHooks(TrainHooks):
    """A loss the classifier head takes no part in (logits: the first 10 channels of the CLS token)."""

    def loss(self, model, x, y, *, epoch, cfg, tag=None):
        loss = F.cross_entropy(model.forward_features(x)[:, 0, :10], y)
        return loss, {"ce": loss.detach()}


def test_a_parameter_left_out_of_the_loss_stops_with_one_line(tmp_path, ddp_group):
    from nascompress.data import DataConfig, load_data
    from nascompress.errors import NascompressError
    from nascompress.runs.io import make_arch
    from nascompress.models.build import build_model, custom_vit_spec
    from nascompress.train.config import TrainConfig
    from nascompress.train.loop import fit
    from nascompress.train.run import input_spec_for

    spec_m = custom_vit_spec(img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2, num_classes=10, in_chans=1)
    model = build_model(spec_m)
    spec = input_spec_for(model, "synthetic")
    data = load_data(DataConfig(dataset="synthetic", train_limit=64, eval_limit=32), spec=spec)
    cfg = TrainConfig(epochs=1, batch_size=32, lr=1e-3, device="cpu", eval_start=False)
    arch = make_arch(spec_m, input_spec=spec.to_dict())
    with pytest.raises(NascompressError, match=r"took no part in the loss under torchrun \(e.g. head.weight\)"):
        fit(model, data=data, input_spec=spec, cfg=cfg, out_dir=tmp_path / "a", arch=arch, hooks=HeadlessHooks())
    hooks = HeadlessHooks()
    hooks.unused_parameters = True  # DDP's find_unused_parameters: trains; the head keeps no gradient
    (tmp_path / "b").mkdir()
    fit(model, data=data, input_spec=spec, cfg=cfg, out_dir=tmp_path / "b", arch=arch, hooks=hooks, finish=False)
    assert ddp_group[-1][0].find_unused_parameters and model.head.weight.grad is None
