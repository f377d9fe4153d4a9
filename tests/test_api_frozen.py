"""Issue 69's last items: parameters the caller froze (``requires_grad=False``) are trained by no
stage (recorded in the run's arch.json, left out of every optimizer, the DCS search's recovery
included) and come back frozen and bit-identical (the kept rows where a method slices them);
one-hot and probability-vector labels are taken as their argmax, said in a warning; a built-in
dataset's images converted to the model's size and channels, and a caller's uint8 images scaled,
are said in one warning each."""

from __future__ import annotations

import warnings

import pytest
import torch

import nascompress as nc
from nascompress.errors import NascompressError

from .test_api_user_setup import tensor_data, tiny_vit


def frozen_vit() -> torch.nn.Module:
    """:func:`tiny_vit` with its patch embedding and first block frozen."""
    m = tiny_vit()
    m.patch_embed.requires_grad_(False)
    m.blocks[0].requires_grad_(False)
    return m


FROZEN = {
    "patch_embed.proj.weight",
    "patch_embed.proj.bias",
    *(f"blocks.0.{n}" for n, _ in tiny_vit().blocks[0].named_parameters()),
}


def kept_slices(small: torch.Tensor, big: torch.Tensor) -> bool:
    """Is ``small`` ``big`` itself, or ``big`` with some slices along one dimension kept, bit for bit?"""
    if small.shape == big.shape:
        return torch.equal(small, big)
    dims = [d for d in range(big.ndim) if small.shape[d] != big.shape[d]]
    if small.ndim != big.ndim or len(dims) != 1:
        return False
    s, b = (t.movedim(dims[0], 0).reshape(t.shape[dims[0]], -1) for t in (small, big))
    return bool((s[:, None, :] == b[None, :, :]).all(-1).any(1).all())


def assert_frozen_kept(
    out: torch.nn.Module, given: torch.nn.Module, before: dict[str, torch.Tensor], *, folded: tuple[str, ...] = ()
) -> list[str]:
    """``out``'s frozen parameters are the given model's (``before``), bit for bit or their kept
    slices, and its flags the given ones; ``folded``: biases the method shifted (DCS folds the closed
    neurons' mean activation into fc2's), left to the caller. Returns the names of the sliced ones."""
    flags = {n: p.requires_grad for n, p in out.named_parameters()}
    assert {n for n, f in flags.items() if not f} == FROZEN  # the given model's flags, no other
    own = dict(out.named_parameters())
    sliced = [n for n in FROZEN if own[n].shape != before[n].shape]
    for n in FROZEN - set(folded):
        assert kept_slices(own[n].detach().float(), before[n]), n
    assert all(not p.requires_grad for n, p in given.named_parameters() if n in FROZEN)  # the caller's model as given
    return sliced


def snapshot(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in m.named_parameters()}


# -- 69.3: frozen parameters ----------------------------------------------------------------------


def test_without_frozen_leaves_the_named_parameters_out_of_the_optimizer():
    from nascompress.train.hooks import param_groups
    from nascompress.train.loop import without_frozen

    m = tiny_vit()
    groups = without_frozen(param_groups(m, weight_decay=0.05), m, sorted(FROZEN))
    names = {id(p): n for n, p in m.named_parameters()}
    kept = {names[id(p)] for g in groups for p in g["params"]}
    assert kept == set(names.values()) - FROZEN and all(g["params"] for g in groups)
    assert without_frozen(groups, m, None) is groups


def test_compress_trains_no_frozen_parameter_and_gives_them_back_frozen(tmp_path):
    m = frozen_vit()
    before = snapshot(m)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no warning that they were trained: they are not
        small = nc.compress(
            m,
            tensor_data(160),
            tensor_data(60, 1),
            target_flops=0.7,
            methods=("dcs",),
            epochs=1,
            device="cpu",
            latency=False,
            progress=False,
            dcs={"epochs": 1, "arch_lr": 0.05, "batch_size": 32},
            retrain={"batch_size": 32},
            out=tmp_path,
        )
    assert sorted(small.arch.frozen) == sorted(FROZEN)  # recorded in the run's arch.json, once
    gathered = nc.load(tmp_path / "pipeline" / "dcs_mat")  # the materialized model, before its retraining
    sliced = assert_frozen_kept(small.model, m, before, folded=("blocks.0.mlp.fc2.bias",))
    assert "blocks.0.mlp.fc1.weight" in sliced  # the search pruned block 0's MLP: its kept rows are the given ones
    own, mat = dict(small.model.named_parameters()), dict(gathered.named_parameters())
    assert all(torch.equal(own[n].detach(), mat[n].detach()) for n in FROZEN)  # the retraining left them
    assert not torch.equal(mat["head.weight"].detach(), before["head.weight"])  # the rest was trained


def test_the_search_and_retrain_train_no_frozen_parameter():
    m = frozen_vit()
    before = snapshot(m)
    data = tensor_data(128)
    s = nc.dcs.search(m, data, target_flops=0.7, epochs=1, batch_size=32, arch_lr=0.05, device="cpu", progress=False)
    assert s.metrics.comparison.recovery.steps > 0  # the recovery of the kept model ran (and left them)
    assert_frozen_kept(s.model, m, before)
    assert not torch.equal(s.model.head.weight.detach(), before["head.weight"])  # the rest trained
    r = nc.retrain(m, data, epochs=1, batch_size=32, device="cpu", progress=False)
    assert_frozen_kept(r.model, m, before)


def test_a_token_methods_fine_tune_trains_no_frozen_parameter():
    m = frozen_vit()
    before = snapshot(m)
    r = nc.tokens.apply(
        m, "evit", tensor_data(128), epochs=1, batch_size=32, keep_rate=0.7, device="cpu", progress=False
    )
    assert_frozen_kept(r.model, m, before)


# -- 69.4: one-hot and probability-vector labels --------------------------------------------------


def test_one_hot_and_soft_labels_are_taken_as_their_argmax_with_a_warning():
    from nascompress.data.memory import CallerDataset

    x, y = torch.randn(20, 1, 16, 16), torch.arange(20) % 5
    one_hot = torch.nn.functional.one_hot(y, 5).float()
    soft = one_hot * 0.8 + 0.04  # label smoothing: rows sum to 1
    for labels in (one_hot, soft):
        with pytest.warns(UserWarning, match=r"one-hot or probability-vector labels \(20 of 20\).*argmax"):
            ds = CallerDataset(torch.utils.data.TensorDataset(x, labels))
        assert torch.equal(ds.labels, y) and ds[3][1] == 3
    targeted = torch.utils.data.TensorDataset(x, one_hot)
    targeted.targets = one_hot  # a (N, K) targets attribute
    with pytest.warns(UserWarning, match=r"one-hot"):
        assert torch.equal(CallerDataset(targeted).labels, y)
    with pytest.raises(NascompressError, match=r"has label a Tensor of shape \(5,\); .*one-hot"):
        CallerDataset(torch.utils.data.TensorDataset(x, one_hot * 2))  # neither an index nor a distribution


# -- 69.3: conversions are said ---------------------------------------------------------------------


def test_a_callers_uint8_images_are_said_to_be_scaled():
    from nascompress.data.memory import CallerDataset

    labels = torch.arange(8) % 2
    with pytest.warns(UserWarning, match=r"data gives uint8 images: they are divided by 255"):
        CallerDataset(torch.utils.data.TensorDataset(torch.zeros(8, 1, 4, 4, dtype=torch.uint8), labels))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        CallerDataset(torch.utils.data.TensorDataset(torch.zeros(8, 1, 4, 4), labels))  # float: nothing to say


def test_the_builtin_shapes_are_those_load_data_reads():
    from nascompress.data import DataConfig, load_data
    from nascompress.pyapi.data_notes import BUILTIN_SHAPES

    for name in ("digits", "synthetic"):
        d = load_data(DataConfig(dataset=name, train_limit=20, eval_limit=20), img_size=(16, 16))
        assert BUILTIN_SHAPES[name] == (d.native_channels, *d.native_size)


def test_each_conversion_of_a_builtin_dataset_is_one_line():
    from nascompress.pyapi.data_notes import conversions

    rgb32 = {"img_size": [32, 32], "in_chans": 3, "interpolation": "bicubic"}
    assert conversions("fashion-mnist", rgb32) == [
        "fashion-mnist's 28x28 px images are resized (bicubic) to the model's 32x32",
        "fashion-mnist's 1-channel images are repeated to the model's 3 channels",
    ]
    assert conversions("fashion-mnist", {"img_size": [28, 28], "in_chans": 1}) == []
    assert conversions("/some/imagefolder", rgb32) == []


def test_retrain_on_a_builtin_dataset_warns_of_its_resize():
    with pytest.warns(
        UserWarning, match=r"nc.retrain: digits's 8x8 px images are resized \(bilinear\) to the model's 16x16"
    ):
        nc.retrain(
            tiny_vit(), "digits", epochs=1, batch_size=32, train_limit=64, eval_limit=64, device="cpu", progress=False
        )
