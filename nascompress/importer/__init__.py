"""``nascompress import``: a model from outside (timm weights, a Hugging Face folder, DINOv2's ONNX file)
as a run directory: the job (:mod:`.run`), the shapes read from a weights file (:mod:`.shapes`) and
DINOv2's ONNX graph read into timm weights (:mod:`.dinov2_onnx`)."""
