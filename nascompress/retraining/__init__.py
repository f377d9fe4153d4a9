"""Retraining a compressed model against the dense one (``nascompress retrain``): the job and its run
(:mod:`.run`), its settings (:mod:`.config`) and its typed metrics (:mod:`.metrics`). The Python API's ``nc.retrain`` is
:func:`nascompress.pyapi.stages.retrain`."""
