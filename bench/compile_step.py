"""Is ``torch.compile`` of the training step worth it on this CPU? (issue 50: candidates measured, not
assumed.) The main job's base step (``tool_speed.py``'s ``main`` recipe: CE with label smoothing,
clip, AdamW) in fp32 and in bf16 (the ``--amp auto`` path: explicit bf16 attention), eager against
the model's forward compiled by ``torch.compile`` (inductor, the backward through AOTAutograd), all
four interleaved in one process (medians of ``--reps`` steps after 3 warm-up steps each); the
compile's own time is the compiled variants' warm-up. Writes ``bench/results/compile_step.json``.

    python bench/compile_step.py --threads 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import ROOT, build, header, load, save, train_step  # noqa: E402  (puts the repository on sys.path)
import torch  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="main")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "compile_step.json")
    a = ap.parse_args()
    # a cold compile: inductor's cache in a fresh folder (a warm one would hide the compile's cost)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")
    torch.set_num_threads(a.threads)
    res: dict[str, Any] = dict(header(), recipe=a.recipe, threads=a.threads, load_at_start=load())
    variants: dict[str, tuple[Any, Any, str]] = {}
    for name in ("fp32", "fp32_compiled", "bf16", "bf16_compiled"):
        torch.manual_seed(0)
        model, x = build(a.recipe)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        # the same step (_common.train_step, tool_speed's: its autocast and attention path), its forward compiled
        variants[name] = (
            torch.compile(model) if name.endswith("compiled") else model,
            opt,
            "bf16" if name.startswith("bf16") else "off",
        )
    y = torch.randint(0, 10, (x.shape[0],))

    def step(name: str) -> float:
        model, opt, amp = variants[name]
        t0 = time.perf_counter()
        train_step(model, x, y, opt, amp)
        return time.perf_counter() - t0

    warm = {}
    for name in variants:
        t0 = time.perf_counter()
        for _ in range(3):
            step(name)
        warm[name] = time.perf_counter() - t0
    times: dict[str, list[float]] = {n: [] for n in variants}
    for _ in range(a.reps):
        for n in variants:
            times[n].append(step(n))
    med = {n: statistics.median(v) for n, v in times.items()}
    res["step_s"] = med
    res["warmup_3_steps_s"] = warm
    res["compiled_speedup"] = {p: med[p] / med[f"{p}_compiled"] for p in ("fp32", "bf16")}
    res["compile_s"] = {p: warm[f"{p}_compiled"] - 3 * med[f"{p}_compiled"] for p in ("fp32", "bf16")}
    res["load_after"] = load()
    save(a.out, res)
    print({k: res[k] for k in ("step_s", "compiled_speedup", "compile_s")})


if __name__ == "__main__":
    main()
