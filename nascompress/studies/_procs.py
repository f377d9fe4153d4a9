"""Is a process of this machine still alive? (pids recorded by study workers, journal locks and
dashboard snapshots, told apart from a reused pid by the process's start time)."""

from __future__ import annotations

import os
import socket
from typing import Any


def pid_start(pid: int) -> str | None:
    """The process's start time in clock ticks (Linux), to tell a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def pid_alive(pid: int, start: str | None) -> bool:
    """True unless process ``pid`` of this machine is gone, a zombie, or another process that
    reused the pid (its start time differs from ``start``)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        if fields[0] in ("Z", "X"):  # a zombie: dead, not yet reaped
            return False
        if start is not None and fields[19] != start:  # the pid was reused
            return False
    except (OSError, IndexError):
        pass
    return True


def host() -> str:
    return socket.gethostname()


def owner_record(pid: int | None = None) -> dict[str, Any]:
    """The owner record of a folder a process makes (this host, the pid, its start time)."""
    pid = os.getpid() if pid is None else pid
    return {"host": host(), "pid": pid, "pid_start": pid_start(pid)}


def owner_gone(owner: Any) -> bool:
    """Does ``owner`` (a record of :func:`owner_record`, read from a file) name a process of this
    host that is gone? False for anything else: another host, a live process, an invalid record."""
    if not isinstance(owner, dict) or owner.get("host") != host():
        return False
    pid, start = owner.get("pid"), owner.get("pid_start")
    if type(pid) is not int or pid <= 0 or not (start is None or isinstance(start, str)):
        return False
    return not pid_alive(pid, start)
