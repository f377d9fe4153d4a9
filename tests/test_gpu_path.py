"""The GPU execution path, tested on the CPU: inference dtypes (load, evaluate, profile), bf16
autocast training, ``--deterministic`` (recorded, in force during the job, restored after), the
CUDA RNG state in checkpoints, losses read back without per-step host syncs, the attention that
falls back to the math path where only its mask needs a gradient, static shapes for compilation."""

from __future__ import annotations

import copy
import json
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

import nascompress
from nascompress import runtime
from nascompress.data import DataConfig, InputSpec, load_data
from nascompress.profiling.evaluate import evaluate
from nascompress.errors import NascompressError
from nascompress.train.hooks import TrainHooks, as_floats
from nascompress.runs.checkpoint import load_state, save_state
from nascompress.runs.io import make_arch
from nascompress.methods import get_method
from nascompress.models.build import ModelSpec, build_model
from nascompress.train.loop import LossWatch, fit
from nascompress.train.config import TrainConfig
from nascompress.train.run import TrainJob, input_spec_for, train

from .conftest import TORCH_DEVICE, invoke, tiny_spec


def vit(img=32, dim=64, heads=2, depth=3):
    torch.manual_seed(0)
    return build_model(
        ModelSpec(
            "vit_tiny_patch16_224",
            dict(img_size=img, patch_size=4, embed_dim=dim, depth=depth, num_heads=heads, num_classes=10, in_chans=1),
        )
    ).eval()


# ---------------------------------------------------------------------------------------------
# Inference dtypes


def test_load_in_bf16_is_close_to_fp32_and_evaluate_records_the_dtype(tiny_run):
    x = torch.randn(4, 1, 16, 16)
    ref = nascompress.load(tiny_run)(x)
    half = nascompress.load(tiny_run, dtype="bf16")
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    out = half(x.bfloat16()).float()
    assert (out - ref).abs().max() < 0.1 * ref.abs().max()
    assert out.argmax(-1).tolist() == ref.argmax(-1).tolist() or (out - ref).abs().max() < 0.05
    from nascompress.profiling.jobs import evaluate_run

    fp32, bf16 = (evaluate_run(tiny_run, split="val", dtype=d, device="cpu") for d in ("fp32", "bf16"))
    assert (fp32.dtype, bf16.dtype) == ("fp32", "bf16")
    assert abs(fp32.top1 - bf16.top1) <= 5.0 and abs(fp32.loss - bf16.loss) < 0.1
    with pytest.raises(NascompressError, match="dtype must be one of fp32, bf16, fp16, got 'fp8'"):
        evaluate_run(tiny_run, dtype="fp8", device="cpu")


def test_cli_evaluate_and_profile_in_bf16(tiny_run):
    r = invoke("evaluate", tiny_run, "--dtype", "bf16", "--json", "--device", "cpu")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["dtype"] == "bf16"
    r = invoke("profile", tiny_run, "--dtype", "bf16", "--json", "--device", "cpu", "--iters", 2, "--batch-size", 4)
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    m = next(iter(res["models"].values()))
    assert res["dtype"] == "bf16" and m["latency_ms"] > 0 and m["macs"] == pytest.approx(m["flop_counter_macs"])
    r = invoke("evaluate", tiny_run, "--dtype", "half")
    assert r.exit_code == 1 and "--dtype must be one of fp32, bf16, fp16" in r.output


@pytest.mark.parametrize(
    "name,cfg",
    [
        ("evit", {"keep_rate": 0.5}),
        ("dynamicvit", {"rho": 0.5}),
        ("sparsifiner", {"attn_keep_ratio": 0.3, "n_down": 8, "mode": "block"}),
        ("uniform", {"keep": 0.5}),
        ("mgvit", {"epsilon": 0.5}),
        ("tome", {"r": 6}),
    ],
)
def test_every_method_runs_in_bf16(name, cfg):
    model, _ = get_method(name).prepare_fresh(vit(img=28), cfg)
    x = torch.randn(3, 1, 28, 28)
    with torch.no_grad():
        ref = model.eval()(x)
        out = model.bfloat16()(x.bfloat16()).float()
    assert out.shape == ref.shape and torch.isfinite(out).all()
    assert (out - ref).abs().max() < 0.1 * ref.abs().max() + 0.05


# ---------------------------------------------------------------------------------------------
# Training: autocast, determinism, checkpoints, host syncs


def _fit(out, **cfg_kw):
    torch.manual_seed(0)
    model = build_model(tiny_spec())
    data = load_data(DataConfig(dataset="synthetic", train_limit=128, eval_limit=64))
    spec = input_spec_for(model, "synthetic")
    out.mkdir(exist_ok=True)
    cfg = TrainConfig(**dict(dict(epochs=1, batch_size=32, lr=2e-3, seed=0, device="cpu"), **cfg_kw))
    seen: dict[str, list] = {"autocast": [], "deterministic": []}

    class Spy(TrainHooks):
        def loss(self, model, x, y, *, epoch, cfg, tag=None):
            seen["autocast"].append(torch.is_autocast_enabled("cpu"))
            seen["deterministic"].append(torch.are_deterministic_algorithms_enabled())
            return super().loss(model, x, y, epoch=epoch, cfg=cfg, tag=tag)

    metrics = fit(
        model,
        data=data,
        input_spec=spec,
        cfg=cfg,
        out_dir=out,
        arch=make_arch(tiny_spec(), input_spec=spec.to_dict()),
        hooks=Spy(),
    )
    return metrics, seen


def test_amp_bf16_trains_under_autocast_and_deterministic_is_in_force_then_restored(tmp_path):
    metrics, seen = _fit(tmp_path / "amp", amp="bf16", deterministic=True)
    assert seen["autocast"] and all(seen["autocast"]) and all(seen["deterministic"])
    assert not torch.are_deterministic_algorithms_enabled()  # restored after the job
    assert metrics.test_top1 > 10.0  # learns something in one epoch
    log = [json.loads(ln) for ln in (tmp_path / "amp" / "log.jsonl").read_text().splitlines()]
    assert isinstance(log[-1]["train_ce"], float)  # device tensors read back into the log as floats
    assert metrics.amp == "bf16"
    off, seen_off = _fit(tmp_path / "off", amp="off")
    assert not any(seen_off["autocast"]) and not any(seen_off["deterministic"]) and off.amp == "off"
    with pytest.raises(NascompressError, match="amp must be one of off, bf16"):
        TrainConfig(amp="fp16")


@pytest.mark.parametrize("native", ["0", "1"])  # both answers on every machine (the flags overridden)
def test_amp_auto_is_bf16_only_on_a_cpu_with_native_bfloat16_and_is_recorded(tmp_path, monkeypatch, native):
    monkeypatch.setenv("NASCOMPRESS_NATIVE_BF16", native)
    assert TrainConfig().amp == "auto"  # the default
    metrics, seen = _fit(tmp_path / "auto")
    on = native == "1"
    assert metrics.amp == ("bf16" if on else "off") and all(a == on for a in seen["autocast"])
    assert runtime.resolve_amp("auto", torch.device("cuda")) == "off"  # not measured on a GPU: TF32 as before
    monkeypatch.delenv("NASCOMPRESS_NATIVE_BF16")  # the CPU's own flags
    monkeypatch.setitem(runtime._ONCE, "cpu_flags", {"avx512f"})  # AVX-512 without BF16: fp32
    assert runtime.resolve_amp("auto", torch.device("cpu")) == "off"
    monkeypatch.setitem(runtime._ONCE, "cpu_flags", {"amx_bf16"})
    assert runtime.resolve_amp("auto", torch.device("cpu")) == "bf16"
    monkeypatch.setenv("NASCOMPRESS_NATIVE_BF16", "0")  # the override wins over the flags
    assert runtime.resolve_amp("auto", torch.device("cpu")) == "off"


def test_cpu_bf16_attention_runs_explicit_matmuls_and_restores_the_flag():
    model = build_model(tiny_spec())
    attn = [m for m in model.modules() if hasattr(m, "fused_attn")]
    assert attn and all(m.fused_attn for m in attn)
    with runtime.cpu_attention(model, torch.device("cpu"), "bf16"):
        assert not any(m.fused_attn for m in attn)
    assert all(m.fused_attn for m in attn)
    with runtime.cpu_attention(model, torch.device("cpu"), "off"):  # fp32's own path unchanged
        assert all(m.fused_attn for m in attn)


def test_a_bf16_evaluation_on_a_cpu_runs_the_attention_as_its_training_does(monkeypatch):
    """evaluate(amp="bf16") outside a training loop (the DCS search's comparison and test) runs the
    attention as explicit bf16 matmuls, as the training steps and their validation do: not SDPA's
    CPU flash kernel (slower in bf16, and a second numerical path for the same model)."""
    model = build_model(tiny_spec())
    spec = InputSpec(img_size=(16, 16), in_chans=1, mean=(0.5,), std=(0.5,))
    data = load_data(DataConfig(dataset="synthetic", eval_limit=32), spec=spec)
    real = torch.nn.functional.scaled_dot_product_attention
    calls = []
    monkeypatch.setattr(
        torch.nn.functional, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    bf16 = evaluate(model, data.val, input_spec=spec, device=torch.device("cpu"), amp="bf16")
    assert not calls and bf16.n == 32
    evaluate(model, data.val, input_spec=spec, device=torch.device("cpu"), amp="off")
    assert calls  # fp32's own path unchanged
    assert all(m.fused_attn for m in model.modules() if hasattr(m, "fused_attn"))


def test_deterministic_and_amp_are_recorded_in_config_json(tmp_path):
    r = invoke(
        "train",
        "--dataset",
        "synthetic",
        "--img-size",
        16,
        "--embed-dim",
        32,
        "--depth",
        1,
        "--num-heads",
        2,
        "--epochs",
        1,
        "--train-limit",
        64,
        "--eval-limit",
        32,
        "--device",
        "cpu",
        "--deterministic",
        "--amp",
        "bf16",
        "--out",
        tmp_path / "run",
    )
    assert r.exit_code == 0, r.output
    rec = json.loads((tmp_path / "run" / "config.json").read_text())["train"]
    assert rec["deterministic"] is True and rec["amp"] == "bf16"


def test_checkpoint_holds_the_cuda_rng_state_and_resume_restores_it(tmp_path, monkeypatch):
    # the field is always there: empty without CUDA, every device's state with it (a run on the CPU
    # of a CUDA machine saves it too)
    _fit(tmp_path / "cpu")
    st = load_state(tmp_path / "cpu" / "checkpoint.safetensors")
    assert "cuda_rng" in st
    if torch.cuda.is_available():
        assert len(st["cuda_rng"]) == torch.cuda.device_count()
    else:
        assert st["cuda_rng"] is None
    # with (mocked) CUDA: every device's state is saved and set back
    states = [torch.arange(16, dtype=torch.uint8), torch.arange(16, 32, dtype=torch.uint8)]
    restored = []
    monkeypatch.setattr(runtime.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(runtime.torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(runtime.torch.cuda, "get_rng_state_all", lambda: [s.clone() for s in states])
    monkeypatch.setattr(runtime.torch.cuda, "set_rng_state_all", lambda s: restored.append(list(s)))
    save_state(tmp_path / "ck.safetensors", {"cuda_rng": runtime.cuda_rng_state()})
    runtime.restore_cuda_rng(load_state(tmp_path / "ck.safetensors")["cuda_rng"])
    assert len(restored) == 1 and all(torch.equal(a, b) for a, b in zip(restored[0], states))
    monkeypatch.setattr(runtime.torch.cuda, "device_count", lambda: 1)  # another machine: left alone
    runtime.restore_cuda_rng(states)
    assert len(restored) == 1


def test_resume_calls_restore_with_the_saved_state(tmp_path, monkeypatch):
    from .conftest import interrupted_at_epoch

    with interrupted_at_epoch(TrainHooks, at=1), pytest.raises(KeyboardInterrupt):
        _fit(tmp_path / "r", epochs=2)
    got = []
    monkeypatch.setattr(runtime, "restore_cuda_rng", lambda s: got.append(s))
    torch.manual_seed(0)
    model = build_model(tiny_spec())
    spec = input_spec_for(model, "synthetic")
    fit(
        model,
        data=load_data(DataConfig(dataset="synthetic", train_limit=128, eval_limit=64)),
        input_spec=spec,
        cfg=TrainConfig(epochs=2, batch_size=32, lr=2e-3, seed=0, device="cpu"),
        out_dir=tmp_path / "r",
        arch=make_arch(tiny_spec(), input_spec=spec.to_dict()),
        resume=True,
    )
    assert len(got) == 1
    if torch.cuda.is_available():  # the states saved at the interruption, one per device
        assert len(got[0]) == torch.cuda.device_count()
    else:
        assert got == [None]


def test_loss_watch_reads_every_n_steps_and_names_the_first_bad_step():
    w = LossWatch(3)
    assert not w.add(0, torch.tensor(1.0)) and not w.add(1, torch.tensor(2.0)) and w.add(2, torch.tensor(3.0))
    assert w.read(epoch=0, peak_lr=1e-3) == 3.0 and w.read(epoch=0, peak_lr=1e-3) is None
    w.add(3, torch.tensor(1.0))
    w.add(4, torch.tensor(float("nan")))
    w.add(5, torch.tensor(float("inf")))
    with pytest.raises(
        NascompressError, match=r"loss became nan at epoch 2 step 4; lower lr \(the peak lr was 0.001\)"
    ):
        w.read(epoch=1, peak_lr=1e-3)


def test_a_nan_loss_stops_fit_with_one_line(tmp_path):
    class Nan(TrainHooks):
        def loss(self, model, x, y, *, epoch, cfg, tag=None):
            loss, logs = super().loss(model, x, y, epoch=epoch, cfg=cfg, tag=tag)
            self.n = getattr(self, "n", 0) + 1
            return (loss * float("nan") if self.n == 3 else loss), logs

    torch.manual_seed(0)
    model = build_model(tiny_spec())
    spec = input_spec_for(model, "synthetic")
    with pytest.raises(NascompressError, match="loss became nan at epoch 1 step 2"):
        fit(
            model,
            data=load_data(DataConfig(dataset="synthetic", train_limit=128, eval_limit=64)),
            input_spec=spec,
            cfg=TrainConfig(epochs=1, batch_size=32, lr=2e-3, device="cpu"),
            out_dir=tmp_path,
            arch=make_arch(tiny_spec(), input_spec=spec.to_dict()),
            hooks=Nan(),
        )
    assert not (tmp_path / "checkpoint.safetensors").exists()


def _no_item():
    def boom(self, *a, **k):
        raise AssertionError("a training loss read a value back to the host (.item())")

    return mock.patch.object(torch.Tensor, "item", boom)


@pytest.mark.parametrize(
    "name,cfg,recipe",
    [
        ("evit", {"keep_rate": 0.5}, {"distill": 0.5}),
        ("dynamicvit", {"rho": 0.5}, {}),
        ("sparsifiner", {"attn_keep_ratio": 0.3, "n_down": 8}, {"stage1_epochs": 1}),
        ("mgvit", {}, {}),
        ("tome", {"r": 6}, {"distill": 0.5}),
    ],
)
def test_method_losses_leave_their_logs_on_the_device(name, cfg, recipe):
    teacher = vit(img=28).requires_grad_(False)
    method = get_method(name)
    model, record = method.prepare_fresh(copy.deepcopy(teacher).requires_grad_(True), cfg, recipe or None)
    tc = TrainConfig(epochs=2, lr=None)
    hooks = method.hooks(model, record, teacher=teacher, train_cfg=tc)
    hooks.steps_per_epoch = 4
    x, y = torch.randn(2, 1, 28, 28), torch.arange(2)
    for epoch in (0, 1):  # Sparsifiner: stage 1 then stage 2
        hooks.on_epoch_start(model.train(), epoch=epoch)
        with _no_item():
            loss, logs = hooks.loss(model, x, y, epoch=epoch, cfg=tc)
        assert loss.requires_grad and all(isinstance(v, (float, int)) or v.dim() == 0 for v in logs.values())
        assert all(isinstance(v, float) for v in as_floats(logs).values())


# ---------------------------------------------------------------------------------------------
# GPU correctness fixes, checked on the CPU


def test_attention_takes_the_math_path_where_only_the_mask_needs_a_gradient():
    """CUDA's memory-efficient SDPA backward fails ('LSE is not correctly aligned (strideH)') when
    only the additive mask requires grad; DynamicViT's predictor-only stage is that case."""
    from nascompress.models.layers import attention

    q, k, v = (torch.randn(2, 3, 7, 8) for _ in range(3))
    bias = torch.randn(2, 1, 7, 7, requires_grad=True)
    real = F.scaled_dot_product_attention

    def strict(q_, k_, v_, attn_mask=None, **kw):
        if (
            attn_mask is not None
            and attn_mask.requires_grad
            and not (q_.requires_grad or k_.requires_grad or v_.requires_grad)
        ):
            raise RuntimeError("LSE is not correctly aligned (strideH)")
        return real(q_, k_, v_, attn_mask=attn_mask, **kw)

    with mock.patch.object(F, "scaled_dot_product_attention", strict):
        out = attention(q, k, v, attn_mask=bias, scale=8**-0.5)
        out.sum().backward()
        assert bias.grad is not None and bias.grad.abs().sum() > 0
        torch.testing.assert_close(out, real(q, k, v, attn_mask=bias.detach(), scale=8**-0.5))
        # DynamicViT's predictor-only stage (backbone frozen) through the model
        from nascompress.methods.dynamicvit import calibrate_predictors

        teacher = vit()
        model, record = get_method("dynamicvit").prepare_fresh(copy.deepcopy(teacher), {"rho": 0.5})
        batches = [(torch.randn(4, 1, 32, 32), torch.arange(4))]
        logs = calibrate_predictors(model, teacher.requires_grad_(False), batches, steps=2)
        assert set(logs) >= {"ce", "ratio"}


def test_predictor_stage_of_a_method_that_keeps_everything_trains_nothing():
    """rho 1 (the uncompressed configuration a search enqueues) runs no predictor: the stage ends
    instead of failing with 'element 0 of tensors does not require grad'."""
    teacher = vit().requires_grad_(False)
    model, record = get_method("dynamicvit").prepare_fresh(copy.deepcopy(teacher), {"rho": 1.0})
    before = {k: v.clone() for k, v in model.state_dict().items()}
    logs = get_method("dynamicvit").calibrate(
        model, record, teacher=teacher, batches=[(torch.randn(2, 1, 32, 32), torch.arange(2))] * 3
    )
    assert "ce" in logs
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_trial_model_is_trainable_though_the_shared_base_is_frozen(tiny_run, tmp_path):
    from nascompress.studies.trial_build import build_trial
    from nascompress.studies.trials import SearchJob
    from nascompress.studies.trial_context import TrialContext

    (tmp_path / "s.yaml").write_text(
        "format: nascompress-space/1\nname: s\nmethods:\n  - name: evit\n    params: {keep_rate: 0.5}\n"
    )
    ctx = TrialContext(
        SearchJob(
            base=str(tiny_run), space=str(tmp_path / "s.yaml"), study="s", train_images=20, eval_images=20, device="cpu"
        )
    )
    assert not any(p.requires_grad for p in ctx.base.parameters())
    model = build_trial(ctx, [{"name": "evit", "config": {"keep_rate": 0.5}}], seed=0).model
    assert all(p.requires_grad for p in model.parameters())


# ---------------------------------------------------------------------------------------------
# Static shapes: token methods compile to one graph, without breaks or recompiles


@pytest.mark.parametrize(
    "name,cfg",
    [
        ("evit", {"keep_rate": 0.5}),
        ("dynamicvit", {"rho": 0.5}),
        ("sparsifiner", {"attn_keep_ratio": 0.3, "n_down": 8}),
        ("sparsifiner", {"attn_keep_ratio": 0.3, "n_down": 8, "mode": "block", "block_size": 16}),
        ("uniform", {"keep": 0.5}),
        ("tome", {"r": 6}),
    ],
)
def test_token_and_channel_methods_trace_to_one_static_graph(name, cfg):
    from torch._dynamo.utils import counters

    model, _ = get_method(name).prepare_fresh(vit(), cfg)
    model.eval()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="eager", dynamic=False)
    with torch.no_grad():
        for seed in range(3):  # other images, same shape: the same graph (no recompile per input)
            x = torch.randn(2, 1, 32, 32, generator=torch.Generator().manual_seed(seed))
            torch.testing.assert_close(compiled(x), model(x))
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"], dict(counters["graph_break"])
    torch._dynamo.reset()


def test_profile_compile_times_the_compiled_model_and_explains_mgvit():
    from nascompress.profiling import profile_models

    dense = vit(img=28, dim=32, depth=1)
    mg, _ = get_method("mgvit").prepare_fresh(copy.deepcopy(dense), {"epsilon": 0.5})
    with mock.patch(
        "nascompress.profiling.latency.torch.compile",
        lambda m, mode=None, dynamic=None: torch._dynamo.optimize("eager", dynamic=dynamic)(m),
    ):
        res = profile_models(
            {"dense": dense, "mgvit": mg},
            device=torch.device("cpu"),
            batch_sizes=(1, 2),
            iters=2,
            warmup=1,
            compile=True,
        )
    d, m = res.models["dense"], res.models["mgvit"]
    assert d.latency_ms_compiled > 0 and d.throughput_compiled > 0 and m.latency_ms_compiled is None
    assert "early exit" in m.compile_note and "latency_ms_compiled" not in res.to_dict()["models"]["mgvit"]
    torch._dynamo.reset()


@pytest.mark.skipif(TORCH_DEVICE != "cpu", reason="Inductor's CPU backend (one real compile)")
def test_inductor_compiles_a_tiny_model():
    from nascompress.profiling.latency import compile_for_speed

    model = vit(img=16, dim=32, depth=1)
    fn, note = compile_for_speed(model, torch.device("cpu"))
    x = torch.randn(1, 1, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(fn(x), model(x), rtol=1e-4, atol=1e-4)
    assert note is None
    torch._dynamo.reset()


def test_train_job_records_deterministic_and_runs(tmp_path):
    job = TrainJob(
        model=tiny_spec(),
        data=DataConfig(dataset="synthetic", train_limit=64, eval_limit=32),
        train=TrainConfig(epochs=1, batch_size=32, lr=None, device=TORCH_DEVICE, deterministic=True),
        out=str(tmp_path / "d"),
    )
    train(job)
    assert json.loads((tmp_path / "d" / "config.json").read_text())["train"]["deterministic"] is True


def test_cpu_bf16_training_is_deterministic_and_leaves_the_attention_flag_as_it_was(tmp_path):
    a, _ = _fit(tmp_path / "a", amp="bf16")
    b, _ = _fit(tmp_path / "b", amp="bf16")
    times = ("train_time_s",)
    assert {k: v for k, v in a.to_dict().items() if k not in times} == {
        k: v for k, v in b.to_dict().items() if k not in times
    }
    model = build_model(tiny_spec())
    fit(
        model,
        data=load_data(DataConfig(dataset="synthetic", train_limit=64, eval_limit=32)),
        input_spec=input_spec_for(model, "synthetic"),
        cfg=TrainConfig(epochs=1, batch_size=32, device="cpu", amp="bf16"),
    )
    assert all(m.fused_attn for m in model.modules() if hasattr(m, "fused_attn"))
