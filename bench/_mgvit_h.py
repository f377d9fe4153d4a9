"""The dense ``pvt_v2_b0`` base of ``bench/mgvit_h.py``, shared with ``bench/mgvit_h_ppsm.py`` and
``bench/mgvit_h_study.py`` (each trains it, or reuses a finished run, exactly the same way)."""

from __future__ import annotations

import json
from pathlib import Path

from _common import data_sizes  # noqa: E402  (puts the repository on sys.path)

from nascompress.data import DataConfig, InputSpec, load_data  # noqa: E402
from nascompress.models.build import ModelSpec  # noqa: E402
from nascompress.runs.io import load_with_arch  # noqa: E402
from nascompress.train.config import TrainConfig
from nascompress.train.run import TrainJob, train  # noqa: E402


def dense_base(base: Path, data_cfg: DataConfig, res: dict, *, img_size: int, epochs: int, reuse: bool):
    """The dense pvt_v2_b0 base every variant starts from (trained unless ``reuse`` and finished), its
    metrics and the data sizes recorded in ``res``: (model, input spec, data)."""
    if not (reuse and (base / "metrics.json").is_file()):
        spec_m = ModelSpec("pvt_v2_b0", {"img_size": img_size, "num_classes": 10, "in_chans": 1})
        train(
            TrainJob(
                model=spec_m,
                data=data_cfg,
                out=str(base),
                train=TrainConfig(epochs=epochs, batch_size=64, lr=1e-3, warmup_epochs=0.2, seed=0),
            ),
            force=True,
        )
    res["dense_base_metrics"] = json.loads((base / "metrics.json").read_text())
    dense, arch = load_with_arch(base)
    spec = InputSpec.from_dict(arch["input"])
    data = load_data(data_cfg, spec=spec)
    res["data"] = data_sizes(data, data_cfg)
    return dense, spec, data
