"""The bench modules (``bench/*.py``) call the library's public functions. A script (a name without
a leading ``_``, run as ``python bench/<name>.py``) imports no other script: code two benches share
lives in a helper module, whose name starts with ``_`` (``bench/_common.py`` for the plumbing,
``_pretrained.py``, ``_standins.py``, ``_faults.py``, ...). A helper imports no script either, and the
helpers import one another without a cycle. No bench module imports a private (``_name``) name or
module of nascompress; every import is at the top of its module, except an optional third-party
package (the external peer a bench compares against: torch_pruning, onnx, onnxruntime) imported
where it is needed, with a ``# reason`` comment on its line. An AST scan, nothing is run."""

from __future__ import annotations

import ast
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
OPTIONAL = {"torch_pruning", "onnx", "onnxruntime"}


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]


def _modules(node: ast.Import | ast.ImportFrom) -> list[str]:
    return [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]


def helper_imports(bench: Path = BENCH) -> dict[str, set[str]]:
    """Each helper module (``_name``) and the helpers it imports."""
    own = {p.stem for p in bench.glob("_*.py")}
    graph: dict[str, set[str]] = {}
    for path in bench.glob("_*.py"):
        tops = {m.split(".")[0] for node in _imports(ast.parse(path.read_text())) for m in _modules(node)}
        graph[path.stem] = (tops & own) - {path.stem}
    return graph


def helper_cycles(bench: Path = BENCH) -> list[str]:
    """``a -> b -> a`` for each cycle among the helpers' imports (each found from its smallest name)."""
    graph = helper_imports(bench)
    found = []

    def walk(path: list[str]) -> None:
        for nxt in sorted(graph.get(path[-1], ())):
            if nxt == path[0]:
                found.append(" -> ".join(path + [nxt]))
            elif nxt not in path and nxt > path[0]:
                walk(path + [nxt])

    for start in sorted(graph):
        walk([start])
    return found


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


def test_no_bench_module_imports_a_script():
    assert bench_imports() == []


def test_the_helpers_import_one_another_without_a_cycle():
    assert helper_cycles() == []


def test_no_bench_script_imports_a_private_name_of_the_library():
    assert private_imports() == []


def test_bench_imports_are_at_the_top():
    assert local_imports() == []


def test_the_scans_find_one(tmp_path):
    (tmp_path / "_common.py").write_text("import os\n")
    (tmp_path / "_shared.py").write_text("from _common import os\nimport other\n")
    (tmp_path / "other.py").write_text("X = 1\n")
    (tmp_path / "a.py").write_text(
        "import _common\nimport _shared\nimport other\nfrom nascompress.x import _y\nfrom nascompress._z import w\n"
        "def f():\n    import json\n    import onnx  # optional\n    import onnxruntime\n"
    )
    assert bench_imports(tmp_path) == ["_shared: other", "a: other"]
    assert helper_cycles(tmp_path) == []
    (tmp_path / "_common.py").write_text("import _shared\n")
    assert helper_cycles(tmp_path) == ["_common -> _shared -> _common"]
    assert private_imports(tmp_path) == ["a: nascompress._z", "a: nascompress._z.w", "a: nascompress.x._y"]
    assert local_imports(tmp_path) == ["a:7", "a:9"]
