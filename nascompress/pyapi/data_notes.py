"""What becomes of a named built-in dataset's images on their way to the given model, said: a
one-line ``warnings.warn`` per conversion (:func:`warn_conversions`), never silent. The built-in
datasets are grey uint8 images of one size each (:data:`BUILTIN_SHAPES`); a model of another size
gets them resized, a 3-channel model gets the grey channel repeated (a 1-channel one would get
RGB averaged), as :func:`nascompress.data.preprocess` does. A caller's own Dataset is never
converted (its images must be the model's size and channels); its uint8 images are said by
:class:`nascompress.data.memory.CallerDataset`."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from ..data import DataConfig
from ..runs.io import load_arch

# (channels, height, width) of the built-in datasets' images, as nascompress.data.load_data reads them
BUILTIN_SHAPES = {"fashion-mnist": (1, 28, 28), "digits": (1, 8, 8), "lfw-faces": (1, 25, 25), "synthetic": (1, 16, 16)}


def conversions(dataset: str, model_input: dict[str, Any]) -> list[str]:
    """One line per conversion the images of the built-in ``dataset`` get to become the input
    ``model_input`` (an arch's ``input``: ``img_size``, ``in_chans``, ``interpolation``) describes;
    none for another dataset or images already as the model takes them."""
    shape = BUILTIN_SHAPES.get(dataset)
    if shape is None:
        return []
    (c, h, w), (mh, mw), mc = shape, tuple(model_input["img_size"]), int(model_input["in_chans"])
    lines = []
    if (h, w) != (mh, mw):
        how = model_input.get("interpolation", "bilinear")
        lines.append(f"{dataset}'s {h}x{w} px images are resized ({how}) to the model's {mh}x{mw}")
    if c != mc:
        done = f"repeated to the model's {mc} channels" if c == 1 else f"averaged to the model's {mc} channel"
        lines.append(f"{dataset}'s {c}-channel images are {done}")
    return lines


def warn_conversions(run: str | Path, data: DataConfig | None, *, what: str) -> None:
    """``warnings.warn`` each conversion (:func:`conversions`) the images of ``data`` get for the
    model of the run directory ``run``; ``what``: the API function, for the message."""
    if data is None:
        return
    for line in conversions(data.dataset, load_arch(run)["input"]):
        warnings.warn(f"{what}: {line}", stacklevel=4)  # the caller of the nc.* function (its python_api wrapper)


__all__ = ["BUILTIN_SHAPES", "conversions", "warn_conversions"]
