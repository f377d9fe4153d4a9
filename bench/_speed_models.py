"""The models of ``bench/speed.py``: the shipped dense geometries (``GEOMETRIES``) and every method's model
built from a dense timm ViT at given settings, without training (``zoo``), plus a pipeline run's dense
base and final model (``pipeline_models``).

Channel-pruned models are built without a search, by weight magnitude, at a FLOPs target by bisection on
the kept share: ``dcs`` is a DCS-materialized model of the static Q/K + hidden family (per block the
``share`` largest hidden neurons by ``||fc1 row|| x ||fc2 column||`` and per head the ``share`` largest
Q/K channels by ``||W_q row|| x ||W_k row||``: ``methods.dcs.channel_importance``), shaped through the
method's own loading path (``build_materialized``); ``uniform`` is ``methods.uniform.uniform_at_flops``.
Speed does not depend on the weights, except where a token method's choices set the work (DynamicViT's
and Sparsifiner's predictors, MG-ViT's early exit): their weights are random here (MG-ViT at epsilon 1:
every image through both stages, its slowest case), which ``NOTES`` says in the JSON."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Callable

from _common import torch_pruning_keep  # noqa: E402  (puts the repository on sys.path)
from _standins import main_job_spec  # noqa: E402

import torch  # noqa: E402

import nascompress  # noqa: E402
from nascompress.models.layers import aligned_width  # noqa: E402
from nascompress.methods import get_method  # noqa: E402
from nascompress.methods.dcs import DCSConfig, build_materialized
from nascompress.methods.dcs_importance import channel_importance  # noqa: E402
from nascompress.methods.uniform import uniform_at_flops, uniform_from_keep  # noqa: E402
from nascompress.models.build import ModelSpec, build_model, custom_vit_spec  # noqa: E402
from nascompress.profiling import PRICED_METHODS, count_flops  # noqa: E402
from nascompress.models.weights import load_pretrained  # noqa: E402

TARGET = 0.6  # the FLOPs ratio of the channel-pruned models

NOTES = {
    "weights": "random weights (speed does not depend on them) unless --weights / --pipeline gives trained ones",
    "channels": "dcs and uniform keep channels by weight magnitude, at the share nearest 0.6x FLOPs "
    "(bisection); torch_pruning: Torch-Pruning's MLP hidden neurons at 0.6x (bench/_common.torch_pruning_keep)",
    "tome": "ToMe's r (every layer) is the one whose FLOPs ratio is nearest 0.6x",
    "token_methods": "DynamicViT's and Sparsifiner's predictors are random: their keep counts are fixed by "
    "their settings (rho, keep ratio), not by the weights; MG-ViT at epsilon 1 sends every image through "
    "both stages (its slowest case)",
}


GEOMETRIES: dict[str, Callable[[], ModelSpec]] = {
    "mainjob": main_job_spec,
    "deit_s_224": lambda: ModelSpec("deit_small_patch16_224", {"num_classes": 1000}),
    "dinov2_s14_112": lambda: ModelSpec("vit_small_patch14_dinov2", {"img_size": 112, "num_classes": 10}),
    # the tests' geometry: a few ms per model
    "tiny": lambda: custom_vit_spec(
        img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=4, in_chans=1
    ),
}


def dense_model(geometry: str, weights: str | None = None) -> tuple[torch.nn.Module, ModelSpec]:
    """The dense model of ``geometry`` (random weights, seeded; ``weights``: a timm state dict file, e.g.
    the converted DINOv2 checkpoint of ``tools/convert_dinov2.py``, head left at its init)."""
    spec = GEOMETRIES[geometry]()
    torch.manual_seed(0)
    model = build_model(spec).eval()
    if weights:
        load_pretrained(model, weights, reset_head=True)
    return model, spec


def input_shape(model: torch.nn.Module) -> tuple[int, int, int]:
    return (model.patch_embed.proj.in_channels, *model.patch_embed.img_size)


_DENSE_FLOPS: dict[tuple[int, tuple[int, ...]], float] = {}  # (id of the dense model, input shape) -> its FLOPs


def flops_ratio(model: torch.nn.Module, dense: torch.nn.Module, x: torch.Tensor) -> float:
    key = (id(dense), tuple(x.shape))
    if key not in _DENSE_FLOPS:
        _DENSE_FLOPS[key] = count_flops(dense, x).total
    return count_flops(model, x).total / _DENSE_FLOPS[key]


# ---------------------------------------------------------------------------------------------
# Channel-pruned models at a FLOPs target


def dcs_hidden_blocks(dense: torch.nn.Module, share: float, align: int) -> list[dict[str, Any]]:
    """Per block: the ``share`` largest MLP hidden neurons and Q/K channels per head (weight magnitude),
    counts rounded up to ``align``, as a DCS materialized record's blocks."""
    blocks = []
    for blk in dense.blocks:
        imp = channel_importance(blk)
        n, (_, d) = imp.hidden.numel(), imp.qk.shape
        k = aligned_width(max(1, round(share * n)), align=align, full=n)
        kq = aligned_width(max(1, round(share * d)), align=align, full=d)
        blocks.append(
            {
                "hidden_keep": imp.hidden.topk(k).indices.sort().values.tolist(),
                "qk_keep": [row.topk(kq).indices.sort().values.tolist() for row in imp.qk],
            }
        )
    return blocks


def dcs_at(dense: torch.nn.Module, x: torch.Tensor, target: float, align: int) -> tuple[torch.nn.Module, dict]:
    """A DCS-materialized model (static Q/K + hidden family) near ``target`` x the dense FLOPs."""
    cfg = DCSConfig(qk_mask="static", mlp_gates="hidden", align=align)

    def build(share: float) -> torch.nn.Module:
        return build_materialized(copy.deepcopy(dense), cfg, dcs_hidden_blocks(dense, share, align)).eval()

    ratios: dict[float, float] = {}

    def ratio(share: float) -> float:
        if share not in ratios:
            ratios[share] = flops_ratio(build(share), dense, x)
        return ratios[share]

    lo, hi = 0.02, 1.0
    for _ in range(10):  # the share to 1/1000: finer than a width step of 8 at DeiT-S's 1536 hidden
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if ratio(mid) > target else (mid, hi)
    share = min((lo, hi), key=lambda s: abs(ratio(s) - target))
    model = build(share)
    model.nc_methods = ["dcs"]
    blocks = dcs_hidden_blocks(dense, share, align)
    return model, {
        "family": "static Q/K + hidden",
        "share": round(share, 4),
        "align": align,
        "hidden_kept": [len(b["hidden_keep"]) for b in blocks],
        "qk_kept": [len(b["qk_keep"][0]) for b in blocks],
    }


def uniform_at(dense: torch.nn.Module, x: torch.Tensor, target: float, align: int) -> tuple[torch.nn.Module, dict]:
    model, rec = uniform_at_flops(dense, target, x, align=align)
    return model.eval(), {
        "keep": round(rec["config"]["keep"], 4),
        "align": align,
        "hidden_kept": [len(b["hidden_keep"]) for b in rec["blocks"]],
        "qk_kept": [len(b["qk_keep"][0]) for b in rec["blocks"]],
    }


def tome_r_for(dense: torch.nn.Module, x: torch.Tensor, target: float) -> int:
    """ToMe's r (tokens merged per layer, every layer) whose FLOPs ratio is nearest ``target``."""
    n_patches = dense.patch_embed.num_patches
    best: tuple[float, int] | None = None
    for r in range(1, n_patches // 2 + 1):
        try:
            m, _ = get_method("tome").prepare_fresh(copy.deepcopy(dense), {"r": r})
        except nascompress.NascompressError:
            break
        err = abs(flops_ratio(m, dense, x) - target)
        if best is None or err < best[0]:
            best = (err, r)
        elif err > best[0]:
            break  # the ratio falls with r: past the nearest
    return best[1] if best else 1


def torch_pruning_at(dense: torch.nn.Module, x: torch.Tensor, target: float) -> tuple[torch.nn.Module, dict]:
    """Torch-Pruning's MLP hidden neurons at ``target`` (``_common.torch_pruning_keep``), built as a model."""
    import torch_pruning as tp  # optional: the external peer (pip install torch-pruning==1.6.1)

    keep, ratio = torch_pruning_keep(dense, x, target)
    model, _ = uniform_from_keep(dense, keep)
    return model.eval(), {
        "pruning_ratio": round(ratio, 4),
        "round_to": 8,
        "hidden_kept": [len(k) for k in keep],
        "torch_pruning": tp.__version__,
    }


# ---------------------------------------------------------------------------------------------
# The zoo


Builder = Callable[[], tuple[torch.nn.Module, dict]]


def zoo(dense: torch.nn.Module, x: torch.Tensor, only: set[str] | None = None) -> dict[str, Builder]:
    """name -> a builder returning (model, settings) for every method's model (``only``: these names).
    The builders are lazy, so a failing one is recorded by the caller and the others still run."""

    def fresh(name: str, cfg: dict) -> Builder:
        return lambda: (get_method(name).prepare_fresh(copy.deepcopy(dense), dict(cfg))[0].eval(), dict(cfg))

    def tome() -> tuple[torch.nn.Module, dict]:
        r = tome_r_for(dense, x, TARGET)
        return fresh("tome", {"r": r})()[0], {"r": r}

    builders: dict[str, Builder] = {  # most wanted first: a time guard skips the last ones
        "dcs_0.6x": lambda: dcs_at(dense, x, TARGET, align=8),
        "uniform_0.6x": lambda: uniform_at(dense, x, TARGET, align=8),
        "evit_0.7": fresh("evit", {"keep_rate": 0.7}),
        "tome": tome,
        "dynamicvit_0.7": fresh("dynamicvit", {"rho": 0.7}),
        "sparsifiner": fresh("sparsifiner", {}),
        "sparsifiner_block": fresh("sparsifiner", {"mode": "block"}),
        "mgvit": fresh("mgvit", {"epsilon": 1.0}),
        "torch_pruning_0.6x": lambda: torch_pruning_at(dense, x, TARGET),
        "dcs_0.6x_unaligned": lambda: dcs_at(dense, x, TARGET, align=1),
    }
    return {k: v for k, v in builders.items() if only is None or k in only}


METHOD_OF = {  # model name -> the method it is (the JSON's ``method`` field)
    "dcs_0.6x": "dcs",
    "dcs_0.6x_unaligned": "dcs",
    "uniform_0.6x": "uniform",
    "evit_0.7": "evit",
    "tome": "tome",
    "dynamicvit_0.7": "dynamicvit",
    "sparsifiner": "sparsifiner",
    "sparsifiner_block": "sparsifiner",
    "mgvit": "mgvit",
    "torch_pruning_0.6x": "torch-pruning",
    "pipeline_final": "pipeline",
}


def pipeline_models(folder: str | Path) -> tuple[torch.nn.Module, torch.nn.Module, dict]:
    """A finished pipeline run's dense base (``base/``) and final model (``final/``), through the library's
    loader, and the final model's settings (its methods as ``arch.json`` records them)."""
    folder = Path(folder)
    base, final = folder / "base", folder / "final"
    for p in (base, final):
        if not p.is_dir():
            raise SystemExit(f"error: {p} is not there: --pipeline takes a finished pipeline's --out folder")
    dense, _ = nascompress.load_with_arch(base)
    model, arch = nascompress.load_with_arch(final)
    methods = [m.get("name") for m in arch.get("methods", [])]
    info = {"pipeline": str(folder), "methods": "+".join(methods), "predictable": set(methods) <= PRICED_METHODS}
    return dense.eval(), model.eval(), info
