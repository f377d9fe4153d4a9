"""What nascompress wrote, so that ``--force`` (and the Python API's ``force=``/``out=``) replaces
only that and never a file of the user's.

Every output directory nascompress creates (a run, a pipeline folder, the Python API's ``out=``)
holds a marker, :data:`MARK_FILE`, written before anything else. A directory is a nascompress
output when it has the marker, or (written before the marker existed) when it holds a nascompress
``arch.json`` or a pipeline ``config.yaml``. Inside one, every entry must be one of the files and
folders nascompress writes (:func:`foreign_entries`: the names of :data:`OWN_FILES` /
:data:`OWN_DIRS`, a nested output, the temp files of atomic writes). :func:`check_replaceable`
refuses in one line a non-empty directory that is not a nascompress output or that holds anything
else, naming the first such entry; :func:`clear_own` then removes the output's entries (the
directory itself stays: it may be a mount point or the working directory). Symbolic links are never
followed: a link is judged, and removed, as the link itself.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
from pathlib import Path

from ..errors import SettingError

MARK_FILE = ".nascompress"
MARK = {"written_by": "nascompress"}

# the file names nascompress writes inside its outputs (fnmatch patterns on the base name)
OWN_FILES = (
    MARK_FILE,
    "arch.json",
    "config.json",
    "config.yaml",
    "metrics.json",
    "model.safetensors",
    "checkpoint.safetensors",
    "last.safetensors",
    "log.jsonl",
    "summary.json",
    "pick.json",
    "report.html",
    ".pipeline.lock",
    "studies.db",
    "studies.db-journal",
    "studies.db-wal",
    "studies.db-shm",
    "preprocessor_config.json",
    ".*.tmp",  # an atomic write killed mid-way
)
# file names only inside a folder whose name matches the key (the pipeline's step markers, its
# export folder, quantize's work folder, a dashboard's snapshot)
OWN_IN = {
    "done": ("*.json",),
    "export": ("*.onnx", "*.onnx.json", "*.onnx.data", "*.pt2", "*.pt2.json"),
    ".*.quantize-*": ("*",),
    ".*.dashboard-*": ("owner.json", "snapshot-*"),
    ".*.making-dashboard-*": ("owner.json", "snapshot-*"),
}
# folder names nascompress creates inside its outputs (the pipeline's steps and stages)
OWN_DIRS = (
    "base",
    "dcs_search",
    "dcs_mat",
    "tokens",
    "dense",
    "picked",
    "final",
    "final_channel",
    "done",
    "export",
    ".*.quantize-*",  # quantize's work folder
    ".*.dashboard-*",  # a dashboard's snapshot of studies.db
    ".*.making-dashboard-*",  # one being made
)


def write_mark(out: Path, kind: str) -> None:
    """Mark ``out`` (a directory nascompress just created or claimed) as a nascompress output."""
    p = out / MARK_FILE
    if p.is_file():
        return
    tmp = out / f".{MARK_FILE}.{os.getpid()}.tmp"  # written whole, then renamed: a kill leaves no empty marker
    tmp.write_text(json.dumps({**MARK, "kind": kind}) + "\n")
    os.replace(tmp, p)


def mark_kind(d: str | Path) -> str | None:
    """The kind recorded in ``d``'s marker (``run``, ``pipeline``, ``api-copy``...), None without one."""
    p = Path(d) / MARK_FILE
    try:
        if p.is_symlink() or not p.is_file() or p.stat().st_size > 4096:
            return None
        mark = json.loads(p.read_text())
        return str(mark.get("kind", "")) if mark.get("written_by") == MARK["written_by"] else None
    except (OSError, ValueError, AttributeError):
        return None


def _marked(d: Path) -> bool:
    return mark_kind(d) is not None


def _legacy(d: Path) -> bool:
    """An output written before the marker: a run's nascompress arch.json, or a pipeline's config."""
    arch, cfg = d / "arch.json", d / "config.yaml"
    try:
        if arch.is_file() and not arch.is_symlink() and arch.stat().st_size < 1 << 20:
            return str(json.loads(arch.read_text()).get("format", "")).startswith("nascompress-arch/")
        if cfg.is_file() and not cfg.is_symlink() and cfg.stat().st_size < 1 << 20:
            return "format: nascompress-pipeline/" in cfg.read_text()
    except (OSError, ValueError, AttributeError, UnicodeDecodeError):
        return False
    return False


def is_output(d: str | Path) -> bool:
    """Whether directory ``d`` is one nascompress wrote (its marker, or a run's / pipeline's files)."""
    d = Path(d)
    return d.is_dir() and not d.is_symlink() and (_marked(d) or _legacy(d))


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def foreign_entries(d: str | Path, *, limit: int = 5) -> list[Path]:
    """Up to ``limit`` entries under the nascompress output ``d`` that nascompress did not write
    (relative paths): files and links of other names, folders of other names that are no output of
    their own, and everything below those."""
    found: list[Path] = []
    stack = [(Path(d), Path())]
    while stack and len(found) < limit:
        here, rel = stack.pop()
        try:
            entries = sorted(os.scandir(here), key=lambda e: e.name)
        except OSError:
            found.append(rel)
            continue
        allowed = OWN_FILES + tuple(p for key, ps in OWN_IN.items() if fnmatch.fnmatchcase(here.name, key) for p in ps)
        for e in entries:
            p, r = Path(e.path), rel / e.name
            if e.is_dir(follow_symlinks=False):
                if _matches(e.name, OWN_DIRS) or is_output(p):
                    stack.append((p, r))
                    continue
            elif _matches(e.name, allowed):
                continue
            found.append(r)
            if len(found) >= limit:
                break
    return found


def check_replaceable(out: str | Path, *, field: str = "out", force: str = "force") -> None:
    """Refuse in one line to replace ``out`` (an existing non-empty directory) unless nascompress
    wrote it and it holds nothing else. The ``field``/``force`` words are SettingError fields."""
    out = Path(out)
    if out.is_symlink():
        raise SettingError(
            f"{{{field}}} {out} is a symbolic link; {{{force}}} replaces only a directory nascompress "
            f"wrote, never through a link: give the directory itself or choose another {{{field}}}"
        )
    entries = sorted(p.name for p in out.iterdir())
    if not is_output(out):
        shown = ", ".join(entries[:3]) + (f" and {len(entries) - 3} more" if len(entries) > 3 else "")
        raise SettingError(
            f"{{{field}}} {out} is not a nascompress output (it holds {shown}); {{{force}}} replaces "
            f"only a run, pipeline or export nascompress wrote and never deletes other files: choose "
            f"another {{{field}}} (a new or empty directory)"
        )
    foreign = foreign_entries(out)
    if foreign:
        names = ", ".join(str(p) for p in foreign[:3]) + (" ..." if len(foreign) > 3 else "")
        raise SettingError(
            f"{{{field}}} {out} holds files nascompress did not write ({names}); {{{force}}} never "
            f"deletes them: move them out of {out} or choose another {{{field}}}"
        )


def clear_own(out: Path, *, keep: tuple[str, ...] = ()) -> None:
    """Remove the entries of the nascompress output ``out`` (checked by :func:`check_replaceable`
    first) but those named in ``keep``; ``out`` itself stays."""
    for p in list(out.iterdir()):
        if p.name in keep:
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


__all__ = ["MARK_FILE", "write_mark", "mark_kind", "is_output", "foreign_entries", "check_replaceable", "clear_own"]
