"""The folder :func:`nascompress.pyapi.hf.to_transformers` writes: which ``directory`` it may write
(:func:`check_directory`: never a file, a link or a nascompress output, and a non-empty folder only
with ``force`` and only when it is a Hugging Face folder to_transformers wrote, holding nothing
else), and the writing itself (:func:`save_folder`: ``save_pretrained``'s files and the
preprocessing, written into a temporary folder beside ``directory`` and moved there complete, so a
failure leaves none half-written and ``force`` never deletes a file to_transformers did not write).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Any

from ..errors import SettingError, writing
from ..runs.files import Arch
from ..runs.owner import is_output
from ..runs.json_io import write_json

# what to_transformers writes: a folder holding these (the first two always) and nothing else
HF_FILES = ("config.json", "model.safetensors", "preprocessor_config.json")


def _hf_folder(d: Path) -> bool:
    """Whether ``d`` is a folder to_transformers wrote: config.json (with a ``model_type``)
    and model.safetensors, at most a preprocessor_config.json besides, all plain files."""
    try:
        entries = list(os.scandir(d))
        if any(e.name not in HF_FILES or not e.is_file(follow_symlinks=False) for e in entries):
            return False
        if not {"config.json", "model.safetensors"} <= {e.name for e in entries}:
            return False
        cfg = d / "config.json"
        if cfg.stat().st_size > 1 << 20:
            return False
        return isinstance(json.loads(cfg.read_text()).get("model_type"), str)
    except (OSError, ValueError, AttributeError, UnicodeDecodeError):
        return False


def check_directory(d: Path, force: bool) -> None:
    """Refuse in one line a ``directory`` to_transformers must not write: a file, a link, a
    nascompress output (whatever ``force`` says), or a non-empty folder unless ``force`` and it is
    a Hugging Face folder to_transformers wrote (:func:`_hf_folder`)."""
    if d.is_symlink():
        raise SettingError(
            f"{{directory}} {d} is a symbolic link; to_transformers writes only a real folder: give "
            "the folder itself or choose another {directory}"
        )
    if d.exists() and not d.is_dir():
        raise SettingError(
            f"{{directory}} {d} is a file, not a folder; choose another {{directory}} (a new or empty folder)"
        )
    if not d.is_dir():
        inside = next((p for p in d.parents if p.exists() and not p.is_dir()), None)
        if inside is not None:
            raise SettingError(f"{{directory}} {d} is inside {inside}, a file; choose another {{directory}}")
        return
    if is_output(d):
        raise SettingError(
            f"{{directory}} {d} is a nascompress run or output; to_transformers never writes into one "
            "(even with {force}): choose another {directory} (a new or empty folder)"
        )
    entries = sorted(p.name for p in d.iterdir())
    if not entries:
        return
    if not force:
        raise SettingError(
            f"{{directory}} {d} already exists and is not empty; pass {{force}}=True to replace a "
            "folder to_transformers wrote, or choose another {directory}"
        )
    if not _hf_folder(d):
        shown = ", ".join(entries[:3]) + (f" and {len(entries) - 3} more" if len(entries) > 3 else "")
        raise SettingError(
            f"{{directory}} {d} is not a folder to_transformers wrote (it holds {shown}); {{force}} "
            f"replaces only such a folder ({', '.join(HF_FILES)}) and never deletes other files: "
            "choose another {directory}"
        )


def _publish(tmp: Path, d: Path) -> None:
    """Move the complete folder ``tmp`` to ``d``: renamed when ``d`` does not exist, else (``d`` is
    empty, or a folder to_transformers wrote) file by file, then ``d``'s files ``tmp`` lacks removed."""
    if not d.exists():
        os.rename(tmp, d)
        return
    names = {f.name for f in tmp.iterdir()}
    for name in names:
        os.replace(tmp / name, d / name)
    for old in d.iterdir():
        if old.name not in names:
            old.unlink()
    tmp.rmdir()


def save_folder(hf: Any, directory: Path, typed: Arch | None) -> None:
    """Write ``hf`` (and the preprocessing of ``typed``, when given) as the folder ``directory``
    (:func:`check_directory` passed it): into a temporary folder beside it, then moved there."""
    with writing(directory, then="then call to_transformers again"):
        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp = directory.parent / f".{directory.name}.{secrets.token_hex(4)}.tmp"
        tmp.mkdir()  # (the umask's mode, as save_pretrained's own folder)
        try:
            _write_hf(hf, tmp, typed)
            _publish(tmp, directory)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)


def _write_hf(hf: Any, folder: Path, typed: Arch | None) -> None:
    """``hf``'s files (save_pretrained's) into ``folder``, and its preprocessing from ``typed``."""
    hf.save_pretrained(str(folder))
    if typed is not None:
        inp = dict(typed.input)
        write_json(
            folder / "preprocessor_config.json",
            {
                "image_processor_type": "ViTImageProcessor",
                "do_resize": True,
                "size": {"height": inp["img_size"][0], "width": inp["img_size"][1]},
                "do_rescale": True,
                "rescale_factor": 1 / 255,
                "do_normalize": True,
                "image_mean": list(inp["mean"]),
                "image_std": list(inp["std"]),
            },
        )


__all__ = ["check_directory", "save_folder"]
