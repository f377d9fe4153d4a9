"""The Python API (``import nascompress as nc``): a model object in, a smaller model out.

Every function here writes the model it is given as a run directory and calls the library
function the matching command calls (``nascompress search dcs``, ``materialize``, ``retrain``,
``finetune``, ``export``, ``quantize``, ``pipeline``), then reads the result back: one
implementation, the same numbers. With ``out=`` the run directories are kept there (and a second
call with the same arguments continues an interrupted run); without it they live in a temporary
directory that is removed before the function returns, so nothing is written.

Modules: :mod:`.common` (models, data and directories), :mod:`.dcs`, :mod:`.stages`
(materialize, retrain, quantize), :mod:`.tokens`, :mod:`.study`, :mod:`.compress`, :mod:`.hf`
(Hugging Face ``transformers`` in and out); ``nc.export.onnx`` is :func:`nascompress.pyapi.export.onnx`.
A caller's Dataset is registered in memory by :mod:`nascompress.data.memory`.
"""
