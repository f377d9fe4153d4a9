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

The parts: :mod:`~nascompress.studies.storage_url` (the forms, masking),
:mod:`~nascompress.studies.storage_open` (opening the three backends),
:mod:`~nascompress.studies.journal_lock` (the journal's lock); this module finds a study's storage.
Their names are importable from here too.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from nascompress.errors import NascompressError, SettingError

from .storage_open import open_storage
from .storage_url import StorageSpec, default_storages, parse_storage

if TYPE_CHECKING:
    from optuna.storages import BaseStorage

__all__ = ["existing_storages", "find_study", "has_study", "resolve_run_storage", "study_names"]


def study_names(storage: BaseStorage) -> list[str]:
    """Names of the studies in an opened storage, sorted."""
    return sorted(s.study_name for s in storage.get_all_studies())


def has_study(storage: BaseStorage, name: str) -> bool:
    try:
        storage.get_study_id_from_name(name)
    except KeyError:
        return False
    return True


def existing_storages(
    storage: str | None = None, *, project_dir: str | Path | None = None
) -> list[tuple[StorageSpec, BaseStorage]]:
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


def find_study(
    name: str, storage: str | None = None, *, project_dir: str | Path | None = None
) -> tuple[StorageSpec, BaseStorage]:
    """The storage holding study ``name``; a clear error listing the studies that do exist.

    Args:
        name: the study name.
        storage: an explicit ``--storage``, or None to look in both default files.
        project_dir: the project directory (default: the working directory).
    """
    opened = existing_storages(storage, project_dir=project_dir)
    if not opened:
        db, journal = default_storages(project_dir)
        raise SettingError(
            f"no study named {name!r}: this directory has no studies yet (neither "
            f"{db.path.name} nor {journal.path.name} exists; pass {{storage}} to look elsewhere)"
        )
    found = [(s, st) for s, st in opened if has_study(st, name)]
    if len(found) > 1:
        raise SettingError(
            f"study {name!r} exists in both {found[0][0].display} and {found[1][0].display}: "
            "pass {storage} to choose one"
        )
    if found:
        return found[0]
    names = sorted({n for _, st in opened for n in study_names(st)})
    where = " and ".join(s.display for s, _ in opened)
    have = ", ".join(names) if names else "none"
    raise NascompressError(f"no study named {name!r} in {where}; studies there: {have}")


def resolve_run_storage(
    storage: str | None, *, study_name: str, workers: int = 1, project_dir: str | Path | None = None
) -> StorageSpec:
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
            raise SettingError(
                f"{{storage}} {spec.display} is SQLite, which is not safe for {workers} "
                "concurrent workers: use {storage} journal:PATH (one machine), "
                "postgresql://... (several machines) or {workers} 1"
            )
        return spec
    db, journal = default_storages(project_dir)
    in_db = bool(db.path and db.path.exists() and has_study(open_storage(db, create=False), study_name))
    in_journal = bool(
        journal.path and journal.path.exists() and has_study(open_storage(journal, create=False), study_name)
    )
    if in_db and in_journal:
        raise SettingError(
            f"study {study_name!r} exists in both {db.path.name} and {journal.path.name}: "
            "pass {storage} to choose one"
        )
    if in_db:
        if workers > 1:
            raise SettingError(
                f"study {study_name!r} lives in {db.path.name} (SQLite), which is not safe "
                f"for {workers} workers: continue it with {{workers}} 1, or start a new study "
                f"name (new multi-worker studies go to {journal.path.name})"
            )
        return db
    if in_journal:
        return journal
    return journal if workers > 1 else db
