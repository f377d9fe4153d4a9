"""MG-ViT's modules (:mod:`.mgvit` builds them into a dense timm ViT, and re-exports them): the
slimming module :class:`PPSM`, the multi-granularity stage :class:`MGIS`, and :class:`MGViT`, the
ViT class whose forward runs the SGIS, the early exit and the MGIS (the module doc of
:mod:`.mgvit` describes both stages)."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from timm.layers import Mlp
from timm.models.vision_transformer import Block, VisionTransformer
from torch import nn

from ..models.layers import NCBlock, core_attention
from ..profiling.flops import count_flops
from .mgvit_ops import (
    HEAD_SPLIT,
    MIDDLE_SPLIT,
    casr_update,
    gather_tokens,
    mgis_token_schedule,
    num_mgis_tokens,
    patchify,
    ppsm,
    ppsm_macs,
    resample_grid,
    split_groups,
    subpatch_index,
)
from .mgvit_ops import resample_image as _resample


class PPSM(nn.Module):
    """The slimming module as a (parameter-free) module so the FLOP counter sees its work.
    ``merge_scatter``: :func:`~nascompress.methods.mgvit_ops.match_merge`'s form (export swaps in False)."""

    merge_scatter = True

    def __init__(self, r_pos: float, r_neg: float):
        super().__init__()
        self.r_pos, self.r_neg = r_pos, r_neg

    def forward(self, x: torch.Tensor, score: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, n, D) patch tokens, score (B, n), values (B, n, D) -> slimmed tokens and scores."""
        return ppsm(x, score, values, self.r_pos, self.r_neg, scatter=self.merge_scatter)

    def matmul_macs(self, inputs: tuple, output: Any) -> float:
        x = inputs[0]
        return ppsm_macs(x.shape[0], x.shape[1], x.shape[2], self.r_pos, self.r_neg)


class MGIS(nn.Module):
    """The multi-granularity stage: its own patch embedding, position grid, feature reuse and ViT."""

    def __init__(
        self,
        *,
        in_chans: int,
        patch: int,
        dim: int,
        extra: int,
        depth: int,
        heads: int,
        mlp_ratio: float,
        qkv_bias: bool,
        num_classes: int,
        pos_grid: int,
        ln_eps: float,
        ppsm_layers: list[int],
        r_pos: float,
        r_neg: float,
    ):
        super().__init__()
        norm = partial(nn.LayerNorm, eps=ln_eps)
        self.proj = nn.Conv2d(in_chans, dim, patch, patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim + extra))
        self.pos_embed = nn.Parameter(torch.randn(1, pos_grid * pos_grid, dim) * 0.02)
        self.reuse_norm = norm(dim)
        self.reuse = Mlp(dim, hidden_features=dim, out_features=extra)
        self.blocks = nn.ModuleList(
            Block(dim + extra, heads, mlp_ratio, qkv_bias=qkv_bias, norm_layer=norm) for _ in range(depth)
        )
        for layer, b in enumerate(self.blocks, 1):
            b.__class__ = NCBlock
            core_attention(b.attn)
            b.attn.record_cls = True
            b.attn.record_values = (layer + 1) in ppsm_layers  # PPSM merges by the previous layer's values
        self.ppsm = nn.ModuleDict({str(layer): PPSM(r_pos, r_neg) for layer in ppsm_layers})
        self.norm = norm(dim + extra)
        self.head = nn.Linear(dim + extra, num_classes)


class MGViT(VisionTransformer):
    """A timm VisionTransformer (the SGIS) with an MGIS stage and early exit. See the module doc."""

    mg: dict[str, Any]
    compile_note = (
        "MG-ViT is timed eager only: its early exit sends a data-dependent subset of the batch "
        "through the MGIS stage, so its shapes change with the input (no static graph)"
    )

    def _sgis(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, C, H, W) -> SGIS logits (B, classes), output patch tokens (B, N, C), CASR (B, N)."""
        g, P, pg = self.mg["grid"], self.patch_embed.patch_size[0], self.patch_embed.grid_size[0]
        t = self.patch_embed.norm(self.patch_embed.proj(_resample(x, g * P)).flatten(2).transpose(1, 2))
        pos = self.pos_embed
        t = torch.cat(
            [(self.cls_token + pos[:, :1]).expand(t.shape[0], -1, -1), t + resample_grid(pos[:, 1:], pg, g)], 1
        )
        t = self.norm_pre(self.pos_drop(t))
        casr = None
        for layer, blk in enumerate(self.blocks, 1):
            t = blk(t)
            if blk.attn.record_cls:
                casr = casr_update(
                    casr,
                    blk.attn.cls_attention()[:, :, 1:].mean(1),
                    layer=layer,
                    start=self.mg["casr_start"],
                    lam=self.mg["lam"],
                )
        t = self.norm(t)
        return self.forward_head(t), t[:, 1:], casr

    def _mgis(self, x: torch.Tensor, s_tokens: torch.Tensor, casr: torch.Tensor) -> torch.Tensor:
        """MGIS logits (B, classes) from the images, SGIS output patch tokens and SGIS CASR."""
        m, mg = self.mgis, self.mg
        g, P, pg = mg["grid"], self.patch_embed.patch_size[0], self.patch_embed.grid_size[0]
        B = x.shape[0]
        groups = split_groups(casr, mg["r_h"], mg["r_t"])
        pix, pos = [], []
        for idx, s in zip(groups, (HEAD_SPLIT, MIDDLE_SPLIT, 1)):
            if idx.shape[1] == 0:
                continue
            sub = subpatch_index(idx, g, s)
            patches = patchify(_resample(x, s * g * P), P).flatten(2)  # (B, (s g)^2, Cin P P)
            pix.append(gather_tokens(patches, sub))
            pos.append(gather_tokens(resample_grid(m.pos_embed, pg, s * g).expand(B, -1, -1), sub))
        pix = torch.cat(pix, 1)
        K = pix.shape[1]
        emb = m.proj(pix.reshape(B * K, -1, P, P)).reshape(B, K, -1) + torch.cat(pos, 1)
        head, mid, tail = groups
        fr = m.reuse(m.reuse_norm(gather_tokens(s_tokens, torch.cat([head, mid], 1))))
        n_h = head.shape[1]
        fr = torch.cat(
            [
                fr[:, :n_h].repeat_interleave(HEAD_SPLIT**2, 1),
                fr[:, n_h:].repeat_interleave(MIDDLE_SPLIT**2, 1),
                fr.new_zeros(B, tail.shape[1], fr.shape[-1]),
            ],
            1,
        )
        t = torch.cat([m.cls_token.expand(B, -1, -1), torch.cat([emb, fr], -1)], 1)
        score = values = None
        for layer, blk in enumerate(m.blocks, 1):
            if str(layer) in m.ppsm:
                patches, score = m.ppsm[str(layer)](t[:, 1:], score, values[:, 1:])
                t = torch.cat([t[:, :1], patches], 1)
            t = blk(t)
            if str(layer + 1) in m.ppsm:
                values = blk.attn.values.transpose(1, 2).flatten(2)  # (B, N, H * hd)
            score = casr_update(
                score, blk.attn.cls_attention()[:, :, 1:].mean(1), layer=layer, start=mg["casr_start"], lam=mg["lam"]
            )
        return m.head(m.norm(t)[:, 0])

    def forward_both(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(SGIS logits, MGIS logits) for every image (epsilon = 1, as in training)."""
        s_logits, s_tokens, casr = self._sgis(x)
        return s_logits, self._mgis(x, s_tokens, casr)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits (B, classes): SGIS, then MGIS for the images whose top probability <= epsilon.

        In training mode every image goes through MGIS (epsilon = 1) and MGIS logits are returned.
        """
        if self.training:
            return self.forward_both(x)[1]
        s_logits, s_tokens, casr = self._sgis(x)
        force = getattr(self, "_mg_force", None)
        if force is None:
            stay = s_logits.softmax(-1).amax(-1) <= self.mg["epsilon"]
        else:
            stay = torch.full_like(s_logits[:, 0], force == "mgis", dtype=torch.bool)
        idx = stay.nonzero().squeeze(1)
        out = s_logits.clone()
        if idx.numel():
            out[idx] = self._mgis(x[idx], s_tokens[idx], casr[idx]).to(out.dtype)
        if force is None:
            st = self.__dict__.setdefault("_mg_stats", {"n": 0, "exit": 0})
            st["n"] += x.shape[0]
            st["exit"] += x.shape[0] - idx.numel()
        return out

    # ---- statistics for evaluate -----------------------------------------------------------
    def stage_flops(self) -> dict[str, float]:
        """Per-image MACs of SGIS alone and of SGIS + MGIS (token counts are input independent)."""
        cache = self.__dict__.get("_mg_flops")
        if cache is None:
            p = next(self.parameters())
            x = torch.randn(
                1, self.patch_embed.proj.in_channels, *self.patch_embed.img_size, device=p.device, dtype=p.dtype
            )
            cache = {}
            for mode in ("sgis", "mgis"):
                self._mg_force = mode
                try:
                    cache[mode] = count_flops(self, x).total
                finally:
                    self._mg_force = None
            cache = {
                "sgis_flops": cache["sgis"],
                "mgis_flops": cache["mgis"] - cache["sgis"],
                "ppsm_flops": self.ppsm_flops(),
            }
            self.__dict__["_mg_flops"] = cache
        return dict(cache)

    def ppsm_flops(self) -> float:
        """Per-image MACs of the PPSM modules (similarity matmul and merges)."""
        mg = self.mg
        n = num_mgis_tokens(mg["grid"] ** 2, mg["r_h"], mg["r_t"])
        sched = mgis_token_schedule(n, len(self.mgis.blocks), mg["ppsm_layers"], mg["r_pos"], mg["r_neg"])
        dim = self.mgis.cls_token.shape[-1]
        ins = [n] + [s - 1 for s in sched]  # patch tokens entering layer l is sched[l-2]-1 (layer 1: n)
        return sum(ppsm_macs(1, ins[layer - 1], dim, mg["r_pos"], mg["r_neg"]) for layer in mg["ppsm_layers"])

    def reset_inference_stats(self) -> None:
        self.__dict__["_mg_stats"] = {"n": 0, "exit": 0}

    def inference_stats(self) -> dict[str, float]:
        """Share of images that exited at SGIS since the last reset, and the mean MACs per image."""
        st = self.__dict__.get("_mg_stats", {"n": 0, "exit": 0})
        share = st["exit"] / max(st["n"], 1)
        f = self.stage_flops()
        mean = f["sgis_flops"] + (1 - share) * f["mgis_flops"]
        return {"epsilon": self.mg["epsilon"], "exit_share": share, "mean_flops": mean, "mean_gflops": mean / 1e9, **f}
