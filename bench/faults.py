"""The fault table: kill -9 in every stage and bad inputs, tried as a user would, with the CLI.

Each case runs ``nascompress`` commands in a subprocess (tiny models, the synthetic dataset or tiny
ImageFolders of random PNGs, so the whole table takes a few minutes on 2 cores) and records:
name, category, command, expected, outcome, exit code, the error line, the partial outputs left
(run directories or files a reader would accept as finished although the command failed) and
whether data was lost (work finished before the fault that is gone or changed after it).

Hostile inputs (issue 37): dataset symlink loops, hidden and linked class folders, a huge image,
an ``arch.json`` asking for a huge model, NaN weights, a forged completion mark, out-of-range and
deeply nested pipeline files, a pickle as weights, the dashboard's bind address and write API,
the trial budget of two workers, full disks during export, and the model file's identity across
output folders. Every command runs with a time limit (a command that does not end is a ``hang``)
and records its peak memory (``peak_rss_mb``, the process's maximum resident set); a case above
twice the peak of an ordinary ``evaluate`` of the tiny model is a memory blow-up.

Outcomes: ``clean refusal`` (non-zero exit, one ``error:`` line naming the problem, no traceback
and no bare exception name), ``raw error`` (non-zero exit otherwise), ``hang`` (no end within the
case's time limit), ``resumed identical`` (killed
with SIGKILL, rerun with the same command: the same weights / trials as an uninterrupted run),
``resumed different``, ``recovered`` (a leftover of a killed process handled at once), ``accepted``
(an input the tool should take), ``wrong`` (anything else).

Read-only and full disks are real where the machine allows it (``mount -t tmpfs``, needs root):
a tiny tmpfs, and read-only tmpfs / bind mounts. Where it does not, full-disk cases of the study
storage use SQLite's ``max_page_count`` (a real "database or disk is full"), and the others are
recorded as not run. Each case records ``how``.

Usage (from the repository root)::

    python bench/faults.py                       # writes bench/results/faults.json
    python bench/faults.py --only pipeline --keep --work /some/scratch
    # the hostile-input cases only (bench/results/faults_hostile.json):
    python bench/faults.py --only "hostile,open door,trial budget,full-disk-export,model identity,full-disk-train" \
        --out bench/results/faults_hostile.json
    # the cases of issue 53 (bench/_faults_r53.py) only:
    python bench/faults.py --only r53- --out bench/results/faults_r53.json
    # the cases of issue 64 (bench/_faults_r64.py: --force and the Python API never delete the user's files) only:
    python bench/faults.py --only r64- --out bench/results/faults_r64.json
"""

from __future__ import annotations

import argparse
import http.client
import io
import json
import os
import pickle
import re
import shutil
import signal
import socket
import sqlite3
import subprocess
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

import numpy as np
import optuna
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from _common import ROOT, header, save
from _faults import (
    ENV,
    PIPELINE,
    PY,
    STUDY,
    TINY,
    Case,
    Ran,
    Table,
    complete,
    digest,
    error_line,
    finished_outputs,
    judge_refusal,
    snapshot,
    study_trials,
    tensors_equal,
)
from _faults_r53 import round53_cases
from _faults_r64 import after_write_failure, round64_cases

# ----------------------------------------------------------------------------------------------
# The cases


def kill_cases(t: Table) -> None:
    reference = t.reference

    for kind, name, shown in (
        ("train", "kill-train-mid-epoch", "train --out run --epochs 3 (tiny ViT)"),
        ("search", "kill-search-dcs-mid-epoch", "search dcs BASE --out run --epochs 3 --target-flops 0.8"),
    ):

        @t.case(name, "kill -9", "rerun with --resume gives the uninterrupted run's weights")
        def _(c: Case, d: Path, kind: str = kind, shown: str = shown) -> None:
            cmd = t.command(kind)
            c.command = f"nascompress {shown}  (kill -9 after epoch 1's checkpoint; rerun with --resume)"
            killed = t.kill_when(cmd, d, lambda: (d / "run" / "checkpoint.safetensors").is_file())
            r = t.nc(cmd + ["--resume"], d)
            c.exit_code, c.error_line = r.rc, error_line(r) if r.rc else None
            same = tensors_equal(d / "run" / "model.safetensors", reference(kind) / "run" / "model.safetensors")
            c.outcome = "resumed identical" if killed and r.rc == 0 and same else "resumed different"
            c.data_lost = r.rc != 0

    @t.case("kill-study-mid-trial", "kill -9", "the same command continues the same sequence of trials")
    def _(c: Case, d: Path) -> None:
        cmd = t.command("study")
        c.command = "nascompress search tokens BASE --study s --trials 12 ...  (kill -9 after 3 trials; rerun)"

        def three_done() -> bool:
            try:
                return len(complete(study_trials(d / "s.db", "s"))) >= 3
            except Exception:  # noqa: BLE001 (not created yet)
                return False

        killed = t.kill_when(cmd, d, three_done)
        before = complete(study_trials(d / "s.db", "s"))
        r = t.nc(cmd, d)
        c.exit_code, c.error_line = r.rc, error_line(r) if r.rc else None
        after = complete(study_trials(d / "s.db", "s"))
        want = complete(study_trials(reference("study") / "s.db", "s"))
        strip = lambda ts: [(p, [round(v, 9) for v in vals]) for _, _, p, vals in ts]  # noqa: E731
        c.outcome = "resumed identical" if killed and r.rc == 0 and strip(after) == strip(want) else "resumed different"
        c.data_lost = not set(map(str, strip(before))) <= set(map(str, strip(after)))
        c.note = f"{len(before)} trials complete at the kill"

    stages = [
        ("base", lambda o: (o / "base" / "checkpoint.safetensors").is_file()),
        ("dcs-search", lambda o: (o / "dcs_search" / "checkpoint.safetensors").is_file()),
        ("token-study", lambda o: (o / "studies.db").is_file() and _n_complete(o / "studies.db") >= 2),
        ("retrain", lambda o: (o / "final" / "checkpoint.safetensors").is_file()),
        ("report", lambda o: (o / "done" / "retrain.json").is_file()),
    ]
    for stage, ready in stages:

        @t.case(f"kill-pipeline-{stage}", "kill -9", "rerunning the same command gives the uninterrupted result")
        def _(c: Case, d: Path, ready: Callable[[Path], bool] = ready, stage: str = stage) -> None:
            (d / "p.yaml").write_text(PIPELINE)
            cmd = t.command("pipeline")
            c.command = f"nascompress pipeline p.yaml --out run  (kill -9 during {stage}; rerun)"
            killed = t.kill_when(cmd, d, lambda: ready(d / "run"))
            done_before = {p.name: digest(p) for p in (d / "run" / "done").glob("*.json")} if killed else {}
            t0 = time.perf_counter()
            r = t.nc(cmd, d, timeout=600)
            rerun_s = time.perf_counter() - t0
            c.exit_code, c.error_line = r.rc, error_line(r) if r.rc else None
            want = reference("pipeline") / "run"
            same = tensors_equal(d / "run" / "final" / "model.safetensors", want / "final" / "model.safetensors")
            if same:
                s1, s2 = (json.loads((x / "summary.json").read_text()) for x in (d / "run", want))
                same = (s1["final"]["test_top1"], s1["comparison"]["flops_ratio"]) == (
                    s2["final"]["test_top1"],
                    s2["comparison"]["flops_ratio"],
                )
            c.outcome = "resumed identical" if killed and r.rc == 0 and same else "resumed different"
            c.data_lost = any(digest(d / "run" / "done" / n) != h for n, h in done_before.items())
            c.note = f"the rerun took {rerun_s:.1f} s" if killed else "the run ended before the kill point"


def _n_complete(db: Path) -> int:
    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            return con.execute("select count(*) from trials where state='COMPLETE'").fetchone()[0]
        finally:
            con.close()
    except sqlite3.Error:
        return 0


def bad_input_cases(t: Table) -> None:
    def refusal(
        name: str,
        category: str,
        expected: str,
        args: list[Any],
        *,
        prepare: Callable[[Path], None],
        must: str = "",
        out: str | None = None,
    ) -> None:
        @t.case(name, category, expected)
        def _(c: Case, d: Path) -> None:
            prepare(d)
            before = snapshot(d)
            c.command = "nascompress " + " ".join(map(str, args))
            r = t.nc(args, d)
            judge_refusal(c, r, must)
            c.partial_outputs = finished_outputs(d, before)
            if out is not None and (d / out).exists() and out not in before:
                c.partial_outputs.append(out + " (created)")

    def yaml_cfg(text: str) -> Callable[[Path], None]:
        return lambda d: (d / "p.yaml").write_text(text)

    for name, text, must in (
        ("yaml-syntax-error", PIPELINE.replace("seed: 0", "seed: [0"), "p.yaml"),
        ("yaml-unknown-key", PIPELINE.replace("seed: 0", "seed: 0\nsed: 1"), "sed"),
        ("yaml-wrong-type", PIPELINE.replace("trials: 4", "trials: four"), "trials"),
        ("yaml-not-a-mapping", "- just\n- a list\n", "p.yaml"),
        ("yaml-empty", "", "p.yaml"),
    ):
        refusal(
            f"config-{name}",
            "broken config",
            "one line naming the file and key; nothing written",
            ["pipeline", "p.yaml", "--out", "run"],
            prepare=yaml_cfg(text),
            must=must,
            out="run",
        )

    def run_with(mutate: Callable[[Path], None]) -> Callable[[Path], None]:
        def prep(d: Path) -> None:
            shutil.copytree(t.base_run(), d / "run")
            mutate(d / "run")

        return prep

    def truncate(p: Path) -> None:
        (p / "model.safetensors").write_bytes((p / "model.safetensors").read_bytes()[:5000])

    def garbage_header(p: Path) -> None:
        b = bytearray((p / "model.safetensors").read_bytes())
        b[8:40] = b"\xff" * 32
        (p / "model.safetensors").write_bytes(bytes(b))

    refusal(
        "truncated-safetensors",
        "corrupt file",
        "one line: the file is corrupt",
        ["evaluate", "run", "--dataset", "synthetic", "--device", "cpu"],
        prepare=run_with(truncate),
        must="run",
    )
    refusal(
        "corrupt-safetensors-header",
        "corrupt file",
        "one line: the file is corrupt",
        ["evaluate", "run", "--dataset", "synthetic", "--device", "cpu"],
        prepare=run_with(garbage_header),
        must="run",
    )
    refusal(
        "text-file-as-weights",
        "corrupt file",
        "one line: not a weights file",
        ["train", "--out", "new", "--weights", "notes.txt", "--epochs", "1", *TINY],
        prepare=lambda d: (d / "notes.txt").write_text("hello\n"),
        must="notes.txt",
        out="new",
    )
    refusal(
        "truncated-weights-pth",
        "corrupt file",
        "one line: not a complete weights file",
        ["train", "--out", "new", "--weights", "w.pth", "--epochs", "1", *TINY],
        prepare=lambda d: (d / "w.pth").write_bytes(_pth_bytes()[:700]),
        must="w.pth",
        out="new",
    )

    def arch_kw(key: str, value: Any) -> Callable[[Path], None]:
        def mutate(p: Path) -> None:
            (p.parent / "notes.txt").write_text("not weights\n")
            a = json.loads((p / "arch.json").read_text())
            a["model"]["kwargs"][key] = value
            (p / "arch.json").write_text(json.dumps(a))
            # a hand-made model arrives as a plain model directory (model.safetensors + arch.json): a
            # finished run's edited arch.json is refused by its completion mark before the key is read
            for f in p.iterdir():
                if f.name not in ("model.safetensors", "arch.json"):
                    shutil.rmtree(f) if f.is_dir() else f.unlink()

        return run_with(mutate)

    for key, value in (
        ("checkpoint_path", "../notes.txt"),
        ("pretrained_cfg_overlay", {"file": "x.bin"}),
        ("act_layer", "os.system"),
        ("global_pool", "os.system"),
    ):
        refusal(
            f"arch-json-{key}",
            "malicious arch.json",
            "one line naming the key; no file opened",
            ["evaluate", "run", "--dataset", "synthetic", "--device", "cpu"],
            prepare=arch_kw(key, value),
            must=key,
        )

    def folder(classes: dict[str, dict[str, int]], corrupt: bool = False) -> Callable[[Path], None]:
        def prep(d: Path) -> None:
            rng = np.random.default_rng(0)
            for split, counts in classes.items():
                for cls, n in counts.items():
                    (d / "imgs" / split / cls).mkdir(parents=True, exist_ok=True)
                    for i in range(n):
                        Image.fromarray(rng.integers(0, 255, (16, 16), dtype=np.uint8)).save(
                            d / "imgs" / split / cls / f"{i}.png"
                        )
            if corrupt:
                p = d / "imgs" / "train" / "a" / "0.png"
                p.write_bytes(p.read_bytes()[:60])

        return prep

    fold = [
        "--dataset",
        "imgs",
        "--img-size",
        "16",
        "--patch-size",
        "4",
        "--embed-dim",
        "32",
        "--depth",
        "1",
        "--num-heads",
        "2",
        "--epochs",
        "1",
        "--batch-size",
        "16",
        "--device",
        "cpu",
        "--num-workers",
        "0",
    ]
    refusal(
        "imagefolder-corrupt-png",
        "bad dataset",
        "one line naming the image; nothing written",
        ["train", "--out", "new", *fold],
        prepare=folder({"train": {"a": 12, "b": 12}}, corrupt=True),
        must="0.png",
        out="new",
    )
    refusal(
        "imagefolder-one-class",
        "bad dataset",
        "one line: fewer than two classes; nothing written",
        ["train", "--out", "new", *fold],
        prepare=folder({"train": {"a": 12}}),
        must="class",
        out="new",
    )
    refusal(
        "imagefolder-empty-class-in-val",
        "bad dataset",
        "one line naming the class and split",
        ["train", "--out", "new", *fold],
        prepare=folder({"train": {"a": 12, "b": 12}, "val": {"a": 4, "b": 0}}),
        must="val",
        out="new",
    )

    @t.case("imagefolder-corrupt-png-skipped", "bad dataset", "--skip-bad-images trains, counting the skipped image")
    def _(c: Case, d: Path) -> None:
        folder({"train": {"a": 12, "b": 12}}, corrupt=True)(d)
        args = ["train", "--out", "new", *fold, "--skip-bad-images"]
        c.command = "nascompress " + " ".join(args)
        r = t.nc(args, d)
        c.exit_code = r.rc
        c.outcome = "accepted" if r.rc == 0 and "skip" in (r.out + r.err).lower() else "wrong"
        c.error_line = error_line(r) if r.rc else None


def _pth_bytes() -> bytes:
    buf = io.BytesIO()
    torch.save({"w": torch.zeros(2000)}, buf)
    return buf.getvalue()


def disk_cases(t: Table) -> None:
    base = t.base_run()

    def needs_mount(c: Case) -> bool:
        if not t.can_mount:
            c.outcome, c.how = "not run", "no tmpfs (mount not permitted here, or --no-mount)"
        return t.can_mount

    @t.case("read-only-train-out", "read-only output", "one line: the output is not writable; nothing written")
    def _(c: Case, d: Path) -> None:
        if needs_mount(c):
            t.tmpfs(d / "ro", size="1m", ro=True)
            c.how = "read-only tmpfs"
            args = ["train", "--out", "ro/run", "--epochs", "1", *TINY]
            c.command = "nascompress " + " ".join(args)
            judge_refusal(c, t.nc(args, d), "ro/run")

    @t.case("read-only-study-export", "read-only output", "one line naming the file; nothing written")
    def _(c: Case, d: Path) -> None:
        if needs_mount(c):
            shutil.copy(t.reference("study") / "s.db", d / "s.db")
            t.tmpfs(d / "ro", size="1m", ro=True)
            c.how = "read-only tmpfs"
            for fmt in ("csv", "json"):
                args = ["study", "export", "s", "--storage", "sqlite:///s.db", "--out", f"ro/s.{fmt}", "--format", fmt]
                c.command = "nascompress " + " ".join(args)
                judge_refusal(c, t.nc(args, d), f"ro/s.{fmt}")
                if c.outcome != "clean refusal":
                    break

    @t.case("read-only-pipeline-resume", "read-only output", "one line: the pipeline folder is read-only")
    def _(c: Case, d: Path) -> None:
        if needs_mount(c):
            (d / "p.yaml").write_text(PIPELINE)
            shutil.copytree(t.reference("pipeline") / "run", d / "run")
            (d / "run" / "done" / "report.json").unlink(missing_ok=True)
            before = {p: digest(p) for p in (d / "run").rglob("*") if p.is_file()}
            t.read_only(d / "run")
            c.how = "read-only bind mount"
            args = ["pipeline", "p.yaml", "--out", "run"]
            c.command = "nascompress " + " ".join(args) + "  (an unfinished pipeline in a read-only folder)"
            judge_refusal(c, t.nc(args, d), "read-only")
            t.unmount_all()
            c.data_lost = any(digest(p) != h for p, h in before.items())

    @t.case(
        "full-disk-train",
        "full disk",
        "one line: no space left; no run that looks finished: the unfinished run removed (then a plain rerun) or "
        "kept with its checkpoint (then --resume), which with more space gives the uninterrupted run's weights",
    )
    def _(c: Case, d: Path) -> None:
        if needs_mount(c):
            t.tmpfs(d / "small", size="96k")
            c.how = "tmpfs of 96 KiB"
            args = ["train", "--out", "small/run", "--epochs", "3", *TINY]
            c.command = "nascompress " + " ".join(args) + "  (then: more space, the rerun the message advises)"
            judge_refusal(c, t.nc(args, d), "no space")
            c.partial_outputs = finished_outputs(d, set())

            def rerun(resume: bool) -> Ran:
                t.grow(d / "small")
                return t.nc(args + (["--resume"] if resume else []), d)

            # the advice must be what finishes the run: a plain rerun where the run was removed, --resume
            # where it was kept (a plain rerun refuses that folder)
            after_write_failure(c, d / "small" / "run", rerun, t.reference("train") / "run" / "model.safetensors")

    @t.case("full-disk-pipeline", "full disk", "one line: no space left; the finished steps kept")
    def _(c: Case, d: Path) -> None:
        if needs_mount(c):
            (d / "p.yaml").write_text(PIPELINE)
            t.tmpfs(d / "small", size="1200k")
            c.how = "tmpfs of 1200 KiB"
            args = ["pipeline", "p.yaml", "--out", "small/run"]
            c.command = "nascompress " + " ".join(args) + "  (then: more space, the same command)"
            judge_refusal(c, t.nc(args, d, timeout=600), "no space")
            c.partial_outputs = [p for p in finished_outputs(d, set()) if not (d / p / "metrics.json").is_file()]
            done = {p.name: digest(p) for p in (d / "small" / "run" / "done").glob("*.json")}
            t.grow(d / "small")
            r = t.nc(args, d, timeout=600)
            want = t.reference("pipeline") / "run" / "final" / "model.safetensors"
            same = tensors_equal(d / "small" / "run" / "final" / "model.safetensors", want)
            c.data_lost = any(digest(d / "small" / "run" / "done" / n) != h for n, h in done.items())
            c.note = f"{len(done)} steps done when the disk filled; with more space the same command " + (
                "finished with the uninterrupted run's final weights"
                if r.rc == 0 and same
                else f"ended with exit code {r.rc}, same weights: {same}"
            )

    @t.case(
        "full-disk-study-storage",
        "full disk",
        "one line: the storage is full; moved to a bigger disk, the same command continues the same trials",
    )
    def _(c: Case, d: Path) -> None:
        ref_db = t.reference("study") / "s.db"
        cmd = ["search", "tokens", str(base), "--study", "s", "--trials", "12", *STUDY]
        pages = None
        if t.can_mount:
            t.tmpfs(d / "small", size="136k")
            c.how = "tmpfs of 136 KiB"
            db = d / "small" / "s.db"
        else:
            c.how = "simulated: SQLite max_page_count"
            db = d / "s.db"
            pages = 29
        args = cmd + ["--storage", f"sqlite:///{db.relative_to(d)}"]
        c.command = (
            "nascompress search tokens BASE --study s --trials 12 ... --storage sqlite:///"
            f"{db.relative_to(d)}  (then: more space, the same command)"
        )
        judge_refusal(c, t.nc(args, d, small_sqlite=pages), "no space")
        before = complete(study_trials(db, "s"))
        if t.can_mount:
            t.grow(d / "small")
        r = t.nc(args, d)  # the same command, with room
        after, want = complete(study_trials(db, "s")), complete(study_trials(ref_db, "s"))
        strip = lambda ts: [(p, [round(v, 9) for v in vals]) for _, _, p, vals in ts]  # noqa: E731
        c.data_lost = not set(map(str, strip(before))) <= set(map(str, strip(after)))
        c.note = f"{len(before)} trials complete when the disk filled; with more space the same command " + (
            "gave the uninterrupted study's trials"
            if r.rc == 0 and strip(after) == strip(want)
            else "differed from the uninterrupted study"
        )

    @t.case("read-only-study-storage", "unwritable study storage", "one line: the storage cannot be written")
    def _(c: Case, d: Path) -> None:
        if needs_mount(c):
            (d / "st").mkdir()
            shutil.copy(t.reference("study") / "s.db", d / "st" / "s.db")
            before = digest(d / "st" / "s.db")
            t.read_only(d / "st")
            c.how = "read-only bind mount"
            args = [
                "search",
                "tokens",
                str(base),
                "--study",
                "s",
                "--trials",
                "8",
                *STUDY,
                "--storage",
                "sqlite:///st/s.db",
            ]
            c.command = "nascompress search tokens BASE --study s --trials 8 ... --storage sqlite:///st/s.db"
            judge_refusal(c, t.nc(args, d), "st/s.db")
            t.unmount_all()
            c.data_lost = digest(d / "st" / "s.db") != before


def leftover_cases(t: Table) -> None:
    base = t.base_run()

    @t.case("stale-journal-lock", "leftover of kill -9", "the lock of a dead writer is recovered at once")
    def _(c: Case, d: Path) -> None:
        cmd = ["search", "tokens", str(base), "--study", "j", "--storage", "journal:s.journal", *STUDY]
        assert t.nc(cmd + ["--trials", "2"], d).rc == 0
        dead = subprocess.Popen(["true"])
        dead.wait()
        os.symlink(f"{d}/s.journal.owner=" + json.dumps([socket.gethostname(), dead.pid, None]), d / "s.journal.lock")
        c.command = (
            "nascompress search tokens BASE --study j --storage journal:s.journal --trials 4  (dead writer's lock)"
        )
        t0 = time.perf_counter()
        r = t.nc(cmd + ["--trials", "4"], d)
        wall = time.perf_counter() - t0
        c.exit_code, c.error_line = r.rc, error_line(r) if r.rc else None
        warned = "lock" in r.err.lower() and "warn" in r.err.lower()
        c.outcome = "recovered" if r.rc == 0 and not os.path.lexists(d / "s.journal.lock") and not warned else "wrong"
        c.note = f"the rerun took {wall:.1f} s (Optuna's own lock waits 30 s)"

    @t.case("dashboard-killed", "leftover of kill -9", "the next dashboard removes the killed one's snapshot")
    def _(c: Case, d: Path) -> None:
        shutil.copy(t.reference("study") / "s.db", d / "s.db")
        args = ["study", "dashboard", "s", "--storage", "sqlite:///s.db", "--port", "0"]
        c.command = "nascompress " + " ".join(args) + "  (kill -9, then start it again)"
        snaps = lambda: sorted(p.name for p in d.glob(".s.db.dashboard-*"))  # noqa: E731
        left = []
        for k in range(2):
            p = subprocess.Popen(
                [PY, "-m", "nascompress.cli.main", *args],
                cwd=d,
                env=ENV,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                start_new_session=True,
            )
            try:
                up = p.stdout.readline()
                if k == 0:
                    left = snaps()
                    os.killpg(p.pid, signal.SIGKILL)
                else:
                    after_restart = snaps()
                    os.killpg(p.pid, signal.SIGINT)
            finally:
                p.wait(30)
        c.exit_code = p.returncode
        ok = "optuna-dashboard" in up and len(left) == 1 and left[0] not in after_restart and snaps() == []
        c.outcome = "recovered" if ok else "wrong"
        c.note = (
            f"snapshot left by kill -9: {len(left)}; after the restart: {len(after_restart)} (its own); "
            f"after Ctrl-C: {len(snaps())}"
        )


def hostile_cases(t: Table) -> None:
    """Hostile inputs (issue 37): nothing hangs, nothing eats memory, no open door."""
    base = t.base_run()
    fold = [
        "--img-size",
        "16",
        "--patch-size",
        "4",
        "--embed-dim",
        "32",
        "--depth",
        "1",
        "--num-heads",
        "2",
        "--epochs",
        "1",
        "--batch-size",
        "16",
        "--device",
        "cpu",
        "--num-workers",
        "0",
    ]

    def images(d: Path, counts: dict[str, int], split: str = "train") -> Path:
        rng = np.random.default_rng(0)
        for cls, n in counts.items():
            (d / "imgs" / split / cls).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                Image.fromarray(rng.integers(0, 255, (16, 16), dtype=np.uint8)).save(
                    d / "imgs" / split / cls / f"{i}.png"
                )
        return d / "imgs"

    def refuse(
        c: Case,
        d: Path,
        args: list[Any],
        must: str,
        *,
        out: str | None = None,
        timeout: float = 120,
        one_line: bool = False,
        env: dict[str, str] | None = None,
    ) -> Ran:
        before = snapshot(d)
        c.command = "nascompress " + " ".join(map(str, args))
        r = t.nc(args, d, timeout=timeout, env=env)
        judge_refusal(c, r, must, one_line=one_line)
        c.partial_outputs = finished_outputs(d, before)
        if out is not None and (d / out).exists() and out not in before:
            c.partial_outputs.append(out + " (created)")
        return r

    @t.case("imagefolder-symlink-loops", "hostile dataset", "one line naming the link; no hang, no memory growth")
    def _(c: Case, d: Path) -> None:
        root = images(d, {"a": 6, "b": 6})
        os.symlink("..", root / "train" / "a" / "up")
        os.symlink("../../train", root / "train" / "a" / "again")
        refuse(c, d, ["train", "--out", "new", "--dataset", "imgs", *fold], "a loop", out="new")

    @t.case("imagefolder-linked-class", "hostile dataset", "one line: two class folders are one folder")
    def _(c: Case, d: Path) -> None:
        root = images(d, {"a": 6, "b": 6})
        os.symlink("a", root / "train" / "c")
        refuse(c, d, ["train", "--out", "new", "--dataset", "imgs", *fold], "same folder", out="new")

    @t.case("imagefolder-notebook-checkpoints", "hostile dataset", "trains: .ipynb_checkpoints is no class")
    def _(c: Case, d: Path) -> None:
        root = images(d, {"a": 12, "b": 12})
        images(d, {"a": 4, "b": 4}, split="val")
        (root / "train" / ".ipynb_checkpoints").mkdir()
        args = ["train", "--out", "new", "--dataset", "imgs", *fold, "--json"]
        c.command = "nascompress " + " ".join(args) + "  (train/.ipynb_checkpoints/ present)"
        r = t.nc(args, d, timeout=300)
        c.exit_code, c.peak_rss_mb = r.rc, r.peak_rss_mb
        arch = json.loads((d / "new" / "arch.json").read_text()) if r.rc == 0 else {}
        classes = arch.get("model", {}).get("kwargs", {}).get("num_classes")
        c.outcome = "hang" if r.timed_out else ("accepted" if r.rc == 0 and classes == 2 else "wrong")
        c.error_line = error_line(r) if r.rc else None
        c.note = f"classes of the trained model: {classes}"

    @t.case(
        "imagefolder-10000x10000-png",
        "hostile dataset",
        "one line naming the image and the pixel limit, read from its header (no decode)",
    )
    def _(c: Case, d: Path) -> None:
        root = images(d, {"a": 6, "b": 6})
        Image.new("L", (10000, 10000)).save(root / "train" / "b" / "huge.png")
        r = refuse(
            c,
            d,
            ["train", "--out", "new", "--dataset", "imgs", *fold],
            "huge.png",
            out="new",
            one_line=True,
            env={"PYTHONWARNINGS": "default"},
        )
        if "DecompressionBomb" in r.err:
            c.outcome, c.note = "raw error", "PIL's DecompressionBombWarning printed"

    def arch_kw(key: str, value: Any) -> Callable[[Path], None]:
        def prep(d: Path) -> None:  # a plain model directory: model.safetensors + an edited arch.json
            (d / "run").mkdir()
            shutil.copy(base / "model.safetensors", d / "run" / "model.safetensors")
            a = json.loads((base / "arch.json").read_text())
            a["model"]["kwargs"][key] = value
            (d / "run" / "arch.json").write_text(json.dumps(a))

        return prep

    for key, value in (("depth", 1_000_000), ("embed_dim", 1_000_000), ("img_size", 100_000)):

        @t.case(f"arch-json-huge-{key}", "hostile model file", "one line naming the limit; nothing built")
        def _(c: Case, d: Path, key: str = key, value: Any = value) -> None:
            arch_kw(key, value)(d)
            refuse(c, d, ["evaluate", "run", "--dataset", "synthetic", "--device", "cpu"], "above the limit")
            c.note = f"arch.json model.kwargs.{key} = {value}"

    @t.case("nan-weights", "hostile model file", "one line: the weights are not finite")
    def _(c: Case, d: Path) -> None:
        (d / "m").mkdir()
        shutil.copy(base / "arch.json", d / "m" / "arch.json")
        sd = load_file(str(base / "model.safetensors"))
        sd["head.weight"][0, 0] = float("nan")
        save_file(sd, str(d / "m" / "model.safetensors"))
        refuse(c, d, ["evaluate", "m", "--dataset", "synthetic", "--device", "cpu"], "not finite")

    @t.case("forged-finished-mark", "hostile model file", "one line: the run is unfinished (the mark is typed)")
    def _(c: Case, d: Path) -> None:
        shutil.copytree(base, d / "run")
        m = json.loads((d / "run" / "metrics.json").read_text())
        (d / "run" / "metrics.json").write_text(json.dumps(dict(m, finished="yes")))
        refuse(c, d, ["evaluate", "run", "--dataset", "synthetic", "--device", "cpu"], "unfinished")

    @t.case("replaced-model-file", "hostile model file", "one line: the run's files changed since it finished")
    def _(c: Case, d: Path) -> None:
        shutil.copytree(base, d / "run")
        b = bytearray((d / "run" / "model.safetensors").read_bytes())
        b[-4:] = b"\x00\x00\x80\x7f"  # the last float of the file: +inf, same size
        (d / "run" / "model.safetensors").write_bytes(bytes(b))
        refuse(c, d, ["evaluate", "run", "--dataset", "synthetic", "--device", "cpu"], "changed since")

    @t.case("pickle-as-weights", "hostile model file", "one line and nothing else (no torch warning)")
    def _(c: Case, d: Path) -> None:
        (d / "w.pkl").write_bytes(pickle.dumps({"w": [1, 2]}, protocol=4))
        refuse(
            c,
            d,
            ["train", "--out", "new", "--weights", "w.pkl", "--epochs", "1", *TINY],
            "w.pkl",
            out="new",
            one_line=True,
            env={"PYTHONWARNINGS": "default"},
        )

    for name, text, must in (
        ("trials-1e9", PIPELINE.replace("trials: 4", "trials: 1000000000"), "max_trials"),
        ("seed-1e23", PIPELINE.replace("seed: 0", "seed: 100000000000000000000000"), "seed"),
        ("lr-inf", PIPELINE.replace("lr: 0.002", "lr: .inf"), "finite"),
        ("nested-5000", PIPELINE + "extra: " + "[" * 5000 + "]" * 5000 + "\n", "nested deeper"),
    ):

        @t.case(f"config-{name}", "hostile config", "one line naming the key or the limit; nothing written")
        def _(c: Case, d: Path, text: str = text, must: str = must) -> None:
            (d / "p.yaml").write_text(text)
            refuse(c, d, ["pipeline", "p.yaml", "--out", "run"], must, out="run")

    @t.case("dashboard-public-bind", "open door", "refused without --expose-storage-without-login")
    def _(c: Case, d: Path) -> None:
        shutil.copy(t.reference("study") / "s.db", d / "s.db")
        refuse(
            c,
            d,
            ["study", "dashboard", "s", "--storage", "sqlite:///s.db", "--host", "0.0.0.0", "--port", "0"],
            "--expose-storage-without-login",
            timeout=60,
        )

    @t.case(
        "dashboard-delete-study",
        "open door",
        "read-only: DELETE /api/studies/N answered 403, the study kept; /static/* served without Accept-Encoding",
    )
    def _(c: Case, d: Path) -> None:
        shutil.copy(t.reference("study") / "s.db", d / "s.db")
        args = ["study", "dashboard", "s", "--storage", "sqlite:///s.db", "--port", "0"]
        c.command = "nascompress " + " ".join(args) + "  (then DELETE /api/studies/0, GET /static/bundle.js)"
        p = subprocess.Popen(
            [PY, "-m", "nascompress.cli.main", *args],
            cwd=d,
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            up = p.stdout.readline()
            port = int(re.search(r":(\d+)/dashboard", up).group(1))

            def request(method: str, path: str) -> int:
                h = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
                try:
                    h.putrequest(method, path, skip_accept_encoding=True)
                    h.endheaders()
                    return h.getresponse().status
                finally:
                    h.close()

            delete, static = request("DELETE", "/api/studies/0"), request("GET", "/static/bundle.js")
        finally:
            os.killpg(p.pid, signal.SIGINT)
            _, errs = p.communicate(timeout=30)
        c.exit_code = p.returncode
        kept = len(complete(study_trials(d / "s.db", "s"))) > 0
        c.data_lost = not kept
        ok = delete == 403 and static == 200 and kept and "Traceback" not in errs
        c.outcome = "clean refusal" if ok else "wrong"
        c.note = f"DELETE: {delete}, static without Accept-Encoding: {static}, study kept: {kept}"

    @t.case("study-two-workers-budget", "trial budget", "2 workers, --trials 4: exactly 4 complete trials")
    def _(c: Case, d: Path) -> None:
        args = [
            "search",
            "tokens",
            str(base),
            "--study",
            "w",
            "--storage",
            "journal:w.journal",
            "--trials",
            "4",
            "--workers",
            "2",
            *STUDY,
        ]
        c.command = "nascompress search tokens BASE --study w --storage journal:w.journal --trials 4 --workers 2 ..."
        r = t.nc(args, d, timeout=600)
        c.exit_code, c.peak_rss_mb = r.rc, r.peak_rss_mb
        n = len(complete(journal_trials(d / "w.journal", "w")))
        c.outcome = "hang" if r.timed_out else ("accepted" if r.rc == 0 and n == 4 else "wrong")
        c.error_line = error_line(r) if r.rc else None
        c.note = f"{n} complete trials"

    for fmt, name in (("onnx", "m.onnx"), ("torch-export", "m.pt2")):

        @t.case(f"full-disk-export-{fmt}", "full disk", "one line: no space left; nothing written")
        def _(c: Case, d: Path, fmt: str = fmt, name: str = name) -> None:
            if not t.can_mount:
                c.outcome, c.how = "not run", "no tmpfs (mount not permitted here, or --no-mount)"
                return
            t.tmpfs(d / "small", size="48k")
            c.how = "tmpfs of 48 KiB"
            refuse(c, d, ["export", str(base), "--out", f"small/{name}", "--format", fmt], "no space", timeout=300)
            c.partial_outputs += [str(p.relative_to(d)) for p in (d / "small").iterdir()]

    @t.case(
        "pipeline-two-folders-same-bytes",
        "model identity",
        "the same pipeline in another folder writes byte-identical model files",
    )
    def _(c: Case, d: Path) -> None:
        want = t.reference("pipeline") / "run"
        other = t.work / "kill-pipeline-report" / "run"  # the same pipeline, finished in another folder
        if not (other / "final" / "metrics.json").is_file():
            (d / "p.yaml").write_text(PIPELINE)
            r = t.nc(["pipeline", "p.yaml", "--out", "run"], d, timeout=900)
            c.exit_code = r.rc
            other = d / "run"
        c.command = "nascompress pipeline p.yaml --out run  (in two folders; sha256 of every model file)"
        names = sorted(str(p.relative_to(want)) for p in want.rglob("model.safetensors"))
        differ = [n for n in names if digest(want / n) != digest(other / n)]
        c.outcome = "accepted" if names and not differ else "wrong"
        c.note = f"{len(names) - len(differ)} of {len(names)} model files identical" + (
            f"; differ: {', '.join(differ)}" if differ else ""
        )


def journal_trials(path: Path, name: str) -> list[tuple]:
    """(number, state, params, values) of every trial of a journal study."""
    st = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(path)))
    try:
        study = optuna.load_study(study_name=name, storage=st)
    except KeyError:
        return []
    return [(t.number, t.state.name, sorted(t.params.items()), list(t.values or [])) for t in study.trials]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=None, help="Scratch folder (default: a new temporary folder).")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "faults.json")
    ap.add_argument(
        "--only",
        default=None,
        help="Run the cases whose name contains this (or of this category); several: comma-separated.",
    )
    ap.add_argument("--keep", action="store_true", help="Keep the scratch folder.")
    ap.add_argument(
        "--no-mount",
        action="store_true",
        help="Do not mount tmpfs (what runs where mounting is not permitted: simulated or not run).",
    )
    args = ap.parse_args()
    work = (args.work or Path(tempfile.mkdtemp(prefix="nascompress-faults-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    t = Table(work, args.only, mount=not args.no_mount)
    t0 = time.perf_counter()
    try:
        # an ordinary evaluate of the tiny model: what a refusal may need at most twice of
        ref = t.nc(["evaluate", t.base_run(), "--dataset", "synthetic", "--device", "cpu"], work)
        baseline = ref.peak_rss_mb if ref.rc == 0 else None
        kill_cases(t)
        bad_input_cases(t)
        disk_cases(t)
        leftover_cases(t)
        hostile_cases(t)
        round53_cases(t)
        round64_cases(t)
    finally:
        t.unmount_all()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    cases = [asdict(c) for c in t.cases]
    tried = [c for c in cases if c["outcome"] != "not run"]
    blowups = [
        c["name"]
        for c in tried
        if baseline
        and c["peak_rss_mb"]
        and c["outcome"] in ("clean refusal", "raw error", "hang")
        and c["peak_rss_mb"] > 2 * baseline
    ]
    summary = {
        "cases_tried": len(tried),
        "clean_refusals": sum(c["outcome"] == "clean refusal" for c in tried),
        "refusals_expected": sum(
            c["category"] not in ("kill -9", "leftover of kill -9") and c["outcome"] != "accepted" for c in tried
        ),
        "resumed_identically": sum(c["outcome"] == "resumed identical" for c in tried),
        "kill_cases": sum(c["category"] == "kill -9" for c in tried),
        "recovered_leftovers": sum(c["outcome"] == "recovered" for c in tried),
        "accepted": sum(c["outcome"] == "accepted" for c in tried),
        "raw_errors": sum(c["outcome"] == "raw error" for c in tried),
        "hangs": sum(c["outcome"] == "hang" for c in tried),
        "evaluate_peak_rss_mb": baseline,
        "memory_blowups": blowups,
        "max_refusal_peak_rss_mb": max(
            (
                c["peak_rss_mb"]
                for c in tried
                if c["peak_rss_mb"] and c["outcome"] in ("clean refusal", "raw error", "hang")
            ),
            default=None,
        ),
        "wrong_or_bench_failures": sum(
            c["outcome"] in ("wrong", "resumed different", "bench failure", "hang") for c in tried
        ),
        "partial_outputs_left": sum(bool(c["partial_outputs"]) for c in tried),
        "data_lost": sum(bool(c["data_lost"]) for c in tried),
        "not_run": [c["name"] for c in cases if c["outcome"] == "not run"],
        "disks": "real (tmpfs and read-only mounts)" if t.can_mount else "simulated where possible (no mount here)",
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    head = header()
    head["command"] = head["command"].replace(str(work), "<work>")  # no machine path in the results
    save(args.out, {**head, "summary": summary, "cases": cases})
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
