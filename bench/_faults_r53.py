"""The fault table's cases of issue 53 (the reliability round), named ``r53-*``: an output that is its
input, arch.json's input section, bounded search spaces, deep JSON, damaged run files on --resume,
unbounded options, wrong acceptances, Ctrl-C advice and leftovers, and the minor ones.

Run only these (from the repository root)::

    python bench/faults.py --only r53- --out bench/results/faults_r53.json

:func:`round53_cases` is called by ``bench/faults.py`` with its :class:`~_faults.Table`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import optuna
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from _common import ROOT
from _faults import PIPELINE, TINY, Case, Ran, Table, digest, error_line, finished_outputs, judge_refusal, snapshot

DEEP = "[" * 1_000_000 + "]" * 1_000_000


def _space(params: str, method: str = "evit") -> str:
    return f"format: nascompress-space/1\nname: t\nmethods:\n  - name: {method}\n    params:\n      {params}\n"


def round53_cases(t: Table) -> None:
    """The cases of issue 53 (see the module docstring)."""
    base = t.base_run()

    def refuse(
        c: Case, d: Path, args: list[Any], must: str, *, out: str | None = None, env: dict[str, str] | None = None
    ) -> Ran:
        before = snapshot(d)
        c.command = "nascompress " + " ".join(map(str, args))
        r = t.nc(args, d, timeout=180, env=env)
        judge_refusal(c, r, must)
        c.partial_outputs = finished_outputs(d, before)
        if out is not None and (d / out).exists() and out not in before:
            c.partial_outputs.append(out + " (created)")
        return r

    def plain_model(d: Path, edit: Callable[[dict], None] | None = None, text: str | None = None) -> None:
        (d / "m").mkdir()
        shutil.copy(base / "model.safetensors", d / "m" / "model.safetensors")
        a = json.loads((base / "arch.json").read_text())
        if edit is not None:
            edit(a)
        (d / "m" / "arch.json").write_text(text if text is not None else json.dumps(a))

    # 1. data lost: an output that is the command's input
    @t.case("r53-finetune-out-is-its-source", "issue 53: data lost", "refused even with --force; the source kept")
    def _(c: Case, d: Path) -> None:
        shutil.copytree(base, d / "base")
        before = {p.name: digest(p) for p in (d / "base").iterdir() if p.is_file()}
        refuse(
            c,
            d,
            ["finetune", "base", "--method", "evit", "--zero-shot", "--out", "base", "--force"],
            "is the command's input",
        )
        c.data_lost = {p.name: digest(p) for p in (d / "base").iterdir() if p.is_file()} != before

    @t.case("r53-dashboard-writable-sqlite", "issue 53: data lost", "refused on SQLite, saying why")
    def _(c: Case, d: Path) -> None:
        optuna.create_study(study_name="s", storage=f"sqlite:///{d}/s.db")
        refuse(c, d, ["study", "dashboard", "s", "--storage", "sqlite:///s.db", "--writable"], "snapshot copy")

    # 2. arch.json's input section
    for key, value, must in (
        ("img_size", [3000, 3000], "but the model takes"),
        ("img_size", [32, 32], "but the model"),
        ("in_chans", 3, "in_chans is 3"),
        ("mean", [float("nan")], "finite numbers"),
    ):
        name = f"r53-arch-input-{key}-{str(value).replace(' ', '')}"

        @t.case(name, "issue 53: model file", "one line naming the input setting; nothing allocated")
        def _(c: Case, d: Path, key: str = key, value: Any = value, must: str = must) -> None:
            plain_model(d, lambda a: a["input"].__setitem__(key, value))
            refuse(c, d, ["evaluate", "m", "--dataset", "synthetic", "--device", "cpu"], must)

    # 3. search-space files, 4. deep files
    for name, text, must in (
        (
            "layers-range-1e9",
            _space("prune_layers: {kind: layers, range: [1, 1000000000], size: [1, 1000000]}"),
            "beyond the deepest model",
        ),
        ("step-1e-300", _space("keep_rate: {kind: float, low: 0.3, high: 1.0, step: 1.0e-300}"), "values from"),
        ("tome-r-negative", _space("r: {kind: int, low: -5, high: 2}", "tome"), "which tome refuses"),
        ("nested-5000-raised-limit", "a: " + "[" * 5000 + "]" * 5000 + "\n", "nested too deeply"),
    ):

        @t.case(f"r53-space-{name}", "issue 53: search space", "one line at load time; no study created")
        def _(c: Case, d: Path, text: str = text, must: str = must) -> None:
            (d / "bad.yaml").write_text(text)
            refuse(
                c,
                d,
                ["search", "tokens", base, "--space", "bad.yaml", "--study", "s", "--storage", "sqlite:///s.db"],
                must,
                out="s.db",
                env={"NASCOMPRESS_MAX_YAML_DEPTH": "100000"},
            )

    @t.case("r53-deep-arch-json", "issue 53: model file", "one line: nests deeper than the limit; no RecursionError")
    def _(c: Case, d: Path) -> None:
        plain_model(d, text='{"format": ' + DEEP + "}")
        refuse(c, d, ["evaluate", "m", "--dataset", "synthetic", "--device", "cpu"], "nests deeper")

    # 5. damaged run files and --resume
    def killed_train(d: Path) -> list[Any]:
        cmd = ["train", "--out", "run", "--epochs", "3", *TINY]
        t.kill_when(cmd, d, lambda: (d / "run" / "checkpoint.safetensors").is_file())
        return cmd

    @t.case("r53-half-written-log-line", "issue 53: resume safety", "--resume drops the line (a note) and finishes")
    def _(c: Case, d: Path) -> None:
        cmd = killed_train(d)
        with open(d / "run" / "log.jsonl", "a") as f:
            f.write('{"epoch": 2, "lr": 0.00')  # what a kill during the per-epoch append leaves
        c.command = "nascompress train --out run ... --resume  (log.jsonl's last line half-written)"
        r = t.nc(cmd + ["--resume"], d)
        c.exit_code, c.error_line = r.rc, error_line(r) if r.rc else None
        ok = r.rc == 0 and "dropping the half-written last line" in r.err
        c.outcome = "accepted" if ok else ("raw error" if r.rc else "wrong")
        c.data_lost = r.rc != 0

    for name, damage, must in (
        ("config-json-list", "config", "not the record"),
        ("checkpoint-missing-tensor", "missing", "is damaged"),
        ("checkpoint-epoch-string", "epoch", "is damaged"),
    ):

        @t.case(f"r53-{name}", "issue 53: resume safety", "one line naming the damage and what to do")
        def _(c: Case, d: Path, damage: str = damage, must: str = must) -> None:
            cmd = killed_train(d)
            ck = d / "run" / "checkpoint.safetensors"
            if damage == "config":
                (d / "run" / "config.json").write_text("[1, 2, 3]")
            else:
                with safe_open(str(ck), "pt") as f:
                    skeleton = json.loads(f.metadata()["nascompress_state"])
                tensors = load_file(str(ck))
                if damage == "missing":
                    tensors.pop("/model/head.bias")
                else:
                    skeleton["__dict__"]["epoch"] = "x"
                save_file(tensors, str(ck), metadata={"nascompress_state": json.dumps(skeleton)})
            refuse(c, d, cmd + ["--resume"], must)

    # 6. unbounded options, 8. wrong acceptances, 10. minor
    for name, args, must in (
        ("export-batch-1e9", ["export", base, "--out", "m.onnx", "--batch", "1000000000"], "[1, 65536]"),
        ("train-lr-1e300", ["train", "--out", "run", "--lr", "1e300", *TINY], "(0, 10]"),
        ("train-epochs-1e12", ["train", "--out", "run", "--epochs", "1000000000000", *TINY], "[1, 10000]"),
        ("profile-iters-1e12", ["profile", base, "--iters", "1000000000000"], "[1, 100000]"),
        (
            "objective-flops-max-flops",
            [
                "search",
                "tokens",
                base,
                "--study",
                "s",
                "--storage",
                "sqlite:///s.db",
                "--objective",
                "flops",
                "--max-flops",
                "0.8",
            ],
            "Pareto front",
        ),
        ("weights-fifo", ["train", "--out", "run", "--weights", "fifo", "--epochs", "1", *TINY], "named pipe"),
    ):

        @t.case(f"r53-{name}", "issue 53: bounds and acceptances", "one line; nothing written")
        def _(c: Case, d: Path, args: list[Any] = args, must: str = must) -> None:
            os.mkfifo(d / "fifo")
            refuse(c, d, args, must, out="run")

    @t.case("r53-world-size-without-torchrun", "issue 53: minor", "one line: not started by torchrun")
    def _(c: Case, d: Path) -> None:
        refuse(
            c,
            d,
            ["train", "--out", "run", "--epochs", "1", *TINY],
            "not started by torchrun",
            out="run",
            env={"WORLD_SIZE": "2"},
        )

    @t.case(
        "r53-pipeline-space-of-another-model-kind",
        "issue 53: bounds and acceptances",
        "refused before its output folder is written",
    )
    def _(c: Case, d: Path) -> None:
        shutil.copy(ROOT / "search_spaces" / "mgvit-h.yaml", d / "mgvit-h.yaml")
        (d / "p.yaml").write_text(PIPELINE.replace("space: space.yaml", "space: mgvit-h.yaml"))
        refuse(c, d, ["pipeline", "p.yaml", "--out", "run"], "needs a pyramid ViT", out="run")

    # 9. leftovers of a killed quantize / export
    @t.case("r53-quantize-leftovers-of-kill", "issue 53: leftovers", "the next run removes them; nothing outside --out")
    def _(c: Case, d: Path) -> None:
        q = d / "q"
        q.mkdir()
        (q / ".model.int8.onnx.quantize-dead").mkdir()
        (q / ".model.int8.onnx.quantize-dead" / "fp32.onnx").write_bytes(b"x")
        (q / ".model.int8.onnx.abc.tmp").write_bytes(b"x")
        c.command = "nascompress quantize BASE --out q  (after a killed one left its work folder and temp file)"
        r = t.nc(["quantize", base, "--out", "q"], d, timeout=300)
        c.exit_code, c.error_line = r.rc, error_line(r) if r.rc else None
        left = sorted(p.name for p in q.iterdir() if p.name.startswith("."))
        c.outcome = "recovered" if r.rc == 0 and not left else "wrong"
        c.note = f"left: {left}" if left else ""


__all__ = ["round53_cases"]
