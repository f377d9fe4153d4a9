"""The data a command or a Python API call runs on (:func:`data_config_for`): one rule for every front
end, from the run's recorded data, the dataset the user names, the command's limits and seed."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

from . import DataConfig


def data_config_for(
    recorded: DataConfig | None = None,
    *,
    dataset: str | None = None,
    keep_recorded: bool = False,
    default: str | None = DataConfig.dataset,
    settings: Mapping[str, Any] | None = None,
    keep_recorded_seed: bool = False,
    data_dir: str | None = None,
    train_limit: int | None = None,
    eval_limit: int | None = None,
    seed: int | None = None,
    skip_bad_images: bool = False,
) -> DataConfig | None:
    """The DataConfig a front end runs with.

    It starts from:

    * a named ``dataset``: a new config of it (with ``settings``); with ``keep_recorded``, the
      ``recorded`` config with only its dataset replaced (its splits, limits, seeds and classes kept;
      a new config when nothing is recorded);
    * else the ``recorded`` one: the data the run's ``config.json`` records (read by the caller), or
      a DataConfig the caller gave;
    * else a new config of the ``default`` dataset (with ``settings``); ``default=None``: None (no
      data: the run's is read later, or nothing is evaluated), returned as it is.

    A new config's subsets are drawn with seed 0, or with ``keep_recorded_seed`` with the recorded
    run's (``evaluate``: a test split the run carved is the same images).

    Then, where given: ``data_dir``; ``train_limit`` / ``eval_limit`` (None keeps the start's);
    ``seed``, the subsets' seed (the command's ``--seed``; None keeps the start's);
    ``skip_bad_images`` (True sets it, False keeps the start's).

    Args:
        recorded: the data already chosen (the run's recorded data), or None.
        dataset: the dataset the user named (``--dataset``, the API's ``data``), or None.
        keep_recorded: a named dataset replaces only the recorded config's dataset.
        default: the dataset when none is named nor recorded (None: no data).
        settings: the other fields of a new config (a command's data options, the API's workers).
        keep_recorded_seed: a new config's subsets drawn with the recorded run's seed.
        data_dir / train_limit / eval_limit / seed / skip_bad_images: the values the command sets.
    """
    if dataset is not None and not (keep_recorded and recorded is not None):
        base = recorded.subset_seed if keep_recorded_seed and recorded is not None else 0
        data = DataConfig(**{**(settings or {}), "dataset": dataset, "subset_seed": base})
    elif dataset is not None:
        data = replace(recorded, dataset=dataset)
    elif recorded is not None:
        data = recorded
    elif default is not None:
        data = DataConfig(**{**(settings or {}), "dataset": default})
    else:
        return None
    if data_dir is not None:
        data = replace(data, data_dir=data_dir)
    limits = {k: v for k, v in (("train_limit", train_limit), ("eval_limit", eval_limit)) if v is not None}
    if limits or seed is not None:
        data = replace(data, **limits, **({} if seed is None else {"subset_seed": seed}))
    if skip_bad_images:
        data = replace(data, skip_bad_images=True)
    return data


__all__ = ["data_config_for"]
