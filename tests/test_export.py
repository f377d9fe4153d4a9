"""``nascompress export``: every method and every allowed stack exports, runs in its runtime and
matches the PyTorch model; the files run without nascompress; bad inputs leave nothing.

Models are built through the public paths (``prepare_fresh``, DCS's ``materialize``), saved as runs
and exported from the run directory, as a user does. New parameters are randomised (seeded) so the
selections are not degenerate: an untrained Sparsifiner predictor scores whole regions equally,
and a top-k over tied scores may pick other keys in another runtime (the check reports that).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from nascompress.errors import NascompressError
from nascompress.deploy import ExportConfig, export_run, sidecar_path, stage_path
from nascompress.deploy.paths import TraceableSparsifiner
from nascompress.deploy.verify import Check, onnx_runner, program_runner, with_exit_rule
from nascompress.runs.files import Sidecar, read_sidecar, write_sidecar_json
from nascompress.runs.io import load, make_arch, save_model
from nascompress.methods import available_methods, get_method
from nascompress.models.build import build_model, custom_vit_spec

from .conftest import invoke

SPEC = custom_vit_spec(img_size=28, patch_size=4, embed_dim=16, depth=2, num_heads=2, num_classes=5, in_chans=1)
INPUT = {
    "img_size": [28, 28],
    "in_chans": 1,
    "mean": [0.286],
    "std": [0.353],
    "interpolation": "bilinear",
    "crop_pct": 1.0,
    "crop_mode": "center",
}
SETTINGS = {
    "uniform": {"keep": 0.5},
    "evit": {"keep_rate": 0.5},
    "dynamicvit": {"rho": 0.5},
    "sparsifiner": {"attn_keep_ratio": 0.25, "mode": "block"},
    "mgvit": {"epsilon": 0.5},
    "tome": {"r": 6},
}


def allowed_stacks() -> list[tuple[str, ...]]:
    """Every method order the registry allows (each method after methods in its ``stacks_on``)."""
    names, out = available_methods(), []

    def grow(stack: tuple[str, ...]) -> None:
        for n in names:
            if n not in stack and set(stack) <= get_method(n).stacks_on:
                out.append(stack + (n,))
                grow(stack + (n,))

    grow(())
    return out


def _randomise(model: torch.nn.Module, name: str, g: torch.Generator) -> None:
    with torch.no_grad():
        if name == "dcs":
            from nascompress.methods.dcs_supernet import arch_parameters

            for p in arch_parameters(model):  # gates open or shut at random: a real channel selection
                p.copy_(torch.randn(p.shape, generator=g))
        if name == "sparsifiner":  # a trained-like predictor (no tied scores)
            for n, p in model.named_parameters():
                if ".kernel.w_" in n:
                    p.add_(0.05 * torch.randn(p.shape, generator=g))


def make_run(root: Path, stack: tuple[str, ...], settings: dict | None = None, seed: int = 0) -> Path:
    """A saved run of the tiny model with ``stack`` applied, through the methods' public paths.
    Sparsifiner runs its block mode, and its unstructured mode under DynamicViT (both are exported)."""
    merged = dict(SETTINGS)
    if "dynamicvit" in stack:
        merged["sparsifiner"] = {**SETTINGS["sparsifiner"], "mode": "unstructured"}
    settings = {**merged, **(settings or {})}
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    model, records = build_model(SPEC).eval(), []
    for name in stack:
        if name == "dcs":
            from nascompress.methods.dcs import DCSConfig, materialize

            model, _ = get_method("dcs").prepare_fresh(model, DCSConfig(qk_mask="static"))
            _randomise(model, "dcs", g)
            model, rec = materialize(model.eval(), DCSConfig(qk_mask="static"))
        else:
            model, rec = get_method(name).prepare_fresh(model, settings.get(name, {}))
            _randomise(model, name, g)
        records.append(rec)
    run = root / ("-".join(stack) or "dense")
    save_model(run, model.eval(), make_arch(SPEC, input_spec=INPUT, methods=records))
    return run


def _check(side: Sidecar) -> None:
    v = side.verification
    assert v["passed"] and v["max_abs_diff"] <= 1e-4 and v["top1_agreement"] == 1.0, v
    assert v["batches"] == [8, 1]


# the two-graph methods (mgvit, mgvit-h: a pyramid model) have their own export tests
STACKS = [()] + [s for s in allowed_stacks() if not {"mgvit", "mgvit-h"} & set(s)]
# ONNX translates torch.export's ops: each method alone and the longest stacks hold every op of the others
ONNX_STACKS = [s for s in STACKS if len(s) == 1 or len(s) == max(map(len, STACKS))]


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """(run, file, sidecar) of a stack exported in a format, made once per module."""
    root, cache = tmp_path_factory.mktemp("exports"), {}

    def get(stack: tuple[str, ...], fmt: str = "onnx"):
        if (stack, fmt) not in cache:
            d = root / f"{'-'.join(stack) or 'dense'}.{fmt}"
            d.mkdir()
            run = make_run(d, stack)
            out = d / ("m.onnx" if fmt == "onnx" else "m.pt2")
            cache[stack, fmt] = run, out, export_run(run, out=out, config=ExportConfig(format=fmt))
        return cache[stack, fmt]

    return get


def test_every_allowed_stack_is_listed():
    stacks = allowed_stacks()
    assert ("dcs",) in stacks and ("uniform", "sparsifiner", "dynamicvit") in stacks and ("mgvit",) in stacks
    assert ("evit", "dcs") not in stacks and ("dynamicvit", "evit") not in stacks
    assert ("dcs", "sparsifiner", "evit") in ONNX_STACKS and ("dcs", "sparsifiner") not in ONNX_STACKS
    assert {m for s in ONNX_STACKS for m in s} == {m for s in STACKS for m in s}


@pytest.mark.parametrize("stack", STACKS, ids=lambda s: "-".join(s) or "dense")
def test_stack_exports_as_torch_program_and_matches(exports, stack):
    run, out, side = exports(stack, "torch-export")
    _check(side)
    assert [m["name"] for m in side.get("methods")] == list(stack)
    assert sorted(p.name for p in out.parent.iterdir()) == sorted([run.name, "m.pt2", "m.pt2.json"])
    x = torch.randn(3, 1, 28, 28)
    torch.testing.assert_close(program_runner(out)[0]([x])[0], load(run)(x), rtol=0, atol=1e-5)


@pytest.mark.parametrize("stack", ONNX_STACKS, ids=lambda s: "-".join(s) or "dense")
def test_stack_exports_to_onnx_and_matches(exports, stack):
    run, out, side = exports(stack, "onnx")
    _check(side)
    assert side.files[0]["inputs"] == [{"name": "image", "shape": ["batch", 1, 28, 28], "dtype": "float32"}]
    import onnx

    ops = {n.op_type for n in onnx.load(str(out)).graph.node}
    if {"evit", "dynamicvit", "sparsifiner", "tome"} & set(stack):  # per-image selection is in the graph, not folded
        assert "TopK" in ops, ops
    if stack == ("dcs",):  # channels gathered, written back by a gather (no ScatterND: not in fp16 on ORT's CPU)
        assert "Gather" in ops and "ScatterND" not in ops, ops
    assert sorted(p.name for p in out.parent.iterdir()) == sorted([run.name, "m.onnx", "m.onnx.json"])


@pytest.mark.parametrize("n_patch,block_size,prefix", [(49, 7, 1), (10, 4, 1), (16, 4, 0)])
def test_traceable_sparsifiner_equals_the_kernels_own_paths(n_patch, block_size, prefix):
    from nascompress.methods.sparsifiner_kernel import SparsifinerConfig, SparsifinerKernel, region_init

    n, H, r = n_patch + prefix, 2, 8
    g = torch.Generator().manual_seed(1)
    wd, wu = region_init(n, r, prefix=prefix, grid=None)
    k0 = SparsifinerKernel(
        SparsifinerConfig(attn_keep_ratio=0.3, mode="block", block_size=block_size),
        wd + 0.05 * torch.randn(H, r, n, generator=g),
        wu + 0.05 * torch.randn(H, r, n, generator=g),
        prefix,
    ).eval()
    q, k, v = torch.randn(3, 2, H, n, 8, generator=g).unbind(0)
    masked = SparsifinerKernel(k0.cfg.replace(kernel="masked"), k0.w_down.data, k0.w_up.data, prefix).eval()
    with torch.no_grad():
        want = k0(q, k, v, scale=8**-0.5)
        ref_masked = masked(q, k, v, scale=8**-0.5)
        k0.__class__ = TraceableSparsifiner
        got = k0(q, k, v, scale=8**-0.5)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(got, ref_masked, rtol=0, atol=1e-6)


def test_gather_add_equals_the_dcs_blocks_own_write_back():
    from nascompress.deploy.paths import GatherAddMLP, traceable_copy

    with torch.no_grad():
        for stack in (("dcs",), ("dcs", "evit")):
            model = load(make_run(Path(tempfile.mkdtemp()), stack))
            copy = traceable_copy(model)
            assert any(isinstance(b, GatherAddMLP) for b in copy.blocks)
            x = torch.randn(4, 1, 28, 28)
            assert torch.equal(copy(x), model(x))


def test_scatter_free_ppsm_merge_equals_the_models_own(tmp_path):
    """mgvit's PPSM merges boundary tokens with scatter_add, which ONNX Runtime's CPU provider does not run
    in fp16: the traced copy merges with a one-hot matmul instead, the same values."""
    from nascompress.deploy.paths import ScatterFreeMerge, traceable_copy
    from nascompress.methods.mgvit_modules import PPSM

    model = load(make_run(tmp_path, ("mgvit",)))
    copy = traceable_copy(model)
    slims = [m for m in copy.modules() if isinstance(m, PPSM)]
    assert slims and all(isinstance(m, ScatterFreeMerge) and not m.merge_scatter for m in slims)
    assert all(m.merge_scatter for m in model.modules() if isinstance(m, PPSM))  # the model itself is untouched
    x = torch.randn(4, 1, 28, 28, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(copy(x), model(x), rtol=0, atol=1e-5)


def test_mgvit_two_stages_and_exit_rule(tmp_path):
    run = make_run(tmp_path, ("mgvit",))
    model = load(run)
    x = torch.randn(16, 1, 28, 28, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        conf = model._sgis(x)[0].softmax(-1).amax(-1)
    eps = float(conf.median())  # about half of the images exit at stage 1
    arch = json.loads((run / "arch.json").read_text())
    arch["methods"][0]["config"]["epsilon"] = eps
    (run / "arch.json").write_text(json.dumps(arch))
    side = export_run(run, out=tmp_path / "mg.onnx")
    _check(side)
    assert [f["stage"] for f in side.files] == ["sgis", "mgis"] and side.get("exit_rule")["epsilon"] == eps
    assert side.verification["stages"]["passed"] and side.verification["stages"]["n"] == 2 * 9  # both, all rows
    assert list(side.verification)[-4:] == ["stages", "runtime", "seed", "inputs"]
    assert read_sidecar(tmp_path / "mg.onnx") == side  # the stages' check too
    check = Check.from_dict(side.verification, source="verification")
    assert check.stages.passed and check.to_dict() == side.verification
    assert (tmp_path / "mg.mgis.onnx").is_file() and stage_path(tmp_path / "mg.onnx", "mgis").name == "mg.mgis.onnx"
    both = with_exit_rule(onnx_runner(tmp_path / "mg.onnx")[0], onnx_runner(tmp_path / "mg.mgis.onnx")[0], eps)
    with torch.no_grad():
        want = load(run)(x)
    assert 0 < int((conf > eps).sum()) < len(x)  # both branches of the rule run
    torch.testing.assert_close(both([x])[0], want, rtol=0, atol=1e-4)


def test_fixed_batch_and_fp16(tmp_path):
    run = make_run(tmp_path, ("dcs", "evit"))
    side = export_run(run, out=tmp_path / "b4.pt2", config=ExportConfig(format="torch-export", batch=4))
    assert side.verification["batches"] == [4] and side.files[0]["inputs"][0]["shape"] == [4, 1, 28, 28]
    half = export_run(run, out=tmp_path / "h.onnx", config=ExportConfig(dtype="fp16"))
    v = half.verification
    assert v["passed"] and half.files[0]["inputs"][0]["dtype"] == "float16" and v["top1_agreement"] >= 0.75
    bf = export_run(run, out=tmp_path / "bf.pt2", config=ExportConfig(format="torch-export", dtype="bf16"))
    assert bf.verification["passed"]


@pytest.mark.parametrize("fmt", ["onnx", "torch-export"])
def test_the_returned_sidecar_is_the_file_written(exports, fmt, tmp_path):
    """export_run returns the record it wrote: read_sidecar of the file equals it, its dict is the file's
    JSON, key for key and in order, and writing it again gives the same bytes."""
    _, out, side = exports((), fmt)
    assert isinstance(side, Sidecar) and read_sidecar(out) == side and side.file == out.name
    on_disk = json.loads(sidecar_path(out).read_text())
    assert side.to_dict() == on_disk and list(side.to_dict()) == list(on_disk)
    assert list(side.verification) == [
        *("n", "max_abs_diff", "logit_scale", "top1_agreement", "batches", "tolerance", "passed"),
        *("runtime", "seed", "inputs"),
    ]
    write_sidecar_json(tmp_path / "again.json", side)
    assert (tmp_path / "again.json").read_bytes() == sidecar_path(out).read_bytes()


RUN_WITHOUT_NASCOMPRESS = """
import json, sys
import numpy as np
import onnxruntime as ort
side = json.load(open(sys.argv[1] + ".json"))
inp = side["files"][0]["inputs"][0]
sess = ort.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
x = np.load(sys.argv[2])
assert list(x.shape[1:]) == inp["shape"][1:] and sess.get_inputs()[0].name == inp["name"]
logits = sess.run(None, {inp["name"]: x})[0]
assert not [m for m in sys.modules if m.split(".")[0] == "nascompress"]
np.save(sys.argv[3], logits)
print(side["num_classes"], logits.shape)
"""


def test_onnx_file_runs_in_a_process_without_nascompress(tmp_path, exports):
    run, out, _ = exports(("uniform", "sparsifiner", "dynamicvit"))
    x = torch.randn(5, 1, 28, 28)
    np.save(tmp_path / "x.npy", x.numpy())
    r = subprocess.run(
        [sys.executable, "-c", RUN_WITHOUT_NASCOMPRESS, str(out), str(tmp_path / "x.npy"), str(tmp_path / "y.npy")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[0] == "5"
    with torch.no_grad():
        want = load(run)(x)
    torch.testing.assert_close(torch.from_numpy(np.load(tmp_path / "y.npy")), want, rtol=0, atol=1e-4)


def test_torch_program_loads_in_a_process_without_nascompress(tmp_path, exports):
    _, out, _ = exports(("dcs", "evit"), "torch-export")
    code = (
        "import sys, torch; m = torch.export.load(sys.argv[1]).module(); y = m(torch.zeros(3, 1, 28, 28)); "
        "assert not [k for k in sys.modules if k.split('.')[0] == 'nascompress']; print(tuple(y.shape))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(out)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert r.returncode == 0 and r.stdout.strip() == "(3, 5)", r.stderr


def test_a_mismatch_fails_and_leaves_nothing(tmp_path, monkeypatch):
    from nascompress.deploy import run as run_mod

    run = make_run(tmp_path, ("evit",))
    real = run_mod.runner_for

    def off_by_a_bit(path, fmt):
        fn, desc = real(path, fmt)
        return (lambda inputs: [o + 1e-2 for o in fn(inputs)]), desc

    monkeypatch.setattr(run_mod, "runner_for", off_by_a_bit)
    with pytest.raises(NascompressError, match="differs from the PyTorch model.*nothing was written"):
        export_run(run, out=tmp_path / "new" / "m.pt2", config=ExportConfig(format="torch-export"))
    assert sorted(p.name for p in tmp_path.iterdir()) == [run.name]


def one_line_error(r, pattern):
    assert r.exit_code == 1, r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in r.output, r.output
    assert pattern in lines[0], lines[0]


def test_cli_export_and_refusals(tmp_path, monkeypatch):
    run = make_run(tmp_path, ("dcs", "evit"))
    out = tmp_path / "out" / "m.onnx"
    r = invoke("export", run, "--out", out)
    assert r.exit_code == 0, r.output
    assert "max |logit diff|" in r.stdout and out.is_file() and sidecar_path(out).is_file()
    side = json.loads(sidecar_path(out).read_text())
    assert side["num_classes"] == 5 and side["input"]["mean"] == [0.286] and side["flops"]["macs_per_image"] > 0
    before = out.read_bytes()
    one_line_error(invoke("export", run, "--out", out), "already exists; pass --force")
    assert out.read_bytes() == before
    assert invoke("export", run, "--out", out, "--force", "--format", "torch-export").exit_code == 0
    assert json.loads(sidecar_path(out).read_text())["runtime"] == "torch-export"

    one_line_error(
        invoke("export", run, "--out", tmp_path / "x.onnx", "--format", "tflite"),
        "format must be one of onnx, torch-export",
    )
    one_line_error(
        invoke("export", run, "--out", tmp_path / "x.onnx", "--batch", "zero"),
        "batch must be 'dynamic' or an integer in [1, 65536]",
    )
    one_line_error(
        invoke("export", run, "--out", tmp_path / "x.onnx", "--dtype", "bf16"), "bf16 ONNX files cannot be checked"
    )
    (tmp_path / "afile").write_text("")
    one_line_error(invoke("export", run, "--out", tmp_path / "afile" / "x.onnx"), "is not a writable directory")
    one_line_error(invoke("export", tmp_path / "nothing", "--out", tmp_path / "x.onnx"), "does not exist")

    from nascompress.methods.dcs import DCSConfig, make_record

    model, _ = get_method("dcs").prepare_fresh(build_model(SPEC), DCSConfig())
    save_model(
        tmp_path / "supernet",
        model,
        make_arch(SPEC, input_spec=INPUT, methods=[make_record(model, DCSConfig(), stage="supernet")]),
    )
    one_line_error(invoke("export", tmp_path / "supernet", "--out", tmp_path / "x.onnx"), "holds the DCS supernet")
    # every registered method exports today: a method without an export path, as a new one would be
    with monkeypatch.context() as m:
        m.setattr(type(get_method("tome")), "exportable", False)
        one_line_error(
            invoke("export", make_run(tmp_path, ("dcs", "tome")), "--out", tmp_path / "x.onnx"),
            "method 'tome' has no export path",
        )
    mg = make_run(tmp_path, ("mgvit",))
    one_line_error(invoke("export", mg, "--out", tmp_path / "x.onnx", "--batch", "4"), "export it with --batch dynamic")
    dense = make_run(tmp_path, ())
    one_line_error(
        invoke("export", dense, "--out", tmp_path / "x.onnx", "--opset", "14"), "cannot write this model at opset 14"
    )
    left = [p.name for p in tmp_path.rglob("*") if p.name.startswith(("x.", ".x.")) or p.suffix == ".tmp"]
    assert left == [] and sorted(p.name for p in (tmp_path / "out").iterdir()) == ["m.onnx", "m.onnx.json"]
