"""Are the slim models faster where ViTs run? Every method against the dense model on one device.

Sections (``--sections``, each merged into ``bench/results/gpu_<device>.json`` on its own, so a
GPU session with a time limit per command can run them one by one):

* ``models``: DeiT-S/224 with random weights (``--device cpu``: a small ViT, so this file runs
  anywhere and cannot rot): dense; EViT keep 0.7 and 0.5; DynamicViT rho 0.7; uniform channel
  pruning and DCS at about 0.6x the dense FLOPs, each with aligned widths (multiples of 8) and
  unaligned (exact counts); Sparsifiner (default, unstructured) and its block mode; MG-ViT
  (epsilon 1: every image through both stages). DCS without a search: kept channels chosen by
  weight magnitude (``methods.dcs.channel_importance``), the share found by bisection on the
  FLOPs, materialized through the method's own path (``build_materialized``). Per dtype (fp32 with
  TF32 on CUDA; bf16 weights and inputs): batch 1 and a large batch eager, every model interleaved
  in one process (medians), and batch 1 ``torch.compile``d (CUDA graphs on CUDA,
  ``profiling.latency.compile_for_speed``); ratios against the dense model of the same run.
* ``qk_layout``: the narrowed-Q/K models with their heads ``packed`` (q/k at the kept width) and
  ``pad`` (zero-padded to V's head dim), interleaved: which layout the fused kernels of this device
  prefer (``layers.qk_pads`` decides by the kernels' documented constraints).
* ``sparsifiner``: one attention call at 197, 785 and 3137 tokens (batch 1, 6 heads, head dim 64,
  keep 0.25): dense SDPA against the block-sparse paths (gather; compiled FlexAttention with
  16-multiple blocks), the predictor included: the crossover token count.
* ``pipeline``: the README's main job (``configs/fashion-mnist.yaml``; ``--device cpu``: a tiny
  synthetic pipeline) run end to end on this device: its wall time and the report's ratios, then the
  final model against the dense base in bf16 and compiled.

Goals of issue 23 (H100, bf16, batch 256) are evaluated in ``goals`` when the device is CUDA.

    python bench/gpu.py                                  # CUDA, every section
    python bench/gpu.py --sections models --dtypes bf16  # one part
    python bench/gpu.py --device cpu                     # small sizes, this machine
"""

from __future__ import annotations

import argparse
import copy
import math
import re
import shutil
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from _common import ROOT, header, save, slug  # noqa: E402  (puts the repository on sys.path)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import nascompress  # noqa: E402,F401
from nascompress import runtime  # noqa: E402
from nascompress.profiling.jobs import profile  # noqa: E402
from nascompress.models.layers import aligned_width, qk_layout_summary, set_qk_layout  # noqa: E402
from nascompress.methods import block_sparse, get_method  # noqa: E402
from nascompress.methods.dcs import DCSConfig, build_materialized
from nascompress.methods.dcs_importance import channel_importance  # noqa: E402
from nascompress.methods.sparsifiner_kernel import region_init  # noqa: E402
from nascompress.methods.uniform import UniformConfig, keep_for_flops  # noqa: E402
from nascompress.models.build import ModelSpec, build_model  # noqa: E402
from nascompress.pipeline import run_pipeline  # noqa: E402
from nascompress.profiling import count_flops, time_models  # noqa: E402
from nascompress.profiling.latency import compile_for_speed  # noqa: E402
from nascompress.runs.json_io import read_json  # noqa: E402

SECTIONS = ("models", "qk_layout", "sparsifiner", "pipeline")
TARGET = 0.6  # the FLOPs ratio of the channel-pruned models


# ---------------------------------------------------------------------------------------------
# Sizes


def sizes(device: torch.device) -> dict[str, Any]:
    """DeiT-S/224 on CUDA; a small ViT with the same structure on the CPU."""
    if device.type == "cuda":
        return {
            "model": ModelSpec("deit_small_patch16_224", {"num_classes": 1000}),
            "big_batch": 256,
            "iters": 20,
            "tokens": (197, 785, 3137),
            "heads": 6,
            "head_dim": 64,
        }
    return {
        "model": ModelSpec(
            "vit_small_patch16_224",
            {"img_size": 56, "patch_size": 8, "embed_dim": 192, "num_heads": 3, "depth": 6, "num_classes": 10},
        ),
        "big_batch": 16,
        "iters": 10,
        "tokens": (65, 197),
        "heads": 3,
        "head_dim": 64,
    }


def device_label(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu"
    return slug(torch.cuda.get_device_name(device), "")


def dense_model(spec: ModelSpec) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(spec).eval()


# ---------------------------------------------------------------------------------------------
# The compressed models


def uniform_at(dense: torch.nn.Module, x: torch.Tensor, align: int) -> tuple[torch.nn.Module, dict]:
    keep = keep_for_flops(copy.deepcopy(dense), TARGET, x, align=align)
    model, rec = get_method("uniform").prepare_fresh(copy.deepcopy(dense), UniformConfig(keep=keep, align=align))
    return model, {
        "keep": keep,
        "hidden": [len(b["hidden_keep"]) for b in rec["blocks"]],
        "qk": [len(b["qk_keep"][0]) for b in rec["blocks"]],
    }


def dcs_blocks(dense: torch.nn.Module, share: float, align: int) -> list[dict]:
    """Per block: the ``share`` most important MLP residual channels and Q/K channels per head
    (weight magnitude), counts rounded up to ``align``."""
    blocks = []
    for blk in dense.blocks:
        imp = channel_importance(blk)
        mlp, qk = imp.residual, imp.qk
        C, (_, d) = mlp.numel(), qk.shape
        k = aligned_width(max(1, round(share * C)), align=align, full=C)
        kq = aligned_width(max(1, round(share * d)), align=align, full=d)
        blocks.append(
            {
                "mlp_keep": mlp.topk(k).indices.sort().values.tolist(),
                "qk_keep": [row.topk(kq).indices.sort().values.tolist() for row in qk],
            }
        )
    return blocks


def dcs_at(dense: torch.nn.Module, x: torch.Tensor, align: int) -> tuple[torch.nn.Module, dict]:
    """A DCS-materialized model near TARGET x the dense FLOPs (bisection on the kept share)."""
    ref = count_flops(dense, x).total
    cfg = DCSConfig(qk_mask="static", mlp_gates="residual")

    def build(share: float):
        return build_materialized(copy.deepcopy(dense), cfg, dcs_blocks(dense, share, align)).eval()

    lo, hi = 0.05, 1.0
    for _ in range(14):
        mid = (lo + hi) / 2
        r = count_flops(build(mid), x).total / ref
        lo, hi = (lo, mid) if r > TARGET else (mid, hi)
    share = min((lo, hi), key=lambda s: abs(count_flops(build(s), x).total / ref - TARGET))
    model = build(share)
    model.nc_methods = ["dcs"]
    blocks = dcs_blocks(dense, share, align)
    return model, {
        "share": share,
        "mlp": [len(b["mlp_keep"]) for b in blocks],
        "qk": [len(b["qk_keep"][0]) for b in blocks],
    }


def model_zoo(dense: torch.nn.Module, x: torch.Tensor) -> dict[str, tuple[Callable[[], torch.nn.Module], dict]]:
    """name -> (a builder, settings): every model of the ``models`` section."""

    def fresh(name: str, cfg: dict) -> Callable[[], torch.nn.Module]:
        return lambda: get_method(name).prepare_fresh(copy.deepcopy(dense), dict(cfg))[0].eval()

    zoo: dict[str, tuple[Callable[[], torch.nn.Module], dict]] = {
        "evit_0.7": (fresh("evit", {"keep_rate": 0.7}), {"keep_rate": 0.7}),
        "evit_0.5": (fresh("evit", {"keep_rate": 0.5}), {"keep_rate": 0.5}),
        "dynamicvit_0.7": (fresh("dynamicvit", {"rho": 0.7}), {"rho": 0.7}),
        "sparsifiner": (fresh("sparsifiner", {}), {"mode": "unstructured", "attn_keep_ratio": 0.25}),
        "sparsifiner_block_gather": (fresh("sparsifiner", {"mode": "block"}), {"mode": "block", "kernel": "gather"}),
        "sparsifiner_block_flex": (
            fresh("sparsifiner", {"mode": "block", "kernel": "flex"}),
            {"mode": "block", "kernel": "flex"},
        ),
        "mgvit": (fresh("mgvit", {"epsilon": 1.0}), {"epsilon": 1.0}),
    }
    for align in (8, 1):
        for name, build in (("uniform", uniform_at), ("dcs", dcs_at)):
            label = f"{name}_0.6x_{'aligned' if align > 1 else 'unaligned'}"
            model, info = build(dense, x, align)
            zoo[label] = ((lambda m=model: copy.deepcopy(m)), dict(info, align=align))
    return zoo


# ---------------------------------------------------------------------------------------------
# Timing


def timed(models: dict[str, Callable], x: torch.Tensor, iters: int) -> dict[str, float | None]:
    """Median ms per forward of each callable, all interleaved; a model that fails gets None."""
    ok = {}
    for k, f in models.items():
        try:
            with torch.inference_mode():
                f(x)
            ok[k] = f
        except Exception as e:  # noqa: BLE001 (recorded, the others are still timed)
            print(f"  {k}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}", flush=True)
    times = dict(zip(ok, time_models(list(ok.values()), x, warmup=3, iters=iters))) if ok else {}
    return {k: (times[k] * 1e3 if k in times else None) for k in models}


def section_models(device: torch.device, dtypes: list[str], compile_: bool, only: set[str] | None) -> dict:
    sz = sizes(device)
    dense = dense_model(sz["model"]).to(device)
    shape = (dense.patch_embed.proj.in_channels, *dense.patch_embed.img_size)
    x1 = torch.randn(1, *shape, generator=torch.Generator().manual_seed(0)).to(device)
    zoo = model_zoo(dense, x1)
    if only:
        zoo = {k: v for k, v in zoo.items() if k in only}
    out: dict[str, Any] = {
        "model": sz["model"].to_dict(),
        "big_batch": sz["big_batch"],
        "iters": sz["iters"],
        "settings": {k: v[1] for k, v in zoo.items()},
        "flops": {},
        "by_dtype": {},
    }
    models = {"dense": dense}
    for k, (build, _) in zoo.items():
        try:
            models[k] = build().to(device)
        except Exception as e:  # noqa: BLE001
            out.setdefault("build_errors", {})[k] = f"{type(e).__name__}: {e}"
    xf = torch.randn(4, *shape, generator=torch.Generator().manual_seed(1)).to(device)
    for k, m in models.items():
        out["flops"][k] = count_flops(m, xf).total
    out["flops_ratio"] = {k: v / out["flops"]["dense"] for k, v in out["flops"].items()}
    for dname in dtypes:
        dtype = runtime.parse_dtype(dname)
        res: dict[str, Any] = {}
        with runtime.configured(device):
            ms = {k: copy.deepcopy(m).to(device, dtype).eval() for k, m in models.items()}
            layouts = {k: qk_layout_summary(m, x1.to(dtype)) for k, m in ms.items()}
            res["qk_layout"] = {k: v for k, v in layouts.items() if v}
            for label, B in (("batch_1", 1), (f"batch_{sz['big_batch']}", sz["big_batch"])):
                x = torch.randn(B, *shape, generator=torch.Generator().manual_seed(2)).to(device, dtype)
                t = timed(ms, x, sz["iters"])
                res[label] = {"ms": t, "speedup_vs_dense": {k: (t["dense"] / v if v else None) for k, v in t.items()}}
                print(dname, label, {k: None if v is None else round(v, 3) for k, v in t.items()}, flush=True)
            if compile_:
                fns, notes, t0 = {}, {}, time.perf_counter()
                for k, m in ms.items():
                    fn, note = compile_for_speed(m, device)
                    if fn is None:
                        notes[k] = note
                    else:
                        fns[k] = fn
                x = torch.randn(1, *shape, generator=torch.Generator().manual_seed(2)).to(device, dtype)
                t = timed(fns, x, sz["iters"])
                res["batch_1_compiled"] = {
                    "ms": t,
                    "speedup_vs_compiled_dense": {
                        k: (t["dense"] / v if v and t.get("dense") else None) for k, v in t.items()
                    },
                    "not_compiled": notes,
                    "compile_and_time_s": time.perf_counter() - t0,
                }
                print(
                    dname, "batch_1_compiled", {k: None if v is None else round(v, 3) for k, v in t.items()}, flush=True
                )
                torch._dynamo.reset()
        out["by_dtype"][dname] = res
    return out


def section_qk_layout(device: torch.device, dtypes: list[str]) -> dict:
    sz = sizes(device)
    dense = dense_model(sz["model"]).to(device)
    shape = (dense.patch_embed.proj.in_channels, *dense.patch_embed.img_size)
    x1 = torch.randn(1, *shape, generator=torch.Generator().manual_seed(0)).to(device)
    narrowed = {}
    for align in (8, 1):
        tag = "aligned" if align > 1 else "unaligned"
        narrowed[f"uniform_{tag}"] = uniform_at(dense, x1, align)[0]
        narrowed[f"dcs_{tag}"] = dcs_at(dense, x1, align)[0]
    out: dict[str, Any] = {}
    for dname in dtypes:
        dtype = runtime.parse_dtype(dname)
        with runtime.configured(device):
            fns = {}
            for k, m in narrowed.items():
                for layout in ("packed", "pad"):
                    mm = copy.deepcopy(m).to(device, dtype).eval()
                    set_qk_layout(mm, layout)
                    fns[f"{k}/{layout}"] = mm
            res = {}
            for B in (1, sz["big_batch"]):
                x = torch.randn(B, *shape, generator=torch.Generator().manual_seed(2)).to(device, dtype)
                t = timed(fns, x, sz["iters"])
                res[f"batch_{B}"] = {
                    "ms": t,
                    "pad_speedup_over_packed": {
                        k: t[f"{k}/packed"] / t[f"{k}/pad"] if t[f"{k}/packed"] and t[f"{k}/pad"] else None
                        for k in narrowed
                    },
                }
                print(dname, B, res[f"batch_{B}"]["pad_speedup_over_packed"], flush=True)
        out[dname] = res
    return out


def section_sparsifiner(device: torch.device, dtypes: list[str]) -> dict:
    """One attention call, batch 1: dense SDPA vs the block-sparse paths, predictor included."""
    sz = sizes(device)
    H, d, r = sz["heads"], sz["head_dim"], 32
    out: dict[str, Any] = {
        "setup": f"batch 1, {H} heads, head dim {d}, keep ratio 0.25, n_down {r}, predictor "
        "included; flex blocks a multiple of 16",
        "by_dtype": {},
    }
    for dname in dtypes:
        dtype = runtime.parse_dtype(dname)
        rows = []
        for n in sz["tokens"]:
            torch.manual_seed(0)
            q, k, v = torch.randn(1, n, 3, H, d).to(device, dtype).permute(2, 0, 3, 1, 4).unbind(0)
            side = math.isqrt(n - 1)
            wd, wu = region_init(n, r, prefix=1, grid=(side, side) if side * side == n - 1 else None)
            w_down = wd.expand(H, -1, -1).contiguous().to(device, dtype)
            w_up = wu.expand(H, -1, -1).contiguous().to(device, dtype)
            budget = math.ceil(0.25 * n)
            row: dict[str, Any] = {"tokens": n}
            fns: dict[str, Callable] = {"dense_sdpa": lambda _: F.scaled_dot_product_attention(q, k, v)}
            for kernel in ("gather", "flex"):
                layout = block_sparse.plan_blocks(
                    n, 1, budget, multiple=block_sparse.flex_multiple(kernel, None, device)
                )
                basis = block_sparse.pooled_basis(w_up, 1e-2, layout)
                fns[kernel] = lambda _, L=layout, b=basis, kn=kernel: block_sparse.block_sparse_attention(
                    q, k, v, w_down, b, L, scale=d**-0.5, tau=0.05, kernel=kn
                )[0]
                row[f"{kernel}_layout"] = {"block_size": layout.bs, "blocks": layout.nb, "kept": layout.keep}
                if kernel == "flex":
                    row["flex_kernel_used"] = block_sparse.flex_kernel_ok(layout, q)
            t = timed(fns, q, sz["iters"] * 2)
            row.update(ms=t, speedup_vs_dense={kn: (t["dense_sdpa"] / v if v else None) for kn, v in t.items()})
            print(dname, n, {kn: None if v is None else round(v, 3) for kn, v in t.items()}, flush=True)
            rows.append(row)
        faster = [
            r_["tokens"]
            for r_ in rows
            if max((v or 0) for kn, v in r_["speedup_vs_dense"].items() if kn != "dense_sdpa") > 1
        ]
        out["by_dtype"][dname] = {"rows": rows, "crossover_tokens": min(faster) if faster else None}
    return out


# ---------------------------------------------------------------------------------------------
# The main job's pipeline


TINY_PIPELINE = """format: nascompress-pipeline/1
seed: 0
device: {device}
data: {{dataset: synthetic}}
base:
  train: {{img_size: 16, patch_size: 4, embed_dim: 32, depth: 2, num_heads: 2, in_chans: 1, epochs: 1, batch_size: 32}}
goal: {{max_flops: 0.9}}
stages:
  dcs: {{target_flops: 0.9, epochs: 1, batch_size: 32}}
  tokens: {{space: space.yaml, trials: 3, train_images: 60, eval_images: 60, batch_size: 30}}
  retrain: {{epochs: 1, eta: 0, batch_size: 32}}
report: {{latency: true, iters: 3, batch_size: 8}}
"""
TINY_SPACE = """format: nascompress-space/1
name: tiny-evit
methods:
  - name: evit
    params:
      prune_layers: [1, 2]
      keep_rate: {kind: per_layer, layers: prune_layers, value: {kind: float, low: 0.5, high: 1.0, step: 0.1}}
"""


def section_pipeline(
    device: torch.device,
    config: str | None,
    workdir: Path,
    amp: str | None = None,
    keep: Callable[[dict], None] = lambda part: None,
) -> dict:
    """The pipeline end to end, its figures handed to ``keep`` (saved) before the compiled profiles."""
    if config is None and device.type == "cuda":
        config = str(ROOT / "configs" / "fashion-mnist.yaml")
    if amp is not None and config is not None:  # the same job at another --amp: a copy of its config
        text = Path(config).read_text()
        text, n = re.subn(r"(?m)^amp:.*$", f"amp: {amp}", text)
        copy_ = workdir / Path(config).name
        copy_.write_text(text if n else f"amp: {amp}\n{text}")
        config = str(copy_)
    if config is None:  # the CPU check of this code path: a tiny synthetic pipeline
        (workdir / "space.yaml").write_text(TINY_SPACE)
        (workdir / "pipeline.yaml").write_text(TINY_PIPELINE.format(device=device.type))
        config = str(workdir / "pipeline.yaml")
    out = workdir / "pipeline_out"
    t0 = time.perf_counter()
    summary = run_pipeline(config, out=out, force=True, progress=False).to_dict()  # (as summary.json holds it)
    wall = time.perf_counter() - t0
    res = {
        "config": Path(config).name if Path(config).parent == workdir else str(Path(config).relative_to(ROOT)),
        "amp": amp or "the config's",
        "wall_s": wall,
        "steps_s": {s["step"]: s["seconds"] for s in summary["stages"]},
        "report": {
            "comparison": summary["comparison"],
            "goal": summary["goal"],
            "dtype": summary.get("dtype"),
            "dense": {k: summary["dense"].get(k) for k in ("test_top1", "macs", "latency_ms", "throughput")},
            "final": {k: summary["final"].get(k) for k in ("test_top1", "macs", "latency_ms", "throughput")},
        },
    }
    keep(res)
    with runtime.configured(device):
        for dname in ("fp32", "bf16"):
            prof = profile(
                out / "final",
                compare=out / "base",
                device=str(device),
                dtype=dname,
                compile=True,
                batch_size=64,
                iters=10,
            )
            res[f"final_vs_dense_{dname}"] = {
                "ratios": prof.comparison.to_dict(),
                "qk_layout": [None if m.qk_layout is None else m.qk_layout.to_dict() for m in prof.models.values()],
            }
            print(dname, res[f"final_vs_dense_{dname}"]["ratios"], flush=True)
    return res


# ---------------------------------------------------------------------------------------------
# Goals (issue 23; H100, bf16, batch 256)


def goals(result: dict) -> dict:
    m = result.get("models")
    if not m or "bf16" not in m.get("by_dtype", {}):
        return {"note": "needs the models section in bf16"}
    bf = m["by_dtype"]["bf16"]
    big = bf.get(f"batch_{m['big_batch']}", {}).get("speedup_vs_dense", {})
    out: dict[str, Any] = {"channel_pruned": {}}
    for k in big:
        if k.startswith(("uniform", "dcs")) and big[k]:
            cut = 1 / m["flops_ratio"][k]
            out["channel_pruned"][k] = {"throughput_speedup": big[k], "flops_cut": cut, "met": big[k] >= 0.8 * cut}
    if big.get("evit_0.7"):
        out["evit_0.7_bf16_big_batch"] = {"speedup": big["evit_0.7"], "met": big["evit_0.7"] >= 1.4}
    comp = bf.get("batch_1_compiled", {}).get("speedup_vs_compiled_dense", {})
    if comp:
        slower = {k: v for k, v in comp.items() if v is not None and v < 1 and k != "dense"}
        out["compiled_batch_1_none_slower_than_dense"] = {"slower": slower, "met": not slower}
    pipe = result.get("pipeline")
    if pipe:
        thr = pipe["report"]["comparison"].get("throughput_speedup")
        out["main_job_faster_than_dense_at_batch_64"] = {
            "throughput_speedup": thr,
            "met": None if thr is None else thr > 1,
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--models", default=None, help="only these compressed models (comma-separated names)")
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled batch-1 timings")
    ap.add_argument(
        "--pipeline-config",
        default=None,
        help="default: configs/fashion-mnist.yaml on CUDA, a tiny synthetic pipeline on the CPU",
    )
    ap.add_argument("--pipeline-amp", default=None, help="run the pipeline at this --amp (default: its config's)")
    ap.add_argument("--out", default=None, help="default bench/results/gpu_<device>.json")
    ap.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch CPU threads (0: torch's default); on a shared machine 1 keeps the timings steadier",
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / f"gpu_{device_label(device)}.json"
    result = read_json(out) if out.is_file() else {}
    result.update(header())
    if device.type == "cuda":
        result["machine"]["gpu"] = torch.cuda.get_device_name(device)
    dtypes = args.dtypes.split(",")
    for sec in args.sections.split(","):
        if sec not in SECTIONS:
            raise SystemExit(f"unknown section {sec!r}; choose from {', '.join(SECTIONS)}")
        key = sec if sec != "pipeline" or not args.pipeline_amp else f"pipeline_amp_{args.pipeline_amp}"
        t0 = time.perf_counter()
        print(f"== {sec}", flush=True)
        try:
            if sec == "models":
                only = set(args.models.split(",")) if args.models else None
                part = section_models(device, dtypes, not args.no_compile, only)
            elif sec == "qk_layout":
                part = section_qk_layout(device, dtypes)
            elif sec == "sparsifiner":
                part = section_sparsifiner(device, dtypes)
            else:
                work = Path(tempfile.mkdtemp(prefix="nascompress-gpu-bench-"))
                try:
                    part = section_pipeline(
                        device,
                        args.pipeline_config,
                        work,
                        args.pipeline_amp,
                        lambda p: save(out, {**result, key: dict(p, unfinished="the compiled profiles")}),
                    )
                finally:
                    shutil.rmtree(work, ignore_errors=True)
        except Exception as e:  # noqa: BLE001 (recorded: the other sections still run)
            traceback.print_exc()
            part = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        part["section_s"] = time.perf_counter() - t0
        result[key] = part
        result["goals"] = (
            goals(result)
            if device.type == "cuda"
            else {"note": "the goals are for an H100 (bf16, batch 256); this run checks the code path on the CPU"}
        )
        save(out, result)
        print(f"-> {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}", flush=True)


if __name__ == "__main__":
    main()
