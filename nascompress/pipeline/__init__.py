"""``nascompress pipeline CONFIG.yaml --out DIR``: from a model to a slim, faster model in one command.

A pipeline is a YAML file a user keeps (format ``nascompress-pipeline/1``, see ``configs/``)::

    format: nascompress-pipeline/1
    seed: 0                      # one seed drives every stage (init, data order, subsets, samplers)
    device: auto
    amp: auto                    # bf16 where the CPU has it natively (the default); bf16: every training
                                 # stage under bfloat16 autocast; off: fp32
    deterministic: false         # true: deterministic kernels in every training stage
    data: {dataset: fashion-mnist, train_limit: null, eval_limit: null}
    base:                        # exactly one of run / train / import
      train: {img_size: 28, patch_size: 4, embed_dim: 96, depth: 6, num_heads: 3, epochs: 8, lr: 1.0e-3}
    goal: {max_flops: 0.6}       # or {max_latency_ms: MS} (batch 1 on this device)
    stages:                      # each optional, run in this order
      dcs: {target_flops: 0.7, epochs: 4, train_limit: 24000, qk_mask: static}
      tokens: {space: evit, trials: 30}   # a shipped space's name, or a file
      retrain: {epochs: 4, eta: 0, distil_from: base}
    report: {latency: true, iters: 10, batch_size: 64, dtype: fp32, compile: false}
    export: {format: onnx}       # optional: OUT/export/model.onnx + .json, run and checked against PyTorch

The whole file is validated before anything runs or is written (:func:`load_config`, then the
plan: files, models, search space against the model's depth, every stage's job built): an error
names the file and the key path (``stages.dcs.target_flops: must be in (0, 1], got 1.5``).
Relative paths in the file are relative to the file's own directory; the normalized config
(defaults filled in, paths absolute) is written to ``OUT/config.yaml`` on the first run.

Stages and their directories under OUT (each step's job is the library function the matching
command runs): ``base/`` (``train``, ``import`` or a linear probe; none for ``base.run``),
``dcs_search/`` (:func:`~nascompress.dcs_search.run.search_dcs`), ``dcs_mat/``
(:func:`~nascompress.dcs_search.materialize.materialize_search`), ``tokens/`` (the study, in
``OUT/studies.db``, by :func:`~nascompress.studies.trials.run_search` on the current model, and the
trial picked under the goal in ``tokens/picked/`` by
:func:`~nascompress.studies.trial_model.materialize_trial`), ``final/``
(:func:`~nascompress.retraining.run.retrain`), ``final_channel/`` (the ``confirm`` step,
:mod:`~nascompress.pipeline.confirm`: when the pick cuts tokens, the channel-only model retrained beside
it, the better on validation kept), ``export/`` (:func:`~nascompress.deploy.export_run`, when the
file has an ``export`` section), then ``summary.json`` and ``report.html``
(:mod:`nascompress.pipeline.report`).

Resume: a step is complete when its marker ``OUT/done/<step>.json`` (written atomically after its
outputs) exists and its outputs do; complete steps are skipped. An interrupted training step
(base, DCS search, retrain, confirm) continues from its last epoch checkpoint (``resume=True``: the same
result as an uninterrupted run), the study continues by name (a trial killed mid-run is run
again in its place and the sampler continues from the seed and the trials told, so the study
and the pick are those of an uninterrupted run, see :mod:`nascompress.studies.runner`), and the
quick steps (import, materialize, pick, export, report) are redone. A rerun with another config into
the same OUT is refused; ``force`` starts over.

The package, one concern a module: :mod:`~nascompress.pipeline.schema` (the schema engine: checked
fields, sections built from YAML), :mod:`~nascompress.pipeline.sections` (the file's own sections;
a stage's is declared in its module, :mod:`~nascompress.pipeline.stages`, and the registry,
:mod:`~nascompress.pipeline.stage`, composes the file's class from them),
:mod:`~nascompress.pipeline.config_io` (reading, loading, dumping and comparing files),
:mod:`~nascompress.pipeline.plan` (the steps), :mod:`~nascompress.pipeline.run` (the output
directory, its lock and markers, :func:`run_pipeline`), :mod:`~nascompress.pipeline.fallback` (a
collapsing DCS stage) and :mod:`~nascompress.pipeline.report` (the summary and the HTML report).
This module re-exports the public API.
"""

from __future__ import annotations

from .config_io import dump_config, load_config, read_yaml
from .plan import plan
from .stage import step_names
from .stages.dcs import DCSStage
from .stages.export import ExportSection
from .stages.retrain import RetrainStage
from .stages.tokens import STUDY_DB, STUDY_JOURNAL, TokensStage
from .steps import Pipeline, Step
from .run import CONFIG_FILE, DONE_DIR, LOCK_FILE, run_pipeline, step_done
from .schema import opt
from .sections import (
    DATASET_KEYWORDS,
    FORMAT,
    BaseImportSection,
    BaseSection,
    BaseTrainSection,
    DataSection,
    GoalSection,
    PipelineConfig,
    ReportSection,
    StagesSection,
)

STEPS = step_names()  # every step a pipeline may run, in order (the registered stages')

__all__ = [
    "FORMAT",
    "PipelineConfig",
    "DataSection",
    "BaseSection",
    "BaseTrainSection",
    "BaseImportSection",
    "GoalSection",
    "DCSStage",
    "TokensStage",
    "RetrainStage",
    "StagesSection",
    "ReportSection",
    "ExportSection",
    "Pipeline",
    "Step",
    "load_config",
    "dump_config",
    "read_yaml",
    "plan",
    "run_pipeline",
    "step_done",
    "STEPS",
    "STUDY_DB",
    "STUDY_JOURNAL",
    "CONFIG_FILE",
    "DONE_DIR",
    "LOCK_FILE",
    "opt",
    "DATASET_KEYWORDS",
]
