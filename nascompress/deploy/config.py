"""Settings of ``nascompress export`` and ``nascompress quantize`` (one dataclass each: the CLI options'
help and defaults and the pipeline's ``export:`` keys are read from them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ..config import Config, check_int, check_settings, field_name, setting
from ..limits import MAX_BATCH, MAX_IMAGES, SEED_MAX
from ..errors import NascompressError, SettingError

FORMATS = ("onnx", "torch-export", "aoti")
# the int8 schemes of ``nascompress quantize`` (QuantizeConfig.scheme; the first is its default), declared
# once here for it and for ExportConfig.quantize, whose "int8" is that default scheme
SCHEMES = ("int8-static", "int8-dynamic")
QUANTIZE = ("none", "int8", *SCHEMES)
DTYPES = ("fp32", "fp16", "bf16")
# max |exported - PyTorch logits| allowed, relative to max(1, max |PyTorch logit|)
DEFAULT_TOLERANCE = {"fp32": 1e-4, "fp16": 1e-2, "bf16": 5e-2}


def parse_batch(v: str | int) -> str | int:
    """``dynamic`` or a positive batch size (the CLI gives text: ``"8"`` -> 8)."""
    if isinstance(v, str) and v.strip().isdigit():
        return int(v)
    return v


@dataclass(frozen=True)
class ExportConfig(Config):
    """How a model is exported and checked.

    Args:
        format: ``onnx`` (for ONNX Runtime, TensorRT, OpenVINO ...), ``torch-export`` (a
            ``torch.export`` program, ``.pt2``, loaded with ``torch.export.load``) or ``aoti`` (that
            program compiled ahead of time by AOTInductor for this machine's CPU: a ``.pt2`` package
            of native code, loaded with ``torch._inductor.aoti_load_package``; needs a C++ compiler).
        batch: ``dynamic`` (any batch size) or a fixed batch size.
        dtype: ``fp32``, ``fp16`` or ``bf16``: the weights' and the input's type.
        opset: ONNX opset (None: the exporter's default); the file must come out at this opset.
        tolerance: allowed max |exported - PyTorch logit| relative to max(1, max |PyTorch logit|)
            (None: 1e-4 in fp32, 1e-2 in fp16, 5e-2 in bf16).
        verify_batch: images in the fixed random batch the file is checked on (with ``batch: N``
            the check runs on N images).
        seed: seed of that batch.
        quantize: ``none``, or an int8 ONNX file instead of the fp32 one, made and checked on the
            validation split as ``nascompress quantize`` makes it (``int8``: its default scheme,
            ``int8-static``; or ``int8-dynamic``), with its default settings.
    """

    format: str = setting(
        "onnx",
        help=(
            "onnx (ONNX Runtime, TensorRT ...), torch-export (a torch.export program, .pt2) or aoti "
            "(that program compiled by AOTInductor for this CPU, .pt2; needs a C++ compiler)."
        ),
        choices=FORMATS,
    )
    batch: str | int = setting("dynamic", help="dynamic (any batch size) or a fixed batch size N.")
    dtype: str = setting("fp32", help="fp32, fp16 or bf16 (weights and input).", choices=DTYPES)
    opset: int | None = setting(None, help="ONNX opset (default: the exporter's; 17 to 23 load in ONNX Runtime).", lo=7)
    tolerance: float | None = setting(
        None,
        help="Allowed max |logit difference| / max(1, max |logit|) (default: 1e-4 fp32, 1e-2 fp16, 5e-2 bf16).",
        lo=0,
        lo_open=True,
    )
    verify_batch: int = setting(8, help="Images in the fixed random batch the file is checked on.", lo=1, hi=MAX_BATCH)
    seed: int = setting(0, lo=0, hi=SEED_MAX, help="Seed of the check's random batch.")
    quantize: str = setting(
        "none",
        choices=QUANTIZE,
        help=(
            "none, or int8 (int8-static / int8-dynamic): write the int8 ONNX file nascompress quantize writes "
            "(its default settings), checked on the validation split."
        ),
    )

    def __post_init__(self) -> None:
        check_settings(self)  # every setting() against its declaration; below: how they combine
        if self.quantize != "none" and (self.format != "onnx" or self.dtype != "fp32"):
            raise SettingError("{quantize} int8 starts from the fp32 ONNX file: use {format} onnx {dtype} fp32")
        if self.batch != "dynamic" and (
            isinstance(self.batch, bool) or not isinstance(self.batch, int) or not 1 <= self.batch <= MAX_BATCH
        ):
            raise NascompressError(f"batch must be 'dynamic' or an integer in [1, {MAX_BATCH}], got {self.batch!r}")
        if self.format == "onnx" and self.dtype == "bf16":
            raise SettingError(
                "bf16 ONNX files cannot be checked: ONNX Runtime's CPU provider has no bfloat16 "
                "kernels for Conv and MatMul; use {dtype} fp16, or {format} torch-export for bf16"
            )
        if self.opset is not None:
            if self.format != "onnx":
                raise SettingError("opset applies to {format} onnx only")

    @property
    def dynamic(self) -> bool:
        return self.batch == "dynamic"

    @property
    def tol(self) -> float:
        return self.tolerance if self.tolerance is not None else DEFAULT_TOLERANCE[self.dtype]


def build_config(settings: Mapping[str, Any]) -> ExportConfig:
    """The export settings of ``nascompress export``, of a pipeline's ``export`` section (its seed: the
    pipeline's) and of ``nc.export.onnx`` (the one place they are built): ``settings``: the values of
    :class:`ExportConfig`'s settings (None of them: its defaults); checked there."""
    return ExportConfig(**settings)


@dataclass(frozen=True)
class QuantizeConfig(Config):
    """How a model is quantized and checked.

    Args:
        scheme: ``int8-static`` (calibrated activation scales) or ``int8-dynamic`` (per-batch scales).
        calib_images: training images the static scheme calibrates on (class-stratified, ``seed``).
        max_drop: the largest allowed top-1 drop (points) of the int8 file against the fp32 file on
            the validation split.
        eval_images: validation images of the check (None: the run's whole validation split).
        fallback: on a failed check try milder levels (first/last blocks fp32, then dynamic).
        batch_size: images per batch of the calibration and the check.
        seed: seed of the calibration subset.
    """

    scheme: str = setting(
        SCHEMES[0],
        choices=SCHEMES,
        help=("int8-static (activation scales calibrated on training images) or int8-dynamic (scales per batch)."),
    )
    calib_images: int = setting(256, lo=1, hi=MAX_IMAGES, help="Training images the static scheme calibrates on.")
    max_drop: float = setting(
        1.0,
        lo=0,
        help=("Largest allowed top-1 drop (points) of the int8 file vs the fp32 file on the validation split."),
    )
    eval_images: int | None = setting(
        None,
        lo=1,
        hi=MAX_IMAGES,
        help=("Validation images of the accuracy check (default: the run's whole validation split)."),
    )
    fallback: bool = setting(
        True,
        flag="--no-fallback",
        help=(
            "Fail at once when the scheme is beyond --max-drop (default: try milder levels first: the first and last "
            "blocks in fp32, then int8-dynamic)."
        ),
    )
    batch_size: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        check_settings(self, name=field_name)  # every setting() against its declaration; below: the rest
        check_int("batch_size", self.batch_size, 1)
        check_int("seed", self.seed, 0)

    def attempts(self) -> list[tuple[str, int]]:
        """(scheme, level) in the order tried: level 0 keeps the default layers in fp32, level 1 also
        the first and last blocks."""
        order = [(self.scheme, 0)]
        if self.fallback:
            order.append((self.scheme, 1))
            if self.scheme == "int8-static":
                order += [("int8-dynamic", 0), ("int8-dynamic", 1)]
        return order


def config_for(quantize: str) -> QuantizeConfig:
    """The QuantizeConfig of an ExportConfig's ``quantize`` choice (``int8``: the default scheme)."""
    return QuantizeConfig() if quantize == "int8" else QuantizeConfig(scheme=quantize)


__all__ = [
    "ExportConfig",
    "build_config",
    "FORMATS",
    "DTYPES",
    "SCHEMES",
    "QUANTIZE",
    "DEFAULT_TOLERANCE",
    "parse_batch",
    "QuantizeConfig",
    "config_for",
]
