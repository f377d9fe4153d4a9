"""``nc.dcs.search``: the DCS channel search on a model object (``nascompress search dcs``)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ..config import user_settings
from ..data.choose import data_config_for
from ..methods.dcs import DCSConfig
from ..dcs_search.search_config import SEARCH_TRAIN_SETTINGS, DCSSearchConfig, search_train_config
from ..dcs_search.metrics import DCSMetrics
from ..dcs_search.run import build_job, search_dcs
from ..train.run import RUNTIME_SETTINGS
from .common import (
    ModelLike,
    StageResult,
    data_config,
    loader_batch,
    model_run,
    read_result,
    setting_names,
    split_settings,
    stage_values,
)
from .workspace import Workspace
from ..progress import silenced
from ..errors import python_api
from .user_model import check_qk_norm, device_name
from .data_notes import warn_conversions
from ..runs.run_config import run_data_config

SEARCH_NAMES = tuple(f.name for f in user_settings(DCSSearchConfig) if f.name != "target_flops")


@dataclass(frozen=True)
class DCSSearch(StageResult):
    """A finished DCS search: ``model`` is the supernet (the dense model with its learnt gates),
    ``metrics`` the search's :class:`~nascompress.dcs_search.metrics.DCSMetrics` (``flops_ratio``,
    ``val_top1``, ``mlp_kept``, ``qk_kept``, ``kept``, ``comparison`` ...). Give it
    to :func:`nascompress.materialize` for the smaller model. The target is a bound:
    :attr:`over_target` says by how much the searched model stands above it (0.0: at or under it)."""

    METRICS = DCSMetrics

    @property
    def over_target(self) -> float:
        """How far the searched model's cost ratio (FLOPs, or predicted latency with ``cost="latency"``)
        stands above its target, as a share of the dense model's; 0.0 at or under it (or no target)."""
        return over_target(self.metrics)


@python_api("nc.dcs.search")
def search(
    model: ModelLike,
    data: Any = None,
    *,
    val: Any = None,
    test: Any = None,
    target_flops: float = 0.6,
    epochs: int | None = None,
    batch_size: int | None = None,
    seed: int = 0,
    device: str = "auto",
    train_limit: int | None = None,
    eval_limit: int | None = None,
    out: str | Path | None = None,
    resume: bool = False,
    force: bool = False,
    progress: bool = True,
    **settings: Any,
) -> DCSSearch:
    """Search which Q/K and MLP channels of a dense ViT to keep for ``target_flops`` x its FLOPs.

    The job of ``nascompress search dcs`` (:func:`~nascompress.dcs_search.run.search_dcs`) with the
    same defaults.

    Args:
        model: a dense timm ViT (an ``nn.Module``), a result of this API, or a run directory.
        data: the training data: a built-in dataset name (``"fashion-mnist"``, ``"digits"``), an
            ImageFolder root, a map-style ``Dataset`` of (image tensor, label), or a ``DataLoader``
            over one (its batch size is then the search's); None: the run's recorded dataset.
        val / test: the caller's other splits (with a Dataset; None: carved from ``data``).
        target_flops: the FLOPs to reach, as a share of the dense model's.
        epochs / batch_size: the search's training (None: the command's recipe; batch size from the
            number of training images).
        seed / device: as the command's ``--seed`` / ``--device`` (``auto``, ``cpu``, ``cuda``, or a
            ``torch.device``).
        train_limit / eval_limit: use a class-stratified subset of the images.
        out: keep the search's run directory here (None: nothing is written).
        resume / force: continue the search in ``out`` / replace it.
        progress: the command's progress lines on stderr (False: nothing is printed).
        **settings: any other option of the command, by its Python name (``arch_lr=0.05``,
            ``qk_mask="static"``, ``mlp_gates="residual"``, ``align=16`` or ``align="auto"`` (the
            multiple timed on the device), ``lr``, ``amp``, ``deterministic`` ...).
            ``at_most`` is True here (the command's default is False): the target is a bound, and a
            search that cannot land at or under it warns (``warnings.warn``) saying by how much
            (:attr:`DCSSearch.over_target`).
    """
    parts = split_settings(
        settings,
        {
            "search": SEARCH_NAMES,
            "method": setting_names(DCSConfig),
            "recipe": setting_names(SEARCH_TRAIN_SETTINGS),
            "runtime": ("amp", "deterministic"),
        },
        what="nc.dcs.search",
    )
    device = device_name(device)
    check_qk_norm(model, parts["method"].get("qk_mask", DCSConfig().qk_mask), how="qk_mask='none'")
    parts["search"].setdefault("at_most", True)  # the API's target is a bound (ModelOpt's, Torch-Pruning's)
    batch_size = batch_size if batch_size is not None else loader_batch(data)
    cfg_data = data_config(data, val=val, test=test, seed=seed, train_limit=train_limit, eval_limit=eval_limit)
    # every setting is checked before anything is written
    search_cfg = stage_values(DCSSearchConfig, {"target_flops": target_flops, **parts["search"]})
    recipe = stage_values(SEARCH_TRAIN_SETTINGS, {"epochs": epochs, "batch_size": batch_size, **parts["recipe"]})
    runtime = stage_values(RUNTIME_SETTINGS, {"seed": seed, "device": device, **parts["runtime"]})
    if epochs is None:
        recipe.pop("epochs")
    DCSSearchConfig(**search_cfg, auto_batch=batch_size is None)
    search_train_config(**recipe, **runtime)
    with Workspace(out) as ws:
        source = model_run(model, ws, "source", data=cfg_data)
        if cfg_data is None:
            cfg_data = data_config_for(
                run_data_config(source), seed=seed, train_limit=train_limit, eval_limit=eval_limit
            )
        warn_conversions(source, cfg_data, what="nc.dcs.search")  # a built-in dataset's images made the model's
        job = build_job(
            source,
            ws.path("dcs_search"),
            search=search_cfg,
            method=parts["method"],
            train={**recipe, **runtime},
            data=cfg_data,
        )
        with silenced(not progress):  # progress=False: a quiet library call
            search_dcs(job, force=force, resume=resume)
        result = read_result(DCSSearch, ws.path("dcs_search"), keep=ws.keep)
    warn_over_target("nc.dcs.search", result.metrics)
    return result


def over_target(metrics: Mapping[str, Any] | DCSMetrics) -> float:
    """How far a DCS search's ``metrics`` stand above their target (0.0: at or under it, or none)."""
    m = DCSMetrics.of(metrics)
    if m.target is None or m.ratio is None:
        return 0.0
    return max(0.0, float(m.ratio) - float(m.target))


def warn_over_target(what: str, metrics: Mapping[str, Any] | DCSMetrics) -> None:
    """Warn (``warnings.warn``) when a search's model stands above its target, saying by how much."""
    m = DCSMetrics.of(metrics)
    over = over_target(m)
    if over > 1e-9:
        name = "target_latency" if m.cost == "latency" else "target_flops"
        warnings.warn(
            f"{what}: the searched model stands at {m.ratio:.4f}x, above {name}={m.target:g} by {over:.4f}x "
            "(the search could not land under it); give more epochs or accept the model's over_target",
            stacklevel=4,  # the caller of the nc.* function (through its python_api wrapper)
        )


__all__ = ["DCSSearch", "search", "over_target", "warn_over_target"]
