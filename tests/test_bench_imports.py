"""The bench scripts (``bench/*.py``) call the library's public functions and import no other bench
script: only the shared plumbing of ``bench/_common.py``; no private (``_name``) name or module of
nascompress; every import at the top of the script, except an optional third-party package (the
external peer a bench compares against: torch_pruning, onnx, onnxruntime) imported where it is
needed, with a ``# reason`` comment on its line. An AST scan, nothing is run."""

from __future__ import annotations

import ast
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
OPTIONAL = {"torch_pruning", "onnx", "onnxruntime"}

# What is still to move (each pair: a script and the bench module it imports; each a script's
# function-local imports). The lists are exact: they only shrink.
KNOWN_BENCH_IMPORTS = {
    "faults: faults_r53",  # issue 53's cases, split off the fault table (and importing it back)
    "faults_r53: faults",
}
KNOWN_LOCAL_IMPORTS = {"faults", "faults_r53"}


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]


def _modules(node: ast.Import | ast.ImportFrom) -> list[str]:
    return [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]


def bench_imports(bench: Path = BENCH) -> list[str]:
    """``module: imported`` for each bench module a bench module imports that is not a helper (an
    ``_``-prefixed module)."""
    own = {p.stem for p in bench.glob("*.py")}
    found = set()
    for path in bench.glob("*.py"):
        for node in _imports(ast.parse(path.read_text())):
            for mod in _modules(node):
                top = mod.split(".")[0]
                if top in own and not top.startswith("_"):
                    found.add(f"{path.stem}: {top}")
    return sorted(found)


def private_imports(bench: Path = BENCH) -> list[str]:
    """``script: name`` for each private nascompress name or module a bench script imports."""
    found = []
    for path in bench.glob("*.py"):
        for node in _imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.split(".")[0] == "nascompress"]
            else:
                mod = node.module or ""
                if mod.split(".")[0] != "nascompress":
                    continue
                names = [mod] + [f"{mod}.{a.name}" for a in node.names]
            for name in names:
                if any(part.startswith("_") and not part.startswith("__") for part in name.split(".")):
                    found.append(f"{path.stem}: {name}")
    return sorted(set(found))


def local_imports(bench: Path = BENCH) -> list[str]:
    """``script:line`` for each import inside a function that is not an optional third-party package
    with a ``# reason`` comment on its line."""
    found = set()
    for path in bench.glob("*.py"):
        src = path.read_text()
        lines = src.splitlines()
        for fn in ast.walk(ast.parse(src)):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if not isinstance(node, (ast.Import, ast.ImportFrom)):
                    continue
                optional = all(m.split(".")[0] in OPTIONAL for m in _modules(node))
                said = any("#" in line for line in lines[node.lineno - 1 : node.end_lineno])
                if not (optional and said):
                    found.add(f"{path.stem}:{node.lineno}")
    return sorted(found)


def test_no_bench_script_imports_another():
    assert set(bench_imports()) == KNOWN_BENCH_IMPORTS


def test_no_bench_script_imports_a_private_name_of_the_library():
    assert private_imports() == []


def test_bench_imports_are_at_the_top():
    assert {f.split(":")[0] + ":" for f in local_imports()} <= {k + ":" for k in KNOWN_LOCAL_IMPORTS}
    for name in KNOWN_LOCAL_IMPORTS:
        assert any(f.startswith(name + ":") for f in local_imports()), f"{name} is clean: take it off the list"


def test_the_scans_find_one(tmp_path):
    (tmp_path / "_common.py").write_text("import os\n")
    (tmp_path / "other.py").write_text("X = 1\n")
    (tmp_path / "a.py").write_text(
        "import _common\nimport other\nfrom nascompress.x import _y\nfrom nascompress._z import w\n"
        "def f():\n    import json\n    import onnx  # optional\n    import onnxruntime\n"
    )
    assert bench_imports(tmp_path) == ["a: other"]
    assert private_imports(tmp_path) == ["a: nascompress._z", "a: nascompress._z.w", "a: nascompress.x._y"]
    assert local_imports(tmp_path) == ["a:6", "a:8"]
