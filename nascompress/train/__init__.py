"""Training a model: the ``nascompress train`` job (:mod:`.run`), the one fit loop (:mod:`.loop`) and
its settings (:mod:`.config`), the hooks a method's recipe plugs into it with (:mod:`.hooks`),
knowledge distillation (:mod:`.distill`), the linear probe (:mod:`.probe`), ``nascompress finetune``
(a method applied to a run and trained with its recipe: :mod:`.finetune`), the default batch size
(:mod:`.auto_batch`), data-parallel training (:mod:`.distributed`) and the typed metrics they return
(:mod:`.metrics`)."""
