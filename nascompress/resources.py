"""The files shipped inside the package: the search spaces (``nascompress/search_spaces/*.yaml``)
and the pipeline configs (``nascompress/configs/*.yaml``). A user names one by its file name
without ``.yaml`` (``--space evit``, ``nascompress pipeline fashion-mnist``) or gives a path; an
existing file always wins over a shipped name (a folder does not). They are package data, so they are found the same
way from a checkout and from an installed wheel (the repository's top-level ``search_spaces/`` and
``configs/`` are links to these folders)."""

from __future__ import annotations

from pathlib import Path

from .errors import NascompressError

PACKAGE_DIR = Path(__file__).resolve().parent
FOLDERS = {"search space": PACKAGE_DIR / "search_spaces", "config file": PACKAGE_DIR / "configs"}


def shipped_names(what: str) -> list[str]:
    """The names of the shipped files of kind ``what`` (``search space`` or ``config file``), sorted."""
    return sorted(p.stem for p in FOLDERS[what].glob("*.yaml"))


def shipped_path(what: str, name: str) -> Path | None:
    """The shipped file of kind ``what`` called ``name`` (``evit`` or ``evit.yaml``), None if none is."""
    stem = name.removesuffix(".yaml")
    if not stem or "/" in stem or "\\" in stem or stem.startswith("."):
        return None
    p = FOLDERS[what] / f"{stem}.yaml"
    return p if p.is_file() else None


def resolve_file(value: str | Path, *, what: str) -> Path:
    """The file a user means by ``value``: an existing path as given, else the shipped file of that
    name; neither is one error naming the shipped files."""
    p = Path(value).expanduser()
    if p.is_file():
        return p
    found = shipped_path(what, str(value))
    if found is not None:  # also where a folder of that name is here (pipeline demo --out demo, rerun)
        return found
    if p.exists():
        return p  # not a file: its reader says so
    raise NascompressError(
        f"{what} {value} does not exist: give a YAML file or the name of a shipped "
        f"{what} ({', '.join(shipped_names(what))})"
    )


__all__ = ["FOLDERS", "PACKAGE_DIR", "resolve_file", "shipped_names", "shipped_path"]
