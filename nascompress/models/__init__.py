"""The models nascompress builds and changes: a model's spec and building it from timm
(:mod:`.build`), nascompress's own block and attention layers (:mod:`.layers`), slicing layers into
smaller ones (:mod:`.slicing`) and loading weights into a built model strictly (:mod:`.weights`)."""
