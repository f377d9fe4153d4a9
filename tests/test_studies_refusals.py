"""Study storages, workers, the dashboard and study export refuse what they cannot use in one line:
a journal storage that is no regular file or no journal, a record without end, more workers than
trials or cores, a request addressed to another host, a spreadsheet formula in an exported cell, an
export onto a device or a full disk; the dashboard removes only its own snapshot folders."""

from __future__ import annotations

import builtins
import csv
import errno
import http.client
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from nascompress.errors import NascompressError
from nascompress.studies import open_storage, parse_storage
from nascompress.studies.dashboard import start_dashboard
from nascompress.studies.inspect import export_study
from nascompress.studies.snapshots import SNAPSHOT_TAG

from .conftest import invoke
from .study_toys import SPACE_INFO, TWO
from .study_toys import run_toy_study as run_toy

ROOT = Path(__file__).resolve().parents[1]
RAW = ("Traceback", "JSONDecodeError", "KeyError", "AssertionError", "Should not reach", "batch size")


def one_line(r, pattern: str) -> str:
    """The CLI result ``r`` is exit 1 with one ``error:`` line holding ``pattern`` and no raw error."""
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.exit_code == 1 and len(lines) == 1, r.output
    assert lines[0].startswith("error: ") and pattern in lines[0], lines[0]
    assert not any(w in r.output for w in RAW), r.output
    return lines[0]


# ---------------------------------------------------------------------------------------------
# Journal storages: a regular file holding Optuna journal records, read in bounded pieces


def test_a_storage_that_is_no_regular_file_is_refused_before_it_is_opened(tmp_path, monkeypatch):
    fifo = tmp_path / "s.journal"
    os.mkfifo(fifo)
    real_open = builtins.open

    def guarded_open(file, *a, **kw):  # opening the FIFO blocks forever; /dev/zero is read without end
        assert str(file) not in (str(fifo), "/dev/zero"), f"{file} was opened"
        return real_open(file, *a, **kw)

    monkeypatch.setattr(builtins, "open", guarded_open)
    one_line(invoke("study", "list", "--storage", f"journal:{fifo}"), "is a named pipe (FIFO), not a regular file")
    one_line(invoke("study", "list", "--storage", "journal:/dev/zero"), "/dev/zero is a device")
    one_line(invoke("study", "list", "--storage", "sqlite:////dev/zero"), "/dev/zero is a device")
    with pytest.raises(NascompressError, match="not a regular file"):
        open_storage(parse_storage(f"journal:{fifo}"), create=True)
    assert fifo.is_fifo()


@pytest.mark.parametrize(
    "text,line,why",
    [
        (b"hello\n", 1, "is not JSON"),
        (b'hello\n{"a": 1}\n', 1, "is not JSON"),
        (b"\xff\xfe\x00\n\x00\n", 1, "is not JSON"),
        (b"[1, 2]\n", 1, "is not an Optuna journal record"),
        (b'{"op_code": 99}\n', 1, "is not an Optuna journal record"),
        (b"no newline at all", 1, "is not an Optuna journal record"),
        (b'{"op_code": 0, "worker_id": "w"}\n', 1, "is not a valid Optuna journal record"),
        (b'{"op_code": 99, "worker_id": "w"}\n', 1, "is not a valid Optuna journal record"),
    ],
)
def test_a_file_that_is_no_journal_is_one_line_naming_the_line(tmp_path, text, line, why):
    bad = tmp_path / "bad.journal"
    bad.write_bytes(text)
    msg = one_line(invoke("study", "list", "--storage", f"journal:{bad}"), f"line {line} {why}")
    assert "not an Optuna journal, or it is damaged there" in msg and "hello" not in msg
    assert bad.read_bytes() == text  # nothing appended


def test_a_damaged_line_in_a_journal_is_named(tmp_path):
    storage = f"journal:{tmp_path}/s.journal"
    run_toy("s", storage, 1, seed=0)
    path = tmp_path / "s.journal"
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:3]) + b'{"op_code": 4, "worker_id": "x", "study_id": 0}\n' + b"".join(lines[3:]))
    one_line(invoke("study", "list", "--storage", storage), "line 4 is not a valid Optuna journal record")
    path.write_bytes(b"".join(lines[:2]) + b"=garbage\n" + b"".join(lines[2:]))
    one_line(invoke("study", "show", "s", "--storage", storage), "line 3 is not JSON")


def test_a_journal_record_without_end_is_refused_at_the_limit(tmp_path, monkeypatch):
    storage = f"journal:{tmp_path}/s.journal"
    run_toy("s", storage, 1, seed=0)
    path = tmp_path / "s.journal"
    good = path.read_bytes()
    longest = max(len(ln) for ln in good.splitlines(keepends=True))
    path.write_bytes(good + b'{"op_code": 4, "worker_id": "' + b"x" * 2000)  # a record being written...
    assert [r["name"] for r in json.loads(invoke("study", "list", "--storage", storage, "--json").stdout)] == ["s"]
    monkeypatch.setenv("NASCOMPRESS_MAX_JOURNAL_RECORD_BYTES", str(max(longest, 1000)))  # ... or without end
    msg = one_line(invoke("study", "list", "--storage", storage), "is longer than")
    assert "(max_journal_record_bytes)" in msg and "NASCOMPRESS_MAX_JOURNAL_RECORD_BYTES=N" in msg
    assert f"line {len(good.splitlines()) + 1} " in msg


# ---------------------------------------------------------------------------------------------
# Workers: never more than the trials asked for or the cores


def test_workers_are_capped_at_the_trials_and_the_cores_with_a_note(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    res = run_toy("one", None, 1, workers=3, progress=True)  # one trial: one worker, in this process
    assert res.workers == 1 and res.complete == 1
    assert res.workers_note == "running 1 worker, not workers 3: the study asks for 1 trial"
    assert res.workers_note in capsys.readouterr().err
    assert res.storage.startswith("sqlite:///")  # one worker: the default SQLite file, as asked with 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    res = run_toy("two", None, 2, workers=2)
    assert res.workers == 1 and res.complete == 2
    assert res.workers_note == "running 1 worker, not workers 2: this machine has 1 usable CPU core"


def test_two_runs_of_one_study_with_two_workers_each_cooperate(tmp_path):
    """Two processes started at once on one journal file and study, two workers each: both end
    with the study's trials complete, none run twice, the journal readable."""
    kw = {
        "study_name": "s",
        "storage": f"journal:{tmp_path}/s.journal",
        "n_trials": 4,
        "workers": 2,
        "space_info": SPACE_INFO,
        "heartbeat_interval": 1.0,
        "grace_period": 30.0,
        **TWO,
    }
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "tests.study_toys", json.dumps(kw)]
    procs = [
        subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0 and "Traceback" not in err, err
        assert json.loads(out.strip().splitlines()[-1])["complete"] == 4
    st = open_storage(parse_storage(kw["storage"]), create=False)
    trials = optuna.load_study(study_name="s", storage=st).get_trials(deepcopy=False)
    done = [json.dumps(t.params, sort_keys=True) for t in trials if t.state == TrialState.COMPLETE]
    assert len(done) == 4 == len(set(done))


# ---------------------------------------------------------------------------------------------
# The dashboard: requests addressed to it only; only its own snapshot folders removed


def _get(port: int, path: str, host: str | None) -> int:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        c.putrequest("GET", path, skip_host=True, skip_accept_encoding=True)
        if host is not None:
            c.putheader("Host", host)
        c.endheaders()
        r = c.getresponse()
        r.read()
        return r.status
    finally:
        c.close()


def test_the_dashboard_answers_only_requests_addressed_to_it(tmp_path):
    storage = f"journal:{tmp_path}/s.journal"
    run_toy("d", storage, 1, seed=0)
    with start_dashboard("d", storage=storage) as h:
        p = h.port
        for ok in (f"127.0.0.1:{p}", f"localhost:{p}", f"LOCALHOST:{p}", f"[::1]:{p}"):
            assert _get(p, "/api/studies", ok) == 200, ok
        for bad in (f"evil.example:{p}", "evil.example", f"127.0.0.1:{p + 1}", "127.0.0.1", f"localhost.evil:{p}"):
            assert _get(p, "/api/studies", bad) == 403, bad
            assert _get(p, "/dashboard/", bad) == 403, bad
        assert _get(p, "/api/studies", None) == 403  # no Host header at all


def _db_study(tmp_path: Path) -> str:
    db = f"sqlite:///{tmp_path}/studies.db"
    run_toy("d", db, 1, seed=0)
    return db


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_the_dashboard_removes_only_folders_it_can_prove_are_its_leftovers(tmp_path):
    db = _db_study(tmp_path)
    old = 1_000_000_000  # long ago (the old rule removed an owner-less folder older than 60 s)
    owner = {"host": socket.gethostname(), "pid": _dead_pid(), "pid_start": None}

    def folder(name: str, files: dict[str, str]) -> Path:
        d = tmp_path / name
        d.mkdir()
        for f, text in files.items():
            (d / f).write_text(text)
        os.utime(d, (old, old))
        return d

    mine = folder(f".studies.db{SNAPSHOT_TAG}mine", {"notes.txt": "my notes"})  # a user's, no owner.json
    empty = folder(f".studies.db{SNAPSHOT_TAG}empty", {})
    other = folder(f".studies.db{SNAPSHOT_TAG}other", {"owner.json": json.dumps(owner), "notes.txt": "x"})
    alive = folder(f".studies.db{SNAPSHOT_TAG}alive", {"owner.json": json.dumps({**owner, "pid": os.getpid()})})
    host = folder(f".studies.db{SNAPSHOT_TAG}host", {"owner.json": json.dumps({**owner, "host": "elsewhere"})})
    junk = folder(f".studies.db{SNAPSHOT_TAG}junk", {"owner.json": "[1, 2", "snapshot-studies.db": ""})
    stale = folder(
        f".studies.db{SNAPSHOT_TAG}stale",
        {"owner.json": json.dumps(owner), "snapshot-studies.db": "", "snapshot-studies.db-journal": ""},
    )
    (tmp_path / f".studies.db{SNAPSHOT_TAG}link").symlink_to(mine)
    with start_dashboard("d", storage=db) as h:
        served = h.snapshot.parent
        assert sorted(p.name for p in served.iterdir()) == ["owner.json", "snapshot-studies.db"]
    assert not served.exists() and not stale.exists()
    for d in (mine, empty, other, alive, host, junk):
        assert d.is_dir(), d
    assert (mine / "notes.txt").read_text() == "my notes" and (tmp_path / f".studies.db{SNAPSHOT_TAG}link").is_symlink()


def test_a_snapshot_folder_appears_with_its_owner_inside(tmp_path, monkeypatch):
    """The folder is made under a temporary name and renamed into place with owner.json in it: a
    dashboard killed at any moment leaves no owner-less folder of the snapshot's name."""
    import nascompress.studies.dashboard as dashboard

    db = _db_study(tmp_path)
    seen: list[tuple[str, list[str]]] = []
    real_rename = os.rename

    def rename(src, dst, *a, **kw):
        if SNAPSHOT_TAG in Path(dst).name:
            seen.append((Path(dst).name, sorted(p.name for p in Path(src).iterdir())))
        return real_rename(src, dst, *a, **kw)

    real_mkdir = Path.mkdir

    def mkdir(self, *a, **kw):
        assert SNAPSHOT_TAG not in self.name, f"{self.name} made in place, without its owner"
        return real_mkdir(self, *a, **kw)

    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(Path, "mkdir", mkdir)
    with dashboard.start_dashboard("d", storage=db) as h:
        assert seen == [(h.snapshot.parent.name, ["owner.json"])]


# ---------------------------------------------------------------------------------------------
# study export: no formula in a cell, never onto a device, a full disk in one line


def _study_with_text(tmp_path: Path) -> str:
    storage = f"journal:{tmp_path}/s.journal"
    st = open_storage(parse_storage(storage), create=True)
    study = optuna.create_study(study_name="s", storage=st, directions=["maximize", "minimize"])
    dists = {
        "cmd": optuna.distributions.CategoricalDistribution(['=HYPERLINK("http://x","y")', "+1", "@SUM(A1)"]),
        "x": optuna.distributions.FloatDistribution(-1.0, 1.0),
    }
    for cmd, x in (('=HYPERLINK("http://x","y")', -0.5), ("+1", 0.25), ("@SUM(A1)", -1.0)):
        study.add_trial(
            optuna.trial.create_trial(
                params={"cmd": cmd, "x": x},
                distributions=dists,
                values=[-3.0, 0.5],
                user_attrs={"nascompress_error": "-minus\tand tab"},
            )
        )
    return storage


def test_exported_cells_never_start_a_formula_and_numbers_stay_numbers(tmp_path):
    storage = _study_with_text(tmp_path)
    out = export_study("s", fmt="csv", out=tmp_path / "s.csv", storage=storage)
    rows = list(csv.DictReader(out.open(newline="")))
    assert [r["params.cmd"] for r in rows] == ['\'=HYPERLINK("http://x","y")', "'+1", "'@SUM(A1)"]
    assert [r["params.x"] for r in rows] == ["-0.5", "0.25", "-1.0"]  # numbers: unescaped
    assert {r["values.value0"] for r in rows} == {"-3.0"}
    assert {r["error"] for r in rows} == {"'-minus\tand tab"}
    for r in rows:
        for v in r.values():
            assert not v.startswith(("=", "+", "@", "\t", "\r")), v
    data = json.loads(export_study("s", fmt="json", out=tmp_path / "s.json", storage=storage).read_text())
    assert data["trials"][0]["params"]["cmd"].startswith("=")  # JSON holds the values themselves


def test_export_never_replaces_a_device_or_a_fifo(tmp_path):
    storage = _study_with_text(tmp_path)
    fifo = tmp_path / "out.csv"
    os.mkfifo(fifo)
    one_line(invoke("study", "export", "s", "--storage", storage, "--out", fifo, "--force"), "is a named pipe (FIFO)")
    assert fifo.is_fifo()
    if os.geteuid() == 0:  # a /dev/full of our own: a write to it fails with "no space left"
        full = tmp_path / "full"
        os.mknod(full, 0o666 | 0o020000, os.makedev(1, 7))
        r = invoke("study", "report", "s", "--storage", storage, "--out", full, "--force")
        one_line(r, f"{full} is a device or socket, not a regular file; choose another --out")
        r = invoke("study", "export", "s", "--storage", storage, "--out", full, "--force")
        one_line(r, f"{full} is a device or socket, not a regular file; choose another --out")
        assert full.is_char_device()


def _tmpfs(d: Path) -> bool:
    d.mkdir()
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8k", "tmpfs", str(d)], capture_output=True)
    except OSError:
        return False
    return r.returncode == 0


def test_export_to_a_full_disk_is_one_line_naming_the_file(tmp_path, monkeypatch):
    storage = _study_with_text(tmp_path)
    small = tmp_path / "small"
    if _tmpfs(small):  # a real full disk: 8 KiB, filled
        try:
            (small / "fill").write_bytes(b"x" * 8192)
            r = invoke("study", "export", "s", "--storage", storage, "--out", small / "s.json", "--format", "json")
            one_line(r, f"cannot write {small / 's.json'}: no space is left on its disk")
            assert sorted(p.name for p in small.iterdir()) == ["fill"]
        finally:
            subprocess.run(["umount", str(small)], check=False)
        return
    real_write = Path.write_text  # no tmpfs here: the write fails as on a full disk

    def full(self, *a, **kw):
        if self.parent == small:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
        return real_write(self, *a, **kw)

    monkeypatch.setattr(Path, "write_text", full)
    r = invoke("study", "export", "s", "--storage", storage, "--out", small / "s.csv")
    one_line(r, f"cannot write {small / 's.csv'}: no space is left on its disk")
    assert list(small.iterdir()) == []
