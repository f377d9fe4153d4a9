"""A toy pipeline stage, the whole of it in this one module (tests/test_pipeline_stage.py registers it):
after the channel stage it counts the parameters of the model so far into ``OUT/toy/params.json``."""

from __future__ import annotations

import json
from typing import Any

from nascompress.pipeline.stage import PipelineStage, PlanState, StagePlan
from nascompress.pipeline.steps import Step
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


STAGE = PipelineStage("toy", 15, ("toy_params",), section=lambda cfg: cfg.report, plan=plan_toy)
