"""Optuna studies of nascompress (``nascompress search tokens|joint``, ``study``, the pipeline's tokens
stage): what they search, how they run, where they live. The DCS channel search is not an Optuna
study: :mod:`nascompress.dcs_search`.

- :mod:`.space` (and its ``space_*`` parts): search spaces, from a YAML file to a model per trial;
  :mod:`.samplers`, :mod:`.grid`, :mod:`.qmc`: the samplers; :mod:`.scoring`: a trial's objectives;
  :mod:`.trials` (and its ``trial_*`` parts): a search job and its trials, and the picked trial rebuilt.

- :mod:`.storage`: where studies live (default SQLite file, journal file, PostgreSQL).
- :mod:`.runner`: :func:`run_study`, the ask/tell loop; :mod:`.records`: the trial and study records
  kept in the storage (:class:`~.records.TrialRecord`, :class:`~.records.StudyInfo`; :func:`record_trial`,
  :func:`study_info`) and the Pareto front; :mod:`.results`: what the functions hand on, as frozen
  records (a run's :class:`~.results.StudyRun`, ``study list|show|export``'s rows); :mod:`.seeding`: sampler seeds;
  :mod:`.liveness`: heartbeats and stale trials; :mod:`.display`: progress; :mod:`.workers`: worker processes.
- :mod:`.inspect`: list, show and export studies; :mod:`.report`: a self-contained HTML report;
  :mod:`.dashboard`: optuna-dashboard on a study's storage.
"""

from __future__ import annotations

from .liveness import fail_stale_trials, stale_trials
from .records import RECORD_FIELDS, pareto_front, record_trial, study_info, trial_record
from .runner import run_study
from .seeding import default_sampler, sampler_seed
from .storage_url import DEFAULT_DB, DEFAULT_JOURNAL, StorageSpec, mask_url, parse_storage
from .storage import find_study, resolve_run_storage
from .storage_open import open_storage

__all__ = [
    "RECORD_FIELDS",
    "DEFAULT_DB",
    "DEFAULT_JOURNAL",
    "StorageSpec",
    "default_sampler",
    "fail_stale_trials",
    "find_study",
    "mask_url",
    "open_storage",
    "pareto_front",
    "parse_storage",
    "record_trial",
    "resolve_run_storage",
    "run_study",
    "sampler_seed",
    "stale_trials",
    "study_info",
    "trial_record",
]
