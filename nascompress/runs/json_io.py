"""Files written atomically (:func:`atomic_path`) and JSON read and written safely: a damaged, too deep
or too large file is one error line naming it, never a traceback."""

from __future__ import annotations

import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from ..errors import NascompressError, writing
from ..limits import check_limit, env_name, limits


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
