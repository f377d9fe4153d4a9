"""Helpers shared by the benchmark scripts (run as ``python bench/<name>.py``, so this folder is on sys.path)."""
from __future__ import annotations

import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the repository's nascompress, also when it is not installed
    sys.path.insert(0, str(ROOT))


def wait_for_base(base: Path, timeout_s: float) -> None:
    """Block until the dense run ``base`` has finished (its metrics.json exists), or exit after ``timeout_s``."""
    t0 = time.time()
    while not (base / "metrics.json").is_file():
        if time.time() - t0 > timeout_s:
            raise SystemExit(f"{base}/metrics.json did not appear within {timeout_s:.0f}s")
        time.sleep(20)


def command_line() -> str:
    """The command that ran this benchmark, as typed from the repository root."""
    script = Path(sys.argv[0])
    try:
        script = script.resolve().relative_to(ROOT)
    except ValueError:
        pass
    return " ".join(["python", shlex.quote(str(script)), *map(shlex.quote, sys.argv[1:])])


def machine() -> dict[str, Any]:
    """Where the figures were measured: torch threads, CPU count, load, platform, versions."""
    import torch

    info: dict[str, Any] = {"cpu_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
                            "platform": platform.platform(), "python": platform.python_version(),
                            "torch": torch.__version__, "cuda": torch.cuda.is_available()}
    try:
        import timm

        info["timm"] = timm.__version__
    except ImportError:  # pragma: no cover
        pass
    try:
        info["load_average_at_start"] = os.getloadavg()[0]
    except OSError:  # pragma: no cover
        pass
    return info


def header() -> dict[str, Any]:
    """The fields every result JSON starts with: the command line and the machine."""
    return {"command": command_line(), "machine": machine()}


def data_sizes(bundle: Any, cfg: Any = None) -> dict[str, Any]:
    """The split sizes of a loaded DataBundle (and the limits / subset seed that drew them)."""
    out: dict[str, Any] = {"dataset": bundle.name, "train_images": len(bundle.train), "val_images": len(bundle.val),
                           "test_images": len(bundle.test)}
    if cfg is not None:
        out.update(train_limit=cfg.train_limit, eval_limit=cfg.eval_limit, subset_seed=cfg.subset_seed,
                   split_seed=cfg.split_seed, val_fraction=cfg.val_fraction)
    return out


def save(path: str | Path, result: dict[str, Any]) -> None:
    """Write ``result`` to ``path`` atomically (parent folders created)."""
    from nascompress.utils import write_json

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, result)
