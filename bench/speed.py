"""Does speed follow FLOPs? Every method's model and the pipeline's against the dense model, on one device.

Each model is built from a dense timm ViT at its settings without training (``bench/_speed_models.py``:
DCS-materialized static Q/K + hidden family and uniform pruning at 0.6x FLOPs, EViT keep 0.7, ToMe at the r
nearest 0.6x, DynamicViT rho 0.7, Sparsifiner unstructured and block, MG-ViT epsilon 1, Torch-Pruning's MLP
pruning at 0.6x when ``torch_pruning`` is installed), and with ``--pipeline DIR`` a finished pipeline's final
model against its own dense base (and the methods rebuilt on that base). Every model of one cell (dtype x
batch x eager/compiled) is timed interleaved with the dense one in this process
(``profiling.time_models``: medians of rotating rounds). Each row: the FLOPs ratio
(``profiling.count_flops``, attention matmuls counted), the speed-up (dense median / model median) and the
**realized share of the FLOPs cut** = speed-up x FLOPs ratio (1.0: speed follows FLOPs exactly; a model at
0.6x FLOPs and 1.2x speed realizes 0.72).

    python bench/speed.py --model mainjob                 # CPU: batch 1, 16, 64; fp32 (+ bf16 where native)
    python bench/speed.py --model deit_s_224 --compile    # + torch.compile'd rows
    python bench/speed.py --pipeline runs/demo            # the main job's final model and its peers
    python bench/speed.py --gpu                           # the GPU part, DeiT-S/224 bf16, < 8 min (time guard)
    python bench/speed.py --gpu --device cpu --quick      # the same code path on a CPU, in seconds

Results merge into ``bench/results/speed_<device>.json`` (``<device>``: the CPU's or GPU's model name as a
slug), one entry per geometry under ``runs``; ``python bench/make_results.py`` renders the tables.
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path
from typing import Any, Callable

from _common import ROOT, header, save, slug  # noqa: E402  (puts the repository on sys.path)
from _speed_models import (  # noqa: E402
    GEOMETRIES,
    METHOD_OF,
    NOTES,
    dense_model,
    flops_ratio,
    input_shape,
    pipeline_models,
    zoo,
)

import torch  # noqa: E402
import torch._dynamo  # noqa: E402

from nascompress import profiling, runtime  # noqa: E402
from nascompress.profiling import time_models  # noqa: E402
from nascompress.profiling.latency import compile_for_speed  # noqa: E402
from nascompress.runs.json_io import read_json  # noqa: E402

GPU_BUDGET_S = 450  # --gpu: the whole command (building included) stays under 8 minutes
BUILD_SHARE = 0.35  # under a time budget, building the models may take this share of it
COMPILE_GUESS_S = {"cuda": 45.0, "cpu": 60.0}  # one model's compile before any was measured
# the methods the latency table prices (widths, blocks, and the tokens each block sees, read from one forward)
PREDICTED = (*sorted(profiling.PRICED_METHODS), "torch-pruning")
COMPILE_PRIORITY = ("dense", "dcs_0.6x", "uniform_0.6x", "evit_0.7", "tome", "pipeline_final")  # compiled first


# ---------------------------------------------------------------------------------------------
# Settings


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(GEOMETRIES), default=None, help="default mainjob (--gpu: deit_s_224)")
    ap.add_argument("--weights", default=None, help="a timm state dict for the dense model (tools/convert_dinov2.py)")
    ap.add_argument("--pipeline", default=None, help="a finished pipeline --out folder: its base and final model")
    ap.add_argument("--methods", default=None, help="only these models (comma-separated; 'none': no method)")
    ap.add_argument("--device", default=None, help="default cuda with --gpu, else cpu")
    ap.add_argument("--dtypes", default=None, help="fp32,bf16 (bf16 on a CPU only where native: AVX512-BF16/AMX)")
    ap.add_argument("--batches", default=None, help="default 1,16,64 on a CPU, 1,256 on a GPU (--quick: 1,4)")
    ap.add_argument("--iters", type=int, default=None, help="timed rounds per cell (default 20; --quick 3)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed calls per model (default 3; --quick 2)")
    ap.add_argument("--compile", action="store_true", help="add torch.compile'd rows (CUDA graphs on a GPU)")
    ap.add_argument(
        "--compile-backend",
        default=None,
        help="torch.compile backend (default: compile_for_speed's; --quick on a CPU: eager, a code-path check)",
    )
    ap.add_argument("--gpu", action="store_true", help="the GPU preset: DeiT-S/224, bf16, batch 1 and 256, compiled")
    ap.add_argument("--quick", action="store_true", help="few iterations and small batches: checks the code path")
    ap.add_argument("--budget-s", type=float, default=None, help=f"time guard (default {GPU_BUDGET_S} with --gpu)")
    ap.add_argument(
        "--predict",
        choices=("auto", "on", "off"),
        default="auto",
        help="the latency table's predicted ms per channel-pruned row (auto: on unless a time budget is set)",
    )
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--out", default=None, help="default bench/results/speed_<device>.json")
    return ap.parse_args(argv)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    return next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "cpu")


def plan(a: argparse.Namespace) -> dict[str, Any]:
    """The run's settings from the options: presets (--gpu, --quick) under what was given explicitly."""
    device = torch.device(a.device or ("cuda" if a.gpu else "cpu"))
    cuda = device.type == "cuda"
    notes: list[str] = []
    dtypes = (a.dtypes or ("bf16" if a.gpu else "fp32,bf16")).split(",")
    if "bf16" in dtypes and not cuda and not runtime.native_bf16(device):
        dtypes = [d for d in dtypes if d != "bf16"] or ["fp32"]
        notes.append("bf16 skipped: this CPU has no native bfloat16 (AVX512-BF16 or AMX)")
    batches = a.batches or ("1,4" if a.quick else "1,256" if cuda else "1,16,64")
    backend = a.compile_backend or ("eager" if a.quick and not cuda else None)
    return {
        "device": device,
        "geometry": a.model or ("deit_s_224" if a.gpu else "mainjob"),
        "dtypes": dtypes,
        "batches": [int(b) for b in batches.split(",")],
        "iters": a.iters or (3 if a.quick else 20),
        "warmup": a.warmup or (2 if a.quick else 3),
        "compile": a.compile or a.gpu,
        "compile_backend": backend,
        "budget_s": a.budget_s or (GPU_BUDGET_S if a.gpu else None),
        "compile_guess_s": 5.0 if backend else COMPILE_GUESS_S.get(device.type, COMPILE_GUESS_S["cpu"]),
        "compile_s": {},
        "predict": a.predict == "on" or (a.predict == "auto" and not (a.budget_s or a.gpu)),
        "notes": notes,
    }


# ---------------------------------------------------------------------------------------------
# The time guard


class Guard:
    """The time left of ``budget_s`` (None: no limit), counted from the start of the command."""

    def __init__(self, budget_s: float | None):
        self.t0, self.budget = time.perf_counter(), budget_s
        self.skipped: list[str] = []

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def fits(self, what: str, estimate_s: float) -> bool:
        if self.budget is None or self.elapsed() + estimate_s <= self.budget:
            return True
        left = self.budget - self.elapsed()
        self.skipped.append(f"{what}: skipped by the time guard (estimated {estimate_s:.0f} s, {left:.0f} s left)")
        print(f"  {self.skipped[-1]}", flush=True)
        return False


# ---------------------------------------------------------------------------------------------
# Timing one cell


def first_calls(fns: dict[str, Callable], x: torch.Tensor, failed: dict[str, str]) -> dict[str, float]:
    """One call of each (a compiled one compiles here): its seconds; a failing one goes to ``failed``."""
    took = {}
    for k, f in fns.items():
        t0 = time.perf_counter()
        try:
            with torch.inference_mode():
                f(x)
            if x.device.type == "cuda":
                torch.cuda.synchronize(x.device)
            took[k] = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 (recorded: the other models are still timed)
            failed[k] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            print(f"  {k}: {failed[k]}", flush=True)
    return took


def time_cell(
    fns: dict[str, Callable], x: torch.Tensor, p: dict[str, Any], guard: Guard, what: str
) -> tuple[dict[str, float], dict[str, str]]:
    """Median ms per forward of each callable, interleaved; (times, failures). Dense must time for any row."""
    failed: dict[str, str] = {}
    took = first_calls(fns, x, failed)
    if "dense" not in took:
        return {}, failed
    ok = {k: fns[k] for k in took}
    per_round = sum(min(t, 10 * took["dense"]) for t in took.values())  # the first calls bound a round from above
    if not guard.fits(what, per_round * (p["warmup"] + p["iters"])):
        return {}, failed
    try:
        times = time_models(list(ok.values()), x, warmup=p["warmup"], iters=p["iters"])
    except Exception as e:  # noqa: BLE001 (a model that fails after its first call: the cell is recorded)
        failed["cell"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        return {}, failed
    return {k: t * 1e3 for k, t in zip(ok, times)}, failed


def compiled(models: dict[str, torch.nn.Module], x: torch.Tensor, p: dict[str, Any], guard: Guard, what: str):
    """(callables, notes): each model torch.compile'd and called once (its compile), most wanted first, while
    the time guard allows (each compile estimated by the longest one so far). With a time budget only
    :data:`COMPILE_PRIORITY`'s models are compiled."""
    order = [k for k in COMPILE_PRIORITY if k in models] + [k for k in models if k not in COMPILE_PRIORITY]
    if p["budget_s"] is not None:
        order = [k for k in order if k in COMPILE_PRIORITY]
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)  # one graph per model
    fns, notes = (
        {},
        {k: "not compiled (a time budget compiles only COMPILE_PRIORITY's)" for k in models if k not in order},
    )
    for k in order:
        if not guard.fits(f"{what} {k}", p["compile_guess_s"]):
            notes[k] = "skipped by the time guard"
            continue
        note = getattr(models[k], "compile_note", None)
        if p["compile_backend"] and not note:
            fn = torch.compile(models[k], backend=p["compile_backend"], dynamic=False)
        else:
            fn, note = compile_for_speed(models[k], p["device"]) if not note else (None, note)
        if fn is None:
            notes[k] = note
            continue
        took = first_calls({k: fn}, x, notes)
        if k in took:
            fns[k] = fn
            p["compile_s"][f"{what} {k}"] = took[k]
            p["compile_guess_s"] = max(p["compile_s"].values())  # the longest compile measured so far
    return fns, notes


# ---------------------------------------------------------------------------------------------
# The predictor (nascompress.profiling.latency_table / predict_latency, when the checkout has them)


def predictor(p: dict[str, Any], dtype: str, batch: int, dense: torch.nn.Module) -> tuple[Any, str | None]:
    """(a callable model -> predicted ms, None), or (None, why not): the latency table of the dense
    model's geometry for this device, dtype and batch (``profiling.latency_table``: read from the user's
    cache, or measured and cached) and its predictor (``profiling.predict_latency``)."""
    if not p["predict"]:
        return None, "off (--predict off, or auto under a time budget)"
    table_fn = getattr(profiling, "latency_table", None)
    predict = getattr(profiling, "predict_latency", None)
    if table_fn is None or predict is None:
        return None, "nascompress.profiling has no latency_table / predict_latency in this checkout"
    try:
        table = table_fn(profiling.geometry_of(dense), device=p["device"], dtype=dtype, batch=batch)
    except Exception as e:  # noqa: BLE001 (recorded: the measurement does not need it)
        return None, f"latency_table failed: {type(e).__name__}: {e}"
    x1 = torch.zeros(1, *input_shape(dense), device=p["device"])  # the tokens each block sees: one forward

    def predicted(m: torch.nn.Module) -> float:
        return float(predict(table, m, x=x1.to(next(m.parameters()).dtype)))

    return predicted, None


# ---------------------------------------------------------------------------------------------
# One geometry


def settings_text(s: dict[str, Any]) -> str:
    """A row's settings in a few words (lists of equal counts as ``184x6``, others as their range)."""
    parts = []
    for k, v in s.items():
        if isinstance(v, list) and v and all(isinstance(i, int) for i in v):
            v = f"{v[0]}x{len(v)}" if len(set(v)) == 1 else f"{min(v)}-{max(v)}"
        parts.append(f"{k} {v}")
    return ", ".join(parts) or "defaults"


def build_models(
    dense: torch.nn.Module, x: torch.Tensor, only: set[str] | None, extra: dict, guard: Guard
) -> dict[str, Any]:
    """Every model (built on the CPU in fp32), its settings and FLOPs ratio; failures recorded. Under a time
    budget the builds stop at :data:`BUILD_SHARE` of it (the last, least wanted models skipped)."""
    models, settings, errors = {"dense": dense}, {"dense": {}}, {}
    builders = dict(extra)
    builders.update(zoo(dense, x, only))
    for k, build in builders.items():
        t0 = time.perf_counter()
        if guard.budget is not None and not guard.fits(f"build {k}", guard.budget * (1 - BUILD_SHARE)):
            errors[k] = "skipped by the time guard"
            continue
        try:
            models[k], settings[k] = build()
        except ModuleNotFoundError as e:
            errors[k] = f"not installed: {e.name}"
        except Exception as e:  # noqa: BLE001 (recorded: the other models are still timed)
            errors[k] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        print(f"built {k} ({time.perf_counter() - t0:.1f} s){': ' + errors[k] if k in errors else ''}", flush=True)
    xf = x.expand(2, *x.shape[1:]).contiguous()
    ratios = {k: flops_ratio(m, dense, xf) for k, m in models.items()}
    return {"models": models, "settings": settings, "errors": errors, "flops_ratio": ratios}


def rows_of(cell: dict[str, float], built: dict, key: dict[str, Any], pred: Callable | None, ms: dict) -> list[dict]:
    """The rows of one timed cell: one per model other than dense."""
    out = []
    for k, t in cell.items():
        if k == "dense":
            continue
        r, speedup = built["flops_ratio"][k], cell["dense"] / t
        row = {
            "model": k,
            "method": METHOD_OF.get(k, k),
            "settings": settings_text(built["settings"][k]),
            **key,
            "flops_ratio": r,
            "ms": t,
            "dense_ms": cell["dense"],
            "speedup": speedup,
            "realized_share": speedup * r,
        }
        channels = METHOD_OF.get(k) in PREDICTED or built["settings"][k].get("predictable")
        if pred is not None and key["mode"] == "eager" and channels:
            try:
                p = pred(ms[k])
                row.update(predicted_ms=p, predictor_error=p / t - 1)
            except Exception as e:  # noqa: BLE001 (recorded per row)
                row["predictor_error"] = f"{type(e).__name__}: {e}"
        out.append(row)
    return out


def torch_pruning_status(built: dict) -> str:
    """Torch-Pruning's version, ``not installed``, ``failed: ...`` or ``not asked`` (``--methods``)."""
    err = built["errors"].get("torch_pruning_0.6x")
    if err:
        return (
            "not installed"
            if err.startswith("not installed")
            else err
            if err.startswith("skipped")
            else f"failed: {err}"
        )
    return built["settings"].get("torch_pruning_0.6x", {}).get("torch_pruning", "not asked")


def run_geometry(a: argparse.Namespace, p: dict[str, Any], guard: Guard) -> tuple[str, dict[str, Any]]:
    only = None if a.methods is None else set() if a.methods == "none" else set(a.methods.split(","))
    unknown = sorted((only or set()) - set(METHOD_OF))
    if unknown:
        raise SystemExit(f"error: unknown --methods {', '.join(unknown)}; choose from {', '.join(METHOD_OF)}")
    extra: dict[str, Callable] = {}
    if a.pipeline:
        dense, final, info = pipeline_models(a.pipeline)
        extra["pipeline_final"] = lambda: (final, info)
        key, spec = f"pipeline_{Path(a.pipeline).name}", {"pipeline": str(a.pipeline)}
    else:
        dense, ms = dense_model(p["geometry"], a.weights)
        key, spec = p["geometry"] + ("_weights" if a.weights else ""), ms.to_dict()
    shape = input_shape(dense)
    x1 = torch.randn(1, *shape, generator=torch.Generator().manual_seed(0))
    built = build_models(dense, x1, only, extra, guard)
    dev = p["device"]
    if p["compile"]:
        n = len(built["models"]) * len(p["dtypes"])
        if p["budget_s"]:
            n = sum(k in COMPILE_PRIORITY for k in built["models"]) * len(p["dtypes"])
        guess = p["compile_guess_s"] * n * len(p["batches"])
        print(f"compiles: about {guess:.0f} s (guard: {p['budget_s']} s)", flush=True)
    res: dict[str, Any] = {
        "model": spec,
        "weights": "given" if (a.weights or a.pipeline) else "random",
        "device": dev.type,
        "device_name": device_name(dev),
        "threads": torch.get_num_threads(),
        "dtypes": p["dtypes"],
        "batches": p["batches"],
        "iters": p["iters"],
        "warmup": p["warmup"],
        "compile": p["compile"],
        "compile_backend": p["compile_backend"] or ("reduce-overhead" if dev.type == "cuda" else "inductor"),
        "quick": bool(a.quick),
        "notes": dict(NOTES, run=p["notes"]),
        "torch_pruning": torch_pruning_status(built),
        "settings": built["settings"],
        "flops_ratio": built["flops_ratio"],
        "build_errors": built["errors"],
        "rows": [],
        "failed": {},
        "predictor": {},
    }
    for dname in p["dtypes"]:
        dtype = runtime.parse_dtype(dname)
        with runtime.configured(dev):
            ms = {k: copy.deepcopy(m).to(dev, dtype).eval() for k, m in built["models"].items()}
            for mode in ("eager", "compiled") if p["compile"] else ("eager",):
                for B in p["batches"]:
                    what = f"{dname} batch {B} {mode}"
                    pred, why = predictor(p, dname, B, ms["dense"]) if mode == "eager" else (None, None)
                    if why:
                        res["predictor"][f"{dname}_batch_{B}"] = why
                    x = torch.randn(B, *shape, generator=torch.Generator().manual_seed(2)).to(dev, dtype)
                    notes: dict[str, str] = {}
                    if mode == "compiled":
                        fns, notes = compiled(ms, x, p, guard, what)
                    else:
                        fns = dict(ms)
                    cell, failed = time_cell(fns, x, p, guard, what)
                    if pred is not None and "dense" in cell:
                        try:
                            pd = pred(ms["dense"])
                            res["predictor"][f"{dname}_batch_{B}"] = {
                                "dense_predicted_ms": pd,
                                "dense_error": pd / cell["dense"] - 1,
                            }
                        except Exception as e:  # noqa: BLE001 (recorded: the measurement does not need it)
                            res["predictor"][f"{dname}_batch_{B}"] = f"predict_latency failed: {type(e).__name__}: {e}"
                    failed.update(notes)
                    if failed:
                        res["failed"][what] = failed
                    keyd = {"dtype": dname, "batch": B, "mode": mode}
                    res["rows"] += rows_of(cell, built, keyd, pred, ms)
                    shown = {k: round(cell["dense"] / v, 2) for k, v in cell.items() if k != "dense"}
                    print(what, "speed-up:", shown, flush=True)
                    if mode == "compiled":
                        torch._dynamo.reset()
    res["compile_s"] = p["compile_s"]
    res["skipped"] = guard.skipped
    res["wall_s"] = guard.elapsed()
    return key, res


def default_out(device: torch.device) -> Path:
    return ROOT / "bench" / "results" / f"speed_{slug(device_name(device))}.json"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    p = plan(a)
    if p["device"].type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but torch sees no GPU; run with --device cpu (add --quick to check)")
    guard = Guard(p["budget_s"])
    out = Path(a.out) if a.out else default_out(p["device"])
    result = read_json(out) if out.is_file() else {}
    result.update(header())
    result["machine"]["cpu" if p["device"].type == "cpu" else "gpu"] = device_name(p["device"])
    key, part = run_geometry(a, p, guard)
    result.setdefault("runs", {})[key] = part
    save(out, result)
    print(f"-> {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out} ({guard.elapsed():.0f} s)", flush=True)
    return result


if __name__ == "__main__":
    main()
