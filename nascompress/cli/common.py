"""Shared CLI plumbing: running one library call with clean errors, printing tables/JSON."""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace
from typing import Annotated, Any, Callable, Optional, TypeVar
import dataclasses
import functools
import inspect
import shlex
import types
import typing

import typer
from typer.core import TyperOption
from rich.console import Console, ConsoleDimensions
from rich.markup import escape

from nascompress.config import (
    StageSettings,
    offered,
    option_name,
    setting_help,
    settings_class,
    tuple_item_type,
    value_kind,
)
from nascompress.data import DataConfig
from nascompress.errors import NascompressError, SettingError, wording, write_error

T = TypeVar("T")
MAIN = int(os.environ.get("RANK", "0")) == 0  # under torchrun only rank 0 prints results (errors: every rank)


def _flag_type(self: Any, ctx: Any) -> str | None:
    """Typer's rich help writes ``<bool>`` after a flag (``--json <bool>``) as if it took a value;
    a flag takes none, so it shows no type."""
    return None if self.is_flag or self.count else _option_type(self, ctx)


_option_type = TyperOption.display_type_rich
TyperOption.display_type_rich = _flag_type  # type: ignore[method-assign]


class PipedConsole(Console):
    """A console that cuts and folds nothing when its output is not a terminal (``| cat``, a file):
    rich's default width there is 80 columns, which truncates wide tables; a terminal keeps its own
    width."""

    @property
    def size(self) -> ConsoleDimensions:
        dims = Console.size.fget(self)
        return dims if self.is_terminal else ConsoleDimensions(max(dims.width, PIPED_WIDTH), dims.height)

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        Console.size.fset(self, new_size)


PIPED_WIDTH = 10_000  # wide enough for any table the commands print
# what the commands print is text (paths, names): no rich markup ("[bold]"), no emoji codes (":x:")
out = PipedConsole(quiet=not MAIN, markup=False, emoji=False)
err = Console(stderr=True, emoji=False)  # its markup only colours "error:"; messages are escaped
STATE = {"debug": False}
# options of commands that do not generate them (setting_params), with the library's help
SkipBadImages = Annotated[bool, typer.Option("--skip-bad-images", help=setting_help(DataConfig, "skip_bad_images"))]
# the data of a command that starts from a run (retrain, finetune, search, evaluate): the run's unless given
RUN_DATA = StageSettings(
    DataConfig,
    ("dataset", "data_dir", "train_limit", "eval_limit"),
    no_default=("dataset", "data_dir"),
    notes={"dataset": "Default: the run's.", "data_dir": "Default: the run's."},
)


def run(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Call a library function (the advice it prints naming this command's options:
    :func:`nascompress.errors.wording`); user errors become one stderr line and exit code 1."""
    try:
        with wording(option_of):
            return fn(*args, **kwargs)
    except NascompressError as e:
        if STATE["debug"]:
            raise
        err.print(f"[red]error:[/red] {escape(cli_words(e))}", highlight=False, soft_wrap=True)  # text, not markup
        raise typer.Exit(code=1)
    except KeyboardInterrupt:
        err.print(escape(interrupt_advice()), highlight=False, soft_wrap=True)
        raise typer.Exit(code=130)
    except typer.Exit:
        raise
    except Exception as e:  # an unexpected failure: still one line unless --debug
        if STATE["debug"]:
            raise
        full = write_error(e, verb="access")  # a full disk or a path it may not write, not named yet
        if full is not None:
            fail(str(full))
        if out_of_memory(e):
            fail(
                f"out of memory ({str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__}): "
                "lower the batch size (or the image size, the model) and rerun"
            )
        err.print(
            f"[red]error:[/red] {type(e).__name__}: {escape(str(e))} (rerun with --debug for the traceback)",
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(code=1)


def option_of(field: str) -> str:
    """The running command's option of config field ``field`` (its generated parameter of that name:
    ``--feat-kd``, or a declared ``option``; run-level ones too: ``--force``, ``--resume``, ``--out``);
    ``--field-name`` outside a command or where it has none (a positional argument is no option). The
    one translation from a library message's field names to the CLI's words."""
    try:  # typer >= 0.2x runs on its own copy of click
        from typer._click.globals import get_current_context  # typer >= 0.2x: its own copy of click
    except ImportError:
        from click import get_current_context  # older typer: click itself

    ctx = get_current_context(silent=True)
    for p in ctx.command.params if ctx is not None else ():
        if p.name == field and p.opts and p.param_type_name == "option":
            return max(p.opts, key=len)  # the long form
    return f"--{field.replace('_', '-')}"


def cli_words(e: NascompressError) -> str:
    """The message of ``e`` as the CLI words it: a :class:`~nascompress.errors.SettingError`'s fields
    named as the running command's options (:func:`option_of`)."""
    return e.worded(option_of) if isinstance(e, SettingError) else str(e)


# commands that continue their own work when rerun as they were (no --resume option)
_RERUN_CONTINUES = {
    "tokens": "the finished trials are kept in the study: rerun the same command to continue it",
    "joint": "the finished trials are kept in the study: rerun the same command to continue it",
}


def interrupt_advice() -> str:
    """What to do after a Ctrl-C, for the running command: continue it with ``--resume`` where it
    has that option (a run with checkpoints), rerun it to continue a study, else rerun it (its
    outputs are written atomically: nothing of an interrupted one is left)."""
    try:  # typer >= 0.2x runs on its own copy of click
        from typer._click.globals import get_current_context  # typer >= 0.2x: its own copy of click
    except ImportError:
        from click import get_current_context  # older typer: click itself

    ctx = get_current_context(silent=True)
    if ctx is None:
        return "interrupted"
    name = ctx.command.name or ""
    if any(p.name == "resume" for p in ctx.command.params):
        out = ctx.params.get("out_dir") or ctx.params.get("out")
        where = f" --out {shlex.quote(str(out))}" if out is not None else ""
        command = " ".join(["nascompress", *ctx.command_path.split()[1:]])  # the program's name, as installed
        return f"interrupted; the last finished epoch is checkpointed: continue with '{command} --resume{where}'"
    if name in _RERUN_CONTINUES:
        return f"interrupted; {_RERUN_CONTINUES[name]}"
    return "interrupted; nothing was written (outputs appear only once complete): rerun the command to start again"


def out_of_memory(e: BaseException) -> bool:
    """Did ``e`` come from an allocation that failed (host or GPU memory)?"""
    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError":
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text)


def given_options() -> set[str]:
    """The parameters of the running command given on its command line (or by environment), not
    defaulted: what a --resume must not silently ignore (:func:`nascompress.runs.out_dir.recorded_job`)."""
    try:  # typer >= 0.2x runs on its own copy of click
        from typer._click.globals import get_current_context  # typer >= 0.2x: its own copy of click
    except ImportError:
        from click import get_current_context  # older typer: click itself

    ctx = get_current_context(silent=True)
    if ctx is None:
        return set()
    sources = {n: ctx.get_parameter_source(n) for n in ctx.params}
    return {n for n, s in sources.items() if s is not None and s.name in ("COMMANDLINE", "ENVIRONMENT")}


def fail(msg: str) -> None:
    err.print(f"[red]error:[/red] {escape(msg)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code=1)


def parse_numbers(text: str, option: str, item: type = float) -> tuple[Any, ...]:
    """``"0.5,0.5,0.5"`` -> (0.5, 0.5, 0.5) (``item``: float or int); bad values name the option."""
    example = "0.5,0.5,0.5" if item is float else "4,7,10"
    what = "numbers" if item is float else "integers"
    try:
        vals = tuple(item(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise NascompressError(f"{option} takes comma-separated {what} such as {example}, got {text!r}") from None
    if not vals:
        raise NascompressError(f"{option} takes comma-separated {what} such as {example}, got {text!r}")
    return vals


def number_or_word(text: Any, meta: Any, kind: type | None) -> Any:
    """An option's text for a setting with ``words`` (``--align 16``, ``--align auto``): one of the
    words as it is, a number as ``kind`` (``"16"`` -> 16), anything else as given (for the library's
    check to refuse, naming what the setting takes)."""
    if not isinstance(text, str):
        return text
    t = text.strip()
    if t in (meta.get("words") or ()):
        return t
    try:
        return int(t) if kind is int else float(t)
    except ValueError:
        return text


def print_json(obj: Any) -> None:
    if MAIN:
        sys.stdout.write(json.dumps(obj, indent=2) + "\n")


def setting_params(spec: Any) -> list[Any]:
    """One keyword-only Typer option per user-facing field ``spec`` offers: a library config class
    (its fields declared with :func:`nascompress.config.setting`) or a
    :class:`~nascompress.config.StageSettings` (a stage's fields and defaults): ``--name`` (or the
    declared ``option``) with the default (none: a required option) and the help, a bool off by
    default ``--name``, an optional bool ``--name/--no-name``, for a bool with a ``flag`` that flag
    (``--no-name``, default off), for a tuple of numbers one comma-separated value, for a text
    with ``choices`` those choices as its metavar (``[int8-static|int8-dynamic]``), and for a number
    with ``words`` a text taking either (``[INTEGER|auto]``)."""
    hints = typing.get_type_hints(settings_class(spec))
    params = []
    for f, default, help in offered(spec):
        flag = f.metadata.get("flag")
        if flag:
            params.append(
                inspect.Parameter(
                    flag.lstrip("-").replace("-", "_"),
                    inspect.Parameter.KEYWORD_ONLY,
                    default=False,
                    annotation=Annotated[bool, typer.Option(flag, help=help)],
                )
            )
            continue
        tp = hints[f.name]
        decls: tuple[str, ...] = (f.metadata["option"],) if f.metadata.get("option") else ()
        required = default is dataclasses.MISSING
        extra = {"default": inspect.Parameter.empty if required else default}
        item = tuple_item_type(tp)
        if item is not None:  # e.g. --mean 0.5,0.5,0.5
            params.append(
                inspect.Parameter(
                    f.name,
                    inspect.Parameter.KEYWORD_ONLY,
                    **extra,
                    annotation=Annotated[
                        Optional[str], typer.Option(*decls, help=help, metavar=f"{item.__name__.upper()}[,...]")
                    ],
                )
            )
            continue
        args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else ()
        optional = type(None) in args or default is None
        words = f.metadata.get("words")
        if words:  # a number or one of its words (--align 16, --align auto): text, read by setting_values
            number = value_kind(tp, f.metadata)[0]
            shown = {"metavar": f"[{'|'.join(('INTEGER' if number is int else 'NUMBER', *words))}]"}
            params.append(
                inspect.Parameter(
                    f.name,
                    inspect.Parameter.KEYWORD_ONLY,
                    **extra,
                    annotation=Annotated[Optional[str] if optional else str, typer.Option(*decls, help=help, **shown)],
                )
            )
            continue
        base = next(a for a in args if a is not type(None)) if args else tp
        if base is bool:
            name = option_name(f)
            decls = (f"{name}/--no-{name[2:]}",) if optional else (name,)
        choices = f.metadata.get("choices")  # the library's, shown (the library checks the value)
        shown = {"metavar": f"[{'|'.join(map(str, choices))}]"} if choices and base is str else {}
        params.append(
            inspect.Parameter(
                f.name,
                inspect.Parameter.KEYWORD_ONLY,
                **extra,
                annotation=Annotated[Optional[base] if optional else base, typer.Option(*decls, help=help, **shown)],
            )
        )
    return params


def setting_option(spec: Any, name: str) -> Any:
    """The ``Annotated`` type of one setting ``name`` that ``spec`` offers (as :func:`setting_params`
    makes it: its type, option and help), for a command that lists its options itself (its default
    written next to it, as the stage offers it)."""
    return next(p.annotation for p in setting_params(spec) if p.name == name)


def setting_values(spec: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The values of the user-facing fields ``spec`` offers from a command's arguments (see
    :func:`setting_params`)."""
    hints = typing.get_type_hints(settings_class(spec))
    values = {}
    for f, _, _ in offered(spec):
        flag = f.metadata.get("flag")
        v = not kwargs[flag.lstrip("-").replace("-", "_")] if flag else kwargs[f.name]
        item = tuple_item_type(hints[f.name])
        if item is not None and isinstance(v, str):
            v = parse_numbers(v, option_name(f), item)
        elif f.metadata.get("words"):  # "16" -> 16, "auto" as it is (the library checks the value)
            v = number_or_word(v, f.metadata, value_kind(hints[f.name], f.metadata)[0])
        values[f.name] = v
    return values


class Settings(SimpleNamespace):
    """The values of the options one settings group generated (:func:`settings_command`), by
    attribute (``runtime.seed``); ``vars(group)`` is the mapping to pass on (``**vars(train)``)."""


def settings_command(extra: list[Any] | None = None, **groups: Any) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Decorator of a command whose signature names its settings groups: each keyword-only
    parameter named in ``groups`` (a library config class or a
    :class:`~nascompress.config.StageSettings`) stands for that group's generated options
    (:func:`setting_params`, in its place on the command line and in ``--help``) and receives their
    values: the config built from them when the parameter is annotated with the config class
    (a user error: one line, exit 1), else :class:`Settings`. The command's other parameters are
    its own options and arguments, as written; ``extra``: further generated parameters, given to the
    command's ``**kwargs`` (``finetune``'s method options). One shared helper builds every command's
    settings."""

    def deco(fn: Callable[..., T]) -> Callable[..., T]:
        sig = inspect.signature(fn, eval_str=True)
        params, own = [], []
        for p in sig.parameters.values():
            if p.name in groups:
                params += setting_params(groups[p.name])
            elif p.kind is inspect.Parameter.VAR_KEYWORD:
                params += extra or []
            else:
                params.append(p.replace(kind=inspect.Parameter.KEYWORD_ONLY))
                own.append(p.name)
        built = {
            name: sig.parameters[name].annotation
            for name in groups
            if isinstance(sig.parameters[name].annotation, type) and sig.parameters[name].annotation is not Settings
        }

        def gather(kw: dict[str, Any]) -> dict[str, Any]:
            values = {}
            for name, spec in groups.items():
                vals = setting_values(spec, kw)
                values[name] = built[name](**vals) if name in built else Settings(**vals)
            return values

        @functools.wraps(fn)
        def command(**kw: Any) -> T:
            values = run(gather, kw)  # a bad value: one line naming its option
            rest = {p.name: kw[p.name] for p in extra or []}
            return fn(**{n: kw[n] for n in own}, **values, **rest)

        command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        return command

    return deco
