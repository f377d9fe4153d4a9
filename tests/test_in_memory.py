"""Stages on models and data in memory: training, the DCS search and IB retraining run without a run
directory (nothing written) and give what their run-directory wrappers give, which write and resume."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch

from nascompress.data import DataConfig, InputSpec, load_data, preprocess
from nascompress.runs.io import load_with_arch
from nascompress.methods.dcs import DCSConfig
from nascompress.dcs_search.search_config import DCSSearchConfig, DCSSearchJob, search_train_config
from nascompress.dcs_search.search import run_dcs_search
from nascompress.dcs_search.run import search_dcs
from nascompress.train.config import TrainConfig
from nascompress.train.loop import fit

from .conftest import TORCH_DEVICE

TIMES = (
    "train_time_s",
    "search_time_s",
    "epoch_time_s",
    "epoch_time_s_mean",
    "kmeans_s",
    "kmeans_s_mean",
    "feature_pass_s",
    "feature_pass_s_mean",
    "kmeans_vs_epoch",
)  # wall clock: differs run to run


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def _without_times(d: dict) -> dict:
    return {k: v for k, v in d.items() if k not in TIMES}


@pytest.fixture()
def base(tiny_run):
    model, arch = load_with_arch(tiny_run)
    data = load_data(DataConfig(dataset="synthetic"), spec=InputSpec.from_dict(arch["input"]))
    return model, arch, data


def test_fit_in_memory_writes_nothing_and_matches_a_run_directory(base, tmp_path, monkeypatch):
    model, arch, data = base
    spec = InputSpec.from_dict(arch["input"])
    cfg = TrainConfig(epochs=2, batch_size=32, lr=1e-3, seed=3, device="cpu")
    monkeypatch.chdir(tmp_path)
    before = _files(tmp_path)
    mem_log: list = []
    a = copy.deepcopy(model)
    m_mem = fit(a, data=data, input_spec=spec, cfg=cfg, log=mem_log)
    assert _files(tmp_path) == before  # no run directory, no stray file
    disk_log: list = []
    (tmp_path / "run").mkdir()
    m_disk = fit(
        copy.deepcopy(model), data=data, input_spec=spec, cfg=cfg, out_dir=tmp_path / "run", arch=arch, log=disk_log
    )
    assert _without_times(m_mem.to_dict()) == _without_times(m_disk.to_dict())
    strip = lambda log: [{k: v for k, v in r.items() if k not in TIMES} for r in log]  # noqa: E731
    assert strip(mem_log) == strip(disk_log) and len(mem_log) == 3  # the start, then one record per epoch
    # the in-memory model ends holding what the directory saved as model.safetensors (the best epoch)
    _same_state(a, load_with_arch(tmp_path / "run", complete=False)[0])
    with pytest.raises(ValueError, match="out_dir"):
        fit(copy.deepcopy(model), data=data, input_spec=spec, cfg=cfg, resume=True)


def test_dcs_search_in_memory_equals_the_search_run(base, tiny_run, tmp_path, monkeypatch):
    model, arch, data = base
    train = search_train_config(epochs=2, batch_size=32, seed=1, device="cpu")
    job = DCSSearchJob(
        source=str(Path(tiny_run).resolve()),
        out=str(tmp_path / "search"),
        method=DCSConfig(mlp_gates="residual", qk_mask="static"),
        search=DCSSearchConfig(target_flops=0.7, arch_lr=0.05, max_val_drop=100, auto_batch=False),
        data=DataConfig(dataset="synthetic"),
        train=train,
    )
    monkeypatch.chdir(tmp_path)
    mem = run_dcs_search(job.replace(out=""), copy.deepcopy(model).requires_grad_(True), arch, data)
    assert not (tmp_path / "search").exists() and os.listdir(tmp_path) == []
    disk = search_dcs(job)
    assert _without_times(mem.metrics.to_dict()) == _without_times(disk.to_dict())
    supernet, _ = load_with_arch(tmp_path / "search")
    _same_state(mem.supernet, supernet)
    assert mem.job.method.mlp_gates == "residual" and len(mem.log) == 3


def test_retrain_in_memory_equals_the_retrain_run(tiny_run, tmp_path):
    from nascompress.retraining.config import RetrainConfig
    from nascompress.retraining.run import RetrainJob, retrain, retrain_train_config, run_retrain
    from nascompress.dcs_search.materialize import MaterializeJob, materialize_search

    search = tmp_path / "search"
    search_dcs(
        DCSSearchJob(
            source=str(tiny_run),
            out=str(search),
            method=DCSConfig(mlp_gates="residual"),
            search=DCSSearchConfig(target_flops=0.7, arch_lr=0.05, max_val_drop=100, auto_batch=False),
            data=DataConfig(dataset="synthetic"),
            train=search_train_config(epochs=1, batch_size=32, device="cpu"),
        )
    )
    materialize_search(MaterializeJob(search_dir=str(search), out=str(tmp_path / "slim")))
    job = RetrainJob(
        model_dir=str(tmp_path / "slim"),
        out=str(tmp_path / "final"),
        data=DataConfig(dataset="synthetic"),
        train=retrain_train_config(epochs=2, batch_size=32, seed=2, device="cpu"),
        retrain=RetrainConfig(eta=1.0, kmeans_iters=2),
        auto_batch=False,
    )
    model, arch = load_with_arch(tmp_path / "slim")
    data = load_data(job.data, spec=InputSpec.from_dict(arch["input"]))
    mem = run_retrain(job, model, arch, data)
    assert not (tmp_path / "final").exists()
    disk = retrain(job)
    assert _without_times(mem.metrics.to_dict()) == _without_times(disk.to_dict())
    _same_state(mem.model, load_with_arch(tmp_path / "final")[0])


def test_search_reads_the_frozen_teachers_outputs_from_its_cache(tiny_run, tmp_path, monkeypatch):
    """In-memory training images are not augmented: the dense teacher's outputs are computed once per
    image and read back by index; the search is the one that runs the teacher on every step."""
    import nascompress.dcs_search.search as dcs_mod
    from nascompress.dcs_search.teacher import TeacherCache

    model, arch = load_with_arch(tiny_run)
    spec = InputSpec.from_dict(arch["input"])
    data = load_data(DataConfig(dataset="synthetic", train_limit=256, eval_limit=64), spec=spec)
    cache = TeacherCache.build(model.eval(), data.train, spec, device=torch.device("cpu"), feat=True)
    idx = torch.tensor([0, 17, 255])
    imgs, _ = data.train.__getitems__(idx.tolist())
    logits, feat = cache.read(idx, torch.device("cpu"))
    with torch.no_grad():
        torch.testing.assert_close(logits, model(preprocess(imgs, spec)), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(
            feat,
            model.forward_head(model.forward_features(preprocess(imgs, spec)), pre_logits=True),
            rtol=1e-5,
            atol=1e-5,
        )
    job = DCSSearchJob(
        source=str(Path(tiny_run).resolve()),
        out="",
        method=DCSConfig(mlp_gates="hidden", qk_mask="static"),
        search=DCSSearchConfig(target_flops=0.7, max_val_drop=100, auto_batch=False),
        data=DataConfig(dataset="synthetic"),
        # on a GPU without TF32 (deterministic): the cache and the live teacher agree to fp32 rounding
        train=search_train_config(epochs=2, batch_size=32, deterministic=TORCH_DEVICE.startswith("cuda")),
    )
    cached = run_dcs_search(job, copy.deepcopy(model).requires_grad_(True), arch, data)
    monkeypatch.setattr(dcs_mod, "IN_MEMORY", ())  # as for augmented (ImageFolder) data: the teacher runs per step
    monkeypatch.setitem(data.extra, "fixed_train_images", False)
    live = run_dcs_search(job, copy.deepcopy(model).requires_grad_(True), arch, data)
    assert cached.metrics.get("teacher_cached") and not live.metrics.get("teacher_cached")
    for a, b in zip(cached.log[1:], live.log[1:]):
        for k in ("train_kl_w", "train_feat_w", "train_kl_a"):
            assert a[k] == pytest.approx(b[k], rel=1e-3, abs=1e-6), k
    assert cached.metrics.flops_ratio == live.metrics.flops_ratio
