"""The fault table's cases of issue 64 (``--force`` and the Python API must never delete what
nascompress did not write), named ``r64-*``: ``--force`` on a home folder, a fake system root (and a
read-only bind mount of one), ``.`` and ``''``; the Python API's ``out=`` and ``Result.save`` over a
user's folder or over the run a result came from; a pipeline folder holding its own config; an
output that is a bind mount of the input; a user's folders named like the dashboard's snapshots;
``to_transformers`` into a run; full disks and ``ulimit -f`` during ``train`` and ``pipeline``; and
the accepted cases (``--force`` still replaces a run or pipeline folder nascompress wrote).

Every case lays a fixture of unrelated user files (:class:`Guard`: ``thesis.tex``, ``docs/notes.md``,
a nested folder, a hidden one, links to a file, to a folder and out of the folder) beside and under
each ``--out`` / ``out=`` and checks every one byte for byte afterwards: any that differs or is gone
is data lost; what a refused command wrote is listed as its partial outputs. Python API calls run
as a script in a subprocess (:func:`api`): a ``NascompressError`` is printed as the CLI prints it
(one ``error:`` line, exit 1), anything else is a traceback (a raw error).

Run only these (from the repository root)::

    python bench/faults.py --only r64- --out bench/results/faults_r64.json

:func:`round64_cases` is called by ``bench/faults.py`` with its :class:`~_faults.Table`;
:func:`after_write_failure` also judges its ``full-disk-train`` case.
"""

from __future__ import annotations

import hashlib
import os
import resource
import select
import shlex
import shutil
import signal
import subprocess
import textwrap
import time
from pathlib import Path
from typing import Any, Callable

import optuna

from _faults import (
    ENV,
    PIPELINE,
    PY,
    SPACE,
    TINY,
    Case,
    Ran,
    Table,
    error_line,
    judge_refusal,
    run_measured,
    snapshot,
    tensors_equal,
)
from nascompress.runs.io import run_state

DATA_LOST = "issue 64: data lost"
ACCEPTED = "issue 64: accepted"
# the user's files laid beside and under every output (relative path -> bytes)
USER_FILES = {
    "thesis.tex": b"\\documentclass{article}\n\\begin{document}Four years of work.\\end{document}\n",
    "docs/notes.md": b"# notes\n\n- never delete me\n",
    "docs/deep/nested/data.csv": b"x,y\n1,2\n3,4\n",
    ".config/settings.ini": b"[user]\nname = me\n",
    "photo.raw": bytes(range(256)) * 16,
}
# a system root's typical entries, for the --out / cases (never run on the real one)
FAKE_ROOT = {
    "bin/sh": b"\x7fELF a shell\n",
    "etc/passwd": b"root:x:0:0:root:/root:/bin/bash\n",
    "etc/hostname": b"box\n",
    "home/user/thesis.tex": b"my thesis\n",
    "root/.bashrc": b"export PS1='# '\n",
    "root/.ssh/authorized_keys": b"ssh-ed25519 AAAAC3Nza me@laptop\n",
    "tmp/other-user.lock": b"4242\n",
    "tmp/session/state.bin": bytes(range(200)),
    "usr/lib/libc.so.6": b"\x7fELF a library\n",
    "var/log/syslog": b"Dec  1 00:00:00 box kernel: booted\n",
}
# the pipeline of the bench, smaller (one epoch a stage, two trials): the cases that run it whole
SMALL_PIPELINE = PIPELINE.replace("epochs: 2", "epochs: 1").replace("trials: 4", "trials: 2")
NOT_OURS = "is not a nascompress output"


def _entry(p: Path) -> tuple[str, str]:
    if p.is_symlink():
        return ("link", os.readlink(p))
    if p.is_dir():
        return ("dir", "")
    return ("file", hashlib.sha256(p.read_bytes()).hexdigest())


class Guard:
    """Files that must come through a case unchanged: the user's fixture (:meth:`lay`) and the
    command's inputs (:meth:`keep`), recorded as they are and compared byte for byte by
    :meth:`check` (links by their target, never followed)."""

    def __init__(self) -> None:
        self.entries: dict[Path, tuple[str, str]] = {}

    def lay(self, where: Path, *, files: dict[str, bytes] = USER_FILES, link_out: Path | None = None) -> Path:
        """Write the user's ``files`` into ``where`` (created when missing), with an empty folder, a
        link to a file, a link to a folder and (``link_out``) a link out of ``where``; record them."""
        laid = []
        for rel, data in files.items():
            p = where / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)
            laid += [p, *(q for q in p.parents if where in q.parents)]
        first = Path(next(iter(files)))
        folder = next(rel.split("/")[0] for rel in files if "/" in rel)
        (where / "empty folder").mkdir(exist_ok=True)
        os.symlink(first.name, where / first.parent / f"link-to-{first.name}")
        os.symlink(folder, where / "link-to-folder")
        laid += [where / "empty folder", where / first.parent / f"link-to-{first.name}", where / "link-to-folder"]
        if link_out is not None:
            os.symlink(link_out, where / "link-out")
            laid.append(where / "link-out")
        for p in laid:
            self.entries[p] = _entry(p)
        return where

    def keep(self, root: Path) -> None:
        """Record every entry under ``root`` (an input of the command, a run it must not replace)."""
        for p in [root, *root.rglob("*")]:
            self.entries[p] = _entry(p)

    def check(self, c: Case) -> None:
        """Data lost when any recorded entry is gone or differs (named in the note)."""
        bad = sorted(str(p) for p, e in self.entries.items() if not os.path.lexists(p) or _entry(p) != e)
        if bad:
            c.data_lost = True
            shown = ", ".join(bad[:4]) + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")
            c.note = (c.note + "; " if c.note else "") + f"lost or changed: {shown}"


def api(body: str, cwd: Path, *, timeout: float = 300) -> Ran:
    """Run ``body`` (Python, ``nc`` imported) in a subprocess; a NascompressError becomes one
    ``error:`` line and exit 1 (as the CLI words it), any other exception a traceback."""
    code = (
        "import sys\nimport nascompress as nc\nfrom nascompress.errors import NascompressError\ntry:\n"
        + textwrap.indent(textwrap.dedent(body).strip(), "    ")
        + "\nexcept NascompressError as e:\n    print('error: ' + str(e), file=sys.stderr)\n    sys.exit(1)\n"
    )
    return run_measured([PY, "-c", code], cwd=cwd, env=ENV, timeout=timeout)


def nc_file_limit(args: list[Any], cwd: Path, limit: int, *, timeout: float = 300) -> Ran:
    """Run a ``nascompress`` command with ``ulimit -f`` at ``limit`` bytes (RLIMIT_FSIZE, set in
    the child before exec; its output goes to pipes, which the limit does not cover)."""

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    try:
        p = subprocess.run(
            [PY, "-m", "nascompress.cli.main", *map(str, args)],
            cwd=cwd,
            env=ENV,
            capture_output=True,
            text=True,
            timeout=timeout,
            preexec_fn=limited,
        )
    except subprocess.TimeoutExpired as e:
        return Ran(-9, str(e.stdout or ""), str(e.stderr or ""), timed_out=True)
    return Ran(p.returncode, p.stdout, p.stderr)


def half_written(root: Path) -> list[str]:
    """Run directories under ``root`` (itself included) with ``arch.json`` or ``config.json`` but
    neither weights nor a checkpoint: what a failed write must not leave."""
    if not root.is_dir():
        return []
    found = []
    for p in [root, *sorted(q for q in root.rglob("*") if q.is_dir() and not q.is_symlink())]:
        if ((p / "arch.json").is_file() or (p / "config.json").is_file()) and not any(
            (p / f).is_file() for f in ("model.safetensors", "checkpoint.safetensors")
        ):
            found.append(f"{p} (arch.json / config.json without model.safetensors)")
    return found


def written_since(d: Path, before: set[str]) -> list[str]:
    """What a refused command wrote under ``d`` (entries new since ``before``, a :func:`snapshot`;
    the top ones of a new tree)."""
    new = sorted(snapshot(d) - before)
    return [f"{p} (written by the refused command)" for p in new if str(Path(p).parent) not in new]


def after_write_failure(c: Case, run: Path, rerun: Callable[[bool], Ran], want: Path) -> None:
    """Judge a command that could not write the new run ``run`` (a full disk, ``ulimit -f``;
    ``judge_refusal`` first) by the advice of its message: "the unfinished ... was removed": no
    ``run`` left, and a plain rerun with room (``rerun(False)``) finishes; "--resume": ``run`` kept
    with its checkpoint, and ``rerun(True)`` (with --resume) finishes. Either way with the
    uninterrupted run's weights (``want``), and no run directory left without weights."""
    line = c.error_line or ""
    removed = "was removed" in line
    kept = not removed and "--resume" in line
    c.partial_outputs += half_written(run.parent)
    state_ok = (removed and not run.exists()) or (kept and (run / "checkpoint.safetensors").is_file())
    if c.outcome == "clean refusal" and (not state_ok or c.partial_outputs):
        c.outcome = "wrong"
    if not (removed or kept):
        c.note = "the message advises neither a plain rerun (the run removed) nor --resume"
        return
    r = rerun(kept)
    same = r.rc == 0 and tensors_equal(run / "model.safetensors", want)
    how = "the unfinished run removed; with room a plain rerun" if removed else "the run kept; with room --resume"
    c.note = how + (
        " finished with the uninterrupted run's weights"
        if same
        else (f" failed: {error_line(r)}" if r.rc else " finished with other weights")
    )
    if c.outcome == "clean refusal" and not same:
        c.outcome = "wrong"
    c.data_lost = c.data_lost or (kept and r.rc != 0)


def _first_line(p: subprocess.Popen, timeout: float) -> str:
    """The first line ``p`` prints (empty when it ends or prints none within ``timeout`` s)."""
    end = time.time() + timeout
    while time.time() < end and p.poll() is None:
        ready, _, _ = select.select([p.stdout], [], [], 0.5)
        if ready:
            return p.stdout.readline()
    return ""


def round64_cases(t: Table) -> None:
    """The cases of issue 64 (see the module docstring)."""
    base = t.base_run()

    def refuse(
        c: Case, d: Path, args: list[Any], must: str, g: Guard, *, cwd: Path | None = None, timeout: float = 300
    ) -> Ran:
        c.command = "nascompress " + shlex.join(map(str, args))
        before = snapshot(d)
        r = t.nc(args, cwd or d, timeout=timeout)
        judge_refusal(c, r, must)
        t.unmount_all()
        g.check(c)
        c.partial_outputs += written_since(d, before)
        return r

    def refuse_api(c: Case, d: Path, shown: str, body: str, must: str, g: Guard, *, timeout: float = 300) -> Ran:
        c.command = "python: " + shown
        before = snapshot(d)
        r = api(body, d, timeout=timeout)
        judge_refusal(c, r, must)
        g.check(c)
        c.partial_outputs += written_since(d, before)
        return r

    def small_pipeline() -> Path:
        """A finished run of SMALL_PIPELINE (made once): the pipeline folder."""
        d = t.work / "r64-reference-pipeline"
        if not (d / "finished").is_file():
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True)
            (d / "space.yaml").write_text(SPACE)
            (d / "p.yaml").write_text(SMALL_PIPELINE)
            r = t.nc(["pipeline", "p.yaml", "--out", "run"], d, timeout=900)
            assert r.rc == 0, r.err[-2000:]
            (d / "finished").touch()
        return d / "run"

    def search_result() -> Path:
        """A finished ``nc.dcs.search(..., out=proj)`` (made once): the folder holding ``proj``."""
        d = t.work / "r64-reference-api-search"
        if not (d / "finished").is_file():
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True)
            r = api(f"nc.dcs.search(nc.load({str(base)!r}), 'synthetic', out='proj', {_SEARCH})", d, timeout=600)
            assert r.rc == 0, r.err[-2000:]
            (d / "finished").touch()
        return d

    def fake_root(d: Path, name: str = "fakeroot") -> tuple[Guard, Path]:
        g = Guard()
        g.lay(d)
        root = g.lay(d / name, files=FAKE_ROOT, link_out=d / "docs")
        for link, target in (("lib", "usr/lib"), ("sbin", "bin")):
            os.symlink(target, root / link)
            g.entries[root / link] = _entry(root / link)
        g.lay(root / "home" / "user" / "work")
        return g, root

    train1 = ["--epochs", "1", *TINY]

    # 1. --force deletes any existing directory, recursively
    @t.case("r64-force-home-folder", DATA_LOST, "refused in one line: not a nascompress output; every file kept")
    def _(c: Case, d: Path) -> None:
        g = Guard()
        g.lay(d)
        g.lay(d / "home", link_out=d / "docs")
        refuse(c, d, ["train", "--out", "home", "--force", *train1], NOT_OURS, g)

    for name, out, cmd in (
        ("train-out-root", "fakeroot", ["train", "--out", "fakeroot", "--force", *train1]),
        ("train-out-tmp", "fakeroot/tmp", ["train", "--out", "fakeroot/tmp", "--force", *train1]),
        ("train-out-root-home", "fakeroot/root", ["train", "--out", "fakeroot/root", "--force", *train1]),
        ("pipeline-demo-out-root", "fakeroot", ["pipeline", "demo", "--out", "fakeroot", "--force"]),
    ):

        @t.case(
            f"r64-force-fake-{name}",
            DATA_LOST,
            f"refused in one line before anything is deleted ({out} stands for a system folder)",
        )
        def _(c: Case, d: Path, cmd: list[Any] = cmd) -> None:
            g, _ = fake_root(d)
            refuse(c, d, cmd, NOT_OURS, g)

    @t.case(
        "r64-force-read-only-fake-root",
        DATA_LOST,
        "refused as not a nascompress output (not as read-only): the check comes before any delete",
    )
    def _(c: Case, d: Path) -> None:
        if not t.can_mount:
            c.outcome, c.how = "not run", "no mounts (not permitted here, or --no-mount)"
            return
        g, root = fake_root(d)
        t.read_only(root)
        c.how = "read-only bind mount of a populated fake root"
        refuse(c, d, ["train", "--out", "fakeroot", "--force", *train1], NOT_OURS, g)

    for cmd_name, out, must in (("train", ".", NOT_OURS), ("train", "", "empty"), ("pipeline", ".", NOT_OURS)):
        label = "dot" if out == "." else "empty-string"

        @t.case(f"r64-force-{cmd_name}-out-{label}", DATA_LOST, "refused in one line; the working folder kept")
        def _(c: Case, d: Path, cmd_name: str = cmd_name, out: str = out, must: str = must) -> None:
            g = Guard()
            g.lay(d)
            here = g.lay(d / "cwd", link_out=d / "docs")
            if cmd_name == "train":
                args = ["train", "--out", out, "--force", *train1]
            else:
                (d / "p.yaml").write_text(SMALL_PIPELINE.replace("space: space.yaml", f"space: {d}/space.yaml"))
                args = ["pipeline", "../p.yaml", "--out", out, "--force"]
            refuse(c, d, args, must, g, cwd=here)

    @t.case("r64-force-replaces-a-run", ACCEPTED, "--force replaces a run nascompress wrote; the files beside kept")
    def _(c: Case, d: Path) -> None:
        g = Guard()
        g.lay(d)
        g.lay(d / "work")
        shutil.copytree(base, d / "work" / "run")
        args = ["train", "--out", "work/run", "--force", "--epochs", "1", *TINY[:-2], "--seed", "1"]
        c.command = "nascompress " + shlex.join(args) + "  (work/run: a finished train run of seed 0)"
        r = t.nc(args, d)
        c.exit_code, c.error_line, c.peak_rss_mb = r.rc, error_line(r) if r.rc else None, r.peak_rss_mb
        run = d / "work" / "run"
        new = r.rc == 0 and run_state(run) == "complete" and '"seed": 1' in (run / "config.json").read_text()
        c.outcome = "hang" if r.timed_out else ("accepted" if new else ("raw error" if r.rc else "wrong"))
        c.note = "replaced by the new run" if new else "the run was not replaced by a complete new one"
        g.check(c)

    @t.case(
        "r64-force-replaces-a-pipeline",
        ACCEPTED,
        "--force starts a pipeline folder nascompress wrote over: the uninterrupted run's final weights",
    )
    def _(c: Case, d: Path) -> None:
        want = small_pipeline()
        g = Guard()
        g.lay(d)
        g.lay(d / "work")
        shutil.copytree(want, d / "work" / "run")
        (d / "p.yaml").write_text(SMALL_PIPELINE)
        args = ["pipeline", "p.yaml", "--out", "work/run", "--force"]
        c.command = "nascompress " + shlex.join(args) + "  (work/run: a finished pipeline folder)"
        r = t.nc(args, d, timeout=900)
        c.exit_code, c.error_line, c.peak_rss_mb = r.rc, error_line(r) if r.rc else None, r.peak_rss_mb
        same = r.rc == 0 and tensors_equal(
            d / "work" / "run" / "final" / "model.safetensors", want / "final" / "model.safetensors"
        )
        c.outcome = "hang" if r.timed_out else ("accepted" if same else ("raw error" if r.rc else "wrong"))
        c.note = "started over: the same final weights" if same else "not the uninterrupted run's final weights"
        g.check(c)

    # 2. the Python API deletes before it validates, or over the run it was given
    @t.case("r64-api-out-source-is-user-folder", DATA_LOST, "refused in one line; proj/source/thesis.tex kept")
    def _(c: Case, d: Path) -> None:
        g = Guard()
        g.lay(d)
        g.lay(d / "proj")
        g.lay(d / "proj" / "source")
        refuse_api(
            c,
            d,
            "nc.dcs.search(nc.load(BASE), 'synthetic', out='proj', ...)  (proj/source: the user's folder)",
            f"nc.dcs.search(nc.load({str(base)!r}), 'synthetic', out='proj', {_SEARCH})",
            "source",
            g,
        )

    limits = "device='cpu', train_limit=64, eval_limit=64"
    for fn, bad, folder, must in (
        ("dcs.search", f"'synthetic', lr=-1, {_SEARCH}", "source", "lr"),
        ("tokens.apply", f"'evit', 'synthetic', lr=-1, {limits}", "source", "lr"),
        ("retrain", f"'synthetic', lr=-1, epochs=1, {limits}", "model", "lr"),
        ("study", "'synthetic', trials=0, device='cpu'", "source", "trials"),
    ):

        @t.case(
            f"r64-api-{fn.replace('.', '-')}-bad-value-before-any-write",
            DATA_LOST,
            f"the bad value refused (naming {must}) before anything is written; proj2/{folder} (the user's) kept",
        )
        def _(c: Case, d: Path, fn: str = fn, bad: str = bad, folder: str = folder, must: str = must) -> None:
            g = Guard()
            g.lay(d)
            g.lay(d / "proj2")
            g.lay(d / "proj2" / folder)
            shown = bad.split(", device")[0].split(", epochs=1")[0].replace(_SEARCH, "...")
            refuse_api(
                c,
                d,
                f"nc.{fn}(nc.load(BASE), {shown}, out='proj2')  (proj2/{folder}: the user's folder)",
                f"nc.{fn}(nc.load({str(base)!r}), {bad}, out='proj2')",
                must,
                g,
            )

    @t.case(
        "r64-api-loaded-run-named-source",
        DATA_LOST,
        "a run at proj/source, loaded and given with out='proj': refused; the run kept byte for byte",
    )
    def _(c: Case, d: Path) -> None:
        g = Guard()
        g.lay(d)
        g.lay(d / "proj")
        shutil.copytree(base, d / "proj" / "source")
        g.keep(d / "proj" / "source")
        refuse_api(
            c,
            d,
            "m = nc.load('proj/source'); nc.dcs.search(m, 'synthetic', out='proj', ...)",
            f"m = nc.load('proj/source')\nnc.dcs.search(m, 'synthetic', out='proj', {_SEARCH})",
            "source",
            g,
        )

    read_search = (
        "from nascompress.pyapi.common import read_result\nfrom nascompress.pyapi.dcs import DCSSearch\n"
        "r = read_result(DCSSearch, 'proj/dcs_search', keep=True)  # what nc.dcs.search(..., out='proj') returns\n"
    )
    materialized = (
        "from nascompress.pyapi.stages import Materialized\n"
        "m = read_result(Materialized, 'proj/dcs_mat', keep=True)  # nc.materialize(r, out='proj')\n"
    )
    for name, shown, call, must in (
        ("its-own-run", "r.save(r.out, force=True)", "r.save(r.out, force=True)", "input"),
        ("the-folder-holding-its-run", "r.save('proj', force=True)", "r.save('proj', force=True)", "input"),
        ("inside-its-run", "r.save(r.out + '/sub', force=True)", "r.save(r.out + '/sub', force=True)", "inside"),
        (
            "the-run-it-came-from",
            "m = nc.materialize(r, out='proj'); m.save(r.out, force=True)",
            materialized + "m.save(r.out, force=True)",
            "input",
        ),
        ("a-user-folder", "r.save('mine', force=True)", "r.save('mine', force=True)", NOT_OURS),
    ):

        @t.case(
            f"r64-api-save-onto-{name}",
            DATA_LOST,
            "refused in one line; the result's runs (and the user's folder) kept byte for byte",
        )
        def _(c: Case, d: Path, shown: str = shown, call: str = call, must: str = must) -> None:
            shutil.copytree(search_result() / "proj", d / "proj")
            if "Materialized" in call:
                r = api(read_search + "nc.materialize(r, out='proj')", d)
                assert r.rc == 0, r.err[-2000:]
            g = Guard()
            g.lay(d)
            g.keep(d / "proj")
            g.lay(d / "mine")
            refuse_api(c, d, f"r = nc.dcs.search(..., out='proj'); {shown}", read_search + call, must, g)

    @t.case(
        "r64-api-compress-force-user-folder",
        DATA_LOST,
        "nc.compress(..., out='proj', force=True), proj/pipeline the user's: refused; every file kept",
    )
    def _(c: Case, d: Path) -> None:
        g = Guard()
        g.lay(d)
        g.lay(d / "proj")
        g.lay(d / "proj" / "pipeline")
        refuse_api(
            c,
            d,
            "nc.compress(nc.load(BASE), 'synthetic', out='proj', force=True, ...)  (proj/pipeline: the user's)",
            f"nc.compress(nc.load({str(base)!r}), 'synthetic', out='proj', force=True, target_flops=0.8, "
            f"epochs=1, trials=2, device='cpu', train_limit=64, eval_limit=64, latency=False, "
            f"tokens={{'space': {str(d / 'space.yaml')!r}}})",
            NOT_OURS,
            g,
        )

    # 3. a pipeline folder that holds the command's own config
    @t.case("r64-pipeline-out-holds-its-config", DATA_LOST, "refused in one line; pp/p.yaml and the user's files kept")
    def _(c: Case, d: Path) -> None:
        g = Guard()
        g.lay(d)
        pp = g.lay(d / "pp")
        (pp / "p.yaml").write_text(SMALL_PIPELINE)
        (pp / "space.yaml").write_text(SPACE)
        g.keep(pp)
        refuse(c, d, ["pipeline", "pp/p.yaml", "--out", "pp", "--force"], "", g)

    @t.case(
        "r64-pipeline-force-its-stored-config",
        DATA_LOST,
        "pipeline pp/config.yaml --out pp --force (the file's own rerun line + --force): refused; pp kept",
    )
    def _(c: Case, d: Path) -> None:
        shutil.copytree(small_pipeline(), d / "pp")
        g = Guard()
        g.lay(d)
        g.keep(d / "pp")
        refuse(c, d, ["pipeline", "pp/config.yaml", "--out", "pp", "--force"], "input", g)

    # 4. an output that is a bind mount of the input
    @t.case("r64-finetune-out-bind-mount-of-input", DATA_LOST, "refused: bindpb is the input pb; pb kept")
    def _(c: Case, d: Path) -> None:
        if not t.can_mount:
            c.outcome, c.how = "not run", "no mounts (not permitted here, or --no-mount)"
            return
        shutil.copytree(base, d / "pb")
        g = Guard()
        g.lay(d)
        g.lay(d / "pb")
        g.keep(d / "pb")
        (d / "bindpb").mkdir()
        subprocess.run(["mount", "--bind", str(d / "pb"), str(d / "bindpb")], check=True)
        t.mounts.append(d / "bindpb")
        c.how = "mount --bind pb bindpb"
        refuse(c, d, ["finetune", "pb", "--method", "evit", "--zero-shot", "--out", "bindpb", "--force"], "input", g)

    # 5. the dashboard's stale snapshots, to_transformers into a run
    @t.case(
        "r64-dashboard-user-folders-named-like-snapshots",
        DATA_LOST,
        "the dashboard starts and stops; the user's .s.db.dashboard-mine/ folders (no owner.json, old) kept",
    )
    def _(c: Case, d: Path) -> None:
        study = optuna.create_study(study_name="s", storage=f"sqlite:///{d}/s.db")
        study.optimize(lambda tr: tr.suggest_float("x", 0, 1), n_trials=2)
        g = Guard()
        g.lay(d)
        old = time.time() - 3600  # past the 60 s after which a snapshot without owner.json counts as stale
        for name in (".s.db.dashboard-mine", ".dstudies.db.dashboard-mine"):
            g.lay(d / name)
            for p in [d / name, *(d / name).rglob("*")]:
                os.utime(p, (old, old), follow_symlinks=False)
        args = ["study", "dashboard", "s", "--storage", "sqlite:///s.db", "--port", "0"]
        c.command = "nascompress " + shlex.join(args) + "  (then Ctrl-C)"
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
            up = _first_line(p, 180)
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGINT)
            try:
                _, errs = p.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                _, errs = p.communicate()
        c.exit_code = p.returncode
        c.error_line = next((ln for ln in errs.splitlines() if ln.startswith("error:")), None)
        started = "/dashboard" in up
        c.outcome = (
            "accepted" if started and "Traceback" not in errs else ("raw error" if "Traceback" in errs else "wrong")
        )
        left = sorted(x.name for x in d.glob(".s.db.dashboard-*") if x.name != ".s.db.dashboard-mine")
        c.note = "started and stopped" if started else "did not start"
        if left:
            c.note += f"; its own snapshot left: {left}"
        g.check(c)

    for name, target, must in (("a-run", "run", "nascompress run"), ("a-user-folder", "mine", "not a folder")):

        @t.case(
            f"r64-api-to-transformers-into-{name}",
            DATA_LOST,
            "refused in one line, even with force=True; every file kept",
        )
        def _(c: Case, d: Path, target: str = target, must: str = must) -> None:
            shutil.copytree(base, d / "run")
            g = Guard()
            g.lay(d)
            g.keep(d / "run")
            g.lay(d / "mine")
            refuse_api(
                c,
                d,
                f"nc.to_transformers(nc.load('run'), {target!r}, force=True)",
                f"nc.to_transformers(nc.load('run'), {target!r}, force=True)",
                must,
                g,
            )

    # 6. a full disk / ulimit -f during train or pipeline
    want_train = lambda: t.reference("train") / "run" / "model.safetensors"  # noqa: E731
    train3 = ["train", "--out", "run", "--epochs", "3", *TINY]

    @t.case(
        "r64-ulimit-f-train",
        "issue 64: full disk",
        "one line naming ulimit -f; the unfinished run removed (plain rerun) or kept (--resume): same weights",
    )
    def _(c: Case, d: Path) -> None:
        g = Guard()
        g.lay(d)
        c.how = "ulimit -f 96 KiB (RLIMIT_FSIZE)"
        c.command = "nascompress " + shlex.join(train3) + "  (ulimit -f 96 KiB; then without it, as advised)"
        judge_refusal(c, nc_file_limit(train3, d, 96 * 1024), "ulimit -f")
        after_write_failure(
            c, d / "run", lambda resume: t.nc(train3 + (["--resume"] if resume else []), d), want_train()
        )
        g.check(c)

    @t.case(
        "r64-full-disk-train-after-checkpoint",
        "issue 64: full disk",
        "one line: no space; the run kept with its checkpoint (--resume) or removed (plain rerun): same weights",
    )
    def _(c: Case, d: Path) -> None:
        if not t.can_mount:
            c.outcome, c.how = "not run", "no tmpfs (mount not permitted here, or --no-mount)"
            return
        g = Guard()
        g.lay(d)
        t.tmpfs(d / "small", size="704k")
        g.lay(d / "small")
        c.how = "tmpfs of 704 KiB (room for the first checkpoint, not the second)"
        args = ["train", "--out", "small/run", "--epochs", "3", *TINY]
        c.command = "nascompress " + shlex.join(args) + "  (then: more space, as advised)"
        judge_refusal(c, t.nc(args, d), "no space")

        def rerun(resume: bool) -> Ran:
            t.grow(d / "small")
            return t.nc(args + (["--resume"] if resume else []), d)

        after_write_failure(c, d / "small" / "run", rerun, want_train())
        g.check(c)  # (the tmpfs is unmounted after the case)

    @t.case(
        "r64-ulimit-f-pipeline",
        "issue 64: full disk",
        "one line naming ulimit -f; no run left without weights; without the limit the same command finishes",
    )
    def _(c: Case, d: Path) -> None:
        want = small_pipeline() / "final" / "model.safetensors"
        g = Guard()
        g.lay(d)
        (d / "p.yaml").write_text(SMALL_PIPELINE)
        args = ["pipeline", "p.yaml", "--out", "run"]
        c.how = "ulimit -f 96 KiB (RLIMIT_FSIZE)"
        c.command = "nascompress " + shlex.join(args) + "  (ulimit -f 96 KiB; then without it, the same command)"
        judge_refusal(c, nc_file_limit(args, d, 96 * 1024, timeout=600), "ulimit -f")
        c.partial_outputs = half_written(d / "run")
        if c.outcome == "clean refusal" and c.partial_outputs:
            c.outcome = "wrong"
        r = t.nc(args, d, timeout=900)
        same = r.rc == 0 and tensors_equal(d / "run" / "final" / "model.safetensors", want)
        c.note = "without the limit the same command " + (
            "finished with the uninterrupted run's final weights"
            if same
            else (f"failed: {error_line(r)}" if r.rc else "finished with other weights")
        )
        if c.outcome == "clean refusal" and not same:
            c.outcome = "wrong"
        g.check(c)


# the tiny DCS search of the Python API cases
_SEARCH = "epochs=1, train_limit=64, eval_limit=64, batch_size=32, target_flops=0.9, device='cpu'"

__all__ = ["round64_cases", "after_write_failure", "Guard", "api"]
