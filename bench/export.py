"""Exported models against PyTorch: agreement and the compressed/dense speed ratio per runtime.

Two model families, each exported with ``nascompress.deploy.export_run`` (ONNX, fp32, dynamic
batch, and a ``torch.export`` program):

1. The main job (``configs/fashion-mnist.yaml``): its dense base and its compressed model (DCS
   channels + EViT tokens). ``--dense RUN --compressed RUN`` take a pipeline's ``base`` and
   ``final`` runs; without them a stand-in is made here: the config's base architecture trained
   for ``--epochs`` on ``--train-limit`` images, DCS channels chosen by measured activation
   importance at the config's DCS target and materialized by the method's own path, EViT keep
   rate 0.7 on top, retrained ``--retrain-epochs`` with the dense model as teacher.
2. DeiT-S/224 (``deit_small_patch16_224``, random weights, 10 classes): dense, EViT keep rate 0.7,
   and DCS at about ``--deit-dcs-flops`` x the dense FLOPs (kept channels chosen by weight
   magnitude, widths multiples of 8, set as the supernet's gates and materialized by DCS's own
   ``materialize``).

Agreement: every exported file against the PyTorch model on ``--agree-images`` class-stratified
Fashion-MNIST test images (seed 0) preprocessed with each model's own input spec (max |logit
difference|, top-1 agreement, and top-1 accuracy of both). Speed: ONNX Runtime (CPU provider,
``--threads`` intra-op threads) and PyTorch eager (inference mode, the same threads), every model
of a family in both runtimes timed interleaved in one process (rotating order, medians), at
batch 1 and a larger batch; the compressed/dense throughput ratio is reported per runtime.

    python bench/export.py --threads 2 --out bench/results/export.json
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import ROOT, header, save  # noqa: E402  (puts the repository on sys.path)

import torch  # noqa: E402

import nascompress  # noqa: E402
from nascompress.data import DataConfig, InputSpec, load_data, preprocess  # noqa: E402
from nascompress.deploy import ExportConfig, export_run  # noqa: E402
from nascompress.deploy.verify import onnx_runner, program_runner  # noqa: E402
from nascompress.runs.io import load_arch, load_with_arch  # noqa: E402
from nascompress.methods import get_method  # noqa: E402
from nascompress.methods.dcs import DCSConfig
from nascompress.methods.dcs_importance import channel_importance  # noqa: E402
from nascompress.models.build import ModelSpec, build_model  # noqa: E402
from nascompress.profiling import time_models  # noqa: E402
from _standins import dcs_at_flops, main_job_standin, save_run  # noqa: E402  (shared with quantize)

IMAGENET = {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}


# ---------------------------------------------------------------------------------------------
# Models


def deit_runs(args, work: Path) -> dict[str, Path]:
    spec = ModelSpec("deit_small_patch16_224", {"num_classes": 10})
    torch.manual_seed(0)
    dense = build_model(spec).eval()
    inp = {
        "img_size": [224, 224],
        "in_chans": 3,
        **IMAGENET,
        "interpolation": "bicubic",
        "crop_pct": 1.0,
        "crop_mode": "center",
    }
    x1 = torch.randn(1, 3, 224, 224)
    evit, evit_rec = get_method("evit").prepare_fresh(copy.deepcopy(dense), {"keep_rate": 0.7})
    sup, _ = get_method("dcs").prepare_fresh(copy.deepcopy(dense), DCSConfig(qk_mask="static"))
    imp = [channel_importance(b) for b in sup.blocks]
    ratio, share, dcs, dcs_rec = dcs_at_flops(dense, imp, args.deit_dcs_flops, x1)
    return {
        "dense": save_run(work, "deit_dense", dense, spec, inp, []),
        "evit_0.7": save_run(work, "deit_evit", evit.eval(), spec, inp, [evit_rec]),
        f"dcs_{ratio:.2f}x": save_run(work, "deit_dcs", dcs, spec, inp, [dcs_rec]),
    }


# ---------------------------------------------------------------------------------------------
# Measurements


def test_images(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` class-stratified Fashion-MNIST test images (uint8, seed 0) and their labels."""
    bundle = load_data(
        DataConfig(dataset="fashion-mnist", eval_limit=n, subset_seed=0), img_size=(28, 28), augment=False
    )
    return bundle.test.__getitems__(list(range(len(bundle.test))))


def agreement(run: Path, files: dict[str, Path], images: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
    model, arch = load_with_arch(run)
    spec = InputSpec.from_dict(arch["input"])
    runners = {"onnxruntime": onnx_runner(files["onnx"])[0], "torch.export": program_runner(files["torch-export"])[0]}
    ref, got = [], {k: [] for k in runners}
    for i in range(0, len(images), 100):
        x = preprocess(images[i : i + 100], spec)
        with torch.inference_mode():
            ref.append(model(x))
        for k, fn in runners.items():
            got[k].append(fn([x])[0].float())
    ref = torch.cat(ref)
    out: dict[str, Any] = {
        "images": len(images),
        "pytorch_top1": 100 * float((ref.argmax(-1) == labels).float().mean()),
    }
    for k, v in got.items():
        v = torch.cat(v)
        out[k] = {
            "max_abs_logit_diff": float((v - ref).abs().max()),
            "top1_agreement": 100 * float((v.argmax(-1) == ref.argmax(-1)).float().mean()),
            "top1": 100 * float((v.argmax(-1) == labels).float().mean()),
        }
    out["logit_scale"] = float(ref.abs().max())
    return out


def speed(
    runs: dict[str, Path], files: dict[str, dict[str, Path]], shape: tuple, batches: list[int], iters: int, threads: int
) -> dict[str, Any]:
    """Every model in PyTorch eager and in ONNX Runtime, all interleaved; medians; ratios to dense."""
    models = {k: nascompress.load(r).eval() for k, r in runs.items()}
    sessions = {k: onnx_runner(f["onnx"], threads=threads)[0] for k, f in files.items()}
    names = list(runs)
    out: dict[str, Any] = {}
    for bs in batches:
        x = torch.randn(bs, *shape, generator=torch.Generator().manual_seed(1))

        def eager(m):
            def f(x):
                with torch.inference_mode():
                    return m(x)

            return f

        calls = [eager(models[k]) for k in names] + [(lambda x, s=sessions[k]: s([x])) for k in names]
        t = time_models(calls, x, warmup=2, iters=iters)
        pt, ort = dict(zip(names, t[: len(names)])), dict(zip(names, t[len(names) :]))
        res: dict[str, Any] = {
            "batch": bs,
            "iters": iters,
            "pytorch_ms": {k: 1e3 * v for k, v in pt.items()},
            "onnxruntime_ms": {k: 1e3 * v for k, v in ort.items()},
            "onnxruntime_vs_pytorch_speedup": {k: pt[k] / ort[k] for k in names},
        }
        dense = names[0]
        res["ratio_vs_dense"] = {
            k: {"pytorch": pt[dense] / pt[k], "onnxruntime": ort[dense] / ort[k]} for k in names[1:]
        }
        out[f"batch_{bs}"] = res
    return out


def export_all(runs: dict[str, Path], work: Path) -> tuple[dict[str, dict[str, Path]], dict[str, Any]]:
    files, info = {}, {}
    for k, run in runs.items():
        files[k], info[k] = {}, {}
        for fmt, suffix in (("onnx", "onnx"), ("torch-export", "pt2")):
            out = work / "export" / f"{run.name}.{suffix}"
            t0 = time.perf_counter()
            side = export_run(run, out=out, config=ExportConfig(format=fmt), force=True).to_dict()  # (the sidecar JSON)
            files[k][fmt] = out
            info[k][fmt] = {
                "seconds": round(time.perf_counter() - t0, 1),
                "file_mb": out.stat().st_size / 2**20,
                "check": {q: side["verification"][q] for q in ("n", "max_abs_diff", "top1_agreement", "passed")},
            }
        info[k]["macs_per_image"] = side["flops"]["macs_per_image"]
        info[k]["methods"] = [m["name"] for m in side["methods"]]
    return files, info


def family(name: str, runs: dict[str, Path], work: Path, images, labels, args, batches: list[int]) -> dict[str, Any]:
    files, info = export_all(runs, work)
    dense_macs = info[next(iter(runs))]["macs_per_image"]
    for k in runs:
        info[k]["flops_ratio"] = info[k]["macs_per_image"] / dense_macs
        print(f"[{name}] {k}: agreement on {len(images)} images ...", flush=True)
        info[k]["agreement"] = agreement(runs[k], files[k], images, labels)
    spec = InputSpec.from_dict(load_arch(next(iter(runs.values())))["input"])
    shape = (spec.in_chans, *spec.img_size)
    print(f"[{name}] timing ...", flush=True)
    return {"models": info, "speed": speed(runs, files, shape, batches, args.iters, args.threads)}


def goals(res: dict[str, Any]) -> dict[str, Any]:
    worst_diff = max(
        m["agreement"][rt]["max_abs_logit_diff"]
        for f in ("main_job", "deit_s_224")
        for m in res[f]["models"].values()
        for rt in ("onnxruntime", "torch.export")
    )
    worst_agree = min(
        m["agreement"][rt]["top1_agreement"]
        for f in ("main_job", "deit_s_224")
        for m in res[f]["models"].values()
        for rt in ("onnxruntime", "torch.export")
    )
    ratios = [
        (f, b, k, r)
        for f in ("main_job", "deit_s_224")
        for b, s in res[f]["speed"].items()
        for k, r in s["ratio_vs_dense"].items()
    ]
    return {
        "max_abs_logit_diff": worst_diff,
        "agreement_goal_1e-4_met": worst_diff <= 1e-4,
        "min_top1_agreement": worst_agree,
        "top1_goal_100_met": worst_agree == 100.0,
        "ort_ratio_at_least_pytorch": {f"{f}/{b}/{k}": r["onnxruntime"] >= r["pytorch"] for f, b, k, r in ratios},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dense", type=Path, help="the main job's dense run (a pipeline's base/)")
    ap.add_argument("--compressed", type=Path, help="the main job's compressed run (a pipeline's final/)")
    ap.add_argument("--train-limit", type=int, default=10000, help="stand-in: training images")
    ap.add_argument("--epochs", type=int, default=1, help="stand-in: dense epochs")
    ap.add_argument("--retrain-epochs", type=int, default=1, help="stand-in: retraining epochs of the compressed model")
    ap.add_argument("--deit-dcs-flops", type=float, default=0.6)
    ap.add_argument("--agree-images", type=int, default=1000)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-deit", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "export.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    res: dict[str, Any] = header()
    import onnxruntime  # optional: the runtime this bench measures

    res["machine"]["onnxruntime"] = onnxruntime.__version__
    res["machine"]["note"] = "shared machine: other jobs ran beside this one; compare ratios, not times"
    images, labels = test_images(args.agree_images)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if (args.dense is None) != (args.compressed is None):
            raise SystemExit("give both --dense and --compressed, or neither (a stand-in is made)")
        if args.dense is None:
            print("[main job] making the stand-in ...", flush=True)
            dense, comp, source = main_job_standin(args, work)
        else:
            dense, comp, source = args.dense, args.compressed, {"kind": "pipeline runs given on the command line"}
        res["main_job"] = {
            "source": source,
            **family("main job", {"dense": dense, "compressed": comp}, work, images, labels, args, [1, 64]),
        }
        save(args.out, res)
        if not args.skip_deit:
            res["deit_s_224"] = {
                "source": "deit_small_patch16_224, random weights (seed 0), 10 classes",
                **family("deit-s", deit_runs(args, work), work, images, labels, args, [1, 16]),
            }
            res["goals"] = goals(res)
        save(args.out, res)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
