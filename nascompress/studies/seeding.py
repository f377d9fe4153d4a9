"""Sampler seeding: the sampler a worker rebuilds before each trial, as a function of the study's
seed, the trials already told and the worker (so a resumed study proposes the same trials)."""

from __future__ import annotations

import hashlib
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import optuna
from optuna.samplers import BaseSampler
from optuna.trial import FrozenTrial, TrialState

from .records import SURPLUS_KEY


def default_sampler(seed: int) -> BaseSampler:
    """TPE (multivariate, grouped for conditional spaces, constant liar for parallel workers)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return optuna.samplers.TPESampler(
            seed=seed, multivariate=True, group=True, constant_liar=True, warn_independent_sampling=False
        )


def sampler_seed(seed: int, told: int, worker: int = 0, ahead: int = 0) -> int:
    """The seed a worker's sampler is rebuilt with before a trial: a hash of the study's seed, the
    number of trials already finished (``told``), the worker (distinct streams per worker) and
    ``ahead``, the trials numbered before this one that were not finished when the worker looked
    (0 in a one-worker study, so its seeds are those of ``(seed, told, worker)`` alone).

    ``ahead`` keeps apart two workers of one index in separate runs of one study (each run numbers
    its workers from 0) that ask at the same ``told``: the storage numbers their trials apart, and
    the later one counts the earlier among those ahead of it."""
    tail = f"/{ahead}" if ahead else ""
    h = hashlib.sha256(f"nascompress-sampler/{seed}/{worker}/{told}{tail}".encode()).hexdigest()
    return int(h[:8], 16)


def _told(trials: Sequence[FrozenTrial]) -> int:
    """Trials finished (told), surplus releases aside (those depend on timing)."""
    return sum(1 for t in trials if t.state.is_finished() and not t.system_attrs.get(SURPLUS_KEY))


class ParamSeeded(BaseSampler):
    """A trial's sampler (``factory(seed)``) whose independently sampled parameters are each drawn
    by a sampler seeded from the trial's seed and the parameter's name.

    Why: a sampler draws independent parameters (TPE's start-up trials, parameters outside the
    relative search space) from one random stream in the order the objective asks for them. A
    trial taken over after its worker died keeps the parameters it had already suggested, so the
    rest would be drawn from an earlier point of the stream and differ from an uninterrupted run.
    Seeded per parameter, every parameter has the value it would have had. Relative sampling
    (computed once when the trial starts) goes to ``factory(seed)`` unchanged."""

    def __init__(self, factory: Callable[[int], BaseSampler], seed: int):
        self._factory, self._seed = factory, seed
        self._inner = factory(seed)

    def _param_seed(self, name: str) -> int:
        return int(hashlib.sha256(f"nascompress-param/{self._seed}/{name}".encode()).hexdigest()[:8], 16)

    def infer_relative_search_space(self, study: optuna.Study, trial: FrozenTrial) -> dict[str, Any]:
        return self._inner.infer_relative_search_space(study, trial)

    def sample_relative(self, study: optuna.Study, trial: FrozenTrial, search_space: dict[str, Any]) -> dict[str, Any]:
        return self._inner.sample_relative(study, trial, search_space)

    def sample_independent(
        self, study: optuna.Study, trial: FrozenTrial, param_name: str, param_distribution: Any
    ) -> Any:
        return self._factory(self._param_seed(param_name)).sample_independent(
            study, trial, param_name, param_distribution
        )

    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        self._inner.before_trial(study, trial)

    def after_trial(
        self, study: optuna.Study, trial: FrozenTrial, state: TrialState, values: Sequence[float] | None
    ) -> None:
        self._inner.after_trial(study, trial, state, values)

    def reseed_rng(self) -> None:
        self._inner.reseed_rng()


class _AskSeeded(ParamSeeded):
    """:class:`ParamSeeded` whose seed is settled when the trial exists (``before_trial``, called as
    the storage hands out its number): :func:`sampler_seed` with the trials ahead of it."""

    def __init__(self, factory: Callable[[int], BaseSampler], seed: int, told: int, worker: int, finished: frozenset):
        self._base, self._finished = (seed, told, worker), finished
        super().__init__(factory, sampler_seed(seed, told, worker))

    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        ahead = sum(1 for n in range(trial.number) if n not in self._finished)
        if ahead:
            self._seed = sampler_seed(*self._base, ahead=ahead)
            self._inner = self._factory(self._seed)
        super().before_trial(study, trial)


@dataclass(frozen=True)
class Seeding:
    """How a worker rebuilds its sampler before each trial (:func:`sampler_seed`, :class:`ParamSeeded`)."""

    factory: Callable[[int], BaseSampler]
    seed: int
    worker: int = 0

    def reseed(self, study: optuna.Study, trials: Sequence[FrozenTrial]) -> None:
        """Set the sampler for the next trial from ``trials``, the study as the worker last read it."""
        finished = frozenset(t.number for t in trials if t.state.is_finished())
        study.sampler = _AskSeeded(self.factory, self.seed, _told(trials), self.worker, finished)
