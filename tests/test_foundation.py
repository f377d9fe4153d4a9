"""The spine: model building, the file format and loader, checkpoints, data splits, training."""

from __future__ import annotations

import json

import pytest
import torch

import nascompress
from nascompress.data import DataConfig, InputSpec, load_data, make_loader, preprocess, split_indices
from nascompress.errors import NascompressError
from nascompress.runs.checkpoint import load_state, save_state
from nascompress.runs.io import build_from_arch, make_arch, save_model
from nascompress.methods import get_method, register_method
from nascompress.models.build import ModelSpec, build_model, custom_vit_spec
from nascompress.models.weights import load_pretrained
from nascompress.train.loop import lr_at

from .conftest import TORCH_DEVICE, needs_fmnist, tiny_spec

# exact-replay tests on a GPU (TORCH_DEVICE=cuda) run with deterministic kernels
EXACT = dict(device=TORCH_DEVICE, deterministic=TORCH_DEVICE.startswith("cuda"))


def test_save_load_roundtrip_exact(tmp_path):
    torch.manual_seed(0)
    model = build_model(tiny_spec()).eval()
    arch = make_arch(tiny_spec(), input_spec=InputSpec((16, 16), 1, (0.5,), (0.5,)).to_dict())
    save_model(tmp_path, model, arch)
    x = torch.randn(3, 1, 16, 16)
    loaded = nascompress.load(tmp_path)
    torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)
    # the safetensors file alone is enough (arch in its metadata)
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "m.safetensors").write_bytes((tmp_path / "model.safetensors").read_bytes())
    torch.testing.assert_close(nascompress.load(alone / "m.safetensors")(x), model(x), rtol=0, atol=0)


def test_load_mismatch_names_tensor_and_shapes(tmp_path):
    model = build_model(tiny_spec())
    arch = make_arch(tiny_spec(), input_spec={"img_size": [16, 16], "in_chans": 1, "mean": [0.5], "std": [0.5]})
    save_model(tmp_path, model, arch)
    arch["model"]["kwargs"]["num_classes"] = 7
    (tmp_path / "arch.json").write_text(json.dumps(arch))
    with pytest.raises(NascompressError, match=r"head\.weight has shape \(10, 32\) in the file but \(7, 32\)"):
        nascompress.load(tmp_path)


def test_corrupt_weights_file(tmp_path):
    bad = tmp_path / "w.safetensors"
    bad.write_bytes(b"not a safetensors file at all")
    with pytest.raises(NascompressError, match="corrupt"):
        load_pretrained(build_model(tiny_spec()), bad)
    with pytest.raises(NascompressError, match="does not exist"):
        load_pretrained(build_model(tiny_spec()), tmp_path / "missing.pth")


def test_load_pretrained_pth_and_reset_head(tmp_path):
    src = build_model(tiny_spec())
    torch.save({"model": src.state_dict()}, tmp_path / "w.pth")
    dst = build_model(tiny_spec())
    load_pretrained(dst, tmp_path / "w.pth")
    torch.testing.assert_close(dst.blocks[0].attn.qkv.weight, src.blocks[0].attn.qkv.weight)
    other = build_model(
        custom_vit_spec(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=3, in_chans=1)
    )
    with pytest.raises(NascompressError, match="num_classes"):
        load_pretrained(other, tmp_path / "w.pth")
    load_pretrained(other, tmp_path / "w.pth", reset_head=True)
    torch.testing.assert_close(other.blocks[1].mlp.fc2.weight, src.blocks[1].mlp.fc2.weight)


def test_unknown_and_non_vit_models():
    with pytest.raises(NascompressError, match="unknown model name 'deit_smal_patch16_224'.*did you mean"):
        build_model(ModelSpec("deit_smal_patch16_224"))
    with pytest.raises(NascompressError, match="not a timm VisionTransformer"):
        build_model(ModelSpec("resnet18", {"num_classes": 10}))


def test_method_registry_and_arch_records(monkeypatch):
    from dataclasses import dataclass

    import nascompress.methods as registry
    from nascompress.config import Config
    from nascompress.methods import Method, available_methods

    available_methods()  # every real method registered first, then work on a copy of the registry
    monkeypatch.setattr(registry, "_METHODS", dict(registry._METHODS))
    calls = []

    @dataclass(frozen=True)
    class MarkerConfig(Config):
        x: int = 0

    @register_method
    class Marker(Method):
        name = "_test_marker"
        config_cls = MarkerConfig

        def patch(self, model, cfg, record):
            calls.append(cfg.x)
            model.register_buffer("test_marker", torch.tensor(float(cfg.x)))
            return model

    arch = make_arch(
        tiny_spec(),
        input_spec={"img_size": [16, 16], "in_chans": 1, "mean": [0.5], "std": [0.5]},
        methods=[{"name": "_test_marker", "config": {"x": 3}}],
    )
    model = build_from_arch(arch)
    assert calls == [3] and float(model.test_marker) == 3.0 and model.nc_methods == ["_test_marker"]
    with pytest.raises(NascompressError, match="unknown method 'nope'; available: _test_marker, dcs, dynamicvit"):
        get_method("nope")
    with pytest.raises(NascompressError, match="unknown _test_marker setting\\(s\\) y; valid: x"):
        build_from_arch(dict(arch, methods=[{"name": "_test_marker", "config": {"y": 1}}]))

    class Other(Marker):
        pass

    with pytest.raises(ValueError, match="already registered"):
        register_method(Other)


def test_checkpoint_state_roundtrip(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    state = {"opt": opt.state_dict(), "epoch": 3, "tup": (1, "a"), "none": None}
    save_state(tmp_path / "c.safetensors", state)
    back = load_state(tmp_path / "c.safetensors")
    assert back["epoch"] == 3 and back["tup"] == (1, "a") and back["none"] is None
    opt2 = torch.optim.AdamW(model.parameters())
    opt2.load_state_dict(back["opt"])  # int keys of optimizer state survive
    torch.testing.assert_close(opt2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def test_split_indices_deterministic_and_disjoint():
    a = split_indices(1000, (0.7, 0.3), seed=1)
    b = split_indices(1000, (0.7, 0.3), seed=1)
    assert [len(p) for p in a] == [700, 300]
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert len(set(a[0].tolist()) & set(a[1].tolist())) == 0
    assert not torch.equal(split_indices(1000, (0.7, 0.3), seed=2)[0], a[0])
    with pytest.raises(ValueError):
        split_indices(10, (0.5, 0.6), seed=0)


def test_loader_order_depends_on_seed_and_epoch():
    ds = load_data(DataConfig(dataset="synthetic")).train

    def first(seed, epoch):
        return next(iter(make_loader(ds, batch_size=8, shuffle=True, seed=seed, epoch=epoch)))[1]

    assert torch.equal(first(0, 0), first(0, 0))
    assert not torch.equal(first(0, 0), first(0, 1))


def test_preprocess_channels_and_size():
    imgs = torch.randint(0, 255, (2, 1, 28, 28), dtype=torch.uint8)
    x = preprocess(imgs, InputSpec((32, 32), 3, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)))
    assert x.shape == (2, 3, 32, 32)
    torch.testing.assert_close(x[:, 0], x[:, 2])
    rgb = torch.randint(0, 255, (2, 3, 8, 8), dtype=torch.uint8)
    assert preprocess(rgb, InputSpec((8, 8), 1, (0.5,), (0.5,))).shape == (2, 1, 8, 8)


@needs_fmnist
def test_fashion_mnist_real_data():
    b = load_data(DataConfig(val_fraction=0.1))
    assert (len(b.train), len(b.val), len(b.test), b.num_classes) == (54000, 6000, 10000, 10)
    imgs, labels = next(iter(make_loader(b.test, batch_size=10000, shuffle=False)))
    assert imgs.shape == (10000, 1, 28, 28) and imgs.dtype == torch.uint8
    assert torch.bincount(labels).tolist() == [1000] * 10


def test_fashion_mnist_missing_says_how_to_install(tmp_path):
    with pytest.raises(NascompressError, match="apt-get install -y dataset-fashion-mnist"):
        load_data(DataConfig(data_dir=str(tmp_path)))


def test_image_folder(tmp_path):
    from PIL import Image

    for split in ("train", "val"):
        for c in ("cat", "dog"):
            d = tmp_path / split / c
            d.mkdir(parents=True)
            for i in range(3):
                Image.new("RGB", (20, 24), color=(i * 40, 10, 200 if c == "dog" else 0)).save(d / f"{i}.png")
    b = load_data(DataConfig(dataset=str(tmp_path)), img_size=(16, 16))
    assert b.classes == ["cat", "dog"] and len(b.train) == 6 and len(b.val) + len(b.test) == 6  # test carved from val/
    imgs, labels = next(iter(make_loader(b.train, batch_size=6, shuffle=False)))
    assert imgs.shape == (6, 3, 16, 16) and labels.tolist() == [0, 0, 0, 1, 1, 1]
    with pytest.raises(NascompressError, match="no train/ folder"):
        load_data(DataConfig(dataset=str(tmp_path / "train")))


def test_lr_schedule():
    assert lr_at(0, total=100, warmup=10, lr=1.0, min_lr=0.0) == pytest.approx(0.1)
    assert lr_at(10, total=100, warmup=10, lr=1.0, min_lr=0.0) == pytest.approx(1.0)
    assert lr_at(100, total=100, warmup=10, lr=1.0, min_lr=0.1) == pytest.approx(0.1)


def _fit_tiny(out, *, hooks=None, resume=False, amp="off"):
    from nascompress.train.config import TrainConfig
    from nascompress.train.loop import fit
    from nascompress.train.run import input_spec_for

    torch.manual_seed(0)
    model = build_model(tiny_spec())
    data = load_data(DataConfig(dataset="synthetic"))
    spec = input_spec_for(model, "synthetic")
    arch = make_arch(tiny_spec(), input_spec=spec.to_dict())
    out.mkdir(exist_ok=True)
    cfg = TrainConfig(epochs=3, batch_size=64, seed=3, lr=2e-3, amp=amp, **EXACT)
    return fit(model, data=data, input_spec=spec, cfg=cfg, out_dir=out, arch=arch, hooks=hooks, resume=resume)


@pytest.mark.parametrize("amp", ["off", "bf16"])  # bf16: on a CPU, also the explicit attention (runtime.cpu_attention)
def test_training_learns_and_resume_is_exact(tmp_path, amp):
    from nascompress.train.hooks import TrainHooks

    full = _fit_tiny(tmp_path / "full", amp=amp)
    assert full.test_top1 > 50.0  # 10 classes: chance is 10%

    class Crash(TrainHooks):
        def on_epoch_start(self, model, *, epoch):
            if epoch == 2:
                raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _fit_tiny(tmp_path / "crash", hooks=Crash(), amp=amp)
    assert len((tmp_path / "crash" / "log.jsonl").read_text().splitlines()) == 3  # the start + 2 epochs
    resumed = _fit_tiny(tmp_path / "crash", resume=True, amp=amp)
    assert len((tmp_path / "crash" / "log.jsonl").read_text().splitlines()) == 4
    a = nascompress.load(tmp_path / "full" / "last.safetensors").state_dict()
    b = nascompress.load(tmp_path / "crash" / "last.safetensors").state_dict()
    for k in a:
        torch.testing.assert_close(b[k], a[k], msg=lambda m, k=k: f"{k}: {m}")
    assert resumed.test_top1 == pytest.approx(full.test_top1)


def test_same_seed_same_run(tmp_path):
    """One seed drives init, data order and training: two runs give identical weights."""
    from nascompress.train.config import TrainConfig
    from nascompress.train.run import TrainJob, train

    def run(name, seed):
        torch.manual_seed(1000 + len(name))  # global RNG state before the job must not matter
        job = TrainJob(
            model=tiny_spec(),
            data=DataConfig(dataset="synthetic", train_limit=128),
            train=TrainConfig(epochs=1, batch_size=64, lr=None, seed=seed, **EXACT),
            out=str(tmp_path / name),
        )
        train(job)
        return nascompress.load(tmp_path / name).state_dict()

    a, b, c = run("a", 5), run("bb", 5), run("c", 6)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
    assert not torch.equal(a["blocks.0.attn.qkv.weight"], c["blocks.0.attn.qkv.weight"])


def test_aligned_width_rule():
    from nascompress.errors import NascompressError
    from nascompress.models.layers import aligned_width

    assert aligned_width(33, align=8, full=96) == 40
    assert aligned_width(33, align=8, full=96, mode="down") == 32
    assert aligned_width(35, align=8, full=96, mode="nearest") == 32
    assert aligned_width(36, align=8, full=96, mode="nearest") == 40
    assert aligned_width(95, align=8, full=96) == 96  # the full width is always allowed
    assert aligned_width(93, align=64, full=96) == 96  # clipped to the full width
    assert aligned_width(0, align=8, full=96) == 0 and aligned_width(96, align=8, full=96) == 96
    assert aligned_width(921, align=1, full=1536) == 921
    assert aligned_width(3, align=8, full=96, mode="down") == 0
    for bad in (dict(n=5, align=0, full=8), dict(n=9, align=8, full=8)):
        with pytest.raises(NascompressError):
            aligned_width(bad["n"], align=bad["align"], full=bad["full"])
