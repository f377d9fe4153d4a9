"""Planning a pipeline: every stage's job built (and so validated) before anything runs, as
:class:`Step` objects of a :class:`Pipeline` (:func:`plan`)."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from ..errors import NascompressError
from .config_io import PipelineSource, config_context, read_config
from ..runtime import resolve_device
from .report import write_summary
from .summary import Summary
from .stage import PlanState, registered_stages
from .steps import Pipeline, Step
from .base_stage import check_data, data_config, plan_base


def plan(
    config: PipelineSource, *, out: str | Path, seed: int | None = None, source: str = "the pipeline config"
) -> Pipeline:
    """Validate ``config`` (a pipeline file, its sections as data, named ``source`` in errors, or the
    typed config read from them)
    completely (schema, files, models, space, every stage's job) and return the pipeline for ``out``.
    Reads files, writes nothing."""
    ctx = config_context(config, source=source)  # (the file found once: a path, or a shipped config's name)
    cfg = read_config(config, ctx, seed=seed)
    try:
        resolve_device(cfg.device)
    except NascompressError as e:
        raise ctx.err("device", str(e)) from None
    out = Path(os.path.abspath(out))
    n_classes = check_data(cfg, ctx)
    base_step, base_dir, dense = plan_base(cfg, out, ctx, n_classes)
    steps = [base_step]
    state = PlanState(cfg=cfg, out=out, ctx=ctx, base_dir=base_dir, dense=dense, current=base_dir)
    storage = None
    for stage in registered_stages():  # (pipeline/stages/: dcs, tokens, retrain, export)
        section = stage.section_of(cfg)
        if section is None:
            if stage.when_off is not None:
                stage.when_off(state)
            continue
        made = stage.plan(state, section)
        steps += made.steps
        state = replace(state, current=made.model or state.current)
        storage = made.storage or storage
    current = state.current
    pipe = Pipeline(
        cfg=cfg,
        out=out,
        source=ctx.source,
        steps=steps,
        base_dir=base_dir,
        final_dir=current,
        storage=storage,
        data=data_config(cfg),
    )

    def report(force: bool, resume: bool) -> Summary:
        return write_summary(pipe)

    steps.append(
        Step(
            "report",
            None,
            "redo",
            report,
            outputs=("summary.json", "report.html"),
            describe="compare with the dense base; write summary.json and report.html",
        )
    )
    return pipe
