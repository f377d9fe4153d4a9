"""The SQLite snapshot folders of :mod:`nascompress.studies.dashboard`. A snapshot lives beside the
study file, in a hidden folder ``.<file>.dashboard-<id>/`` (the system's temporary folder only when
the study's folder is read-only), removed when the dashboard stops. The folder appears with its owner
already recorded in ``owner.json`` (made under a temporary name, then renamed into place). A folder
left by a dashboard killed with kill -9 is removed by the next start only if it is provably such a
leftover: a valid ``owner.json`` naming a dead process of this machine, and nothing in it but that
file and the ``snapshot-*`` files a dashboard writes; any other folder of that name (one without
``owner.json``, one holding other files) is never touched.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import stat
import tempfile
import uuid
from pathlib import Path

from nascompress.errors import NascompressError
from nascompress.runs.json_io import read_json

from ._procs import owner_gone, owner_record
from .storage_url import StorageSpec

SNAPSHOT_TAG = ".dashboard-"  # snapshot folders: .<study file>.dashboard-<id>/
_MAKING = ".making-dashboard-"  # a snapshot folder being made, before its rename into place
OWNER_FILE = "owner.json"
SNAPSHOT_PREFIX = "snapshot-"  # the files of a snapshot folder besides owner.json (SQLite's -journal too)


def _own_files(d: Path) -> list[Path] | None:
    """The files of ``d`` if it is a snapshot folder as a dashboard writes it: a real folder (no
    link) holding ``owner.json`` and ``snapshot-*`` regular files only; else None."""
    try:
        if not stat.S_ISDIR(os.lstat(d).st_mode):
            return None
        files = list(d.iterdir())
        for f in files:
            if not stat.S_ISREG(os.lstat(f).st_mode):
                return None
    except OSError:
        return None
    names = {f.name for f in files}
    if OWNER_FILE not in names or any(n != OWNER_FILE and not n.startswith(SNAPSHOT_PREFIX) for n in names):
        return None
    return files


def remove_snapshot_dir(d: Path) -> None:
    """Remove snapshot folder ``d`` if it holds only what a dashboard writes (:func:`_own_files`):
    its files one by one, then the folder (kept if anything else appeared in it meanwhile)."""
    files = _own_files(d)
    if files is None:
        return
    for f in sorted(files, key=lambda f: f.name == OWNER_FILE):  # owner.json last
        try:
            f.unlink()
        except FileNotFoundError:
            pass
        except OSError:
            return
    try:
        d.rmdir()
    except OSError:
        pass


def _dead_owner(d: Path) -> bool:
    """Does ``d/owner.json`` name a process of this machine that is gone? (False when it is missing,
    invalid, of another host, or its process lives.)"""
    try:
        return owner_gone(read_json(d / OWNER_FILE))
    except NascompressError:
        return False


def _remove_stale_snapshots(home: Path) -> None:
    """Remove the snapshot folders of dashboards of this machine that are no longer running: only a
    folder that is provably one (a valid ``owner.json`` naming a dead process of this host, nothing
    in it but that file and ``snapshot-*`` files); any other folder is left alone."""
    for d in [*home.glob(f".*{SNAPSHOT_TAG}*"), *home.glob(f".*{_MAKING}*")]:
        if _own_files(d) is not None and _dead_owner(d):
            remove_snapshot_dir(d)


def make_snapshot_dir(spec: StorageSpec) -> Path:
    """A new snapshot folder beside the study file (the temporary folder if that one is read-only)
    that appears with its owner recorded (made under a temporary name, then renamed into place);
    stale folders of killed dashboards are removed first."""
    assert spec.path is not None
    home = spec.path.resolve().parent
    if not os.access(home, os.W_OK):
        home = Path(tempfile.gettempdir())
    _remove_stale_snapshots(home)
    tmp = Path(tempfile.mkdtemp(prefix=f".{spec.path.name}{_MAKING}", dir=home))
    try:
        (tmp / OWNER_FILE).write_text(json.dumps(owner_record()))
        d = home / f".{spec.path.name}{SNAPSHOT_TAG}{uuid.uuid4().hex[:8]}"
        while os.path.lexists(d):  # rename would replace an empty folder of that name
            d = home / f".{spec.path.name}{SNAPSHOT_TAG}{uuid.uuid4().hex[:8]}"
        os.rename(tmp, d)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # the folder just made here, with owner.json at most
        raise
    return d


def snapshot_sqlite(spec: StorageSpec, tmpdir: Path) -> StorageSpec:
    """A consistent copy of SQLite storage ``spec`` (SQLite's online backup, safe mid-write) in
    snapshot folder ``tmpdir``, as a storage to serve."""
    assert spec.path is not None
    snap = tmpdir / f"snapshot-{spec.path.name}"
    try:
        src = sqlite3.connect(f"file:{spec.path}?mode=ro", uri=True, timeout=30)
        try:
            dst = sqlite3.connect(snap)
            with dst:
                src.backup(dst)
            dst.close()
        finally:
            src.close()
    except sqlite3.Error as e:
        raise NascompressError(f"cannot snapshot {spec.display} for the dashboard: {e}") from None
    return StorageSpec("sqlite", f"sqlite:///{snap}", snap)
