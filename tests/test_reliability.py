"""Reliability: model files are data, runs are complete only when marked so, bad datasets and
unwritable outputs are refused in one line, and leftovers of a killed run are recovered."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import nascompress
from nascompress.errors import NascompressError
from nascompress.io import make_arch, save_model
from nascompress.models import ModelSpec, build_model, custom_vit_spec

from .conftest import invoke

SPEC = custom_vit_spec(img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2, num_classes=3, in_chans=1)
INPUT = {"img_size": [16, 16], "in_chans": 1, "mean": [0.5], "std": [0.5]}


def plain_model_dir(d: Path) -> Path:
    """model.safetensors + arch.json, as a user assembles them (no run files)."""
    save_model(d, build_model(SPEC), make_arch(SPEC, input_spec=INPUT))
    return d


# ---------------------------------------------------------------------------------------------
# arch.json's model settings are an allow-list


@pytest.mark.parametrize("key,value,match", [
    ("checkpoint_path", "TEXT", "model setting 'checkpoint_path' is not one nascompress accepts"),
    ("pretrained_cfg_overlay", {"file": "x.bin"}, "model setting 'pretrained_cfg_overlay' is not one"),
    ("act_layer", "os.system", "model setting 'act_layer' is not one nascompress accepts"),
    ("img_size", "16", "model setting img_size must be a positive integer or \\[H, W\\], got '16'"),
    ("global_pool", "os.system", "model setting global_pool must be one of"),
    ("qkv_bias", "yes", "model setting qkv_bias must be true or false"),
])
def test_arch_json_model_settings_are_an_allow_list(tmp_path, key, value, match):
    d = plain_model_dir(tmp_path / "m")
    text = tmp_path / "notes.txt"
    text.write_text("not weights\n")
    arch = json.loads((d / "arch.json").read_text())
    arch["model"]["kwargs"][key] = str(text) if value == "TEXT" else value
    (d / "arch.json").write_text(json.dumps(arch))
    with pytest.raises(NascompressError, match=match) as e:
        nascompress.load(d)
    assert str(d / "arch.json") in str(e.value) and "\n" not in str(e.value)
    r = invoke("evaluate", d, "--dataset", "synthetic")
    assert r.exit_code == 1 and "error:" in r.output and "Traceback" not in r.output
    # the same arch embedded in the weights file alone (no arch.json beside it)
    sd = {k: v.contiguous() for k, v in build_model(SPEC).state_dict().items()}
    lone = tmp_path / "lone.safetensors"
    save_file(sd, str(lone), metadata={"nascompress_arch": json.dumps(arch)})
    with pytest.raises(NascompressError, match=match):
        nascompress.load(lone)


def test_every_setting_the_project_writes_is_allowed():
    build_model(SPEC)  # custom ViT: img_size, patch_size, embed_dim, depth, num_heads, mlp_ratio, classes, chans
    for kw in ({"reg_tokens": 2, "class_token": True}, {"class_token": False, "global_pool": "avg"},
               {"init_values": 0.1, "qk_norm": True, "qkv_bias": False}, {"img_size": [16, 20], "patch_size": 4},
               {"no_embed_class": True, "dynamic_img_size": True, "fc_norm": None, "pre_norm": True}):
        build_model(ModelSpec("vit_tiny_patch16_224", dict(kw, depth=1, embed_dim=32, num_heads=2, num_classes=3,
                                                           **({} if "img_size" in kw else {"img_size": 16}),
                                                           **({} if "patch_size" in kw else {"patch_size": 4}))))
    with pytest.raises(NascompressError, match="'drop_path_rate' is not one"):
        build_model(ModelSpec("vit_tiny_patch16_224", {"drop_path_rate": 0.1}))


def test_a_text_file_as_weights_is_one_line(tmp_path):
    bad = tmp_path / "w.safetensors"
    bad.write_text("hello\n")
    with pytest.raises(NascompressError, match="is not a readable safetensors file"):
        nascompress.load(bad)
    from nascompress.models import read_weights_file

    for name in ("w.safetensors", "w.pth"):
        (tmp_path / name).write_text("hello\n")
        with pytest.raises(NascompressError, match="corrupt or not a weights file"):
            read_weights_file(tmp_path / name)
