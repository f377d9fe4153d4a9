"""``nascompress import``: a model from outside (timm weights, a Hugging Face folder, DINOv2's ONNX file)
as a run directory: the job (:mod:`.run`) and its typed metrics (:mod:`.metrics`), the shapes read from a
weights file (:mod:`.shapes`) and DINOv2's ONNX graph read into timm weights (:mod:`.dinov2_onnx`)."""
