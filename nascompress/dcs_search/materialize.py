"""``nascompress materialize``: a finished DCS search -> a physically smaller model run.

The gather itself belongs to the DCS method (:func:`nascompress.methods.dcs.materialize`); this is
the job beside the search: load the finished supernet, materialize it in memory, check that the
compact model reproduces the masked supernet, and only then write the run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import Config
from ..data import InputSpec
from ..errors import NascompressError, SettingError
from ..runs.io import load_typed, save_model
from ..methods.dcs import DCSConfig, materialize
from ..methods.dcs_supernet import selection
from ..profiling import count_flops
from ..runs.run_dir import RunDir
from ..runs.files import Arch, read_metrics
from ..runs.run_config import find_run_config
from .metrics import MaterializeMetrics


@dataclass(frozen=True)
class MaterializeJob(Config):
    """``nascompress materialize``: a finished DCS search directory -> a compact model run."""

    search_dir: str
    out: str
    check_batch: int = 8
    seed: int = 0


def build_job(search_dir: str | Path, out: str | Path, *, seed: int = 0) -> MaterializeJob:
    """The materialization job of ``nascompress materialize SEARCH_DIR``, of a pipeline's
    ``stages.dcs`` and of ``nc.materialize`` (the one place it is built): ``search_dir``: a finished
    DCS search; ``out``: the run to create; ``seed``: of the random batch the check runs on."""
    return MaterializeJob(search_dir=str(search_dir), out=str(out), seed=seed)


def load_search(search_dir: str | Path) -> tuple[nn.Module, Arch, DCSConfig]:
    """Load a finished DCS search (supernet, arch, config); refuse unfinished or inconsistent ones."""
    d = Path(search_dir)
    if not d.is_dir():
        raise SettingError(f"{d} is not a directory; give the {{out}} directory of 'nascompress search dcs'")
    supernet, arch = load_typed(d)  # an unfinished search is refused here (--resume continues it)
    methods = arch.methods
    if not methods or methods[-1].name != "dcs" or (methods[-1].stage or "supernet") != "supernet":
        raise SettingError(
            f"{d} holds no finished DCS search (its arch.json's last method is not dcs at stage "
            "supernet); give the {out} directory of 'nascompress search dcs'"
        )
    rec = methods[-1]
    cfg = DCSConfig.from_dict(dict(rec.config or {}))
    if rec.get("blocks") is not None and rec.get("blocks") != selection(supernet):
        raise NascompressError(
            f"{d}/arch.json records selected channels that do not match the gates in "
            f"{d}/model.safetensors; re-run the search or restore the matching arch.json"
        )
    return supernet, arch, cfg


def source_data(search_cfg: dict[str, Any]) -> dict[str, Any] | None:
    """The ``data`` section of the dense run a search started from (its dataset, without the
    search's own --train-limit), else the search's."""
    src = Path(search_cfg.get("source", ""))
    cfg = find_run_config(src) if src.is_dir() else None
    return (cfg.data if cfg is not None else None) or search_cfg.get("data")


def materialize_search(job: MaterializeJob, *, force: bool = False) -> MaterializeMetrics:
    """Materialize ``job.search_dir`` into ``job.out``; returns its FLOPs/params/equivalence metrics
    (:class:`~nascompress.dcs_search.metrics.MaterializeMetrics`, the run's ``metrics.json``).

    Everything is checked and built in memory before anything is written.
    """
    out = Path(job.out)
    run = RunDir.prepare(out, force=force, inputs=(job.search_dir,))
    supernet, arch, cfg = load_search(job.search_dir)
    model, record = materialize(supernet, cfg)
    spec = InputSpec.from_dict(dict(arch.input))
    g = torch.Generator().manual_seed(job.seed)
    x = torch.randn(job.check_batch, spec.in_chans, *spec.img_size, generator=g)
    with torch.no_grad():
        diff = (supernet.eval()(x) - model(x)).abs().max().item()
    if diff > 1e-4:
        raise NascompressError(
            f"materialized logits differ from the supernet's by {diff:.2e} (> 1e-4): this is a bug, please report it"
        )
    new_arch = arch.with_last_method(record)
    sup_flops, flops = count_flops(supernet, x[:2]), count_flops(model, x[:2])
    recorded = find_run_config(job.search_dir)
    search_cfg = recorded.to_dict() if recorded is not None else {}
    dense_macs = read_metrics(job.search_dir).dense_macs
    blocks = record["blocks"]
    gates: dict[str, Any] = {}  # the keys of the gates searched (absent without)
    if any("heads_keep" in b for b in blocks):  # head gates
        gates["heads_kept"] = [None if b.get("heads_keep") is None else len(b["heads_keep"]) for b in blocks]
    if any("skip" in b for b in blocks):  # block gates
        gates["skipped_blocks"] = [i for i, b in enumerate(blocks) if b.get("skip")]
    metrics = MaterializeMetrics.new(
        macs=flops.total,
        params=flops.params,
        supernet_macs=sup_flops.total,
        supernet_params=sup_flops.params,
        dense_macs=dense_macs,
        flops_ratio_vs_dense=flops.total / dense_macs if dense_macs else None,
        max_abs_logit_diff=diff,
        qk_mask=cfg.qk_mask,
        mlp_kept=[None if b["mlp_keep"] is None else len(b["mlp_keep"]) for b in blocks],
        qk_kept=[None if b["qk_keep"] is None else [len(h) for h in b["qk_keep"]] for b in blocks],
        **gates,
    )
    run.create(
        {
            "materialize": job.to_dict(),
            "data": source_data(search_cfg),
            "search": search_cfg.get("search"),
            "search_data": search_cfg.get("data"),
            "source": search_cfg.get("source"),
        }
    )
    save_model(out, model, new_arch)
    return run.finish(metrics)  # the last write: marks the run complete


__all__ = ["MaterializeJob", "build_job", "materialize_search", "load_search", "source_data"]
