"""Foundation figures: FLOPs of DeiT-S/DeiT-Ti vs the papers (ours, FlopCounterMode, thop), and the
dense Fashion-MNIST base run (accuracy, training time, FLOPs, latency/throughput).

The base run's accuracy is measured here again on its test split (``evaluate_run``) beside the
figures its own metrics.json recorded; latency (batch 1) and throughput (batch 64) come from
``profile_models`` in this process.

    python bench/foundation.py --base runs/base --out bench/results/foundation.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from _common import data_sizes, header, save  # noqa: E402  (puts the repository on sys.path)

import torch  # noqa: E402

import nascompress  # noqa: E402,F401  (torchvision CPU fix before timm)
from nascompress.profiling.jobs import evaluate_run
from nascompress.runs.run_config import run_data_config  # noqa: E402
from nascompress.data import DataConfig, InputSpec, load_data  # noqa: E402
from nascompress.runs.io import load_with_arch  # noqa: E402
from nascompress.models.build import ModelSpec, build_model  # noqa: E402
from nascompress.profiling import count_flops, flop_counter_macs, profile_models  # noqa: E402
from nascompress.profiling.flops import thop_macs  # noqa: E402
from nascompress.runs.json_io import read_json  # noqa: E402

PAPER_GFLOPS = (("deit_small_patch16_224", 4.6), ("deit_tiny_patch16_224", 1.25))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="runs/base")
    ap.add_argument("--out", default="bench/results/foundation.json")
    ap.add_argument("--iters", type=int, default=20, help="interleaved timing rounds of the base run")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    res: dict = {**header(), "paper_flops": {}}
    for name, paper in PAPER_GFLOPS:
        m = build_model(ModelSpec(name)).eval()
        x = torch.randn(1, 3, 224, 224)
        res["paper_flops"][name] = {
            "paper_gflops": paper,
            "nascompress_gflops": count_flops(m, x).gflops,
            "flop_counter_mode_gflops": flop_counter_macs(m, x) / 1e9,
            "thop_gflops_missing_attention": thop_macs(m, x) / 1e9,
        }
        print(name, json.dumps(res["paper_flops"][name]), flush=True)
    base = Path(args.base)
    if (base / "metrics.json").is_file():
        metrics = read_json(base / "metrics.json")
        model, arch = load_with_arch(base)
        prof = profile_models({"base": model}, device=torch.device("cpu"), iters=args.iters).models["base"]
        data_cfg = run_data_config(base) or DataConfig()
        test = evaluate_run(base, data=data_cfg, device="cpu")
        log = (
            [json.loads(ln) for ln in (base / "log.jsonl").read_text().splitlines() if ln]
            if (base / "log.jsonl").is_file()
            else []
        )
        epochs = [r for r in log if not r.get("start")]
        res["base_run"] = {
            "dir": str(base),
            "config": read_json(base / "config.json"),
            "metrics": metrics,
            "data": data_sizes(load_data(data_cfg, spec=InputSpec.from_dict(arch["input"])), data_cfg),
            "test_top1_measured_here": test.top1,
            "test_n": test.n,
            "epoch_time_s": [r.get("epoch_time_s") for r in epochs],
            "gflops": prof.gflops,
            "params": prof.params,
            "latency_ms_batch1": prof.latency_ms,
            "throughput_batch64": prof.throughput,
            "timing_iters": args.iters,
        }
        print(
            "base",
            json.dumps(
                {
                    k: res["base_run"][k]
                    for k in ("test_top1_measured_here", "gflops", "params", "latency_ms_batch1", "throughput_batch64")
                }
            ),
        )
    else:
        res["base_run"] = {"dir": str(base), "status": "not finished (no metrics.json): not measured"}
    save(args.out, res)
    print(json.dumps({k: res[k] for k in ("command", "paper_flops")}, indent=2))


if __name__ == "__main__":
    main()
