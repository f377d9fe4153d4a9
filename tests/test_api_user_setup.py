"""The Python API as a Torch-Pruning or ModelOpt user holds it (issue 69 items 1, 3, 4; issue 68 item 5):
the FLOPs target is a bound (met, or a warning saying by how much), a goal is compared at the precision
the report prints, the caller's DataLoader batch size and frozen parameters are honoured, and the
models users hold (half / bf16, compiled, DataParallel, dynamic_img_size, qk_norm, a torch.device,
an unsupported device) are taken or refused in one line before anything runs."""

from __future__ import annotations

import warnings

import pytest
import timm
import torch

import nascompress as nc
from nascompress.errors import NascompressError


def tiny_vit(**kw) -> torch.nn.Module:
    """A tiny timm ViT on 16x16 one-channel images (2 blocks 32 wide, 2 heads), seeded 0."""
    torch.manual_seed(0)
    args = dict(img_size=16, patch_size=4, in_chans=1, num_classes=10, embed_dim=32, depth=2, num_heads=2)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, **dict(args, **kw))


def tensor_data(n: int, seed: int = 0) -> torch.utils.data.TensorDataset:
    from nascompress.data import synthetic_dataset

    ds = synthetic_dataset(n, seed=seed)
    return torch.utils.data.TensorDataset((ds.images.float() / 255 - 0.5) / 0.5, ds.labels)


SEARCH = dict(epochs=1, batch_size=32, arch_lr=0.05, device="cpu")


# -- 69.1: the budget is a bound ------------------------------------------------------------------


def test_compress_asks_its_channel_search_to_land_at_or_under_the_target():
    from nascompress.data import DataConfig
    from nascompress.pyapi.compress import pipeline_config

    cfg = pipeline_config(
        DataConfig(dataset="synthetic"),
        "base",
        target_flops=0.6,
        methods=("dcs",),
        teacher=None,
        epochs=1,
        seed=0,
        device="cpu",
        trials=2,
        latency=False,
        stages={},
    )
    assert cfg["stages"]["dcs"]["at_most"] is True and cfg["goal"] == {"max_flops": 0.6}


def test_dcs_search_lands_at_or_under_its_target_and_says_so():
    s = nc.dcs.search(tiny_vit(), tensor_data(200), target_flops=0.7, **dict(SEARCH, device=torch.device("cpu")))
    assert s.config.get("search")["at_most"] is True
    assert s.metrics.flops_ratio <= 0.7 and s.over_target == 0.0


def test_a_search_above_its_target_warns_by_how_much():
    from nascompress.pyapi.dcs import over_target, warn_over_target

    metrics = {"cost": "flops", "target_flops": 0.6, "flops_ratio": 0.6015}
    assert over_target(metrics) == pytest.approx(0.0015)
    with pytest.warns(UserWarning, match=r"above target_flops=0.6 by 0.0015x"):
        warn_over_target("nc.dcs.search", metrics)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_over_target("nc.dcs.search", dict(metrics, flops_ratio=0.5999))  # under: silent


def test_compress_reports_the_bound_exactly_and_warns_over_it():
    from nascompress.pipeline.summary import Summary
    from nascompress.pyapi.compress import budget_report

    def summary(ratio: float, **more) -> Summary:
        return Summary.new(comparison={"flops_ratio": ratio}, **more)

    config = {"goal": {"max_flops": 0.6}}
    met, over = budget_report(summary(0.6004, goal={"met": True}), config)
    assert met is False and over == pytest.approx(0.0004)  # a bound: exact
    with pytest.warns(UserWarning, match=r"above target_flops=0.6 by 0.0004x"):
        budget_report(summary(0.6004), config, warn=True)
    assert budget_report(summary(0.5966), config) == (True, 0.0)


# -- 68.5: goals by a hair ------------------------------------------------------------------------


def test_the_confirm_step_takes_a_channel_model_at_the_goal_as_printed():
    from nascompress.pipeline.confirm import why_not

    assert why_not("stacked", 0.6004, 0.6) is None  # printed 0.600x: it meets the 0.6x goal
    reason = why_not("stacked", 0.6012, 0.6)
    assert reason is not None and "above it by 0.0012x" in reason


def test_a_missed_goal_says_by_how_much():
    from nascompress.pipeline.goal import flops_goal, latency_goal
    from nascompress.pipeline.report_format import goal_text
    from nascompress.pipeline.summary import Summary

    assert flops_goal(0.6004, 0.6).met is True
    g = flops_goal(0.6015, 0.6)
    assert g.met is False and g.missed_by == pytest.approx(0.0015) and "by 0.0015x" in g.statement
    assert "NOT met (above it by 0.0015x)" in goal_text(Summary.new(goal=g))
    lat = latency_goal(2.5, 2.0)
    assert lat.met is False and lat.missed_by == pytest.approx(0.5) and "by 0.50 ms" in lat.statement
    assert latency_goal(2.004, 2.0).met is True


# -- 69.4: models users hold ----------------------------------------------------------------------


def test_wrapped_models_are_unwrapped():
    from nascompress.pyapi.common import model_and_arch

    m = tiny_vit().eval()
    for wrapped in (torch.nn.DataParallel(m), torch.compile(m)):
        got, arch = model_and_arch(wrapped)
        assert type(got).__name__ == "VisionTransformer" and arch.spec.kwargs["embed_dim"] == 32


def test_a_half_model_is_copied_to_fp32_and_left_as_it_is():
    from nascompress.pyapi.common import model_and_arch

    m = tiny_vit().eval().half()
    got, _ = model_and_arch(m)
    assert next(got.parameters()).dtype == torch.float32 and next(m.parameters()).dtype == torch.float16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_model_is_never_moved_to_the_cpu_in_place(tmp_path):
    from nascompress.pyapi.common import model_run
    from nascompress.pyapi.workspace import Workspace

    m = tiny_vit().eval().cuda()
    with Workspace(tmp_path / "w") as ws:
        model_run(m, ws, "source")
    assert next(m.parameters()).device.type == "cuda"


def test_dynamic_img_size_is_kept_on_the_compressed_model():
    s = nc.dcs.search(tiny_vit(dynamic_img_size=True).half(), tensor_data(200), target_flops=0.7, **SEARCH)
    small = nc.materialize(s).model
    with torch.no_grad():
        assert small(torch.randn(2, 1, 12, 12)).shape == (2, 10)  # 12 px: the dense model took it too


def test_devices_users_hold():
    with pytest.raises(NascompressError, match=r"device='mps' is not supported"):
        nc.dcs.search(tiny_vit(), tensor_data(64), device="mps")
    with pytest.raises(NascompressError, match=r"device='mps' is not supported"):
        nc.compress(tiny_vit(), tensor_data(64), methods=("dcs",), device="mps", progress=False)
    from nascompress.pyapi.user_model import device_name

    assert device_name(torch.device("cpu")) == "cpu" and device_name("auto") == "auto"


def test_qk_norm_is_refused_before_searching():
    m = tiny_vit(qk_norm=True)
    with pytest.raises(NascompressError, match=r"qk_norm=True.*give qk_mask='none'"):
        nc.dcs.search(m, tensor_data(64), **SEARCH)
    with pytest.raises(NascompressError, match=r"qk_norm=True.*give dcs=\{'qk_mask': 'none'\}"):
        nc.compress(m, tensor_data(64), methods=("dcs",), progress=False)


# -- 69.3: the user's data setup ------------------------------------------------------------------


def test_compress_needs_train():
    with pytest.raises(NascompressError, match=r"nc.compress needs train="):
        nc.compress(tiny_vit(), methods=("dcs",), progress=False)


def test_compress_honours_the_loaders_batch_size_and_the_frozen_parameters():
    m = tiny_vit().half()
    m.patch_embed.requires_grad_(False)
    loader = torch.utils.data.DataLoader(tensor_data(300), batch_size=24)
    small = nc.compress(  # the frozen parameters are trained by no stage (tests/test_api_frozen.py)
        m,
        loader,
        tensor_data(100, 1),
        target_flops=0.7,
        methods=("dcs",),
        epochs=1,
        device=torch.device("cpu"),
        latency=False,
        progress=False,
        dcs={"epochs": 1, "arch_lr": 0.05},
    )
    stages = small.report.config["stages"]
    assert stages["dcs"]["batch_size"] == 24 and stages["retrain"]["batch_size"] == 24
    assert small.report.goal_met and small.report.flops_ratio <= 0.7 and small.report.over_target == 0.0
    assert small.report.splits  # which images decided and which measured the accuracy printed
    assert next(small.model.parameters()).dtype == torch.float16  # the caller's dtype
    frozen = {n for n, p in small.model.named_parameters() if not p.requires_grad}
    assert frozen == {"patch_embed.proj.weight", "patch_embed.proj.bias"}


class RandomFlip(torch.utils.data.Dataset):
    """A caller's augmented dataset: every item is flipped at random (torch's RNG), as a random
    torchvision transform does."""

    def __init__(self, base: torch.utils.data.TensorDataset):
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int):
        x, y = self.base[i]
        return (x.flip(-1) if torch.rand(()) < 0.5 else x), y


def test_an_augmented_dataset_keeps_its_name_for_resume():
    from nascompress.pyapi.common import data_config

    ds = RandomFlip(tensor_data(64))
    names = {data_config(ds, val=ds).dataset for _ in range(4)}
    assert len(names) == 1  # out= resumes: the same dataset, though its transform draws anew


def test_the_validation_split_carved_from_a_callers_dataset_is_class_stratified():
    from nascompress.data import load_data
    from nascompress.data.splits import dataset_labels
    from nascompress.pyapi.common import data_config

    x = torch.randn(100, 1, 16, 16, generator=torch.Generator().manual_seed(0))
    balanced = torch.utils.data.TensorDataset(x, torch.arange(100) % 10)  # 10 images a class
    data = load_data(data_config(balanced), augment=False)
    val = dataset_labels(data.val)
    assert sorted(val.tolist()) == list(range(10))  # one image of every class (val_fraction 0.1)
