"""Opening a parsed storage, every failure one line: SQLite and PostgreSQL through Optuna's
``RDBStorage`` (the installed PostgreSQL driver, a connect timeout), journal files through
``JournalStorage`` on :class:`CheckedJournalBackend` with
:class:`~nascompress.studies.journal_lock.OwnedJournalLock`. A file storage must be a regular file
(a FIFO would block its opening forever, a device such as ``/dev/zero`` would be read without end)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import warnings
from typing import TYPE_CHECKING, Any, Iterator
import importlib.util

from optuna.storages import JournalStorage, RDBStorage
from optuna.storages.journal import JournalFileBackend

from nascompress.errors import NascompressError, write_error
from nascompress.limits import env_name, limits
from nascompress.runs.json_io import check_regular_file

from .journal_lock import OwnedJournalLock
from .storage_url import StorageSpec, scrub

if TYPE_CHECKING:
    from optuna.storages import BaseStorage

CONNECT_TIMEOUT_S = 10


def open_storage(spec: StorageSpec, *, create: bool = True) -> BaseStorage:
    """Open a storage; every failure becomes one :class:`NascompressError` line.

    Args:
        spec: the storage.
        create: create a missing SQLite or journal file (False: refuse, for read-only commands).
    """
    if spec.kind in ("sqlite", "journal"):
        assert spec.path is not None
        if not spec.path.exists():
            if not create:
                raise NascompressError(f"storage {spec.display} does not exist (no file {spec.path})")
            if not spec.path.parent.is_dir():
                raise NascompressError(
                    f"cannot create storage {spec.display}: directory {spec.path.parent} does not exist"
                )
            if not os.access(spec.path.parent, os.W_OK):
                raise NascompressError(
                    f"cannot create storage {spec.display}: directory {spec.path.parent} is not writable"
                )
        elif spec.path.is_dir():
            raise NascompressError(f"storage {spec.display} is a directory, not a file")
        else:  # before anything opens it: a FIFO blocks open() forever, a device is read without end
            form = "sqlite:///PATH" if spec.kind == "sqlite" else "journal:PATH"
            check_regular_file(spec.path, what="storage", fix=f"give {form} of a study file")
    if spec.kind == "journal":
        return _open_journal(spec)
    return _open_rdb(spec)


@contextlib.contextmanager
def creation_lock(spec: StorageSpec) -> Iterator[None]:
    """Hold an exclusive lock on the folder of an SQLite or journal storage (``flock`` on the folder
    itself: no file is left behind; released by the OS if the process dies) while a storage or a
    study is created, so two processes creating one new storage or study at once both succeed
    (SQLite: Optuna's schema setup is not safe to run twice at once, ``UNIQUE constraint failed:
    alembic_version``). Other storages: no lock."""
    if spec.kind not in ("sqlite", "journal") or spec.path is None:
        yield
        return
    import fcntl  # POSIX only: SQLite and journal storages lock with it

    try:
        fd = os.open(spec.path.parent, os.O_RDONLY)
    except OSError:  # a missing folder: refused by the caller in words
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


class CheckedJournalBackend(JournalFileBackend):
    """Optuna's journal file backend, read defensively: the file is read only if it is a regular
    file, no record longer than the ``max_journal_record_bytes`` limit is read into memory, and a
    line that is not an Optuna journal record (a JSON object with an integer ``op_code`` and a
    ``worker_id``) is one :class:`NascompressError` naming the storage and the line. As in Optuna,
    only what the file held when a read began is read, and an unfinished last line (a record being
    written) is left for the next read. :attr:`line` is the line of the record last handed out."""

    def __init__(self, path: str, lock: OwnedJournalLock, display: str) -> None:
        super().__init__(path, lock_obj=lock)
        self.display = display
        self.line = 0
        self._offsets = {0: 0}  # line number -> where it starts in the file (the lines read so far)

    def _damaged(self, line: int, why: str) -> NascompressError:
        return NascompressError(
            f"storage {self.display}: line {line} {why}: the file is not an Optuna journal, or it is "
            "damaged there; give the study's journal file (a journal:PATH that does not exist starts a new one)"
        )

    def read_logs(self, log_number_from: int) -> Iterator[dict[str, Any]]:
        cap = limits().max_journal_record_bytes
        fd = os.open(self._file_path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO swapped in: no blocking open
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise NascompressError(f"storage {self.display} is not a regular file; give a journal file")
            number, pos = 0, 0
            if log_number_from in self._offsets:
                number, pos = log_number_from, self._offsets[log_number_from]
                f.seek(pos)
            while pos < st.st_size:
                raw = f.readline(min(cap + 1, st.st_size - pos))
                if not raw:
                    return
                if not raw.endswith(b"\n"):
                    if len(raw) > cap:
                        raise NascompressError(
                            f"storage {self.display}: line {number + 1} is longer than {cap:,} bytes, the "
                            "limit of a journal record (max_journal_record_bytes): the file is not an Optuna "
                            f"journal, or it is damaged; if it is intended, raise the limit with "
                            f"{env_name('max_journal_record_bytes')}=N"
                        )
                    if not raw.startswith(b"{"):
                        raise self._damaged(number + 1, "is not an Optuna journal record")
                    return  # a record being written: the next read takes it
                pos += len(raw)
                self._offsets[number + 1] = pos
                number += 1
                if number <= log_number_from:
                    continue
                try:
                    log = json.loads(raw)
                except ValueError:  # not JSON, or not UTF-8
                    raise self._damaged(number, "is not JSON") from None
                if not (
                    isinstance(log, dict) and type(log.get("op_code")) is int and isinstance(log.get("worker_id"), str)
                ):
                    raise self._damaged(number, "is not an Optuna journal record")
                self.line = number
                yield log


def _open_journal(spec: StorageSpec) -> BaseStorage:
    backend = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            lock = OwnedJournalLock(str(spec.path))
            backend = CheckedJournalBackend(str(spec.path), lock, spec.display)
            return JournalStorage(backend)  # replays the whole file
    except NascompressError:
        raise
    except OSError as e:
        raise NascompressError(f"cannot open storage {spec.display}: {e.strerror}") from None
    except (ValueError, KeyError, TypeError, AttributeError, IndexError, AssertionError):
        # a record Optuna's replay cannot apply (an unknown op_code, a missing or mistyped field);
        # no line of this process is in the file yet, so none of Optuna's own errors arise here
        if backend is None:
            raise
        raise backend._damaged(backend.line, "is not a valid Optuna journal record") from None


def _driver_url(url: str) -> str:
    """A plain ``postgresql://`` URL with the driver that is installed (SQLAlchemy's default
    differs between versions: psycopg2 up to 2.0, psycopg 3 from 2.1)."""
    if not url.startswith("postgresql://"):
        return url
    for module, dialect in (("psycopg", "psycopg"), ("psycopg2", "psycopg2")):
        if importlib.util.find_spec(module) is not None:
            return f"postgresql+{dialect}://" + url[len("postgresql://") :]
    return url


def _open_rdb(spec: StorageSpec) -> BaseStorage:
    url = spec.url
    if spec.kind == "postgresql":
        url = _driver_url(url)
        engine_kwargs = {"pool_pre_ping": True, "connect_args": {"connect_timeout": CONNECT_TIMEOUT_S}}
    else:
        engine_kwargs = {"connect_args": {"timeout": 30}}  # wait for the heartbeat thread's writes
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with creation_lock(spec):  # SQLite: one process at a time sets up a new file's schema
                return RDBStorage(url, engine_kwargs=engine_kwargs)
    except ImportError as e:
        raise NascompressError(
            f"cannot open storage {spec.display}: no PostgreSQL driver is installed "
            f"({e}); pip install 'psycopg[binary]'"
        ) from None
    except Exception as e:  # SQLAlchemy / driver / Optuna schema errors
        full = write_error(e, what=f"study storage {spec.display}", then="then rerun the command")
        raise full or NascompressError(_rdb_error(spec, e)) from None


def _rdb_error(spec: StorageSpec, e: Exception) -> str:
    """One line: which storage, which host, why."""
    orig = getattr(e, "orig", None) or e
    text = scrub(str(orig), spec)
    first = text.strip().splitlines()[0] if text.strip() else type(orig).__name__
    if spec.kind == "sqlite":
        if "file is not a database" in text:
            reason = "the file is not an SQLite database"
        elif "unable to open database file" in text:
            reason = "the file cannot be opened (check the path and its permissions)"
        elif "no longer compatible" in text or "schema" in text.lower():
            reason = f"its Optuna schema does not match this Optuna version ({first})"
        else:
            reason = first
        return f"cannot open storage {spec.display}: {reason}"
    host = _pg_host(spec)
    low = text.lower()
    m_db = re.search(r'database "([^"]+)" does not exist', text)
    m_user = re.search(r'(?:password authentication failed|authentication failed) for user "([^"]+)"', text)
    m_role = re.search(r'role "([^"]+)" does not exist', text)
    if "connection refused" in low:
        reason = "connection refused (is PostgreSQL running and listening there?)"
    elif m_user:
        reason = f"authentication failed for user {m_user.group(1)} (check the user and password)"
    elif m_role:
        reason = f"user {m_role.group(1)} does not exist"
    elif m_db:
        reason = f"unknown database {m_db.group(1)} (create it first: createdb {m_db.group(1)})"
    elif "could not translate host name" in low or "name or service not known" in low:
        reason = "unknown host name"
    elif "timeout" in low or "timed out" in low:
        reason = f"no answer within {CONNECT_TIMEOUT_S} s (timed out)"
    elif "no longer compatible" in low:
        reason = f"its Optuna schema does not match this Optuna version ({first})"
    else:
        reason = first
    return f"cannot open storage {spec.display}: PostgreSQL at {host}: {reason}"


def _pg_host(spec: StorageSpec) -> str:
    try:
        from sqlalchemy.engine import make_url  # ~0.25 s at start-up; PostgreSQL storages only

        u = make_url(spec.url)
        return f"{u.host or 'localhost'}:{u.port or 5432}"
    except Exception:
        return "?"
