"""Small shared helpers: seeding, device choice, atomic writes, output directories."""

from __future__ import annotations

import json
import os
import random
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator
from dataclasses import fields, replace

import numpy as np
import torch

from .errors import NascompressError, SettingError, writing
from .limits import check_limit, check_path_names, env_name, limits
from .runs.owner import check_replaceable, clear_own, write_mark


def seed_everything(seed: int) -> torch.Generator:
    """Seed python, numpy and torch from one number; return a torch.Generator seeded with it."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def resolve_device(device: str | None) -> torch.device:
    if device in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise NascompressError(f"unknown device {device!r}: use cpu, cuda or cuda:N") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SettingError(f"device {device!r} requested but CUDA is not available; use {{device}} cpu")
    return dev


def machine_device(value: str | torch.device, *, field: str = "device") -> torch.device:
    """``value`` (a ``map_location``) as a device this machine has; anything else refused in one
    line naming ``field`` (not torch's AssertionError from a CPU build)."""
    try:
        dev = torch.device(value)
    except (RuntimeError, TypeError):
        raise SettingError(f"{{{field}}} {value!r} is not a device: use cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SettingError(
            f"{{{field}}} {value!r} needs CUDA, which this machine (or its torch build) has not; use {{{field}}} 'cpu'"
        )
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise SettingError(
            f"{{{field}}} {value!r}: this machine has {torch.cuda.device_count()} CUDA device(s); "
            f"use {{{field}}} 'cuda' or 'cpu'"
        )
    return dev


_UMASK = os.umask(0)
os.umask(_UMASK)


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temp path in the same directory; rename it onto ``path`` only if the block succeeds."""
    path = Path(path)
    with writing(path):  # a full disk or an unwritable folder: one line naming path
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
        tmp = Path(tmp)
        try:
            yield tmp
            os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp creates 0600; give the file the usual mode
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                tmp.unlink()


def write_json(path: str | Path, obj: Any) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def nesting_depth(obj: Any) -> int:
    """How deeply lists and dicts nest in ``obj`` (0: a scalar), counted without recursion."""
    depth, stack = 0, [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, (dict, list)):
            depth = max(depth, d)
            stack.extend((v, d + 1) for v in (o.values() if isinstance(o, dict) else o))
    return depth


def _too_deep(source: str) -> NascompressError:
    return NascompressError(
        f"{source} nests deeper than {limits().max_json_depth} levels (the max_json_depth limit): "
        "it was not written by nascompress or is damaged; replace it (or raise the limit with "
        f"{env_name('max_json_depth')}=N if it is intended)"
    )


def parse_json(text: str | bytes, *, source: str) -> Any:
    """The JSON value of ``text`` (from ``source``, named in messages), bounded in size and depth
    (:mod:`nascompress.limits`): invalid, too large or too deep JSON is one NascompressError."""
    check_limit("max_file_bytes", len(text), f"{source}'s size in bytes", fix="check the file")
    try:
        obj = json.loads(text)
    except RecursionError:
        raise _too_deep(source) from None
    except json.JSONDecodeError as e:
        raise NascompressError(
            f"{source} is not valid JSON ({e.msg} at line {e.lineno}); it was damaged or edited: replace it"
        ) from None
    except UnicodeDecodeError:
        raise NascompressError(f"{source} is not valid JSON (not UTF-8 text); replace it") from None
    if nesting_depth(obj) > limits().max_json_depth:
        raise _too_deep(source)
    return obj


def check_regular_file(path: Path, *, what: str, fix: str = "give a regular file") -> None:
    """Refuse in one line a ``path`` that is missing, or a directory, a FIFO or a device (which
    would be read without end): what it is, and ``fix``."""
    if path.is_file():
        return
    if not path.exists():
        raise NascompressError(f"{what} {path} does not exist")
    kind = "a directory" if path.is_dir() else "a named pipe (FIFO)" if path.is_fifo() else "a device or socket"
    raise NascompressError(f"{what} {path} is {kind}, not a regular file; {fix}")


def read_file_text(path: str | Path, *, what: str = "") -> str:
    """The text of a file nascompress reads, bounded in size (checked before reading: no
    ``/dev/zero`` read to the end), one line for a missing or unreadable one."""
    path = Path(path)
    name = f"{what} {path}".strip()
    check_regular_file(path, what=what or "file", fix="give the file itself")
    try:
        check_limit("max_file_bytes", path.stat().st_size, f"{name}'s size in bytes", fix="check the file")
        return path.read_text()
    except UnicodeDecodeError:
        raise NascompressError(f"{name} is not text (not UTF-8); replace it") from None
    except OSError as e:
        raise NascompressError(f"cannot read {name}: {e.strerror or e}") from None


def read_json(path: str | Path) -> Any:
    """The JSON of file ``path``, bounded in size and depth (:func:`parse_json`), in one line on error."""
    return parse_json(read_file_text(path), source=str(path))


def append_jsonl(path: str | Path, obj: Any) -> None:
    with writing(path), open(path, "a") as f:
        f.write(json.dumps(obj) + "\n")


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
