"""Packaging that fits a user's environment: ranges in pyproject.toml, exact versions only in
constraints.txt, no top-level package but ``nascompress``, and a plain ``import timm`` that works
without importing nascompress first."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _requirements() -> dict[str, str]:
    out = {}
    for req in PROJECT["dependencies"]:
        name = re.split(r"[<>=!~\[ ;]", req, maxsplit=1)[0].lower()
        out[name] = req[len(name) :]
    return out


def _constraints() -> dict[str, str]:
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not an exact pin"
            pins[name.lower()] = version
    return pins


def test_torch_torchvision_timm_are_ranges_not_pins():
    reqs = _requirements()
    for name in ("torch", "torchvision", "timm"):
        assert name in reqs and "==" not in reqs[name] and (">=" in reqs[name]), (name, reqs.get(name))


def test_constraints_pin_what_is_installed_and_satisfy_the_ranges():
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    pins, reqs = _constraints(), _requirements()
    for name in ("torch", "torchvision", "timm"):
        assert SpecifierSet(reqs[name]).contains(Version(pins[name])), (name, pins[name], reqs[name])
        installed = Version(metadata.version(name))
        assert installed.public == Version(pins[name]).public, f"{name} {installed} installed, {pins[name]} pinned"


def test_only_the_nascompress_package_is_installed_and_the_cli_lives_inside_it():
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert pyproject["tool"]["setuptools"]["packages"]["find"]["include"] == ["nascompress*"]
    assert PROJECT["scripts"]["nascompress"] == "nascompress.cli.main:app"
    assert not (REPO / "cli").exists() and (REPO / "nascompress" / "cli" / "main.py").is_file()


def test_plain_import_timm_works_without_nascompress():
    code = (
        "import sys, timm, torchvision; assert not any(m.startswith('nascompress') for m in sys.modules); print('ok')"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
