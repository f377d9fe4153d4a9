"""The pipeline's built-in stages, one module each (:mod:`.dcs`, :mod:`.tokens`, :mod:`.retrain`,
:mod:`.export`), each declaring its section of the pipeline file (``stages.dcs``: ``DCSStage``;
``export``: ``ExportSection``) and registered with :func:`nascompress.pipeline.stage.register_stage`;
every module of this package is imported when the stages are listed."""
