"""The package's layers, as its folder tree shows them: the front ends (``cli/``, the Python API in
``pyapi/``) on top and imported by nothing in the library; a handful of core modules at the root
(every other module in a package of its stage or of a shared concern); one home per name (no module
but a package's ``__init__`` hands on names it imports from another module)."""

from __future__ import annotations

import ast
from pathlib import Path

from .test_imports import PKG, _modules, import_graph

FRONT_ENDS = ("nascompress.cli", "nascompress.pyapi")
ROOT_MODULES = 8  # errors, config, limits, progress, runtime, yaml_io and the two torchvision fixes


def _in(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def front_end_imports(graph: dict[str, set[str]], root: str = "nascompress") -> list[str]:
    """``module -> front end`` for each library module that imports a front end (the package's own
    ``__init__`` names the Python API's functions lazily, by string, and is not a library module)."""
    return sorted(
        f"{m} -> {d}"
        for m, deps in graph.items()
        if m != root and not _in(m, FRONT_ENDS)
        for d in deps
        if _in(d, FRONT_ENDS)
    )


def re_exports(pkg: Path = PKG) -> list[str]:
    """``module: name`` for each name a module other than a package ``__init__`` lists in its
    ``__all__`` without defining it (imported from its real home, to be imported from there)."""
    found = []
    for name, path in sorted(_modules(pkg).items()):
        if path.name == "__init__.py":
            continue
        tree = ast.parse(path.read_text())
        imported, defined, listed = set(), set(), []
        for node in tree.body:
            if isinstance(node, ast.ImportFrom):
                imported |= {a.asname or a.name for a in node.names}
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, ast.Assign):
                targets = {n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
                defined |= targets
                if "__all__" in targets and isinstance(node.value, (ast.List, ast.Tuple)):
                    listed = [e.value for e in node.value.elts if isinstance(e, ast.Constant)]
        found += [f"{name}: {n}" for n in listed if n in imported and n not in defined]
    return found


def test_nothing_in_the_library_imports_a_front_end():
    graph = import_graph()
    assert "nascompress.pyapi.compress" in graph and "nascompress.cli.main" in graph
    assert front_end_imports(graph) == []


def test_the_front_end_check_finds_one():
    graph = {"nascompress": {"nascompress.pyapi.x"}, "nascompress.deploy": {"nascompress.pyapi.common"}}
    graph |= {"nascompress.cli.main": {"nascompress.pyapi.x"}, "nascompress.pyapi.x": set()}
    assert front_end_imports(graph) == ["nascompress.deploy -> nascompress.pyapi.common"]


def test_the_root_holds_only_the_core_modules():
    root = sorted(p.name for p in PKG.glob("*.py") if p.name != "__init__.py")
    assert len(root) <= ROOT_MODULES, root


def test_no_module_but_a_package_init_hands_on_names():
    assert re_exports() == []


def test_the_re_export_check_finds_one(tmp_path):
    pkg = tmp_path / "toy"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .a import f\n__all__ = ['f']\n")
    (pkg / "a.py").write_text("def f(): ...\n")
    (pkg / "b.py").write_text("from .a import f\n\n\ndef g(): ...\n\n\n__all__ = ['f', 'g']\n")
    assert re_exports(pkg) == ["toy.b: f"]
