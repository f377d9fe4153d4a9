"""The DCS search's metrics typed (:class:`~nascompress.dcs_search.metrics.DCSMetrics`): what the search
returns is the record of the metrics.json it writes, key for key and in the same order."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from nascompress.data import DataConfig
from nascompress.dcs_search.metrics import Calibration, DCSMetrics, Stopped
from nascompress.dcs_search.run import search_dcs
from nascompress.dcs_search.search_config import DCSSearchConfig, DCSSearchJob, search_train_config
from nascompress.errors import NascompressError
from nascompress.methods.dcs import DCSConfig
from nascompress.pyapi.dcs import over_target


def test_search_dcs_returns_the_record_of_the_file_it_writes(tiny_run, tmp_path):
    """A search the guard stops (lr 1.0 wrecks the weights, the target at once): the record returned is
    metrics.json less the completion mark's files, ``stopped`` with how to go on included."""
    job = DCSSearchJob(
        source=str(Path(tiny_run).resolve()),
        out=str(tmp_path / "s"),
        method=DCSConfig(align=1),
        search=DCSSearchConfig(
            target_flops=0.6, target_ramp=0, max_val_drop=1, distill=0, recovery_images=32, auto_batch=False
        ),
        data=DataConfig(dataset="synthetic", train_limit=256, eval_limit=64),
        train=search_train_config(epochs=3, batch_size=32, lr=1.0, device="cpu"),
    )
    metrics = search_dcs(job)
    assert isinstance(metrics, DCSMetrics)
    written = json.loads((tmp_path / "s" / "metrics.json").read_text())
    assert list(written)[-1] == "finished_files" and written["finished"] is True
    assert metrics.to_dict() == {k: v for k, v in written.items() if k != "finished_files"}
    assert list(metrics.to_dict()) == [k for k in written if k != "finished_files"]
    assert DCSMetrics.from_dict(written, source="metrics.json").to_dict() == written
    assert isinstance(metrics.stopped, Stopped) and metrics.stopped.epoch == written["stopped"]["epoch"]
    assert list(written["stopped"]) == ["epoch", "reason", "continue"]
    assert metrics.stopped.extra["continue"] == written["stopped"]["continue"]
    assert metrics.kept == written["kept"] == metrics.comparison.kept


def test_setting_a_key_writes_what_the_dict_edited_the_same_way_did():
    d = {"epochs": 2, "stopped": {"epoch": 1, "reason": "r"}, "kept": "dcs", "calibration": None, "x": [1]}
    m = DCSMetrics.from_dict(d, source="m")
    edited = copy.deepcopy(d)
    edited["stopped"]["continue"] = "go on"
    assert m.set(stopped=m.stopped.set(**{"continue": "go on"})).to_dict() == edited
    assert json.dumps(m.set(stopped=m.stopped.set(**{"continue": "go on"})).to_dict()) == json.dumps(edited)
    assert m.to_dict() == d  # the record itself is unchanged
    assert m.calibration is None and "calibration" in m.to_dict()  # a null the file holds stays


def test_over_target_reads_the_record_and_the_dict_alike():
    d = {"cost": "latency", "target_flops": None, "target_latency": 0.5, "latency_ratio": 0.55, "flops_ratio": 0.4}
    m = DCSMetrics.of(d)
    assert m.target == 0.5 and m.ratio == 0.55 and DCSMetrics.of(m) is m
    assert over_target(d) == over_target(m) == pytest.approx(0.05)
    assert over_target({"cost": "flops", "target_flops": 0.6, "flops_ratio": 0.5}) == 0.0
    assert over_target({}) == 0.0


def test_a_damaged_field_is_one_error_line():
    with pytest.raises(NascompressError, match="flops_ratio must be a number"):
        DCSMetrics.from_dict({"flops_ratio": "0.5"}, source="metrics.json")
    with pytest.raises(NascompressError, match="calibration has no ratio_before"):
        DCSMetrics.from_dict({"calibration": {"move": 0.1}}, source="metrics.json")
    cal = DCSMetrics.from_dict({"calibration": {"ratio_before": 0.7, "alpha_shift": 0.1}}, source="m").calibration
    assert isinstance(cal, Calibration) and cal.ratio_before == 0.7 and cal.extra == {"alpha_shift": 0.1}
