"""Time the README's demo (``nascompress pipeline demo``) as a user runs it: the installed command in a fresh
process, from a directory outside the checkout, wall and CPU time, each stage's seconds (the pipeline's
own markers) and the result (summary.json). Writes ``bench/results/demo_time.json``; the README's
"Two commands" section quotes it (``python bench/make_results.py``).

    python bench/demo_time.py [--config demo] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT, header, save


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="demo", help="a shipped config's name or a path")
    ap.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS (default: torch's)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "demo_time.json")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="nc-demo-"))
    env = dict(os.environ, NASCOMPRESS_PROGRESS="off")
    if a.threads:
        env["OMP_NUM_THREADS"] = str(a.threads)
    exe = Path(sys.executable).parent / "nascompress"
    load0 = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run(
        [str(exe), "pipeline", a.config, "--out", str(work / "out")], cwd=work, env=env, capture_output=True, text=True
    )
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0:
        raise SystemExit(f"the demo failed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")
    out = work / "out"
    stages = {p.stem: json.loads(p.read_text())["seconds"] for p in sorted((out / "done").glob("*.json"))}
    s = json.loads((out / "summary.json").read_text())
    res = dict(
        header(),
        config=a.config,
        wall_s=round(wall, 1),
        user_s=round(after.ru_utime - before.ru_utime, 1),
        sys_s=round(after.ru_stime - before.ru_stime, 1),
        load_at_start=round(load0, 2),
        load_at_end=round(os.getloadavg()[0], 2),
        stage_seconds=stages,
        result={
            "dataset": s["dataset"],
            "dense_test_top1": s["dense"]["test_top1"],
            "final_test_top1": (s["final"] or {}).get("test_top1"),
            "flops_ratio": (s["comparison"] or {}).get("flops_ratio"),
            "goal_met": s["goal"]["met"],
            "picked_study": (s["decisions"].get("tokens") or {}).get("picked_study"),
        },
    )
    save(a.out, res)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
