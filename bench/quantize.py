"""int8 on top of compression: accuracy and CPU speed of fp32 and int8 files, dense and compressed.

Families (each optional):

1. The main job (``configs/fashion-mnist.yaml``): its dense base and compressed model (DCS + EViT).
   ``--dense RUN --compressed RUN`` take a pipeline's ``base`` and ``final``; without them the stand-in
   of ``bench/export.py`` is made here (the config's base trained ``--epochs`` on ``--train-limit``
   images, DCS channels by activation importance at the config's target, EViT 0.7, retrained
   ``--retrain-epochs`` against the dense model).
2. DINOv2 ViT-S/14 at 112 px (``--dinov2-weights``): a linear probe fitted on ``--dinov2-train``
   Fashion-MNIST images (``train --linear-probe``), and from it, without any retraining (say so when
   reading the accuracies), DCS at about 0.6x FLOPs (channels by activation importance,
   materialized) and EViT keep rate 0.7.

Every model is quantized by the library (:func:`nascompress.deploy.quantize.quantize_run`, default
settings: int8-static, 256 calibration images, check on the validation split, fallback on). Then, per
model: test top-1 on ``--eval-images`` class-stratified test images of PyTorch fp32 and of the int8
file; the file sizes; and the speed of PyTorch eager fp32, ONNX Runtime fp32 and ONNX Runtime int8, all
models of a family timed interleaved in one process (rotating order, medians) at batch 1 and a larger
batch (64 main job, 16 DINOv2), one interleaved pass per intra-op thread count (``--threads`` and
``--try-threads``, both runtimes at that count); each model and runtime is reported at its fastest count
(a deployment sets it: at batch 1 a small model runs fastest in ONNX Runtime on one thread), every
pass is kept.
Ratios are to the dense fp32 PyTorch model at its fastest count. The goals of issue 35 are
evaluated from these figures (``goals``), and ``cpu`` records the CPU's int8 dot-product support and a
one-GEMM ONNX Runtime measurement of the int8 kernel path against fp32.

    python bench/quantize.py --threads 2 --out bench/results/quantize.json
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

from _common import ROOT, command_line, header, save  # noqa: E402  (puts the repository on sys.path)

import numpy as np  # noqa: E402
import torch  # noqa: E402

import nascompress  # noqa: E402
from nascompress.runs.run_config import run_data_config  # noqa: E402
from nascompress.data import DataConfig, InputSpec, load_data, preprocess  # noqa: E402
from nascompress.deploy import ExportConfig, export_run  # noqa: E402
from nascompress.deploy.config import QuantizeConfig  # noqa: E402
from nascompress.deploy.quantize import quantize_run  # noqa: E402
from nascompress.deploy.verify import onnx_runner  # noqa: E402
from nascompress.methods import get_method  # noqa: E402
from nascompress.methods.dcs_importance import activation_importance  # noqa: E402
from nascompress.models.build import ModelSpec  # noqa: E402
from nascompress.runs.io import load_with_arch  # noqa: E402
from nascompress.profiling import count_flops, time_models, time_models_by_threads  # noqa: E402
from nascompress.train.config import TrainConfig
from nascompress.train.run import TrainJob, train  # noqa: E402
from nascompress.runs.json_io import read_json  # noqa: E402
from _standins import dcs_at_flops, main_job_standin, save_run  # noqa: E402  (bench/export.py's stand-ins)

CPU_FLAGS = (
    "avx2",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
)


# ---------------------------------------------------------------------------------------------
# The CPU's int8 paths


def cpu_int8(threads: int) -> dict[str, Any]:
    """The CPU's flags that decide ONNX Runtime's (MLAS) int8 GEMM kernel, and one GEMM timed in fp32
    and as ORT's static int8 (QDQ -> QLinearMatMul / int8 GEMM) with the same threads."""
    import onnx  # optional: the ONNX graph of the one GEMM timed (pip install onnx)
    import onnxruntime as ort  # optional: the runtime this bench measures
    from onnx import TensorProto, helper, numpy_helper  # optional (see above)
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static  # optional

    flags: set[str] = set()
    model_name = ""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                flags.update(line.split(":", 1)[1].split())
            elif line.startswith("model name") and not model_name:
                model_name = line.split(":", 1)[1].strip()
    have = {k: k in flags for k in CPU_FLAGS}
    if have["amx_int8"]:
        path = "AMX int8 tiles"
    elif have["avx512_vnni"]:
        path = "AVX512-VNNI (vpdpbusd: u8 x s8 dot products)"
    elif have["avx_vnni"]:
        path = "AVX-VNNI (256-bit vpdpbusd)"
    elif have["avx2"]:
        path = "AVX2 (vpmaddubsw + vpmaddwd: no int8 dot-product instruction)"
    else:
        path = "no SIMD int8 path"
    M, K, N = 64 * 50, 384, 1536  # one ViT-S MLP fc1 at batch 64 (50 tokens)
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((K, N)) / np.sqrt(K)).astype(np.float32)
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        "gemm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, N])],
        [numpy_helper.from_array(w, "w")],
    )
    x = rng.standard_normal((M, K)).astype(np.float32)

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter([{"x": x[:256]}])

        def get_next(self):
            return next(self.it, None)

    res: dict[str, Any] = {
        "cpu": model_name,
        "flags": have,
        "mlas_int8_path_expected": path,
        "gemm": {"m": M, "k": K, "n": N},
    }
    with tempfile.TemporaryDirectory() as tmp:
        f32, q8 = Path(tmp) / "f32.onnx", Path(tmp) / "q8.onnx"
        onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(f32))
        quantize_static(
            str(f32),
            str(q8),
            Reader(),
            quant_format=QuantFormat.QDQ,
            per_channel=True,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
        )
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        sess = {
            k: ort.InferenceSession(str(p), so, providers=["CPUExecutionProvider"])
            for k, p in (("fp32", f32), ("int8", q8))
        }
        calls = [lambda _x, s=s: s.run(None, {"x": x}) for s in sess.values()]
        t = time_models(calls, torch.zeros(1), warmup=3, iters=30)
    res["gemm_ms"] = {"fp32": 1e3 * t[0], "int8": 1e3 * t[1]}
    res["gemm_int8_speedup"] = t[0] / t[1]
    res["gemm_int8_gops"] = 2 * M * K * N / t[1] / 1e9
    res["gemm_fp32_gflops"] = 2 * M * K * N / t[0] / 1e9
    return res


# ---------------------------------------------------------------------------------------------
# Models


def dinov2_runs(args, work: Path) -> tuple[dict[str, Path], dict[str, Any]]:
    """The DINOv2 linear probe and, from it without retraining, DCS ~0.6x and EViT 0.7 (see the docstring)."""
    data = DataConfig(dataset="fashion-mnist", train_limit=args.dinov2_train, eval_limit=args.eval_images)  # (see main)
    dense_dir = work / "dinov2_dense"
    t0 = time.time()
    m = train(
        TrainJob(
            model=ModelSpec("vit_small_patch14_dinov2", {"img_size": 112, "num_classes": 10}),
            data=data,
            train=TrainConfig(epochs=5, lr=None, seed=0),
            out=str(dense_dir),
            weights=str(args.dinov2_weights),
            reset_head=True,
            linear_probe=True,
        ),
        force=True,
    )
    probe_s = time.time() - t0
    dense, arch = load_with_arch(dense_dir)
    spec = InputSpec.from_dict(arch["input"])
    bundle = load_data(data, spec=spec, augment=False)
    xs = bundle.train.__getitems__(list(range(min(128, len(bundle.train)))))[0]
    batches = [preprocess(xs[i : i + 32], spec) for i in range(0, len(xs), 32)]
    imp = activation_importance(copy.deepcopy(dense), batches)
    ratio, share, dcs, dcs_rec = dcs_at_flops(dense, imp, args.dinov2_dcs_flops, batches[0][:1])
    evit, evit_rec = get_method("evit").prepare_fresh(copy.deepcopy(dense), {"keep_rate": 0.7})
    mspec = ModelSpec.from_dict(arch["model"])
    runs = {
        "dense": dense_dir,
        f"dcs_{ratio:.2f}x": save_run(work, "dinov2_dcs", dcs.eval(), mspec, arch["input"], [dcs_rec]),
        "evit_0.7": save_run(work, "dinov2_evit", evit.eval(), mspec, arch["input"], [evit_rec]),
    }
    info = {
        "kind": "DINOv2 ViT-S/14 112 px linear probe made by this bench; DCS and EViT applied to it WITHOUT "
        "retraining (zero-shot): their accuracy is not that of a trained compressed model",
        "probe_train_images": args.dinov2_train,
        "probe_val_top1": m.best_val_top1,
        "probe_seconds": round(probe_s, 1),
        "dcs_share": share,
        "dcs_flops_ratio": ratio,
    }
    return runs, info


def dinov2_given_runs(args, work: Path) -> tuple[dict[str, Path], dict[str, Any], DataConfig]:
    """``--dinov2-runs DENSE DCS``: the probe, the trained DCS model, and EViT 0.7 on the probe (zero-shot)."""
    dense_dir, dcs_dir = args.dinov2_runs
    dense, arch = load_with_arch(dense_dir)
    evit, evit_rec = get_method("evit").prepare_fresh(copy.deepcopy(dense), {"keep_rate": 0.7})
    evit_dir = save_run(work, "dinov2_evit", evit.eval(), ModelSpec.from_dict(arch["model"]), arch["input"], [evit_rec])
    dcs_metrics = read_json(dcs_dir / "metrics.json")
    data = run_data_config(dcs_dir) or DataConfig(dataset="fashion-mnist")
    info = {
        "kind": "DINOv2 ViT-S/14 112 px linear probe and a DCS model searched (search dcs, every default), "
        "materialized and retrained from it; EViT 0.7 applied to the probe WITHOUT retraining",
        "dense_run": str(dense_dir),
        "dcs_run": str(dcs_dir),
        "dcs_test_top1": dcs_metrics.get("test_top1"),
    }
    x = torch.zeros(1, 3, *arch["input"]["img_size"])
    ratio = count_flops(load_with_arch(dcs_dir)[0].eval(), x).total / count_flops(dense.eval(), x).total
    info["dcs_flops_ratio"] = ratio
    return {"dense": dense_dir, f"dcs_{ratio:.2f}x": dcs_dir, "evit_0.7": evit_dir}, info, data


# ---------------------------------------------------------------------------------------------
# Measurements


def test_set(data: DataConfig, spec: InputSpec, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    bundle = load_data(replace(data, eval_limit=n, subset_seed=0), spec=spec, augment=False)
    return bundle.test.__getitems__(list(range(len(bundle.test))))


def top1(fn, images: torch.Tensor, labels: torch.Tensor, spec: InputSpec, bs: int = 100) -> float:
    hits = 0
    for i in range(0, len(images), bs):
        with torch.inference_mode():
            out = fn(preprocess(images[i : i + bs], spec))
        hits += int((out.argmax(-1) == labels[i : i + bs]).sum())
    return 100 * hits / len(images)


def family(name: str, runs: dict[str, Path], data: DataConfig, work: Path, args, batches: list[int]) -> dict[str, Any]:
    models: dict[str, Any] = {}
    files: dict[str, dict[str, Path]] = {}
    qdata = replace(data, eval_limit=args.eval_images)
    for k, run in runs.items():
        print(f"[{name}] {k}: export + quantize ...", flush=True)
        f32, q8 = work / f"{name}_{k}.onnx", work / f"{name}_{k}.int8.onnx"
        t0 = time.perf_counter()
        export_run(run, out=f32, config=ExportConfig(), force=True)
        t1 = time.perf_counter()
        side = quantize_run(run, out=q8, config=QuantizeConfig(), data=qdata, force=True).to_dict()  # (its JSON)
        t2 = time.perf_counter()
        q = side["quantization"]
        files[k] = {"fp32": f32, "int8": q8}
        models[k] = {
            "methods": [m["name"] for m in side["methods"]],
            "macs_per_image": side["flops"]["macs_per_image"],
            "file_mb": {"fp32": f32.stat().st_size / 2**20, "int8": q8.stat().st_size / 2**20},
            "export_s": round(t1 - t0, 1),
            "quantize_s": round(t2 - t1, 1),
            "quantization": {
                "scheme": q["scheme"],
                "level": q["level"],
                "fallback": q["fallback"],
                "quantized_nodes": q["quantized_nodes"],
                "kept_fp32": q["kept_fp32_summary"],
                "calibration_images": (q["calibration"] or {}).get("images"),
                "attempts": [
                    {
                        "scheme": a["scheme"],
                        "level": a["level"],
                        **{c: a["check"][c] for c in ("top1_drop", "top1_agreement", "max_abs_logit_diff")},
                    }
                    for a in q["attempts"]
                ],
            },
            "val_check": {
                c: side["verification"][c]
                for c in ("n", "fp32_top1", "int8_top1", "top1_drop", "top1_agreement", "max_abs_logit_diff", "passed")
            },
        }
    dense_macs = models[next(iter(runs))]["macs_per_image"]
    spec = InputSpec.from_dict(load_with_arch(next(iter(runs.values())))[1]["input"])
    images, labels = test_set(data, spec, args.eval_images)
    pts = {k: nascompress.load(r).eval() for k, r in runs.items()}
    tq = {}  # PyTorch's own int8 path, measured beside the ONNX file (not offered: see README)
    for k, m in pts.items():
        q = torch_int8(m)
        models[k]["pytorch_int8_dynamic"] = q if isinstance(q, str) else "runs"
        if not isinstance(q, str):
            tq[k] = q
    # no spinning: ORT's idle workers would starve the PyTorch model timed next (see onnx_runner)
    thread_counts = sorted({*args.try_threads, args.threads})
    sess_by = {
        th: {k: {p: onnx_runner(f, threads=th, spinning=False)[0] for p, f in fs.items()} for k, fs in files.items()}
        for th in thread_counts
    }
    sess = sess_by[args.threads]
    for k in runs:
        models[k]["flops_ratio"] = models[k]["macs_per_image"] / dense_macs
        print(f"[{name}] {k}: test top-1 on {len(images)} images ...", flush=True)
        models[k]["test_top1"] = {
            "pytorch_fp32": top1(pts[k], images, labels, spec),
            "ort_int8": top1(lambda x, s=sess[k]["int8"]: s([x])[0], images, labels, spec),
        }
        t = models[k]["test_top1"]
        t["int8_drop"] = t["pytorch_fp32"] - t["ort_int8"]
        if k in tq:
            t["pytorch_int8_dynamic"] = top1(tq[k], images, labels, spec)
    shape = (spec.in_chans, *spec.img_size)
    speed: dict[str, Any] = {}
    names = list(runs)
    for bs in batches:
        print(f"[{name}] timing batch {bs} ...", flush=True)
        x = torch.randn(bs, *shape, generator=torch.Generator().manual_seed(1))

        def eager(m):
            def f(x):
                with torch.inference_mode():
                    return m(x)

            return f

        labels_ = (
            [(k, "pytorch_fp32") for k in names]
            + [(k, f"ort_{p}") for k in names for p in ("fp32", "int8")]
            + [(k, "pytorch_int8_dynamic") for k in names if k in tq]
        )
        iters = args.iters_b1 if bs == 1 else args.iters  # ~1 ms calls at b1: many more for a stable median
        # one interleaved pass per intra-op thread count, every runtime at that count
        calls = {
            th: [
                eager(pts[k])
                if rt == "pytorch_fp32"
                else eager(tq[k])
                if rt == "pytorch_int8_dynamic"
                else (lambda x, s=sess_by[th][k][rt[4:]]: s([x]))
                for k, rt in labels_
            ]
            for th in thread_counts
        }
        by_threads = {
            str(th): {f"{k}/{rt}": 1e3 * v for (k, rt), v in zip(labels_, t)}
            for th, t in time_models_by_threads(calls, x, warmup=2, iters=iters).items()
        }
        # each model and runtime at the thread count that is fastest for it (a deployment picks it; at
        # batch 1 a small model is fastest on one thread: waking a second one costs more than it brings)
        best = {
            lab: min(thread_counts, key=lambda th: by_threads[str(th)][lab]) for lab in by_threads[str(args.threads)]
        }
        ms = {lab: by_threads[str(th)][lab] for lab, th in best.items()}
        ref = ms[f"{names[0]}/pytorch_fp32"]
        speed[f"batch_{bs}"] = {
            "batch": bs,
            "iters": iters,
            "ms": ms,
            "threads": best,
            "ms_by_threads": by_threads,
            "speedup_vs_dense_pytorch_fp32": {k: ref / v for k, v in ms.items()},
            "speedup_same_threads": {
                th: {k: v[f"{names[0]}/pytorch_fp32"] / x_ for k, x_ in v.items()} for th, v in by_threads.items()
            },
            "images_per_s": {k: 1e3 * bs / v for k, v in ms.items()},
        }
    return {"models": models, "speed": speed, "test_images": len(images)}


def goals(res: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    mj = res.get("main_job")
    if mj:
        m, s = mj["models"], mj["speed"]
        c = m["compressed"]["test_top1"]
        b64 = s["batch_64"]["speedup_vs_dense_pytorch_fp32"]["compressed/ort_int8"]
        b1 = s["batch_1"]["speedup_vs_dense_pytorch_fp32"]["compressed/ort_int8"]
        out["main_job"] = {
            "throughput_b64_vs_dense_pytorch_fp32": b64,
            "throughput_goal_2.5x_met": b64 >= 2.5,
            "latency_b1_vs_dense_pytorch_fp32": b1,
            "latency_goal_1.5x_met": b1 >= 1.5,
            "int8_drop_vs_compressed_fp32_pts": c["int8_drop"],
            "accuracy_goal_0.5pt_met": c["int8_drop"] <= 0.5,
        }
        out["main_job_stacking"] = stacking(m, s, "dense", "compressed")
    dv = res.get("dinov2")
    if dv:
        m, s = dv["models"], dv["speed"]
        dcs = next(k for k in m if k.startswith("dcs_"))
        big = next(k for k in s if k != "batch_1")
        sp = s[big]["speedup_vs_dense_pytorch_fp32"][f"{dcs}/ort_int8"]
        drop = m[dcs]["test_top1"]["int8_drop"]
        out["dinov2_dcs"] = {
            "model": dcs,
            f"throughput_{big}_vs_dense_pytorch_fp32": sp,
            "speed_goal_2x_met": sp >= 2,
            "int8_drop_vs_own_fp32_pts": drop,
            "accuracy_goal_1pt_met": drop <= 1.0,
            "note": (
                "the DCS model is searched and retrained"
                if dcs_retrained(res)
                else "the DCS model is not retrained here (zero-shot channel pruning)"
            ),
        }
        out["dinov2_stacking"] = {k: stacking(m, s, "dense", k) for k in m if k != "dense"}
    return out


def stacking(m: dict[str, Any], s: dict[str, Any], dense: str, comp: str) -> dict[str, Any]:
    """Compressed + int8 faster than dense + int8, at no worse top-1 than dense int8 minus the compression's drop."""
    speed = {b: v["ms"][f"{dense}/ort_int8"] / v["ms"][f"{comp}/ort_int8"] for b, v in s.items()}
    d, c = m[dense]["test_top1"], m[comp]["test_top1"]
    bound = d["ort_int8"] - (d["pytorch_fp32"] - c["pytorch_fp32"])
    dv, cv = m[dense]["val_check"], m[comp]["val_check"]  # the same comparison on the validation split
    vbound = dv["int8_top1"] - (dv["fp32_top1"] - cv["fp32_top1"])
    return {
        "compressed_int8_vs_dense_int8_speedup": speed,
        "faster_met": all(v > 1 for v in speed.values()),
        "compressed_int8_top1": c["ort_int8"],
        "bound_top1": bound,
        "accuracy_met": c["ort_int8"] >= bound - 1e-9,
        "val_split": {
            "n": cv["n"],
            "compressed_int8_top1": cv["int8_top1"],
            "bound_top1": vbound,
            "accuracy_met": cv["int8_top1"] >= vbound - 1e-9,
        },
    }


def dcs_retrained(res: dict[str, Any]) -> bool:
    """Whether the DINOv2 family's DCS model was searched and retrained (``--dinov2-runs``), not zero-shot."""
    return "retrained from it" in res.get("dinov2", {}).get("source", {}).get("kind", "")


def torch_int8(model: torch.nn.Module) -> Any:
    """PyTorch's dynamic int8 (``torch.ao.quantization.quantize_dynamic`` of the ``nn.Linear`` layers,
    weights int8 per tensor, activations quantized per batch; FBGEMM/x86 kernels) of a copy of
    ``model``, or why it does not run on it (one line)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation notice
        try:
            q = torch.ao.quantization.quantize_dynamic(copy.deepcopy(model), {torch.nn.Linear}, dtype=torch.qint8)
            with torch.inference_mode():
                pe = model.patch_embed
                q(torch.zeros(1, pe.proj.in_channels, *pe.img_size))
        except Exception as e:  # noqa: BLE001 (recorded: the layers it does not run on)
            return f"does not run: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return q


def not_measured(args, res: dict[str, Any]) -> list[str]:
    """What this result does not cover, in words."""
    return [
        g
        for g, present in (
            (
                "main job on the README's pipeline models (a stand-in was used: see main_job.source)",
                "main_job" in res and not args.pipeline_runs,
            ),
            ("main job", "main_job" not in res),
            ("DINOv2 models", "dinov2" not in res),
            (
                "retrained DINOv2 DCS 0.6x / EViT 0.7 models (zero-shot ones used: their accuracy goals are "
                "not meaningful "
                "here)",
                "dinov2" in res and not dcs_retrained(res),
            ),
            ("a retrained DINOv2 EViT 0.7 model (EViT applied to the probe zero-shot)", dcs_retrained(res)),
            ("2 threads per runtime (this run's thread count is machine.cpu_threads)", args.threads != 2),
            ("GPU int8 (no GPU on this machine; not offered)", True),
        )
        if present
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dense", type=Path, help="the main job's dense run (a pipeline's base/)")
    ap.add_argument("--compressed", type=Path, help="the main job's compressed run (a pipeline's final/)")
    ap.add_argument("--train-limit", type=int, default=10000, help="stand-in: training images")
    ap.add_argument("--epochs", type=int, default=1, help="stand-in: dense epochs")
    ap.add_argument("--retrain-epochs", type=int, default=1, help="stand-in: retraining epochs")
    ap.add_argument("--skip-main", action="store_true")
    ap.add_argument("--dinov2-weights", type=Path, help="DINOv2 ViT-S/14 112 px timm weights (tools/convert_dinov2.py)")
    ap.add_argument(
        "--dinov2-runs",
        type=Path,
        nargs=2,
        metavar=("DENSE", "DCS"),
        help="instead of --dinov2-weights: a DINOv2 probe run and a DCS run searched, materialized and "
        "retrained from it (bench/dcs_generalise.py's dense/ and dcs_auto_0.6_retrained/); EViT 0.7 "
        "is applied to DENSE zero-shot",
    )
    ap.add_argument("--dinov2-train", type=int, default=1000, help="linear-probe training images")
    ap.add_argument("--dinov2-dcs-flops", type=float, default=0.6)
    ap.add_argument("--eval-images", type=int, default=1000, help="validation (check) and test images per model")
    ap.add_argument("--dinov2-eval-images", type=int, help="the same for DINOv2 (default: --eval-images)")
    ap.add_argument("--iters", type=int, default=30, help="timed calls per model at the large batch")
    ap.add_argument("--iters-b1", type=int, default=300, help="timed calls per model at batch 1")
    ap.add_argument("--threads", type=int, default=2, help="intra-op threads of both runtimes (the accuracy runs)")
    ap.add_argument(
        "--try-threads",
        type=lambda s: [int(t) for t in s.split(",")],
        default=[1],
        help="further thread counts timed (one interleaved pass each); each model and runtime is "
        "reported at its fastest count, the per-count figures kept",
    )
    ap.add_argument("--work", type=Path, help="keep the models here (default: a temporary folder)")
    ap.add_argument(
        "--pipeline-runs",
        action="store_true",
        help="--dense/--compressed are the README main job's pipeline runs (base/, final/), not a stand-in",
    )
    ap.add_argument(
        "--derive-only",
        action="store_true",
        help="measure nothing: recompute goals and not_measured of --out from its figures and these flags",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "quantize.json")
    args = ap.parse_args()
    if args.derive_only:
        res = json.loads(args.out.read_text())
        res["goals"], res["not_measured"] = goals(res), not_measured(args, res)
        res["derived_by"] = command_line()  # goals and not_measured recomputed from the figures above
        save(args.out, res)
        return
    torch.set_num_threads(args.threads)
    import onnxruntime  # optional: the runtime this bench measures (--derive-only runs without it)

    res: dict[str, Any] = header()
    res["machine"]["onnxruntime"] = onnxruntime.__version__
    res["machine"]["note"] = (
        "shared machine: other jobs ran beside this one; compare ratios measured together. "
        f"Timed at {sorted({*args.try_threads, args.threads})} intra-op threads (one "
        "interleaved pass per count, PyTorch and ONNX Runtime at the same count); speed.*.ms "
        "is each model and runtime at its fastest count (speed.*.threads), ms_by_threads "
        "every pass. ORT without spinning workers (they starve the PyTorch model timed next)"
    )
    res["cpu_int8"] = cpu_int8(args.threads)
    print(
        f"cpu int8: {res['cpu_int8']['mlas_int8_path_expected']}, one GEMM int8 vs fp32 "
        f"{res['cpu_int8']['gemm_int8_speedup']:.2f}x",
        flush=True,
    )
    save(args.out, res)
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        if not args.skip_main:
            if (args.dense is None) != (args.compressed is None):
                raise SystemExit("give both --dense and --compressed, or neither (a stand-in is made)")
            if args.dense is None:
                print("[main job] making the stand-in ...", flush=True)
                dense, comp, source = main_job_standin(args, work)
                data = DataConfig(dataset="fashion-mnist", train_limit=args.train_limit, subset_seed=0)
            else:
                dense, comp = args.dense, args.compressed
                source = {
                    "kind": "runs given on the command line",
                    **{
                        k: {"config": read_json(r / "config.json"), "metrics": read_json(r / "metrics.json")}
                        for k, r in (("dense", dense), ("compressed", comp))
                    },
                }
                data = run_data_config(comp) or DataConfig()
            res["main_job"] = {
                "source": source,
                **family("main_job", {"dense": dense, "compressed": comp}, data, work, args, [1, 64]),
            }
            res["goals"] = goals(res)
            save(args.out, res)
        if args.dinov2_runs is not None:
            args.eval_images = args.dinov2_eval_images or args.eval_images
            runs, info, data = dinov2_given_runs(args, work)
            res["dinov2"] = {"source": info, **family("dinov2", runs, data, work, args, [1, 16])}
        elif args.dinov2_weights is not None:
            args.eval_images = args.dinov2_eval_images or args.eval_images
            runs, info = dinov2_runs(args, work)
            data = DataConfig(dataset="fashion-mnist", train_limit=args.dinov2_train, subset_seed=0)
            res["dinov2"] = {"source": info, **family("dinov2", runs, data, work, args, [1, 16])}
        res["goals"], res["not_measured"] = goals(res), not_measured(args, res)
        save(args.out, res)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
