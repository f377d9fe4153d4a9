"""Every option of every command and every key of every pipeline section is generated from a setting
declared once in the library (:func:`nascompress.config.setting`: name, type, default, checks, help),
but the plumbing listed below (with the reason for each).

The walk is by introspection (click's command tree under Typer, the pipeline sections' dataclass
fields), so a command or a key added by hand later fails here."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import typing

import typer

import nascompress
from nascompress.pipeline.schema import Section, _section_type
from nascompress.pipeline.stage import config_class

# Options that are plumbing, not settings: where the output goes and how it is written, how the
# result is printed, continuing a run; no library config has them, every command means the same by them.
PLUMBING_OPTIONS = {
    "--out": "where the command writes (a run directory, a file)",
    "--force": "overwrite an existing output",
    "--resume": "continue the run in --out from its checkpoint",
    "--json": "print the result as JSON instead of text",
    "--help": "click's help",
    "--debug": "the app's switch: tracebacks instead of one-line errors",
    "--version": "the app's: print the version and exit",
    "--install-completion": "Typer's shell completion (add_completion)",
    "--show-completion": "Typer's shell completion (add_completion)",
}
# Per-command plumbing and inputs (a second input, as an argument is): (command, option) -> reason
COMMAND_PLUMBING = {
    ("profile", "--compare"): "a second run to measure, an input like the RUN_DIR argument",
    ("finetune", "--opt"): "key=value for any method or recipe setting: each key is checked against the method's "
    "declared config and recipe fields (finetune.split_settings)",
}
# Pipeline keys that are the file's structure, not settings: the format tag, the sections, and base.run
# (the dense run the pipeline starts from: its input, as a command's argument)
PIPELINE_STRUCTURE = {
    "format",
    "data",
    "base",
    "goal",
    "stages",
    "report",
    "export",
    "base.run",
    "base.train",
    "base.import",
    "stages.dcs",
    "stages.tokens",
    "stages.retrain",
}


def _library_settings() -> list[tuple[type, dataclasses.Field]]:
    """Every field declared with a ``help`` in the library's dataclasses (outside the pipeline
    sections, which generate their keys from these)."""
    for info in pkgutil.walk_packages(nascompress.__path__, "nascompress."):
        if not info.name.startswith(("nascompress.cli", "nascompress.pipeline")):
            try:
                importlib.import_module(info.name)
            except ImportError:  # optional extras (onnx, optuna-dashboard) not installed
                continue
    import sys

    seen, out = set(), []

    for mod in list(sys.modules.values()):
        if not getattr(mod, "__name__", "").startswith("nascompress.") or mod.__name__.startswith(
            ("nascompress.pipeline", "nascompress.cli")
        ):
            continue
        for obj in vars(mod).values():
            if isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj not in seen:
                seen.add(obj)
                out += [(obj, f) for f in dataclasses.fields(obj) if f.metadata.get("help")]
    return out


SETTINGS = _library_settings()


def _option_name(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or f.metadata.get("option") or f"--{f.name.replace('_', '-')}"


def _commands():
    from nascompress.cli.main import app

    root = typer.main.get_command(app)
    yield (), root
    stack = [((), root)]
    while stack:
        path, cmd = stack.pop()
        for name, sub in getattr(cmd, "commands", {}).items():
            yield (*path, name), sub
            stack.append(((*path, name), sub))


def _generated(opt: str, param) -> bool:
    """The option is a declared setting's: its option name and its help (a stage may add a note)."""
    help_text = param.help or ""
    return any(_option_name(f) == opt and help_text.startswith(f.metadata["help"]) for _, f in SETTINGS)


def test_the_walk_reaches_every_command():
    names = {" ".join(p) for p, _ in _commands()}
    assert {
        "train",
        "import",
        "evaluate",
        "profile",
        "finetune",
        "retrain",
        "materialize",
        "search dcs",
        "search tokens",
        "search joint",
        "pipeline",
        "export",
        "quantize",
        "study list",
        "study show",
        "study export",
        "study report",
        "study dashboard",
    } <= names
    assert len(SETTINGS) > 100


def test_every_cli_option_is_generated_from_a_library_setting():
    bad = []
    for path, cmd in _commands():
        for p in cmd.params:
            if p.param_type_name != "option":  # arguments: what the command acts on
                continue
            opt = max(p.opts, key=len)
            if opt in PLUMBING_OPTIONS or (" ".join(path), opt) in COMMAND_PLUMBING:
                continue
            if not _generated(opt, p):
                bad.append(f"{' '.join(path) or 'nascompress'} {opt}")
    assert not bad, "options not generated from a library setting (declare them with setting()): " + ", ".join(bad)


def _sections(cls: type, path: str = ""):
    hints = typing.get_type_hints(cls)
    for key, name in cls.keys().items():
        where = f"{path}.{key}" if path else key
        f = next(f for f in dataclasses.fields(cls) if f.name == name)
        yield where, f
        sub = _section_type(hints[name])
        if sub is not None and issubclass(sub, Section):
            yield from _sections(sub, where)


def _declared_defaults() -> dict[str, set]:
    """Option -> every default a declaration gives it: the field's default, and each
    StageSettings' default for it (a stage's recipe), wherever one is defined (CLI modules too)."""
    import sys

    from nascompress.config import StageSettings, offered

    import nascompress.cli.main  # noqa: F401  (every command module, with its StageSettings)

    out: dict[str, set] = {}
    for _, f in SETTINGS:
        d = f.default
        out.setdefault(_option_name(f), set()).add(None if d is dataclasses.MISSING else repr(d))
    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("nascompress"):
            for obj in vars(mod).values():
                if isinstance(obj, StageSettings):  # its recipe's values, None where it has no default
                    for f, d, _ in offered(obj):
                        out.setdefault(_option_name(f), set()).add(None if d is dataclasses.MISSING else repr(d))
    return out


def test_every_generated_option_has_a_declared_default():
    """A command that lists a setting's option itself writes its default there too: it must be one a
    declaration gives (the field's, or a stage's), not a third."""
    defaults, bad = _declared_defaults(), []
    for path, cmd in _commands():
        for p in cmd.params:
            if p.param_type_name != "option" or getattr(p, "is_flag", False):
                continue
            opt = max(p.opts, key=len)
            if (
                opt in PLUMBING_OPTIONS
                or (" ".join(path), opt) in COMMAND_PLUMBING
                or path[:1] == ("finetune",)
                and p.name in _method_option_names()
            ):
                continue
            if repr(p.default) not in defaults.get(opt, set()) and not (p.required and None in defaults.get(opt, ())):
                bad.append(f"{' '.join(path)} {opt}={p.default!r} (declared: {sorted(defaults.get(opt, set()))})")
    assert not bad, "options whose default no declaration gives: " + ", ".join(bad)


def _method_option_names() -> set[str]:
    from nascompress.cli.finetune import method_option_fields

    return set(method_option_fields())  # default None: the method's own (its config field's default)


def test_every_pipeline_key_is_a_library_setting_or_the_files_structure():
    names = {f.name for _, f in SETTINGS}
    bad = []
    for where, f in _sections(config_class()):  # the file's keys: the registered stages' sections too
        if where in PIPELINE_STRUCTURE:
            continue
        if any(dict(f.metadata) == dict(g.metadata) and f.name == g.name for _, g in SETTINGS):
            continue  # generated: the library field's own declaration (library_keys)
        if f.metadata.get("help") and f.name not in names:
            continue  # a setting of the pipeline alone (no command has it), declared once, here
        bad.append(where)
    assert not bad, "pipeline keys not generated from a library setting: " + ", ".join(bad)


def test_a_hand_written_option_or_key_fails_the_walk(monkeypatch):
    """The walk is not vacuous: an option written by hand (its own help) is caught."""
    import click

    p = click.Option(["--img-size"], help="Input size.")
    assert not _generated("--img-size", p)
    assert _generated(
        "--img-size",
        click.Option(
            ["--img-size"],
            help=next(
                f.metadata["help"] for _, f in SETTINGS if f.name == "img_size" and "custom ViT" in f.metadata["help"]
            ),
        ),
    )
