"""The units of ``bench/pretrained.py`` (``Bench``: one seed's dense base, ``dense_ft``, ``uniform@T``,
``dcs-<family>@T``, the family probe and the token methods; ``summarize``: its summary), shared with
``bench/dcs_generalise.py``, whose ``Cell`` runs the same units on other datasets and bases."""

from __future__ import annotations

import argparse
import copy
import fcntl
import json
import time
from pathlib import Path
from typing import Any

import torch

from _common import log_summary, save, uniform_summary  # noqa: E402  (puts the repository on sys.path)
import nascompress  # noqa: E402,F401  (torchvision CPU fix before timm)
from nascompress.data import count_classes
from nascompress.profiling.jobs import evaluate_run, profile  # noqa: E402
from nascompress.data import DataConfig, InputSpec, load_data  # noqa: E402
from nascompress.dcs_search.family import choose_family  # noqa: E402
from nascompress.dcs_search.prepare import calibration_images  # noqa: E402
from nascompress.methods import get_method  # noqa: E402
from nascompress.methods.uniform import UniformConfig, uniform_at_flops  # noqa: E402
from nascompress.pyapi.common import write_run  # noqa: E402
from nascompress.train.finetune import FinetuneJob, finetune, finetune_train_config  # noqa: E402
from nascompress.runs.io import load_with_arch, save_model  # noqa: E402
from nascompress.methods.dcs import DCSConfig
from nascompress.methods.dcs_importance import activation_stats  # noqa: E402
from nascompress.models.build import ModelSpec  # noqa: E402
from nascompress.retraining.config import RetrainConfig
from nascompress.retraining.run import RetrainJob, retrain, retrain_train_config  # noqa: E402
from nascompress.dcs_search import search_dcs  # noqa: E402
from nascompress.dcs_search.search_config import DCSSearchConfig, DCSSearchJob, search_train_config  # noqa: E402
from nascompress.dcs_search.materialize import MaterializeJob, materialize_search  # noqa: E402
from nascompress.train.config import TrainConfig
from nascompress.train.run import TrainJob, train  # noqa: E402
from nascompress.runs.json_io import read_json, write_json  # noqa: E402

TOKEN_METHODS = {"evit": {"keep_rate": 0.7}, "dynamicvit": {"rho": 0.7}, "sparsifiner": {"attn_keep_ratio": 0.5}}


def flops_ratio(dense: Path, run: Path) -> dict[str, Any]:
    res = profile(run, compare=dense, latency=False)
    c = res.comparison
    m = res.models[c.model]
    return {"flops": m.macs, "params": m.params, "flops_ratio": c.flops_ratio}


def done(run: Path) -> bool:
    m = run / "metrics.json"
    return m.is_file() and bool(read_json(m))


class Bench:
    """One seed's units; results go into ``res[seed]``."""

    def __init__(self, a: argparse.Namespace, seed: int, res: dict[str, Any], out: Path):
        self.a, self.seed, self.out = a, seed, out
        self.runs = Path(a.runs) / f"seed{seed}"
        self.res = res.setdefault(f"seed{seed}", {})
        self.data = DataConfig(
            dataset="fashion-mnist",
            **({"data_dir": a.data_dir} if a.data_dir else {}),
            train_limit=a.train_limit,
            eval_limit=a.eval_limit,
            subset_seed=seed,
        )
        self.dense = self.runs / "dense"
        self.full = res

    def save(self) -> None:
        """Merge this process's units into ``--out`` under a lock (several bench processes may share it)."""
        lock = self.out.with_name(self.out.name + ".lock")
        self.out.parent.mkdir(parents=True, exist_ok=True)
        with open(lock, "w") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            disk = json.loads(self.out.read_text()) if self.out.is_file() else {}
            self.merge(disk)
            disk["summary"] = self.summarize(disk)
            save(self.out, disk)

    def merge(self, disk: dict[str, Any]) -> None:
        """This process's units into the JSON read from disk (the seeds' units are merged, not replaced)."""
        for k, v in self.full.items():
            if k.startswith("seed") and isinstance(disk.get(k), dict):
                disk[k].update(v)
            else:
                disk[k] = v

    def summarize(self, disk: dict[str, Any]) -> dict[str, Any]:
        return summarize(disk, self.a.summary_targets)

    def ensure_dense(self) -> None:
        if not done(self.dense):
            t0 = time.time()
            train(
                TrainJob(
                    model=ModelSpec(
                        "vit_small_patch14_dinov2", {"img_size": 112, "num_classes": count_classes(self.data)}
                    ),
                    data=self.data,
                    train=TrainConfig(epochs=5, lr=None, seed=self.seed),
                    out=str(self.dense),
                    weights=self.a.weights,
                    reset_head=True,
                    linear_probe=True,
                ),
                force=True,
            )
            self.res["dense_wall_s"] = time.time() - t0
        dm = read_json(self.dense / "metrics.json")
        self.res["dense"] = {"val_top1": dm["best_val_top1"], "test_top1": dm["test_top1"], "l2": dm.get("l2")}
        self.save()

    def retrain(self, model_dir: Path, rt: Path) -> dict[str, Any]:
        """The library's retrain defaults (batch and feature distillation by its rules), teacher = dense."""
        if not done(rt):
            tc = retrain_train_config(epochs=self.a.retrain_epochs, seed=self.seed)
            rc = RetrainConfig(eta=0.0)
            retrain(
                RetrainJob(
                    model_dir=str(model_dir),
                    out=str(rt),
                    data=self.data,
                    train=tc,
                    retrain=rc,
                    teacher=str(self.dense),
                    auto_batch=True,
                ),
                force=True,
            )
        m = read_json(rt / "metrics.json")
        cfg = read_json(rt / "config.json")
        return {
            "val_top1": m["best_val_top1"],
            "test_top1": m["test_top1"],
            "best_epoch": m["best_epoch"],
            "peak_lr": m["peak_lr"],
            "batch_size": cfg["train"]["batch_size"],
            "feat_kd": cfg["retrain"]["feat_kd"],
            "epochs": cfg["train"]["epochs"],
            "train_time_s": m["train_time_s"],
            **log_summary(rt),
            **flops_ratio(self.dense, rt),
        }

    def dense_ft(self) -> None:
        off = self.runs / "dense_off"
        if not done(off):  # compression off (uniform keep 1: the plain model), so retrain applies as is
            model, arch = load_with_arch(self.dense)
            model, record = get_method("uniform").prepare_fresh(model, UniformConfig(keep=1.0))
            off.mkdir(parents=True, exist_ok=True)
            save_model(off, model.eval(), dict(copy.deepcopy(arch), methods=[record]))
            write_json(off / "config.json", {"data": self.data.__dict__})
            write_json(off / "metrics.json", {"compression": "off"})
        self.res["dense_ft"] = {"retrained": self.retrain(off, self.runs / "dense_ft")}
        self.save()

    def uniform(self, target: float) -> None:
        uni, rt = self.runs / f"uniform_{target}", self.runs / f"uniform_{target}_retrained"
        entry = self.res.setdefault(f"uniform@{target}", {})
        if not done(uni):
            model, arch = load_with_arch(self.dense)
            spec = arch["input"]
            x1 = torch.randn(1, spec["in_chans"], *spec["img_size"])
            pruned, record = uniform_at_flops(model.eval(), target, x1)  # the library's uniform pruning
            config = {"data": dict(self.data.__dict__), "uniform": {**record["config"], "target_flops_ratio": target}}
            write_run(uni, pruned.eval(), dict(copy.deepcopy(arch), methods=[record]), config=config, force=True)
            entry["pruned"] = uniform_summary(record)
            write_json(uni / "metrics.json", entry["pruned"])
        entry["pruned"] = read_json(uni / "metrics.json")
        entry["zero_shot"] = {
            "val_top1": evaluate_run(uni, split="val").top1,
            "test_top1": evaluate_run(uni).top1,
        }
        entry["retrained"] = self.retrain(uni, rt)
        self.save()

    def dcs_unit(self, family: str, target: float, at_most: bool = False) -> tuple[str, Path]:
        """The DCS unit's result key and the stem of its run directories (``STEM_search``, ``_mat``,
        ``_retrained``)."""
        tag = "-atmost" if at_most else ""
        return f"dcs-{family}{tag}@{target}", self.runs / f"dcs_{family}_{target}{tag.replace('-', '_')}"

    def dcs(self, family: str, target: float, at_most: bool = False) -> None:
        """``search dcs --target-flops target`` with every default (``at_most``: the target as a limit, as the
        pipeline's DCS stage runs it; unit ``dcs-<family>-atmost@T``), materialized and retrained."""
        name, stem = self.dcs_unit(family, target, at_most)
        search, mat = Path(f"{stem}_search"), Path(f"{stem}_mat")
        entry = self.res.setdefault(name, {})
        job = DCSSearchJob(
            source=str(self.dense.resolve()),
            out=str(search),
            method=DCSConfig(mlp_gates=family),
            search=DCSSearchConfig(target_flops=target, auto_batch=True, at_most=at_most),
            train=search_train_config(seed=self.seed),
            data=self.data,
        )
        t0 = time.time()
        if not (done(search) and read_json(search / "metrics.json").get("finished")):
            resume = (search / "checkpoint.safetensors").is_file()
            try:
                search_dcs(job, force=not resume, resume=resume)
            except nascompress.NascompressError as e:  # a collapse: recorded, the bench goes on
                entry["search"] = {"failed": str(e), "target_flops": target}
                self.save()
                return
            entry["search_wall_s"] = time.time() - t0
        sm = read_json(search / "metrics.json")
        keys = (
            "flops_ratio",
            "calibrated",
            "calibration",
            "mlp_gates",
            "mlp_kept",
            "qk_kept",
            "dense_val_top1",
            "val_top1",
            "batch_size",
            "init",
            "init_kl",
            "protected",
            "block_weights",
            "block_sensitivity",
            "search_time_s",
            "kept",
            "comparison",
            "stopped",
            "search_val_top1",
            "test_top1",
        )
        entry["search"] = {"target_flops": target, **{k: sm.get(k) for k in keys}, **log_summary(search)}
        if not done(mat):
            materialize_search(MaterializeJob(search_dir=str(search), out=str(mat)), force=True)
        entry["materialized"] = {
            "val_top1": evaluate_run(mat, split="val").top1,
            "test_top1": evaluate_run(mat).top1,
            "max_abs_logit_diff": read_json(mat / "metrics.json")["max_abs_logit_diff"],
        }
        self.save()
        entry["retrained"] = self.retrain(mat, Path(f"{stem}_retrained"))
        self.save()

    def family_probe(self, target: float) -> None:
        """What ``--mlp-gates auto`` chooses on this model (the search's own probe, no training)."""
        key = f"auto_family@{target}"
        if key in self.res:
            return
        dense, arch = load_with_arch(self.dense)
        spec = InputSpec.from_dict(arch["input"])
        images = calibration_images(load_data(self.data, spec=spec), spec, n=256, seed=self.seed)
        family, info = choose_family(
            dense, images, activation_stats(dense, images), target=target, align=8, hidden_fill="mean"
        )
        self.res[key] = {"mlp_gates": family, **info.to_dict()}
        self.save()

    def token(self, name: str) -> None:
        entry = self.res.setdefault(name, {"config": TOKEN_METHODS[name]})
        zs, ft = self.runs / f"{name}_zero_shot", self.runs / f"{name}_finetuned"
        m = finetune(
            FinetuneJob(
                run_dir=str(self.dense),
                method=name,
                config=TOKEN_METHODS[name],
                out=str(zs),
                data=self.data,
                zero_shot=True,
                train=finetune_train_config(name, seed=self.seed),
            ),
            force=True,
        )
        entry["zero_shot"] = {"val_top1": m.val_top1, "test_top1": m.test_top1}
        tc = finetune_train_config(name, epochs=self.a.epochs, seed=self.seed)
        m = finetune(
            FinetuneJob(
                run_dir=str(self.dense), method=name, config=TOKEN_METHODS[name], out=str(ft), data=self.data, train=tc
            ),
            force=True,
        )
        entry["finetuned"] = {
            "val_top1": m.best_val_top1,
            "test_top1": m.test_top1,
            **log_summary(ft),
            **flops_ratio(self.dense, ft),
        }
        self.save()


def summarize(res: dict[str, Any], targets: list[float]) -> dict[str, Any]:
    """Test top-1 per method and target (mean over the seeds that have it) and the goals' gaps."""
    seeds = [v for k, v in res.items() if k.startswith("seed")]

    def mean(path: list[str]) -> float | None:
        vals = []
        for s in seeds:
            v: Any = s
            for p in path:
                v = v.get(p) if isinstance(v, dict) else None
            if isinstance(v, (int, float)):
                vals.append(float(v))
        return sum(vals) / len(vals) if vals else None

    out: dict[str, Any] = {
        "seeds": len(seeds),
        "dense_probe_test": mean(["dense", "test_top1"]),
        "dense_ft_test": mean(["dense_ft", "retrained", "test_top1"]),
    }
    for t in targets:
        row = {m: mean([f"{m}@{t}", "retrained", "test_top1"]) for m in ("uniform", "dcs-hidden", "dcs-residual")}
        row.update(
            {
                f"{m}_flops": mean([f"{m}@{t}", "retrained", "flops_ratio"])
                for m in ("uniform", "dcs-hidden", "dcs-residual")
            }
        )
        ref = out["dense_ft_test"]
        best = max((row[m] for m in ("dcs-hidden", "dcs-residual") if row[m] is not None), default=None)
        if ref is not None and best is not None:
            row["dcs_best_vs_dense_ft"] = best - ref
        if best is not None and row["uniform"] is not None:
            row["dcs_best_vs_uniform"] = best - row["uniform"]
        out[str(t)] = row
    return out
