"""A toy pipeline stage, the whole of it in this one module (tests/test_pipeline_stage.py registers it):
after the channel stage it counts the parameters of the model so far into ``OUT/toy/params.json``;
the report records the count in ``summary.json``'s ``decisions.toy`` and says it in its decisions.
Its section, ``stages.toy``, has a key of its own (``scale``), declared here and checked as the
file is read like every other key; the stage runs when the section is given."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from nascompress.config import setting
from nascompress.pipeline.schema import Section
from nascompress.pipeline.stage import PipelineStage, PlanState, ReportState, StagePlan
from nascompress.pipeline.steps import Step
from nascompress.pipeline.summary import Decisions
from nascompress.runs.io import load_with_arch


@dataclass(frozen=True)
class ToySection(Section):
    """``stages.toy``: count the parameters after the channel stage."""

    scale: float = setting(1.0, lo=0, lo_open=True, help="The count is also written times this (1e-3: thousands).")


def plan_toy(state: PlanState, section: ToySection) -> StagePlan:
    model_dir, out, scale = state.current, state.out / "toy", section.scale

    def run(force: bool, resume: bool) -> dict[str, Any]:
        model, _ = load_with_arch(model_dir)
        params = sum(p.numel() for p in model.parameters())
        out.mkdir(exist_ok=True)
        counted = {"model": str(model_dir), "params": params, "scaled": params * scale}
        (out / "params.json").write_text(json.dumps(counted))
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
    plan=plan_toy,
    config=ToySection,  # its keys: stages.toy
    decide=decide_toy,
    report_lines=toy_lines,
)
