"""Progress of long work, on stderr so that --json output stays clean.

On a terminal: rich progress bars. In a Jupyter notebook (with ipywidgets): tqdm's notebook bars
(:class:`NotebookProgress`). Anywhere else (``| tee log``, CI logs, nohup): plain,
flushed one-line reports (:class:`PlainProgress`: the task, step/total, percentage, its info such as
loss and lr, elapsed time and ETA), at most every ``NASCOMPRESS_PROGRESS_SECONDS`` seconds per task
(default 10; 0: every update) and always when a task ends; a task added with ``each=True`` (the
epochs) reports every update. :func:`step` shows a phase without steps (the DCS probe, activation
statistics, an export's checks) as a line when it starts and one when it ends, on a terminal too.
Under torchrun only rank 0 prints. ``NASCOMPRESS_PROGRESS``: ``auto`` (the default, as above),
``plain`` (plain lines on a terminal too) or ``off`` (nothing; the test suite's setting).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

console = Console(stderr=True)


_SILENT = 0  # > 0: inside silenced(), every progress display of this process is off


@contextmanager
def silenced(on: bool = True) -> Iterator[None]:
    """Inside (when ``on``): no progress line, bar or note of nascompress's, as with
    ``NASCOMPRESS_PROGRESS=off`` (a Python API call's ``progress=False``); errors are raised as ever."""
    global _SILENT
    if not on:
        yield
        return
    _SILENT, was = _SILENT + 1, console.quiet
    console.quiet = True
    try:
        yield
    finally:
        _SILENT, console.quiet = _SILENT - 1, was


def _mode() -> str:
    if _SILENT:
        return "off"
    mode = os.environ.get("NASCOMPRESS_PROGRESS", "auto").strip().lower()
    return mode if mode in ("auto", "plain", "off") else "auto"


def _main() -> bool:
    return int(os.environ.get("RANK", "0")) == 0 and _mode() != "off"


def _every() -> float:
    try:
        return max(0.0, float(os.environ.get("NASCOMPRESS_PROGRESS_SECONDS", "10")))
    except ValueError:
        return 10.0


def clock_text(s: float) -> str:
    """Seconds as ``m:ss`` (``h:mm:ss`` from an hour)."""
    s = int(round(s))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def say(line: str) -> None:
    """One plain, flushed line on stderr (rank 0 only)."""
    if _main():
        print(line, file=sys.stderr, flush=True)


@dataclass
class _Task:
    description: str
    total: float | None
    completed: float
    info: str
    start: float
    start_completed: float
    last: float
    each: bool


class PlainProgress:
    """The subset of ``rich.progress.Progress`` nascompress uses, as periodic plain lines."""

    def __init__(self, every: float | None = None):
        self.every = _every() if every is None else every
        self._tasks: dict[int, _Task] = {}
        self._next = 0

    def __enter__(self) -> "PlainProgress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self._tasks.clear()

    def add_task(
        self,
        description: str,
        total: float | None = None,
        completed: float = 0,
        info: str = "",
        each: bool = False,
        **_: Any,
    ) -> int:
        now = time.perf_counter()
        tid = self._next
        self._next += 1
        self._tasks[tid] = _Task(description, total, completed, info, now, completed, now, each)
        return tid

    def update(
        self, task: int, *, advance: float = 0, completed: float | None = None, info: str | None = None, **_: Any
    ) -> None:
        t = self._tasks.get(task)
        if t is None:
            return
        t.completed = completed if completed is not None else t.completed + advance
        if info is not None:
            t.info = info
        now = time.perf_counter()
        done = t.total is not None and t.completed >= t.total
        if done or t.each or now - t.last >= self.every:
            t.last = now
            say(self._line(t, now))

    def remove_task(self, task: int) -> None:
        self._tasks.pop(task, None)

    @staticmethod
    def _line(t: _Task, now: float) -> str:
        elapsed = now - t.start
        parts = [f"{t.description}:"]
        if t.total:
            parts.append(f"{t.completed:g}/{t.total:g} ({100 * t.completed / t.total:.0f}%)")
        else:
            parts.append(f"{t.completed:g}")
        if t.info:
            parts.append(t.info)
        parts.append(f"elapsed {clock_text(elapsed)}")
        moved = t.completed - t.start_completed
        if t.total and 0 < moved and t.completed < t.total:
            parts.append(f"ETA {clock_text(elapsed / moved * (t.total - t.completed))}")
        return "  ".join(parts)


def in_notebook() -> bool:
    """Running in a Jupyter kernel (IPython's ZMQ shell) that has ipywidgets, which tqdm's bars need."""
    ipython = sys.modules.get("IPython")  # never imported here: a notebook has it loaded already
    try:
        shell = ipython.get_ipython() if ipython is not None else None
    except Exception:  # noqa: BLE001 (an IPython that cannot answer: not a notebook)
        return False
    return type(shell).__name__ == "ZMQInteractiveShell" and importlib.util.find_spec("ipywidgets") is not None


class NotebookProgress:
    """:class:`PlainProgress`'s interface as tqdm's notebook bars, one per task."""

    def __init__(self) -> None:
        from tqdm.notebook import tqdm  # (only in a notebook: tqdm comes with timm's huggingface_hub)

        self._tqdm = tqdm
        self._bars: dict[int, Any] = {}
        self._next = 0

    def __enter__(self) -> "NotebookProgress":
        return self

    def __exit__(self, *exc: Any) -> None:
        for bar in self._bars.values():
            bar.close()
        self._bars.clear()

    def add_task(
        self, description: str, total: float | None = None, completed: float = 0, info: str = "", **_: Any
    ) -> int:
        tid = self._next
        self._next += 1
        bar = self._tqdm(total=total, desc=description, initial=completed, leave=True)
        if info:
            bar.set_postfix_str(info)
        self._bars[tid] = bar
        return tid

    def update(
        self, task: int, *, advance: float = 0, completed: float | None = None, info: str | None = None, **_: Any
    ) -> None:
        bar = self._bars.get(task)
        if bar is None:
            return
        moved = completed - bar.n if completed is not None else advance
        if moved:
            bar.update(moved)
        if info is not None:
            bar.set_postfix_str(info)

    def remove_task(self, task: int) -> None:
        bar = self._bars.pop(task, None)
        if bar is not None:
            bar.close()


def make_progress(*, disable: bool | None = None) -> Progress | PlainProgress | NotebookProgress:
    """A progress display: rich bars when stderr is a terminal, tqdm's bars in a Jupyter notebook,
    else :class:`PlainProgress` lines; ``disable=True`` shows nothing (e.g. torchrun's other ranks)."""
    mode = _mode()
    if mode == "off":
        disable = True
    elif disable is None and mode == "auto" and in_notebook():
        return NotebookProgress()
    elif disable is None and (mode == "plain" or not sys.stderr.isatty()):
        return PlainProgress()
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=bool(disable),
        transient=False,
    )


# the running pipeline's estimate of the time it has left: (fraction of its running step done, the
# fraction done before this process began it) -> a text such as "pipeline: about 6:10 left"
_PIPELINE_LEFT: ContextVar[Callable[[float, float], str] | None] = ContextVar("nascompress_pipeline_left", default=None)


@contextmanager
def pipeline_eta(left: Callable[[float, float], str]) -> Iterator[None]:
    """Inside: :func:`pipeline_left` answers with ``left`` (set by the pipeline around each step)."""
    token = _PIPELINE_LEFT.set(left)
    try:
        yield
    finally:
        _PIPELINE_LEFT.reset(token)


def pipeline_left(fraction: float, *, since: float = 0.0) -> str:
    """How long the whole pipeline has left with ``fraction`` of its running step done (``since``:
    the part done before this process, a resumed training), e.g. ``pipeline: about 6:10 left``;
    empty outside a pipeline or before it has measured anything."""
    left = _PIPELINE_LEFT.get()
    return "" if left is None else left(fraction, since)


@contextmanager
def step(what: str) -> Iterator[None]:
    """Show a phase without steps: ``what ...`` when it starts, ``what: done in 12.3 s`` when it ends."""
    t0 = time.perf_counter()
    say(f"{what} ...")
    yield
    say(f"{what}: done in {time.perf_counter() - t0:.1f} s")


@contextmanager
def counted(what: str, *, unit: str) -> Iterator[Callable[..., None]]:
    """A phase of many small steps of unknown number (the DCS search's probe forwards): the
    :func:`step` lines, and between them a progress task counting ``unit``; yields
    ``tick(n=1, info=None)``, which advances it (``info``: the sub-phase now running)."""
    with step(what):
        if not _main():
            yield lambda n=1, info=None: None
            return
        with make_progress() as prog:
            tid = prog.add_task(f"  {unit}", total=None, info="")

            def tick(n: int = 1, info: str | None = None) -> None:
                prog.update(tid, advance=n, **({} if info is None else {"info": info}))

            yield tick
