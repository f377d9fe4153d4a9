"""The package's import graph has no cycle (imports inside functions and ``if TYPE_CHECKING:`` blocks
included: a type-only circle still ties the modules together for a reader): every module can be read,
tested and moved on its own. No module imports another module's private (``_name``) names."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "nascompress"


def _modules(pkg: Path = PKG) -> dict[str, Path]:
    mods = {}
    for p in pkg.rglob("*.py"):
        parts = p.relative_to(pkg.parent).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return mods


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of a module: top level, inside functions, and under ``if TYPE_CHECKING:``."""
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]


def _base(name: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module an ``import from`` reads from."""
    if not node.level:
        return node.module or ""
    pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    pkg = pkg[: len(pkg) - (node.level - 1)]
    return ".".join(pkg + ([node.module] if node.module else []))


def import_graph(pkg: Path = PKG) -> dict[str, set[str]]:
    mods = _modules(pkg)
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        deps: set[str] = set()
        for node in _imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = _base(name, path, node)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            deps.update(t for t in targets if t in mods and t != name)
        graph[name] = deps
    return graph


def private_imports(pkg: Path = PKG) -> list[str]:
    """``module: name`` for each private name one module of the package imports from another
    (``from .x import _name``, ``from ..pkg import _module``). A private module (``_compat``) may be
    imported by the modules of the package that holds it, and names from outside the package
    (``torch._dynamo``) are not the package's to rename."""
    mods = _modules(pkg)
    root = pkg.name
    found = []
    for name, path in mods.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                continue
            base = _base(name, path, node)
            if base != root and not base.startswith(root + "."):
                continue
            for a in node.names:
                if not a.name.startswith("_") or a.name.startswith("__"):
                    continue
                full = f"{base}.{a.name}"
                if full in mods and (here == base or here.startswith(base + ".")):
                    continue  # a private module of the importer's own package
                found.append(f"{name}: {full}")
    return sorted(found)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return found


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert "nascompress.studies.trial_model" in graph and "nascompress.cli.main" in graph
    assert cycles(graph) == []


def test_the_cycle_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_a_type_only_import_closes_a_circle(tmp_path):
    pkg = tmp_path / "toy"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "plan.py").write_text("def run():\n    from .report import write\n    write()\n")
    (pkg / "report.py").write_text(
        "from __future__ import annotations\nfrom typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from .plan import Plan\n"
    )
    assert cycles(import_graph(pkg)) == [["toy.plan", "toy.report"]]


def test_no_private_name_is_imported_from_another_module():
    found = private_imports()
    assert found == []


def test_the_private_import_check_finds_one(tmp_path):
    pkg = tmp_path / "toy"
    (pkg / "sub").mkdir(parents=True)
    for f in ("__init__.py", "_compat.py", "sub/__init__.py", "sub/_impl.py"):
        (pkg / f).write_text("")
    (pkg / "a.py").write_text(
        "from ._compat import x\nfrom . import _compat\nfrom .b import _helper, public\n"
        "from .sub import _impl\nimport torch._dynamo\nfrom torch._C import _x\n"
    )
    (pkg / "b.py").write_text("def _helper(): ...\ndef public(): ...\n")
    (pkg / "sub" / "c.py").write_text("from .. import _compat\nfrom . import _impl\n")
    assert private_imports(pkg) == ["toy.a: toy.b._helper", "toy.a: toy.sub._impl"]


def test_the_library_never_imports_typer():
    lib = {n: p for n, p in _modules().items() if not n.startswith("nascompress.cli")}
    for name, path in lib.items():
        for node in _imports(ast.parse(path.read_text())):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            assert not any(m == "typer" or m.startswith("typer.") for m in mods), name


def test_the_study_runner_still_exports_what_it_did_before_the_split():
    from nascompress.studies import liveness, records, runner, seeding

    for mod, names in (
        (
            records,
            [
                "RECORD_KEY",
                "WORKER_KEY",
                "FAIL_REASON_KEY",
                "SURPLUS_KEY",
                "RETRIES_KEY",
                "RETRY_OF_KEY",
                "ERROR_KEY",
                "RECORD_FIELDS",
                "record_trial",
                "trial_record",
                "study_info",
                "pareto_front",
            ],
        ),
        (seeding, ["default_sampler", "sampler_seed", "ParamSeeded", "Seeding"]),
        (liveness, ["stale_trials", "fail_stale_trials"]),
    ):
        for name in names:
            assert getattr(runner, name) is getattr(mod, name), name
    assert callable(runner.run_study) and callable(runner.storage_full) and runner.FLOPS_BUCKETS


def unexplained_local_imports(pkg: Path = PKG) -> list[str]:
    """``module:line`` for each import of a module of the package made inside a function without a
    ``# reason`` comment on its line. The package's imports are at the top of each module, where a
    reader (and a tool) sees the dependency; one inside a function says why it must be there."""
    root = pkg.name
    found = set()
    for name, path in _modules(pkg).items():
        src = path.read_text()
        lines = src.splitlines()
        for fn in ast.walk(ast.parse(src)):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    ours = any(a.name == root or a.name.startswith(root + ".") for a in node.names)
                elif isinstance(node, ast.ImportFrom):
                    mod = node.module or ""
                    ours = bool(node.level) or mod == root or mod.startswith(root + ".")
                else:
                    continue
                if ours and not any("#" in line for line in lines[node.lineno - 1 : node.end_lineno]):
                    found.add(f"{name}:{node.lineno}")
    return sorted(found)


def test_a_function_local_import_of_the_package_says_why():
    assert unexplained_local_imports() == []


def test_the_local_import_check_finds_one(tmp_path):
    pkg = tmp_path / "toy"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text(
        "import os\n\n\ndef f():\n    from .b import g\n    import toy.b\n"
        "    from . import b  # the registry imports this module\n    import json\n"
        "    from toy.b import (g,\n                       h)\n"
    )
    (pkg / "b.py").write_text("def g(): ...\ndef h(): ...\n")
    assert unexplained_local_imports(pkg) == ["toy.a:5", "toy.a:6", "toy.a:9"]


# Helpers that were written two or more times, each now written once: a text that marks its body, and
# the one module that holds it.
WRITTEN_ONCE = {
    "iter(lambda: f.read(": "runs/io.py",  # a file's sha256 (io.file_sha256)
    "problem_mark": "yaml_io.py",  # a YAML file's one-line error (yaml_io.read_yaml_file)
    "; and {len(bad) - ": "models/weights.py",  # the state-dict mismatch report (weights.mismatch_report)
    "check_token_model(model,": "methods/tokens.py",  # a token method's resolve() header (tokens.token_layers)
}


def test_the_shared_helpers_are_written_once():
    for text, home in WRITTEN_ONCE.items():
        where = sorted(str(p.relative_to(PKG)) for p in PKG.rglob("*.py") if text in p.read_text())
        assert where == [home], (text, where)


def test_no_module_is_over_450_lines():
    long = {str(p.relative_to(PKG)) for p in PKG.rglob("*.py") if len(p.read_text().splitlines()) > 450}
    assert not long, f"modules over 450 lines: {sorted(long)}"
