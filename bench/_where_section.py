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


def _channel(units: dict[str, Any], cell: dict[str, Any], t: str) -> tuple[Any, Any]:
    """Channel-only test top-1 and FLOPs: this file's own DCS unit, else the baseline file's cell when it
    stands on the same base (the same probe's test top-1)."""
    own = (units.get(f"dcs-auto@{t}") or {}).get("retrained") or {}
    if own.get("test_top1") is not None:
        return own["test_top1"], own.get("flops_ratio")
    if cell.get("dense") is not None and cell.get("dense") == (units.get("dense") or {}).get("test_top1"):
        return cell.get("dcs"), cell.get("dcs_flops")
    return None, None


def _r(v: Any) -> str:
    return "-" if v is None else f"{v:.3f}"


def where_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (dataset/base, seed, target) that has a pipeline unit: every pipeline variant."""
    d, ch = data.get(WHERE_FILE) or {}, data.get(CHANNEL_FILE) or {}
    rows = []
    for key, seeds in d.items():
        if "/" not in key or not isinstance(seeds, dict):
            continue
        for seed, units in seeds.items():
            targets = sorted({u.partition("@")[2] for u in units if u.startswith("pipeline")})
            for t in targets:
                tok = units.get(f"evit@{t}") or {}
                cell = (ch.get("summary") or {}).get(f"{key}/{seed}@{t}") or {}
                channel, channel_flops = _channel(units, cell, t)
                better = max((v for v in (channel, tok.get("test_top1")) if v is not None), default=None)
                at_most = (units.get(f"dcs-auto-atmost@{t}") or {}).get("retrained") or {}
                same = at_most.get("test_top1")  # channel-only at or under the goal, as the pipeline's DCS stage
                better_same = max((v for v in (same, tok.get("test_top1")) if v is not None), default=None)
                pipes = {
                    (p["dcs_target"], bool(p.get("dcs_at_most"))): p
                    for u, p in sorted(units.items())
                    if u.startswith("pipeline") and u.endswith(f"@{t}")
                }
                rows.append(
                    {
                        "cell": f"{key.replace('/', ' / ')} / {seed}",
                        "target": float(t),
                        "dense": (units.get("dense") or {}).get("test_top1"),
                        "dense_ft": cell.get("dense_ft") if channel == cell.get("dcs") else None,
                        "channel": channel,
                        "channel_flops": channel_flops,
                        "token": tok.get("test_top1"),
                        "token_flops": tok.get("flops_ratio"),
                        "keep_rate": tok.get("keep_rate"),
                        "better": better,
                        "channel_at_most": same,
                        "channel_at_most_flops": at_most.get("flops_ratio"),
                        "better_same_flops": None if same is None else better_same,
                        "pipelines": pipes,
                    }
                )
    return rows


def _label(p: dict[str, Any]) -> str:
    """The picked model's methods; a token method at keep 1 everywhere (runs before trials at their off
    setting were built without it) prunes nothing and is named as such."""
    methods = list(p.get("methods") or [])
    pick = (p.get("candidates") or {}).get(p.get("picked_study") or "") or {}
    rates = [v for k, v in (pick.get("params") or {}).items() if "keep_rate" in k]
    if "evit" in methods and rates and all(v == 1.0 for v in rates):
        return " + ".join(m for m in methods if m != "evit") + ", evit at keep 1"
    return " + ".join(methods) or "-"


def _verdict(p: dict[str, Any] | None, better: Any) -> str:
    """Whether the pipeline ``p`` is at or above ``better`` ("-" where either is missing)."""
    if p is None or better is None:
        return "-"
    return "yes" if p["test_top1"] >= better else "no"


def _pipe_cell(p: dict[str, Any] | None) -> str:
    """Test top-1 (methods, FLOPs); where the confirm step ran, the model it set aside and its test top-1."""
    if not p:
        return "-"
    ck, why = p.get("confirm") or {}, ""
    if ck.get("kept") == "channel-only":
        why = f"; confirm: kept over the {ck['pick_kind']} pick, {_f(ck['pick_test_top1'])}"
    elif ck.get("kept") == "pick" and ck.get("channel_test_top1") is not None:
        why = f"; confirm: kept over channel-only, {_f(ck['channel_test_top1'])}"
    return f"{_f(p['test_top1'])} ({_label(p)}, {_r(p['flops_ratio'])}x{why})"


def where_table(data: dict[str, Any]) -> list[str]:
    """Lines between the README's where-cut markers."""
    rows = where_rows(data)
    if not rows:
        return [
            "(not measured yet: `python bench/dcs_generalise.py --bases dinov2 --targets 0.6 --units evit,pipeline "
            "--out bench/results/dcs_generalise_where.json`)"
        ]
    variants = sorted({v for r in rows for v in r["pipelines"]}, key=lambda v: (-v[0], v[1]))

    def label(v: tuple[float, bool]) -> str:
        return f"DCS at {v[0]:g}" + (", at_most" if v[1] else "")

    same = any(r["better_same_flops"] is not None for r in rows)  # channel-only also run with at_most
    last = variants[-1]  # the shipped recipe's: judged against channel-only at the same FLOPs too
    out = [
        "| dataset / base / seed | dense (probe) | channel-only: DCS, retrained | "
        + ("channel-only at the goal: DCS with at_most, retrained | " if same else "")
        + "token-only: EViT, fine-tuned | "
        + " | ".join(f"pipeline, {label(v)} | >= the better" for v in variants)
        + (" | >= the better at the same FLOPs" if same else "")
        + " |",
        "|---|---|---|---|" + "---|" * same + "---|---|" * len(variants) + "---|" * same,
    ]
    for r in rows:
        cells = []
        for v in variants:
            p = r["pipelines"].get(v)
            cells += [_pipe_cell(p), _verdict(p, r["better"])]
        if same:
            cells.append(_verdict(r["pipelines"].get(last), r["better_same_flops"]))
        ch_same = (
            "-" if r["channel_at_most"] is None else f"{_f(r['channel_at_most'])} ({_r(r['channel_at_most_flops'])}x)"
        )
        out.append(
            f"| {r['cell']} | {_f(r['dense'])} | "
            + ("-" if r["channel"] is None else f"{_f(r['channel'])} ({_r(r['channel_flops'])}x)")
            + " | "
            + (f"{ch_same} | " if same else "")
            + f"{_f(r['token'])} (keep {_f(r['keep_rate'])}, {_r(r['token_flops'])}x) | "
            + " | ".join(cells)
            + " |"
        )
    out.append("")
    for v, key, against in [(v, "better", "channel-only and token-only") for v in variants] + [
        (
            last,
            "better_same_flops",
            "channel-only at the same FLOPs (its search with at_most, as the pipeline's DCS stage) and token-only",
        )
    ]:
        judged = [(r, r["pipelines"][v]) for r in rows if v in r["pipelines"] and r[key] is not None]
        if judged:
            gaps = [p["test_top1"] - r[key] for r, p in judged]
            out.append(
                f"- Pipeline, {label(v)}: at or above the better of {against} in "
                f"{sum(g >= 0 for g in gaps)} of {len(judged)} cells (minus the better: "
                f"{', '.join(f'{g:+.1f}' for g in gaps)} pt; mean {sum(gaps) / len(gaps):+.2f} pt)."
            )
    return out
