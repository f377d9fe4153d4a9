"""Helpers shared by the benchmark scripts (run as ``python bench/<name>.py``, so this folder is on sys.path)."""
from __future__ import annotations

import time
from pathlib import Path


def wait_for_base(base: Path, timeout_s: float) -> None:
    """Block until the dense run ``base`` has finished (its metrics.json exists), or exit after ``timeout_s``."""
    t0 = time.time()
    while not (base / "metrics.json").is_file():
        if time.time() - t0 > timeout_s:
            raise SystemExit(f"{base}/metrics.json did not appear within {timeout_s:.0f}s")
        time.sleep(20)
