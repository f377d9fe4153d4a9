"""The one rule every front end builds its DataConfig with (:func:`nascompress.data.choose.data_config_for`)."""

from __future__ import annotations

from dataclasses import replace

from nascompress.data import DataConfig
from nascompress.data.choose import data_config_for

RECORDED = DataConfig(dataset="digits", val_fraction=0.2, train_limit=50, eval_limit=20, subset_seed=7, classes="0,1")


def test_the_recorded_data_unless_a_dataset_is_named():
    assert data_config_for(RECORDED) == RECORDED
    assert data_config_for(RECORDED, dataset="synthetic") == DataConfig(dataset="synthetic")
    # keep_recorded: only the dataset replaced (search dcs, quantize)
    assert data_config_for(RECORDED, dataset="synthetic", keep_recorded=True) == replace(RECORDED, dataset="synthetic")
    assert data_config_for(None, dataset="synthetic", keep_recorded=True) == DataConfig(dataset="synthetic")


def test_the_default_dataset_or_none():
    assert data_config_for() == DataConfig()
    assert data_config_for(default="digits", settings={"val_fraction": 0.3}) == DataConfig("digits", val_fraction=0.3)
    assert data_config_for(default=None, seed=3, skip_bad_images=True) is None


def test_a_named_dataset_keeps_the_run_seed_only_when_asked():
    assert data_config_for(RECORDED, dataset="synthetic", keep_recorded_seed=True).subset_seed == 7
    assert data_config_for(RECORDED, dataset="synthetic").subset_seed == 0
    assert data_config_for(None, dataset="synthetic", keep_recorded_seed=True).subset_seed == 0


def test_the_command_values_where_given():
    got = data_config_for(RECORDED, data_dir="data/fm", train_limit=30, seed=3, skip_bad_images=True)
    assert got == replace(RECORDED, data_dir="data/fm", train_limit=30, subset_seed=3, skip_bad_images=True)
    assert got.eval_limit == 20  # None keeps the recorded limit
    assert data_config_for(RECORDED, skip_bad_images=False).skip_bad_images is False
