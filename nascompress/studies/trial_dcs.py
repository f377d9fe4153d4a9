"""A trial's DCS stage: a short DCS search at the trial's settings, in memory, on the worker's base
model and data (:func:`~nascompress.dcs_search.search.run_dcs_search`, its baseline comparison included), and
the worker's memo of the searches it made (a space whose trials share DCS settings searches once)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from torch import nn

from ..errors import NascompressError
from .trial_context import TrialContext
from ..methods.dcs import DCSConfig, materialize
from ..dcs_search.search import run_dcs_search
from ..dcs_search.search_config import DCSSearchConfig, DCSSearchJob, search_train_config


DCS_MEMO_SIZE = 12  # searched DCS models a worker keeps (a joint space's target has 11 values)


def dcs_stage(ctx: TrialContext, settings: dict[str, Any], seed: int) -> tuple[nn.Module, dict[str, Any], bool]:
    """A short DCS search at the trial's settings, materialized in memory: (model, its record, whether
    it was reused from the worker's memo of earlier trials with the same settings and seed).

    The gate family is chosen by the search's probe unless the space fixes ``mlp_gates``, the
    batch size follows the trial's training images (``auto_batch``: enough architecture steps)
    unless the space fixes ``auto_batch``, and the pre-search measurements use the study's seed
    (``init_seed``: the same for every trial, measured once per worker)."""
    key = json.dumps([settings, seed], sort_keys=True)
    memo, reused = ctx.dcs_memo, key in ctx.dcs_memo
    if not reused:
        if len(memo) >= DCS_MEMO_SIZE:
            memo.pop(next(iter(memo)))  # the oldest
        try:
            memo[key] = _search_dcs(ctx, settings, seed)
        except NascompressError as e:  # a collapsed search fails the same way every time: once is enough
            memo[key] = e
            raise
    if isinstance(memo[key], NascompressError):
        raise memo[key]
    model, record = memo[key]  # the memo's copy stays untouched: the trial patches its own
    return copy.deepcopy(model), copy.deepcopy(record), reused


def _search_dcs(ctx: TrialContext, settings: dict[str, Any], seed: int) -> tuple[nn.Module, dict[str, Any]]:
    if ctx.arch.methods:
        raise NascompressError(
            f"a space with a dcs entry needs a dense base run; {ctx.job.base} already applies "
            f"{list(ctx.arch.method_names)}"
        )
    m_keys = set(DCSConfig.__dataclass_fields__)
    method = DCSConfig.user(**{k: v for k, v in settings.items() if k in m_keys})
    search = DCSSearchConfig.from_dict(
        {"auto_batch": True, "init_seed": ctx.job.seed, **{k: v for k, v in settings.items() if k not in m_keys}}
    )
    train = search_train_config(
        epochs=ctx.job.dcs_epochs,
        batch_size=ctx.job.batch_size,
        seed=seed,
        device=ctx.job.device,
        amp=ctx.job.amp,
        deterministic=ctx.job.deterministic,
    )
    # the search's own record of where it started (the memo of pre-search measurements is keyed on it);
    # nothing is written: the search runs on the worker's base model and data, in memory
    job = DCSSearchJob(
        source=str(Path(ctx.job.base).resolve()), out="", method=method, search=search, data=ctx.data_cfg, train=train
    )
    dense = copy.deepcopy(ctx.base).requires_grad_(True)  # the shared base stays frozen and untouched
    result = run_dcs_search(job, dense, ctx.arch, ctx.search_data())
    model, record = materialize(result.supernet.to(ctx.device), result.job.method)
    model.nc_methods = ["dcs"]
    model.nc_dcs_kept = result.metrics.kept  # the searched model or the magnitude baseline (trial info)
    return model, record


__all__ = ["DCS_MEMO_SIZE", "dcs_stage"]
