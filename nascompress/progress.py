"""Rich progress bars for long work, on stderr so that --json output stays clean."""
from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

console = Console(stderr=True)


def make_progress(*, disable: bool | None = None) -> Progress:
    """A progress display; hidden when stderr is not a terminal unless forced on."""
    if disable is None:
        disable = not sys.stderr.isatty()
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                    console=console, disable=disable, transient=False)
