"""The pipeline's built-in stages, one module each (:mod:`.dcs`, :mod:`.tokens`, :mod:`.retrain`,
:mod:`.export`), each registered with :func:`nascompress.pipeline.stage.register_stage`; every
module of this package is imported when the stages are listed."""
