"""The lock of a journal storage (:class:`OwnedJournalLock`): Optuna's symlink lock with its owner
(host, pid, process start) written into the link, so a lock left by a killed process of this
machine is taken over at once."""

from __future__ import annotations

import json
import os
import time
import uuid

from optuna.storages.journal import JournalFileSymlinkLock

from ._procs import host, pid_alive, pid_start

_OWNER = ".owner="  # the lock link's target: "<journal>.owner=[host, pid, start]"


class OwnedJournalLock(JournalFileSymlinkLock):
    """Optuna's symlink lock on ``PATH.lock`` (so plain Optuna writers still exclude each other with
    it) whose link names its owner: a lock whose owner on this host is dead is broken at once, one of
    unknown owner after ``grace_period`` s (Optuna's rule)."""

    def __init__(self, journal: str, grace_period: int = 30) -> None:
        super().__init__(journal, grace_period=grace_period)  # sets _lock_file = journal + ".lock"
        pid = os.getpid()
        self._me = journal + _OWNER + json.dumps([host(), pid, pid_start(pid)])

    def acquire(self) -> bool:
        sleep = 0.001
        while True:
            try:
                os.symlink(self._me, self._lock_file)  # atomic: the lock is created with its owner
                return True
            except FileExistsError:
                if self._recover():
                    continue
                time.sleep(sleep)
                sleep = min(sleep * 2, 0.05)

    def release(self) -> None:
        moved = f"{self._lock_file}.{uuid.uuid4().hex}.rename"
        try:
            os.rename(self._lock_file, moved)
            os.unlink(moved)
        except OSError:
            raise RuntimeError(f"did not possess the lock {self._lock_file}") from None

    def _recover(self) -> bool:
        """Break the existing lock if its owner is gone; True if the lock may be retried now."""
        try:
            target, st = os.readlink(self._lock_file), os.lstat(self._lock_file)
        except FileNotFoundError:
            return True  # released meanwhile
        except OSError:
            return False
        owner = None
        if _OWNER in target:
            try:
                owner = json.loads(target.rsplit(_OWNER, 1)[1])
            except ValueError:
                owner = None
        if isinstance(owner, list) and len(owner) == 3 and owner[0] == host():
            stale = not pid_alive(int(owner[1]), owner[2])
        else:  # another host's lock, or a plain Optuna one: Optuna's rule (its age)
            stale = time.time() - st.st_mtime > self.grace_period
        if not stale:
            return False
        moved = f"{self._lock_file}.{uuid.uuid4().hex}.stale"
        try:
            os.rename(self._lock_file, moved)
        except FileNotFoundError:
            return True
        if os.lstat(moved).st_ino != st.st_ino:  # a new, live lock replaced the stale one meanwhile: restore it
            try:
                os.link(moved, self._lock_file, follow_symlinks=False)
            except OSError:
                pass
        os.unlink(moved)
        return True
