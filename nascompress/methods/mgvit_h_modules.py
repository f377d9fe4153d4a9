"""Hierarchical MG-ViT's modules (:mod:`.mgvit_h` builds them into a dense PVT v2, and re-exports
them): the ranking attention of stage 1 (:class:`RankingAttention`), the sub-token embedding
(:class:`SubEmbed`), the finer tokens' slimming (:class:`GroupSlim`, with :func:`group_domains` and
:func:`slimmed_tokens`), the MG layer (:class:`MGLayer`) and :class:`MGPVT`, the PVT v2 class whose
forward runs the SGIS, the early exit and the MGIS (the module doc of :mod:`.mgvit_h` describes them)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from timm.layers import Mlp
from timm.models._features import feature_take_indices
from timm.models.pvt_v2 import Attention as PvtAttention
from timm.models.pvt_v2 import PyramidVisionTransformerV2
from torch import nn

from ..errors import NascompressError
from .mgvit_ops import (
    HEAD_SPLIT,
    MIDDLE_SPLIT,
    casr_update,
    match_merge,
    ppsm_counts,
    ppsm_macs,
    resample_image,
    split_groups,
)
from ..profiling.flops import count_flops


class RankingAttention(PvtAttention):
    """PVT v2's spatial-reduction attention, computed explicitly so that it records the mean
    attention each reduced key (coarse cell) receives, ``received`` (B, M): the ranking score."""

    def forward(self, x: torch.Tensor, feat_size: list[int]) -> torch.Tensor:
        B, N, C = x.shape
        H, W = feat_size
        q = self.q(x).reshape(B, N, self.num_heads, -1).permute(0, 2, 1, 3)
        r = self.sr(x.permute(0, 2, 1).reshape(B, C, H, W)).reshape(B, C, -1).permute(0, 2, 1)
        k, v = self.kv(self.norm(r)).reshape(B, -1, 2, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        attn = ((q * self.scale) @ k.transpose(-2, -1)).softmax(-1)
        self.received = attn.mean((1, 2))
        x = (self.attn_drop(attn) @ v).transpose(1, 2).reshape(B, N, C)
        return self.proj_drop(self.proj(x))


class SubEmbed(nn.Module):
    """The stem convolution on the crops of the selected cells (parameter free: it is given the
    stem's weights, so the FLOP counter sees exactly the crops it embeds)."""

    def forward(
        self, crops: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: int
    ) -> torch.Tensor:
        return F.conv2d(crops, weight, bias, stride=stride)

    def matmul_macs(self, inputs: tuple, output: torch.Tensor) -> float:
        w = inputs[1]
        return float(output.numel() * w.shape[1] * w.shape[2] * w.shape[3])


class GroupSlim(nn.Module):
    """PPSM's rules on whole proxy groups (P, k, C), parameter free, so that the FLOP counter sees
    the merges: ``boundary`` match-merges each group (row-major A / B, equal weights: the tokens
    of a group share their cell's rank), ``negative`` averages it into one token.
    ``merge_scatter``: :func:`~nascompress.methods.mgvit_ops.match_merge`'s form (export swaps in False)."""

    merge_scatter = True

    def forward(self, fine: torch.Tensor, domain: str) -> torch.Tensor:
        if domain == "negative":
            return fine.mean(1, keepdim=True)
        if fine.shape[1] < 2:
            return fine
        ones = fine.new_ones(fine.shape[:2])
        return match_merge(fine, ones, fine, scatter=self.merge_scatter)[0]

    def matmul_macs(self, inputs: tuple, output: torch.Tensor) -> float:
        fine, domain = inputs
        P, k, C = fine.shape
        return ppsm_macs(P, k, C, 0.0, 1.0 if domain == "negative" else 0.0)


class MGLayer(nn.Module):
    """The MG Transformer layer with proxy tokens (Eq. 16): a pre-norm Transformer layer over each
    group ``[fine tokens, proxy]``; it returns the proxy's output (the only one Eq. 17 reads), so only
    the proxy's query, attention row and MLP are computed."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float, qkv_bias: bool, eps: float):
        super().__init__()
        self.num_heads, self.head_dim = heads, dim // heads
        self.norm1 = nn.LayerNorm(dim, eps=eps)
        self.q = nn.Linear(dim, dim, bias=qkv_bias)
        self.kv = nn.Linear(dim, 2 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim, eps=eps)
        self.mlp = Mlp(dim, hidden_features=int(round(dim * mlp_ratio)))

    def forward(self, proxy: torch.Tensor, fine: torch.Tensor) -> torch.Tensor:
        """proxy (P, 1, C), fine (P, k, C) -> the proxy's output (P, 1, C)."""
        P, k, C = fine.shape
        h = self.norm1(torch.cat([fine, proxy], 1))
        q = self.q(h[:, -1:]).reshape(P, 1, self.num_heads, self.head_dim).transpose(1, 2)
        kv = self.kv(h).reshape(P, k + 1, 2, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, kv[0], kv[1]).transpose(1, 2).reshape(P, 1, C)
        x = proxy + self.proj(a)
        return x + self.mlp(self.norm2(x))

    def matmul_macs(self, inputs: tuple, output: torch.Tensor) -> float:
        P, k, C = inputs[1].shape
        return float(P * (k + 1) * 2 * C)  # one query row over k + 1 keys: QK^T and AV


class MGPVT(PyramidVisionTransformerV2):
    """A timm PVT v2 with Hierarchical MG-ViT's MG layer, ranking and early exit (module doc)."""

    mg: dict[str, Any]
    compile_note = (
        "Hierarchical MG-ViT is timed eager only: the cells it splits, and with early exit the images "
        "that run the MG pass, depend on the input (no static graph)"
    )

    # ---- the two passes --------------------------------------------------------------------
    def _stage1(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
        """Stem and stage 1's layers: tokens (B, N, C), the ranking (B, cells), the grid (H, W)."""
        t = self.patch_embed(x)
        B, H, W, C = t.shape
        t = t.reshape(B, H * W, C)
        score = None
        for layer, blk in enumerate(self.stages[0].blocks, 1):
            t = blk(t, (H, W))
            received = blk.attn.__dict__.pop("received")  # read once: no tensor (or graph) stays on the module
            score = casr_update(score, received, layer=layer, start=self.mg["casr_start"], lam=self.mg["lam"])
        return t, score, (H, W)

    def _stages(self, t: torch.Tensor, hw: tuple[int, int], upto: int | None = None) -> list[torch.Tensor]:
        """Stage 1's norm and stages 2.. on stage-1 tokens: the feature maps (NCHW), up to stage ``upto``."""
        B, _, C = t.shape
        x = self.stages[0].norm(t).reshape(B, hw[0], hw[1], C).permute(0, 3, 1, 2).contiguous()
        feats = [x]
        last = len(self.stages) - 1 if upto is None else upto
        for st in self.stages[1 : last + 1]:
            x = st(x)
            feats.append(x)
        return feats

    def _sub_tokens(self, x: torch.Tensor, idx: torch.Tensor, s: int, g: int, r: int) -> torch.Tensor:
        """Fine (s = 3) or medium (s = 2) tokens of cells ``idx`` (B, n): (B * n * r * r, s * s, C),
        the s x s sub-tokens of each stage-1 token consecutive (row-major)."""
        pe = self.patch_embed
        k, st, p = pe.proj.kernel_size[0], pe.proj.stride[0], pe.proj.padding[0]
        B, n = idx.shape
        side = x.shape[-1] * s // g  # a cell's side in the resampled image
        xs = F.pad(resample_image(x, x.shape[-1] * s), (p, p, p, p))
        crop = side + k - st  # the stem windows of the cell's s r x s r tokens
        v = xs.unfold(2, crop, side).unfold(3, crop, side)  # (B, Cin, g, g, crop, crop), a view
        crops = v[torch.arange(B, device=x.device)[:, None], :, idx // g, idx % g]  # (B, n, Cin, crop, crop)
        emb = self.mg_embed(crops.flatten(0, 1), pe.proj.weight, pe.proj.bias, st)  # (B n, C, s r, s r)
        emb = pe.norm(emb.permute(0, 2, 3, 1))
        C = emb.shape[-1]
        return emb.reshape(B * n, r, s, r, s, C).permute(0, 1, 3, 2, 4, 5).reshape(B * n * r * r, s * s, C)

    def _mg(self, x: torch.Tensor, t: torch.Tensor, score: torch.Tensor, hw: tuple[int, int]) -> torch.Tensor:
        """Eq. 17: the stage-1 tokens with the proxies' outputs in the head and middle cells (their
        groups' finer tokens slimmed by PPSM's domain where r_pos / r_neg say so)."""
        H, W = hw
        B, _, C = t.shape
        r = self.mg["cell_tokens"]
        g = H // r
        cells = t.reshape(B, g, r, g, r, C).permute(0, 1, 3, 2, 4, 5).reshape(B, g * g, r * r, C)
        head, mid, _ = split_groups(score, self.mg["r_h"], self.mg["r_t"])
        out = cells
        first = 0  # the rank (among the split cells) of the first cell of ``idx``
        for idx, s, pos in ((head, HEAD_SPLIT, self.mg_pos_head), (mid, MIDDLE_SPLIT, self.mg_pos_middle)):
            n = idx.shape[1]
            if n == 0:
                continue
            fine = (self._sub_tokens(x, idx, s, g, r) + pos).reshape(B, n, r * r, s * s, C)
            for lo, hi, domain in group_domains(first, n, head.shape[1] + mid.shape[1], self.mg):
                m = hi - lo
                where = idx[:, lo:hi, None, None].expand(-1, -1, r * r, C)
                f = self._slim(fine[:, lo:hi].reshape(B * m * r * r, s * s, C), domain)
                proxy = cells.gather(1, where).reshape(B * m * r * r, 1, C)
                out = out.scatter(1, where, self.mg_layer(proxy, f).reshape(B, m, r * r, C))
            first += n
        return out.reshape(B, g, g, r, r, C).permute(0, 1, 3, 2, 4, 5).reshape(B, H * W, C)

    def _slim(self, fine: torch.Tensor, domain: str) -> torch.Tensor:
        """Proxy groups' finer tokens (P, k, C) after PPSM's rule of ``domain`` (module doc)."""
        return fine if domain == "positive" else self.mg_slim(fine, domain)

    def _mgis_features(self, x: torch.Tensor, upto: int | None = None) -> list[torch.Tensor]:
        t, score, hw = self._stage1(x)
        return self._stages(self._mg(x, t, score, hw), hw, upto)

    def _sgis(self, x: torch.Tensor) -> torch.Tensor:
        """SGIS logits: the network without the MG layer on the image at ``sgis_size``."""
        t, _, hw = self._stage1(resample_image(x, self.mg["sgis_size"]))
        return self.forward_head(self._stages(t, hw)[-1])

    # ---- timm's interfaces -------------------------------------------------------------------
    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """The last stage's map (B, C4, H/32, W/32) of the MG pass (no early exit)."""
        return self._mgis_features(x)[-1]

    def forward_intermediates(
        self,
        x: torch.Tensor,
        indices: int | list[int] | None = None,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
    ) -> Any:
        """timm's convention (NCHW stage maps; ``indices`` as timm): the MG pass's stage outputs, a list
        (``intermediates_only``) or (last map, list)."""
        if output_fmt != "NCHW":
            raise NascompressError(f"mgvit-h gives NCHW feature maps, got output_fmt={output_fmt!r}")
        take, max_index = feature_take_indices(len(self.stages), indices)
        feats = self._mgis_features(x, upto=max_index if stop_early or intermediates_only else None)
        inter = [feats[i] for i in take]
        if intermediates_only:
            return inter
        return feats[-1], inter

    def forward_both(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(SGIS logits, MG-pass logits) for every image (training: every image through both)."""
        return self._sgis(x), self.forward_head(self.forward_features(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits: the SGIS, then the MG pass for the images whose top SGIS probability <= epsilon
        (with epsilon = 1, the MG pass alone). In training mode: the MG pass."""
        if self.training:
            return self.forward_head(self.forward_features(x))
        force = getattr(self, "_mg_force", None)
        if force == "sgis":
            return self._sgis(x)
        if force == "mgis" or (force is None and self.mg["epsilon"] >= 1):
            out = self.forward_head(self.forward_features(x))
            idx_n = x.shape[0]
        else:
            s_logits = self._sgis(x)
            idx = (s_logits.softmax(-1).amax(-1) <= self.mg["epsilon"]).nonzero().squeeze(1)
            out = s_logits.clone()
            if idx.numel():
                out[idx] = self.forward_head(self.forward_features(x[idx])).to(out.dtype)
            idx_n = idx.numel()
        if force is None:
            st = self.__dict__.setdefault("_mg_stats", {"n": 0, "exit": 0})
            st["n"] += x.shape[0]
            st["exit"] += x.shape[0] - idx_n
        return out

    # ---- statistics ---------------------------------------------------------------------------
    def stage_flops(self) -> dict[str, float]:
        """Per-image MACs of the SGIS and of the MG pass (each alone; the MG layer, sub-token
        embeddings and ranking included; the number of split cells is fixed, so they are input
        independent). An exiting image costs the SGIS, another both (or the MG pass alone at
        epsilon = 1, where no SGIS runs)."""
        cache = self.__dict__.get("_mg_flops")
        if cache is None:
            p = next(self.parameters())
            x = torch.randn(1, self.patch_embed.proj.in_channels, *self.nc_img_size, device=p.device, dtype=p.dtype)
            cache = {}
            for mode in ("sgis", "mgis"):
                self._mg_force = mode
                try:
                    cache[f"{mode}_flops"] = count_flops(self, x).total
                finally:
                    self._mg_force = None
            self.__dict__["_mg_flops"] = cache
        return dict(cache)

    def mean_flops(self, exit_share: float, epsilon: float | None = None) -> float:
        """Mean MACs per image when ``exit_share`` of the images exit at the SGIS."""
        f = self.stage_flops()
        eps = self.mg["epsilon"] if epsilon is None else epsilon
        return f["mgis_flops"] if eps >= 1 else f["sgis_flops"] + (1 - exit_share) * f["mgis_flops"]

    def reset_inference_stats(self) -> None:
        self.__dict__["_mg_stats"] = {"n": 0, "exit": 0}

    def inference_stats(self) -> dict[str, float]:
        """Share of images that exited at the SGIS since the last reset, and the mean MACs per image."""
        st = self.__dict__.get("_mg_stats", {"n": 0, "exit": 0})
        share = st["exit"] / max(st["n"], 1)
        mean = self.mean_flops(share)
        return {
            "epsilon": self.mg["epsilon"],
            "exit_share": share,
            "mean_flops": mean,
            "mean_gflops": mean / 1e9,
            **self.stage_flops(),
        }


def group_domains(first: int, n: int, n_split: int, mg: dict[str, Any]) -> list[tuple[int, int, str]]:
    """PPSM's domains of the split cells ranked ``first .. first + n - 1`` (of ``n_split``), as
    (lo, hi, domain) slices of those n: ranks below ``n_pos`` positive, the last ``n_neg`` negative
    (:func:`~nascompress.methods.mgvit_ops.ppsm_counts` of ``n_split``), the rest boundary."""
    n_pos, _, n_neg = ppsm_counts(n_split, mg.get("r_pos", 1.0), mg.get("r_neg", 0.0))
    cuts = sorted({0, n, *(min(n, max(0, c - first)) for c in (n_pos, n_split - n_neg))})
    out = []
    for lo, hi in zip(cuts, cuts[1:]):
        rank = first + lo
        out.append((lo, hi, "positive" if rank < n_pos else "negative" if rank >= n_split - n_neg else "boundary"))
    return out


def slimmed_tokens(k: int, domain: str) -> int:
    """Finer tokens a proxy group of ``k`` keeps in ``domain``: k, half (floor) of them, or one."""
    return k if domain == "positive" else 1 if domain == "negative" else (k // 2 if k >= 2 else k)
