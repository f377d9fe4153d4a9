"""What is exported for a model (its graphs), and writing one graph to a file.

A model is one graph ``image -> logits``. MG-ViT is two: its early exit is a per-image branch, so it
is exported as its two stages plus the exit rule (recorded in the sidecar and applied by the caller):

* stage 1 (``sgis``): ``image -> (logits, tokens, casr)``: the coarse single-granularity pass, its
  output patch tokens and its class-attention ranking;
* stage 2 (``mgis``): ``(image, tokens, casr) -> logits`` for the images that did not exit.

An image exits with stage 1's logits when its top softmax probability is above ``epsilon``; the
other rows of (image, tokens, casr) go through stage 2, whose logits replace stage 1's.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch._inductor
from torch import nn

from ..errors import NascompressError, SettingError, write_error
from ..methods import method_names
from ..methods.mgvit_h_modules import MGPVT
from ..runs.files import Arch
from ..runs.records import TypedRecord

TWO_STAGE = ("mgvit", "mgvit-h")  # written as two graphs and the exit rule


@dataclass(frozen=True, kw_only=True)
class ExitRule(TypedRecord):
    """MG-ViT's exit rule, applied by the caller between its two graphs (the sidecar's ``exit_rule``):
    the threshold ``epsilon`` on stage 1's top softmax probability and the rule in words."""

    NEW_SOURCE = "the export's {name}"

    epsilon: float
    text: str


@dataclass(frozen=True, kw_only=True)
class WrittenGraph(TypedRecord):
    """What :func:`write_graph` wrote beyond the file (its keys go into the sidecar's ``files`` entry):
    the ONNX ``opset`` (absent for a torch.export program)."""

    NEW_SOURCE = "the export's {name}"

    opset: int | None = None


@dataclass
class Graph:
    """One exported graph: its role, module, example inputs (batch first) and tensor names."""

    role: str  # "model", or MG-ViT's "sgis" / "mgis"
    module: nn.Module
    inputs: tuple[torch.Tensor, ...]
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]


class _Stage1(nn.Module):
    """MG-ViT's first stage: image -> (SGIS logits, output patch tokens, CASR)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.model._sgis(image)


class _SGIS(nn.Module):
    """Hierarchical MG-ViT's first stage: image -> SGIS logits (the half-size coarse pass)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.model._sgis(image)


class _MGPass(nn.Module):
    """Hierarchical MG-ViT's second stage: image -> logits of the MG pass (it ranks the cells itself)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.model.forward_head(self.model.forward_features(image))


class _Stage2(nn.Module):
    """MG-ViT's second stage: (image, SGIS tokens, CASR) -> MGIS logits."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, image: torch.Tensor, tokens: torch.Tensor, casr: torch.Tensor) -> torch.Tensor:
        return self.model._mgis(image, tokens, casr)


def check_exportable(arch: Arch, *, dynamic: bool) -> None:
    """Refuse, with the reason, models that have no export path."""
    exportable = method_names(exportable=True)  # (a method's class says whether it has a path)
    for rec in arch.methods:
        name = rec.name
        if name not in exportable:
            raise NascompressError(f"method {name!r} has no export path (exportable: {', '.join(exportable)})")
        if name == "dcs" and (rec.stage or "supernet") != "materialized":
            raise NascompressError(
                "this run holds the DCS supernet (channel gates and masks, not a smaller model); "
                "export the run `nascompress materialize` makes from it"
            )
        if name in TWO_STAGE and not dynamic:
            raise SettingError(
                "MG-ViT's second stage runs on the images that did not exit, any number of them: "
                "export it with {batch} dynamic"
            )


def graphs_for(model: nn.Module, x: torch.Tensor) -> tuple[list[Graph], ExitRule | None]:
    """The graphs to export for ``model`` (a :func:`~nascompress.deploy.paths.traceable_copy`) and
    MG-ViT's exit rule (None for a single graph); ``x`` is the example batch."""
    if isinstance(model, MGPVT):
        rule = ExitRule.new(
            epsilon=float(model.mg["epsilon"]),
            text="an image exits with stage 1's logits when max(softmax(logits)) > epsilon (never at epsilon "
            "1: then stage 2 alone gives every image's logits); the images of the other rows go "
            "through stage 2, whose logits replace stage 1's",
        )
        return [
            Graph("sgis", _SGIS(model).eval(), (x,), ("image",), ("logits",)),
            Graph("mgis", _MGPass(model).eval(), (x,), ("image",), ("logits",)),
        ], rule
    if hasattr(model, "mgis") and hasattr(model, "_sgis"):
        s1, s2 = _Stage1(model).eval(), _Stage2(model).eval()
        with torch.no_grad():
            _, tokens, casr = s1(x)
        rule = ExitRule.new(
            epsilon=float(model.mg["epsilon"]),
            text="an image exits with stage 1's logits when max(softmax(logits)) > epsilon; the rows of "
            "(image, tokens, casr) of the other images go through stage 2, whose logits replace stage 1's",
        )
        return [
            Graph("sgis", s1, (x,), ("image",), ("logits", "tokens", "casr")),
            Graph("mgis", s2, (x, tokens, casr), ("image", "tokens", "casr"), ("logits",)),
        ], rule
    return [Graph("model", model, (x,), ("image",), ("logits",))], None


@contextlib.contextmanager
def quiet():
    """The exporters print progress to stdout, warn and log (with tracebacks) about things that do
    not concern a user; a failure is reported by the exception it raises."""
    before = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(before)


def _one_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:400]


def write_graph(g: Graph, path: Path, *, fmt: str, dynamic: bool, opset: int | None) -> WrittenGraph:
    """Export ``g`` to ``path`` (``onnx``, ``torch-export`` or ``aoti``); returns what was written (the opset)."""
    batch = torch.export.Dim("batch", min=1)
    shapes = tuple({0: batch} for _ in g.inputs) if dynamic else None
    try:
        with quiet(), torch.no_grad():
            if fmt in ("torch-export", "aoti"):
                ep = torch.export.export(g.module, g.inputs, dynamic_shapes=shapes)
                # serialized in memory, written by Python: torch's C++ zip writer aborts the process
                # (exit 134, a C++ stack) when the disk fills up; a Python write raises ENOSPC
                buf = io.BytesIO()
                if fmt == "aoti":  # the program compiled to native code for this CPU (AOTInductor)
                    torch._inductor.aoti_compile_and_package(ep, package_path=buf)
                else:
                    torch.export.save(ep, buf)
                with open(path, "wb") as f:
                    f.write(buf.getbuffer())
                return WrittenGraph.new()
            prog = torch.onnx.export(
                g.module,
                g.inputs,
                dynamo=True,
                dynamic_shapes=shapes,
                input_names=list(g.input_names),
                output_names=list(g.output_names),
                opset_version=opset,
                verbose=False,
            )
            prog.save(str(path))
            got = next(o.version for o in prog.model_proto.opset_import if o.domain in ("", "ai.onnx"))
    except NascompressError:
        raise
    except Exception as e:  # noqa: BLE001 (the exporters raise many kinds; one line for the user)
        full = write_error(e, what=f"the export into {path.parent}", then="then run the export again")
        if full is not None:  # a full disk or an unwritable folder, not the model's fault
            raise full from e
        raise SettingError(
            f"the {fmt} exporter failed on the {g.role} graph ({_one_line(e)}); rerun with {{debug}} for the traceback"
        ) from e
    if opset is not None and got != opset:
        raise SettingError(
            f"the ONNX exporter cannot write this model at opset {opset} (it fell back to "
            f"{got}); choose {{opset}} {got} or leave {{opset}} out"
        )
    return WrittenGraph.new(opset=got)


__all__ = ["ExitRule", "Graph", "TWO_STAGE", "WrittenGraph", "check_exportable", "graphs_for", "write_graph", "quiet"]
