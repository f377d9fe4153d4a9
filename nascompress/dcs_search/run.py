"""``nascompress search dcs`` into a run directory: the dense source (a run, or a timm name with local
weights), the search itself (:func:`~nascompress.dcs_search.search.run_dcs_search`, in memory) writing its
files as it goes, the completion mark; and a search the guard stopped reopened by ``--resume`` with
another ``--max-val-drop``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from torch import nn

from ..train import distributed
from ..data import count_classes
from ..runs.run_config import run_data_config
from ..data import DataConfig, InputSpec, dataset_paths, load_data
from ..errors import NascompressError, SettingError
from ..runs.io import load_typed, make_arch
from ..models.build import ModelSpec, build_model
from ..models.weights import load_pretrained
from ..runs.run_dir import RunDir
from ..train.run import input_spec_for
from ..runs.files import METRICS_FILE, Arch, find_metrics
from ..runs.run_config import find_run_config
from ..methods.dcs import ALIGN_AUTO, DCSConfig
from .metrics import DCSMetrics
from .prepare import ALIGN_PROBE
from .search import run_dcs_search
from .search_config import DCSSearchConfig, DCSSearchJob, search_train_config


def build_job(
    source: str | Path,
    out: str | Path,
    *,
    search: Mapping[str, Any],
    method: Mapping[str, Any],
    train: Mapping[str, Any],
    data: DataConfig | None = None,
    weights: str | None = None,
    img_size: int | None = None,
) -> DCSSearchJob:
    """The DCS search job of ``nascompress search dcs`` and of a pipeline's ``stages.dcs`` (the one
    place it is built): ``search``: the values of :class:`~nascompress.dcs_search.search_config.DCSSearchConfig`'s
    settings; ``method``: :data:`~nascompress.methods.dcs.SEARCH_DCS_SETTINGS`'; ``train``:
    :data:`~nascompress.dcs_search.search_config.SEARCH_TRAIN_SETTINGS`' and
    :data:`~nascompress.train.run.RUNTIME_SETTINGS`'
    (None: the recipe's; ``batch_size`` None: chosen from the training images); ``data``: the dataset
    (None: the source run's); ``weights`` / ``img_size``: a timm ``source``'s weights file and input size."""
    cfg = DCSSearchConfig(**search, auto_batch=train.get("batch_size") is None)
    tc = search_train_config(**train)
    return DCSSearchJob(
        source=str(source),
        out=str(out),
        method=DCSConfig.user(**method),
        search=cfg,
        train=tc,
        data=data,
        weights=weights,
        model_kwargs={"img_size": img_size} if img_size else {},
    )


PRE_SEARCH = "pre_search"  # config.json's record of the pre-search choices (the batch rule, the gate family)
# how to let the gates of a search the guard stopped go on (a SettingError template: a front end words
# its fields, e.g. the CLI as the command that continues it)
CONTINUE = "rerun the same command with {resume} {max_val_drop} 100 to let the gates go on from this epoch"


def _build_source(job: DCSSearchJob) -> tuple[nn.Module, Arch, DataConfig]:
    src = Path(job.source)
    if src.is_dir():
        model, arch = load_typed(src)
        if arch.methods:
            raise NascompressError(f"{src} is not a dense run (it has methods {list(arch.method_names)})")
        return model, arch, job.data or run_data_config(src) or DataConfig()
    if job.weights is None:
        raise SettingError(f"{job.source} is not a run directory; to search a timm model name give {{weights}} FILE")
    data = job.data or DataConfig()
    spec = ModelSpec(job.source, dict({"num_classes": count_classes(data)}, **job.model_kwargs))
    model = build_model(spec)
    load_pretrained(model, job.weights)
    return model, Arch.of(make_arch(spec, input_spec=input_spec_for(model, data.dataset).to_dict())), data


def search_dcs(
    job: DCSSearchJob, *, force: bool = False, resume: bool = False, explicit: set[str] | None = None
) -> DCSMetrics:
    """Run (or ``resume``) the DCS search into the run directory ``job.out`` (:func:`run_dcs_search`
    on the source run's model and data); writes the supernet, arch.json, log.jsonl, metrics.json and
    returns the metrics (:class:`~nascompress.dcs_search.metrics.DCSMetrics`, the file less its
    completion mark's files).
    ``config.json`` records the job with its pre-search choices resolved and, as ``pre_search``,
    what those measurements chose and why: a resumed search reports them as the first run did and
    searches at the width multiple it chose (``align`` auto given again is that choice)."""
    out = Path(job.out)
    chosen = None
    if resume:  # (explicit: the options given on the command line; each must agree with the record)
        recorded = find_run_config(out)
        chosen = recorded.get(PRE_SEARCH) if recorded is not None else None
        chosen = chosen if isinstance(chosen, dict) else None  # (a run written before it was recorded: none)
        # but the guard's limit: it decides only when the gates stop, so a stopped search continues with another
        guard = job.search.max_val_drop if explicit and "max_val_drop" in explicit else None
        leave = {"max_val_drop"}
        if job.method.align == ALIGN_AUTO and chosen is not None and ALIGN_PROBE in chosen:
            leave.add("align")  # align auto again: the multiple the run chose (recorded), never timed anew
        job = RunDir.recorded(
            out,
            DCSSearchJob,
            "nascompress search dcs",
            given=job,
            explicit=None if explicit is None else explicit - leave,
        )
        if guard is not None:
            job = job.replace(search=job.search.replace(max_val_drop=guard))
            reopen_stopped(out)
    elif Path(job.source).is_dir():  # recorded absolute: materialize reads the dense run's data section
        job = job.replace(source=str(Path(job.source).resolve()))
    distributed.init(job.train.device)
    run = RunDir.prepare(out, force=force, resume=resume, inputs=(job.source, job.weights, *dataset_paths(job.data)))
    dense, base_arch, data_cfg = _build_source(job)
    # the search reads its training images as they are (an ImageFolder without its training transform, as the
    # in-memory datasets its defaults were chosen on), so the dense teacher's outputs are computed once per image
    data = load_data(data_cfg, spec=InputSpec.from_dict(dict(base_arch.input)), augment=False)

    def create(resolved: DCSSearchJob, info: dict[str, Any]) -> None:
        run.create({**resolved.replace(data=data_cfg).to_dict(), PRE_SEARCH: info})

    result = run_dcs_search(
        job, dense, base_arch, data, out_dir=out, resume=resume, before_fit=create, pre_search=chosen
    )
    metrics = result.metrics
    if metrics.stopped is not None:  # how to continue the gates (a front end words CONTINUE its own way)
        how = "resume the run with max_val_drop 100 to let the gates go on from this epoch"
        metrics = metrics.set(stopped=metrics.stopped.set(**{"continue": how}))
    run.finish(metrics)  # the last write: marks the search complete
    return metrics


def reopen_stopped(out: Path) -> None:
    """Take the completion mark off a search the guard stopped (``metrics.json``'s ``stopped``), so that
    ``--resume`` with another ``--max-val-drop`` continues its gates from the epoch they stopped at; a
    search that ran all its epochs is left as it is."""
    mark = find_metrics(out)
    if mark is not None and mark.get("stopped") and distributed.is_main():
        (out / METRICS_FILE).unlink()


__all__ = ["CONTINUE", "PRE_SEARCH", "build_job", "search_dcs", "reopen_stopped"]
