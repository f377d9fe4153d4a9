"""Data: stratified seeded limits, preprocessing from the model's pretrained config, timm's
ImageFolder conventions (eval crop, training transform, two views of one split), loader workers."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from nascompress.data import (
    DataConfig,
    InputOverrides,
    InputSpec,
    Subset,
    dataset_labels,
    folder_transform,
    load_data,
    make_loader,
    preprocess,
    stratified_indices,
)
from nascompress.errors import NascompressError

from .conftest import invoke, needs_fmnist

COUNTS = {"ant": 12, "bee": 6, "cat": 9, "dog": 3}  # unequal on purpose; ImageFolder lists them class by class


def make_folder(root, counts=COUNTS, size=(20, 24), splits=("train",)):
    """Tiny PNGs: class k is a colour; a gradient makes crops and flips visible."""
    import numpy as np
    from PIL import Image

    for split in splits:
        for k, (c, n) in enumerate(counts.items()):
            d = root / split / c
            d.mkdir(parents=True)
            for i in range(n):
                h, w = size
                a = np.zeros((h, w, 3), dtype=np.uint8)
                a[..., 0] = np.linspace(0, 255, w, dtype=np.uint8)[None, :]  # left-right gradient
                a[..., 1] = 40 * k + i
                a[..., 2] = np.linspace(0, 255, h, dtype=np.uint8)[:, None]
                Image.fromarray(a).save(d / f"{i}.png")
    return root


# ---------------------------------------------------------------------------------------------
# A. limits: seeded, class-stratified random subsets


def test_stratified_indices_exact_proportional_sorted():
    labels = torch.tensor([0] * 50 + [1] * 30 + [2] * 20)
    idx = stratified_indices(labels, 10, seed=0)
    assert len(idx) == 10 and torch.equal(idx, idx.sort().values) and len(set(idx.tolist())) == 10
    assert torch.bincount(labels[idx]).tolist() == [5, 3, 2]
    # largest remainder: 7 of (50, 30, 20) -> quotas 3.5, 2.1, 1.4 -> 3 + 2 + 1 = 6, the 7th to class 0
    assert torch.bincount(labels[stratified_indices(labels, 7, seed=0)], minlength=3).tolist() == [4, 2, 1]
    assert torch.equal(stratified_indices(labels, 7, seed=3), stratified_indices(labels, 7, seed=3))
    assert not torch.equal(stratified_indices(labels, 7, seed=3), stratified_indices(labels, 7, seed=4))
    assert len(stratified_indices(labels, 100, seed=0)) == 100


def test_image_folder_limit_draws_every_class_in_proportion(tmp_path):
    root = make_folder(tmp_path)  # 30 images sorted by class: the first 10 would all be "ant"
    cfg = DataConfig(dataset=str(root), val_fraction=0.2, num_workers=0)
    full = load_data(cfg, img_size=(16, 16))
    assert len(full.train) + len(full.test) == 24 and len(full.val) == 6 and len(full.test) >= 4  # no test/: carved

    def limited(seed, n=12):
        b = load_data(
            DataConfig(
                dataset=str(root), val_fraction=0.2, num_workers=0, train_limit=n, eval_limit=3, subset_seed=seed
            ),
            img_size=(16, 16),
        )
        return b, dataset_labels(b.train)

    b, labels = limited(0)
    full_counts = torch.bincount(dataset_labels(full.train), minlength=4)
    counts = torch.bincount(labels, minlength=4)
    assert counts.sum() == 12 and (counts[full_counts >= 2] > 0).all(), counts
    assert ((counts - full_counts * 12 / len(full.train)).abs() <= 1).all(), (counts, full_counts)  # in proportion, +-1
    # the subset really is those images: its items carry the labels dataset_labels reports
    _, ys = next(iter(make_loader(b.train, batch_size=12, shuffle=False)))
    assert torch.equal(ys, labels)
    assert len(b.val) == 3 and len(b.test) == 3  # no test/: a test split carved, then limited
    # same seed, same subset; another seed, another subset
    assert torch.equal(limited(0)[0].train.indices, b.train.indices)
    assert not torch.equal(limited(1)[0].train.indices, b.train.indices)


def test_limits_on_synthetic_are_stratified():
    b = load_data(DataConfig(dataset="synthetic", train_limit=100, eval_limit=50))
    assert torch.bincount(dataset_labels(b.train)).tolist() == [10] * 10
    assert torch.bincount(dataset_labels(b.test)).tolist() == [5] * 10
    assert len(b.val) == 50


@needs_fmnist
def test_fashion_mnist_limits_are_stratified_random():
    b = load_data(DataConfig(train_limit=1000, eval_limit=500, subset_seed=0))
    assert torch.bincount(dataset_labels(b.test)).tolist() == [50] * 10
    counts = torch.bincount(dataset_labels(b.train), minlength=10)
    assert counts.sum() == 1000 and (counts >= 95).all() and (counts <= 105).all()
    assert b.test.indices.max() > 5000  # not the first 500 images
    other = load_data(DataConfig(train_limit=1000, eval_limit=500, subset_seed=1))
    assert not torch.equal(other.train.indices, b.train.indices)


def test_dataset_labels_maps_through_subsets():
    b = load_data(DataConfig(dataset="synthetic"))
    inner = Subset(b.train, torch.tensor([5, 1, 7]))
    outer = Subset(inner, torch.tensor([2, 0]))
    expected = torch.stack([outer[i][1] for i in range(2)])
    assert torch.equal(dataset_labels(outer), expected)
    assert torch.equal(
        dataset_labels(torch.utils.data.Subset(b.train, [3, 4])), torch.stack([b.train[3][1], b.train[4][1]])
    )


def test_data_config_rejects_bad_limits():
    with pytest.raises(NascompressError, match="train_limit must be an integer"):
        DataConfig(train_limit=0)
    with pytest.raises(NascompressError, match="num_workers"):
        DataConfig(num_workers=-1)


def test_cli_train_records_subset_seed(tmp_path):
    out = tmp_path / "run"
    r = invoke(
        "train",
        "--out",
        out,
        "--img-size",
        16,
        "--embed-dim",
        32,
        "--depth",
        1,
        "--num-heads",
        2,
        "--dataset",
        "synthetic",
        "--train-limit",
        64,
        "--eval-limit",
        20,
        "--epochs",
        1,
        "--seed",
        7,
        "--json",
    )
    assert r.exit_code == 0, r.output
    data = json.loads((out / "config.json").read_text())["data"]
    assert data["subset_seed"] == 7 and data["train_limit"] == 64


# ---------------------------------------------------------------------------------------------
# B. preprocessing


def test_input_spec_reads_old_dicts_and_round_trips():
    old = {"img_size": [16, 16], "in_chans": 1, "mean": [0.5], "std": [0.5]}
    spec = InputSpec.from_dict(old)
    assert (spec.interpolation, spec.crop_pct, spec.crop_mode) == ("bilinear", 1.0, "center")
    new = InputSpec((32, 32), 3, (0.1, 0.2, 0.3), (0.4, 0.5, 0.6), interpolation="bicubic", crop_pct=0.9)
    assert InputSpec.from_dict(json.loads(json.dumps(new.to_dict()))) == new
    with pytest.raises(NascompressError, match="interpolation must be one of"):
        InputSpec((8, 8), 1, (0.5,), (0.5,), interpolation="lanczos2")
    with pytest.raises(NascompressError, match=r"crop_pct must be in \(0, 1\]"):
        InputSpec((8, 8), 1, (0.5,), (0.5,), crop_pct=1.5)


def test_preprocess_interpolation_modes():
    torch.manual_seed(0)
    imgs = torch.randint(0, 256, (2, 1, 28, 28), dtype=torch.uint8)
    plain = dict(mean=(0.0,), std=(1.0,))
    # bilinear is exactly what every run used before (antialiased bilinear)
    ref = F.interpolate(imgs.float() / 255, size=(40, 40), mode="bilinear", align_corners=False, antialias=True)
    torch.testing.assert_close(preprocess(imgs, InputSpec((40, 40), 1, **plain)), ref, rtol=0, atol=0)
    # bicubic overshoots at edges; the result is clamped to [0, 1] before normalising
    bic = preprocess(imgs, InputSpec((112, 112), 1, **plain, interpolation="bicubic"))
    raw = F.interpolate(imgs.float() / 255, size=(112, 112), mode="bicubic", align_corners=False, antialias=True)
    assert raw.max() > 1 or raw.min() < 0
    assert bic.min() >= 0 and bic.max() <= 1 and not torch.equal(bic, ref)
    # shrinking is antialiased: a 1-pixel checkerboard becomes flat grey, not aliased stripes
    checker = ((torch.arange(28)[:, None] + torch.arange(28)[None, :]) % 2 * 255).to(torch.uint8).view(1, 1, 28, 28)
    small = preprocess(checker, InputSpec((7, 7), 1, **plain, interpolation="bicubic"))
    assert (small - 0.5).abs().max() < 0.05
    # nearest doubles pixels exactly
    near = preprocess(imgs, InputSpec((56, 56), 1, **plain, interpolation="nearest"))
    torch.testing.assert_close(near, imgs.float().repeat_interleave(2, -1).repeat_interleave(2, -2) / 255)


def test_input_spec_for_follows_weights_pretrained_config(tmp_path):
    from safetensors.torch import save_file

    from nascompress.data import FMNIST_MEAN, IMAGENET_MEAN
    from nascompress.runs.io import make_arch
    from nascompress.models.build import ModelSpec, build_model
    from nascompress.train.run import input_spec_for

    w = tmp_path / "w.pth"
    torch.save({}, w)  # only its kind matters here: a foreign file, no nascompress metadata
    augreg = build_model(ModelSpec("vit_small_patch16_224", {"depth": 1, "img_size": 32, "num_classes": 10}))
    scratch = input_spec_for(augreg, "fashion-mnist")
    assert scratch.mean == (FMNIST_MEAN,) * 3 and scratch.interpolation == "bilinear" and scratch.crop_pct == 1.0
    spec = input_spec_for(augreg, "fashion-mnist", weights=w)
    assert spec.mean == (0.5, 0.5, 0.5) and spec.std == (0.5, 0.5, 0.5) and spec.interpolation == "bicubic"
    assert spec.img_size == (32, 32) and spec.crop_pct == pytest.approx(0.9)  # size: the model's own, not 224
    clip = build_model(ModelSpec("vit_base_patch16_clip_224.openai", {"depth": 1, "img_size": 32, "num_classes": 10}))
    assert input_spec_for(clip, "fashion-mnist", weights=w).mean == pytest.approx((0.48145466, 0.4578275, 0.40821073))
    dino = build_model(ModelSpec("vit_small_patch14_dinov2", {"depth": 1, "img_size": 28, "num_classes": 10}))
    assert input_spec_for(dino, "fashion-mnist", weights=w).mean == IMAGENET_MEAN
    # explicit values win; one value is broadcast; a wrong count is refused
    ov = InputOverrides(mean=(0.2,), std=(0.3, 0.3, 0.3), interpolation="bilinear", crop_pct=1.0)
    spec = input_spec_for(augreg, "fashion-mnist", weights=w, overrides=ov)
    assert (spec.mean, spec.std, spec.interpolation, spec.crop_pct) == ((0.2,) * 3, (0.3,) * 3, "bilinear", 1.0)
    with pytest.raises(NascompressError, match="mean has 2 values but the model takes 3 channels"):
        input_spec_for(augreg, "fashion-mnist", overrides=InputOverrides(mean=(0.1, 0.2)))
    # a nascompress file carries the preprocessing it was trained with
    recorded = InputSpec((32, 32), 3, (0.25,) * 3, (0.75,) * 3, interpolation="nearest", crop_pct=0.8)
    f = tmp_path / "n.safetensors"
    save_file(
        {"x": torch.zeros(1)},
        str(f),
        metadata={
            "nascompress_arch": json.dumps(make_arch(ModelSpec("vit_small_patch16_224"), input_spec=recorded.to_dict()))
        },
    )
    assert input_spec_for(augreg, "fashion-mnist", weights=f) == recorded


def test_train_with_weights_records_pretrained_preprocessing(tmp_path, tiny_run):
    from nascompress.models.build import build_model, custom_vit_spec

    src = build_model(
        custom_vit_spec(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=10, in_chans=1)
    )
    torch.save(src.state_dict(), tmp_path / "foreign.pth")
    base = [
        "train",
        "--img-size",
        16,
        "--embed-dim",
        32,
        "--depth",
        2,
        "--num-heads",
        2,
        "--dataset",
        "synthetic",
        "--train-limit",
        64,
        "--eval-limit",
        20,
        "--epochs",
        1,
    ]

    def arch_input(name, *args):
        r = invoke(*base, "--out", tmp_path / name, *args)
        assert r.exit_code == 0, r.output
        return json.loads((tmp_path / name / "arch.json").read_text())["input"]

    # the custom ViT is timm's vit_tiny_patch16_224 (augreg: mean/std 0.5, bicubic, crop 0.9)
    foreign = arch_input("foreign", "--weights", tmp_path / "foreign.pth")
    assert foreign == {
        "img_size": [16, 16],
        "in_chans": 1,
        "mean": [0.5],
        "std": [0.5],
        "interpolation": "bicubic",
        "crop_pct": 0.9,
        "crop_mode": "center",
    }
    # a nascompress run's weights keep the preprocessing they were trained with
    own = json.loads((tiny_run / "arch.json").read_text())["input"]
    assert arch_input("own", "--weights", tiny_run / "model.safetensors")["mean"] == own["mean"]
    over = arch_input(
        "over",
        "--weights",
        tmp_path / "foreign.pth",
        "--mean",
        "0.1",
        "--std",
        "0.2",
        "--interpolation",
        "nearest",
        "--crop-pct",
        "0.5",
    )
    assert (over["mean"], over["std"], over["interpolation"], over["crop_pct"]) == ([0.1], [0.2], "nearest", 0.5)
    r = invoke(*base, "--out", tmp_path / "bad", "--mean", "a,b")
    assert r.exit_code == 1 and "--mean takes comma-separated numbers" in r.stderr and not (tmp_path / "bad").exists()


# ---------------------------------------------------------------------------------------------
# B. ImageFolder: timm's transforms, ending in uint8 without normalisation


def test_image_folder_eval_transform_is_timms(tmp_path):
    from PIL import Image
    from timm.data import create_transform

    root = make_folder(tmp_path, counts={"a": 1, "b": 1}, size=(30, 50))
    spec = InputSpec((16, 16), 3, (0.5,) * 3, (0.25,) * 3, interpolation="bicubic", crop_pct=0.8)
    x = folder_transform(spec, train=False)(Image.open(root / "train" / "a" / "0.png").convert("RGB"))
    assert x.dtype == torch.uint8 and x.shape == (3, 16, 16)
    timm_tf = create_transform((3, 16, 16), interpolation="bicubic", crop_pct=0.8, mean=spec.mean, std=spec.std)
    ref = timm_tf(Image.open(root / "train" / "a" / "0.png").convert("RGB"))
    torch.testing.assert_close(preprocess(x[None], spec)[0], ref, rtol=0, atol=1e-5)
    # shorter side to int(16 / 0.8) = 20, then a centre crop: the gradient's middle, not the whole width
    assert 60 < int(x[0, 0, 0]) and int(x[0, 0, -1]) < 200


def test_image_folder_train_view_and_eval_view_share_split(tmp_path):
    root = make_folder(tmp_path, size=(32, 32))
    spec = InputSpec((16, 16), 3, (0.5,) * 3, (0.5,) * 3, interpolation="bicubic")
    b = load_data(DataConfig(dataset=str(root), val_fraction=0.25, num_workers=0), spec=spec)
    assert isinstance(b.train, Subset) and isinstance(b.val, Subset)
    assert b.train.base.samples is b.val.base.samples  # one scan of train/, two views
    tr, va = set(b.train.indices.tolist()), set(b.val.indices.tolist())
    te = set(b.test.indices.tolist())  # no test/: carved from train/ too
    assert not tr & va and not te & (tr | va) and len(tr | va | te) == sum(COUNTS.values())

    def names(ds):
        return [type(t).__name__ for t in ds.base.transform.transforms]

    assert names(b.train)[:2] == ["RandomResizedCropAndInterpolation", "RandomHorizontalFlip"]
    assert "ColorJitter" not in names(b.train) and names(b.train)[-1] == "MaybePILToTensor"
    assert names(b.val) == ["Resize", "CenterCrop", "MaybePILToTensor"]
    torch.manual_seed(0)
    draws = {tuple(b.train[0][0].flatten().tolist()) for _ in range(6)}
    assert len(draws) > 1  # random crops and flips
    assert torch.equal(b.val[0][0], b.val[0][0])
    plain = load_data(DataConfig(dataset=str(root), val_fraction=0.25, num_workers=0), spec=spec, augment=False)
    assert names(plain.train) == names(plain.val) and torch.equal(plain.train.indices, b.train.indices)
    x, y = next(iter(make_loader(b.train, batch_size=5, shuffle=True)))
    assert x.shape == (5, 3, 16, 16) and x.dtype == torch.uint8


def test_image_folder_with_val_dir_uses_eval_transform(tmp_path):
    root = make_folder(tmp_path, counts={"a": 2, "b": 2}, splits=("train", "val"))
    b = load_data(DataConfig(dataset=str(root), num_workers=0), img_size=(16, 16))
    assert [type(t).__name__ for t in b.val.base.transform.transforms][-2:] == ["CenterCrop", "MaybePILToTensor"]
    assert type(b.train.transform.transforms[0]).__name__ == "RandomResizedCropAndInterpolation"
    assert b.test is not b.val and len(b.val) + len(b.test) == 4  # no test/: half of val/ carved as the test split


def test_loader_workers_are_automatic_and_deterministic(tmp_path):
    import os

    root = make_folder(tmp_path, counts={"a": 6, "b": 6}, size=(24, 24))
    b = load_data(DataConfig(dataset=str(root), val_fraction=0.5), img_size=(16, 16))  # both classes in val
    assert b.train.num_workers == b.val.num_workers == min(4, os.cpu_count())
    assert load_data(DataConfig(dataset="synthetic")).train.num_workers == 0
    one = load_data(DataConfig(dataset=str(root), num_workers=1, val_fraction=0.5), img_size=(16, 16))
    loader = make_loader(one.train, batch_size=4, shuffle=True, seed=3, epoch=1)
    assert loader.num_workers == 1
    assert make_loader(one.train, batch_size=4, shuffle=True, num_workers=0).num_workers == 0  # explicit wins
    first = [x for x, _ in loader]
    again = [x for x, _ in make_loader(one.train, batch_size=4, shuffle=True, seed=3, epoch=1)]
    assert all(torch.equal(a, c) for a, c in zip(first, again))  # augmentation seeded by (seed, epoch)
    other = [x for x, _ in make_loader(one.train, batch_size=4, shuffle=True, seed=3, epoch=2)]
    assert not all(torch.equal(a, c) for a, c in zip(first, other))
    val_w = torch.cat([x for x, _ in make_loader(one.val, batch_size=4, shuffle=False)])
    val_0 = torch.cat([x for x, _ in make_loader(one.val, batch_size=4, shuffle=False, num_workers=0)])
    assert torch.equal(val_w, val_0)


def test_digits_is_a_real_builtin_dataset():
    """scikit-learn's bundled digits: 1,797 real 8x8 images, a fixed stratified test split, no download."""
    from nascompress.data import DataConfig, load_data

    b = load_data(DataConfig(dataset="digits"))
    assert b.name == "digits" and b.classes == [str(c) for c in range(10)] and b.native_size == (8, 8)
    assert len(b.train) + len(b.val) + len(b.test) == 1797 and len(b.test) == 449
    x, y = b.test[0]
    assert x.dtype == torch.uint8 and tuple(x.shape) == (1, 8, 8) and 0 <= int(y) < 10
    imgs = lambda ds: {bytes(ds[i][0].numpy()) for i in range(len(ds))}  # noqa: E731
    assert len(imgs(b.train) & imgs(b.test)) < 10  # disjoint splits (a few digits are pixel-identical)
    again = load_data(DataConfig(dataset="digits"))
    assert torch.equal(again.test[5][0], b.test[5][0])  # the same split every time


def test_lfw_faces_is_a_real_builtin_dataset_of_another_domain():
    """scikit-image's bundled LFW subset: 200 real 25x25 photographs, faces vs non-faces, a fixed
    stratified test split, no download."""
    from nascompress.data import count_classes

    b = load_data(DataConfig(dataset="lfw-faces"))
    assert b.name == "lfw-faces" and b.classes == ["face", "non-face"] and b.native_size == (25, 25)
    assert len(b.train) + len(b.val) + len(b.test) == 200 and len(b.test) == 50
    assert torch.bincount(dataset_labels(b.test)).tolist() == [25, 25]
    x, _ = b.train[0]
    assert x.dtype == torch.uint8 and tuple(x.shape) == (1, 25, 25) and int(x.max()) > 100
    assert count_classes(DataConfig(dataset="lfw-faces")) == 2
    assert torch.equal(load_data(DataConfig(dataset="lfw-faces")).test[7][0], b.test[7][0])


def test_classes_keeps_a_subset_relabelled_in_order(tmp_path):
    from nascompress.data import count_classes

    full = load_data(DataConfig(dataset="digits"))
    b = load_data(DataConfig(dataset="digits", classes="7,1,3"))
    assert b.classes == ["7", "1", "3"] and count_classes(DataConfig(dataset="digits", classes="7,1,3")) == 3
    for split in ("train", "val", "test"):
        labels = dataset_labels(b.split(split))
        assert set(labels.tolist()) == {0, 1, 2}
        old = dataset_labels(full.split(split))
        if split == "test":  # the test split is the same images, only those classes, relabelled 7->0, 1->1, 3->2
            assert len(labels) == int(sum((old == k).sum() for k in (7, 1, 3)))
            kept = [i for i in range(len(full.test)) if int(old[i]) in (7, 1, 3)]  # in their order
            for j in (0, 1, len(kept) - 1):
                x, y = full.test[kept[j]]
                assert torch.equal(b.test[j][0], x) and int(b.test[j][1]) == {7: 0, 1: 1, 3: 2}[int(y)]
    # the same subset by name on an ImageFolder, relabelled as named (a limit then draws from it)
    root = make_folder(tmp_path)
    f = load_data(DataConfig(dataset=str(root), classes="cat,ant", val_fraction=0.25, num_workers=0), img_size=(16, 16))
    assert f.classes == ["cat", "ant"] and len(f.train) + len(f.val) + len(f.test) == COUNTS["cat"] + COUNTS["ant"]
    assert set(dataset_labels(f.train).tolist()) == {0, 1}
    _, ys = next(iter(make_loader(f.train, batch_size=64, shuffle=False)))
    assert torch.equal(ys, dataset_labels(f.train))


@pytest.mark.parametrize(
    "spec, msg",
    [
        ("3,x", "'x', which is not a class"),
        ("4", "at least 2 classes"),
        ("2,2", "twice"),
        ("1,10", "'10', which is not a class"),
    ],
)
def test_classes_refuses_unknown_repeated_or_single_classes(spec, msg):
    with pytest.raises(NascompressError, match=msg):
        load_data(DataConfig(dataset="digits", classes=spec))


# ---------------------------------------------------------------------------------------------
# the ImageFolder training augmentation: a setting (none | light | default), recorded in the run


def test_augment_setting_picks_the_training_transform(tmp_path):
    import random

    from nascompress.data import load_data

    root = make_folder(tmp_path / "f", counts={"a": 4, "b": 4}, size=(20, 24), splits=("train", "val"))
    spec = InputSpec((16, 16), 3, (0.5,), (0.5,))

    def draws(augment):
        train = load_data(DataConfig(dataset=str(root), augment=augment, num_workers=0), spec=spec).train
        random.seed(0)
        torch.manual_seed(0)
        return [train[0][0] for _ in range(12)]

    none, light, default = draws("none"), draws("light"), draws("default")
    assert all(torch.equal(x, none[0]) for x in none)  # none: the evaluation resize + centre crop, no randomness
    assert any(not torch.equal(x, light[0]) for x in light) and any(not torch.equal(x, default[0]) for x in default)

    # light never flips: the left-right gradient always rises; default flips some draws
    def rises(x):
        return bool(x[0, :, -1].float().mean() > x[0, :, 0].float().mean())

    assert all(rises(x) for x in light) and not all(rises(x) for x in default)
    assert DataConfig().augment == "default"  # unchanged unless asked
    with pytest.raises(NascompressError, match="augment must be one of none, light, default"):
        DataConfig(augment="heavy")


def test_train_records_the_augment_setting(tmp_path):
    root = make_folder(tmp_path / "f", counts={"a": 4, "b": 4}, size=(20, 24), splits=("train", "val"))
    out = tmp_path / "run"
    r = invoke(
        "train",
        "--out",
        out,
        "--dataset",
        root,
        "--augment",
        "none",
        "--img-size",
        16,
        "--patch-size",
        8,
        "--embed-dim",
        16,
        "--depth",
        1,
        "--num-heads",
        2,
        "--epochs",
        1,
        "--json",
    )
    assert r.exit_code == 0, r.output
    assert json.loads((out / "config.json").read_text())["data"]["augment"] == "none"


def test_only_unaugmented_training_images_are_fixed(tmp_path):
    """``fixed_train_images`` (what lets the DCS search cache its teacher's outputs per image): in-memory
    data, and an ImageFolder whose training transform does not augment (``augment: none``)."""
    from nascompress.data import DataConfig, InputSpec, load_data

    root = make_folder(tmp_path / "f", splits=("train", "val"))
    spec = InputSpec(img_size=(16, 16), in_chans=3, mean=(0.5,) * 3, std=(0.5,) * 3)
    assert load_data(DataConfig(dataset=str(root), augment="none"), spec=spec).extra["fixed_train_images"]
    assert not load_data(DataConfig(dataset=str(root)), spec=spec).extra["fixed_train_images"]
    assert not load_data(DataConfig(dataset=str(root), augment="light"), spec=spec).extra["fixed_train_images"]
    assert load_data(DataConfig(dataset="synthetic"), spec=spec).extra["fixed_train_images"]
