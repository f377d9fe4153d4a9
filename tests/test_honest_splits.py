"""Issue 68, items 1-3: a dataset without a test split gets one carved (class-stratified, seeded,
recorded) so that no decision and the report share images; every report says which images decided
and which measured; ``evaluate`` reads a folder holding just the split it reads; ``retrain`` takes a
dense model, and the pipeline shows that dense reference beside the compressed model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from nascompress.data import DataConfig, Subset, load_data
from nascompress.pipeline.files import read_summary
from nascompress.profiling.records import Evaluation
from nascompress.retraining.metrics import RetrainMetrics
from nascompress.train.metrics import TrainMetrics

from .conftest import invoke

COUNTS = {"ant": 6, "bee": 4, "cat": 4}


def make_folder(root: Path, splits=("train", "val"), counts=COUNTS, size=8) -> Path:
    """Tiny RGB PNGs, one colour per class (so a one-epoch model learns something)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for split in splits:
        for k, (c, n) in enumerate(counts.items()):
            d = root / split / c
            d.mkdir(parents=True)
            for i in range(n):
                a = rng.integers(0, 40, (size, size, 3), dtype=np.uint8)
                a[..., k] += 200
                Image.fromarray(a).save(d / f"{i}.png")
    return root


def image_paths(ds, root: str) -> list[str]:
    """The files of an ImageFolder split (through Subset views), relative to ``root``."""
    idx = None
    while isinstance(ds, Subset):
        idx = ds.indices if idx is None else ds.indices[idx]
        ds = ds.base
    picked = ds.samples if idx is None else [ds.samples[i] for i in idx.tolist()]
    return [str(Path(p).relative_to(root)) for p, _ in picked]


def _load(root: Path, seed: int = 0):
    return load_data(DataConfig(dataset=str(root), num_workers=0, subset_seed=seed), img_size=(8, 8))


# ---------------------------------------------------------------------------------------------
# 1. honest splits


def test_a_train_val_folder_gets_a_carved_test_split_no_decision_sees(tmp_path):
    root = make_folder(tmp_path / "d")
    b = _load(root)
    val, test = set(image_paths(b.val, str(root))), set(image_paths(b.test, str(root)))
    assert val and test and not val & test  # disjoint: the images that decide never measure
    assert val | test == {f"val/{c}/{i}.png" for c, n in COUNTS.items() for i in range(n)}
    for part in (b.val, b.test):  # class-stratified: every class on both sides
        assert {p.split("/")[1] for p in image_paths(part, str(root))} == set(COUNTS)
    rec = b.splits
    assert rec.carved is True and rec.decide == "val" and rec.measure == "test"
    assert rec.n_decide == len(b.val) and rec.n_measure == len(b.test) and rec.seed == 0
    assert rec.decide_from == f"{root}/val" and f"{root}/val" in rec.measure_from
    assert sorted(rec.measure_images) == sorted(test) and rec.measure_digest
    assert list(rec.to_dict()) == [
        *("decide", "measure", "decide_from", "measure_from", "carved", "n_decide", "n_measure"),
        *("seed", "fraction", "measure_digest", "measure_images"),
    ]  # the JSON's keys, in the order the metrics and the summary have always written them
    kept = rec.without_images()  # what a stage's metrics keep: the digest names the files
    assert kept.measure_images is None and "measure_images" not in kept.to_dict()
    assert kept.to_dict() == {k: v for k, v in rec.to_dict().items() if k != "measure_images"}
    # seeded by the run's seed: the same seed carves the same images, another seed others
    assert image_paths(_load(root).test, str(root)) == image_paths(b.test, str(root))
    assert any(image_paths(_load(root, s).test, str(root)) != image_paths(b.test, str(root)) for s in (1, 2, 3))


def test_a_train_only_folder_carves_its_test_split_from_train_not_from_val(tmp_path):
    root = make_folder(tmp_path / "d", splits=("train",), counts={"ant": 10, "bee": 10})
    b = load_data(DataConfig(dataset=str(root), num_workers=0, val_fraction=0.2), img_size=(8, 8))
    tr, va, te = (set(image_paths(p, str(root))) for p in (b.train, b.val, b.test))
    assert not tr & va and not tr & te and not va & te and len(tr | va | te) == 20
    assert b.splits.carved is True and "train" in b.splits.measure_from


def test_a_test_folder_is_the_test_split_and_builtin_splits_are_unchanged(tmp_path):
    root = make_folder(tmp_path / "d", splits=("train", "val", "test"))
    b = _load(root)
    assert set(image_paths(b.test, str(root))) == {f"test/{c}/{i}.png" for c, n in COUNTS.items() for i in range(n)}
    assert len(b.val) == sum(COUNTS.values())  # val/ whole: nothing carved
    rec = b.splits
    assert rec.carved is False and rec.measure_from == f"{root}/test" and rec.measure_images is None
    assert list(rec.to_dict()) == [
        *("decide", "measure", "decide_from", "measure_from", "carved", "n_decide", "n_measure")
    ]  # nothing carved: no seed, share nor files
    d = load_data(DataConfig(dataset="digits"))  # a real test split: the same images as before, recorded
    assert d.splits.carved is False and len(d.test) == 449 and len(d.val) == 135


# ---------------------------------------------------------------------------------------------
# 2. evaluate a folder holding just the split it reads; 3. retrain a dense model


@pytest.fixture(scope="module")
def folder_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("honest")
    root = make_folder(d / "data")
    run = d / "run"
    r = invoke(
        "train", "--dataset", root, "--img-size", 8, "--patch-size", 4, "--embed-dim", 16, "--depth", 1,
        "--num-heads", 1, "--epochs", 1, "--batch-size", 8, "--out", run, "--json",
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    return {"dir": d, "root": root, "run": run, "metrics": json.loads(r.stdout)}


def test_a_runs_metrics_say_which_images_decided_and_measured(folder_run):
    m = TrainMetrics.from_dict(folder_run["metrics"], source="train --json")
    assert m.splits.carved is True and "measure_images" not in m.splits  # (the digest names them)
    assert m.test_n == m.splits.n_measure < sum(COUNTS.values())  # not the validation images


def test_evaluate_reads_a_folder_of_only_val_or_only_test_or_plain_class_folders(folder_run):
    d, run = folder_run["dir"], folder_run["run"]
    only_val = d / "only_val"
    shutil.copytree(folder_run["root"] / "val", only_val / "val")
    r = invoke("evaluate", run, "--dataset", only_val, "--split", "val", "--teacher", run, "--json")
    assert r.exit_code == 0, r.output
    res = Evaluation.from_dict(json.loads(r.stdout), source="evaluate --json")
    assert res.n == sum(COUNTS.values()) and res.agreement == 100.0
    assert res.splits.measure == "val" and res.splits.measure_from == str(only_val / "val")
    assert res.splits.decide is None and "decide" not in res.splits  # one split read on its own
    r = invoke("evaluate", run, "--dataset", only_val, "--split", "test")
    assert r.exit_code == 1 and "has no test/ folder" in r.stderr and "--split val" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    only_test = d / "only_test"
    shutil.copytree(folder_run["root"] / "val", only_test / "test")
    r = invoke("evaluate", run, "--dataset", only_test, "--json")  # --split test, the default
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["n"] == sum(COUNTS.values())
    plain = d / "plain"  # class folders themselves, a class missing: matched to the model's by name
    shutil.copytree(folder_run["root"] / "val", plain)
    shutil.rmtree(plain / "bee")
    r = invoke("evaluate", run, "--dataset", plain, "--split", "val", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["n"] == COUNTS["ant"] + COUNTS["cat"]


def test_retrain_accepts_a_dense_model(folder_run, tmp_path):
    out = tmp_path / "dense_ft"
    r = invoke("retrain", folder_run["run"], "--out", out, "--epochs", 1, "--teacher", folder_run["run"])
    assert r.exit_code == 0, r.output
    assert "retrained (dense)" in r.stdout
    m = RetrainMetrics.from_dict(json.loads((out / "metrics.json").read_text()), source="metrics.json")
    assert m.methods == [] and m.kd is True and m.splits.carved is True


# ---------------------------------------------------------------------------------------------
# the pipeline: the splits record and report.dense_reference


def _pipeline_config(root: Path, **report) -> dict:
    return {
        "format": "nascompress-pipeline/1",
        "seed": 0,
        "device": "cpu",
        "data": {"dataset": str(root)},
        "base": {
            "train": {
                "img_size": 8,
                "patch_size": 4,
                "embed_dim": 16,
                "depth": 1,
                "num_heads": 1,
                "epochs": 1,
                "batch_size": 8,
            }
        },  # fmt: skip
        "goal": {"max_flops": 0.9},
        "stages": {
            "dcs": {"target_flops": 0.9, "epochs": 1, "batch_size": 8},
            "retrain": {"epochs": 1, "eta": 0, "batch_size": 8},
        },
        "report": {"latency": False, **report},
    }


def test_the_pipeline_reports_its_splits_and_the_dense_reference(folder_run, tmp_path):
    cfg = tmp_path / "p.yaml"
    cfg.write_text(yaml.safe_dump(_pipeline_config(folder_run["root"], dense_reference=True), sort_keys=False))
    out = tmp_path / "out"
    r = invoke("pipeline", cfg, "--out", out)
    assert r.exit_code == 0, r.output
    s = read_summary(out)
    assert s.splits.carved is True and s.splits.n_measure == s.dense.test_n
    assert len(s.splits.measure_images) == s.splits.n_measure
    ref = s.dense_reference
    assert ref.run == str(out / "dense_reference") and ref.test_n == s.dense.test_n
    assert ref.teacher == "base" and (out / "done" / "retrain_dense.json").is_file()
    if s.final is not None:
        assert ref.final_top1_change == pytest.approx(s.final.test_top1 - ref.test_top1)
    page = (out / "report.html").read_text()
    assert 'id="dense-reference"' in page and "no decision saw these images" in page
    marker = json.loads((out / "done" / "retrain_dense.json").read_text())
    r = invoke("pipeline", cfg, "--out", out)  # resumable: every step complete, skipped
    assert r.exit_code == 0, r.output
    assert json.loads((out / "done" / "retrain_dense.json").read_text()) == marker  # not run again


def test_a_dense_reference_without_a_retrain_stage_is_refused(folder_run, tmp_path):
    c = _pipeline_config(folder_run["root"], dense_reference=True)
    del c["stages"]["retrain"]
    c["goal"] = {"max_flops": 0.95}
    c["stages"]["dcs"]["target_flops"] = 0.9
    cfg = tmp_path / "p.yaml"
    cfg.write_text(yaml.safe_dump(c, sort_keys=False))
    r = invoke("pipeline", cfg, "--out", tmp_path / "out")
    assert r.exit_code == 1 and "report.dense_reference" in r.stderr and "retrain stage" in r.stderr
    assert not (tmp_path / "out").exists()
