"""Which nodes of an exported ONNX model ``nascompress quantize`` turns int8, and which it keeps in
fp32 with the reason (recorded in the sidecar): the linear layers of the blocks are quantized; the
patch embedding, the classifier head, the attention matmuls between activations, Softmax and
LayerNorm stay fp32, and at the milder level the first and last blocks' linear layers too.

:func:`linears_as_gemm` prepares the graph for the static scheme: a linear layer exported as
``MatMul`` + bias ``Add`` (the exporter's form for token inputs ``(B, N, C)``) becomes one ``Gemm`` on
the flattened tokens, so ONNX Runtime runs it as one int8 ``QGemm`` with the bias inside (int32) and
an fp32 output, instead of an int8 matmul, a requantization, a dequantization and an fp32 bias add."""

from __future__ import annotations

import re
from typing import Any

import numpy as np

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


def linears_as_gemm(model: Any, nodes: list[str]) -> int:
    """Rewrite, in place, each ``MatMul`` named in ``nodes`` whose constant 2-D weight's only consumer
    path is one ``Add`` of a constant 1-D bias into ``Flatten(axis=-1) -> Gemm(W, b) -> Reshape`` back
    to the input's leading dimensions (the Gemm keeps the MatMul's name and name scopes, so ``nodes``
    still selects it). Returns how many were rewritten; the function is unchanged (same math)."""
    import onnx  # optional (nascompress[export])
    from onnx import helper, numpy_helper  # optional (nascompress[export])

    g = model.graph
    inits = {i.name: i for i in g.initializer}
    shapes = {
        v.name: [d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim]
        for v in onnx.shape_inference.infer_shapes(model).graph.value_info
    }
    users = _users(g.node)
    wanted, done, out = set(nodes), set(), []
    for n in g.node:
        if id(n) in done:
            continue
        w = inits.get(n.input[1]) if n.op_type == "MatMul" and len(n.input) == 2 else None
        after = users.get(n.output[0], [])
        add = after[0] if len(after) == 1 and after[0].op_type == "Add" else None
        bias = [i for i in add.input if i != n.output[0]] if add is not None else []
        if (
            n.name not in wanted
            or w is None
            or len(w.dims) != 2
            or len(bias) != 1
            or bias[0] not in inits
            or list(inits[bias[0]].dims) != [w.dims[1]]
            or any(o.name == n.output[0] for o in g.output)
        ):
            out.append(n)
            continue
        p = f"{n.name}/as_gemm"
        gemm = helper.make_node("Gemm", [f"{p}/x2d", n.input[1], bias[0]], [f"{p}/y2d"], name=n.name)
        gemm.metadata_props.extend(n.metadata_props)
        out += [helper.make_node("Flatten", [n.input[0]], [f"{p}/x2d"], axis=-1, name=f"{p}/flatten"), gemm]
        lead = shapes[n.input[0]][1:-1] if n.input[0] in shapes else [None]
        if None not in lead:  # only the batch is dynamic (the usual case): one Reshape to a constant shape
            shape = numpy_helper.from_array(np.array([-1, *lead, w.dims[1]], dtype=np.int64), f"{p}/shape_out")
            g.initializer.append(shape)
        else:
            width = numpy_helper.from_array(np.array([w.dims[1]], dtype=np.int64), f"{p}/width")
            g.initializer.append(width)
            out += [
                helper.make_node("Shape", [n.input[0]], [f"{p}/lead"], end=-1, name=f"{p}/shape"),
                helper.make_node("Concat", [f"{p}/lead", width.name], [f"{p}/shape_out"], axis=0, name=f"{p}/concat"),
            ]
        out.append(helper.make_node("Reshape", [f"{p}/y2d", f"{p}/shape_out"], [add.output[0]], name=f"{p}/reshape"))
        done.add(id(add))  # the bias Add, now inside the Gemm
    del g.node[:]
    g.node.extend(_elementwise_in_2d(g, out))
    return len(done)


def _users(nodes: Any) -> dict[str, list[Any]]:
    """Each value name -> the nodes that read it."""
    users: dict[str, list[Any]] = {}
    for n in nodes:
        for i in n.input:
            users.setdefault(i, []).append(n)
    return users


_ELEMENTWISE = ("Gelu", "Relu", "Sigmoid", "Tanh", "Erf")


def _elementwise_in_2d(g: Any, nodes: list[Any]) -> list[Any]:
    """``Gemm -> Reshape -> Gelu -> Flatten -> Gemm`` (an MLP's two rewritten layers) without the
    Reshape and the Flatten: an elementwise activation runs as well on the flattened tokens (two
    nodes fewer per block; at batch 1 each node's dispatch costs about as much as its arithmetic)."""
    made = {o: n for n in nodes for o in n.output}
    users = _users(nodes)
    consts = {i.name for i in g.initializer}
    drop: set[int] = set()
    gone: set[str] = set()
    for f in nodes:
        act = made.get(f.input[0]) if f.name.endswith("/as_gemm/flatten") else None
        if act is None or act.op_type not in _ELEMENTWISE or len(users.get(act.output[0], [])) != 1:
            continue
        rs = made.get(act.input[0])
        if (
            rs is None
            or not rs.name.endswith("/as_gemm/reshape")
            or len(users.get(rs.output[0], [])) != 1
            or rs.input[1] not in consts
        ):  # (a shape read at run time: its Shape/Concat would dangle)
            continue
        act.input[0] = rs.input[0]  # the first layer's (tokens, width) output
        for u in users.get(f.output[0], []):
            u.input[:] = [act.output[0] if i == f.output[0] else i for i in u.input]
        drop.update((id(rs), id(f)))
        gone.update((act.output[0], rs.input[1]))  # its recorded 3-D shape; the Reshape's constant
    keep_vi = [v for v in g.value_info if v.name not in gone]
    del g.value_info[:]
    g.value_info.extend(keep_vi)
    keep_init = [i for i in g.initializer if i.name not in gone]
    del g.initializer[:]
    g.initializer.extend(keep_init)
    return [n for n in nodes if id(n) not in drop]


def summarise_kept(kept: list[dict[str, str]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for k in kept:
        out[k["why"]] = out.get(k["why"], 0) + 1
    return out


__all__ = ["LINEAR_OPS", "plan_precision", "linears_as_gemm", "summarise_kept"]
