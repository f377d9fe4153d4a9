"""ImageFolder datasets: class folders walked in torchvision's order without loops (links followed,
hidden folders left out), and every image checked once when a dataset is loaded
(:func:`scan_images`: decoded the way the loader will, JPEGs at a reduced size, in parallel threads;
an image above the pixel limit is refused from its header). An unreadable file is named and
refused, or with ``skip_bad_images`` (``--skip-bad-images``) left out and counted
(:func:`drop_bad_images`). Files whose extension is not an image's are not part of an ImageFolder
and are ignored.
"""

from __future__ import annotations

import copy
import os
import warnings
from functools import partial
from pathlib import Path
from typing import Any, Sequence
from concurrent.futures import ThreadPoolExecutor

from torch.utils.data import Dataset
from PIL import Image
from torchvision import datasets
from torchvision.datasets.folder import IMG_EXTENSIONS

from ..errors import NascompressError, SettingError, literal, words
from .. import _compat  # noqa: F401  (torchvision's CPU fix, before torchvision is used)
from ..limits import env_name, limits
from ..progress import console


def _walk_class(folder: str) -> list[str]:
    """The image files under class folder ``folder`` in torchvision's order (folders by path, files
    by name), symlinks followed, hidden files and folders (``.ipynb_checkpoints``) left out. A link
    back to a folder that contains it (a loop) or a second way into one folder is refused in one
    line, instead of walking forever."""
    top = os.path.realpath(folder)
    seen: dict[str, str] = {}
    found: list[tuple[str, list[str]]] = []
    stack = [folder]
    while stack:
        d = stack.pop()
        real = os.path.realpath(d)
        if d != folder and (top == real or top.startswith(real.rstrip(os.sep) + os.sep)):
            raise NascompressError(
                f"{d} is a symlink to {real}, a folder that contains it (a loop): remove the link from the dataset"
            )
        if real in seen:
            raise NascompressError(
                f"{d} leads to {real}, already read as {seen[real]} (two links to one folder, or a "
                "loop): remove one of them from the dataset"
            )
        seen[real] = d
        files, dirs = [], []
        try:
            entries = list(os.scandir(d))
        except OSError as e:
            raise NascompressError(f"cannot read dataset folder {d}: {e.strerror or e}") from None
        for e in entries:
            if e.name.startswith("."):
                continue
            try:
                is_dir = e.is_dir(follow_symlinks=True)
            except OSError:
                is_dir = False
            if is_dir:
                dirs.append(e.path)
            elif e.name.lower().endswith(IMG_EXTENSIONS):
                files.append(e.name)
        found.append((d, sorted(files)))
        stack.extend(dirs)
    return [os.path.join(d, f) for d, files in sorted(found) for f in files]


def folder_classes(directory: str | Path) -> list[str]:
    """The class folders of an ImageFolder split, sorted: its sub-folders (links followed) but the
    hidden ones (``.ipynb_checkpoints``); two that are one folder (a link to another class) are
    refused in one line."""
    try:
        entries = [e for e in os.scandir(directory) if not e.name.startswith(".") and e.is_dir()]
    except OSError as e:
        raise NascompressError(f"cannot read dataset folder {directory}: {e.strerror or e}") from None
    classes = sorted(e.name for e in entries)
    real: dict[str, str] = {}
    for c in classes:
        r = os.path.realpath(os.path.join(directory, c))
        if r in real:
            raise NascompressError(
                f"class folders {real[r]!r} and {c!r} of {directory} are the same folder ({r}; one "
                "is a link to the other): remove one, a class must be one folder"
            )
        real[r] = c
    return classes


_FOLDER_CLASS: list[type] = []


def _folder_class() -> type:
    """torchvision's ImageFolder with :func:`_walk_class` finding its classes and files (made on
    first use: torchvision is imported after :mod:`nascompress._compat`)."""
    if _FOLDER_CLASS:
        return _FOLDER_CLASS[0]

    class _Folder(datasets.ImageFolder):
        @staticmethod
        def find_classes(directory: Any) -> tuple[list[str], dict[str, int]]:
            classes = folder_classes(directory)
            if not classes:
                raise NascompressError(
                    f"{directory} is not an ImageFolder directory with one folder per class (it has no class folder)"
                )
            return classes, {c: i for i, c in enumerate(classes)}

        @staticmethod
        def make_dataset(
            directory: Any,
            class_to_idx: dict[str, int],
            extensions: Any = None,
            is_valid_file: Any = None,
            allow_empty: bool = False,
        ) -> list[tuple[str, int]]:
            return [
                (p, class_to_idx[c]) for c in sorted(class_to_idx) for p in _walk_class(os.path.join(str(directory), c))
            ]

    _Folder.__module__, _Folder.__qualname__ = __name__, "_Folder"  # picklable (DataLoader workers)
    _FOLDER_CLASS.append(_Folder)
    return _Folder


def __getattr__(name: str) -> Any:  # nascompress.data.folders._Folder, for pickle in a worker process
    if name == "_Folder":
        return _folder_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def image_folder(path: Path, transform: Any) -> Dataset:
    """An ImageFolder over ``path`` (:func:`_folder_class`): hidden folders are no class, a class
    folder that is a link to another one is refused, links are followed without loops."""
    # empty class folders are allowed here and refused by check_classes, naming the class
    return _folder_class()(str(path), transform=transform, allow_empty=True)


TOO_LARGE = "too large"


def _unreadable(path: str, max_pixels: int | None = None) -> str | None:
    """Why the image at ``path`` cannot be read as the loader reads it (None: it can); an image
    above ``max_pixels`` (default: the limit :mod:`nascompress.limits` sets) is refused from its
    header, before it is decoded."""
    max_pixels = max_pixels or limits().max_image_pixels
    big = (
        f"{TOO_LARGE}: {{}} pixels, above the limit of {max_pixels:,} (max_image_pixels); shrink it, or raise "
        f"the limit with {env_name('max_image_pixels')}=N"
    )
    try:
        with Image.open(path) as im:
            w, h = im.size
            if w * h > max_pixels:
                return big.format(f"{w}x{h} = {w * h:,}")
            if im.format == "JPEG":
                im.draft("RGB", (1, 1))  # decode at 1/8 scale: every byte is still read, 64x less work
            im.load()
        return None
    except Image.DecompressionBombError:  # above PIL's own limit: refused by Image.open from the header
        return big.format(f"more than {2 * (Image.MAX_IMAGE_PIXELS or 0):,}")
    except Exception as e:  # noqa: BLE001 (PIL raises OSError, SyntaxError, ValueError...)
        msg = str(e).split(" <", 1)[0] if "cannot identify image file" in str(e) else str(e)
        return msg or "it cannot be decoded"


_SCANNED: dict[
    tuple[str, int, int, int], str | None
] = {}  # (path, size, mtime, max pixels) -> reason: a file is decoded once per process
_REPORTED: set[str] = set()  # folders whose skipped images were reported (once per process)


def _stat_key(path: str, max_pixels: int) -> tuple[str, int, int, int]:
    try:
        st = os.stat(path)
        return path, st.st_size, st.st_mtime_ns, max_pixels
    except OSError:
        return path, -1, -1, max_pixels


def scan_images(paths: Sequence[str], *, workers: int | None = None) -> dict[str, str]:
    """The unreadable images among ``paths`` (path -> reason), each decoded once as the loader
    would (JPEGs at 1/8 scale), in ``workers`` threads (default ``min(8, cpu count)``). Results are
    kept for the process (keyed by path, size and modification time), so the stages of one
    pipeline scan a dataset once."""
    # the size check below replaces PIL's warning (a raw DecompressionBombWarning on the terminal)
    warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)
    max_pixels = limits().max_image_pixels
    keys = [_stat_key(p, max_pixels) for p in paths]
    todo = [k for k in keys if k not in _SCANNED]
    if todo:
        workers = workers or min(8, os.cpu_count() or 1)
        with ThreadPoolExecutor(max_workers=workers) as pool:
            for k, r in zip(
                todo, pool.map(partial(_unreadable, max_pixels=max_pixels), [k[0] for k in todo], chunksize=64)
            ):
                _SCANNED[k] = r
    return {k[0]: _SCANNED[k] for k in keys if _SCANNED[k] is not None}


def drop_bad_images(ds: Any, where: Path, *, skip: bool, skipped: dict[str, int]) -> None:
    """Scan an ImageFolder's files; refuse unreadable ones in one line, or (``skip``) leave them out."""
    bad = scan_images([p for p, _ in ds.samples])
    if not bad:
        return
    first, why = next(iter(bad.items()))
    if not skip:
        more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
        what = "image" if why.startswith(TOO_LARGE) else "unreadable image"
        raise SettingError(
            f"{what} {first} ({why}){more} in {where}: fix or remove it, or pass "
            "{skip_bad_images} to leave unreadable images out"
        )
    ds.samples = [s for s in ds.samples if s[0] not in bad]
    ds.imgs, ds.targets = ds.samples, [t for _, t in ds.samples]
    skipped[str(where)] = len(bad)
    if str(where) in _REPORTED:
        return
    _REPORTED.add(str(where))
    console.print(
        words(
            f"skipped {len(bad)} unreadable image(s) in {literal(str(where))} ({{skip_bad_images}}), e.g. "
            f"{literal(str(first))}: {literal(why)}"
        ),
        highlight=False,
        style="yellow",
    )


def with_transform(ds: Dataset, transform: Any) -> Dataset:
    """The same ImageFolder (same files, same order) read through another transform."""
    other = copy.copy(ds)
    other.transform = transform
    return other
