"""Retraining a compressed model against the dense one (``nascompress retrain``): the job and its run
(:mod:`.run`) and its settings (:mod:`.config`). The Python API's ``nc.retrain`` is
:func:`nascompress.pyapi.stages.retrain`."""
