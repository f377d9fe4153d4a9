"""Every dense command through Typer's CliRunner, and the bad inputs the foundation names."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import invoke, needs_fmnist

TINY = ["--embed-dim", "32", "--depth", "2", "--num-heads", "2"]


@needs_fmnist
def test_train_evaluate_profile_on_fashion_mnist(tmp_path):
    out = tmp_path / "run"
    r = invoke("train", "--out", out, *TINY, "--train-limit", 512, "--eval-limit", 256, "--epochs", 1, "--json")
    assert r.exit_code == 0, r.output
    metrics = json.loads(r.stdout)
    assert metrics["test_n"] == 256 and 0 <= metrics["test_top1"] <= 100
    for f in (
        "model.safetensors",
        "arch.json",
        "config.json",
        "metrics.json",
        "log.jsonl",
        "checkpoint.safetensors",
        "last.safetensors",
    ):
        assert (out / f).is_file(), f
    r = invoke("evaluate", out, "--eval-limit", 100, "--json", "--teacher", out)
    assert r.exit_code == 0, r.output
    ev = json.loads(r.stdout)
    assert ev["n"] == 100 and ev["agreement"] == 100.0
    r = invoke("profile", out, "--compare", out, "--iters", 2, "--batch-size", 8, "--json")
    assert r.exit_code == 0, r.output
    prof = json.loads(r.stdout)
    (m,) = [v for k, v in prof["models"].items() if "reference" not in k]
    assert m["macs"] == pytest.approx(m["flop_counter_macs"])
    assert len(m["blocks"]) == 2 and m["throughput"] > 0
    assert prof["comparison"]["flops_ratio"] == pytest.approx(1.0)
    # resume of a finished run is a no-op that still reports metrics
    r = invoke("train", "--out", out, "--resume", "--json")
    assert r.exit_code == 0, r.output


def test_profile_by_model_name():
    r = invoke("profile", "--model", "deit_tiny_patch16_224", "--no-latency", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["models"]["deit_tiny_patch16_224"]["gflops"] == pytest.approx(1.25, rel=0.02)
    r = invoke("profile", "--model", "deit_tiny_patch16_224", "--no-latency")
    assert r.exit_code == 0 and "GFLOPs" in r.stdout


def _one_line_error(r, pattern):
    assert r.exit_code != 0
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in r.output, r.output
    assert pattern in lines[0], lines[0]


@pytest.mark.parametrize(
    "args,pattern",
    [
        (["--model", "deit_smal_patch16_224"], "unknown model name"),
        (["--model", "resnet18"], "not a timm VisionTransformer"),
        (
            ["--dataset", "/nonexistent/data"],
            "neither a built-in dataset (fashion-mnist, digits, lfw-faces) nor a directory",
        ),
        (["--weights", "/nonexistent/w.safetensors"], "does not exist"),
        (["--epochs", "0"], r"--epochs must be an integer in [1, 10000], got 0"),
    ],
)
def test_train_bad_input(tmp_path, args, pattern):
    out = tmp_path / "out"
    _one_line_error(invoke("train", "--out", out, *TINY, *args), pattern)
    assert not out.exists()


def test_train_bad_weights_and_class_count(tmp_path, tiny_run):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x00garbage")
    out = tmp_path / "out"
    base = ["train", "--out", out, "--img-size", 16, *TINY, "--dataset", "synthetic"]
    _one_line_error(invoke(*base, "--weights", bad), "corrupt")
    _one_line_error(
        invoke(*base, "--weights", tiny_run / "model.safetensors", "--num-classes", 5), "class count differs"
    )
    assert not out.exists()


def test_existing_output_needs_force(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("user data")
    _one_line_error(invoke("train", "--out", out, *TINY, "--dataset", "synthetic"), "--force")
    assert (out / "precious.txt").read_text() == "user data"


def test_unwritable_output(tmp_path):
    import os

    if os.geteuid() == 0:
        file_parent = tmp_path / "afile"
        file_parent.write_text("x")
        _one_line_error(invoke("train", "--out", file_parent, *TINY, "--dataset", "synthetic"), "not a directory")
        return
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    _one_line_error(invoke("train", "--out", ro / "run", *TINY, "--dataset", "synthetic"), "not writable")


def test_evaluate_bad_inputs(tmp_path, tiny_run):
    _one_line_error(invoke("evaluate", tmp_path / "nope"), "does not exist")
    _one_line_error(invoke("evaluate", tmp_path), "no model.safetensors")
    _one_line_error(
        invoke("evaluate", tiny_run, "--split", "bogus"), "--split must be one of train, val, test"
    )  # its declared choices


def test_debug_shows_traceback(tmp_path):
    r = invoke("--debug", "evaluate", tmp_path / "nope")
    assert r.exit_code != 0 and r.exception is not None


@pytest.mark.parametrize("command", [(), ("retrain",), ("profile",), ("study", "show")])
def test_help_shows_flags_as_flags(command):
    r = invoke(*command, "--help")
    assert r.exit_code == 0, r.output
    assert "--help" in r.stdout and "<bool>" not in r.stdout, r.stdout


def test_a_flag_takes_no_value():
    r = invoke("--version")
    from nascompress import __version__

    assert r.exit_code == 0 and r.stdout.strip() == f"nascompress {__version__}"
    assert invoke("--debug", "--version").exit_code == 0
    assert invoke("profile", "--model", "test_vit", "--json", "true").exit_code != 0  # a flag, not --json <bool>


def test_shell_completion():
    r = invoke("--help")
    assert "--install-completion" in r.stdout and "--show-completion" in r.stdout
    # the script Typer installs for bash (--show-completion detects the user's shell from the process tree,
    # which a test runner's tree does not always show: the script itself is what the option prints)
    from typer._completion_shared import get_completion_script

    script = get_completion_script(prog_name="nascompress", complete_var="_NASCOMPRESS_COMPLETE", shell="bash")
    assert "_NASCOMPRESS_COMPLETE=complete_bash" in script and "complete -o default" in script
    # and what that script asks the command: the completions of a partial word
    env = dict(os.environ, _NASCOMPRESS_COMPLETE="complete_bash", COMP_WORDS="nascompress sea", COMP_CWORD="1")
    script = Path(sys.executable).parent / "nascompress"  # the installed command (its name picks the variable)
    r = subprocess.run([str(script)], env=env, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.split() == ["search"], r.stderr
