"""Library errors name config fields, never a CLI flag (issue 51): a rule is checked once, in the
library, as a :class:`~nascompress.errors.SettingError` template (``{field}``), and each front end
words it its own way: the CLI as its command's options (``--field``), the pipeline as its section's
keys."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from nascompress.errors import NascompressError, SettingError

from .conftest import invoke

PACKAGE = Path(__file__).resolve().parents[1] / "nascompress"
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9_-]*")
# (module, flag) a user-facing library message may name literally, and why
ALLOWED = {
    ("train/distributed.py", "--nproc_per_node"): "torchrun's own option, in the torchrun command line it advises",
    **{
        ("importer/run.py", f): "a whole 'nascompress train' command line, quoted for the shell"
        for f in ("--model", "--weights", "--reset-head", "--linear-probe")
    },
    **{
        ("runs/io.py", f): "a whole command line (the pipeline's, or the recorded one of the run's writer), quoted for "
        "the shell"
        for f in ("--out", "--resume")
    },
}


def _called(f: ast.expr) -> str:
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def _messages(tree: ast.AST) -> list[ast.Constant]:
    """The string constants (f-strings' literal parts included) of raised exceptions and of the
    arguments of every call of an error class (``...Error``, ``SearchCollapsed``, ...)."""
    roots: list[ast.AST] = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Raise) and n.exc is not None:
            roots.append(n.exc)
        elif isinstance(n, ast.Call) and re.search(r"(Error|Collapsed|OffTarget|Unreachable)$", _called(n.func)):
            roots.append(n)
    seen: dict[int, ast.Constant] = {}
    for r in roots:
        for c in ast.walk(r):
            if isinstance(c, ast.Constant) and isinstance(c.value, str):
                seen[id(c)] = c
    return list(seen.values())


def test_library_messages_name_no_cli_flag():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("cli/"):
            continue
        for c in _messages(ast.parse(path.read_text(), filename=str(path))):
            for flag in FLAG.findall(c.value):
                if (rel, flag) not in ALLOWED:
                    found.append(f"nascompress/{rel}:{c.lineno}: {flag} in {c.value!r}")
    assert not found, (
        "library messages name CLI flags; write the field as a SettingError template "
        "({field_name}) instead:\n" + "\n".join(found)
    )


def test_the_scan_sees_a_flag_in_a_raised_message():
    tree = ast.parse('def f(x):\n    raise NascompressError(f"{x}: pass --force to replace it")\n')
    assert any(FLAG.search(c.value) for c in _messages(tree))


def test_a_template_names_fields_and_leaves_other_braces():
    e = SettingError("rerun the same command with {force} {epochs} 8 (in {'a': 1} and {Path})")
    assert e.fields == ("force", "epochs")
    assert str(e) == "rerun the same command with force epochs 8 (in {'a': 1} and {Path})"
    assert e.worded(lambda f: f"--{f}") == "rerun the same command with --force --epochs 8 (in {'a': 1} and {Path})"


def test_outside_a_command_the_cli_words_a_field_as_its_option():
    from nascompress.cli.common import cli_words

    assert cli_words(SettingError("rerun with {force} {max_val_drop} 100")) == "rerun with --force --max-val-drop 100"
    assert cli_words(NascompressError("as {it} is")) == "as {it} is"  # not a SettingError: no fields


def test_printed_advice_is_worded_by_the_running_front_end():
    from nascompress.cli.common import option_of
    from nascompress.errors import wording, words

    assert words("leave out {weights}") == "leave out weights"  # no front end: the field's own name
    with wording(option_of):  # what the CLI's run() sets around each library call
        assert words("leave out {weights} ({{as is}})") == "leave out --weights ({as is})"
    assert words("{max_flops}") == "max_flops"


def test_a_rule_reads_as_the_commands_option_and_as_the_pipelines_key(tmp_path):
    """DCS's arch loss rule, checked once (DCSSearchConfig): the CLI names its options, the pipeline
    file its stages.dcs keys; both refuse in one line, before anything runs."""
    from nascompress.dcs_search.search_config import DCSSearchConfig

    with pytest.raises(SettingError) as e:
        DCSSearchConfig(distill=0, feat_distill=0)
    assert e.value.fields == ("arch_loss", "distill", "feat_distill")
    out = tmp_path / "s"
    r = invoke("search", "dcs", "vit_tiny_patch16_224", "--out", out, "--distill", 0, "--feat-distill", 0)
    assert r.exit_code == 1, r.output
    assert (
        "--arch-loss kd distils from the dense model: give --distill or --feat-distill a positive weight, "
        "or use --arch-loss ce"
    ) in r.output and not out.exists()

    from .test_pipeline import tiny_config, write_config

    cfg = tiny_config()
    cfg["stages"]["dcs"].update(distill=0, feat_distill=0)
    r = invoke("pipeline", write_config(tmp_path, cfg), "--out", tmp_path / "p")
    assert r.exit_code == 1 and len(r.output.strip().splitlines()) == 1, r.output
    assert (
        "stages.dcs: arch_loss kd distils from the dense model: give distill or feat_distill a positive "
        "weight, or use arch_loss ce"
    ) in r.output and "--" not in r.output
    assert not (tmp_path / "p").exists()


def test_a_field_with_a_declared_option_reads_as_that_option(tmp_path):
    """``max_latency_ms`` is the search's ``--max-latency``: the CLI words the field through the
    command's parameter (the one mapping), not as ``--max-latency-ms``."""
    r = invoke(
        "search",
        "tokens",
        tmp_path / "base",
        "--space",
        tmp_path / "s.yaml",
        "--study",
        "x",
        "--max-flops",
        0.5,
        "--max-latency",
        3,
    )
    assert r.exit_code == 1 and "give --max-flops or --max-latency, not both" in r.output, r.output


def test_a_stage_error_at_run_time_reads_as_the_pipeline_files_keys(tmp_path):
    """A library error while a step runs: its fields as key paths of the step's section (else data,
    or the file's top level), the run's own (force) left to the pipeline command (--force)."""
    from nascompress.cli.common import cli_words
    from nascompress.pipeline import plan
    from nascompress.pipeline.run import step_error
    from nascompress.dcs_search.hooks import SearchCollapsed

    from .test_pipeline import tiny_config, write_config

    pipe = plan(write_config(tmp_path, tiny_config()), out=tmp_path / "p")
    e = step_error(
        pipe, "retrain", SettingError("loss became nan; lower {lr}, or rerun with {force} ({dataset}, {seed})")
    )
    assert str(e) == "loss became nan; lower stages.retrain.lr, or rerun with force (data.dataset, seed)"
    assert cli_words(e) == "loss became nan; lower stages.retrain.lr, or rerun with --force (data.dataset, seed)"
    stop = step_error(pipe, "dcs_search", SearchCollapsed("fell more than {max_val_drop} 5 points", "rerun"))
    assert isinstance(stop, SearchCollapsed) and str(stop) == "fell more than stages.dcs.max_val_drop 5 points; rerun"
    assert str(step_error(pipe, "base", SettingError("{embed_dim} {{x}}"))) == "base.train.embed_dim {x}"
    assert e.keys == {"lr": "stages.retrain.lr", "dataset": "data.dataset", "seed": "seed"}  # the key paths: data
    assert e.template == "loss became nan; lower {lr}, or rerun with {force} ({dataset}, {seed})"


def test_a_config_error_names_its_keys_as_data():
    """A pipeline config's validation error names the keys it is about as data (ConfigError's Key
    parts), which a front end words its own way; its text is the file's (key paths)."""
    from nascompress.pipeline import load_config
    from nascompress.pipeline.schema import ConfigError

    from .test_pipeline import tiny_config

    cfg = tiny_config()
    cfg["stages"]["dcs"]["epochs"] = -1
    with pytest.raises(ConfigError) as e:
        load_config(cfg, source="the caller")
    assert str(e.value) == "the caller: stages.dcs.epochs: must be an integer in [1, 10000], got -1"
    assert e.value.keys == ("stages.dcs.epochs",)
    assert (
        e.value.worded(lambda k: k.upper()) == "the caller: STAGES.DCS.EPOCHS: must be an integer in [1, 10000], got -1"
    )
    cfg["stages"]["dcs"] = {"epoch": 2}
    with pytest.raises(ConfigError) as e:
        load_config(cfg, source="the caller")
    assert e.value.keys == ("stages.dcs.epoch",) and str(e.value).startswith(
        "the caller: unknown key stages.dcs.epoch;"
    )
