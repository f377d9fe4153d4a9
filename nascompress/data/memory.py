"""A caller's own data in memory (the Python API, :mod:`nascompress.pyapi`): any map-style
``torch.utils.data.Dataset`` of ``(image tensor, label)`` pairs, or a ``DataLoader`` over one,
registered under a name (``python:<fingerprint>``) that :class:`~nascompress.data.DataConfig` and
:func:`~nascompress.data.load_data` read like a built-in dataset's, so every stage (the same
functions the commands run) loads it as it loads Fashion-MNIST.

The images are the caller's: already decoded, resized and normalised as their model expects
(float ``(C, H, W)`` tensors; uint8 ones are scaled to [0, 1]). The models made from such data
record an identity normalisation (mean 0, std 1: :func:`caller_input`), and the run's data section
names the registered dataset, so that a reader knows the preprocessing was the caller's. A name
lives in the process that registered it; the same data registered again (e.g. to continue a run
with ``out=``) gets the same name: the fingerprint is the splits' lengths, types and a few items.
"""

from __future__ import annotations

import hashlib
import math
import numbers
import random
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from .sources import MEMORY_DATASETS, MEMORY_PREFIX
from ..errors import NascompressError
from ..limits import check_limit

if TYPE_CHECKING:
    from .input import InputSpec

LABELS_ARE = (
    "labels must be integer class indices (0, 1, ...) or one-hot / probability vectors, one per image: "
    "map class names to indices (and give the names with classes=)"
)


def _shown(v: Any) -> str:
    """A label as a message shows it: a tensor's type and shape, else a short repr and its type."""
    if isinstance(v, (torch.Tensor, np.ndarray)) and v.ndim:
        return f"a {type(v).__name__} of shape {tuple(v.shape)}"
    if isinstance(v, (torch.Tensor, np.ndarray)):
        v = v.item()
    text = repr(v)
    return f"{text if len(text) <= 40 else text[:40] + '...'} ({type(v).__name__})"


def _index(v: Any) -> int | None:
    """``v`` as a class index (an integer, an integral finite float, or a one-value tensor of one),
    else None."""
    if isinstance(v, (torch.Tensor, np.ndarray)):
        if v.ndim and math.prod(v.shape) != 1:
            return None
        v = v.item()
    if isinstance(v, numbers.Integral):
        return int(v)
    if isinstance(v, numbers.Real) and math.isfinite(v) and float(v).is_integer():
        return int(v)
    return None


def _vector_index(v: Any) -> int | None:
    """A one-hot or probability-vector label (one value per class, none negative, summing to 1) as
    its class index (the argmax), else None."""
    if not isinstance(v, (torch.Tensor, np.ndarray)) or v.ndim != 1 or len(v) < 2:
        return None
    if isinstance(v, np.ndarray) and v.dtype.kind not in "biuf":
        return None
    t = torch.as_tensor(v).double()
    if not bool(torch.isfinite(t).all()) or bool((t < 0).any()) or abs(float(t.sum()) - 1.0) > 1e-3:
        return None
    return int(t.argmax())


class CallerDataset(Dataset):
    """A caller's map-style dataset seen as nascompress's splits are: ``labels`` (read once and
    checked: integer class indices; one-hot or probability-vector labels become their argmax, said
    once in a warning), ``classes``, and items ``(float or uint8 image tensor (C, H, W),
    int label)``. ``what``: the Python argument it came as (``data``, ``val`` ...), and ``named``:
    where ``classes`` came from (default ``classes=``, or the dataset's ``classes``), for messages."""

    def __init__(
        self, base: Dataset, *, classes: Sequence[str] | None = None, what: str = "data", named: str | None = None
    ):
        if isinstance(base, IterableDataset) or not hasattr(base, "__getitem__") or not hasattr(base, "__len__"):
            raise NascompressError(
                f"{what} must be a map-style torch Dataset (with __len__ and __getitem__) of "
                f"(image tensor, label) pairs, got {type(base).__name__}"
            )
        if len(base) == 0:
            raise NascompressError(f"{what} holds no images")
        self.base, self.what, self.vectors = base, what, 0  # vectors: one-hot / soft labels taken as their argmax
        targets = getattr(base, "targets", None)
        if targets is None:
            check_limit(
                "max_label_scan",
                len(base),
                f"{what}'s length (its items are read one by one for their labels: it has no targets attribute)",
                fix=f"give {what} a targets attribute (its labels, one per item) or fewer items",
            )
            self.labels = torch.tensor([self._label(self._item(i)[1], i) for i in range(len(base))], dtype=torch.long)
        else:
            self.labels = self._targets(targets)
        self.classes = list(classes) if classes is not None else list(getattr(base, "classes", None) or [])
        top = int(self.labels.max())
        if not self.classes:
            self.classes = [str(i) for i in range(top + 1)]
        elif top >= len(self.classes):
            named = named or ("classes=" if classes is not None else f"{what}.classes")
            raise NascompressError(
                f"{what} has label {top} but {named} names {len(self.classes)} classes; {LABELS_ARE}"
            )
        first = self._item(0)[0]
        self.shape = tuple(first.shape)
        if self.vectors:
            warnings.warn(
                f"{what} gives one-hot or probability-vector labels ({self.vectors:,} of {len(base):,}); nascompress "
                "trains on class indices, so each is taken as its argmax (soft labels lose their weights)",
                stacklevel=2,
            )
        if first.dtype == torch.uint8:
            warnings.warn(
                f"{what} gives uint8 images: they are divided by 255 (to [0, 1]) and not normalised further "
                "(the model records mean 0, std 1); give float tensors to choose the scaling",
                stacklevel=2,
            )

    def _targets(self, targets: Any) -> torch.Tensor:
        """The labels of a ``targets`` attribute, checked: one class index per item."""
        numeric = isinstance(targets, torch.Tensor) or isinstance(targets, np.ndarray) and targets.dtype.kind in "biuf"
        if numeric and targets.ndim == 2 and len(targets) == len(self.base):  # one-hot / probability rows
            labels = torch.tensor([self._label(y, i, "targets") for i, y in enumerate(targets)], dtype=torch.long)
        elif numeric and targets.ndim == 1:
            t = torch.as_tensor(targets)
            bad = None
            if t.is_complex():
                bad = 0
            elif t.is_floating_point():
                wrong = ~(torch.isfinite(t) & (t == t.round()))
                bad = int(wrong.nonzero()[0, 0]) if bool(wrong.any()) else None
            if bad is not None:
                raise NascompressError(f"{self.what}.targets[{bad}] is {_shown(t[bad])}; {LABELS_ARE}")
            labels = t.long()
        else:
            try:
                targets = list(targets)
            except TypeError:
                raise NascompressError(
                    f"{self.what}.targets is a {type(targets).__name__}, not a sequence of labels; {LABELS_ARE}"
                ) from None
            labels = torch.tensor([self._label(y, i, "targets") for i, y in enumerate(targets)], dtype=torch.long)
        if len(labels) != len(self.base):
            raise NascompressError(
                f"{self.what}.targets has {len(labels):,} labels but {self.what} has {len(self.base):,} items; "
                "give one label per item"
            )
        if len(labels) and int(labels.min()) < 0:
            i = int((labels < 0).nonzero()[0, 0])
            raise NascompressError(f"{self.what}.targets[{i}] is {int(labels[i])}; {LABELS_ARE}")
        return labels

    def _label(self, y: Any, i: int, source: str = "") -> int:
        """Item ``i``'s label ``y`` as a class index; anything else is refused in one line."""
        v = _index(y)
        if v is None:
            v = _vector_index(y)
            self.vectors += v is not None
        if v is None or v < 0:
            where = f"{self.what}.{source}[{i}] is" if source else f"{self.what}[{i}] has label"
            raise NascompressError(f"{where} {_shown(y)}; {LABELS_ARE}")
        return v

    def _item(self, i: int) -> tuple[torch.Tensor, Any]:
        try:
            item = self.base[i]
        except NascompressError:
            raise
        except Exception as e:  # the caller's __getitem__: any error of theirs, in one line
            why = (str(e).strip().splitlines() or [""])[0][:200]
            raise NascompressError(
                f"{self.what}[{i}] raised {type(e).__name__}{': ' + why if why else ''}; fix the "
                f"dataset's __getitem__ (or leave that item out of {self.what})"
            ) from e
        if not isinstance(item, (tuple, list)) or len(item) < 2:
            raise NascompressError(
                f"{self.what} must give (image tensor, label) pairs; item {i} is a {type(item).__name__}"
            )
        x = item[0]
        if not isinstance(x, torch.Tensor) or x.ndim != 3:
            raise NascompressError(
                f"{self.what} gives {type(x).__name__} images; give (C, H, W) tensors (the "
                "preprocessing is the caller's: e.g. a torchvision transform ending in ToTensor "
                "and Normalize)"
            )
        if not (x.is_floating_point() or x.dtype == torch.uint8):
            raise NascompressError(
                f"{self.what} gives {x.dtype} images (item {i}); give float tensors (or uint8 ones, "
                "0 to 255): the preprocessing is the caller's"
            )
        return x, item[1]

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        i = int(i)
        return self._item(i)[0], int(self.labels[i])

    def __getitems__(self, idx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """A whole batch at once, as the built-in datasets give it: (images (B, C, H, W), labels (B,))."""
        idx = [int(i) for i in idx]
        items = [self._item(i)[0] for i in idx]
        try:
            images = torch.stack(items)
        except RuntimeError:
            raise NascompressError(
                f"{self.what} gives images of different shapes; give them at one size "
                "(the preprocessing is the caller's)"
            ) from None
        return images, self.labels[idx]


@dataclass(frozen=True)
class MemorySplits:
    """A registered dataset: train, and val / test where the caller gave them (None: carved from
    train; a test split from the validation images, :mod:`~nascompress.data.carve`)."""

    train: CallerDataset
    val: CallerDataset | None
    test: CallerDataset | None
    in_chans: int
    size: tuple[int, int]

    @property
    def classes(self) -> list[str]:
        return self.train.classes


def as_dataset(data: Any, what: str) -> Dataset:
    """The map-style dataset of ``data`` (a Dataset, or a DataLoader over one: nascompress draws its
    own batches at the loader's batch size, so a loader without one is refused)."""
    if not isinstance(data, DataLoader):
        return data
    if data.batch_size is None:
        raise NascompressError(
            f"{what} is a DataLoader without a batch size (batch_size=None or a batch_sampler); "
            "nascompress draws its own batches from the loader's dataset at the loader's batch "
            f"size: give the DataLoader a batch_size, or give its Dataset as {what}"
        )
    return data.dataset


def _fingerprint(ds: CallerDataset) -> str:
    h = hashlib.sha256(f"{type(ds.base).__qualname__}:{len(ds)}:{ds.classes}".encode())
    h.update(ds.labels.numpy().tobytes())
    state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):  # a random transform (augmentation) draws the same each time
        torch.manual_seed(0)
        random.seed(0)
        np.random.seed(0)
        for i in sorted({0, len(ds) // 2, len(ds) - 1}):
            h.update(ds[i][0].detach().cpu().contiguous().float().numpy().tobytes())
    random.setstate(state[0])
    np.random.set_state(state[1])
    return h.hexdigest()[:16]


def register_dataset(
    train: Any, val: Any = None, test: Any = None, *, classes: Sequence[str] | None = None, what: str = "data"
) -> str:
    """Register the caller's splits; returns the dataset name a DataConfig takes (``python:...``).
    ``val`` None: a validation split is carved from ``train`` (``DataConfig.val_fraction``);
    ``test`` None: a test split is carved, never the validation images (:mod:`~nascompress.data.carve`).
    ``what``: the Python argument ``train`` came as (``data``, or ``train`` for
    :func:`nascompress.compress`), for messages."""
    tr = CallerDataset(as_dataset(train, what), classes=classes, what=what)
    splits = [tr]
    for name, d in (("val", val), ("test", test)):
        splits.append(
            None
            if d is None
            else CallerDataset(as_dataset(d, name), classes=tr.classes, what=name, named=f"{what}'s classes")
        )
    va, te = splits[1], splits[2]
    for name, d in (("val", va), ("test", te)):
        if d is not None and d.shape != tr.shape:
            raise NascompressError(f"{name} images have shape {d.shape} but {what}'s have {tr.shape}")
    key = hashlib.sha256("/".join(_fingerprint(d) if d is not None else "-" for d in splits).encode()).hexdigest()[:16]
    name = f"{MEMORY_PREFIX}{key}"
    if name not in MEMORY_DATASETS:
        MEMORY_DATASETS[name] = MemorySplits(tr, va, te, in_chans=tr.shape[0], size=(tr.shape[1], tr.shape[2]))
    return name


def memory_splits(name: str, spec: InputSpec | None = None) -> MemorySplits:
    """The splits registered as ``name``; a name of another process is refused in one line. With
    ``spec`` (the model's input), images of other channels or another size are refused: the
    caller's preprocessing made them, so nascompress does not convert them behind it."""
    if name not in MEMORY_DATASETS:
        raise NascompressError(
            f"dataset {name} was held in memory by the Python API in another process; pass the "
            "same Dataset again (nascompress.compress(..., train=...)) to use it"
        )
    mem = MEMORY_DATASETS[name]
    if spec is not None:
        given, takes = (mem.in_chans, *mem.size), (spec.in_chans, *spec.img_size)
        if given != takes:
            raise NascompressError(
                f"the images of {mem.train.what} are {given} (C, H, W) but the model takes {takes}; "
                "give images as the model takes them (the preprocessing is the caller's: resize "
                "them and convert their channels, e.g. in the Dataset's transform)"
            )
    return mem


def is_memory(name: str) -> bool:
    """A name the Python API gives an in-memory dataset (registered in this process or not)."""
    return isinstance(name, str) and name.startswith(MEMORY_PREFIX)


def caller_input(in_chans: int) -> dict[str, Any]:
    """The preprocessing recorded for a model trained on the caller's tensors: none (mean 0,
    std 1, the whole image). Its own images are at the model's size; an image of another size given
    to the saved model (an export's sidecar) is resized bilinearly."""
    return {
        "mean": (0.0,) * in_chans,
        "std": (1.0,) * in_chans,
        "interpolation": "bilinear",
        "crop_pct": 1.0,
        "crop_mode": "center",
    }


__all__ = ["CallerDataset", "MemorySplits", "register_dataset", "memory_splits", "is_memory", "caller_input"]
