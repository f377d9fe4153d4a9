"""Creating a study or opening an existing one (:func:`open_study`): the objectives, the sampler and
the search space of a continued study must be the ones it was created with (:func:`check_space`
names where two spaces differ); a new study gets its metric names, its first trials and, last, its
record (what marks it initialized)."""

from __future__ import annotations

import time
from typing import Any, Mapping, Sequence

import optuna

from nascompress.errors import NascompressError, SettingError, literal

from .records import RECORD_KEY, StudyInfo, study_info
from .storage_url import StorageSpec
from .storage_open import open_storage
from .storage_open import creation_lock


def space_diff(a: Any, b: Any, path: str = "") -> list[str]:
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        out = []
        for k in list(a) + [k for k in b if k not in a]:
            if k not in a or k not in b:
                out.append(f"{path}.{k}".lstrip("."))
            else:
                out += space_diff(a[k], b[k], f"{path}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in space_diff(x, y, f"{path}[{i}]")]
    return [] if a == b else [path.lstrip(".") or "(whole space)"]


def check_space(study: optuna.Study, stored: StudyInfo, new: StudyInfo, where: str) -> None:
    old_hash, new_hash = stored.space_hash, new.space_hash
    if old_hash == new_hash:
        return
    old_space, new_space = stored.space or {}, new.space or {}
    diff = space_diff(
        {k: v for k, v in old_space.items() if k in ("methods",)},
        {k: v for k, v in new_space.items() if k in ("methods",)},
    )
    where_diff = f"; they differ in {', '.join(diff[:4])}" + (" ..." if len(diff) > 4 else "") if diff else ""
    raise NascompressError(
        f"study {study.study_name!r} in {where} was created with search space {old_space.get('name', '?')!r} "
        f"(hash {old_hash}) and this run uses {new_space.get('name', '?')!r} (hash {new_hash}){where_diff}. "
        "A study keeps one search space: use a new study name, or rerun with the original space"
    )


def _or_unknown(v: Any) -> Any:
    return "?" if v is None else v


def open_study(
    spec: StorageSpec,
    *,
    study_name: str,
    directions: Sequence[str],
    metric_names: Sequence[str],
    info: StudyInfo,
    enqueue: Sequence[Mapping[str, Any]],
) -> tuple[optuna.Study, bool]:
    """The study ``study_name`` in ``spec``, and whether this call created it: a new study gets its
    metric names, the ``enqueue`` configurations and, last, its record ``info``; an existing one is
    checked against ``info`` (its space, base model, sampler and scoring) and its objectives."""
    storage = open_storage(spec, create=True)
    with creation_lock(spec):  # a file storage: creation and initialization by one process at a time
        return _open_locked(
            spec,
            storage,
            study_name=study_name,
            directions=directions,
            metric_names=metric_names,
            info=info,
            enqueue=enqueue,
        )


def _open_locked(
    spec: StorageSpec,
    storage: Any,
    *,
    study_name: str,
    directions: Sequence[str],
    metric_names: Sequence[str],
    info: StudyInfo,
    enqueue: Sequence[Mapping[str, Any]],
) -> tuple[optuna.Study, bool]:
    placeholder = optuna.samplers.RandomSampler(seed=0)  # this Study object never samples
    try:
        study = optuna.create_study(
            study_name=study_name, storage=storage, directions=list(directions), sampler=placeholder
        )
        created = True
    except optuna.exceptions.DuplicatedStudyError:
        study = optuna.load_study(study_name=study_name, storage=storage, sampler=placeholder)
        created = False
    have = [d.name.lower() for d in study.directions]
    if have != list(directions):
        raise NascompressError(
            f"study {study_name!r} in {spec.display} optimizes {have}, not {list(directions)}: "
            "use a new study name for other objectives"
        )
    stored = study_info(study)
    if not created and not stored and not study.trials and spec.kind not in ("sqlite", "journal"):
        for _ in range(30):  # another process has just created it: let it finish initializing (a file
            # storage's creator holds creation_lock until it is initialized: nothing to wait for)
            time.sleep(0.5)
            stored = study_info(study)
            if stored:
                break
    if not stored:
        if study.metric_names is None or list(study.metric_names) != list(metric_names):
            study.set_metric_names(list(metric_names))
        for params in enqueue:
            study.enqueue_trial(dict(params), skip_if_exists=True)
        study.set_user_attr(RECORD_KEY, info.to_dict())  # last: marks the study initialized
        return study, True
    check_space(study, stored, info, spec.display)
    old, new = stored.base_fingerprint, info.base_fingerprint
    if old is not None and new is not None and old != new:
        was, given = _or_unknown(stored.base_run), _or_unknown(info.base_run)
        raise NascompressError(
            f"study {study_name!r} in {spec.display} was made on base model "
            f"{was} (sha256 {old[:12]}) and this run gives "
            f"{given} (sha256 {new[:12]}), another model; a study keeps its "
            f"base model: rerun with base {was} or use a new study name"
        )
    old, new = stored.sampler, info.sampler
    if old is not None and new is not None and old != new:
        raise SettingError(
            f"study {study_name!r} in {spec.display} was created with sampler {old!r} and this run "
            f"asks for {new!r}; a study keeps its sampler: rerun with {{sampler}} {old} or use a new "
            "study name"
        )
    if stored.scoring is not None and info.scoring is not None:  # the settings every trial is scored with
        old, new = stored.scoring.to_dict(), info.scoring.to_dict()  # (each as recorded: option -> value)
        diff = [
            f"{{{k}}} {literal(str(old[k]))} (this run: {literal(str(new[k]))})"
            for k in old
            if k in new and old[k] != new[k]
        ]
        if diff:
            raise SettingError(
                f"study {study_name!r} in {spec.display} scores every trial alike and this run "
                f"differs: {', '.join(diff)}; rerun with the study's settings or use a new "
                "study name"
            )
    names = study.metric_names
    if names is not None and list(names) != list(metric_names):
        raise NascompressError(
            f"study {study_name!r} in {spec.display} has objectives {list(names)}, not "
            f"{list(metric_names)}: use a new study name for other objectives"
        )
    return study, created
