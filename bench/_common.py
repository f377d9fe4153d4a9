"""Helpers shared by the benchmark scripts (run as ``python bench/<name>.py``, so this folder is on sys.path)."""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the repository's nascompress, also when it is not installed
    sys.path.insert(0, str(ROOT))

import nascompress  # noqa: E402,F401  (torchvision CPU fix before timm)
import timm  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from PIL import Image  # noqa: E402
from torch.profiler import record_function  # noqa: E402

from nascompress import runtime  # noqa: E402
from nascompress.data import load_fashion_mnist  # noqa: E402
from nascompress.methods.uniform import uniform_from_keep  # noqa: E402
from nascompress.models.build import build_model, custom_vit_spec  # noqa: E402
from nascompress.profiling import count_flops  # noqa: E402
from nascompress.runs.json_io import read_json, write_json  # noqa: E402


# An absolute path of the machine a bench ran on (``/home/me/runs/base``); system folders are kept.
_ABS_PATH = re.compile(r"(?<![\w.~/-])/+[\w.+-]+(?:/[\w.+-]*)+")
_SYSTEM_PREFIXES = ("/usr/", "/dev/", "/proc/", "/sys/", "/etc/", "/opt/", "/bin/", "/lib")
_REPO_FOLDERS = ("runs", "weights", "configs", "bench", "tests", "search_spaces", "scripts", "tools", "docs", "data")


def slug(name: str, default: str = "cpu") -> str:
    """A device's name as it stands in a result file's name (``AMD EPYC`` -> ``amd-epyc``)."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or default


def relative_path(path: str, root: Path = ROOT) -> str:
    """``path`` as it reads on any machine: relative to the repository root when it lies inside it, else
    from its first repository-like folder (``/x/y/runs/base`` -> ``runs/base``), else its file name."""
    if path.startswith(_SYSTEM_PREFIXES):
        return path
    root_s = str(root)
    if path == root_s:
        return "."
    if path.startswith(root_s + "/"):
        return path[len(root_s) + 1 :]
    parts = path.strip("/").split("/")
    if parts[0] in _REPO_FOLDERS:  # already relative (``sqlite:///runs/x.db``): left alone
        return path
    for i, part in enumerate(parts):
        if part in _REPO_FOLDERS:
            return "/".join(parts[i:])
    return parts[-1] or "."


def _relative_match(m: re.Match, root: Path = ROOT) -> str:
    """A matched path made relative; the extra slashes of a URL (``sqlite:////abs/x.db``) are kept."""
    path = m.group(0)
    slashes = len(path) - len(path.lstrip("/"))
    if m.start() > 0 and m.string[m.start() - 1] == ":" and slashes <= 3:
        return path  # a URL's host (http://h/x) or a relative SQLite path (sqlite:///x.db)
    return "/" * (slashes - 1) + relative_path("/" + path.lstrip("/"), root)


def relative_paths(obj: Any, root: Path = ROOT) -> Any:
    """``obj`` (a JSON value) with every machine path in its strings made relative (``relative_path``)."""
    if isinstance(obj, str):
        return _ABS_PATH.sub(lambda m: _relative_match(m, root), obj)
    if isinstance(obj, dict):
        return {k: relative_paths(v, root) for k, v in obj.items()}
    if isinstance(obj, list):
        return [relative_paths(v, root) for v in obj]
    return obj


def fashion_mnist_folders(parts: list[tuple[Path, str, int, int]], seed: int) -> None:
    """ImageFolders of 28-px grayscale PNGs drawn from Fashion-MNIST's test split: ``(root, split, start,
    stop)`` takes images ``start:stop`` of one seeded permutation (so the parts are disjoint) into
    ``root/split/c<label>/``; each root is written beside itself (``root.part``) and renamed when complete."""
    _, test = load_fashion_mnist()
    order = torch.randperm(len(test), generator=torch.Generator().manual_seed(seed)).tolist()
    for root, split, start, stop in parts:
        for k, i in enumerate(order[start:stop]):
            img, label = test[i]
            d = root.with_name(root.name + ".part") / split / f"c{int(label)}"
            d.mkdir(parents=True, exist_ok=True)
            Image.fromarray(img.squeeze(0).numpy()).save(d / f"{k:05d}.png")
    for root in dict.fromkeys(r for r, *_ in parts):
        root.with_name(root.name + ".part").rename(root)


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
    info: dict[str, Any] = {
        "cpu_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
    }
    info["timm"] = timm.__version__
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
    out: dict[str, Any] = {
        "dataset": bundle.name,
        "train_images": len(bundle.train),
        "val_images": len(bundle.val),
        "test_images": len(bundle.test),
    }
    if cfg is not None:
        out.update(
            train_limit=cfg.train_limit,
            eval_limit=cfg.eval_limit,
            subset_seed=cfg.subset_seed,
            split_seed=cfg.split_seed,
            val_fraction=cfg.val_fraction,
        )
    return out


def save(path: str | Path, result: dict[str, Any]) -> None:
    """Write ``result`` to ``path`` atomically (parent folders created), machine paths made relative so
    that a result committed under ``bench/results/`` names no folder of the machine it ran on."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, relative_paths(result))


def torch_pruning_keep(dense: Any, x: Any, target: float, *, round_to: int = 8) -> tuple[list[list[int]], float]:
    """Torch-Pruning (``pip install torch-pruning==1.6.1``) as a user runs it on a timm ViT's MLPs:
    ``MetaPruner`` with its group L2 magnitude importance, global pruning of the MLP hidden neurons
    (fc1 out / fc2 in; every other layer ignored), ``round_to``, its pruning ratio bisected to the FLOPs
    ratio ``target`` of ``dense`` on input ``x``. Returns (the fc1 rows kept per block, the pruning
    ratio); the rows are matched back to ``dense``'s so that the library's
    :func:`~nascompress.methods.uniform.uniform_from_keep` builds the model (a nascompress run) from them."""
    import torch_pruning  # noqa: F401  (optional: the external peer, pip install torch-pruning==1.6.1)

    full = count_flops(dense, x).total

    def pruned(ratio: float) -> list[list[int]]:
        return torch_pruning_rows(dense, x, ratio, round_to=round_to)

    def flops_of(keep: list[list[int]]) -> float:
        return count_flops(uniform_from_keep(dense, keep)[0], x).total / full

    lo, hi, best = 0.0, 0.95, None
    for _ in range(12):  # the FLOPs ratio falls as the pruning ratio rises
        mid = (lo + hi) / 2
        keep = pruned(mid)
        r = flops_of(keep)
        if best is None or abs(r - target) < abs(best[0] - target):
            best = (r, mid, keep)
        lo, hi = (mid, hi) if r > target else (lo, mid)
    return best[2], best[1]


def torch_pruning_rows(dense: Any, x: Any, ratio: float, *, round_to: int = 8) -> list[list[int]]:
    """The fc1 rows of ``dense`` (per block) that Torch-Pruning keeps at pruning ratio ``ratio``: the
    user's run of :func:`torch_pruning_keep` (``MetaPruner``, group L2 magnitude importance, global
    pruning of the MLP hidden neurons only, ``round_to``) at one ratio, without the FLOPs bisection."""
    import torch_pruning as tp  # optional: the external peer (pip install torch-pruning==1.6.1)

    m = copy.deepcopy(dense)
    keep_fc1 = {id(b.mlp.fc1) for b in m.blocks}
    ignored = [mod for mod in m.modules() if isinstance(mod, torch.nn.Linear) and id(mod) not in keep_fc1]
    pr = tp.pruner.MetaPruner(
        m,
        x,
        importance=tp.importance.GroupMagnitudeImportance(p=2),
        global_pruning=True,
        pruning_ratio=ratio,
        ignored_layers=ignored,
        round_to=round_to,
    )
    pr.step()
    return [
        torch.cdist(b1.mlp.fc1.weight, b0.mlp.fc1.weight).argmin(1).sort().values.tolist()
        for b0, b1 in zip(dense.blocks, m.blocks)
    ]


def bisect_to_ratio(
    measure: Any, least: float, most: float, *, target: float = 1.0, tol: float = 0.03, steps: int = 8
) -> dict[str, Any]:
    """The least-pruned amount between ``least`` and ``most`` pruned (either may be the larger number)
    whose ``measure(amount)["ratio"]`` (e.g. the candidate's measured latency over the reference's,
    falling, up to noise, as the pruning grows) is at most ``target * (1 + tol)``: the peer that is as
    fast as the reference and otherwise pruned as little as it can be (at batch 1 latency is nearly
    flat in the MLP width, so "closest to the target" would be any amount, most of them needlessly
    pruned).

    ``measure`` is called first at ``most``: if even the most-pruned setting stays above the bound
    (measured twice, a timing being noisy: the mean of the two), the target cannot be reached
    (``reachable`` False) and the answer is that setting, no bisection run. Else ``steps`` midpoints
    are measured, each one fast enough moving the answer towards ``least``. Returns ``reached`` (the
    answer is within the bound), ``reachable``, ``amount`` and ``ratio`` of the answer, and ``steps``:
    every call in order, ``{"amount": ..., **measure(amount)}``."""
    trail: list[dict[str, Any]] = []
    bound = target * (1.0 + tol)

    def probe(amount: float) -> float:
        got = dict(measure(amount))
        trail.append({"amount": amount, **got})
        return float(got["ratio"])

    r = probe(most)
    if r > bound:  # confirmed before giving up
        r = (r + probe(most)) / 2
    if r > bound:
        return {"reached": False, "reachable": False, "amount": most, "ratio": r, "steps": trail}
    best, lo, hi = (most, r), least, most
    for _ in range(steps):
        mid = (lo + hi) / 2
        rm = probe(mid)
        if rm <= bound:  # fast enough: try pruning less
            best, hi = (mid, rm), mid
        else:
            lo = mid
    return {"reached": True, "reachable": True, "amount": best[0], "ratio": best[1], "steps": trail}


def log_summary(run: Path) -> dict[str, Any]:
    """A training run's ``log.jsonl``: its validation top-1 before training (if logged), per epoch, and
    the epoch times."""
    log = [json.loads(ln) for ln in (run / "log.jsonl").read_text().splitlines() if ln.strip()]
    return {
        "start_val_top1": log[0].get("val_top1") if log and log[0].get("start") else None,
        "val_per_epoch": [r["val_top1"] for r in log if not r.get("start")],
        "epoch_time_s": [r.get("epoch_time_s") for r in log if not r.get("start")],
    }


def hypervolume(points: list[tuple[float, float]], ref_ratio: float, floor: float) -> float:
    """Area dominated by (flops_ratio (min), top1 (max)) points within [0, ref_ratio] x [floor, 100]."""
    pts = sorted({(r, a) for r, a in points if r <= ref_ratio and a >= floor})
    area, best = 0.0, floor
    for i, (r, a) in enumerate(pts):  # sweep by increasing cost; a point counts while it beats the best so far
        best = max(best, a)
        nxt = pts[i + 1][0] if i + 1 < len(pts) else ref_ratio
        area += (nxt - r) * (best - floor)
    return area


def uniform_summary(record: dict[str, Any]) -> dict[str, Any]:
    """A ``uniform`` method record (``nascompress.methods.uniform``) as a result reports it: the share
    kept and the kept counts per block (MLP hidden neurons; Q/K channels per head, None: all)."""
    blocks = record["blocks"]
    return {
        "keep": record["config"]["keep"],
        "hidden_kept": [len(b["hidden_keep"]) for b in blocks],
        "qk_kept": [None if b["qk_keep"] is None else [len(h) for h in b["qk_keep"]] for b in blocks],
    }


def user_command(
    base: str, target: float, a: argparse.Namespace, out: Path, amp: str | None = None
) -> tuple[list[str], dict[str, str]]:
    """The user's ``search dcs BASE --target-flops T --epochs 4`` (``--max-val-drop 100``: run to the end)
    on ``a``'s images and seed, into ``out`` (``amp``: its ``--amp``; None: the default), and the
    environment to run it in (plain progress lines)."""
    cmd = [
        sys.executable,
        "-m",
        "nascompress.cli.main",
        "search",
        "dcs",
        base,
        "--target-flops",
        str(target),
        "--epochs",
        "4",
        "--train-limit",
        str(a.train_limit),
        "--eval-limit",
        str(a.eval_limit),
        "--seed",
        str(a.seed),
        "--max-val-drop",
        "100",
        "--out",
        str(out),
        *(["--amp", amp] if amp else []),
    ]
    return cmd, dict(os.environ, NASCOMPRESS_PROGRESS="plain", PYTHONPATH=str(ROOT))


def run_user_search(base: str, target: float, a: argparse.Namespace, out: Path, options: list[str]) -> Path:
    """:func:`user_command` plus ``options``, run into ``out`` (``a.threads``: its OMP_NUM_THREADS) unless
    ``out`` holds a finished search; an interrupted one is resumed."""
    m = out / "metrics.json"
    if m.is_file() and read_json(m).get("finished") is True:
        return out
    cmd, env = user_command(base, target, a, out)
    cmd += options + (["--resume"] if (out / "checkpoint.safetensors").is_file() else ["--force"])
    if a.threads:
        env["OMP_NUM_THREADS"] = str(a.threads)
    subprocess.run(cmd, check=True, env=env, cwd=ROOT)
    return out


# The timed training step of bench/tool_speed.py and bench/compile_step.py

RECIPES = {  # the model and batch of each recipe's training step
    "main": {
        "spec": dict(img_size=28, patch_size=4, embed_dim=96, depth=6, num_heads=3, in_chans=1, num_classes=10),
        "batch": 128,
    },
    "dinov2": {"timm": "vit_small_patch14_dinov2", "kwargs": dict(img_size=112, num_classes=10), "batch": 16},
}


def load() -> float:
    """The 1-minute load average now."""
    return round(os.getloadavg()[0], 2)


def build(recipe: str) -> tuple[Any, Any]:
    """The model and input batch of a timed recipe (:data:`RECIPES`: the main job's base, DINOv2-S)."""
    r = RECIPES[recipe]
    if "spec" in r:
        model = build_model(custom_vit_spec(**r["spec"]))
        x = torch.randn(r["batch"], r["spec"]["in_chans"], r["spec"]["img_size"], r["spec"]["img_size"])
    else:
        model = timm.create_model(r["timm"], pretrained=False, **r["kwargs"])
        x = torch.randn(r["batch"], 3, r["kwargs"]["img_size"], r["kwargs"]["img_size"])
    return model, x


PRECISIONS = {  # name -> (amp, the attention path): "auto" is what `--amp auto` runs on this machine
    "fp32": "off",
    "bf16": "bf16",
    "bf16_flash_attention": "bf16-flash",
}


def train_step(model: Any, x: Any, y: Any, opt: Any, amp: str, dev: Any = None) -> None:
    """The loop's step (:func:`nascompress.train.loop.fit`): CE with label smoothing under the run's
    autocast and attention path (``bf16-flash``: bf16 autocast with SDPA's fused kernel kept), clip, AdamW;
    on ``dev`` (default the CPU; model, batch and optimizer already there)."""
    dev = dev or torch.device("cpu")
    attn = contextlib.nullcontext() if amp == "bf16-flash" else runtime.cpu_attention(model, dev, amp)
    with attn:
        with record_function("forward"), runtime.autocast(dev, amp.split("-")[0]):
            loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
        with record_function("backward"):
            opt.zero_grad(set_to_none=True)
            loss.backward()
        with record_function("optimizer"):
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], 1.0)
            opt.step()
