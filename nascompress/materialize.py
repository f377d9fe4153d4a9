"""Physical materialization: turn a searched DCS supernet into a smaller, faster model.

Small mirrored gather functions build new layers with ``index_select`` and update the module's
metadata in the same place (no fix-up loop afterwards):

* :func:`slice_linear_in` / :func:`slice_linear_out` keep input columns / output rows;
* :func:`slice_layerscale` keeps LayerScale channels;
* :func:`slice_mlp` gathers the selected MLP channels: the MLP reads them after LN2 (fc1 input
  columns) and writes them back into the C-wide residual with one ``index_add`` (fc2 rows); an
  MLP with no channel left is removed, one with every channel kept is left untouched;
* :func:`slice_qk` keeps the selected query/key channels of each head (static Q/K mask). Heads
  may keep different counts; they are padded with zero weight rows to the largest count (one
  batched matmul, the padding counted as computed) and the original ``1/sqrt(head_dim)`` scale
  is passed to SDPA explicitly.

The input-dependent Q/K mask cannot be removed: the materialized model keeps the
:class:`~nascompress.methods.dcs.DCSAttention` with its theta Linear (counted by the profiler).
"""
from __future__ import annotations

import copy
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from timm.layers import Attention
from timm.models.vision_transformer import Block
from torch import nn

from .errors import NascompressError
from .methods.dcs import (
    attend_and_project,
    DCSAttention,
    DCSBlock,
    DCSConfig,
    attach_state,
    check_supported,
    make_record,
    patch_attention_qk,
    selection,
)

# ---------------------------------------------------------------------------------------------
# Gather functions


def _index(keep: Any, size: int, *, what: str, device: torch.device) -> torch.Tensor:
    idx = torch.as_tensor(keep, dtype=torch.long).flatten()
    bad = [int(i) for i in idx if not 0 <= int(i) < size]
    if bad:
        raise NascompressError(f"{what}: all indices should fall into [0, {size}). Invalid indices: {bad}")
    if len(set(idx.tolist())) != len(idx):
        raise NascompressError(f"{what}: indices must be unique, got {idx.tolist()}")
    return idx.sort().values.to(device)


def slice_linear_out(layer: nn.Linear, keep: torch.Tensor) -> nn.Linear:
    """A new Linear with only the output rows ``keep`` (weight and bias)."""
    new = nn.Linear(layer.in_features, len(keep), bias=layer.bias is not None,
                    device=layer.weight.device, dtype=layer.weight.dtype)
    with torch.no_grad():
        new.weight.copy_(layer.weight.index_select(0, keep))
        if layer.bias is not None:
            new.bias.copy_(layer.bias.index_select(0, keep))
    return new


def slice_linear_in(layer: nn.Linear, keep: torch.Tensor) -> nn.Linear:
    """A new Linear that reads only the input columns ``keep`` (the bias is unchanged)."""
    new = nn.Linear(len(keep), layer.out_features, bias=layer.bias is not None,
                    device=layer.weight.device, dtype=layer.weight.dtype)
    with torch.no_grad():
        new.weight.copy_(layer.weight.index_select(1, keep))
        if layer.bias is not None:
            new.bias.copy_(layer.bias)
    return new


def slice_layerscale(ls: nn.Module, keep: torch.Tensor) -> nn.Module:
    """LayerScale with only channels ``keep`` (an Identity stays an Identity)."""
    if isinstance(ls, nn.Identity):
        return ls
    ls.gamma = nn.Parameter(ls.gamma.detach().index_select(0, keep).clone())
    return ls


class MaterializedBlock(Block):
    """timm ``Block`` whose MLP reads and writes only the DCS-selected residual channels.

    Modifications:
        - ``h = norm2(x)[..., keep]``; ``x = x.index_add(-1, keep, drop_path2(ls2(mlp(h))))``;
          fc1 has ``len(keep)`` inputs, fc2 ``len(keep)`` outputs, ls2 ``len(keep)`` channels.
        - with no channel kept the MLP is gone (``mlp = ls2 = Identity``) and skipped.
    """

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x), attn_mask=attn_mask, is_causal=is_causal)))
        keep = self.mlp_keep
        if keep.numel() == 0:
            return x
        B, N, C = x.shape
        # Gather/scatter on a 2-D (B*N, C) view: several times faster on CPU than along dim -1 of 3-D.
        h = self.norm2(x).reshape(B * N, C).index_select(1, keep).reshape(B, N, -1)  # (B, N, len(keep))
        y = self.drop_path2(self.ls2(self.mlp(h))).reshape(B * N, -1)
        if torch.is_grad_enabled() and (x.requires_grad or y.requires_grad):
            return x.reshape(B * N, C).index_add(1, keep, y).reshape(B, N, C)
        return x.reshape(B * N, C).index_add_(1, keep, y).reshape(B, N, C)  # inference: x is this block's own


def slice_mlp(block: Block, keep: Any) -> Block:
    """Gather the MLP channels ``keep`` of ``block`` physically (see :class:`MaterializedBlock`).

    With every channel kept the block is left as it is (no gather, no write-back).
    """
    C = block.mlp.fc1.in_features
    idx = _index(keep, C, what="mlp_keep", device=block.mlp.fc1.weight.device)
    if len(idx) == C:
        return block
    if len(idx) == 0:
        block.mlp, block.ls2 = nn.Identity(), nn.Identity()
    else:
        block.mlp.fc1 = slice_linear_in(block.mlp.fc1, idx)
        block.mlp.fc2 = slice_linear_out(block.mlp.fc2, idx)
        block.ls2 = slice_layerscale(block.ls2, idx)
    if hasattr(block, "dcs_alpha"):
        del block.dcs_alpha
    block.__class__ = MaterializedBlock
    block.register_buffer("mlp_keep", idx, persistent=False)
    return block


class StaticQKAttention(Attention):
    """timm ``Attention`` (forward copied from timm 1.0.31) with per-head kept Q/K channels.

    Modifications:
        - qkv outputs ``[q (H * qk_dim), k (H * qk_dim), v (attn_dim)]``: head h keeps
          ``qk_counts[h]`` channels, padded with zero weight rows to ``qk_dim`` (the largest
          count), so heads stay one batched matmul; the padding is counted as computed.
        - the scale stays the original ``head_dim ** -0.5`` (passed to SDPA as ``scale=``).
        - :meth:`matmul_macs` counts QK^T at ``qk_dim`` per head and AV at ``head_dim``.
    """

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv output (B, N, 2 H qk_dim + attn_dim) -> q, k (B, H, N, qk_dim) and v (B, H, N, head_dim)."""
        B, N, _ = qkv.shape
        H, S = self.num_heads, self.num_heads * self.qk_dim
        q, k, v = qkv.split([S, S, self.attn_dim], dim=-1)
        return (q.reshape(B, N, H, self.qk_dim).transpose(1, 2), k.reshape(B, N, H, self.qk_dim).transpose(1, 2),
                v.reshape(B, N, H, self.head_dim).transpose(1, 2))

    def split_qk(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k (B, H, N, qk_dim) from the qkv output (for methods that read attention scores)."""
        return self.split_qkv(qkv)[:2]

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
        gate = self.gate(x).sigmoid() if self.gate is not None else None
        q, k, v = self.split_qkv(self.qkv(x))
        return attend_and_project(self, q, k, v, attn_mask=attn_mask, is_causal=is_causal, gate=gate)

    def matmul_macs(self, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> float:
        B, N, _ = inputs[0].shape
        return float(B * self.num_heads * N * N * (self.qk_dim + self.head_dim))


def _with_zero_row(layer: nn.Linear) -> nn.Linear:
    """``layer`` with one extra all-zero output row (weight and bias) at the end."""
    new = nn.Linear(layer.in_features, layer.out_features + 1, bias=layer.bias is not None,
                    device=layer.weight.device, dtype=layer.weight.dtype)
    with torch.no_grad():
        new.weight.zero_()[:-1].copy_(layer.weight)
        if layer.bias is not None:
            new.bias.zero_()[:-1].copy_(layer.bias)
    return new


def slice_qk(attn: Attention, keep_per_head: list[Any]) -> Attention:
    """Keep the query/key channels ``keep_per_head[h]`` of each head h (V untouched)."""
    if not isinstance(attn.q_norm, nn.Identity):
        raise NascompressError("a static Q/K mask cannot be materialized on a model with qk_norm "
                               "(the norm needs every channel); search with --qk-mask input or none")
    H, d = attn.num_heads, attn.head_dim
    if len(keep_per_head) != H:
        raise NascompressError(f"qk_keep has {len(keep_per_head)} heads but the attention has {H}")
    dev, A = attn.qkv.weight.device, attn.attn_dim
    keeps = [_index(kh, d, what=f"qk_keep of head {h}", device=dev) for h, kh in enumerate(keep_per_head)]
    kmax = max(1, *(len(kh) for kh in keeps))
    zero = 3 * A  # index of an all-zero row appended below qkv's rows: the padding
    q_rows = torch.cat([torch.cat([h * d + kh, kh.new_full((kmax - len(kh),), zero)]) for h, kh in enumerate(keeps)])
    k_rows = torch.where(q_rows == zero, q_rows, q_rows + A)
    rows = torch.cat([q_rows, k_rows, torch.arange(2 * A, 3 * A, device=dev)])
    attn.qkv = slice_linear_out(_with_zero_row(attn.qkv), rows)
    attn.qk_counts, attn.qk_dim = [len(kh) for kh in keeps], kmax
    if hasattr(attn, "dcs_theta"):
        del attn.dcs_theta
    attn.__class__ = StaticQKAttention
    return attn


# ---------------------------------------------------------------------------------------------
# Whole models


def _apply_blocks(model: nn.Module, cfg: DCSConfig, blocks: list[dict[str, Any]]) -> None:
    if len(blocks) != len(model.blocks):
        raise NascompressError(f"arch.json records {len(blocks)} DCS blocks but the model has {len(model.blocks)}")
    for i, (blk, rec) in enumerate(zip(model.blocks, blocks)):
        if cfg.qk_mask == "static":
            if rec.get("qk_keep") is None:
                raise NascompressError(f"arch.json block {i} has no qk_keep for the static Q/K mask")
            slice_qk(blk.attn, rec["qk_keep"])
        if rec.get("mlp_keep") is not None:
            slice_mlp(blk, rec["mlp_keep"])


def build_materialized(model: nn.Module, cfg: DCSConfig, blocks: list[dict[str, Any]], *,
                       tau: float = 1.0) -> nn.Module:
    """Shape a fresh dense timm ViT as the materialized model ``blocks`` describes (for loading)."""
    check_supported(model)
    if cfg.qk_mask == "input":
        for blk in model.blocks:
            patch_attention_qk(blk.attn, "input", theta_init=cfg.theta_init)
    _apply_blocks(model, cfg, blocks)
    attach_state(model, tau=tau)
    return model


def materialize(supernet: nn.Module, cfg: DCSConfig) -> tuple[nn.Module, dict[str, Any]]:
    """A materialized copy of ``supernet`` (eval-mode masks) and its ``arch.json`` record."""
    record = make_record(supernet, cfg, stage="materialized")
    model = copy.deepcopy(supernet)
    for blk in model.blocks:
        if cfg.qk_mask == "none" and isinstance(blk.attn, DCSAttention):  # plain timm attention again
            del blk.attn.dcs_qk, blk.attn.dcs_theta
            blk.attn.__class__ = Attention
    _apply_blocks(model, cfg, record["blocks"])
    for blk in model.blocks:
        if isinstance(blk, DCSBlock):  # mlp_gates off: plain timm block again
            del blk.dcs_alpha
            blk.__class__ = Block
    attach_state(model, tau=supernet.dcs_state.tau)
    return model.eval(), record


# ---------------------------------------------------------------------------------------------
# The `nascompress materialize` job


@dataclass(frozen=True)
class MaterializeJob:
    """``nascompress materialize``: a finished DCS search directory -> a compact model run."""

    search_dir: str
    out: str
    check_batch: int = 8
    seed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def load_search(search_dir: str | Path) -> tuple[nn.Module, dict[str, Any], DCSConfig]:
    """Load a finished DCS search (supernet, arch, config); refuse unfinished or inconsistent ones."""
    from .io import load_with_arch
    from .utils import read_json

    d = Path(search_dir)
    if not d.is_dir():
        raise NascompressError(f"{d} is not a directory; give the --out directory of 'nascompress search dcs'")
    metrics = d / "metrics.json"
    if not metrics.is_file() or not read_json(metrics).get("finished"):
        raise NascompressError(f"{d} holds no finished DCS search (no metrics.json with finished=true); "
                               "run or --resume 'nascompress search dcs' first")
    supernet, arch = load_with_arch(d)
    methods = arch.get("methods") or []
    if not methods or methods[-1].get("name") != "dcs" or methods[-1].get("stage", "supernet") != "supernet":
        raise NascompressError(f"{d}/arch.json does not describe a DCS supernet "
                               "(its last method must be dcs at stage supernet)")
    rec = methods[-1]
    cfg = DCSConfig.from_dict(dict(rec.get("config", {})))
    if rec.get("blocks") is not None and rec["blocks"] != selection(supernet):
        raise NascompressError(f"{d}/arch.json records selected channels that do not match the gates in "
                               f"{d}/model.safetensors; re-run the search or restore the matching arch.json")
    return supernet, arch, cfg


def source_data(search_cfg: dict[str, Any]) -> dict[str, Any] | None:
    """The ``data`` section of the dense run a search started from (its dataset, without the
    search's own --train-limit), else the search's."""
    from .utils import read_json

    src = Path(search_cfg.get("source", ""))
    if src.is_dir() and (src / "config.json").is_file():
        return read_json(src / "config.json").get("data") or search_cfg.get("data")
    return search_cfg.get("data")


def materialize_search(job: MaterializeJob, *, force: bool = False) -> dict[str, Any]:
    """Materialize ``job.search_dir`` into ``job.out``; returns FLOPs/params/equivalence metrics.

    Everything is checked and built in memory before anything is written.
    """
    from .data import InputSpec
    from .io import save_model
    from .profiling import count_flops
    from .utils import create_out_dir, prepare_out_dir, read_json, write_json

    out = Path(job.out)
    prepare_out_dir(out, force=force)
    supernet, arch, cfg = load_search(job.search_dir)
    model, record = materialize(supernet, cfg)
    spec = InputSpec.from_dict(arch["input"])
    g = torch.Generator().manual_seed(job.seed)
    x = torch.randn(job.check_batch, spec.in_chans, *spec.img_size, generator=g)
    with torch.no_grad():
        diff = (supernet.eval()(x) - model(x)).abs().max().item()
    if diff > 1e-4:
        raise NascompressError(f"materialized logits differ from the supernet's by {diff:.2e} (> 1e-4): "
                               "this is a bug, please report it")
    new_arch = copy.deepcopy(arch)
    new_arch["methods"][-1] = record
    sup_flops, flops = count_flops(supernet, x[:2]), count_flops(model, x[:2])
    cfg_path = Path(job.search_dir) / "config.json"
    search_cfg = read_json(cfg_path) if cfg_path.is_file() else {}
    search_metrics = read_json(Path(job.search_dir) / "metrics.json")
    metrics = {"macs": flops.total, "params": flops.params, "supernet_macs": sup_flops.total,
               "supernet_params": sup_flops.params, "dense_macs": search_metrics.get("dense_macs"),
               "flops_ratio_vs_dense": (flops.total / search_metrics["dense_macs"]
                                        if search_metrics.get("dense_macs") else None),
               "max_abs_logit_diff": diff, "qk_mask": cfg.qk_mask,
               "mlp_kept": [None if b["mlp_keep"] is None else len(b["mlp_keep"]) for b in record["blocks"]]}
    create_out_dir(out, force=force)
    save_model(out, model, new_arch)
    write_json(out / "config.json", {"materialize": job.to_dict(), "data": source_data(search_cfg),
                                     "search": search_cfg.get("search"), "search_data": search_cfg.get("data")})
    write_json(out / "metrics.json", metrics)
    return metrics


__all__ = ["slice_linear_in", "slice_linear_out", "slice_layerscale", "slice_mlp", "slice_qk", "MaterializedBlock",
           "StaticQKAttention", "build_materialized", "materialize", "MaterializeJob", "materialize_search",
           "load_search"]
