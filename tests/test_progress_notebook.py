"""Progress in a Jupyter notebook: tqdm's notebook bars (a fake kernel and a recording tqdm stand in
for Jupyter here); plain lines where the kernel lacks ipywidgets; rich bars and plain lines elsewhere
are tested with the commands (test_ecosystem)."""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest

from nascompress import progress


class ZMQInteractiveShell:  # the class name IPython's Jupyter kernel has
    pass


class Bar:
    made: list["Bar"] = []

    def __init__(self, total=None, desc="", initial=0, leave=True):
        self.total, self.desc, self.n, self.postfix, self.closed = total, desc, initial, "", False
        Bar.made.append(self)

    def update(self, n):
        self.n += n

    def set_postfix_str(self, s):
        self.postfix = s

    def close(self):
        self.closed = True


@pytest.fixture
def notebook(monkeypatch):
    monkeypatch.setenv("NASCOMPRESS_PROGRESS", "auto")
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=ZMQInteractiveShell))
    monkeypatch.setitem(sys.modules, "tqdm.notebook", types.SimpleNamespace(tqdm=Bar))
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "ipywidgets" else real(name, *a)
    )
    Bar.made.clear()


def test_a_notebook_gets_tqdm_bars_that_follow_the_tasks(notebook):
    assert progress.in_notebook()
    with progress.make_progress() as prog:
        assert isinstance(prog, progress.NotebookProgress)
        epochs = prog.add_task("epochs", total=3, info="val -")
        prog.update(epochs, advance=1, info="val 81.0%")
        prog.update(epochs, completed=3)
        steps = prog.add_task("epoch 1", total=None)
        prog.update(steps, advance=5)
        prog.remove_task(steps)
    bar, inner = Bar.made
    assert (bar.desc, bar.total, bar.n, bar.postfix) == ("epochs", 3, 3, "val 81.0%")
    assert inner.n == 5 and inner.closed and bar.closed


def test_a_kernel_without_ipywidgets_or_another_shell_gets_plain_lines(notebook, monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert not progress.in_notebook()
    assert isinstance(progress.make_progress(), progress.PlainProgress)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: None))  # a terminal IPython
    assert not progress.in_notebook()
    monkeypatch.setenv("NASCOMPRESS_PROGRESS", "plain")  # the user's choice wins in a notebook too
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=ZMQInteractiveShell))
    assert isinstance(progress.make_progress(), progress.PlainProgress)
