"""docs/results.md and the README's results table are generated from bench/results/ and cannot drift from it;
the repository names no folder of a particular machine."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import make_results  # noqa: E402
from _common import relative_paths  # noqa: E402


def test_results_doc_is_up_to_date():
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "make_results.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr


def test_every_result_file_has_a_section():
    doc = (REPO / "docs" / "results.md").read_text()
    results = REPO / "bench" / "results"
    for path in sorted(results.rglob("*.json")) + sorted(results.rglob("*.jsonl")):  # the generator's files
        assert f"### `{path.relative_to(REPO / 'bench' / 'results')}`" in doc, path.name


def test_unknown_and_fault_results_render_with_their_command():
    data = {
        "faults.json": {
            "command": "python bench/faults.py",
            "machine": {"cpu_threads": 2, "cpu_count": 2},
            "faults": [{"fault": "kill -9 during the base", "outcome": "resumed", "same_result": True}],
        },
        "zzz_new.json": {
            "command": "python bench/zzz.py --x 1",
            "rows": {"a": {"x": 1.5, "y": 2}, "b": {"x": 3.25, "y": 4}},
        },
    }
    doc = make_results.render(data)
    assert "## Faults and refusals" in doc and "kill -9 during the base" in doc
    assert "Run: `python bench/faults.py`" in doc and "2 torch threads of 2 CPUs" in doc
    assert "### `zzz_new.json`" in doc and "Run: `python bench/zzz.py --x 1`" in doc
    assert "| a | 1.500 | 2 |" in doc and "| b | 3.250 | 4 |" in doc
    assert "faults" not in make_results.render({k: v for k, v in data.items() if k != "faults.json"})


def test_readme_table_figures_come_from_their_json():
    readme = (REPO / "README.md").read_text()
    start, end = readme.index(make_results.TABLE_START), readme.index(make_results.TABLE_END)
    rows = readme[start:end]
    summary = make_results.load(REPO / "bench" / "results" / "pipeline_fashion_mnist.json")
    assert f"{summary['comparison']['flops_ratio']:.3f}x" in rows and "pipeline_fashion_mnist.json" in rows


@pytest.mark.parametrize(
    "text,expected",
    [
        ("--weights /home/me/weights/vit.safetensors --runs runs/p", "--weights weights/vit.safetensors --runs runs/p"),
        ("sqlite:////home/me/proj/runs/demo/studies.db", "sqlite:///runs/demo/studies.db"),
        ("sqlite:///runs/demo/studies.db", "sqlite:///runs/demo/studies.db"),
        ("--storage sqlite:///small/s.db", "--storage sqlite:///small/s.db"),
        ("http://host.example/a/b", "http://host.example/a/b"),
        ("/var/scratch/sp_bench", "sp_bench"),
        ("/usr/share/datasets/fashion-mnist", "/usr/share/datasets/fashion-mnist"),
        ("val / test 0.5/1.0", "val / test 0.5/1.0"),
    ],
)
def test_machine_paths_are_made_relative(text, expected):
    assert relative_paths({"a": [text]}) == {"a": [expected]}
    assert relative_paths(relative_paths(text)) == expected  # idempotent


def test_repository_holds_no_machine_path():
    try:
        files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    bad = re.compile(rb"/(work|tmp)/|\.\./shared")
    hits = []
    for name in filter(None, files.split(b"\0")):
        path = REPO / name.decode()
        if path.is_file() and bad.search(path.read_bytes()):
            hits.append(name.decode())
    assert not hits, f"machine paths in {hits}"


def test_readme_cli_reference_matches_the_app():
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "cli_reference.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr


def test_int8_goal_lines_say_what_is_not_met():
    q = make_results.load(REPO / "bench" / "results" / "quantize.json")
    lines = make_results.int8_goals({"quantize.json": q})
    assert any(line.startswith("- Main job, compressed + int8") for line in lines)
    q["goals"]["main_job"]["latency_goal_1.5x_met"] = False  # a missed goal must read as missed
    text = "\n".join(make_results.int8_goals({"quantize.json": q}))
    assert "goal 1.5x **not met**" in text
    assert make_results.int8_goals({}) == []


def test_sampler_table_rows_come_from_the_50_trial_files():
    data = {n: make_results.load(REPO / "bench" / "results" / n) for n in ("samplers_mainjob.json", "samplers.json")}
    rows = make_results.samplers_table(data)
    body = "\n".join(rows)
    assert "`samplers_mainjob.json`" in body and "`samplers.json`" not in body  # 30-trial files are not in it
    summ = data["samplers_mainjob.json"]["results"]["mainjob"]["evit"]["summary"]
    evit = next(r for r in rows if "`evit`" in r)
    best = summ["best_at_30"][0]
    assert f"**{summ['mean'][best]['30']['hypervolume']:.2f}**" in evit and "refuses" in evit  # gp, qmc refuse
    reached = summ["reaches_99pct_of_best_within_30_on_every_seed"]["tpe"]
    assert evit.rstrip(" |").endswith("yes" if reached else "no")


def test_dcs_summary_counts_goals_and_peer_margins_per_base():
    summ = {
        "d/dinov2/seed0@0.7": {"dcs": 90.0, "uniform": 85.0, "torch_pruning": 89.5, "goals": {"a": True, "b": False}},
        "d/dinov2/seed1@0.7": {"dcs": 91.0, "uniform": 90.0, "torch_pruning": None, "goals": {"a": True}},
        "d/scratch/seed0@0.6": {"dcs": None, "uniform": 80.0, "goals": {}},
    }
    lines = make_results.dcs_generalise_summary(summ)
    assert lines[0] == (
        "- **dinov2**: 2 of 3 goals met over 2 cells; DCS minus uniform +3.00 pt on average "
        "(+1.00 to +5.00, 2 cells); DCS minus Torch-Pruning +0.50 pt on average "
        "(+0.50 to +0.50, 1 cells)."
    )
    assert lines[1] == "- **scratch**: 0 of 0 goals met over 1 cells."
