"""A command's output directory: created, refused where it would overwrite the command's own inputs or
something that is not a nascompress run, and the job a run recorded compared with the one given on
``--resume``."""

from __future__ import annotations

import json
import os
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from ..errors import NascompressError, SettingError, writing
from ..limits import check_path_names
from .json_io import read_json
from .owner import check_replaceable, clear_own, write_mark


def recorded_job(out: Path, job_cls: Any, command: str, *, given: Any = None, explicit: set[str] | None = None) -> Any:
    """The job stored in ``out/config.json`` by an earlier run of ``command`` (for ``--resume``),
    with ``out`` as given now. ``job_cls`` is a dataclass with ``from_dict``.

    ``given`` (the job the command built now) and ``explicit`` (the names of the options given on its
    command line): a setting those options set that differs from the recorded one is refused in one
    line naming each difference (a resumed run continues the recorded job; it cannot apply another
    epoch count or method setting halfway). Without ``explicit`` nothing is compared (a library
    caller passing a job with resolved or default values)."""
    if not (out / "config.json").is_file():
        raise NascompressError(f"nothing to resume in {out}: it has no config.json from an earlier '{command}'")
    recorded = read_json(out / "config.json")
    damaged = (
        f"{out / 'config.json'} is not the record of a '{command}' run (damaged or edited)",
        f"it cannot be continued: rerun '{command}' with {{force}} to start over",
    )  # SettingError templates
    if not isinstance(recorded, dict):
        raise SettingError(f"{damaged[0]}: it holds a JSON {type(recorded).__name__}, not an object; {damaged[1]}")
    names = {f.name for f in fields(job_cls)}  # config.json may also hold what the run derived (features, ...)
    try:
        job = replace(job_cls.from_dict({k: v for k, v in recorded.items() if k in names}), out=str(out))
    except NascompressError as e:
        raise SettingError(f"{damaged[0]}: {e}; {damaged[1]}") from None
    except (TypeError, ValueError, AttributeError, KeyError) as e:
        raise SettingError(f"{damaged[0]}: {type(e).__name__}: {e}; {damaged[1]}") from None
    if given is not None and explicit:
        diffs = resume_differences(job, given, explicit)
        if diffs:
            raise SettingError(
                f"{{resume}} continues {out} with the settings recorded in its config.json, and "
                f"{'this differs' if len(diffs) == 1 else 'these differ'}: {'; '.join(diffs)}; leave "
                f"{'it' if len(diffs) == 1 else 'them'} out to continue the run as recorded, or start "
                "a new run (another {out}, or {force})"
            )
    return job


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, str) and isinstance(b, str) and a != b and os.path.exists(a) and os.path.exists(b):
        return os.path.samefile(a, b)  # one path written two ways
    return a == b or (
        isinstance(a, (int, float))
        and isinstance(b, (int, float))
        and float(a) == float(b)
        and not isinstance(a, bool)
        and not isinstance(b, bool)
    )


def resume_differences(recorded: Any, given: Any, explicit: set[str]) -> list[str]:
    """``key value (recorded value)`` for each setting of job ``given`` that differs from job
    ``recorded`` and that an option named in ``explicit`` sets (a key part equal to the option's name:
    ``--epochs`` sets ``train.epochs``, ``--keep-rate`` ``config.keep_rate``)."""

    def as_dict(job: Any) -> dict[str, Any]:
        return json.loads(json.dumps(job.to_dict(), default=str))

    a, b = _flat(as_dict(recorded)), _flat(as_dict(given))
    diffs = []
    for key in [k for k in b if k != "out"] + [k for k in a if k not in b and k != "out"]:
        if not set(key.split(".")) & explicit or _same(a.get(key), b.get(key)):
            continue
        diffs.append(f"{key} {b.get(key)!r} (recorded {a.get(key)!r})")
    return diffs


def _ids(p: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(p)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def refuse_overwriting_inputs(out: str | Path, inputs: Any, *, field: str = "out") -> None:
    """Refuse, whatever ``--force`` says, an output ``out`` that is one of the command's ``inputs``
    (paths; None entries skipped) or a directory that contains one: writing it would replace or
    delete what the command reads. Paths are compared as the files they are (device and inode), so
    a bind mount, a hard link or another spelling of an input is the input."""
    if str(out).strip() == "":
        raise SettingError(f"{{{field}}} is empty; give the directory to write")
    dst = Path(os.path.realpath(out))
    dst_id = _ids(dst)
    for src in inputs:
        if src is None or str(src) == "":
            continue
        s = Path(os.path.realpath(src))
        same = s == dst or (dst_id is not None and _ids(s) == dst_id)
        inside = dst in s.parents or (dst_id is not None and any(_ids(p) == dst_id for p in s.parents))
        if same or inside:
            what = "is" if same else "contains"
            raise SettingError(
                f"{{{field}}} {out} {what} the command's input {src}: writing it would replace the "
                f"input (even with {{force}}); choose another {{{field}}}"
            )


def prepare_out_dir(out: str | Path, *, force: bool = False, resume: bool = False, inputs: Any = ()) -> Path:
    """Check that ``out`` may be written, without creating it.

    An existing non-empty directory is refused unless ``resume`` (it is kept) or ``force`` and it is
    a nascompress output holding nothing else (:func:`~nascompress.runs.owner.check_replaceable`:
    its entries are removed when :func:`create_out_dir` runs; any other directory is refused, so
    ``force`` never deletes a file nascompress did not write). An ``out`` that is or contains one
    of ``inputs`` (the paths the command reads) is refused whatever the flags.
    """
    refuse_overwriting_inputs(out, inputs)
    check_path_names(out)  # a name its file system cannot hold: one line, not OSError, before anything
    out = Path(out)
    if out.is_symlink() and not out.is_dir():
        raise SettingError(f"output path {out} is a symbolic link to no directory; choose another {{out}}")
    if out.exists() and not out.is_dir():
        raise SettingError(f"output path {out} exists and is not a directory; choose another {{out}}")
    if out.is_dir() and any(out.iterdir()) and not resume:
        if not force:
            raise SettingError(
                f"output directory {out} already exists; pass {{force}} to overwrite it or {{resume}} to continue it"
            )
        check_replaceable(out)
    parent = out if out.exists() else out.parent
    while not parent.exists():
        parent = parent.parent
    if not os.access(parent, os.W_OK):
        raise SettingError(f"output directory {out} is not writable; choose another {{out}}")
    return out


def create_out_dir(out: Path, *, force: bool = False, resume: bool = False, kind: str = "run") -> Path:
    """Create ``out`` (after :func:`prepare_out_dir` accepted it) and mark it as a nascompress
    output. With force, its entries (all nascompress's: checked again here) are removed first."""
    try:
        with writing(out, what=f"output directory {out}"):
            if out.is_dir() and force and not resume and any(out.iterdir()):
                check_replaceable(out)
                clear_own(out)
            out.mkdir(parents=True, exist_ok=True)
            write_mark(out, kind)
    except OSError as e:  # not a disk or permission problem (those are one line already)
        raise NascompressError(f"cannot create output directory {out}: {e.strerror}") from e
    return out
