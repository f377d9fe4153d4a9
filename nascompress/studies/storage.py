"""Where nascompress studies live: parsing ``--storage``, opening it with one-line errors.

Accepted storages:

- nothing (the default): the project directory (the current working directory) holds
  ``nascompress-studies.db``, an SQLite file; the same file holds every study of a project
  directory. Studies run with several local workers live in ``nascompress-studies.journal``
  instead (see below), and every study command looks a study name up in both default files.
- ``sqlite:///PATH`` (relative to the working directory; ``sqlite:////abs/path`` for an
  absolute one).
- ``postgresql://USER:PASSWORD@HOST:PORT/DB``: opened with the installed driver, psycopg 3
  (``psycopg[binary]``, a nascompress dependency) or else psycopg2; ``postgresql+psycopg2://``
  or ``postgresql+psycopg://`` pick one. Opened with ``pool_pre_ping`` and a 10 s connect
  timeout.
- ``journal:PATH``: Optuna's ``JournalStorage`` on a ``JournalFileBackend`` (an append-only
  log guarded by a lock file; safe for several processes on one machine). The lock is Optuna's
  symlink lock (``PATH.lock``) with its owner written into the link itself (host, pid, process
  start, :class:`OwnedJournalLock`): a lock left by a killed process of this machine is taken
  over at once, where Optuna would wait 30 s and warn; a lock of unknown owner (another host, an
  older writer) is broken after Optuna's 30 s.

Several workers. SQLite has no row locking and fails with "database is locked" under several
writers (Optuna's FAQ), so it is never used by more than one worker:

- ``--workers N`` (N > 1) with the default storage runs the study in the project's journal
  file ``nascompress-studies.journal``; a study that already lives in the default SQLite file
  is refused with N > 1 (continue it with one worker, or start a new name).
- An explicit ``sqlite:///`` storage with N > 1 is refused with a one-line error that suggests
  ``journal:PATH`` (one machine) or ``postgresql://`` (several machines).
- Several machines share one PostgreSQL database, each running the same command.

Passwords are never printed: :func:`mask_url` renders a storage with its password masked and
every message goes through it (:attr:`StorageSpec.display`). A storage that cannot be opened
raises :class:`~nascompress.errors.NascompressError` naming the storage, the host and the reason.
"""
from __future__ import annotations

import json
import os
import re
import time
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from optuna.storages.journal import JournalFileSymlinkLock

from nascompress.errors import NascompressError, write_error

from ._procs import host, pid_alive, pid_start

if TYPE_CHECKING:
    from optuna.storages import BaseStorage

DEFAULT_DB = "nascompress-studies.db"
DEFAULT_JOURNAL = "nascompress-studies.journal"
CONNECT_TIMEOUT_S = 10
_FORMS = "sqlite:///PATH, postgresql://USER:PASSWORD@HOST:PORT/DB or journal:PATH"


@dataclass(frozen=True)
class StorageSpec:
    """A parsed storage.

    Attributes:
        kind: ``sqlite``, ``postgresql`` or ``journal``.
        url: the full URL (for journal: ``journal:PATH``). It may hold a password: print
            :attr:`display` instead.
        path: the file of an SQLite or journal storage, else None.
        default: True for the project's default files.
    """

    kind: str
    url: str
    path: Path | None = None
    default: bool = False

    @property
    def display(self) -> str:
        """The storage as it may be printed (password masked)."""
        return mask_url(self.url)

    @property
    def password(self) -> str | None:
        if self.kind != "postgresql":
            return None
        try:
            from sqlalchemy.engine import make_url

            return make_url(self.url).password
        except Exception:  # an unparsable URL: mask_url's regex covers it
            return None


def mask_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (safe to print)."""
    if url.startswith("journal:") or url.startswith("sqlite:"):
        return url
    try:
        from sqlalchemy.engine import make_url

        u = make_url(url)
        if u.password is None:
            return url
        return u.render_as_string(hide_password=True)
    except Exception:  # not parsable by SQLAlchemy: mask anything between "user:" and the last "@"
        return re.sub(r"(://[^:/@\s]*:).*@", r"\1***@", url)


def scrub(text: str, spec: StorageSpec) -> str:
    """``text`` with the storage's password (if any) replaced by ``***``."""
    pw = spec.password
    return text.replace(pw, "***") if pw else text


def default_storages(project_dir: str | Path | None = None) -> tuple[StorageSpec, StorageSpec]:
    """The project's default SQLite file and journal file (whether or not they exist)."""
    d = Path(project_dir) if project_dir is not None else Path.cwd()
    db = d / DEFAULT_DB
    journal = d / DEFAULT_JOURNAL
    return (StorageSpec("sqlite", f"sqlite:///{db}", db, True),
            StorageSpec("journal", f"journal:{journal}", journal, True))


def parse_storage(text: str) -> StorageSpec:
    """Parse a ``--storage`` value (see the module docstring for the accepted forms).

    Args:
        text: ``sqlite:///PATH``, ``postgresql://...`` or ``journal:PATH``.
    """
    t = text.strip()
    if t.startswith("sqlite:///"):
        path = t[len("sqlite:///"):]
        if not path or path == ":memory:":
            raise NascompressError(f"--storage {t}: give a file, e.g. sqlite:///studies.db (an in-memory "
                                   "database would lose the study)")
        return StorageSpec("sqlite", t, Path(path))
    if t.startswith("sqlite:"):
        raise NascompressError(f"--storage {t}: write SQLite storages as sqlite:///PATH (three slashes; "
                               "four for an absolute path)")
    if t.startswith("postgres://"):
        t = "postgresql://" + t[len("postgres://"):]
    if re.match(r"postgresql(\+\w+)?://", t):
        return StorageSpec("postgresql", t)
    if t.startswith("journal:"):
        path = t[len("journal:"):]
        if path.startswith("//"):
            path = path[2:]
        if not path:
            raise NascompressError("--storage journal: needs a file, e.g. journal:studies.journal")
        return StorageSpec("journal", f"journal:{path}", Path(path))
    raise NascompressError(f"--storage {mask_url(t)} is not a storage nascompress knows: use {_FORMS}")


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
                raise NascompressError(f"cannot create storage {spec.display}: directory {spec.path.parent} "
                                       "does not exist")
            if not os.access(spec.path.parent, os.W_OK):
                raise NascompressError(f"cannot create storage {spec.display}: directory {spec.path.parent} "
                                       "is not writable")
        elif spec.path.is_dir():
            raise NascompressError(f"storage {spec.display} is a directory, not a file")
    if spec.kind == "journal":
        return _open_journal(spec)
    return _open_rdb(spec)


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


def _open_journal(spec: StorageSpec) -> BaseStorage:
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            lock = OwnedJournalLock(str(spec.path))
            return JournalStorage(JournalFileBackend(str(spec.path), lock_obj=lock))
    except (ValueError, UnicodeDecodeError, KeyError) as e:
        raise NascompressError(f"cannot open storage {spec.display}: it is not an Optuna journal file "
                               f"({type(e).__name__}: {e})") from None
    except OSError as e:
        raise NascompressError(f"cannot open storage {spec.display}: {e.strerror}") from None


def _driver_url(url: str) -> str:
    """A plain ``postgresql://`` URL with the driver that is installed (SQLAlchemy's default
    differs between versions: psycopg2 up to 2.0, psycopg 3 from 2.1)."""
    if not url.startswith("postgresql://"):
        return url
    import importlib.util

    for module, dialect in (("psycopg", "psycopg"), ("psycopg2", "psycopg2")):
        if importlib.util.find_spec(module) is not None:
            return f"postgresql+{dialect}://" + url[len("postgresql://"):]
    return url


def _open_rdb(spec: StorageSpec) -> BaseStorage:
    from optuna.storages import RDBStorage

    url = spec.url
    if spec.kind == "postgresql":
        url = _driver_url(url)
        engine_kwargs = {"pool_pre_ping": True, "connect_args": {"connect_timeout": CONNECT_TIMEOUT_S}}
    else:
        engine_kwargs = {"connect_args": {"timeout": 30}}  # wait for the heartbeat thread's writes
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return RDBStorage(url, engine_kwargs=engine_kwargs)
    except ImportError as e:
        raise NascompressError(f"cannot open storage {spec.display}: no PostgreSQL driver is installed "
                               f"({e}); pip install 'psycopg[binary]'") from None
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
        from sqlalchemy.engine import make_url

        u = make_url(spec.url)
        return f"{u.host or 'localhost'}:{u.port or 5432}"
    except Exception:
        return "?"


def study_names(storage: BaseStorage) -> list[str]:
    """Names of the studies in an opened storage, sorted."""
    return sorted(s.study_name for s in storage.get_all_studies())


def has_study(storage: BaseStorage, name: str) -> bool:
    try:
        storage.get_study_id_from_name(name)
    except KeyError:
        return False
    return True


def existing_storages(storage: str | None = None, *,
                      project_dir: str | Path | None = None) -> list[tuple[StorageSpec, BaseStorage]]:
    """The storages a read-only study command looks in, opened.

    Args:
        storage: an explicit ``--storage`` (must exist), or None for the project's default
            files (those that exist; none is created).
        project_dir: the project directory (default: the working directory).
    """
    if storage is not None:
        spec = parse_storage(storage)
        return [(spec, open_storage(spec, create=False))]
    return [(s, open_storage(s, create=False)) for s in default_storages(project_dir) if s.path and s.path.exists()]


def find_study(name: str, storage: str | None = None, *,
               project_dir: str | Path | None = None) -> tuple[StorageSpec, BaseStorage]:
    """The storage holding study ``name``; a clear error listing the studies that do exist.

    Args:
        name: the study name.
        storage: an explicit ``--storage``, or None to look in both default files.
        project_dir: the project directory (default: the working directory).
    """
    opened = existing_storages(storage, project_dir=project_dir)
    if not opened:
        db, journal = default_storages(project_dir)
        raise NascompressError(f"no study named {name!r}: this directory has no studies yet (neither "
                               f"{db.path.name} nor {journal.path.name} exists; pass --storage to look elsewhere)")
    found = [(s, st) for s, st in opened if has_study(st, name)]
    if len(found) > 1:
        raise NascompressError(f"study {name!r} exists in both {found[0][0].display} and {found[1][0].display}: "
                               "pass --storage to choose one")
    if found:
        return found[0]
    names = sorted({n for _, st in opened for n in study_names(st)})
    where = " and ".join(s.display for s, _ in opened)
    have = ", ".join(names) if names else "none"
    raise NascompressError(f"no study named {name!r} in {where}; studies there: {have}")


def resolve_run_storage(storage: str | None, *, study_name: str, workers: int = 1,
                        project_dir: str | Path | None = None) -> StorageSpec:
    """Choose the storage of a study run (see the module docstring for the rules).

    Args:
        storage: an explicit ``--storage``, or None for the project's default files.
        study_name: the study to create or continue.
        workers: worker processes on this machine (SQLite is refused for more than one).
        project_dir: the project directory (default: the working directory).
    """
    if storage is not None:
        spec = parse_storage(storage)
        if spec.kind == "sqlite" and workers > 1:
            raise NascompressError(f"--storage {spec.display} is SQLite, which is not safe for {workers} "
                                   "concurrent workers: use --storage journal:PATH (one machine), "
                                   "postgresql://... (several machines) or --workers 1")
        return spec
    db, journal = default_storages(project_dir)
    in_db = bool(db.path and db.path.exists() and has_study(open_storage(db, create=False), study_name))
    in_journal = bool(journal.path and journal.path.exists()
                      and has_study(open_storage(journal, create=False), study_name))
    if in_db and in_journal:
        raise NascompressError(f"study {study_name!r} exists in both {db.path.name} and {journal.path.name}: "
                               "pass --storage to choose one")
    if in_db:
        if workers > 1:
            raise NascompressError(f"study {study_name!r} lives in {db.path.name} (SQLite), which is not safe "
                                   f"for {workers} workers: continue it with --workers 1, or start a new study "
                                   f"name (new multi-worker studies go to {journal.path.name})")
        return db
    if in_journal:
        return journal
    return journal if workers > 1 else db
