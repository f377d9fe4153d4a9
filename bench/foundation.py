"""Foundation figures: FLOPs of DeiT-S/DeiT-Ti vs the papers (ours, FlopCounterMode, thop), and the
dense Fashion-MNIST base run (accuracy, training time, FLOPs, latency/throughput).

    python bench/foundation.py --base runs/base --out bench/results/foundation.json
"""
from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

import nascompress
from nascompress.io import write_json
from nascompress.models import ModelSpec, build_model
from nascompress.profiling import count_flops, flop_counter_macs, profile_models
from nascompress.profiling.flops import thop_macs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="runs/base")
    ap.add_argument("--out", default="bench/results/foundation.json")
    args = ap.parse_args()
    res: dict = {"machine": {"cpu_threads": torch.get_num_threads(), "platform": platform.platform(),
                             "torch": torch.__version__}, "paper_flops": {}}
    for name, paper in (("deit_small_patch16_224", 4.6), ("deit_tiny_patch16_224", 1.25)):
        m = build_model(ModelSpec(name)).eval()
        x = torch.randn(1, 3, 224, 224)
        res["paper_flops"][name] = {"paper_gflops": paper, "nascompress_gflops": count_flops(m, x).gflops,
                                    "flop_counter_mode_gflops": flop_counter_macs(m, x) / 1e9,
                                    "thop_gflops_missing_attention": thop_macs(m, x) / 1e9}
    base = Path(args.base)
    if (base / "metrics.json").is_file():
        metrics = json.loads((base / "metrics.json").read_text())
        model = nascompress.load(base)
        prof = profile_models({"base": model}, device=torch.device("cpu"), iters=20)["models"]["base"]
        res["base_run"] = {"dir": str(base), "config": json.loads((base / "config.json").read_text()),
                           "metrics": metrics, "gflops": prof["gflops"], "params": prof["params"],
                           "latency_ms_batch1": prof["latency_ms"], "throughput_batch64": prof["throughput"]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, res)
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
