"""The README's "where to cut" table: the pipeline against channel-only and token-only models of the same
bases at the same FLOPs and retraining budget, generated from ``bench/results/dcs_generalise_where.json``
(``bench/dcs_generalise.py --units evit,pipeline``) and the channel-only cells of
``dcs_generalise_baseline.json``, by ``bench/make_results.py``; no torch here."""

from __future__ import annotations

from typing import Any

WHERE_START, WHERE_END = "<!-- where-cut:start -->", "<!-- where-cut:end -->"
WHERE_FILE, CHANNEL_FILE = "dcs_generalise_where.json", "dcs_generalise_baseline.json"


def _f(v: Any) -> str:
    return "-" if v is None else f"{v:.2f}".rstrip("0").rstrip(".")


def where_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (dataset/base, seed, target) that has a pipeline unit."""
    d, ch = data.get(WHERE_FILE) or {}, data.get(CHANNEL_FILE) or {}
    rows = []
    for key, seeds in d.items():
        if "/" not in key or not isinstance(seeds, dict):
            continue
        for seed, units in seeds.items():
            for unit, p in units.items():
                if not unit.startswith("pipeline@"):
                    continue
                t = unit.partition("@")[2]
                tok = units.get(f"evit@{t}") or {}
                cell = (ch.get("summary") or {}).get(f"{key}/{seed}@{t}") or {}
                channel = cell.get("dcs")
                better = max((v for v in (channel, tok.get("test_top1")) if v is not None), default=None)
                rows.append(
                    {
                        "cell": f"{key.replace('/', ' / ')} / {seed}",
                        "target": float(t),
                        "dense": (units.get("dense") or {}).get("test_top1"),
                        "dense_ft": cell.get("dense_ft"),
                        "channel": channel,
                        "channel_flops": cell.get("dcs_flops"),
                        "token": tok.get("test_top1"),
                        "token_flops": tok.get("flops_ratio"),
                        "keep_rate": tok.get("keep_rate"),
                        "pipeline": p["test_top1"],
                        "pipeline_flops": p["flops_ratio"],
                        "methods": " + ".join(p.get("methods") or []) or "-",
                        "met": None if better is None else p["test_top1"] >= better,
                    }
                )
    return rows


def where_table(data: dict[str, Any]) -> list[str]:
    """Lines between the README's where-cut markers."""
    rows = where_rows(data)
    if not rows:
        return [
            "(not measured yet: `python bench/dcs_generalise.py --bases dinov2 --targets 0.6 --units evit,pipeline "
            "--out bench/results/dcs_generalise_where.json`)"
        ]
    out = [
        "| dataset / base / seed | dense (probe) | channel-only: DCS, retrained | token-only: EViT, fine-tuned "
        "| pipeline (its pick) | dense retrained | pipeline >= the better |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['cell']} | {_f(r['dense'])} | {_f(r['channel'])} ({_f(r['channel_flops'])}x) | "
            f"{_f(r['token'])} (keep {_f(r['keep_rate'])}, {_f(r['token_flops'])}x) | "
            f"{_f(r['pipeline'])} ({r['methods']}, {_f(r['pipeline_flops'])}x) | {_f(r['dense_ft'])} | "
            f"{'-' if r['met'] is None else 'yes' if r['met'] else 'no'} |"
        )
    judged = [r for r in rows if r["met"] is not None]
    gaps = [r["pipeline"] - max(v for v in (r["channel"], r["token"]) if v is not None) for r in judged]
    if judged:
        out += [
            "",
            f"- The pipeline at or above the better of channel-only and token-only in {sum(r['met'] for r in judged)} "
            f"of {len(judged)} cells (pipeline minus the better: {', '.join(f'{g:+.1f}' for g in gaps)} pt).",
        ]
    return out
