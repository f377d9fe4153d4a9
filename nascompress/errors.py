"""User-facing errors. The CLI prints their message as one line and exits non-zero.

A full disk or an output that cannot be written surfaces as many exception types (``OSError``
with errno ENOSPC/EDQUOT/EROFS/EACCES/EPERM, safetensors' ``SafetensorError ... (os error 28)``,
SQLite's ``database or disk is full`` inside Optuna's ``StorageInternalError``). :func:`write_error`
recognises them all, wherever in the exception's chain, and turns them into one NascompressError
naming the path and what to do; :func:`writing` applies it to a block of writes.
"""

from __future__ import annotations

import errno
import functools
import re
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping
import importlib.util


class NascompressError(Exception):
    """A problem with the user's input: the message says what is wrong and what to do."""


class SettingError(NascompressError):
    """A rule about a stage's config fields broken. The library names fields, never a front end's
    words: ``template`` writes each field as ``{field_name}``; ``str()`` gives the bare names
    (``feat_kd``), and a front end words them its own way with :meth:`worded`: the CLI as its
    command's options (``--feat-kd``, :func:`nascompress.cli.common.run`), the pipeline as its
    section's keys (:func:`nascompress.pipeline.schema.section_error`). Advice that names a value
    writes it after the field (``rerun with {force} {epochs} 8``), so the CLI's wording is a command
    that works as written. Only ``{lower_snake}`` is a field: any other text (a path, a repr, a
    value with braces) is left as it is, so values need no escaping; ``{{`` and ``}}`` are a literal
    brace (:func:`literal` escapes a text that must never read as a field). ``keys``: the fields that
    are keys of a config file, by their key path (a pipeline step's error, ``{max_val_drop}`` as
    ``stages.dcs.max_val_drop``: :func:`nascompress.pipeline.run.step_error`): every wording names
    them by that path, and a front end that names the file's keys its own way words them from this
    data (``nc.compress``: the argument ``dcs={'max_val_drop': ...}``)."""

    def __init__(self, template: str, *, keys: Mapping[str, str] | None = None):
        self.template = template
        self.keys = dict(keys or {})  # field -> its key path in a config file
        super().__init__(self.worded())

    @property
    def fields(self) -> tuple[str, ...]:
        """The fields the message names, in order of first mention."""
        return tuple(dict.fromkeys(f for f in _FIELD.findall(self.template) if f))

    def worded(self, name: Callable[[str], str] = str) -> str:
        """The message with every field named by ``name(field)`` (default: the field's own name), a
        field of :attr:`keys` by its key path."""
        return _FIELD.sub(lambda m: self._name(m.group(1), name) if m.group(1) else m.group(0)[0], self.template)

    def _name(self, f: str, name: Callable[[str], str]) -> str:
        return self.keys[f] if f in self.keys else name(f)

    def renamed(self, template_of: Callable[[str], str]) -> str:
        """The template with every field replaced by ``template_of(field)`` (template text: a field,
        or :func:`literal` words); literal braces stay escaped."""
        return _FIELD.sub(lambda m: template_of(m.group(1)) if m.group(1) else m.group(0), self.template)


_FIELD = re.compile(r"\{\{|\}\}|\{([a-z][a-z0-9_]*)\}")  # a field in a SettingError's template, or a literal brace


def literal(text: str) -> str:
    """``text`` as a part of a :class:`SettingError` template that names no field (braces escaped)."""
    return text.replace("{", "{{").replace("}", "}}")


_WORDING: ContextVar[Callable[[str], str]] = ContextVar("nascompress_field_wording", default=str)


@contextmanager
def wording(name: Callable[[str], str]) -> Iterator[None]:
    """While the block runs, :func:`words` names fields with ``name``: the running front end's words
    (the CLI's :func:`nascompress.cli.common.option_of`, around each library call it makes)."""
    token = _WORDING.set(name)
    try:
        yield
    finally:
        _WORDING.reset(token)


def words(template: str) -> str:
    """``template`` (a :class:`SettingError` template) worded as the running front end names fields
    (:func:`wording`; outside one: the fields' own names): advice the library prints while it runs."""
    return SettingError(template).worded(_WORDING.get())


_FLAGS = ("force", "resume")  # fields that are a switch: named alone, they mean ``=True``
_CLI_WORDS = (  # the commands' words in advice, and what a Python caller does instead
    ("rerun the same command", "call the same function again"),
    ("the same command", "the same call"),
    ("'nascompress search dcs'", "nc.dcs.search"),
    ("'nascompress materialize'", "nc.materialize"),
    ("'nascompress retrain'", "nc.retrain"),
)


def python_words(
    template: str, *, call: str = "", entry: Callable[[str, str | None, bool], str | None] | None = None
) -> str:
    """A :class:`SettingError` template worded for a Python caller (the API's errors): every field
    as its argument, a field followed by a value as ``field=value`` (``{force} {epochs} 8``:
    ``force=True, epochs=8``; ``set {num_classes} 5``: ``set num_classes=5``), the commands' words
    as the call's (``rerun the same command``: ``call the same function again``); ``call`` (e.g.
    ``nc.retrain``) opens the message. ``entry(field, value, closes)``: how a caller words a field
    its own way (``value``: the word written after it, None when none; ``closes``: nothing but the
    end of a clause, ``,;:)``, follows that word), None: as an argument."""
    text = _FIELD.sub(lambda m: f"\0{m.group(1)}\0" if m.group(1) else m.group(0)[0], template)
    text = re.sub(r"\0(\w+)\0 (?![\0(])([^\s,;:)]+)", lambda m: f"\0{m.group(1)}={m.group(2)}\0", text)
    if entry is not None:  # (the markers of fields, \0field\0 and \0field=value\0; never the text between them)

        def own(m: re.Match) -> str:
            tail = re.sub(r"\0 \0", ", ", m.string[m.end() - 1 :]).replace("\0", "")  # what follows it, worded
            worded = entry(m.group(1), m.group(2), not tail or tail[0] in ",;:)")
            return m.group(0) if worded is None else f"\0{worded}\0"

        text = re.sub(r"\0(\w+)(?:=([^\0]*))?\0", own, text)
    text = re.sub(r"\0(%s)\0" % "|".join(_FLAGS), r"\0\1=True\0", text)
    text = re.sub(r"\0 \0", ", ", text).replace("\0", "")
    for cli, py in _CLI_WORDS:
        text = text.replace(cli, py)
    return f"{call}: {text}" if call and not text.startswith(call) else text


@contextmanager
def python_errors(call: str) -> Iterator[None]:
    """A Python API call's block: advice the library prints (:func:`words`) and a
    :class:`SettingError` it raises name the Python arguments (:func:`python_words`), not the
    command's options or the pipeline file's keys; the error stays a SettingError, one line."""
    with wording(lambda f: f"{f}=True" if f in _FLAGS else f):
        try:
            yield
        except SettingError as e:
            paths = e.keys  # a config file's keys: named as the file names them
            template = e.renamed(lambda f: literal(paths[f]) if f in paths else "{%s}" % f)
            raise SettingError(literal(python_words(template, call=call))) from None


def python_api(call: str) -> Callable:
    """Decorate a Python API function (``@python_api("nc.retrain")``): its body runs in
    :func:`python_errors` (its signature and docstring stay the function's)."""

    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def api(*args: Any, **kwargs: Any) -> Any:
            with python_errors(call):
                return fn(*args, **kwargs)

        return api

    return decorate


class WriteError(NascompressError):
    """A full disk or an output that cannot be written (see :func:`write_error`): not the input's
    fault, so e.g. a study stops at once instead of failing trial after trial. ``head``: the
    message without its last part (what to do once the cause is fixed), see :meth:`instead`."""

    head: str | None = None

    def instead(self, then: str) -> "WriteError":
        """The same error advising ``then`` once the cause is fixed (a caller that knows better,
        e.g. that a run continues with --resume)."""
        if self.head is None:
            return self
        e = WriteError(f"{self.head}, {then}")
        e.head = self.head
        return e


# errno -> (what is wrong, what to do)
_PROBLEMS = {
    errno.ENOSPC: ("no space is left on its disk", "free space there or choose an output on another disk"),
    errno.EDQUOT: ("the disk quota is exceeded", "free space there or choose an output on another disk"),
    errno.EROFS: ("the file system is read-only", "choose a writable output (or remount it read-write)"),
    errno.EACCES: ("permission denied", "make it writable for this user or choose another output"),
    errno.EPERM: ("operation not permitted", "make it writable for this user or choose another output"),
    errno.EFBIG: (
        "the file size limit of this shell (ulimit -f) is exceeded",
        "raise it (ulimit -f unlimited) or write a smaller file",
    ),
}
# SQLite reports these as text (sqlite3.OperationalError, wrapped by SQLAlchemy and Optuna)
_SQLITE = (
    ("database or disk is full", errno.ENOSPC),
    ("attempt to write a readonly database", errno.EROFS),
    ("unable to open database file", errno.EACCES),
    ("File too large", errno.EFBIG),
)
_OS_ERROR = re.compile(r"os error (\d+)")  # Rust's io::Error text (safetensors)


def _chain(e: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        orig = getattr(e, "orig", None)  # SQLAlchemy's DBAPIError keeps the driver's error here
        if isinstance(orig, BaseException) and id(orig) not in seen:
            yield orig
        e = e.__cause__ or e.__context__


def storage_problem(e: BaseException) -> tuple[int, str | None] | None:
    """``(errno, filename)`` when ``e`` (or an exception in its chain) says the disk is full or a
    path is not writable; None for any other failure."""
    for x in _chain(e):
        if isinstance(x, NascompressError):
            return None  # already a message for the user (a WriteError included)
        if isinstance(x, OSError) and x.errno in _PROBLEMS:
            return x.errno, x.filename if isinstance(x.filename, str) else None
        text = str(x)
        for needle, code in _SQLITE:
            if needle in text:
                return code, None
        m = _OS_ERROR.search(text)
        if m and int(m.group(1)) in _PROBLEMS:
            return int(m.group(1)), None
    return None


def write_error(
    e: BaseException,
    path: str | Path | None = None,
    *,
    then: str = "then rerun the command",
    what: str | None = None,
    verb: str = "write",
) -> WriteError | None:
    """The one-line NascompressError for a full disk or an unwritable path behind ``e`` (None when
    ``e`` is something else).

    Args:
        e: the exception raised while writing.
        path: the file or directory being written (default: the one the error names).
        then: what to do once the cause is fixed, appended to the advice.
        what: how to call the target in the message (default: the path).
        verb: ``write``, or ``access`` where the failing call may have been a read.
    """
    found = storage_problem(e)
    if found is None:
        return None
    code, filename = found
    target = what or str(path if path is not None else filename or "the output")
    problem, fix = _PROBLEMS[code]
    head = f"cannot {verb} {target}: {problem}; {fix}"
    err = WriteError(f"{head}, {then}")
    err.head = head
    return err


def require_extra(extra: str, modules: tuple[str, ...], *, what: str) -> None:
    """Refuse in one line, naming the extra to install, when a module of an optional extra
    (pyproject's ``[project.optional-dependencies]``) is missing."""
    missing = []
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a parent package missing, or a module set to None
            found = False
        if not found:
            missing.append(name)
    if missing:
        raise NascompressError(
            f"{what} needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not "
            f"installed; install nascompress's '{extra}' extra: pip install 'nascompress[{extra}]'"
        )


@contextmanager
def writing(path: str | Path, *, then: str = "then rerun the command", what: str | None = None) -> Iterator[None]:
    """Turn a full disk or an unwritable path while the block writes ``path`` into one line."""
    try:
        yield
    except Exception as e:
        err = write_error(e, path, then=then, what=what)
        if err is None:
            raise
        raise err from e
