"""The Optuna samplers a search offers (``--sampler``): NSGA-II, multivariate TPE, GPSampler (numeric
spaces only), scrambled Sobol QMC (:mod:`~nascompress.studies.qmc`) and the space's spread points
(:mod:`~nascompress.studies.grid`), each seeded per trial by the study runner, and the picklable
factory a search hands to :func:`nascompress.studies.run_study`."""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Sequence
import warnings

import optuna
from optuna.distributions import CategoricalDistribution

from ..config import check_choice, check_field
from ..errors import NascompressError
from .space_model import Space
from .grid import GridPointSampler
from .qmc import qmc_sampler

SAMPLERS = ("nsga2", "tpe", "gp", "qmc", "grid")


def make_sampler(
    kind: str,
    seed: int,
    *,
    study_seed: int | None = None,
    distributions: Mapping[str, Any] | None = None,
    points: Sequence[Mapping[str, Any]] | None = None,
):
    """The sampler of a trial, seeded by ``seed`` (the runner's per-trial seed): ``nsga2``, ``tpe``
    or ``gp``; ``qmc`` needs the study's seed and the space's distributions too, ``grid`` the
    space's points (:func:`sampler_factory` binds them)."""
    if kind == "qmc":
        if study_seed is None or distributions is None:
            raise NascompressError(
                "the qmc sampler needs the study's seed and the space's distributions "
                "(build its factory with sampler_factory)"
            )
        return qmc_sampler(distributions, study_seed=study_seed, seed=seed)
    if kind == "grid":
        if points is None:
            raise NascompressError("the grid sampler needs the space's points (build its factory with sampler_factory)")
        return GridPointSampler(points, seed=seed)
    if kind not in SAMPLERS:
        raise NascompressError(f"unknown sampler {kind!r}; choose one of {', '.join(SAMPLERS)}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind == "nsga2":
            return optuna.samplers.NSGAIISampler(seed=seed, population_size=20)
        if kind == "gp":
            return optuna.samplers.GPSampler(seed=seed, warn_independent_sampling=False)
        return optuna.samplers.TPESampler(
            seed=seed, multivariate=True, group=True, constant_liar=True, warn_independent_sampling=False
        )


def numeric_space(space: Space) -> str | None:
    """Why ``space`` is not a space of numeric parameters only (one line), or None when it is:
    conditional parameters and categorical ones (choices, layer sets, groups, on/off) are not."""
    why = space.conditional()
    if why is not None:
        return why
    for name, d in space.distributions().items():
        if isinstance(d, CategoricalDistribution) and not d.single():
            return f"{name} is categorical ({len(d.choices)} choices)"
    return None


def sampler_factory(kind: str, space: Space, seed: int, *, trials: int = 50) -> Callable[[int], Any]:
    """The picklable ``seed -> sampler`` of a search (``run_study``'s ``sampler_factory``): for
    ``nsga2`` / ``tpe`` / ``gp`` :func:`make_sampler` of the kind; for ``qmc`` bound to the study's
    ``seed`` and ``space``'s distributions (see :mod:`nascompress.studies.qmc`); for ``grid`` to the
    space's ``trials`` spread points (:mod:`nascompress.studies.grid`). ``qmc`` on a space with
    conditional parameters and ``gp`` on one with categorical or conditional parameters are
    refused (one line naming the parameter)."""
    check_field("sampler", check_choice, kind, SAMPLERS)
    if kind == "grid":
        return functools.partial(make_sampler, kind, points=space.grid(trials))
    if kind == "gp":
        why = numeric_space(space)
        if why is not None:
            raise NascompressError(
                f"sampler gp needs a space of numeric parameters, and space {space.name!r} has "
                f"another: {why}; use sampler tpe for it"
            )
    if kind != "qmc":
        return functools.partial(make_sampler, kind)
    why = space.conditional()
    if why is not None:
        raise NascompressError(
            f"sampler qmc needs a space without conditional parameters, and space "
            f"{space.name!r} has one: {why}; use sampler nsga2 or tpe for it"
        )
    return functools.partial(make_sampler, kind, study_seed=seed, distributions=space.distributions())


__all__ = ["SAMPLERS", "make_sampler", "numeric_space", "sampler_factory"]
