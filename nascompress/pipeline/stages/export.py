"""The ``export`` stage (the config's ``export`` section): the final model as a deployable file
(``OUT/export/<file>`` and its sidecar), checked against PyTorch; quantized and checked on the
validation split when asked."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from ...config import StageSettings, setting
from ...deploy import export_run
from ...deploy.config import ExportConfig, build_config
from ...deploy.verify import AccuracyCheck, Check, sidecar_check
from ..base_stage import data_config
from ..fallback import current_model
from ..schema import KeyProblem, Section, library_keys, library_values
from ..stage import PipelineStage, PlanState, StagePlan, register_stage
from ..steps import Step

# `export`'s keys: ExportConfig's settings but the check's seed (the pipeline's seed)
EXPORT_SETTINGS = StageSettings(
    ExportConfig, tuple(f.name for f in fields(ExportConfig) if "help" in f.metadata and f.name != "seed")
)


@dataclass(frozen=True)
@library_keys(EXPORT_SETTINGS, lead=("file",))
class ExportSection(Section):
    """``export``: end with a deployable file of the final model, ``OUT/export/<file>`` and its sidecar
    (``nascompress export``: the other keys are its options, every user-facing field of
    :class:`~nascompress.deploy.ExportConfig`, declared there with its checks; the check's seed is the
    pipeline's)."""

    file: str | None = setting(
        None,
        help=("The file in OUT/export/ (default model.onnx; model.int8.onnx quantized; model.pt2 for torch-export)."),
    )

    def __post_init__(self) -> None:
        self.config(seed=0)
        if self.file is not None and Path(self.file).name != self.file:
            raise KeyProblem("file", f"must be a file name (it is written into OUT/export/), got {self.file!r}")

    def config(self, *, seed: int) -> Any:
        return build_config({**library_values(self, EXPORT_SETTINGS), "seed": seed})

    @property
    def filename(self) -> str:
        if self.file:
            return self.file
        return "model.pt2" if self.format != "onnx" else "model.onnx" if self.quantize == "none" else "model.int8.onnx"


def plan_export(state: PlanState, s: Any) -> StagePlan:
    """The export step of section ``s`` (onnx and onnxruntime required for an ONNX file)."""
    cfg, out, base_dir = state.cfg, state.out, state.base_dir
    needs = ("onnx", "onnxruntime") if s.format == "onnx" else ()
    missing = [m for m in needs if importlib.util.find_spec(m) is None]
    if missing:  # refused now, not after every training stage
        raise state.ctx.err(
            "export",
            f"format onnx needs {' and '.join(missing)}: pip install 'nascompress[export]', or drop the export section",
        )
    target, ec = out / "export" / s.filename, s.config(seed=cfg.seed)

    def run(force: bool, resume: bool) -> Check | AccuracyCheck:
        st = cfg.stages
        final = current_model(
            out,
            base_dir=base_dir,
            dcs=st.dcs is not None,
            tokens=st.tokens is not None,
            retrain=st.retrain is not None,
            upto="final",
        )  # after a DCS fallback: what was made
        # no compressed model (the DCS stage was skipped and nothing else compresses): the base is exported
        # (int8: calibrated and checked on the pipeline's data)
        side = export_run(final or base_dir, out=target, config=ec, force=True, data=data_config(cfg))
        return sidecar_check(side)  # the check, as the file has it: its scalars go in the step's marker

    step = Step(
        "export",
        out / "export",
        "redo",  # the step owns OUT/export: an earlier attempt is replaced
        run,
        outputs=(f"export/{s.filename}", f"export/{s.filename}.json"),
        describe=f"export the final model as {s.format} (export/{s.filename}), checked against PyTorch"
        + (f"; quantized ({s.quantize}) and checked on the validation split" if s.quantize != "none" else ""),
    )
    return StagePlan([step])


STAGE = register_stage(PipelineStage("export", 40, ("export",), plan=plan_export, config=ExportSection, top_level=True))
