"""Installing nascompress into a user's environment keeps the user's torch, and a plain ``import timm``
works there afterwards (issue 36, items 1 and 2).

The install check asks pip what it would do: ``pip install --dry-run --report`` of this checkout into a
fresh venv that holds this environment's torch (the CPU build here) and nothing else of ours. pip
decides from installed metadata only, so the venv receives the ``.dist-info`` of that torch and of
everything it requires (a CUDA torch's nvidia packages included): to pip it is that environment, and
the test needs no 200 MB copy. It resolves against the index pip is configured with in the
environment (``PIP_INDEX_URL``, default PyPI), never against local caps such as this machine's pip
config, which would hide the problem; it is skipped only when that index cannot be reached."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import urllib.request
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
INDEX = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")


def _index_reachable() -> bool:
    try:
        with urllib.request.urlopen(f"{INDEX}/pip/", timeout=15) as r:
            return r.status == 200
    except Exception:  # noqa: BLE001  (any network failure: skip with the reason)
        return False


def _closure(name: str) -> list[metadata.Distribution]:
    """The installed distribution ``name`` and, recursively, what it requires (no extras)."""
    seen: dict[str, metadata.Distribution] = {}
    todo = [name]
    while todo:
        n = re.split(r"[<>=!~\[ ;(]", todo.pop(), maxsplit=1)[0].strip().lower().replace("_", "-")
        if n in seen:
            continue
        try:
            dist = metadata.distribution(n)
        except metadata.PackageNotFoundError:
            continue
        seen[n] = dist
        todo += [r for r in dist.requires or [] if "extra ==" not in r]
    return list(seen.values())


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _source(tmp_path: Path) -> Path:
    """A copy of what the package is built from (building leaves build/ and *.egg-info beside it)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "nascompress", src / "nascompress", ignore=shutil.ignore_patterns("__pycache__"))
    return src


def _pip_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in ("PIP_FIND_LINKS", "PIP_CONSTRAINT", "PIP_NO_INDEX", "PIP_EXTRA_INDEX_URL", "PIP_REQUIRE_VIRTUALENV")
    }
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1")
    return env


def test_pip_install_into_an_environment_with_the_cpu_torch_keeps_torch(tmp_path):
    if not _index_reachable():
        pytest.skip(f"the package index {INDEX} cannot be reached: the install check needs it")
    torch_dist = metadata.distribution("torch")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
    py = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    have = {}
    for dist in _closure("torch"):
        info = Path(dist._path)  # the .dist-info directory
        shutil.copytree(info, site / info.name)
        have[_norm(dist.metadata["Name"])] = dist.version
    report = tmp_path / "report.json"
    r = subprocess.run(
        [str(py), "-m", "pip", "install", "--dry-run", "--quiet", "--report", str(report), str(_source(tmp_path))],
        capture_output=True,
        text=True,
        env=_pip_env(),
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    plan = {_norm(i["metadata"]["name"]): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
    assert "nascompress" in plan and "timm" in plan, sorted(plan)
    changed = {n: v for n, v in plan.items() if n in have or n == "torch" or n.startswith("nvidia-") or n == "triton"}
    assert not changed, (
        f"pip install nascompress next to torch {torch_dist.version} would install {changed} (installed: {have})"
    )


def test_the_wheel_makes_plain_import_timm_work_without_importing_nascompress(tmp_path):
    """The wheel carries a .pth whose line runs the torchvision remedy at start-up, so ``import timm``
    works in a fresh interpreter where a CUDA torchvision sits next to a CPU torch (here: the
    environment's own torchvision, its .pth files not processed)."""
    src, wheels = _source(tmp_path), tmp_path / "wheels"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(wheels),
            str(src),
        ],
        check=True,
        capture_output=True,
        env=_pip_env(),
        timeout=300,
    )
    (wheel,) = wheels.glob("nascompress-*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        pths = [n for n in z.namelist() if n.endswith(".pth") and "/" not in n]
        assert pths == ["nascompress-torchvision-cpu.pth"], z.namelist()[:20]
        z.extractall(site)
    code = (
        "import sys, site; sys.path[:0] = [{env!r}]; site.addsitedir({site!r}); import timm, torchvision; "
        "timm.create_model('vit_tiny_patch16_224', img_size=32, num_classes=3); "
        "assert not any(m.startswith('nascompress') for m in sys.modules); print('ok')"
    )
    env_site = sysconfig.get_paths()["purelib"]
    # -S: the environment's own .pth files (a hook scripts/setup.sh installed) are not run
    r = subprocess.run(
        [sys.executable, "-S", "-c", code.format(env=env_site, site=str(site))],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
