"""The measuring jobs' results as frozen records (:mod:`nascompress.profiling.records`): ``to_dict()``
is the dict the jobs returned before (the same keys in the same order), read back to the same
record, and what ``--json`` prints."""

from __future__ import annotations

import json

import pytest
import torch

from nascompress.data import DataConfig
from nascompress.errors import NascompressError
from nascompress.methods import get_method
from nascompress.models.build import ModelSpec, build_model, custom_vit_spec
from nascompress.profiling import profile_models
from nascompress.profiling.compare import comparison_text
from nascompress.profiling.jobs import epsilon_sweep, evaluate_run, profile
from nascompress.profiling.records import (
    EpsilonSweep,
    Evaluation,
    ModelProfile,
    Profile,
    ProfileComparison,
    ProfileRatios,
)
from nascompress.runs.io import make_arch, save_model
from nascompress.train.run import input_spec_for

from .conftest import invoke

DATA = DataConfig(dataset="synthetic", eval_limit=32)
MODEL_KEYS = [
    "macs",
    "gflops",
    "params",
    "other_macs",
    "blocks",
    "batch",
    "flop_counter_macs",
    "thop_macs_no_attention_matmuls",
    "input_size",
]
TIMED = ["latency_ms", "latency_batch", "throughput", "throughput_batch"]


def _run(path, depth: int):
    spec = custom_vit_spec(
        img_size=16, patch_size=4, embed_dim=32, depth=depth, num_heads=2, num_classes=10, in_chans=1
    )
    torch.manual_seed(depth)
    model = build_model(spec)
    save_model(path, model, make_arch(spec, input_spec=input_spec_for(model, "synthetic").to_dict()))
    return path


def _mgvit_run(path):
    spec = ModelSpec(
        "vit_tiny_patch16_224",
        dict(img_size=28, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=10, in_chans=1),
    )
    torch.manual_seed(0)
    mg, _ = get_method("mgvit").prepare_fresh(build_model(spec), {"epsilon": 0.5})
    input_spec = {"img_size": [28, 28], "in_chans": 1, "mean": [0.5], "std": [0.5]}
    save_model(path, mg, make_arch(spec, input_spec=input_spec, methods=[{"name": "mgvit", "config": dict(mg.mg)}]))
    return path


def _round_trip(rec):
    d = rec.to_dict()
    again = type(rec).from_dict(json.loads(json.dumps(d)), source="test")
    assert again.to_dict() == d and list(again.to_dict()) == list(d)
    return d


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("records")
    return {"small": _run(root / "small", 1), "big": _run(root / "big", 2), "mg": _mgvit_run(root / "mg")}


def test_evaluation_keeps_the_keys_of_the_job_and_is_what_json_prints(runs):
    ev = evaluate_run(runs["small"], data=DATA, device="cpu", teacher=runs["big"])
    assert isinstance(ev, Evaluation) and ev.n == 32 and ev.agreement is not None and ev.exit_share is None
    d = _round_trip(ev)
    assert list(d) == ["top1", "loss", "n", "agreement", "split", "dataset", "methods", "splits", "dtype"]
    assert (d["top1"], d["n"], d["split"], d["methods"], d["dtype"]) == (ev.top1, 32, "test", [], "fp32")
    r = invoke("evaluate", runs["small"], "--dataset", "synthetic", "--eval-limit", 32, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) == evaluate_run(runs["small"], data=DATA, device="cpu").to_dict()


def test_an_early_exit_model_adds_its_exit_share_flops_and_sweep(runs):
    ev = evaluate_run(runs["mg"], data=DATA, device="cpu")
    d = _round_trip(ev)
    assert list(d)[:8] == ["top1", "loss", "n", "epsilon", "exit_share", "mean_flops", "mean_gflops", "sgis_flops"]
    assert ev.epsilon == 0.5 and 0 <= ev.exit_share <= 1 and ev.extra["sgis_flops"] == d["sgis_flops"]
    sw = epsilon_sweep(runs["mg"], [0.5, 1.0], data=DATA, device="cpu")
    assert isinstance(sw, EpsilonSweep) and [r.epsilon for r in sw.rows] == [0.5, 1.0]
    d = _round_trip(sw)
    assert list(d)[:4] == ["rows", "n", "sgis_top1", "mgis_top1"] and list(d)[-2:] == ["split", "dataset"]
    assert list(d["rows"][0]) == ["epsilon", "top1", "exit_share", "mean_flops", "mean_gflops"]
    r = invoke("evaluate", runs["mg"], "--dataset", "synthetic", "--eval-limit", 32, "--epsilon", "0.5,1", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) == d
    prof = profile(runs["mg"], device="cpu", latency=False)
    stages = prof.models[str(runs["mg"])].stages
    assert stages.sgis_flops > 0 and stages.ppsm_flops is not None
    assert list(_round_trip(prof)["models"][str(runs["mg"])]) == [*MODEL_KEYS, "stages"]


def test_profile_keeps_the_keys_of_the_job_and_is_what_json_prints(runs):
    small, big = str(runs["small"]), str(runs["big"])
    prof = profile(runs["small"], compare=runs["big"], device="cpu", latency=False)
    assert isinstance(prof, Profile) and isinstance(prof.comparison, ProfileComparison)
    assert all(isinstance(m, ModelProfile) for m in prof.models.values())
    d = _round_trip(prof)
    assert list(d) == ["device", "dtype", "models", "comparison", "input_size"] and list(d["models"]) == [small, big]
    assert all(list(m) == MODEL_KEYS for m in d["models"].values())
    assert list(d["comparison"]) == [
        "model",
        "reference",
        "flops_ratio",
        "params_ratio",
        "flops_images",
        "latency_batch",
        "throughput_batch",
    ]
    c = prof.comparison
    assert (c.model, c.reference, c.latency_batch, d["comparison"]["latency_batch"]) == (small, big, None, None)
    assert c.flops_ratio == prof.models[small].macs / prof.models[big].macs
    assert list(d["models"][small]["blocks"][0]) == ["attn", "mlp", "other"]
    r = invoke("profile", runs["small"], "--compare", runs["big"], "--no-latency", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) == d
    r = invoke("profile", runs["small"], "--compare", runs["big"], "--no-latency")
    assert all(line in r.stdout for line in comparison_text(c))


def test_profile_models_times_and_compares_with_the_first():
    spec = custom_vit_spec(img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2, num_classes=10, in_chans=1)
    models = {"a": build_model(spec), "b": build_model(spec)}
    prof = profile_models(models, device=torch.device("cpu"), batch_sizes=(1, 2), iters=1, warmup=1)
    d = _round_trip(prof)
    assert list(d) == ["device", "dtype", "models", "ratios"] and list(d["ratios"]) == ["b"]
    assert list(d["models"]["a"]) == [*MODEL_KEYS, *TIMED] and prof.models["a"].latency_batch == 1
    assert list(d["ratios"]["b"]) == ["flops_ratio", "params_ratio", "latency_speedup", "throughput_speedup"]
    ratios = prof.ratios["b"]
    assert isinstance(ratios, ProfileRatios) and ratios.flops_ratio == 1.0 and ratios.latency_speedup > 0
    assert Profile.from_dict(d, source="p").ratios["b"] == ratios  # read back: the same record


def test_a_damaged_record_is_one_line():
    with pytest.raises(NascompressError, match="models: a: macs must be a number, got str"):
        Profile.from_dict({"device": "cpu", "dtype": "fp32", "models": {"a": {"macs": "x", "params": 1}}}, source="p")
    with pytest.raises(NascompressError, match="has no top1"):
        Evaluation.from_dict({"loss": 1.0, "n": 3}, source="e")
