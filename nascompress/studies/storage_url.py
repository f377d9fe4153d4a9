"""``--storage`` values: the accepted forms parsed into a :class:`StorageSpec`, the project's default
files, and passwords masked wherever a storage is printed (:func:`mask_url`, :func:`scrub`); see
:mod:`nascompress.studies.storage` for the rules."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from nascompress.errors import SettingError

DEFAULT_DB = "nascompress-studies.db"
DEFAULT_JOURNAL = "nascompress-studies.journal"
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
            from sqlalchemy.engine import make_url  # ~0.25 s at start-up; PostgreSQL URLs only

            return make_url(self.url).password
        except Exception:  # an unparsable URL: mask_url's regex covers it
            return None


def mask_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (safe to print)."""
    if url.startswith("journal:") or url.startswith("sqlite:"):
        return url
    try:
        from sqlalchemy.engine import make_url  # ~0.25 s at start-up; PostgreSQL URLs only

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
    return (
        StorageSpec("sqlite", f"sqlite:///{db}", db, True),
        StorageSpec("journal", f"journal:{journal}", journal, True),
    )


def parse_storage(text: str) -> StorageSpec:
    """Parse a ``--storage`` value (see the module docstring for the accepted forms).

    Args:
        text: ``sqlite:///PATH``, ``postgresql://...`` or ``journal:PATH``.
    """
    t = text.strip()
    if t.startswith("sqlite:///"):
        path = t[len("sqlite:///") :]
        if not path or path == ":memory:":
            raise SettingError(
                f"{{storage}} {t}: give a file, e.g. sqlite:///studies.db (an in-memory database would lose the study)"
            )
        return StorageSpec("sqlite", t, Path(path))
    if t.startswith("sqlite:"):
        raise SettingError(
            f"{{storage}} {t}: write SQLite storages as sqlite:///PATH (three slashes; four for an absolute path)"
        )
    if t.startswith("postgres://"):
        t = "postgresql://" + t[len("postgres://") :]
    if re.match(r"postgresql(\+\w+)?://", t):
        return StorageSpec("postgresql", t)
    if t.startswith("journal:"):
        path = t[len("journal:") :]
        if path.startswith("//"):
            path = path[2:]
        if not path:
            raise SettingError("{storage} journal: needs a file, e.g. journal:studies.journal")
        return StorageSpec("journal", f"journal:{path}", Path(path))
    raise SettingError(f"{{storage}} {mask_url(t)} is not a storage nascompress knows: use {_FORMS}")
