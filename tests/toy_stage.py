"""A toy pipeline stage, the whole of it in this one module (tests/test_pipeline_stage.py registers it):
after the channel stage it counts the parameters of the model so far into ``OUT/toy/params.json``;
the report records the count in ``summary.json``'s ``decisions.toy`` and says it in its decisions."""

from __future__ import annotations

import json
from typing import Any

from nascompress.pipeline.stage import PipelineStage, PlanState, ReportState, StagePlan
from nascompress.pipeline.steps import Step
from nascompress.pipeline.summary import Decisions
from nascompress.runs.io import load_with_arch


def plan_toy(state: PlanState, section: Any) -> StagePlan:
    model_dir, out = state.current, state.out / "toy"

    def run(force: bool, resume: bool) -> dict[str, Any]:
        model, _ = load_with_arch(model_dir)
        params = sum(p.numel() for p in model.parameters())
        out.mkdir(exist_ok=True)
        (out / "params.json").write_text(json.dumps({"model": str(model_dir), "params": params}))
        return {"params": params}

    step = Step("toy_params", out, "redo", run, outputs=("toy/params.json",), describe="count the parameters")
    return StagePlan([step])  # the model is left as it was


def decide_toy(state: ReportState) -> dict[str, Any]:
    counted = state.pipe.out / "toy" / "params.json"
    return {"toy": json.loads(counted.read_text())} if counted.is_file() else {}


def toy_lines(decisions: Decisions) -> list[str]:
    toy = decisions.extra.get("toy")  # a key of this stage's own
    return [] if toy is None else [f"toy: {toy['params']:,} parameters after the channel stage"]


STAGE = PipelineStage(
    "toy",
    15,
    ("toy_params",),
    section=lambda cfg: cfg.report,
    plan=plan_toy,
    decide=decide_toy,
    report_lines=toy_lines,
)
