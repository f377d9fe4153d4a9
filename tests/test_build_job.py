"""No job is built outside its stage's ``build_job`` (issue 51): each stage's job class is built in one
library function, which the stage's CLI command, its pipeline section and the Python API call. A
front end (``nascompress/cli/``, ``nascompress/pipeline/``, ``nascompress/pyapi/`` and
``nc.export.onnx``) that constructs a job class itself (``TrainJob(...)``, ``run(TrainJob, ...)``,
``library_config(section, <a job's settings>)``) fails here."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

from nascompress.config import StageSettings

PKG = Path(__file__).resolve().parents[1] / "nascompress"
FRONT_ENDS = [
    *sorted((PKG / "cli").glob("*.py")),
    *sorted((PKG / "pipeline").rglob("*.py")),  # (its stages in pipeline/stages/)
    *sorted((PKG / "pyapi").glob("*.py")),
]
# jobs that are settings dataclasses of a stage without a *Job class, and their builder's name
OTHER_JOBS = {"ExportConfig": ("nascompress.deploy.config", "build_config")}
# a job whose builder lives beside the stage's run, not beside the class
BUILDER_MODULES = {"DCSSearchJob": "nascompress.dcs_search.run"}
# "path:ClassName" -> why it is still built there (none: every front end calls the builder)
ALLOWED: dict[str, str] = {}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def job_classes() -> dict[str, tuple[str, str]]:
    """Every stage job class of the package (``class ...Job`` but protocols), by name: (its module,
    its builder's name), and :data:`OTHER_JOBS`."""
    found: dict[str, tuple[str, str]] = dict(OTHER_JOBS)
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name.endswith("Job"):
                if any(isinstance(b, ast.Name) and b.id == "Protocol" for b in node.bases):
                    continue  # a type (dcs_search.prepare.SearchJob: what a DCS search reads), not a job
                assert node.name not in found, f"two job classes named {node.name}"
                found[node.name] = (BUILDER_MODULES.get(node.name, _module_name(path)), "build_job")
    return found


def settings_names() -> dict[str, str]:
    """The module-level names of every StageSettings over a job class (``library_config(section, NAME)``
    builds that job), and the class."""
    jobs, names = job_classes(), {}
    for path in PKG.rglob("*.py"):
        mod = importlib.import_module(_module_name(path))
        names |= {
            k: v.cls.__name__ for k, v in vars(mod).items() if isinstance(v, StageSettings) and v.cls.__name__ in jobs
        }
    return names


def constructions(path: Path, jobs: set[str], settings: dict[str, str]) -> list[tuple[int, str]]:
    """(line, class) of each place ``path`` builds a job itself."""

    def name(node: ast.AST) -> str | None:
        if isinstance(node, ast.Name):
            return node.id
        return node.attr if isinstance(node, ast.Attribute) else None

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        called = name(node.func)
        if called in jobs:  # TrainJob(...)
            found.append((node.lineno, called))
        elif called == "run" and node.args and name(node.args[0]) in jobs:  # the CLI's run(TrainJob, ...)
            found.append((node.lineno, name(node.args[0])))
        elif (
            called in ("library_config", "settings_class")
            and len(node.args) > 1
            and (name(node.args[1]) in jobs or name(node.args[1]) in settings)
        ):  # a section -> a job
            found.append((node.lineno, settings.get(name(node.args[1]), name(node.args[1]))))
    return found


def test_every_job_class_has_its_build_job():
    for cls, (module, builder) in job_classes().items():
        fn = getattr(importlib.import_module(module), builder, None)
        assert callable(fn), f"{module} has no {builder} for {cls}"
        assert inspect.signature(fn).return_annotation in (cls, getattr(importlib.import_module(module), cls)), (
            f"{module}.{builder} does not return a {cls}"
        )


def test_no_front_end_builds_a_job_itself():
    jobs = job_classes()
    settings = settings_names()
    assert {"STUDY_SETTINGS", "IMPORT_SETTINGS", "FROM_STUDY"} <= set(settings)  # (the scan reads them)
    bad = []
    for path in FRONT_ENDS:
        rel = path.relative_to(PKG.parent)
        for line, cls in constructions(path, set(jobs), settings):
            if f"{rel}:{cls}" not in ALLOWED:
                module, builder = jobs.get(cls, (None, "build_job"))
                bad.append(f"{rel}:{line} builds {cls} itself; call {module or 'its stage'}.{builder}")
    assert not bad, "\n".join(bad)


def test_the_scan_sees_a_job_built_directly(tmp_path):
    src = tmp_path / "front.py"
    src.write_text(
        "from nascompress.train.run import TrainJob\n\n"
        "def build(run, spec, s):\n"
        "    a = TrainJob(model=spec)\n"
        "    b = run(TrainJob, model=spec)\n"
        "    c = library_config(s, STUDY_SETTINGS)\n"
        "    d = nascompress.importer.run.ImportJob(model='m', weights='w', out='o')\n"
        "    return build_job(spec, 'o'), setting_option(TrainJob, 'weights')\n"
    )
    assert constructions(src, set(job_classes()), {"STUDY_SETTINGS": "SearchJob"}) == [
        (4, "TrainJob"),
        (5, "TrainJob"),
        (6, "SearchJob"),
        (7, "ImportJob"),
    ]


@pytest.mark.parametrize("allowed", sorted(ALLOWED))
def test_the_allow_list_is_current(allowed):
    """An entry that no longer matches a construction is removed (the list only shrinks)."""
    path, cls = allowed.split(":")
    assert constructions(PKG.parent / path, {cls}, {}), f"{allowed} is built through its builder now"
