"""The limits that keep a hostile or mistaken input from exhausting the machine.

Each is a setting with a default chosen from what a real user needs, and a message that says
what was refused and how to raise the limit: ``NASCOMPRESS_<NAME>`` in the environment (e.g.
``NASCOMPRESS_MAX_MODEL_PARAMS=5000000000``) overrides a default for one command.

- ``max_model_params``: parameters of a model built from a file or from options, counted from its
  settings before anything is allocated. The largest timm ViTs nascompress handles (ViT-g/14,
  1.0 B; ViT-G/14, 1.8 B) fit; an ``arch.json`` with ``"depth": 1000000`` does not.
- ``max_model_depth``: blocks of such a model (ViTs stop at 48; each block is dozens of Python
  modules, so a million of them exhaust memory whatever their width).
- ``max_model_tokens``: tokens per image (patches plus prefix tokens): attention's memory grows with
  its square. 518 px DINOv2 at patch 14 has 1,370; 1024 px at patch 16 has 4,097.
- ``max_image_pixels``: pixels of one ImageFolder image (a 10000x10000 PNG is 100 M pixels and
  ~300 MB decoded before the resize): a 40-megapixel camera photo passes.
- ``max_trials``: complete trials a study may be asked for (a study of 100,000 zero-shot trials
  already runs for weeks).
- ``max_label_scan``: items of a caller's Dataset (the Python API) read one by one for their labels
  when it has no ``targets`` attribute: each read loads an image, so 10^6 tensor items take seconds
  and 10^8 would look like a hang (a ``targets`` attribute needs no pass at all).

Seeds are in [0, 2^32 - 1] (:data:`SEED_MAX`: numpy's range; the seeds derived from them, e.g. a
trial's, stay in 64 bits): the range of the ``seed`` setting itself, not a limit to raise.
- ``max_yaml_depth``: nesting of a pipeline or search-space file (they nest a few levels).
- ``max_yaml_values``: values (numbers, strings, lists, mappings) of such a file, counted by the C
  parser before the file is read (a shipped one holds under 200; a search space's 10,000 layer sets
  written out hold about 50,000): a list of 2,000,000 choices would take minutes to read.
- ``max_json_depth``: nesting of a JSON file nascompress reads (``arch.json``, ``config.json``,
  ``metrics.json``, ``log.jsonl``, a checkpoint's metadata, an export sidecar): the deepest it
  writes, a checkpoint's optimizer state, nests about 10 levels; 10^6 levels would exhaust the
  parser's stack.
- ``max_file_bytes``: size of such a JSON or YAML file (arch.json is a few KB; a log.jsonl of
  10,000 epochs about 5 MB).
- ``max_journal_record_bytes``: one record (line) of a journal study storage (``journal:PATH``): a
  trial's record is a few KB; a file that is no journal (one endless line) is refused after this
  many bytes instead of being read into memory whole.

An output's path is checked against its file system's limits before anything is written
(:func:`check_path_names`): a name longer than ``NAME_MAX`` bytes (255 on ext4, XFS, btrfs, APFS,
NTFS) or a path longer than ``PATH_MAX`` (4,096) cannot be created there; not a limit to raise.

The count, size and iteration options of the commands (epochs, batch sizes, timing iterations, ...)
have bounds too, :data:`OPTION_BOUNDS`: the largest value a real use needs, well above it; they
are ranges of the options (checked with them, in one line), not limits to raise.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import NascompressError, SettingError, literal

ENV_PREFIX = "NASCOMPRESS_"
SEED_MAX = 2**32 - 1

# The bounds of the count, size and iteration options (the ``hi`` of their settings): far above
# what a use needs, low enough that a typo (10^9, 1e12) is refused before anything is allocated
# or run instead of exhausting memory or running for years.
MAX_EPOCHS = 10_000  # epochs, fine-tune and DCS epochs, warm-up epochs (ImageNet recipes: 300 to 1,000)
MAX_BATCH = 65_536  # batch sizes: training, evaluation, export, its check, profiling
MAX_ITERS = 100_000  # timing repetitions (profile --iters, --latency-iters)
MAX_STEPS = 10_000_000  # optimisation steps (--calib-steps)
MAX_IMAGES = 1_000_000_000  # image counts (--train-images, --calib-images, --train-limit, ...)
MAX_WORKERS = 1_024  # processes (--workers, --num-workers)
MAX_LR = 10.0  # learning rates (--lr, --base-lr, --arch-lr): AdamW diverges long before
OPTION_BOUNDS = {
    "epochs": MAX_EPOCHS,
    "batch": MAX_BATCH,
    "iters": MAX_ITERS,
    "steps": MAX_STEPS,
    "images": MAX_IMAGES,
    "workers": MAX_WORKERS,
    "lr": MAX_LR,
}


def _limit(default: int, *, lo: int, help: str) -> Any:  # noqa: A002 (the settings' name for it)
    # the metadata of nascompress.config.setting (not imported: config reads these limits)
    return dataclasses.field(default=default, metadata={"help": help, "lo": lo})


@dataclass(frozen=True)
class Limits:
    """The limits (see the module docstring); :func:`limits` reads the environment's overrides."""

    max_model_params: int = _limit(2_000_000_000, lo=1, help="Parameters of a model built from a file or options.")
    max_model_depth: int = _limit(256, lo=1, help="Blocks of a model built from a file or options.")
    max_model_tokens: int = _limit(16_384, lo=1, help="Tokens per image of a model (patches + prefix tokens).")
    max_image_pixels: int = _limit(40_000_000, lo=1, help="Pixels of one ImageFolder image.")
    max_trials: int = _limit(100_000, lo=1, help="Complete trials a study may be asked for.")
    max_label_scan: int = _limit(1_000_000, lo=1, help="Items of a Dataset without targets read for their labels.")
    max_yaml_depth: int = _limit(50, lo=2, help="Nesting depth of a pipeline or search-space YAML file.")
    max_yaml_values: int = _limit(100_000, lo=1, help="Values of a pipeline or search-space YAML file.")
    max_json_depth: int = _limit(100, lo=2, help="Nesting depth of a JSON file nascompress reads.")
    max_file_bytes: int = _limit(64 * 2**20, lo=1, help="Size of a JSON or YAML file nascompress reads.")
    max_journal_record_bytes: int = _limit(64 * 2**20, lo=1, help="Size of one record (line) of a journal storage.")


DEFAULT = Limits()


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def limits() -> Limits:
    """The limits in force: the defaults, each overridden by ``NASCOMPRESS_<NAME>`` if set."""
    changes: dict[str, Any] = {}
    for f in dataclasses.fields(Limits):
        raw = os.environ.get(env_name(f.name))
        if raw is None or not raw.strip():
            continue
        try:
            v = int(raw.replace("_", "").strip())
        except ValueError:
            v = -1
        if v < f.metadata["lo"]:
            raise NascompressError(
                f"{env_name(f.name)}={raw!r} must be an integer >= {f.metadata['lo']} "
                f"(the default is {getattr(DEFAULT, f.name):,}); fix or unset it"
            )
        changes[f.name] = v
    return dataclasses.replace(DEFAULT, **changes) if changes else DEFAULT


def check_limited(name: str, v: Any, limit: str) -> Any:
    """``v`` (setting ``name``) must not exceed limit ``limit`` (a field of :class:`Limits`; the
    ``limit`` of :func:`nascompress.config.setting`); non-numbers are left to the type checks."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        check_limit(limit, v, name)
    return v


def check_limit(name: str, value: int, what: str, *, fix: str = "") -> None:
    """Refuse ``value`` above limit ``name`` in one line: what is too large, the limit, how to fix
    or raise it (``fix``: what the user should do instead, e.g. "check the file")."""
    limit = getattr(limits(), name)
    if value > limit:
        how = f"{fix}; " if fix else ""
        raise NascompressError(
            f"{what} is {value:,}, above the limit of {limit:,} ({name}); {how}if it is "
            f"intended, raise the limit with {env_name(name)}=N"
        )


NAME_MAX, PATH_MAX = 255, 4096  # bytes of a file name, of a path (where the file system does not say)


def _fs_limit(path: Path, name: str, default: int) -> int:
    """The file system's ``pathconf`` value ``name`` where ``path`` (its nearest existing folder) lies."""
    d = Path(os.path.abspath(path))
    while not os.path.isdir(d) and d != d.parent:  # (os.path's: False for a name too long to stat)
        d = d.parent
    try:
        return int(os.pathconf(d, name))
    except (OSError, ValueError, AttributeError):  # no pathconf (Windows), or the system gives none
        return default


def check_path_names(path: str | Path, *, field: str = "out", extra: int = 0) -> None:
    """Refuse, naming setting ``field``, an output ``path`` that its file system cannot hold: a name
    longer than its ``NAME_MAX`` bytes (``extra``: the bytes the last name gets beside it, e.g. a
    sidecar's ``.json`` and an atomic write's temp name) or a path longer than ``PATH_MAX``."""
    p = Path(path)
    parts = [q for q in p.parts if q not in ("/", ".", "..")]
    name_max = _fs_limit(p, "PC_NAME_MAX", NAME_MAX)
    for i, part in enumerate(parts):
        n, add = len(os.fsencode(part)), extra if i == len(parts) - 1 else 0
        if n + add > name_max:
            more = f" and the files written beside it add {add}" if add else ""
            fix = f" (a name of at most {name_max - add} bytes)" if add else ""
            raise SettingError(
                f"{{{field}}} has a name of {n:,} bytes ({literal(repr(part[:16]))}...){more}: longer than "
                f"the {name_max} bytes a file name may have; choose a shorter {{{field}}}{fix}"
            )
    total = len(os.fsencode(os.path.abspath(p))) + extra
    path_max = _fs_limit(p, "PC_PATH_MAX", PATH_MAX)
    if total >= path_max:
        raise SettingError(
            f"{{{field}}} is a path of {total:,} bytes, longer than the {path_max:,} this system allows; "
            f"choose a shorter {{{field}}}"
        )


__all__ = [
    "Limits",
    "NAME_MAX",
    "PATH_MAX",
    "check_path_names",
    "limits",
    "check_limit",
    "check_limited",
    "env_name",
    "SEED_MAX",
    "OPTION_BOUNDS",
    "MAX_BATCH",
    "MAX_EPOCHS",
    "MAX_IMAGES",
    "MAX_ITERS",
    "MAX_LR",
    "MAX_STEPS",
    "MAX_WORKERS",
]
