"""DCS: differentiable channel selection (seed 003, sections 3.1, 3.2, 3.4; METHODS.md section 1).

Two selections inside every block, searched jointly (the search is ``nascompress search dcs``):

* Q/K channel masks for the attention weights (section 3.1): ``W = softmax((Q*M)(K*M)^T / sqrt(d))``,
  the same mask on Q and K, V untouched, plugged into :class:`~nascompress.models.layers.NCAttention` as
  its ``qk_mask`` (:class:`DCSQKMask`). ``qk_mask="input"`` is the paper's input-dependent mask,
  theta = Linear(x) per token; ``"static"`` learns one theta per channel (as the official code
  does), the only kind that can be removed physically; ``"none"`` turns it off.
* MLP gates, one of two families (``mlp_gates``; :class:`DCSBlock` owns that MLP half):
  ``residual`` (section 3.2, the paper's): alpha (C,) per block, the gate g multiplies the MLP's
  input and output residual channels; ``hidden``: alpha (Hm,) per block gates the MLP's hidden
  neurons (fc1 rows / fc2 columns), which leaves the residual stream untouched (far less
  destructive on pretrained models, see :mod:`nascompress.dcs_search.family`).

Optionally whole units too (:mod:`.dcs_structure`): ``head_gates`` (one gate per head of every block;
a closed head loses its q, k, v rows and proj columns) and ``depth_gates`` (one gate per block over
both residual branches; a closed block is removed).

All are binary Gumbel-sigmoid masks: hard 0/1 forward at 0.5, straight-through backward. At
inference (no noise) the mask keeps the channels with ``logit > 0``, their count widened to the
alignment (:func:`aligned_mask`: 0, the full width or a multiple of ``align``, filled with the next
channels by logit), so the eval-mode supernet is exactly the model materialization builds. New
parameters: ``blocks.<i>.dcs_alpha`` and ``blocks.<i>.attn.qk_mask.theta``; timm's keys are kept.

Materialization gathers the selection physically: :func:`slice_mlp` (``residual``: the MLP reads
the kept residual channels after LN2 and writes them back with one ``index_add``:
:class:`MaterializedBlock`), :func:`slice_hidden_gates` (``hidden``: fc1 keeps its kept rows and fc2
its kept columns, a plain block) and :func:`slice_qk` (each head keeps its Q/K channels, zero-padded
to the largest count so the heads stay one batched matmul; the original ``1/sqrt(head_dim)`` scale
is kept). The input-dependent mask cannot be removed: its theta Linear stays (and is counted).

The ``arch.json`` record is ``{"name": "dcs", "config": DCSConfig, "stage": "supernet" |
"materialized", "tau": float, "blocks": [{"mlp_keep": [...] | None, "hidden_keep": [...] | None,
"qk_keep": [[...] per head], "heads_keep": [...] (head gates), "skip": bool (block gates)}]}``
(with ``heads_keep``, ``qk_keep`` lists the kept heads only); DCS must be the first method of a
model (it changes channels that later methods read).

This module holds the config, the supernet and materialized model builders and the method; the gate
functions are :mod:`.dcs_gates`'s, the state and patched modules :mod:`.dcs_supernet`'s, the per-block
gather :mod:`.dcs_materialize`'s and the channel importance :mod:`.dcs_importance`'s (re-exported here).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from ..config import Config, StageSettings, check_choice, check_range, check_settings, setting, user_settings
from ..errors import NascompressError
from ..models.layers import DEFAULT_ALIGN, NCBlock
from ..models.slicing import slice_qk
from . import Method, check_index_list, register_method
from .dcs_importance import (
    ChannelImportance,
    channel_importance,
    check_supported,
    spread,
)
from .dcs_gates import (
    protect_gates,
)
from .dcs_materialize import drop_gates, slice_hidden_gates, slice_mlp
from .dcs_structure import ConstantAttention, add_structure_gates, check_structure, drop_skipped, keep_heads
from .dcs_supernet import (
    DCSBlock,
    add_qk_mask,
    attach_state,
    check_align,
    check_family,
    selection,
)

QK_MODES = ("input", "static", "none")
MLP_GATES = ("residual", "hidden", "none", "auto")
ALIGN_AUTO = "auto"  # align's other value: chosen by the search (nascompress.dcs_search.align)
HIDDEN_FILLS = ("zero", "mean")
STAGES = ("supernet", "materialized")
BLOCK_KEYS = ("mlp_keep", "hidden_keep", "qk_keep", "heads_keep", "skip")  # an arch.json DCS block's keys


# ---------------------------------------------------------------------------------------------
# Config


@dataclass(frozen=True)
class DCSConfig(Config):
    """How the supernet is built.

    Args:
        qk_mask: ``input`` (the paper's theta = Linear(x)), ``static`` (one theta per channel,
            can be materialized) or ``none``.
        mlp_gates: the MLP gate family: ``residual`` (the paper's, the default of this building
            block: the MLP's input/output residual channels), ``hidden`` (the MLP's hidden neurons),
            ``none``, or ``auto`` (the search chooses from a short measured probe on the model,
            :mod:`nascompress.dcs_search.family`; ``search dcs``, the pipeline and study trials
            default to it: :data:`SEARCH_DCS`; a supernet is always built with the chosen family).
            ``true``/``false``
            (records of earlier versions) read as ``residual``/``none``.
        align: every width the search keeps (MLP residual or hidden channels per block, Q/K
            channels per head) is 0, the full width or a multiple of this (1: any width), or
            ``auto``: the search chooses it from the model's MLP timed on its device
            (:mod:`nascompress.dcs_search.align`); a supernet is always built with an integer.
        hidden_fill: what a closed hidden neuron contributes: ``zero`` (nothing) or ``mean`` (its
            mean activation on the dense model, folded into fc2's bias when materialized; the
            bias correction of structured pruning, which keeps the MLP's output unbiased).
        alpha_init: initial alpha (positive: gates start open, the dense model is the start). The
            hard Gumbel sample is on iff alpha + L > 0 with L ~ Logistic(0, 1) whatever the
            temperature, so a gate at alpha drops its channel with probability sigmoid(-alpha) at
            every training step: 5 keeps that under 2% at the start (a pretrained model does not
            tolerate 10-30% of its channels dropped at random, as alpha 1-2 would).
        theta_init: initial theta (bias of the theta Linear, or the static theta).
        head_gates: one gate per head of every block (:mod:`.dcs_structure`), logits from
            ``alpha_init`` spread by the heads' weight magnitude.
        depth_gates: one gate per block over both residual branches (:mod:`.dcs_structure`).
        init_spread: the initial logits are ``init + init_spread * z`` with z in [-1, 1] the channel's
            importance within its block (weight magnitude, or the scores given to
            :func:`make_supernet`, e.g. :func:`activation_importance`) (standardised, clipped at 2 sigma, halved):
            the least important channels reach the threshold first, so the FLOPs fall gradually
            instead of every equal logit crossing at the same step (Adam moves all logits alike
            when cross-entropy barely tells channels apart). 0: every logit starts at ``init``.
    """

    # Fields declared with setting() are `search dcs` options and `stages.dcs` keys (the CLI's help, the
    # pipeline's checks; choices in the order the messages list them); theta_init follows alpha_init there.
    qk_mask: str = setting(
        "static",
        choices=("static", "input", "none"),
        help=(
            "Q/K channel mask: static (searched per channel, materializable), input (the paper's, kept at run "
            "time) or none."
        ),
    )
    mlp_gates: str = setting(
        "residual",
        choices=("auto", "residual", "hidden", "none"),
        help=(
            "MLP gate family: residual (the paper's: the MLP's input/output residual channels), hidden (its hidden "
            "neurons: far less destructive on pretrained models), none, or auto (chosen by a short measured probe "
            "on the model: the family whose pruned models stay closer to the dense one)."
        ),
    )
    align: int | str = setting(
        DEFAULT_ALIGN,
        lo=1,
        words=(ALIGN_AUTO,),
        help=(
            "Every kept width (MLP channels per block, Q/K channels per head) is 0, full or a multiple of this "
            "(GPU kernels leave their fast paths below multiples of 8; 1: any width), or auto: the search times "
            "the model's MLP on its device at consecutive hidden widths and takes the largest multiple (64 to 1) "
            "at which the latency steps, so that widths between steps buy nothing."
        ),
    )
    hidden_fill: str = setting(
        "mean",
        choices=("mean", "zero"),
        help=("Hidden family: a closed neuron contributes zero or its mean activation (folded into fc2's bias)."),
    )
    alpha_init: float = setting(5.0, help="Initial mean gate logit alpha/theta (> 0: gates start open).")
    head_gates: bool = setting(
        False,
        help=(
            "Also search whole attention heads: one gate per head of every block (a closed head loses its q, k, "
            "v rows and proj columns)."
        ),
    )
    depth_gates: bool = setting(
        False,
        help="Also search whole blocks: one gate per block over both residual branches (a closed block is removed).",
    )
    theta_init: float = 5.0
    init_spread: float = 1.0

    @classmethod
    def user(cls, **given: Any) -> "DCSConfig":
        """The config a user's settings make (``search dcs``, ``stages.dcs``, a study trial's dcs
        entry): the search's recipe (:data:`SEARCH_DCS`: ``mlp_gates`` auto) but those ``given``,
        ``theta_init`` following ``alpha_init`` unless given."""
        cfg = SEARCH_DCS.replace(**given)
        return cfg if "theta_init" in given else cfg.replace(theta_init=cfg.alpha_init)

    def __post_init__(self) -> None:
        if isinstance(self.mlp_gates, bool):  # records written before the gate families
            object.__setattr__(self, "mlp_gates", "residual" if self.mlp_gates else "none")
        check_settings(self)  # every setting() against its declaration; below: the internal fields
        check_range("theta_init", self.theta_init)
        check_range("init_spread", self.init_spread, 0)


# The DCS search's own settings (`search dcs` options, `stages.dcs` keys, a study trial's dcs entry):
# the building block's, but the gate family, chosen by the search's probe on the model
SEARCH_DCS = DCSConfig(mlp_gates="auto")
SEARCH_DCS_SETTINGS = StageSettings(DCSConfig, tuple(f.name for f in user_settings(DCSConfig)), recipe=SEARCH_DCS)


# ---------------------------------------------------------------------------------------------
# Building and recording (the state, modules and readers: dcs_supernet; the gates: dcs_gates)


def make_supernet(
    model: VisionTransformer,
    cfg: DCSConfig,
    *,
    tau: float = 1.0,
    importance: list[ChannelImportance] | None = None,
    fill: list[torch.Tensor] | None = None,
    protect: list[torch.Tensor | None] | None = None,
) -> VisionTransformer:
    """Patch ``model`` in place into the DCS supernet; dense weights keep their keys.

    Args:
        cfg: its family (``cfg.mlp_gates``) and alignment (``cfg.align``), both resolved (not
            ``auto``), and its initial logits.
        importance: per block (e.g. :func:`activation_importance`); the gate logits start open,
            spread by it (``cfg.init_spread``); default: weight magnitude (:func:`channel_importance`).
        fill: per block, the dense model's mean hidden activation (Hm,) (``BlockStats.hidden_mean``)
            for ``hidden_fill="mean"``; without it the buffer starts at 0 (a loaded record fills it).
        protect: per block, a bool mask of gates fixed open (:func:`protect_gates`), or None.
    """
    check_supported(model)
    check_family(model, cfg.mlp_gates)
    check_align(cfg.align)
    for what, v in (("importance", importance), ("fill", fill), ("protect", protect)):
        if v is not None and len(v) != len(model.blocks):
            raise NascompressError(f"{what} has {len(v)} blocks but the model has {len(model.blocks)}")
    for j, blk in enumerate(model.blocks):
        imp = channel_importance(blk) if importance is None else importance[j]
        blk.__class__ = DCSBlock
        blk.dcs_alpha = blk.dcs_depth = None  # (the block gate: add_structure_gates)
        if cfg.mlp_gates != "none":
            w = blk.mlp.fc1.weight
            alpha = cfg.alpha_init + cfg.init_spread * spread(imp.mlp(cfg.mlp_gates).to(w.device, torch.float32))
            blk.dcs_alpha = nn.Parameter(alpha.to(device=w.device, dtype=w.dtype))
            if protect is not None and protect[j] is not None:
                protect_gates(blk, protect[j])
        if cfg.mlp_gates == "hidden" and cfg.hidden_fill == "mean":
            f = torch.zeros(w.shape[0]) if fill is None else fill[j].float()
            blk.register_buffer("dcs_fill", f.to(device=w.device, dtype=w.dtype).clone())
        if cfg.qk_mask != "none":
            add_qk_mask(blk.attn, cfg.qk_mask, theta_init=cfg.theta_init)
            if cfg.qk_mask == "static":
                with torch.no_grad():
                    th = blk.attn.qk_mask.theta
                    th.add_(cfg.init_spread * spread(imp.qk.to(th.device, torch.float32)).flatten().to(th.dtype))
    add_structure_gates(
        model, heads=cfg.head_gates, depth=cfg.depth_gates, init=cfg.alpha_init, init_spread=cfg.init_spread
    )
    attach_state(model, tau=tau, family=cfg.mlp_gates, align=cfg.align)
    return model


def make_record(model: nn.Module, cfg: DCSConfig, *, stage: str) -> dict[str, Any]:
    """The ``arch.json`` method record of a supernet (stage ``supernet`` or ``materialized``)."""
    return {
        "name": "dcs",
        "config": cfg.to_dict(),
        "stage": stage,
        "tau": float(model.dcs_state.tau),
        "blocks": selection(model),
    }


# ---------------------------------------------------------------------------------------------
# Materialization (the per-block gather: dcs_materialize)


def _apply_blocks(model: nn.Module, cfg: DCSConfig, blocks: list[dict[str, Any]]) -> None:
    if len(blocks) != len(model.blocks):
        raise NascompressError(f"arch.json records {len(blocks)} DCS blocks but the model has {len(model.blocks)}")
    for i, (blk, rec) in enumerate(zip(model.blocks, blocks)):
        if rec.get("heads_keep") is not None:
            keep_heads(blk, rec["heads_keep"])
        if cfg.qk_mask == "static" and not isinstance(blk.attn, ConstantAttention):
            if rec.get("qk_keep") is None:
                raise NascompressError(f"arch.json block {i} has no qk_keep for the static Q/K mask")
            slice_qk(blk.attn, rec["qk_keep"])
        if rec.get("hidden_keep") is not None:
            slice_hidden_gates(blk, rec["hidden_keep"])
        elif rec.get("mlp_keep") is not None:
            slice_mlp(blk, rec["mlp_keep"])
        elif isinstance(blk, DCSBlock):  # no MLP gates: plain block again
            drop_gates(blk)
            blk.__class__ = NCBlock
    drop_skipped(model, blocks)


def build_materialized(
    model: nn.Module, cfg: DCSConfig, blocks: list[dict[str, Any]], *, tau: float = 1.0
) -> nn.Module:
    """Shape a fresh dense timm ViT as the materialized model ``blocks`` describes (for loading)."""
    check_supported(model)
    if cfg.qk_mask == "input":
        for blk in model.blocks:
            add_qk_mask(blk.attn, "input", theta_init=cfg.theta_init)
    _apply_blocks(model, cfg, blocks)
    attach_state(model, tau=tau, family=cfg.mlp_gates, align=cfg.align)
    return model


def materialize(supernet: nn.Module, cfg: DCSConfig) -> tuple[nn.Module, dict[str, Any]]:
    """A materialized copy of ``supernet`` (eval-mode masks) and its ``arch.json`` record."""
    record = make_record(supernet, cfg, stage="materialized")
    model = copy.deepcopy(supernet)
    _apply_blocks(model, cfg, record["blocks"])
    attach_state(model, tau=supernet.dcs_state.tau, family=cfg.mlp_gates, align=cfg.align)
    return model.eval(), record


# ---------------------------------------------------------------------------------------------
# The method


@register_method
class DCS(Method):
    name = "dcs"
    summary = "differentiable channel selection: Q/K channel masks and MLP channel gates (seed 003)"
    config_cls = DCSConfig
    stacks_on = frozenset()  # first: it changes the channels every later method reads

    def check_record(self, record: dict[str, Any]) -> None:
        super().check_record(record)
        check_choice("stage", record.get("stage", "supernet"), STAGES)
        tau = record.get("tau", 1.0)
        if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not 0 < tau < math.inf:
            got = tau if isinstance(tau, (int, float)) else type(tau).__name__
            raise NascompressError(f"tau must be a positive number, got {got}")
        blocks = record.get("blocks")
        if blocks is None and record.get("stage") != "materialized":
            return
        if not isinstance(blocks, list) or not all(isinstance(b, dict) for b in blocks):
            raise NascompressError("blocks must be a list of objects, one per block")
        for i, blk in enumerate(blocks):
            unknown = sorted(set(blk) - set(BLOCK_KEYS))
            if unknown:
                raise NascompressError(f"blocks[{i}] has unknown keys (valid: {', '.join(BLOCK_KEYS)})")
            if blk.get("mlp_keep") is not None and blk.get("hidden_keep") is not None:
                raise NascompressError(f"blocks[{i}] keeps both mlp_keep and hidden_keep (one MLP gate family)")
            for key in ("mlp_keep", "hidden_keep", "qk_keep", "heads_keep"):
                if blk.get(key) is not None:
                    check_index_list(blk[key], f"blocks[{i}].{key}", nested=key == "qk_keep")
            check_structure(blk, i)

    def patch(self, model: nn.Module, cfg: DCSConfig, record: dict[str, Any]) -> nn.Module:
        stage = check_choice("stage", record.get("stage", "supernet"), STAGES)
        tau = float(record.get("tau", 1.0))
        if "align" not in (record.get("config") or {}):  # a record of before the alignment: widths as kept
            cfg = cfg.replace(align=1)
        if stage == "supernet":
            return make_supernet(model, cfg, tau=tau)
        return build_materialized(model, cfg, record.get("blocks") or [], tau=tau)

    def prepare(self, model, cfg, recipe):
        model = make_supernet(model, cfg)
        return model, make_record(model, cfg, stage="supernet")

    def cli_fields(self) -> list:
        return []  # not a finetune method: its settings' options belong to `search dcs`

    def hooks(self, model, record, *, teacher, train_cfg):
        raise NascompressError(
            "dcs is trained by `nascompress search dcs` (then `materialize` and `retrain`), not by finetune"
        )


__all__ = [
    "DCS",
    "DCSConfig",
    "SEARCH_DCS",
    "SEARCH_DCS_SETTINGS",
    "MLP_GATES",
    "ALIGN_AUTO",
    "make_supernet",
    "make_record",
    "build_materialized",
    "materialize",
]
