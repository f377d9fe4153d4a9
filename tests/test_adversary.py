"""The adversarial round of issue 53: nothing of the user's overwritten, every file read checked,
every number bounded, no advice that fails, nothing left behind.

Each test fails on the code before the fix.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from nascompress.errors import NascompressError

from .conftest import invoke
from .test_reliability import one_line, plain_model_dir


def _copy_run(tiny_run: Path, dst: Path) -> Path:
    shutil.copytree(tiny_run, dst)
    return dst


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


# ---------------------------------------------------------------------------------------------
# 1. An output that is or contains an input is refused, even with --force


def test_an_output_that_is_or_holds_an_input_is_refused_even_with_force(tmp_path, tiny_run):
    base = _copy_run(tiny_run, tmp_path / "runs" / "base")
    before = _files(base)
    for out in (base, tmp_path / "runs", tmp_path):
        r = invoke("finetune", base, "--method", "evit", "--zero-shot", "--out", out, "--force")
        msg = one_line(r, f"--out {out} ")
        assert ("is the command's input" if out == base else "contains the command's input") in msg
        assert "choose another --out" in msg
    assert _files(base) == before
    # export: neither the model file nor its arch.json (the sidecar is OUT.json) is replaced
    for out in (base / "model.safetensors", base / "arch"):
        r = invoke("export", base, "--out", out, "--force")
        one_line(r, "is the command's input")
    assert _files(base) == before
    # a train whose --out holds its dataset folder
    from .test_reliability import TINY, folder

    data = folder(tmp_path / "proj" / "data", {"a": 4, "b": 4})
    r = invoke("train", "--dataset", data, "--out", tmp_path / "proj", "--force", *TINY)
    one_line(r, f"contains the command's input {data}")
    assert (data / "train").is_dir()


def test_the_dashboard_refuses_writable_sqlite_saying_why(tmp_path):
    from nascompress.studies import run_study
    from nascompress.studies.dashboard import start_dashboard

    from .study_toys import SPACE_INFO, TWO, toy_factory

    storage = f"sqlite:///{tmp_path}/s.db"
    run_study(study_name="d", storage=storage, n_trials=1, objective_factory=toy_factory, space_info=SPACE_INFO,
              progress=False, **TWO)
    with pytest.raises(NascompressError, match="--writable cannot change SQLite storage .* snapshot copy"):
        start_dashboard("d", storage=storage, writable=True)
    one_line(invoke("study", "dashboard", "d", "--storage", storage, "--writable"), "leave out --writable")
    with start_dashboard("d", storage=storage) as h:  # the advice works: read-only, served
        assert h.snapshot is not None and not h.writable
    assert not list(tmp_path.glob(".s.db.dashboard-*"))


# ---------------------------------------------------------------------------------------------
# 2. arch.json's input section is checked


@pytest.mark.parametrize("key,value,words", [
    ("img_size", [3000, 3000], "img_size is [3000, 3000] but the model takes [16, 16]"),
    ("img_size", [100000, 100000], "img_size is [100000, 100000] but the model takes [16, 16]"),
    ("img_size", [32, 32], "img_size is [32, 32] but the model takes [16, 16]"),
    ("img_size", [16, "x"], "img_size must be [H, W] of positive integers"),
    ("in_chans", 3, "in_chans is 3 but the model (and its weights) take 1 channels"),
    ("mean", [float("nan")], "mean must be a list of 1 or 1 (in_chans) finite numbers"),
    ("std", [0.0], "std values must be positive"),
    ("std", [1.0, 2.0], "std must be a list of 1 or 1 (in_chans) finite numbers"),
])
def test_the_input_section_of_arch_json_is_checked(tmp_path, key, value, words):
    import nascompress

    d = plain_model_dir(tmp_path / "m")
    arch = json.loads((d / "arch.json").read_text())
    arch["input"][key] = value
    (d / "arch.json").write_text(json.dumps(arch))
    with pytest.raises(NascompressError, match="arch.json: input ") as e:
        nascompress.load(d)
    assert words in str(e.value) and "\n" not in str(e.value)
    one_line(invoke("evaluate", d, "--dataset", "synthetic", "--device", "cpu"), words)


def test_a_dynamic_size_model_takes_multiples_of_its_patch_within_the_token_limit():
    from nascompress.data_input import check_input_section

    model = {"img_size": (16, 16), "patch_size": (4, 4), "in_chans": 1, "prefix": 1, "dynamic": True}
    inp = {"img_size": [24, 32], "in_chans": 1, "mean": [0.5], "std": [0.5]}
    check_input_section(inp, source="a", model=model)
    with pytest.raises(NascompressError, match="not a multiple of the model's patch size"):
        check_input_section(dict(inp, img_size=[30, 32]), source="a", model=model)
    with pytest.raises(NascompressError, match="tokens per image is 6,250,001, above the limit"):
        check_input_section(dict(inp, img_size=[10000, 10000]), source="a", model=model)


# ---------------------------------------------------------------------------------------------
# 3. Search-space files: bounded, steps checked, values the methods accept


_SPACE = "format: nascompress-space/1\nname: t\nmethods:\n  - name: {method}\n    params:\n      {params}\n"


@pytest.mark.parametrize("method,params,words", [
    ("evit", "prune_layers: {kind: layers, range: [1, 1000000000], size: [1, 1000000]}",
     "prune_layers.range: layer 1,000,000,000 is beyond the deepest model nascompress builds (256 blocks"),
    ("evit", "prune_layers: {kind: layers, candidates: [1, 999999999], size: 1}", "layer 999,999,999 is beyond"),
    ("evit", "keep_rate: {kind: float, low: 0.3, high: 1.0, step: 1.0e-300}",
     "keep_rate.step: step 1e-300 gives 7.00e+299 values from 0.3 to 1.0, more than the 1,000,000"),
    ("evit", "keep_rate: {kind: float, low: 0.3, high: .inf}", "keep_rate.high: must be a number, got inf"),
    ("tome", "r: {kind: int, low: 0, high: 100000000000}", "the range gives 100,000,000,001 values"),
    ("tome", "r: {kind: int, low: -5, high: 2}",
     "params.r: r may take -5, which tome refuses: r must be a whole number of tokens >= 0"),
    ("tome", "r: {kind: categorical, choices: [2, -1]}", "r may take -1, which tome refuses"),
    ("evit", "keep_rate: 1.5", "keep_rate may take 1.5, which evit refuses"),
])
def test_a_search_space_is_bounded_and_checked_when_loaded(tmp_path, method, params, words):
    from nascompress.search.space import load_space

    f = tmp_path / "s.yaml"
    f.write_text(_SPACE.format(method=method, params=params))
    with pytest.raises(NascompressError) as e:
        load_space(f)
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_combination_refused_with_another_default_is_left_to_the_trial(tmp_path):
    from nascompress.search.space import load_space

    load_space(Path(__file__).parent.parent / "search_spaces" / "mgvit-h.yaml")  # r_neg 0.1 with r_pos's 1.0
