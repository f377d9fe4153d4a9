"""Running a planned pipeline: the output directory (checks, lock, claim), the per-step done
markers, and :func:`run_pipeline`, which skips complete steps and resumes the rest."""

from __future__ import annotations

import copy
import datetime as _dt
import os
import time
from pathlib import Path
from typing import Any, Callable

import yaml

from ..errors import NascompressError, SettingError, WriteError, writing
from ..limits import check_path_names
from ..data import dataset_paths
from .files import DONE_DIR as STEP_DONE_DIR
from .files import StepMarker, find_step_marker, read_summary, write_step_marker
from .summary import Summary, ThisRun
from ..runs.files import Record, has_metrics
from ..runs.owner import MARK_FILE, check_replaceable, clear_own, write_mark
from ..train.run import RUNTIME_SETTINGS
from ..progress import pipeline_eta
from ..runs.json_io import atomic_path
from ..runs.out_dir import refuse_overwriting_inputs
from ..yaml_io import StrictYamlLoader as _Loader
from .config_io import PipelineSource, config_diff, dump_config, given_as_data, load_config, read_yaml
from .eta import PipelineEta, step_estimates
from .fallback import DcsOutcome
from .plan import plan
from .steps import Pipeline, Step
from .schema import Section
from .stage import registered_stages

CONFIG_FILE = "config.yaml"
DONE_DIR = STEP_DONE_DIR
LOCK_FILE = ".pipeline.lock"
_CONTINUE = "then rerun the same command to continue the pipeline there"


def _stray(p: Path) -> bool:
    """Files that do not make OUT a used directory: a temp file of a write killed mid-way, the lock,
    the output marker."""
    return p.name in (LOCK_FILE, MARK_FILE) or (p.name.startswith(".") and p.name.endswith(".tmp"))


def check_out(out: Path, *, force: bool) -> None:
    """Refuse an OUT that is a file, or a used directory that holds no pipeline run (without force);
    with force, one that is not a nascompress output holding only its own files (nothing of the
    user's is ever removed)."""
    check_path_names(out)  # a name its file system cannot hold: one line, not OSError
    if out.exists() and not out.is_dir():
        raise SettingError(f"output path {out} exists and is not a directory; choose another {{out}}")
    used = out.is_dir() and any(not _stray(p) for p in out.iterdir())
    if used and not force and not (out / CONFIG_FILE).is_file():
        raise SettingError(
            f"output directory {out} already exists and holds no pipeline run ({CONFIG_FILE}); "
            "choose another {out} or pass {force} to replace it"
        )
    if used and force:
        check_replaceable(out)


def _lock(out: Path) -> int:
    """Hold an exclusive lock on OUT for this process (released by the OS when it exits, even on
    kill -9), so two runs never write into one pipeline directory at once."""
    import fcntl  # POSIX only: the run lock

    try:
        with writing(out, what=f"pipeline directory {out}", then=_CONTINUE):
            out.mkdir(parents=True, exist_ok=True)
            fd = os.open(out / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:  # not a disk or permission problem (those are one line already)
        raise NascompressError(f"cannot create output directory {out}: {e.strerror}") from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise NascompressError(
            f"another 'nascompress pipeline' is running in {out}; wait for it to finish or stop it first"
        ) from None
    return fd


def _plain(cfg: Any) -> Any:
    """A config as the plain data its ``config.yaml`` holds."""
    return yaml.load(yaml.safe_dump(cfg.to_dict(), sort_keys=False), Loader=_Loader)  # noqa: S506


def _as_this_version(stored: Path, old: Any) -> Any:
    """The stored config of a run as this version reads it: a key added since that run was written
    takes its default (the behaviour the run had), a renamed key its new name, so upgrading
    nascompress does not refuse to continue a run. The stored data as it is when this version cannot
    read it."""
    try:
        return _plain(load_config(stored, upgrade=True))
    except NascompressError:
        return old


def _claim_out(pipe: Pipeline, *, force: bool) -> bool:
    """Make the (locked) OUT ready: new, resumed (same config) or started over (``force``); write
    config.yaml. Returns True when an earlier run is continued."""
    out, stored = pipe.out, pipe.out / CONFIG_FILE
    used = any(not _stray(p) for p in out.iterdir())
    if used and not force:
        old = read_yaml(stored)
        new = _plain(pipe.cfg)
        if old != new:
            old = _as_this_version(stored, old)
        if old != new:
            diff = config_diff(new, old if isinstance(old, dict) else {})
            more = f" (and {len(diff) - 3} more)" if len(diff) > 3 else ""
            keys = {f"key_{i}": path for i, (path, _, _) in enumerate(diff[:3]) if path}  # the keys: data
            shown = [
                f"{'{key_%d}' % i if path else '(whole file)'} is {a!r} here but {b!r} there"
                for i, (path, a, b) in enumerate(diff[:3])
            ]
            keep = ""
            if pipe.cfg.base.run is None and has_metrics(out / "base"):  # a finished base of its own
                keep = f" (to keep its finished base, give the new config base: {{run: {out / 'base'}}})"
            raise SettingError(
                f"{out} holds a pipeline run of another config ({'; '.join(shown)}{more}); "
                f"rerun it with the same config ({stored}) to continue it, use another {{out}}"
                f"{keep}, or pass {{force}} to start over",
                keys=keys,
            )
        return True
    if used:  # start over (force): only nascompress's own files (checked again under the lock)
        check_replaceable(out)
    clear_own(out, keep=(LOCK_FILE,))  # and what a killed first run left (its temp files)
    write_mark(out, "pipeline")

    with atomic_path(stored) as tmp:
        tmp.write_text(dump_config(pipe.cfg))
    return False


# the run's own settings: the pipeline command's options (its front end words them), not a section's keys
_RUN_LEVEL = ("force", "resume", "out", "debug")


def step_error(pipe: Pipeline, step: str, e: SettingError) -> SettingError:
    """Error ``e`` of the library that runs ``step``, as the pipeline file words it: each field named
    as its key path (``stages.dcs.max_val_drop``: the step's section, else ``data``), the field's key
    path kept as data (:attr:`~nascompress.errors.SettingError.keys`: ``nc.compress`` words it as
    its argument); the run's own
    settings (``force``, ``out``) left to the pipeline command's front end; the runtime's (``seed``)
    are the file's top-level keys. The same exception type."""
    cfg = pipe.cfg
    head = step.split("_")[0]
    if head == "base":
        sections = [(f"base.{k}", getattr(cfg.base, n)) for k, n in type(cfg.base).keys().items()]
    else:  # the section of the stage of that name (tokens_search_dense: the tokens stage's)
        stage = next((s for s in registered_stages() if s.name == head and s.path is not None), None)
        sections = [] if stage is None else [(stage.path, stage.section_of(cfg))]
    keys = {n: n for n in RUNTIME_SETTINGS.names}  # seed, device, ...: the file's top-level keys
    for path, section in [*sections, ("data", cfg.data)]:
        if isinstance(section, Section):
            keys = {**{n: f"{path}.{k}" for k, n in type(section).keys().items()}, **keys}

    worded = copy.copy(e)  # its fields that are keys of the file: named by their key path (data: e.keys)
    worded.keys = {**e.keys, **{f: keys[f] for f in e.fields if f in keys and f not in _RUN_LEVEL}}
    worded.args = (worded.worded(),)
    return worded


def step_done(out: Path, step: Step) -> bool:
    """A step is complete when its marker and every output exist (or its marker says it was
    skipped: a DCS stage that collapsed twice, and the steps that then had nothing to do)."""
    marker = find_step_marker(out, step.name)
    if marker is None:
        return False
    return all((out / p).exists() for p in step.outputs) or marker.skipped


def _compact(res: Any) -> Any:
    """A step's result as kept in its marker (scalars only; the stage's own files hold the rest)."""
    if isinstance(res, Record):  # a typed result (the report's Summary): its JSON object
        res = res.to_dict()
    if not isinstance(res, dict):
        return {}
    return {k: v for k, v in res.items() if isinstance(v, (int, float, str, bool)) or v is None}


def run_pipeline(
    config: PipelineSource,
    *,
    out: str | Path,
    force: bool = False,
    seed: int | None = None,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
    source: str = "the pipeline config",
) -> Summary:
    """Validate ``config``, then run (or continue) the pipeline in ``out``; return its summary
    (``summary.json``'s :class:`~nascompress.pipeline.summary.Summary`, with ``this_run``: what this
    call ran, what it found done).

    Args:
        config: the pipeline YAML file, its sections as data, or the typed config
            (:func:`~nascompress.pipeline.config_io.load_config`'s: what ``nc.compress`` builds).
        out: the pipeline's directory (created; an earlier run of the same config is continued).
        force: start over in ``out``, even with another config (only a pipeline folder nascompress
            wrote holding nothing else: its files are replaced; any other folder is refused).
        seed: override the file's seed.
        progress: live progress of the study (stderr).
        log: called with one line per step (skipped, running, done); default: silent.
        source: how errors name a config given as data (``nc.compress``).
    """
    log = log or (lambda msg: None)
    pipe = plan(config, out=out, seed=seed, source=source)  # everything is checked before anything is written
    check_out(pipe.out, force=force)
    own = (pipe.out / "base",)  # the base run the pipeline trains itself
    refuse_overwriting_inputs(
        pipe.out,
        [
            *(() if given_as_data(config) else (Path(pipe.source),)),  # (the file plan() found)
            *(() if pipe.base_dir in own else (pipe.base_dir,)),
            *dataset_paths(pipe.data),
        ],
    )
    lock = _lock(pipe.out)
    try:
        with writing(pipe.out, what=f"pipeline directory {pipe.out}", then=_CONTINUE):
            return _run(pipe, force=force, progress=progress, log=log)
    finally:
        os.close(lock)


def _run(pipe: Pipeline, *, force: bool, progress: bool, log: Callable[[str], None]) -> Summary:
    resumed = _claim_out(pipe, force=force)
    if resumed:
        log(f"continuing the pipeline in {pipe.out}")
    ran: dict[str, bool] = {}
    todo = [s.name for s in pipe.steps if not step_done(pipe.out, s)]  # (the ETA: complete steps not counted)
    eta = PipelineEta(step_estimates(pipe.cfg, todo))
    for step in pipe.steps:
        if step_done(pipe.out, step):
            log(f"{step.name}: complete, skipped")
            ran[step.name] = False
            eta.skip(step.name)
            continue
        d = step.dir
        resume = step.mode == "train" and d is not None and (d / "config.json").is_file()
        force_step = d is not None and d.exists() and not resume and step.mode != "study"
        how = ""
        if resume and (d / "checkpoint.safetensors").is_file():
            how = " (continuing from its last checkpoint)"
        elif step.mode == "study" and d is not None and d.exists():
            how = " (continuing the study)"
        log(f"{step.name}: {step.describe}{how}")
        t0 = time.perf_counter()
        eta.start(step.name)
        try:
            with pipeline_eta(eta.text):  # the epochs lines of a training step say the pipeline's time left
                if step.mode == "study":
                    res = step.run(force=False, resume=False, progress=progress)
                else:
                    res = step.run(force=force_step, resume=resume)
        except SettingError as e:
            raise step_error(pipe, step.name, e) from e
        except WriteError as e:  # a full disk: the step's own advice (train --resume ...) is not how a pipeline goes on
            raise e.instead(_CONTINUE) from e
        marker = StepMarker.new(
            step.name,
            seconds=round(time.perf_counter() - t0, 3),
            finished=_dt.datetime.now().astimezone().isoformat(timespec="seconds"),
            dir=None if d is None else str(d),
            result=_compact(res),
        )
        if isinstance(res, DcsOutcome) and res.dcs_outcome in ("milder", "skipped"):
            log(
                f"{step.name}: the search collapsed ({res.dcs_reason}); "
                + (
                    f"retried at {res.dcs_target:g}x the dense FLOPs"
                    if res.dcs_outcome == "milder"
                    else "the pipeline goes on without DCS"
                )
            )
        elif marker.skipped:
            log(f"{step.name}: skipped ({marker.result.get('reason')})")
        write_step_marker(pipe.out, marker)
        ran[step.name] = True
        eta.finish(step.name)
        left = eta.text()
        log(f"{step.name}: done in {time.perf_counter() - t0:.1f} s" + (f"; {left}" if left else ""))
    return read_summary(pipe.out).set(
        this_run=ThisRun.new(
            resumed=resumed,
            ran=[k for k, v in ran.items() if v],
            skipped=[k for k, v in ran.items() if not v],
        )
    )
