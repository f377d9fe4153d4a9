"""The package's import graph has no cycle (imports inside functions included; ``if TYPE_CHECKING:``
blocks excluded, they never run): every module can be read, tested and moved on its own."""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "nascompress"


def _modules() -> dict[str, Path]:
    mods = {}
    for p in PKG.rglob("*.py"):
        parts = p.relative_to(PKG.parent).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return mods


def _runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    out: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for sub in child.orelse:
                    visit(sub)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                out.append(child)
            visit(child)

    visit(tree)
    return out


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        deps: set[str] = set()
        for node in _runtime_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                    pkg = pkg[:len(pkg) - (node.level - 1)]
                    base = ".".join(pkg + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            deps.update(t for t in targets if t in mods and t != name)
        graph[name] = deps
    return graph


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
    assert "nascompress.search.trial_model" in graph and "nascompress.cli.main" in graph
    assert cycles(graph) == []


def test_the_cycle_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_library_never_imports_typer():
    lib = {n: p for n, p in _modules().items() if not n.startswith("nascompress.cli")}
    for name, path in lib.items():
        for node in _runtime_imports(ast.parse(path.read_text())):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            assert not any(m == "typer" or m.startswith("typer.") for m in mods), name


def test_the_study_runner_still_exports_what_it_did_before_the_split():
    from nascompress.studies import liveness, records, runner, seeding

    for mod, names in ((records, ["RECORD_KEY", "WORKER_KEY", "FAIL_REASON_KEY", "SURPLUS_KEY", "RETRIES_KEY",
                                  "RETRY_OF_KEY", "ERROR_KEY", "RECORD_FIELDS", "record_trial", "trial_record",
                                  "study_info", "pareto_front"]),
                       (seeding, ["default_sampler", "sampler_seed", "ParamSeeded", "_Seeding"]),
                       (liveness, ["stale_trials", "fail_stale_trials"])):
        for name in names:
            assert getattr(runner, name) is getattr(mod, name), name
    assert callable(runner.run_study) and callable(runner.storage_full) and runner.FLOPS_BUCKETS
