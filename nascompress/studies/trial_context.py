"""One study worker's cached state (:class:`TrialContext`): the base model, the uncompressed
model's cost, the validation and calibration images preprocessed once, and the speed of each
architecture measured once."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch
from optuna.trial import TrialState
from torch import nn

from ..data import DataConfig, InputSpec, load_data, make_loader, preprocess
from ..runs.io import MODEL_FILE, file_sha256, load_typed
from ..models.build import build_model
from ..profiling import (
    PRICED_METHODS,
    count_flops,
    geometry_of,
    latency_table,
    measure,
    predict_latency,
    table_anchor,
)
from .records import ANCHOR_KEY, LatencyNote, TrialRecord
from ..runtime import resolve_device
from .scoring import subset_fingerprint
from .space_model import load_space
from ..runs.run_config import run_data_config

FLOPS_IMAGES = 32  # images the FLOPs of a trial are averaged over (dynamic models differ per image)
FINALIST_MARGIN = 0.15  # a trial predicted this far over a latency constraint may still meet it measured


@dataclass(frozen=True)
class Speed:
    """A trial's speed (:meth:`TrialContext.speed`): batch-1 ``latency_ms`` (predicted or measured:
    ``latency`` says which), batch-64 ``throughput`` (measured trials only) and the uncompressed
    model's, measured beside it; None: not measured (or the study needs no speed)."""

    latency_ms: float | None = None
    throughput: float | None = None
    latency: LatencyNote | None = None
    dense_latency_ms: float | None = None
    dense_throughput: float | None = None


class TrialContext:
    """What every trial of one worker shares: the base model, the uncompressed model's cost, and
    the data (validation and calibration images preprocessed once)."""

    def __init__(self, job: Any):
        """``job``: the search's :class:`~nascompress.studies.trials.SearchJob`."""
        self.job = job
        self.device = resolve_device(job.device)
        self.base, self.arch = load_typed(job.base, map_location=self.device)
        self.space = load_space(job.space, model=self.base)  # sized by and checked against the base's depth
        self.spec = InputSpec.from_dict(dict(self.arch.input))
        data_cfg = job.data or run_data(job.base)
        data_cfg = dataclasses.replace(data_cfg, train_limit=job.train_images, eval_limit=job.eval_images)
        data_cfg = dataclasses.replace(data_cfg, subset_seed=job.seed)
        self.data_cfg = data_cfg
        self.data = load_data(data_cfg, spec=self.spec)
        self.val = tensors_of(self.data.val, self.spec, job.batch_size)
        self.calib = tensors_of(self.data.train, self.spec, job.batch_size)
        # the identity of the validation subset every trial of the study is scored on
        self.eval_subset = subset_fingerprint(
            self.data.val,
            torch.cat([y for _, y in self.val]) if self.val else torch.zeros(0),
            seed=data_cfg.subset_seed,
        )
        self.uncompressed = build_model(self.arch.spec).to(self.device).eval()
        x = self.val[0][0][:FLOPS_IMAGES].to(self.device)
        self.flops_x = x
        self.dense_flops = count_flops(self.uncompressed, x[:2]).total
        self.base.eval().requires_grad_(False)
        self._speed: dict[str, Speed] = {}
        self._table: Any = None
        self._anchor: float | None = None
        # searched DCS stages, by (settings, seed): (materialized model, record), or the error the search
        # stopped with (search.trial_dcs.dcs_stage)
        self.dcs_memo: dict[str, Any] = {}
        self._search_data: Any = None

    def search_data(self) -> Any:
        """The splits a trial's DCS search reads: the training images unaugmented (as ``search dcs``
        reads them), so the teacher's outputs are computed once; an ImageFolder's loaded once more without
        its training transform, the first time a DCS stage asks."""
        if self._search_data is None:
            fixed = self.data.extra.get("fixed_train_images")
            self._search_data = self.data if fixed else load_data(self.data_cfg, spec=self.spec, augment=False)
        return self._search_data

    def calibration_batches(self) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
        return [(x.to(self.device), y.to(self.device)) for x, y in self.calib]

    @torch.no_grad()
    def accuracy(self, model: nn.Module) -> float:
        model.eval()
        correct = n = 0
        for x, y in self.val:
            correct += (model(x.to(self.device)).argmax(-1).cpu() == y).sum().item()
            n += len(y)
        return 100.0 * correct / max(n, 1)

    def speed(
        self,
        model: nn.Module,
        key: str,
        *,
        methods: Sequence[str] = (),
        accuracy: float | None = None,
        study: Any = None,
    ) -> Speed:
        """Latency (batch 1) and throughput (batch 64) of ``model`` interleaved with the uncompressed
        model; cached per architecture ``key``.

        With the job's ``latency_source`` ``predicted`` (a latency objective or constraint, every
        method of ``methods`` one the table prices: :data:`~nascompress.profiling.PRICED_METHODS`),
        the latency is predicted from the device's table (:func:`~nascompress.profiling.predict_latency`,
        the tokens per block read from one forward; scaled by :meth:`anchor`) and measured only for a
        finalist (:func:`is_finalist`: a trial at ``accuracy`` that ``study`` could still pick);
        ``latency`` says which."""
        if key in self._speed:
            return self._speed[key]
        if not self.predicts(methods):
            out = self._measure(model)
            out = dataclasses.replace(
                out, latency=LatencyNote.new(source="measured", predicted_ms=None, measured_ms=out.latency_ms)
            )
        else:
            ms = predict_latency(self.table(), model, x=self.flops_x[:1]) * self.anchor(study)
            out = Speed(latency_ms=ms, latency=LatencyNote.new(source="predicted", predicted_ms=ms))
            if is_finalist(self.job, study, accuracy, ms):
                out = self._measure(model)
                out = dataclasses.replace(
                    out, latency=LatencyNote.new(source="measured", predicted_ms=ms, measured_ms=out.latency_ms)
                )
        self._speed[key] = out
        return out

    def predicts(self, methods: Sequence[str]) -> bool:
        """Whether the trial's latency is predicted (see :meth:`speed`)."""
        job = self.job
        wants = job.max_latency_ms is not None or (not job.constrained and job.second_objective == "latency")
        return job.latency_source == "predicted" and wants and set(methods) <= PRICED_METHODS

    def table(self) -> Any:
        """The device's latency table of the uncompressed model at batch 1 (fp32; cached)."""
        if self._table is None:
            self._table = latency_table(geometry_of(self.uncompressed), device=self.device, batch=1)
        return self._table

    def anchor(self, study: Any = None) -> float:
        """The factor a predicted latency is scaled by: the uncompressed model timed on the device over
        the table's prediction of it (:func:`~nascompress.profiling.table_anchor`), so milliseconds
        predicted from a table cached while the machine ran faster or slower compare with the
        constraint and with measured trials at this moment's speed. Taken once per study (its
        ``nascompress:latency_anchor`` attribute, set by the first worker that needs it and read by
        every other and by a resume: a trial's predicted milliseconds do not change with the process)."""
        if self._anchor is None:
            stored = study.user_attrs.get(ANCHOR_KEY) if study is not None else None
            if not (isinstance(stored, dict) and isinstance(stored.get("anchor"), (int, float))):
                stored = table_anchor(self.uncompressed, self.table(), device=self.device, seed=self.job.seed).to_dict()
                if study is not None:
                    study.set_user_attr(ANCHOR_KEY, stored)
                    stored = study.user_attrs.get(ANCHOR_KEY, stored)  # as stored (two workers at once: the later)
            self._anchor = float(stored["anchor"])
        return self._anchor

    def _measure(self, model: nn.Module) -> Speed:
        shape = tuple(self.flops_x.shape[1:])
        dense, cand = measure(
            [self.uncompressed, model], shape, device=self.device, iters=self.job.latency_iters, seed=self.job.seed
        )
        return Speed(
            latency_ms=cand["latency_ms"],
            throughput=cand["throughput"],
            dense_latency_ms=dense["latency_ms"],
            dense_throughput=dense["throughput"],
        )


def is_finalist(job: Any, study: Any, accuracy: float | None, predicted_ms: float) -> bool:
    """Whether a trial at ``accuracy`` with ``predicted_ms`` could be picked, so its latency is measured:
    under a latency constraint, within :data:`FINALIST_MARGIN` of it and more accurate than every
    complete trial that meets it; with a latency objective, not dominated by a complete trial (as
    accurate and as fast). Without a study (or an accuracy) every trial is one."""
    if study is None or accuracy is None:
        return True
    done = [
        TrialRecord.from_attrs(t.user_attrs) for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE
    ]
    done = [r for r in done if r.latency_ms is not None and r.accuracy is not None]
    if job.max_latency_ms is not None:
        if predicted_ms > job.max_latency_ms * (1 + FINALIST_MARGIN):
            return False
        # the pick takes the most accurate trial under the bound, the earliest of equals
        return all(accuracy > r.accuracy for r in done if r.latency_ms <= job.max_latency_ms)
    return not any(r.accuracy >= accuracy and r.latency_ms <= predicted_ms for r in done)


def run_data(run_dir: str) -> DataConfig:
    return run_data_config(run_dir) or DataConfig()


def tensors_of(ds: Any, spec: InputSpec, batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A dataset preprocessed once into batches of model input (CPU)."""
    return [(preprocess(imgs, spec), labels) for imgs, labels in make_loader(ds, batch_size=batch_size, shuffle=False)]


def base_fingerprint(base: str | Path) -> str:
    """The sha256 of a base run's weights file (its arch is in the file's metadata): what binds a
    study to its base model, wherever the run is copied."""
    p = Path(base)
    return file_sha256(p / MODEL_FILE if p.is_dir() else p)


__all__ = ["TrialContext", "Speed", "FLOPS_IMAGES", "base_fingerprint", "run_data", "tensors_of"]
