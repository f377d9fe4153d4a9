"""The typed run files (nascompress.runs.files): arch.json, metrics.json and the export sidecar are
read and written in one place, round-trip byte for byte, keep unknown keys, and a damaged file is
one NascompressError line; no other module reads or writes those files itself."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from nascompress.errors import NascompressError
from nascompress.runs.io import read_arch
from nascompress.runs.files import (
    ARCH_FILE,
    METRICS_FILE,
    Arch,
    MethodRecord,
    RunMetrics,
    Sidecar,
    find_metrics,
    read_metrics,
    read_sidecar,
    write_arch_json,
    write_metrics_json,
    write_sidecar_json,
)
from tests.conftest import tiny_spec

PKG = Path(__file__).resolve().parents[1] / "nascompress"


def _saved(tmp_path, methods=None, labels=None):
    from nascompress.runs.io import make_arch, save_model
    from nascompress.models.build import build_model

    spec = tiny_spec()
    arch = make_arch(
        spec,
        input_spec={"in_chans": 1, "img_size": [16, 16], "mean": [0.5], "std": [0.5]},
        methods=methods,
        labels=labels,
    )
    save_model(tmp_path, build_model(spec), arch)
    return tmp_path


def test_a_real_runs_files_round_trip_unchanged(tiny_run, tmp_path):
    """Read and written again, a trained run's arch.json and metrics.json are the same bytes."""
    arch = read_arch(tiny_run)
    assert arch.spec.name and arch.methods == () and arch.input["img_size"] == [16, 16]
    metrics = read_metrics(tiny_run)
    assert metrics.finished is True and isinstance(metrics.test_top1, float) and "best_val_top1" in metrics
    write_arch_json(tmp_path, arch)
    write_metrics_json(tmp_path, metrics)
    for name in (ARCH_FILE, METRICS_FILE):
        assert (tmp_path / name).read_bytes() == (tiny_run / name).read_bytes(), name


def test_write_read_write_gives_identical_json(tmp_path):
    d = _saved(
        tmp_path / "m", methods=[{"name": "evit", "config": {"keep_rate": 0.7, "prune_layers": [1]}}], labels=["a", "b"]
    )
    first = (d / ARCH_FILE).read_bytes()
    arch = read_arch(d)
    assert arch.method_names == ("evit",) and arch.method("evit").config["keep_rate"] == 0.7
    assert arch.labels == ("a", "b") and arch.method("dcs") is None
    write_arch_json(d, arch)
    assert (d / ARCH_FILE).read_bytes() == first
    write_metrics_json(d, {"test_top1": 51.5, "stage_only": {"x": [1, 2]}, "macs": 3, "finished": True})
    first = (d / METRICS_FILE).read_bytes()
    m = read_metrics(d)
    assert (m.test_top1, m.macs, m.val_top1, m.get("stage_only")) == (51.5, 3, None, {"x": [1, 2]})
    write_metrics_json(d, m)
    assert (d / METRICS_FILE).read_bytes() == first


def test_unknown_keys_are_kept_in_their_place():
    arch = {
        "format": "nascompress-arch/2",
        "model": {"name": "vit"},
        "future": {"a": 1},
        "input": {"in_chans": 1},
        "methods": [{"name": "dcs", "stage": "supernet", "blocks": [None]}],
        "retrain": {"eta": 0.1},
    }
    a = Arch.from_dict(arch, source="arch.json")
    assert a.extra == {"future": {"a": 1}, "retrain": {"eta": 0.1}} and a.method("dcs").get("blocks") == [None]
    assert json.dumps(a.to_dict()) == json.dumps(arch)
    m = {"finished": True, "comparison": {"reason": "r"}, "test_top1": None, "flops_ratio": 0.5}
    rm = RunMetrics.from_dict(m, source="metrics.json")
    assert rm.get("comparison") == {"reason": "r"} and "test_top1" in rm and "val_top1" not in rm
    assert json.dumps(rm.to_dict()) == json.dumps(m) and rm.results() == {k: m[k] for k in list(m)[1:]}
    side = {
        "format": "nascompress-export/1",
        "file": "m.onnx",
        "files": [{"file": "m.onnx"}],
        "batch": "batch",
        "quantization": {"scheme": "int8-static", "kept_fp32_summary": {"head": 1}, "tool": "ort"},
    }
    s = Sidecar.from_dict(side, source="m.onnx.json")
    assert s.quantization.kept_fp32_summary == {"head": 1} and s.quantization.extra == {"tool": "ort"}
    assert json.dumps(s.to_dict()) == json.dumps(side)


def test_the_sidecar_is_read_beside_its_file(tmp_path):
    side = {
        "format": "nascompress-export/1",
        "file": "m.onnx",
        "runtime": "onnx",
        "dtype": "fp32",
        "batch": 1,
        "files": [{"file": "m.onnx"}],
        "verification": {"passed": True},
    }
    write_sidecar_json(tmp_path / "m.onnx.json", side)
    for p in (tmp_path / "m.onnx", tmp_path / "m.onnx.json"):
        s = read_sidecar(p)
        assert (s.runtime, s.quantization, s.verification["passed"]) == ("onnx", None, True)


@pytest.mark.parametrize(
    "text, says",
    [
        ("{not json", "is not valid JSON"),
        ('{"format": "nascompress-arch/2", "model": {"name": "x", "evil": 1}, "input": {}}', "model must be"),
        ("[1, 2]", "is not a nascompress arch"),
    ],
)
def test_a_damaged_arch_is_one_line(tmp_path, text, says):
    d = _saved(tmp_path)
    (d / ARCH_FILE).write_text(text)
    with pytest.raises(NascompressError) as e:
        read_arch(d)
    assert says in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "text, says",
    [
        ("{not json", "is not valid JSON"),
        ('{"test_top1": "high"}', "test_top1 must be a number"),
        ('{"finished": "yes"}', "finished must be a boolean"),
        ("[1]", "must be a JSON object"),
    ],
)
def test_damaged_metrics_are_one_line(tmp_path, text, says):
    (tmp_path / METRICS_FILE).write_text(text)
    with pytest.raises(NascompressError) as e:
        read_metrics(tmp_path)
    assert says in str(e.value) and "\n" not in str(e.value) and METRICS_FILE in str(e.value)
    assert find_metrics(tmp_path / "nowhere") is None


def test_a_damaged_method_record_or_labels_is_one_line():
    base = {"format": "nascompress-arch/2", "model": {"name": "vit"}}
    for bad, says in (
        ({"methods": [3]}, "methods[0] must be a JSON object"),
        ({"methods": [{"config": {}}]}, "methods[0] has no name"),
        ({"labels": "cat"}, "labels must be a list of class names"),
    ):
        with pytest.raises(NascompressError, match=says.replace("[", r"\[").replace("]", r"\]")):
            Arch.from_dict(dict(base, **bad), source="arch.json")


# ---------------------------------------------------------------------------------------------
# No module other than run_files reads or writes arch.json / metrics.json itself.

NAMES = {
    "arch.json",
    "metrics.json",
    "ARCH_FILE",
    "METRICS_FILE",
    # the pipeline's own files and a run's config.json (nascompress.pipeline.files)
    "done",
    "DONE_DIR",
    "pick.json",
    "PICK_FILE",
    "summary.json",
    "SUMMARY_FILE",
    "config.json",
    "CONFIG_FILE",
    "RUN_CONFIG_FILE",
}
IO_CALLS = {"read_json", "write_json", "open", "read_text", "write_text", "read_bytes", "load", "loads", "parse_json"}
# modules allowed to (with the reason); every other reader and writer goes through runs/files.py, runs/run_config.py
# and pipeline/files.py
ALLOWED: dict[str, str] = {
    "pipeline/files.py": "the reader and writer of the pipeline's files",
    "runs/run_config.py": "the reader and writer of a run's config.json",
    "runs/out_dir.py": "recorded_job reads config.json itself: it words a damaged record its own way for --resume",
    "runs/owner.py": "recognises an output written before its marker by arch.json's format key alone (bounded, "
    "never validated: a damaged file only means 'not recognised', and --force then refuses the folder)",
    "pyapi/hf_folder.py": "reads a Hugging Face folder's config.json (its model_type), not a run's",
}


def _mentions(node: ast.AST, names: set[str]) -> bool:
    for n in ast.walk(node):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.rsplit("/", 1)[-1] in NAMES:
            return True
        if isinstance(n, ast.Name) and n.id in names:
            return True
        if isinstance(n, ast.Attribute) and n.attr in NAMES:
            return True
    return False


def direct_file_access(tree: ast.AST) -> list[int]:
    """Lines that read or write one of the files by name: a JSON/file call whose arguments (or
    receiver) name it, directly or through a variable assigned a path that names it."""
    hits = []
    for fn in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
        tainted = set(NAMES)
        for n in ast.walk(fn):
            if isinstance(n, ast.Assign) and _mentions(n.value, tainted):
                tainted |= {t.id for tgt in n.targets for t in ast.walk(tgt) if isinstance(t, ast.Name)}
        for n in ast.walk(fn):
            if not isinstance(n, ast.Call):
                continue
            name = n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", None)
            if name not in IO_CALLS:
                continue
            parts = [*n.args, *(k.value for k in n.keywords)]
            if isinstance(n.func, ast.Attribute):
                parts.append(n.func.value)
            if any(_mentions(p, tainted) for p in parts):
                hits.append(n.lineno)
    return sorted(set(hits))


def test_no_other_module_reads_or_writes_the_run_files_itself():
    found = {}
    for p in PKG.rglob("*.py"):
        rel = str(p.relative_to(PKG))
        if rel == "runs/files.py" or rel in ALLOWED:
            continue
        lines = direct_file_access(ast.parse(p.read_text()))
        if lines:
            found[rel] = lines
    assert found == {}, f"read arch.json / metrics.json through nascompress.runs.files: {found}"


def test_the_scan_finds_a_direct_read():
    src = (
        'def f(d):\n    m = d / "metrics.json"\n    return read_json(m)\n'
        "def g(d):\n    return json.loads((d / ARCH_FILE).read_text())\n"
        'def h(d):\n    return read_json(d / "config.json"), read_json(d / "done" / "search.json")\n'
    )
    assert direct_file_access(ast.parse(src)) == [3, 5, 7]
    assert direct_file_access(ast.parse('def f(d):\n    return read_json(d / "other.json")\n')) == []


def test_a_record_built_in_code_writes_only_what_it_holds():
    m = RunMetrics(test_top1=50.0, extra={"epochs": 2})
    assert m.to_dict() == {"test_top1": 50.0, "epochs": 2} and m.get("macs", "none") == "none"
    s = Sidecar(format="nascompress-export/1", file="m.onnx")
    assert s.to_dict() == {"format": "nascompress-export/1", "file": "m.onnx"}


def test_a_changed_arch_writes_as_the_dict_it_replaces():
    """with_method / with_labels / set / without give the JSON the former dict edits gave."""
    d = {
        "format": "nascompress-arch/2",
        "model": {"name": "vit"},
        "input": {"in_chans": 1},
        "methods": [{"name": "dcs", "stage": "supernet"}],
        "retrain": {"eta": 0.1},
    }
    a = Arch.from_dict(d, source="arch.json")
    rec = {"name": "evit", "config": {"keep_rate": 0.7}}
    assert a.with_method(rec).to_dict() == dict(d, methods=[*d["methods"], rec])
    assert json.dumps(a.with_labels(["x", 1]).to_dict()) == json.dumps(dict(d, labels=["x", "1"]))
    assert a.with_labels(None) is a and a.with_method().to_dict() == d
    last = {"name": "dcs", "stage": "materialized", "blocks": [None]}
    assert a.with_last_method(last).to_dict() == dict(d, methods=[last])
    assert json.dumps(a.without("retrain").set(source={"k": 1}).to_dict()) == json.dumps(
        {**{k: v for k, v in d.items() if k != "retrain"}, "source": {"k": 1}}
    )
    built = Arch(format="nascompress-arch/2", model={"name": "vit"}, methods=(MethodRecord(name="tome"),))
    assert list(built.with_labels(["a"]).to_dict()) == ["format", "model", "methods", "labels"]
    assert Arch.of(d) == a and Arch.of(a) is a and d["methods"] == [{"name": "dcs", "stage": "supernet"}]


# ---------------------------------------------------------------------------------------------
# No module other than the loader indexes an arch dict by key: the others read the typed Arch.

# modules allowed to (with the reason)
ARCH_DICT_ALLOWED = {
    "runs/files.py": "the loader itself: validates the dict read from the file and types it",
    "runs/io.py": "the model format: builds the model and timm's pretrained_cfg from the validated dict it read",
}


def _arch_named(node: ast.AST) -> bool:
    """A name (``arch``, ``base_arch``, ``self.arch``, ``ctx.arch`` ...) an arch is kept under."""
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
    return name is not None and (name == "arch" or name.endswith("_arch"))


def arch_dict_indexing(tree: ast.AST) -> list[int]:
    """Lines that index an arch by a string key (``arch["input"]``, ``base_arch.get("labels")``,
    ``arch.pop("retrain")``), a heuristic on the names an arch is kept under."""
    hits = []
    for n in ast.walk(tree):
        if (
            isinstance(n, ast.Subscript)
            and _arch_named(n.value)
            and isinstance(n.slice, ast.Constant)
            and isinstance(n.slice.value, str)
        ):
            hits.append(n.lineno)
        if (
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and n.func.attr in ("get", "pop", "setdefault")
            and _arch_named(n.func.value)
            and n.args
            and isinstance(n.args[0], ast.Constant)
        ):
            hits.append(n.lineno)
    return sorted(set(hits))


def test_no_other_module_indexes_an_arch_dict():
    found = {}
    for p in PKG.rglob("*.py"):
        rel = str(p.relative_to(PKG))
        if rel not in ARCH_DICT_ALLOWED:
            lines = arch_dict_indexing(ast.parse(p.read_text()))
            if lines:
                found[rel] = lines
    assert found == {}, f"read the typed Arch (nascompress.runs.io.load_typed / read_arch), not the dict: {found}"


def test_the_scan_finds_arch_dict_indexing():
    src = (
        'def f(arch, self, ctx):\n    s = arch["input"]\n    base_arch.get("labels")\n'
        '    self.arch["methods"].append(1)\n    ctx.arch.pop("retrain", None)\n'
        '    return arch.input, arch.method("dcs"), rec["name"], archive["x"]\n'
    )
    assert arch_dict_indexing(ast.parse(src)) == [2, 3, 4, 5]


def test_the_pipeline_files_round_trip_unchanged(tmp_path):
    """A step marker, pick.json, summary.json and a run's config.json: read and written again, the same
    bytes; a marker or pick built in code writes every key (null where there is no value)."""
    from nascompress.pipeline.files import (
        Pick,
        StepMarker,
        find_pick,
        find_step_marker,
        read_summary,
        step_marker_path,
        write_pick,
        write_step_marker,
        write_summary_json,
    )
    from nascompress.pipeline.summary import Summary
    from nascompress.runs.run_config import find_run_config, write_run_config
    from nascompress.runs.json_io import write_json

    m = StepMarker.new(
        "dcs_search",
        seconds=1.5,
        finished="2026-01-01T00:00:00+00:00",
        dir=None,
        result={"skipped": True, "reason": "r"},
    )
    path = write_step_marker(tmp_path, m)
    assert path == step_marker_path(tmp_path, "dcs_search") == tmp_path / "done" / "dcs_search.json"
    assert list(json.loads(path.read_text())) == ["step", "seconds", "finished", "dir", "result"]
    back = find_step_marker(tmp_path, "dcs_search")
    assert (
        back.skipped and back.dir is None and back.result["reason"] == "r" and find_step_marker(tmp_path, "x") is None
    )
    first = path.read_bytes()
    write_step_marker(tmp_path, back)
    assert path.read_bytes() == first
    write_pick(tmp_path, Pick.new(picked_study="s", candidates=[{"study": "s"}], dense_study="d", dense_skipped=None))
    p = find_pick(tmp_path)
    assert (p.picked_study, p.dense_skipped, p.candidates) == ("s", None, [{"study": "s"}])
    assert json.loads((tmp_path / "pick.json").read_text())["dense_skipped"] is None
    summary = {"source": "c.yaml", "final": None, "goal": {"met": True}, "decisions": {"dcs": {}}, "stages": []}
    write_summary_json(tmp_path, Summary.from_dict(summary, source="summary"))
    first = (tmp_path / "summary.json").read_bytes()
    assert json.loads(first) == summary
    s = read_summary(tmp_path)
    assert s.final is None and s.goal.met and s.decisions.dcs.to_dict() == {} and s.stages == ()
    write_summary_json(tmp_path, s)
    assert (tmp_path / "summary.json").read_bytes() == first
    write_run_config(tmp_path, {"import": {"model": "vit"}, "data": None, "source": {"sha256": "x"}})
    c = find_run_config(tmp_path)
    assert (
        c.data is None
        and "data" in c
        and c.get("import") == {"model": "vit"}
        and find_run_config(tmp_path / "no") is None
    )
    write_json(tmp_path / "done" / "bad.json", {"seconds": 1})
    with pytest.raises(NascompressError, match="has no step"):
        find_step_marker(tmp_path, "bad")
