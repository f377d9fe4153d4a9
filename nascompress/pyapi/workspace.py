"""Where an API call's run directories go (:class:`Workspace`): the caller's ``out=`` (kept,
resumable), or a temporary directory removed when the call returns; one that a killed call left
behind is removed by a later call, when its recorded owner is gone."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any

from ..errors import NascompressError
from ..runs.json_io import read_json, write_json


class Workspace:
    """Where a call's run directories go: ``out`` (kept, resumable), or a temporary directory that
    is removed when the call returns (``with Workspace(out) as ws``).

    A temporary directory (``$TMPDIR/nascompress-*``) records its owner as it is made
    (:attr:`OWNER_FILE`: host, pid and the process's start time); one left behind by a process
    killed with kill -9 is removed when a later Workspace is made: only a directory of this user
    whose valid record names a process of this host that is gone (any other, one without a record
    among them, is never touched)."""

    PREFIX = "nascompress-"
    OWNER_FILE = "owner.json"

    def __init__(self, out: str | Path | None):
        self.keep = out is not None
        self.root = Path(out).expanduser().resolve() if out is not None else None
        self._tmp: str | None = None
        self.remove_dead()

    def __enter__(self) -> "Workspace":
        if self.root is None:
            self._tmp = self._make_tmp()
            self.root = Path(self._tmp)
        return self

    def _make_tmp(self) -> str:
        """A new temporary directory holding its owner record."""
        from ..studies._procs import owner_record  # the process helpers: only when a temporary folder is made

        tmp = tempfile.mkdtemp(prefix=self.PREFIX)
        write_json(Path(tmp) / self.OWNER_FILE, owner_record())
        return tmp

    @classmethod
    def dead_owner(cls, d: Path) -> bool:
        """Is ``d`` a temporary directory of a Workspace whose process is gone: a real directory of
        this user holding a valid owner record that names a process of this host no longer running?"""
        from ..studies._procs import owner_gone  # only when leftovers are looked for

        rec = d / cls.OWNER_FILE
        try:
            st = os.lstat(d)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or not stat.S_ISREG(os.lstat(rec).st_mode):
                return False
            return owner_gone(read_json(rec))
        except (OSError, NascompressError):
            return False

    @classmethod
    def remove_dead(cls) -> None:
        """Remove the temporary directories that Workspaces of dead processes left (:meth:`dead_owner`)."""
        try:
            found = list(Path(tempfile.gettempdir()).glob(f"{cls.PREFIX}*"))
        except OSError:
            return
        for d in found:
            if cls.dead_owner(d):
                shutil.rmtree(d, ignore_errors=True)

    def __exit__(self, *exc: Any) -> None:
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)

    def path(self, name: str) -> Path:
        assert self.root is not None
        return self.root / name

    def scratch(self, name: str) -> Path:
        """A directory for the API's own files (the given model as a run): always temporary."""
        if self._tmp is None:
            self._tmp = self._make_tmp()
        return Path(self._tmp) / name


__all__ = ["Workspace"]
