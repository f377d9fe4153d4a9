"""The CLI's refusals (issue 64): values, files and outputs it used to answer with a raw error, a
traceback or a hang, or to accept; advice that names the real cause; messages that print paths as
written and never quote the file they were given.

Each test fails on the code before the fix.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from nascompress.errors import NascompressError, SettingError
from nascompress.models.build import build_model, custom_vit_spec
from nascompress.runs.io import make_arch, save_model

from .conftest import invoke
from .test_reliability import one_line

SPEC = custom_vit_spec(img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2, num_classes=10, in_chans=1)
INPUT = {"img_size": [16, 16], "in_chans": 1, "mean": [0.5], "std": [0.5]}
TINY = ["--dataset", "synthetic", "--img-size", "16", "--patch-size", "4", "--embed-dim", "32", "--depth", "1"]
TINY += ["--num-heads", "2", "--epochs", "1", "--train-limit", "64", "--eval-limit", "32", "--device", "cpu"]


def model_dir(d: Path, method: str | None = None, **config) -> Path:
    """model.safetensors + arch.json of a tiny model (with ``method`` applied, as ``config`` says;
    ``dcs``: the materialized model a DCS search gives)."""
    from nascompress.methods import get_method
    from nascompress.methods.dcs import DCSConfig, make_supernet, materialize

    torch.manual_seed(0)
    model, methods = build_model(SPEC), []
    if method == "dcs":
        model, record = materialize(make_supernet(model, DCSConfig(**config)).eval(), DCSConfig(**config))
        methods = [record]
    elif method is not None:
        model, record = get_method(method).prepare_fresh(model, config)
        methods = [record]
    save_model(d, model, make_arch(SPEC, input_spec=INPUT, methods=methods))
    return d


def edit_arch(d: Path, edit) -> Path:
    arch = json.loads((d / "arch.json").read_text())
    edit(arch)
    (d / "arch.json").write_text(json.dumps(arch))
    return d


# ---------------------------------------------------------------------------------------------
# evaluate: its values, a FIFO


def test_evaluate_refuses_a_zero_batch_or_limit_in_one_line(tiny_run):
    one_line(invoke("evaluate", tiny_run, "--eval-batch-size", "0"), "--eval-batch-size must be an integer in [1,")
    one_line(invoke("evaluate", tiny_run, "--eval-limit", "0"), "--eval-limit must be an integer in [1,")
    from nascompress.data import DataConfig, InputSpec, load_data
    from nascompress.profiling.evaluate import evaluate

    data = load_data(DataConfig(dataset="synthetic", eval_limit=8), spec=InputSpec.from_dict(INPUT))
    with pytest.raises(SettingError, match="batch_size must be an integer in"):  # the library's argument
        evaluate(build_model(SPEC), data.test, input_spec=InputSpec.from_dict(INPUT), device="cpu", batch_size=0)


def test_a_fifo_given_as_the_model_is_refused_without_opening_it(tmp_path):
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    stop = threading.Event()

    def writer():  # lets any reader's open() return (at EOF), so the old code errs instead of hanging
        while not stop.is_set():
            os.close(os.open(fifo, os.O_WRONLY))

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    try:
        msg = one_line(invoke("evaluate", fifo, "--dataset", "synthetic"), f"model file {fifo} is a named pipe")
        assert "give a run directory or a model.safetensors file" in msg
    finally:
        stop.set()
        os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))  # the writer's last open returns
        t.join()


# ---------------------------------------------------------------------------------------------
# outputs: a name longer than the file system holds, an export into a directory


def test_an_out_name_too_long_for_the_file_system_is_one_line(tmp_path, tiny_run):
    long = tmp_path / ("a" * 300)
    msg = one_line(invoke("train", "--out", long, *TINY), "--out has a name of 300 bytes")
    assert "longer than the 255 bytes a file name may have" in msg and "Errno" not in msg
    one_line(invoke("finetune", tiny_run, "--method", "tome", "--zero-shot", "--out", long), "a name of 300 bytes")
    # an export's name leaves room for its sidecar and temp files (19 bytes)
    msg = one_line(invoke("export", tiny_run, "--out", tmp_path / ("m" * 240)), "--out has a name of 240 bytes")
    assert "add 19" in msg and "at most 236 bytes" in msg
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("out", ["/", ".", "sub/.."])
def test_an_export_into_a_directory_is_one_line(tmp_path, tiny_run, monkeypatch, out):
    monkeypatch.chdir(tmp_path)
    msg = one_line(invoke("export", tiny_run, "--out", out), f"--out {out} is a directory, not a file to write")
    assert "ValueError" not in msg and "model.onnx" in msg


# ---------------------------------------------------------------------------------------------
# values accepted that make no sense


def test_a_min_lr_above_the_peak_lr_is_refused(tmp_path):
    from nascompress.train.config import TrainConfig

    out = tmp_path / "run"
    msg = one_line(invoke("train", "--out", out, *TINY, "--min-lr", "5"), "--min-lr 5 is above the peak")
    assert "--lr 0.001" in msg and not out.exists()
    with pytest.raises(SettingError, match="min_lr 0.01 is above the peak learning rate, base_lr 0.004"):
        TrainConfig(lr=None, min_lr=1e-2)
    assert TrainConfig(lr=1e-3, min_lr=1e-3).min_lr == 1e-3  # up to the peak: a flat end


def test_tome_r_beyond_any_model_is_refused(tiny_run, tmp_path):
    out = tmp_path / "tome"
    msg = one_line(
        invoke("finetune", tiny_run, "--method", "tome", "--zero-shot", "--r", "1000000000", "--out", out),
        "--r 1,000,000,000 is more tokens than any model has (at most 16,384",
    )
    assert "give a smaller --r" in msg and not out.exists()


def test_weights_that_are_not_finite_are_refused_when_read(tmp_path):
    src = model_dir(tmp_path / "src")
    sd = load_file(src / "model.safetensors")
    sd["blocks.0.attn.qkv.weight"][0, 0] = float("nan")
    save_file(sd, tmp_path / "nan.safetensors")
    out = tmp_path / "imported"
    args = ("import", "vit_tiny_patch16_224", "--weights", tmp_path / "nan.safetensors", "--num-heads", "2")
    msg = one_line(invoke(*args, "--out", out), "holds values that are not finite (NaN or inf) in blocks.0.attn.qkv")
    assert "--lr" not in msg and not out.exists()
    # training from them: the weights named, not a learning rate to lower
    msg = one_line(invoke("train", "--weights", tmp_path / "nan.safetensors", "--out", out, *TINY), "not finite")
    assert "--lr" not in msg and not out.exists()


# ---------------------------------------------------------------------------------------------
# a tampered arch.json: each method's record is checked where the file is


def _block(arch, key, value):
    arch["methods"][0]["blocks"][0][key] = value


DCS = {"qk_mask": "static", "mlp_gates": "hidden"}
TAMPERED = {
    "dcs-string-width": ("dcs", lambda a: _block(a, "hidden_keep", ["3"] * 8), "blocks[0].hidden_keep must be"),
    "dcs-float-widths": (
        "dcs",
        lambda a: _block(a, "hidden_keep", [i + 0.5 for i in a["methods"][0]["blocks"][0]["hidden_keep"]]),
        "blocks[0].hidden_keep must be",
    ),
    "dcs-qk-not-a-list": ("dcs", lambda a: _block(a, "qk_keep", 5), "blocks[0].qk_keep must be a list of lists"),
    "dcs-two-families": ("dcs", lambda a: _block(a, "mlp_keep", [0, 1]), "keeps both mlp_keep and hidden_keep"),
    "dcs-negative-tau": ("dcs", lambda a: a["methods"][0].update(tau=-1), "tau must be a positive number, got -1"),
    "dcs-blocks-text": ("dcs", lambda a: a["methods"][0].update(blocks="x"), "blocks must be a list of objects"),
    "uniform-no-hidden": ("uniform", lambda a: _block(a, "hidden_keep", None), "blocks[0].hidden_keep must be"),
    "tome-huge-r": ("tome", lambda a: a["methods"][0]["config"].update(r=10**9), "r 1,000,000,000 is more tokens"),
    "tome-config-text": ("tome", lambda a: a["methods"][0].update(config="x"), "config must be an object"),
    "sparsifiner-n-down": ("sparsifiner", lambda a: a["methods"][0].update(n_down=10**6), "n_down must be a whole"),
}


@pytest.mark.parametrize("case", list(TAMPERED))
def test_a_tampered_method_record_is_refused_naming_the_file(tmp_path, case):
    method, edit, says = TAMPERED[case]
    config = {"dcs": {**DCS}, "uniform": {"keep": 0.5}, "tome": {"r": 2}, "sparsifiner": {}}[method]
    d = model_dir(tmp_path / "m", method, **config)
    assert invoke("evaluate", d, "--dataset", "synthetic", "--eval-limit", "8").exit_code == 0
    edit_arch(d, edit)
    msg = one_line(
        invoke("evaluate", d, "--dataset", "synthetic", "--eval-limit", "8"), f"{d / 'arch.json'}: methods[0]"
    )
    assert says in msg and "the file was not written by nascompress or was edited" in msg


@pytest.mark.parametrize(
    "key,value,says",
    [("std", [1e-300], "std values must be at least 1e-06"), ("mean", [1e300], "mean values within +-1e+06")],
)
def test_a_normalisation_that_overflows_is_refused(tmp_path, key, value, says):
    d = edit_arch(model_dir(tmp_path / "m"), lambda a: a["input"].update({key: value}))
    msg = one_line(invoke("evaluate", d, "--dataset", "synthetic", "--eval-limit", "8"), says)
    assert f"{d / 'arch.json'}: input" in msg


# ---------------------------------------------------------------------------------------------
# a search space too large to read


def test_a_space_file_of_too_many_values_is_refused_before_it_is_read(tmp_path, monkeypatch):
    from nascompress.studies.space_model import load_space

    choices = ", ".join(str(i) for i in range(2000))
    path = tmp_path / "big.yaml"
    path.write_text(
        "format: nascompress-space/1\nname: big\nmethods:\n  - name: tome\n"
        f"    params:\n      r: {{kind: categorical, choices: [{choices}]}}\n"
    )
    monkeypatch.setenv("NASCOMPRESS_MAX_YAML_VALUES", "1000")
    with pytest.raises(NascompressError, match="holds more than 1,000 values \\(the max_yaml_values limit\\)"):
        load_space(path)
    monkeypatch.delenv("NASCOMPRESS_MAX_YAML_VALUES")
    assert len(load_space(path).methods[0].params[0].choices) == 2000  # the default limit: 100,000


# ---------------------------------------------------------------------------------------------
# advice: NaN images are no learning-rate problem; a pipeline continues by rerunning it


def _caller_data(nan: bool):
    from torch.utils.data import TensorDataset

    x = torch.rand(60, 1, 16, 16, generator=torch.Generator().manual_seed(0))
    if nan:
        x[:, 0, 0, 0] = float("nan")
    return TensorDataset(x, torch.arange(60) % 3)


def test_images_that_are_not_finite_are_named_not_the_learning_rate():
    import nascompress as nc

    torch.manual_seed(0)
    model = build_model(
        custom_vit_spec(img_size=16, patch_size=4, embed_dim=16, depth=1, num_heads=1, num_classes=3, in_chans=1)
    ).eval()
    clean = {"val": _caller_data(False), "test": _caller_data(False)}
    with pytest.raises(NascompressError, match="the images of epoch 1 step 0 hold values that are not finite") as e:
        nc.tokens.apply(model, "evit", _caller_data(True), **clean, keep_rate=0.7, device="cpu", epochs=1)
    assert "lr" not in str(e.value)
    with pytest.raises(NascompressError, match="the images hold values that are not finite"):  # evaluated: no NaN top-1
        nc.tokens.apply(model, "evit", _caller_data(True), keep_rate=0.7, device="cpu")


def test_a_full_disk_during_a_pipeline_advises_rerunning_the_pipeline(tmp_path, monkeypatch):
    from safetensors import SafetensorError

    import nascompress.runs.checkpoint as nckpt

    from .test_pipeline import tiny_config, write_config

    def full(*a, **kw):  # the disk fills up when the base's first checkpoint is written
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(nckpt, "save_file", full)
    cfg = write_config(tmp_path, tiny_config())
    out = tmp_path / "out"
    r = invoke("pipeline", cfg, "--out", out)
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    msg = r.stderr.strip().splitlines()[-1]  # (after the pipeline's progress lines)
    assert msg.startswith("error: cannot write") and "no space is left on its disk" in msg, msg
    assert "then rerun the same command to continue the pipeline there" in msg and "--resume" not in msg


# ---------------------------------------------------------------------------------------------
# messages: paths as written (no rich markup or emoji), never a file's content


def test_paths_print_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("runs/no:x:such", "runs/[bold]x[/bold]", "runs/:thumbs_up:"):
        one_line(invoke("evaluate", name), f"error: {name} does not exist")
    out = tmp_path / "[red]run:x:"
    r = invoke("train", "--out", out, *TINY)
    assert r.exit_code == 0 and f"-> {out}" in r.stdout, r.output


def test_a_refusal_names_the_file_and_line_never_its_content(tmp_path, tiny_run):
    secret = "root:x:0:0:token-3f9a1c77e2:/root:/bin/bash"
    text = tmp_path / "passwd"
    text.write_text(f"{secret}\ndaemon:x:1:1::/usr/sbin:/usr/sbin/nologin\n")
    msg = one_line(invoke("pipeline", text, "--out", tmp_path / "p"), f"{text}: line 1: expected a mapping of sections")
    assert "token" not in msg and "found a text of" in msg
    msg = one_line(
        invoke("search", "tokens", tiny_run, "--space", text, "--study", "s"), f"{text}: line 1: expected a mapping"
    )
    assert "token" not in msg
    cfg = tmp_path / "p.yaml"
    cfg.write_text(f"format: nascompress-pipeline/1\ndata: '{secret}'\n")
    msg = one_line(invoke("pipeline", cfg, "--out", tmp_path / "p"), "data: must be a mapping of settings, got a text")
    assert "token" not in msg
    space = tmp_path / "s.yaml"
    space.write_text(f"format: '{secret}'\nname: s\nmethods: []\n")
    with pytest.raises(NascompressError, match="format: must be 'nascompress-space/1', got a text of") as e:
        from nascompress.studies.space_model import load_space

        load_space(space)
    assert "token" not in str(e.value)
