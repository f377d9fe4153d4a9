"""Does DCS hold on data nobody tuned it to? (issue: DCS that lands on its target by itself.)

One set of library defaults, every cell: datasets (``--datasets``: ``fashion-mnist``, ``digits``
(scikit-learn's bundled 8x8 digits) and ``lfw-faces`` (scikit-image's bundled LFW photographs, faces
vs non-faces: another domain), all real and offline; any ImageFolder root too; ``NAME:K`` keeps the
first K classes only, so the class count varies), two
bases (``--bases``): ``dinov2`` (the DINOv2 ViT-S/14 backbone at 112 px + a linear-probe head:
the model a user starts from) and ``scratch`` (the README main job's small ViT, 28 px, patch 4, width
96, depth 6, 3 heads, trained from scratch with ``train``'s recipe on the same images), FLOPs targets
(``--targets``) and seeds (``--seeds``: the subsets, the data order and every search). Per cell, the
units of ``bench/pretrained.py``: ``dense_ft`` (the base retrained with compression off: the
reference), ``uniform@T`` (uniform magnitude pruning, then the same retraining), ``torch-pruning@T``
(Torch-Pruning, ``pip install torch-pruning==1.6.1``: global group-magnitude pruning of the MLP hidden
neurons, ``round_to`` 8, then the same retraining) and ``dcs@T`` (``search dcs --target-flops T``
with every default, ``materialize``, the same retraining; ``dcs-atmost@T`` the same with ``at_most``, the
target a limit as the pipeline's DCS stage sets it, so that channel-only lands at or under T), and
``ib@T`` (the searched model retrained with the IB bound at each weight of ``--etas`` and warm-up share
of ``--ib-warmups``, the rest as the library's ``retrain`` defaults); each DCS search's
budget record (``budget``, ``at_target_share``, ``calibration_move``, ``projections``) is kept.

Results per dataset, base and seed in ``--out`` (default ``bench/results/dcs_generalise.json``) and
the issue's goals checked per cell in its ``summary``. Each unit is a run directory under ``--runs``,
skipped when finished, so the bench resumes.

    python bench/dcs_generalise.py --datasets fashion-mnist,digits --bases scratch,dinov2 --seeds 0,1
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path
from typing import Any

import yaml

from _common import ROOT, header, log_summary, torch_pruning_keep  # noqa: E402  (puts the repository on sys.path)
from _pretrained import Bench, done, flops_ratio  # noqa: E402  (bench/pretrained.py's units: dense_ft, uniform@T, dcs@T)
import torch  # noqa: E402

from nascompress.data import count_classes
from nascompress.profiling.jobs import evaluate_run  # noqa: E402
from nascompress.train.finetune import FinetuneJob, finetune, finetune_train_config  # noqa: E402
from nascompress.methods import get_method  # noqa: E402
from nascompress.pipeline import run_pipeline  # noqa: E402
from nascompress.data import DataConfig  # noqa: E402
from nascompress.runs.io import load_with_arch  # noqa: E402
from nascompress.methods.uniform import uniform_from_keep  # noqa: E402
from nascompress.models.build import custom_vit_spec  # noqa: E402
from nascompress.profiling import count_flops  # noqa: E402
from nascompress.pyapi.common import write_run  # noqa: E402
from nascompress.retraining.config import RetrainConfig
from nascompress.retraining.run import RetrainJob, retrain, retrain_train_config  # noqa: E402
from nascompress.train.run import TrainJob, train, train_recipe  # noqa: E402
from nascompress.runs.json_io import read_json, write_json  # noqa: E402

SCRATCH = dict(img_size=28, patch_size=4, embed_dim=96, depth=6, num_heads=3)  # the README main job's base
SCRATCH_EPOCHS = 30  # on 2,000 images: 480 steps, as many as the main job's base on 54,000 images gets in 1 epoch


class Cell(Bench):
    """One (dataset, base, seed): ``Bench``'s units (those of ``bench/pretrained.py``) on that dataset and base."""

    def __init__(self, a: argparse.Namespace, dataset: str, base: str, seed: int, res: dict[str, Any], out: Path):
        self.key = f"{dataset}/{base}"
        self.base_kind = base
        super().__init__(a, seed, res.setdefault(self.key, {}), out)
        self.full = res
        self.runs = Path(a.runs) / dataset.replace("/", "_").replace(":", "_classes") / base / f"seed{seed}"
        self.dense = self.runs / "dense"
        # "digits:5": the first 5 classes only (a class-count subset); "fashion-mnist:5-9": classes 5 to 9
        # (another task)
        name, _, k = dataset.partition(":")
        lo, _, hi = k.partition("-")
        keep = range(int(lo), int(hi) + 1) if hi else range(int(k)) if k else None
        self.data = DataConfig(
            dataset=name,
            train_limit=a.train_limit,
            eval_limit=a.eval_limit,
            subset_seed=seed,
            classes=",".join(str(c) for c in keep) if keep else None,
        )

    def merge(self, disk: dict[str, Any]) -> None:
        """Units under ``dataset/base`` -> ``seedN`` (merged, not replaced)."""
        for k, v in self.full.items():
            if isinstance(v, dict) and isinstance(disk.get(k), dict) and "/" in k:
                for seed, units in v.items():
                    disk[k].setdefault(seed, {}).update(units)
            else:
                disk[k] = v

    def summarize(self, disk: dict[str, Any]) -> dict[str, Any]:
        return summarize(disk, self.a.targets)

    def ensure_dense(self) -> None:
        if self.base_kind == "dinov2":
            return super().ensure_dense()
        if not done(self.dense):
            t0 = time.time()
            spec = custom_vit_spec(**SCRATCH, num_classes=count_classes(self.data), in_chans=1)
            train(
                TrainJob(
                    model=spec,
                    data=self.data,
                    out=str(self.dense),
                    train=train_recipe(fine_tune=False, epochs=SCRATCH_EPOCHS, batch_size=64, seed=self.seed),
                ),
                force=True,
            )
            self.res["dense_wall_s"] = time.time() - t0
        dm = read_json(self.dense / "metrics.json")
        self.res["dense"] = {"val_top1": dm["best_val_top1"], "test_top1": dm["test_top1"]}
        self.save()

    def torch_pruning(self, target: float) -> None:
        """Torch-Pruning (the tool a user would pick instead): ``MetaPruner`` with its group L2
        magnitude importance, global pruning of the MLP hidden neurons (fc1 out / fc2 in; every other
        layer ignored), ``round_to`` 8, its pruning ratio bisected to the FLOPs target; the kept
        neurons are gathered into a nascompress run (the ``uniform`` record with those indices) and
        retrained with the same recipe."""
        import torch_pruning as tp  # optional: the external peer (pip install torch-pruning==1.6.1)

        run, rt = self.runs / f"tp_{target}", self.runs / f"tp_{target}_retrained"
        entry = self.res.setdefault(f"torch-pruning@{target}", {})
        if not done(run):
            dense, arch = load_with_arch(self.dense)
            dense.eval()
            spec = arch["input"]
            x = torch.randn(1, spec["in_chans"], *spec["img_size"])
            keep, ratio = torch_pruning_keep(dense, x, target)
            model, record = uniform_from_keep(dense, keep)  # the kept neurons as a nascompress model
            r = count_flops(model, x).total / count_flops(dense, x).total
            new_arch = dict(copy.deepcopy(arch), methods=[record])
            write_run(run, model.eval(), new_arch, config={"data": dict(self.data.__dict__)}, force=True)
            write_json(
                run / "metrics.json",
                {
                    "pruning_ratio": ratio,
                    "flops_ratio": r,
                    "torch_pruning": tp.__version__,
                    "importance": "GroupMagnitudeImportance(p=2)",
                    "global_pruning": True,
                    "round_to": 8,
                    "hidden_kept": [len(b["hidden_keep"]) for b in record["blocks"]],
                },
            )
        entry["pruned"] = read_json(run / "metrics.json")
        entry["zero_shot"] = {
            "val_top1": evaluate_run(run, split="val").top1,
            "test_top1": evaluate_run(run).top1,
        }
        entry["retrained"] = self.retrain(run, rt)
        self.save()

    def ib(self, target: float) -> None:
        """The IB bound's weight on the same retraining of the searched model (``--etas``; 0 is the
        bench's own retraining): what the bound contributes, per eta."""

        mat = self.runs / f"dcs_auto_{target}_mat"
        if not done(mat):
            return
        unit = f"ib@{target}"
        # a unit holds several runs: start from the file's, so that a run of some settings keeps the others
        on_disk = read_json(self.out).get(self.key, {}).get(f"seed{self.seed}", {}) if self.out.is_file() else {}
        entry = self.res.setdefault(unit, dict(on_disk.get(unit) or {}))
        default = RetrainConfig()
        for eta in self.a.etas:
            bound = eta > 0  # no bound: nothing to warm up or ramp
            for w in self.a.ib_warmups if bound else [default.warmup_frac]:
                for sched in self.a.ib_schedules if bound else [default.eta_schedule]:
                    tag = (
                        f"eta{eta:g}"
                        + ("" if w == default.warmup_frac else f"_warmup{w:g}")
                        + ("" if sched == default.eta_schedule else f"_{sched}")
                    )
                    rt = self.runs / f"dcs_auto_{target}_retrained_{tag}"
                    if not done(rt):
                        tc = retrain_train_config(epochs=self.a.retrain_epochs, seed=self.seed)
                        rc = RetrainConfig(eta=eta, warmup_frac=w, eta_schedule=sched)
                        retrain(
                            RetrainJob(
                                model_dir=str(mat),
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
                    entry[tag] = {
                        "val_top1": m["best_val_top1"],
                        "test_top1": m["test_top1"],
                        "warmup_frac": w,
                        "eta_schedule": sched,
                        "warm_epochs": m.get("warm_epochs"),
                        "best_epoch": m["best_epoch"],
                        **log_summary(rt),
                    }
        self.save()

    def dcs(self, family: str, target: float, at_most: bool = False) -> None:
        super().dcs(family, target, at_most=at_most)
        name, stem = self.dcs_unit(family, target, at_most)
        entry = self.res[name]
        sm = Path(f"{stem}_search") / "metrics.json"
        if sm.is_file():
            m = read_json(sm)
            entry["search"].update(
                {
                    k: m.get(k)
                    for k in (
                        "budget",
                        "at_target_share",
                        "calibration_move",
                        "projections",
                        "teacher_cached",
                        "mlp_gates",
                        "search_time_s",
                    )
                }
            )
            self.save()

    def evit(self, target: float) -> None:
        """Token-only, what EViT alone gives: its default layers (4, 7, 10 of 12) with one keep rate,
        bisected on the FLOPs to land at or under ``target``, fine-tuned (``finetune``'s EViT recipe)
        for ``--retrain-epochs``, the budget every other unit's retraining gets."""
        ft = self.runs / f"evit_{target}_finetuned"
        entry = self.res.setdefault(f"evit@{target}", {})
        dense, arch = load_with_arch(self.dense)
        spec = arch["input"]
        x = torch.randn(1, spec["in_chans"], *spec["img_size"])
        ref = count_flops(dense.eval(), x).total

        def ratio(keep: float) -> float:
            model = get_method("evit").prepare_fresh(copy.deepcopy(dense), {"keep_rate": keep})[0]
            return count_flops(model.eval(), x).total / ref

        lo, hi = 0.05, 1.0  # the FLOPs grow with the keep rate: the largest rate at or under the target
        for _ in range(12):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if ratio(mid) <= target else (lo, mid)
        keep = round(lo, 4)
        if not done(ft):
            tc = finetune_train_config("evit", epochs=self.a.retrain_epochs, seed=self.seed)
            finetune(
                FinetuneJob(
                    run_dir=str(self.dense),
                    method="evit",
                    config={"keep_rate": keep},
                    out=str(ft),
                    data=self.data,
                    train=tc,
                ),
                force=True,
            )
        m = read_json(ft / "metrics.json")
        entry.update(
            keep_rate=keep,
            val_top1=m["best_val_top1"],
            test_top1=m["test_top1"],
            epochs=self.a.retrain_epochs,
            **log_summary(ft),
            **flops_ratio(self.dense, ft),
        )
        self.save()

    def pipeline(self, target: float) -> None:
        """``nascompress pipeline`` as a user runs it on this base: the shipped recipe's stages
        (``configs/dinov2-fashion-mnist.yaml`` on the DINOv2 base, ``configs/fashion-mnist.yaml`` on the
        scratch one), this cell's data and seed, the dense run as its base, the goal ``max_flops`` at
        ``target`` and ``--retrain-epochs`` of retraining (the budget of the other units); no
        latency report. Its study picks channels + tokens or tokens alone; the pick is recorded. Its
        ``test_top1`` is the retraining loop's test evaluation (``final/metrics.json``, in the loop's precision,
        as every other unit's); ``test_top1_report`` the report's (``summary.json``, fp32).
        ``--pipeline-dcs-target``: the recipe with its DCS stage at that target instead (unit
        ``pipeline-dcsX@T``); ``--pipeline-at-most``: that stage with ``at_most`` (``-atmost``)."""
        dcs_t = self.a.pipeline_dcs_target
        tag = ("" if dcs_t is None else f"_dcs{dcs_t:g}") + ("_atmost" if self.a.pipeline_at_most else "")
        out = self.runs / f"pipeline_{target}{tag}"
        recipe = "dinov2-fashion-mnist.yaml" if self.base_kind == "dinov2" else "fashion-mnist.yaml"
        cfg = yaml.safe_load((ROOT / "configs" / recipe).read_text())
        cfg["seed"] = self.seed
        cfg["data"] = {
            k: v
            for k, v in dict(
                dataset=self.data.dataset,
                train_limit=self.data.train_limit,
                eval_limit=self.data.eval_limit,
                classes=self.data.classes,
            ).items()
            if v is not None
        }
        cfg["base"] = {"run": str(self.dense.resolve())}
        cfg["goal"] = {"max_flops": target}
        for stage in cfg["stages"].values():
            stage.pop("train_limit", None)  # the cell's images, every stage
        cfg["stages"]["retrain"]["epochs"] = self.a.retrain_epochs
        if dcs_t is not None:
            cfg["stages"]["dcs"]["target_flops"] = dcs_t
        if self.a.pipeline_at_most:
            cfg["stages"]["dcs"]["at_most"] = True
        cfg.pop("export", None)
        cfg["report"] = {"latency": False}
        path = self.runs / f"pipeline_{target}{tag}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        t0 = time.time()
        summ = run_pipeline(path, out=out, progress=False).to_dict()  # (as summary.json holds it)
        pick = read_json(out / "tokens" / "pick.json") if (out / "tokens" / "pick.json").is_file() else {}
        # the retraining loop's test evaluation, as every other unit's, of the model the pipeline kept (its
        # retrained pick, or the channel-only model that its confirm step kept instead)
        final = Path(summ["final"]["run"]) / "metrics.json"
        fm = read_json(final) if final.is_file() else {}
        loop = fm.get("test_top1")
        self.res[f"pipeline{tag.replace('_', '-')}@{target}"] = {
            "recipe": recipe,
            "dcs_target": cfg["stages"]["dcs"]["target_flops"],
            "dcs_at_most": bool(self.a.pipeline_at_most),
            "test_top1": summ["final"]["test_top1"] if loop is None else loop,
            "test_top1_report": summ["final"]["test_top1"],  # the report's evaluation (summary.json: fp32)
            "test_top1_from": "the report" if loop is None else "the retraining loop",
            # the retraining's best validation top-1: what a keep-the-better rule against channel-only would compare
            "val_top1": fm.get("best_val_top1"),
            "flops_ratio": summ["comparison"]["flops_ratio"],
            "methods": summ["final"].get("methods"),
            "picked_study": pick.get("picked_study"),
            "candidates": pick.get("candidates"),
            "dcs": {k: summ["decisions"].get("dcs", {}).get(k) for k in ("kept", "reason", "mlp_gates")},
            # the pick against the channel-only model after the same retraining (stages.retrain.confirm_pick)
            "confirm": summ["decisions"].get("confirm"),
            "stage_seconds": {st["step"]: st["seconds"] for st in summ.get("stages", [])},
            "wall_s_this_call": time.time() - t0,
        }
        self.save()


def _get(d: Any, *path: str) -> Any:
    for p in path:
        d = d.get(p) if isinstance(d, dict) else None
    return d


def summarize(res: dict[str, Any], targets: list[float]) -> dict[str, Any]:
    """Per cell (dataset/base/seed) and target: the issue's goals, each with its gap."""
    out: dict[str, Any] = {}
    cells = {key: seeds for key, seeds in res.items() if "/" in key and isinstance(seeds, dict)}
    # every target measured in the file, not only this run's (a run of one target keeps the others' summary)
    targets = sorted(
        {
            *targets,
            *(float(u.rpartition("@")[2]) for seeds in cells.values() for r in seeds.values() for u in r if "@" in u),
        },
        reverse=True,
    )
    for key, seeds in cells.items():
        for seed, r in seeds.items():
            dense, ft = _get(r, "dense", "test_top1"), _get(r, "dense_ft", "retrained", "test_top1")
            for t in targets:
                dcs, uni = r.get(f"dcs-auto@{t}") or {}, r.get(f"uniform@{t}") or {}
                cell: dict[str, Any] = {
                    "dense": dense,
                    "dense_ft": ft,
                    "search_flops_ratio": _get(dcs, "search", "flops_ratio"),
                    "at_target_share": _get(dcs, "search", "at_target_share"),
                    "calibration_move": _get(dcs, "search", "calibration_move"),
                    "searched": _get(dcs, "materialized", "test_top1"),
                    "dcs": _get(dcs, "retrained", "test_top1"),
                    "dcs_flops": _get(dcs, "retrained", "flops_ratio"),
                    "uniform": _get(uni, "retrained", "test_top1"),
                    "uniform_flops": _get(uni, "retrained", "flops_ratio"),
                    "torch_pruning": _get(r, f"torch-pruning@{t}", "retrained", "test_top1"),
                    "torch_pruning_flops": _get(r, f"torch-pruning@{t}", "retrained", "flops_ratio"),
                    "failed": _get(dcs, "search", "failed"),
                    # the baseline inside the search: which model it kept, both validation scores
                    "kept": _get(dcs, "search", "kept"),
                    "kept_val": _get(dcs, "search", "val_top1"),
                    "in_search_dcs_val": _get(dcs, "search", "comparison", "dcs", "val_top1"),
                    "in_search_magnitude_val": _get(dcs, "search", "comparison", "magnitude", "val_top1"),
                    "stopped": _get(dcs, "search", "stopped", "reason"),
                }
                before = 6.0 if t >= 0.7 else 12.0
                after = 1.0 if t >= 0.7 else 2.0
                goals = {}
                if dense is not None and cell["searched"] is not None:
                    goals[f"searched within {before:g} pt of dense"] = dense - cell["searched"] <= before
                if ft is not None and cell["dcs"] is not None:
                    goals[f"retrained within {after:g} pt of dense_ft"] = ft - cell["dcs"] <= after
                if cell["uniform"] is not None and cell["dcs"] is not None:
                    goals[">= 3 pt above uniform"] = cell["dcs"] - cell["uniform"] >= 3.0
                if cell["torch_pruning"] is not None and cell["dcs"] is not None:
                    goals[">= 1 pt above Torch-Pruning"] = cell["dcs"] - cell["torch_pruning"] >= 1.0
                if t >= 0.7 and dense is not None and cell["dcs"] is not None:
                    goals["not below the base"] = cell["dcs"] >= dense
                if cell["kept"] is not None and cell["in_search_magnitude_val"] is not None:
                    goals["kept >= the magnitude baseline (validation)"] = (
                        cell["kept_val"] >= cell["in_search_magnitude_val"]
                    )
                if cell["torch_pruning"] is not None and cell["dcs"] is not None:
                    goals["kept >= Torch-Pruning (test)"] = cell["dcs"] >= cell["torch_pruning"]
                if key.endswith("/dinov2") and dense is not None and cell["dcs"] is not None:
                    goals["not below the probe"] = cell["dcs"] >= dense
                if cell["failed"]:  # the search stopped (collapsed or off target) with the library's defaults
                    goals["search finished with the defaults"] = False
                if cell["calibration_move"] is not None:
                    goals["calibration move < 0.02"] = cell["calibration_move"] < 0.02
                cell["goals"] = goals
                out[f"{key}/{seed}@{t}"] = cell
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", default="weights/dinov2_vits14_112.safetensors")
    ap.add_argument("--runs", default="runs/dcs_generalise")
    ap.add_argument("--out", default="bench/results/dcs_generalise.json")
    ap.add_argument("--datasets", default="fashion-mnist,digits,lfw-faces,fashion-mnist:5")
    ap.add_argument("--bases", default="scratch,dinov2")
    ap.add_argument("--targets", default="0.7,0.6")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--train-limit", type=int, default=2000)
    ap.add_argument("--eval-limit", type=int, default=1000)
    ap.add_argument("--retrain-epochs", type=int, default=3)
    ap.add_argument(
        "--units",
        default="dense_ft,dcs,uniform,torch-pruning",
        help="in order: dense_ft, dcs, dcs-atmost (dcs with the target as a limit, as the pipeline's DCS stage), "
        "uniform, torch-pruning, ib, evit (token-only), pipeline (at every target)",
    )
    ap.add_argument("--etas", default="0,5,50", help="the ib unit's IB-bound weights (50: the paper's)")
    ap.add_argument(
        "--ib-warmups",
        default="0.3",
        help="the ib unit's warm-up shares (epochs on CE + KD only before "
        "the bound joins; 0.3: the paper's and the default), per eta > 0",
    )
    ap.add_argument(
        "--ib-schedules",
        default="step",
        help="the ib unit's weight schedules after the warm-up (step: the paper's and the default; linear: ramped)",
    )
    ap.add_argument(
        "--pipeline-dcs-target", type=float, default=None, help="the pipeline unit's DCS target (default: its recipe's)"
    )
    ap.add_argument("--pipeline-at-most", action="store_true", help="the pipeline unit's DCS stage with at_most")
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    a.targets = [float(t) for t in a.targets.split(",")]
    a.etas = [float(e) for e in a.etas.split(",")]
    a.ib_warmups = [float(w) for w in a.ib_warmups.split(",")]
    a.ib_schedules = a.ib_schedules.split(",")
    a.data_dir, a.summary_targets = None, a.targets
    out = Path(a.out)
    res: dict[str, Any] = dict(header())
    res["protocol"] = {
        "train_images": a.train_limit,
        "eval_images": a.eval_limit,
        "retrain_epochs": a.retrain_epochs,
        "scratch_base": dict(SCRATCH, epochs=SCRATCH_EPOCHS),
        "dinov2_base": "vit_small_patch14_dinov2 at 112 px + linear probe (train --linear-probe)",
        "defaults": "library defaults for search dcs (mlp_gates auto) and retrain; nothing per dataset",
    }
    for dataset in a.datasets.split(","):
        for base in a.bases.split(","):
            for seed in [int(s) for s in a.seeds.split(",")]:
                c = Cell(a, dataset, base, seed, res, out)
                c.ensure_dense()
                for u in a.units.split(","):
                    for t in a.targets if u != "dense_ft" else [None]:
                        if u == "dense_ft":
                            c.dense_ft()
                        elif u == "uniform":
                            c.uniform(t)
                        elif u == "dcs":
                            c.dcs("auto", t)
                        elif u == "dcs-atmost":
                            c.dcs("auto", t, at_most=True)
                        elif u == "torch-pruning":
                            c.torch_pruning(t)
                        elif u == "ib":
                            c.ib(t)
                        elif u == "evit":
                            c.evit(t)
                        elif u == "pipeline":
                            c.pipeline(t)
                        else:
                            raise SystemExit(f"unknown unit {u!r}")
    print(json.dumps(json.loads(out.read_text()).get("summary"), indent=1))


if __name__ == "__main__":
    main()
