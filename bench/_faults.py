"""The fault table's machinery, shared by ``bench/faults.py`` and its issue-53 cases
(``bench/_faults_r53.py``): the tiny settings (``TINY``, ``SPACE``, ``PIPELINE``, ``STUDY``), a case's
record (``Case``) and a command's (``Ran``), running a command with its peak memory
(``run_measured``), the table that runs the cases (``Table``), and judging a result (``error_line``,
``judge_refusal``, ``finished_outputs``, ``snapshot``, ``digest``, ``tensors_equal``, ``study_trials``,
``complete``)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file

from _common import ROOT
from nascompress.runs.io import run_state

PY = sys.executable
ENV = dict(
    os.environ,
    PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    PYTHONWARNINGS="ignore",
    COLUMNS="200",
    OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
)
TINY = [
    "--dataset",
    "synthetic",
    "--img-size",
    "16",
    "--patch-size",
    "4",
    "--embed-dim",
    "32",
    "--depth",
    "2",
    "--num-heads",
    "2",
    "--batch-size",
    "32",
    "--device",
    "cpu",
    "--seed",
    "0",
]
SPACE = """format: nascompress-space/1
name: tiny-evit
methods:
  - name: evit
    params:
      prune_layers: {kind: layers, range: [1, 2], size: [1, 2]}
      keep_rate: {kind: per_layer, layers: prune_layers, value: {kind: float, low: 0.3, high: 1.0, step: 0.1}}
"""
PIPELINE = """format: nascompress-pipeline/1
seed: 0
device: cpu
data: {dataset: synthetic}
base:
  train: {img_size: 16, patch_size: 4, embed_dim: 32, depth: 2, num_heads: 2, in_chans: 1, epochs: 2,
    batch_size: 32, lr: 0.002}
goal: {max_flops: 0.75}
stages:
  dcs: {target_flops: 0.85, epochs: 2, batch_size: 32, alpha_init: 0.5, base_lr: 0.001, arch_lr: 0.15}
  tokens: {space: space.yaml, trials: 4, eval_images: 60, train_images: 60, calib_steps: 3, batch_size: 30}
  retrain: {epochs: 2, eta: 0, batch_size: 32}
report: {iters: 2, batch_size: 8}
"""
STUDY = [
    "--space",
    "space.yaml",
    "--train-images",
    "60",
    "--eval-images",
    "60",
    "--batch-size",
    "30",
    "--calib-steps",
    "2",
    "--device",
    "cpu",
    "--seed",
    "0",
]
# a CLI run whose SQLite connections hold at most NASCOMPRESS_FAULTS_PAGES pages (a full disk, simulated)
SMALL_SQLITE = (
    "import os, sys\nfrom sqlalchemy import event\nfrom sqlalchemy.engine import Engine\n"
    "@event.listens_for(Engine, 'connect')\ndef _small(c, _r):\n"
    "    c.execute('PRAGMA max_page_count = ' + os.environ['NASCOMPRESS_FAULTS_PAGES'])\n"
    "from nascompress.cli.main import app\nsys.argv = ['nascompress'] + sys.argv[1:]\napp()\n"
)
RAW_NAME = re.compile(r"\b[A-Z][A-Za-z]*(Error|Exception)\b|Errno|Traceback")


@dataclass
class Case:
    name: str
    category: str
    command: str
    expected: str
    outcome: str = "wrong"
    exit_code: int | None = None
    error_line: str | None = None
    partial_outputs: list[str] = field(default_factory=list)
    data_lost: bool = False
    how: str = "real"
    seconds: float = 0.0
    peak_rss_mb: float | None = None
    note: str = ""


@dataclass
class Ran:
    rc: int
    out: str
    err: str
    peak_rss_mb: float = 0.0
    timed_out: bool = False


# Starts a command from a small process and records its peak resident memory: a process's maxrss
# counts the memory of the process it was forked from (Linux carries it across exec), so the
# command is forked from this launcher (~10 MB), not from the bench (hundreds of MB).
LAUNCH = (
    "import os, signal, sys\npid = os.fork()\nif pid == 0:\n    os.execv(sys.argv[2], sys.argv[2:])\n"
    "_, status, usage = os.wait4(pid, 0)\nwith open(sys.argv[1], 'w') as f:\n    f.write(str(usage.ru_maxrss))\n"
    "code = os.waitstatus_to_exitcode(status)\nif code < 0:\n    os.kill(os.getpid(), -code)\nsys.exit(code)\n"
)


def run_measured(cmd: list[str], *, cwd: Path, env: dict[str, str], timeout: float) -> Ran:
    """Run ``cmd``; its exit code, output, peak resident memory (its maxrss, see LAUNCH) and
    whether it was killed at ``timeout`` seconds (a hang)."""
    with (
        tempfile.TemporaryFile("w+") as fo,
        tempfile.TemporaryFile("w+") as fe,
        tempfile.NamedTemporaryFile("r", suffix=".rss") as rss,
    ):
        p = subprocess.Popen(
            [PY, "-W", "ignore", "-c", LAUNCH, rss.name, *cmd],
            cwd=cwd,
            env=env,
            stdout=fo,
            stderr=fe,
            text=True,
            start_new_session=True,
        )
        hung = threading.Event()

        def kill() -> None:
            hung.set()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)

        timer = threading.Timer(timeout, kill)
        timer.start()
        try:
            p.wait()
        finally:
            timer.cancel()
        fo.seek(0)
        fe.seek(0)
        peak = rss.read().strip()
        return Ran(p.returncode, fo.read(), fe.read(), round(int(peak) / 1024, 1) if peak else 0.0, hung.is_set())


class Table:
    def __init__(self, work: Path, only: str | None, *, mount: bool = True) -> None:
        self.work, self.only, self.cases = work, only, []
        self.mounts: list[Path] = []
        self.can_mount = mount and self._try_mount()

    # -- running commands ----------------------------------------------------------------------
    def nc(
        self,
        args: list[Any],
        cwd: Path,
        *,
        timeout: float = 300,
        env: dict[str, str] | None = None,
        small_sqlite: int | None = None,
    ) -> Ran:
        cmd = [PY, "-c", SMALL_SQLITE] if small_sqlite is not None else [PY, "-m", "nascompress.cli.main"]
        e = dict(ENV, **(env or {}))
        if small_sqlite is not None:
            e["NASCOMPRESS_FAULTS_PAGES"] = str(small_sqlite)
        return run_measured(cmd + [str(a) for a in args], cwd=cwd, env=e, timeout=timeout)

    def kill_when(self, args: list[Any], cwd: Path, ready: Callable[[], bool], *, timeout: float = 300) -> bool:
        """Start the command, SIGKILL it as soon as ``ready()``; False if it ended before."""
        p = subprocess.Popen(
            [PY, "-m", "nascompress.cli.main", *map(str, args)],
            cwd=cwd,
            env=ENV,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        end = time.time() + timeout
        try:
            while p.poll() is None and time.time() < end:
                if ready():
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
                    return True
                time.sleep(0.05)
            return False
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    def scrub(self, text: str, d: Path) -> str:
        """No machine path in the results: the case's folder is '.', the scratch folder <work>."""
        return text.replace(str(d) + "/", "").replace(str(d), ".").replace(str(self.work), "<work>")

    # -- shared runs -----------------------------------------------------------------------------
    def base_run(self) -> Path:
        """A tiny dense run (one epoch) every search starts from (made once)."""
        b = self.work / "shared-base"
        if not (b / "metrics.json").is_file():
            shutil.rmtree(b, ignore_errors=True)
            r = self.nc(["train", "--out", b, "--epochs", "1", *TINY], self.work)
            assert r.rc == 0, r.err[-2000:]
        return b

    def command(self, kind: str) -> list[Any]:
        """The killed commands (run in a case's folder): train, search (dcs), study (tokens), pipeline."""
        base = self.base_run() if kind in ("search", "study") else None
        return {
            "train": ["train", "--out", "run", "--epochs", "3", *TINY],
            # (the one-epoch tiny base loses accuracy when the search really cuts it to 0.8x: this case
            # checks the resume, so the accuracy stop is off)
            "search": [
                "search",
                "dcs",
                base,
                "--out",
                "run",
                "--epochs",
                "3",
                "--target-flops",
                "0.8",
                "--batch-size",
                "32",
                "--device",
                "cpu",
                "--max-val-drop",
                "100",
            ],
            "study": [
                "search",
                "tokens",
                base,
                "--study",
                "s",
                "--storage",
                "sqlite:///s.db",
                "--trials",
                "12",
                *STUDY,
            ],
            "pipeline": ["pipeline", "p.yaml", "--out", "run"],
        }[kind]

    def reference(self, kind: str) -> Path:
        """An uninterrupted run of each killed command (made once): train, search, study, pipeline."""
        d = self.work / f"reference-{kind}"
        if (d / "finished").is_file():
            return d
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        (d / "space.yaml").write_text(SPACE)
        (d / "p.yaml").write_text(PIPELINE)
        r = self.nc(self.command(kind), d, timeout=600)
        assert r.rc == 0, r.err[-2000:]
        (d / "finished").touch()
        return d

    # -- mounts ----------------------------------------------------------------------------------
    def _try_mount(self) -> bool:
        probe = self.work / ".mount-probe"
        probe.mkdir(parents=True, exist_ok=True)
        ok = (
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(probe)], capture_output=True
            ).returncode
            == 0
        )
        if ok:
            subprocess.run(["umount", str(probe)], capture_output=True)
        probe.rmdir()
        return ok

    def tmpfs(self, d: Path, *, size: str, ro: bool = False) -> None:
        d.mkdir(parents=True, exist_ok=True)
        opts = f"size={size}" + (",ro" if ro else "")
        subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(d)], check=True)
        self.mounts.append(d)

    def grow(self, d: Path) -> None:
        """Free space: the tmpfs at ``d`` grows to 64 MiB (its files stay)."""
        subprocess.run(["mount", "-o", "remount,size=64m", str(d)], check=True)

    def read_only(self, d: Path) -> None:
        """Remount the existing folder ``d`` read-only (a bind mount on itself)."""
        subprocess.run(["mount", "--bind", str(d), str(d)], check=True)
        self.mounts.append(d)
        subprocess.run(["mount", "-o", "remount,ro,bind", str(d)], check=True)

    def unmount_all(self) -> None:
        for d in reversed(self.mounts):
            subprocess.run(["umount", str(d)], capture_output=True)
        self.mounts = []

    # -- cases -----------------------------------------------------------------------------------
    def case(self, name: str, category: str, expected: str) -> Callable[[Callable[[Case, Path], None]], None]:
        def run(fn: Callable[[Case, Path], None]) -> None:
            if self.only and not any(o in name or o in category for o in self.only.split(",")):
                return
            d = self.work / name
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True)
            (d / "space.yaml").write_text(SPACE)
            c = Case(name=name, category=category, command="", expected=expected)
            t0 = time.perf_counter()
            try:
                fn(c, d)
            except Exception as e:  # the bench itself failed: record it, go on
                c.outcome, c.note = "bench failure", f"{type(e).__name__}: {e}"
            finally:
                self.unmount_all()
            c.seconds = round(time.perf_counter() - t0, 1)
            c.command, c.error_line, c.note = (
                None if x is None else self.scrub(x, d) for x in (c.command, c.error_line, c.note)
            )
            self.cases.append(c)
            print(
                f"{name:38s} {c.outcome:20s} rc={c.exit_code} {c.seconds:6.1f}s  {c.error_line or c.note}", flush=True
            )

        return run


# ----------------------------------------------------------------------------------------------
# Judging a result


def error_line(r: Ran) -> str | None:
    lines = [ln for ln in r.err.splitlines() if ln.startswith("error:")]
    return lines[-1] if lines else (r.err.strip().splitlines() or [None])[-1]


def judge_refusal(c: Case, r: Ran, must: str = "", *, one_line: bool = False) -> None:
    """``one_line``: stderr must hold nothing but the error line (no warning printed before it)."""
    c.exit_code, c.error_line, c.peak_rss_mb = r.rc, error_line(r), r.peak_rss_mb
    if r.timed_out:
        c.outcome = "hang"
        return
    errs = [ln for ln in r.err.splitlines() if ln.startswith("error:")]
    clean = (
        r.rc != 0
        and len(errs) == 1
        and "Traceback" not in r.err
        and not RAW_NAME.search(errs[0])
        and must.lower() in errs[0].lower()
        and not (one_line and len(r.err.strip().splitlines()) != 1)
    )
    c.outcome = "clean refusal" if clean else ("raw error" if r.rc != 0 else "wrong")


def finished_outputs(root: Path, before: set[str]) -> list[str]:
    """Files and run directories under ``root`` that are new since ``before`` and that a reader
    accepts as finished (a run whose mark says complete, a plain model directory, any other file)."""
    found = []
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if rel in before or p.name.startswith(".") or any(part.startswith(".") for part in p.relative_to(root).parts):
            continue
        if p.is_dir() and (p / "model.safetensors").is_file():
            if run_state(p) in ("complete", "plain"):
                found.append(rel + "/")
        elif p.is_file() and p.suffix in (".csv", ".html", ".onnx", ".pt2") and p.stat().st_size > 0:
            found.append(rel)
    return found


def snapshot(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""


def tensors_equal(a: Path, b: Path) -> bool:
    if not (a.is_file() and b.is_file()):
        return False
    x, y = load_file(str(a)), load_file(str(b))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def study_trials(db: Path, name: str) -> list[tuple]:
    """(number, state, params, values) of every trial, straight from the SQLite file."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        row = con.execute("select study_id from studies where study_name=?", (name,)).fetchone()
        if row is None:
            return []
        sid = row[0]
        rows = con.execute(
            "select trial_id, number, state from trials where study_id=? order by number", (sid,)
        ).fetchall()
        out = []
        for tid, num, state in rows:
            params = sorted(
                con.execute("select param_name, param_value from trial_params where trial_id=?", (tid,)).fetchall()
            )
            values = [
                v for (v,) in con.execute("select value from trial_values where trial_id=? order by objective", (tid,))
            ]
            out.append((num, state, params, values))
        return out
    finally:
        con.close()


def complete(trials: list[tuple]) -> list[tuple]:
    return [t for t in trials if t[1] == "COMPLETE"]
