"""Which nodes of an exported ONNX model ``nascompress quantize`` turns int8, and which it keeps in
fp32 with the reason (recorded in the sidecar): the linear layers of the blocks are quantized; the
patch embedding, the classifier head, the attention matmuls between activations, Softmax and
LayerNorm stay fp32, and at the milder level the first and last blocks' linear layers too."""
from __future__ import annotations

import re
from typing import Any

LINEAR_OPS = ("MatMul", "Gemm")
_BLOCK = re.compile(r"(?:^|\.)blocks\.(\d+)(?:\.|$)")


def _module_of(node: Any) -> str:
    """The module path of an exported node (torch.onnx records its name scopes), or ''."""
    for p in node.metadata_props:
        if p.key == "pkg.torch.onnx.name_scopes":
            scopes = [s.strip(" '\"") for s in p.value.strip("[]").split(",")]
            return scopes[-2] if len(scopes) >= 2 else ""
    return ""


def _constants(graph: Any) -> set[str]:
    names = {i.name for i in graph.initializer}
    names.update(o for n in graph.node if n.op_type == "Constant" for o in n.output)
    return names


def _block_of(module: str) -> int | None:
    m = _BLOCK.search(module)
    return int(m.group(1)) if m else None


def plan_precision(model: Any, level: int) -> tuple[list[str], list[dict[str, str]]]:
    """The nodes of ONNX ``model`` to quantize and those kept fp32 (with the reason), at ``level``
    (0: the default; 1: the first and last blocks' linear layers too; a model of one or two blocks
    has nothing left to quantize there)."""
    g = model.graph
    consts = _constants(g)
    linear = [n for n in g.node if n.op_type in LINEAR_OPS]
    blocks = [b for b in (_block_of(_module_of(n)) for n in linear) if b is not None]
    ends = {min(blocks), max(blocks)} if blocks and level >= 1 else set()
    quantize, kept = [], []
    for n in g.node:
        mod = _module_of(n)
        why = None
        if n.op_type == "Conv":
            why = "patch embedding (Conv)"
        elif n.op_type in ("Softmax", "LayerNormalization"):
            why = n.op_type
        elif n.op_type in LINEAR_OPS:
            if len(n.input) < 2 or n.input[1] not in consts:
                why = "attention matmul between activations (QK^T / AV)"
            elif mod == "head" or mod.startswith("head."):
                why = "classifier head"
            elif _block_of(mod) in ends:
                why = f"{'first' if _block_of(mod) == min(blocks) else 'last'} block (milder level)"
            else:
                quantize.append(n.name)
                continue
        if why is not None:
            kept.append({"node": n.name, "op": n.op_type, "module": mod, "why": why})
    return quantize, kept


def summarise_kept(kept: list[dict[str, str]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for k in kept:
        out[k["why"]] = out.get(k["why"], 0) + 1
    return out


__all__ = ["LINEAR_OPS", "plan_precision", "summarise_kept"]
