"""``--force`` and the Python API's ``out=`` / ``force=`` replace only what nascompress wrote (issue 64):
a directory that is no nascompress output, or one that holds anything else, is refused in one line
and left byte for byte as it was; nothing is written before every setting is checked; an input is
never replaced, however its path is spelled (a bind mount); a run that cannot be written before its
first checkpoint leaves nothing half-written.

Each test fails on the code before the fix.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nascompress.errors import NascompressError, SettingError
from nascompress.runs.owner import MARK_FILE, check_replaceable, foreign_entries, is_output

from .conftest import invoke
from .test_reliability import one_line

TINY = [
    "--dataset", "digits", "--img-size", "8", "--patch-size", "2", "--embed-dim", "16", "--depth", "1",
    "--num-heads", "1", "--in-chans", "1", "--epochs", "1", "--train-limit", "64", "--eval-limit", "64",
]  # fmt: skip


def user_files(root: Path) -> dict[Path, bytes]:
    """Lay a user's files in ``root`` (a thesis, a nested folder, a link) and return them by path."""
    files = {
        root / "thesis.tex": b"\\documentclass{article} my thesis\n",
        root / "docs" / "notes.md": b"# notes\n",
        root / "docs" / "deep" / "data.bin": bytes(range(256)),
    }
    for p, b in files.items():
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b)
    (root / "link").symlink_to(root / "docs" / "notes.md")
    return files


def intact(files: dict[Path, bytes]) -> bool:
    return all(p.is_file() and p.read_bytes() == b for p, b in files.items())


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A tiny run of ``nascompress train`` (copied by each test that changes it)."""
    out = tmp_path_factory.mktemp("force") / "run"
    r = invoke("train", "--out", out, *TINY)
    assert r.exit_code == 0, r.output
    return out


# ---------------------------------------------------------------------------------------------
# 1. --force on a directory that is no nascompress output


@pytest.mark.parametrize("where", ["home", "cwd"])
def test_force_refuses_a_directory_nascompress_did_not_write(tmp_path, monkeypatch, where):
    monkeypatch.chdir(tmp_path)
    home = tmp_path / "home"
    files = user_files(home)
    out = home if where == "home" else Path(".")
    r = invoke("train", "--out", out, "--force", *TINY)
    assert "is not a nascompress output" in one_line(r, f"--out {out}")
    assert intact(files) and not (home / "config.json").exists()


def test_force_replaces_a_run_and_refuses_one_holding_user_files(tmp_path, run):
    mine = tmp_path / "run"
    shutil.copytree(run, mine)
    files = user_files(mine)
    r = invoke("train", "--out", mine, "--force", *TINY)
    assert "holds files nascompress did not write" in one_line(r, f"--out {mine}")
    assert intact(files) and (mine / "model.safetensors").read_bytes() == (run / "model.safetensors").read_bytes()
    shutil.rmtree(mine / "docs")
    for p in ("thesis.tex", "link"):
        (mine / p).unlink()
    r = invoke("train", "--out", mine, "--force", *TINY)  # only nascompress's files: replaced
    assert r.exit_code == 0, r.output
    assert (mine / MARK_FILE).is_file() and (mine / "metrics.json").is_file()


def test_an_empty_out_is_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    files = user_files(tmp_path)
    r = invoke("train", "--out", "", "--force", *TINY)
    one_line(r, "--out is empty")
    assert intact(files)


def test_the_pipeline_refuses_to_replace_a_folder_holding_its_own_config(tmp_path):
    pp = tmp_path / "pp"
    pp.mkdir()
    cfg = pp / "p.yaml"
    shutil.copy(Path(__file__).parents[1] / "nascompress" / "configs" / "demo.yaml", cfg)
    before = cfg.read_bytes()
    r = invoke("pipeline", cfg, "--out", pp, "--force")
    one_line(r, str(pp))
    assert cfg.read_bytes() == before and sorted(p.name for p in pp.iterdir()) == ["p.yaml"]


def test_a_pipeline_folder_is_recognised_and_user_files_in_it_are_named(tmp_path):
    d = tmp_path / "p"
    (d / "done").mkdir(parents=True)
    (d / "config.yaml").write_text("format: nascompress-pipeline/1\n")  # written before the marker
    (d / "done" / "base.json").write_text("{}")
    (d / "base").mkdir()
    (d / "base" / MARK_FILE).write_text(json.dumps({"written_by": "nascompress", "kind": "run"}))
    (d / "base" / "model.safetensors").write_bytes(b"x")
    assert is_output(d) and foreign_entries(d) == []
    check_replaceable(d)
    (d / "done" / "mine.txt").write_text("mine")
    (d / "base" / "results.xlsx").write_text("mine")
    assert sorted(map(str, foreign_entries(d))) == ["base/results.xlsx", "done/mine.txt"]
    with pytest.raises(SettingError, match="holds files nascompress did not write"):
        check_replaceable(d)
    # a Hugging Face folder has a run's file names but is no nascompress output
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "vit"}))
    (hf / "model.safetensors").write_bytes(b"x")
    assert not is_output(hf)


# ---------------------------------------------------------------------------------------------
# 4. an input under another name (a bind mount) is the input


def _bind(src: Path, dst: Path) -> bool:
    dst.mkdir()
    return subprocess.run(["mount", "--bind", str(src), str(dst)], capture_output=True).returncode == 0


def test_an_output_bound_onto_the_input_is_refused(tmp_path, run):
    pb = tmp_path / "pb"
    shutil.copytree(run, pb)
    before = {p.name: p.read_bytes() for p in pb.iterdir() if p.is_file()}
    alias = tmp_path / "bindpb"
    if not _bind(pb, alias):
        pytest.skip("mount --bind is not allowed here")
    try:
        r = invoke("finetune", pb, "--method", "evit", "--zero-shot", "--out", alias, "--force")
        assert "is the command's input" in one_line(r, f"--out {alias}")
    finally:
        subprocess.run(["umount", str(alias)], check=True)
    assert {p.name: p.read_bytes() for p in pb.iterdir() if p.is_file()} == before


# ---------------------------------------------------------------------------------------------
# 2, 5. the Python API


@pytest.fixture()
def tiny_vit():
    import timm

    return timm.create_model(
        "vit_tiny_patch16_224", img_size=8, patch_size=2, embed_dim=16, depth=1, num_heads=1, in_chans=1, num_classes=10
    )


def test_the_api_never_replaces_a_users_folder_under_out(tmp_path, tiny_vit):
    import nascompress as nc

    proj = tmp_path / "proj"
    files = {**user_files(proj / "source"), **user_files(proj / "model")}
    with pytest.raises(NascompressError, match="is not such a copy"):
        nc.dcs.search(tiny_vit, "digits", out=proj, epochs=1, train_limit=64, eval_limit=64)
    with pytest.raises(NascompressError, match="is not such a copy"):
        nc.retrain(tiny_vit, "digits", out=proj, epochs=1, train_limit=64, eval_limit=64, force=True)
    assert intact(files)
    # nc.compress's pipeline folder of the user's: refused before the model's copy is written
    mine = tmp_path / "mine"
    files = user_files(mine / "pipeline")
    with pytest.raises(NascompressError, match="is not a nascompress output"):
        nc.compress(tiny_vit, "digits", out=mine, force=True)
    assert intact(files) and not (mine / "source").exists()


def test_the_api_checks_its_settings_before_it_writes(tmp_path, tiny_vit):
    import nascompress as nc

    out = tmp_path / "proj2"
    calls = [
        lambda: nc.retrain(tiny_vit, "digits", out=out, lr=-1),
        lambda: nc.dcs.search(tiny_vit, "digits", out=out, target_flops=7),
        lambda: nc.tokens.apply(tiny_vit, "evit", "digits", out=out, lr=-2),
        lambda: nc.compress(tiny_vit, "digits", out=out, target_flops=-1),
        lambda: nc.study(tiny_vit, "digits", space="evit", trials=0, out=out),
    ]
    for call in calls:
        with pytest.raises(SettingError):
            call()
        assert not out.exists()


def test_a_result_is_never_saved_over_the_run_it_was_read_from(tmp_path, run):
    from nascompress.pyapi.common import read_result
    from nascompress.pyapi.stages import Retrained
    from nascompress.runs.run_config import RunConfig

    src = tmp_path / "kept"
    shutil.copytree(run, src)
    before = (src / "model.safetensors").read_bytes()
    res = read_result(Retrained, src, keep=True)
    for target in (src, tmp_path, src / "sub"):
        with pytest.raises(SettingError):
            res.save(target, force=True)
    assert (src / "model.safetensors").read_bytes() == before and not (src / "sub").exists()
    assert (res.save(tmp_path / "copy") / "model.safetensors").read_bytes() == before
    # nor over the run it was made from (a materialized model's search, recorded in its config)
    recorded = RunConfig.from_dict({"materialize": {"search_dir": str(src)}}, source="config.json")
    made = Retrained(model=res.model, arch=res.arch, config=recorded)
    with pytest.raises(SettingError, match="is the command's input"):
        made.save(src, force=True)
    assert (src / "model.safetensors").read_bytes() == before


# ---------------------------------------------------------------------------------------------
# 6. a run that cannot be written before its first checkpoint is removed


def test_a_file_size_limit_before_the_first_checkpoint_leaves_no_half_written_run(tmp_path):
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (12_000, 12_000))  # smaller than the model file

    out = tmp_path / "run"
    beside = user_files(tmp_path / "mine")
    r = subprocess.run(
        [sys.executable, "-m", "nascompress.cli.main", "train", "--out", str(out), *TINY],
        capture_output=True,
        text=True,
        preexec_fn=limit,
        env={**os.environ, "NASCOMPRESS_PROGRESS": "off"},
    )
    err = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 1 and len(err) == 1, r.stderr[-2000:]
    assert "ulimit -f" in err[0] and "rerun the command" in err[0] and "--resume" not in err[0]
    assert not out.exists() and intact(beside)
