"""Write docs/api.md, the Python API's reference (``import nascompress as nc``), from its docstrings
and signatures.

    python tools/api_reference.py           # rewrite docs/api.md
    python tools/api_reference.py --check   # exit 1 when docs/api.md differs from the code
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OUT = ROOT / "docs" / "api.md"
# (the name a user calls, the module and attribute that implement it), in the reference's order
ENTRIES = [
    ("nc.compress", "nascompress.pyapi.compress", "compress"),
    ("nc.Compressed", "nascompress.pyapi.compress", "Compressed"),
    ("nc.CompressReport", "nascompress.pyapi.compress", "CompressReport"),
    ("nc.dcs.search", "nascompress.pyapi.dcs", "search"),
    ("nc.dcs.DCSSearch", "nascompress.pyapi.dcs", "DCSSearch"),
    ("nc.materialize", "nascompress.pyapi.stages", "materialize"),
    ("nc.retrain", "nascompress.pyapi.stages", "retrain"),
    ("nc.tokens.apply", "nascompress.pyapi.tokens", "apply"),
    ("nc.export.onnx", "nascompress.pyapi.export", "onnx"),
    ("nc.quantize", "nascompress.pyapi.stages", "quantize"),
    ("nc.study", "nascompress.pyapi.study", "study"),
    ("Study", "nascompress.pyapi.study", "Study"),
    ("nc.from_transformers", "nascompress.pyapi.hf", "from_transformers"),
    ("nc.to_transformers", "nascompress.pyapi.hf", "to_transformers"),
    ("nc.load", "nascompress.runs.io", "load"),
    ("StageResult", "nascompress.pyapi.common", "StageResult"),
    ("Materialized", "nascompress.pyapi.stages", "Materialized"),
    ("Retrained", "nascompress.pyapi.stages", "Retrained"),
    ("TokenModel", "nascompress.pyapi.tokens", "TokenModel"),
    ("Exported", "nascompress.pyapi.export", "Exported"),
    ("Quantized", "nascompress.pyapi.stages", "Quantized"),
]
HEAD = """# Python API reference

Generated from the docstrings by `python tools/api_reference.py` (checked by the test suite: edit
the docstrings, then rerun it). A tour with a runnable example: the README's "From Python" section.

`import nascompress as nc`. Every function writes the model it is given as a run directory and calls
the library function the matching command calls, so a call and the command give the same weights for
the same data and seed. Models are accepted as an `nn.Module` (a plain timm `VisionTransformer`, or one
this API returned), a result of this API, or a run directory; data as a built-in dataset name, an
ImageFolder root, or a map-style `Dataset` / `DataLoader` of `(image tensor, label)` whose preprocessing
is the caller's (recorded as such: mean 0, std 1). Without `out=` nothing is written; with `out=DIR`
the given model is kept as `DIR/source` and the stage's run as `DIR/<stage>` (`dcs_search`, `dcs_mat`,
`retrain`, the token method's name, `pipeline`). Errors are one-line `nascompress.NascompressError`s
naming the Python arguments (`force=True`, `target_flops=0.39`), not the commands' options; every
stage function takes `progress` (`progress=False`: nothing is printed). `result.save(dir)` of a model
already saved in `dir` returns it (another model there needs `force=True`).

Which models need nascompress at inference: a model whose blocks only got narrower (DCS's `hidden`
MLP family, pruned heads, removed blocks; uniform pruning with `qk=False`; any model without a
method) comes back as timm's own `Block`/`Attention`/`Mlp` holding its per-block widths, so it pickles
and runs where nascompress is not installed (`nascompress.models.layers.nascompress_modules(model)` is
`[]`). Nascompress's classes stay where timm has none for the shape: DCS's `residual` MLP family (a
channel gather), a static Q/K mask or uniform pruning's Q/K (a Q/K narrower than V), a block left
with no head or hidden neuron (a constant), and every token method (EViT, DynamicViT, ToMe,
Sparsifiner, MG-ViT); `nascompress_modules(model)` names those modules.
"""


def _signature(obj: Any) -> str:
    sig = inspect.signature(obj)
    params = []
    for p in sig.parameters.values():
        text = (
            p.name
            if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
            else ("**" if p.kind == p.VAR_KEYWORD else "*") + p.name
        )
        if p.default is not p.empty:
            text += f"={p.default!r}"
        params.append(text)
        if p.kind == p.KEYWORD_ONLY and "*" not in params and not any(q.startswith("*") for q in params[:-1]):
            params.insert(len(params) - 1, "*")
    return f"({', '.join(params)})"


def section(name: str, obj: Any) -> str:
    doc = inspect.cleandoc(obj.__doc__ or "")
    if inspect.isclass(obj) and dataclasses.is_dataclass(obj):
        fields = ", ".join(f.name for f in dataclasses.fields(obj))
        head = f"### `{name}`\n\nA frozen dataclass: `{fields}`."
        methods = [
            f"- `{m}{_signature(getattr(obj, m))}`: {inspect.cleandoc(getattr(obj, m).__doc__ or '').splitlines()[0]}"
            for m in ("save", "to_transformers")
            if m in vars(obj)
        ]
        return "\n\n".join([head, doc, *(["\n".join(methods)] if methods else [])]) + "\n"
    return f"### `{name}{_signature(obj)}`\n\n{doc}\n"


def reference() -> str:
    parts = [HEAD]
    for name, module, attr in ENTRIES:
        parts.append(section(name, getattr(importlib.import_module(module), attr)))
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 when docs/api.md is out of date")
    args = ap.parse_args(argv)
    new = reference()
    if args.check:
        if not OUT.is_file() or OUT.read_text() != new:
            print("docs/api.md is out of date: run python tools/api_reference.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
