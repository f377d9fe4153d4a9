"""The stand-in models of ``bench/export.py``, shared with ``bench/quantize.py``: DCS channels chosen by
importance at a FLOPs target (``dcs_from_importance``, ``dcs_at_flops``), a model saved as a run
(``save_run``), and the main job's dense and compressed stand-in (``main_job_standin``: the config's base
trained here, DCS by activation importance at the config's target, EViT 0.7, retrained)."""

from __future__ import annotations

import copy
from pathlib import Path

from _common import ROOT  # noqa: E402  (puts the repository on sys.path)

import torch  # noqa: E402

from nascompress.data import DataConfig, InputSpec, load_data, preprocess  # noqa: E402
from nascompress.runs.io import load_with_arch, make_arch, save_model  # noqa: E402
from nascompress.models.layers import aligned_width  # noqa: E402
from nascompress.methods import get_method  # noqa: E402
from nascompress.methods.dcs import DCSConfig, materialize
from nascompress.methods.dcs_importance import activation_importance  # noqa: E402
from nascompress.models.build import ModelSpec, custom_vit_spec  # noqa: E402
from nascompress.pipeline import load_config  # noqa: E402
from nascompress.profiling import count_flops  # noqa: E402
from nascompress.retraining.config import RetrainConfig
from nascompress.retraining.run import RetrainJob, retrain, retrain_train_config  # noqa: E402
from nascompress.train.config import TrainConfig
from nascompress.train.run import TrainJob, train  # noqa: E402


def dcs_from_importance(dense: torch.nn.Module, importance: list, share: float, align: int = 8):
    """DCS with the ``share`` most important MLP residual channels and Q/K channels per head of every
    block (counts rounded up to multiples of ``align``) set as the supernet's gates, then
    materialized by the method's own path. Returns (model, record)."""
    cfg = DCSConfig(qk_mask="static")
    sup, _ = get_method("dcs").prepare_fresh(copy.deepcopy(dense), cfg)
    with torch.no_grad():
        for blk, imp in zip(sup.blocks, importance):
            mlp_imp, qk_imp = imp.mlp(cfg.mlp_gates), imp.qk  # methods.dcs_importance.ChannelImportance
            C = mlp_imp.numel()
            k = aligned_width(max(1, round(share * C)), align=align, full=C)
            alpha = torch.full((C,), -1.0)
            alpha[mlp_imp.topk(k).indices] = 1.0
            blk.dcs_alpha.copy_(alpha)
            H, d = qk_imp.shape
            kq = aligned_width(max(1, round(share * d)), align=align, full=d)
            theta = torch.full((H, d), -1.0)
            theta.scatter_(1, qk_imp.topk(kq, dim=1).indices, 1.0)
            blk.attn.qk_mask.theta.copy_(theta.flatten())
    model, rec = materialize(sup.eval(), cfg)
    return model.eval(), rec


def dcs_at_flops(dense: torch.nn.Module, importance: list, target: float, x1: torch.Tensor):
    """:func:`dcs_from_importance` at the share whose FLOPs are closest to ``target`` x dense (bisection)."""
    full = count_flops(dense, x1).total
    lo, hi, best = 0.05, 1.0, None
    for _ in range(10):
        mid = (lo + hi) / 2
        model, rec = dcs_from_importance(dense, importance, mid)
        r = count_flops(model, x1).total / full
        if best is None or abs(r - target) < abs(best[0] - target):
            best = (r, mid, model, rec)
        lo, hi = (mid, hi) if r < target else (lo, mid)
    return best


def save_run(root: Path, name: str, model, spec: ModelSpec, input_spec: dict, records: list) -> Path:
    run = root / name
    save_model(run, model, make_arch(spec, input_spec=input_spec, methods=records))
    return run


def main_job_spec() -> ModelSpec:
    """The README main job's dense base (``configs/fashion-mnist.yaml``, read with the library's loader)."""
    t = load_config(ROOT / "configs" / "fashion-mnist.yaml").base.train
    return custom_vit_spec(
        img_size=t.img_size,
        patch_size=t.patch_size,
        embed_dim=t.embed_dim,
        depth=t.depth,
        num_heads=t.num_heads,
        num_classes=10,
        in_chans=t.in_chans,
    )


def main_job_standin(args, work: Path) -> tuple[Path, Path, dict]:
    """The main job's dense and compressed models made here (see the module docstring)."""
    cfg = load_config(ROOT / "configs" / "fashion-mnist.yaml")  # the library's loader: validated
    t, spec = cfg.base.train, main_job_spec()
    data = DataConfig(dataset="fashion-mnist", train_limit=args.train_limit, subset_seed=0)
    dense_dir = work / "dense"
    m = train(
        TrainJob(
            model=spec,
            data=data,
            out=str(dense_dir),
            train=TrainConfig(epochs=args.epochs, batch_size=t.batch_size, lr=t.lr, seed=0),
        )
    )
    dense, arch = load_with_arch(dense_dir)
    bundle = load_data(data, spec=InputSpec.from_dict(arch["input"]), augment=False)
    xs = bundle.train.__getitems__(list(range(min(512, len(bundle.train)))))[0]
    batches = [preprocess(xs[i : i + 128], InputSpec.from_dict(arch["input"])) for i in range(0, len(xs), 128)]
    imp = activation_importance(copy.deepcopy(dense), batches)
    x1 = batches[0][:1]
    target = cfg.stages.dcs.target_flops
    ratio, share, dcs_model, dcs_rec = dcs_at_flops(dense, imp, target, x1)
    evit_model, evit_rec = get_method("evit").prepare_fresh(dcs_model, {"keep_rate": 0.7})
    pre = save_run(
        work, "dcs_evit", evit_model.eval(), ModelSpec.from_dict(arch["model"]), arch["input"], [dcs_rec, evit_rec]
    )
    comp_dir = work / "compressed"
    r = retrain(
        RetrainJob(
            model_dir=str(pre),
            out=str(comp_dir),
            data=data,
            teacher=str(dense_dir),
            train=retrain_train_config(epochs=args.retrain_epochs, seed=0),
            retrain=RetrainConfig(eta=0.0),
            auto_batch=False,
        )
    )
    info = {
        "kind": "stand-in made by this bench",
        "dense_epochs": args.epochs,
        "train_limit": args.train_limit,
        "dense_val_top1": m.best_val_top1,
        "dcs_target_flops": target,
        "dcs_share": share,
        "dcs_flops_ratio": ratio,
        "evit_keep_rate": 0.7,
        "retrain_epochs": args.retrain_epochs,
        "retrained_val_top1": r.best_val_top1,
    }
    return dense_dir, comp_dir, info
