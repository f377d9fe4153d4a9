"""MG-ViT's algorithm as pure batched tensor functions (seed 004, sections 3.2-3.3, 7.5, 7.7).

Nothing here knows about timm: the patching lives in :mod:`nascompress.methods.mgvit`.
Shapes: B images, n patch tokens (the class token is handled by the caller), D channels.

* :func:`casr_update`: the global class attention (CASR) of Eq. 6, ``a_hat_l = lam a_hat_{l-1}
  + (1 - lam) a_l`` from layer ``start`` on (before it, the layer's own class attention).
* :func:`split_counts` / :func:`split_groups`: the head / middle / tail split of Eq. 7 with the
  paper's rounding ``N_h = floor(N r_h + 0.5)``.
* :func:`subpatch_index`: which cells of the 2x / 3x finer grid a coarse patch covers.
* :func:`ppsm_counts` / :func:`ppsm`: the Plug-and-Play Slimming Module (three-way decision of
  Eq. 21, boundary match-merge by cosine similarity of value vectors, weighted averages).
* :func:`layer_macs`: the paper's complexity model, SA ``4NC^2 + 2N^2C`` and FFN ``8NC^2``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

HEAD_SPLIT, MIDDLE_SPLIT = 3, 2  # head patches -> 3x3 fine patches, middle -> 2x2 medium patches


def casr_update(prev: torch.Tensor | None, a: torch.Tensor, *, layer: int, start: int, lam: float) -> torch.Tensor:
    """Global class attention after ``layer`` (1-based).

    Args:
        prev: (B, n) the global class attention after the previous layer (None before layer 1).
        a: (B, n) this layer's class attention to the patch tokens (mean over heads).
        start: first layer of the recursion (3 in the paper); up to it ``a_hat = a``.
        lam: the decay lambda (0.98).
    Returns:
        (B, n) the new global class attention.
    """
    if prev is None or layer <= start:
        return a
    return lam * prev + (1.0 - lam) * a


def split_counts(n: int, r_h: float, r_t: float) -> tuple[int, int, int]:
    """(N_h, N_m, N_t) of Eq. 7: ``N_h = floor(N r_h + 0.5)``, ``N_t = floor(N r_t + 0.5)``."""
    n_h = math.floor(n * r_h + 0.5)
    n_t = math.floor(n * r_t + 0.5)
    return n_h, n - n_h - n_t, n_t


def num_mgis_tokens(n: int, r_h: float, r_t: float) -> int:
    """Patch tokens after subsplitting: 9 N_h + 4 N_m + N_t (161 for 7x7, r_h 0.1, r_t 0.4)."""
    n_h, n_m, n_t = split_counts(n, r_h, r_t)
    return HEAD_SPLIT**2 * n_h + MIDDLE_SPLIT**2 * n_m + n_t


def split_groups(casr: torch.Tensor, r_h: float, r_t: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank the coarse patches by CASR (descending) and cut them into head / middle / tail.

    Args:
        casr: (B, N) global class attention of the coarse patches.
    Returns:
        Index tensors (B, N_h), (B, N_m), (B, N_t) into the N coarse patches.
    """
    n_h, n_m, _ = split_counts(casr.shape[1], r_h, r_t)
    order = casr.argsort(dim=1, descending=True)
    return order[:, :n_h], order[:, n_h : n_h + n_m], order[:, n_h + n_m :]


def subpatch_index(idx: torch.Tensor, grid: int, s: int) -> torch.Tensor:
    """Cells of the (s*grid)^2 grid covered by coarse patches ``idx`` of the grid^2 grid.

    Args:
        idx: (B, k) coarse patch indices (row-major).
    Returns:
        (B, k * s * s) row-major indices into the finer grid; the s*s sub-patches of one
        coarse patch are consecutive (row by row inside the patch).
    """
    r, c = idx // grid, idx % grid
    off = torch.arange(s, device=idx.device)
    rows = r[..., None, None] * s + off[:, None]  # (B, k, s, 1)
    cols = c[..., None, None] * s + off[None, :]  # (B, k, 1, s)
    return (rows * grid * s + cols).flatten(1)


def gather_tokens(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x (B, n, D) gathered at idx (B, k) -> (B, k, D)."""
    return x.gather(1, idx[..., None].expand(-1, -1, x.shape[-1]))


def ppsm_counts(num: int, r_pos: float, r_neg: float) -> tuple[int, int, int]:
    """(positive, boundary, negative) counts of Eq. 21 for ``num`` patch tokens ranked 1..num.

    Pos = {rank <= num r_pos}, Neg = {rank >= num (1 - r_neg)}, the rest is the boundary.
    """
    tol = 1e-9
    n_pos = min(num, math.floor(num * r_pos + tol))
    n_neg = num - math.ceil(num * (1.0 - r_neg) - tol) + 1 if r_neg > 0 else 0
    n_neg = max(0, min(n_neg, num - n_pos))
    return n_pos, num - n_pos - n_neg, n_neg


def ppsm_out_tokens(num: int, r_pos: float, r_neg: float) -> int:
    """Patch tokens after one PPSM: positives + half the boundary (floor) + one merged negative."""
    n_pos, n_b, n_neg = ppsm_counts(num, r_pos, r_neg)
    n_b_out = n_b // 2 if n_b >= 2 else n_b
    return n_pos + n_b_out + (1 if n_neg > 0 else 0)


def _weighted_merge(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """(B, k, D) tokens, (B, k) weights -> (B, 1, D) weighted average."""
    return (x * w[..., None]).sum(1, keepdim=True) / w.sum(1, keepdim=True)[..., None].clamp_min(1e-12)


def match_merge(
    x: torch.Tensor, score: torch.Tensor, values: torch.Tensor, *, scatter: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPSM's boundary rule on tokens in rank order: they alternate into set A (1st, 3rd, ...) and
    set B (2nd, 4th, ...), each A token is matched to the B token with the most cosine-similar value
    vector, and every B token becomes the score-weighted average of itself and its A tokens.

    Args:
        x: (B, k, D) tokens (k >= 2), score: (B, k) positive weights, values: (B, k, Dv).
        scatter: add the A tokens into their B tokens with ``scatter_add`` (the default, the fewest
            operations); False: with a one-hot (B, nB, nA) matmul, the same sums for export (a
            ``scatter_add`` becomes an ONNX ``ScatterElements`` with ``reduction="add"``, which ONNX
            Runtime's CPU provider does not run in fp16).
    Returns:
        (B, k // 2, D) merged tokens and their (B, k // 2) summed scores.
    """
    D = x.shape[-1]
    xa, sa, va = x[:, 0::2], score[:, 0::2], values[:, 0::2]
    xbb, sbb, vbb = x[:, 1::2], score[:, 1::2], values[:, 1::2]
    sim = F.normalize(va, dim=-1) @ F.normalize(vbb, dim=-1).transpose(1, 2)  # (B, nA, nB)
    dst = sim.argmax(-1)  # (B, nA)
    if scatter:
        num = (xbb * sbb[..., None]).scatter_add(1, dst[..., None].expand(-1, -1, D), xa * sa[..., None])
        den = sbb.scatter_add(1, dst, sa)
    else:
        to_b = F.one_hot(dst, xbb.shape[1]).to(x.dtype).transpose(1, 2)  # (B, nB, nA): A token i -> B token dst_i
        num = xbb * sbb[..., None] + to_b @ (xa * sa[..., None])
        den = sbb + (to_b @ sa[..., None])[..., 0]
    return num / den[..., None].clamp_min(1e-12), den


def ppsm(
    x: torch.Tensor, score: torch.Tensor, values: torch.Tensor, r_pos: float, r_neg: float, *, scatter: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Three-way decision slimming of the patch tokens (the class token stays with the caller).

    Tokens are ranked by ``score`` (their global class attention). The top ``n_pos`` are kept;
    the bottom ``n_neg`` become one token, their average weighted by score; the boundary tokens
    in rank order alternate into set A (ranks 1, 3, 5, ...) and set B (ranks 2, 4, ...), each A
    token is matched to the B token with the most cosine-similar value vector, and every B token
    becomes the score-weighted average of itself and the A tokens matched to it, so the boundary
    count halves (to |B|). A merged token's score is the sum of its members' scores.

    Args:
        x: (B, n, D) patch tokens.
        score: (B, n) positive importance (global class attention).
        values: (B, n, Dv) value vectors used for the similarity.
        scatter: :func:`match_merge`'s form of the boundary merge (False: export's scatter-free one).
    Returns:
        (B, n', D) tokens and (B, n') scores, ordered positives, merged boundary, negative;
        n' = :func:`ppsm_out_tokens` (n).
    """
    B, n, D = x.shape
    n_pos, n_b, n_neg = ppsm_counts(n, r_pos, r_neg)
    order = score.argsort(dim=1, descending=True)
    xs, ss, vs = gather_tokens(x, order), score.gather(1, order), gather_tokens(values, order)
    parts, scores = [xs[:, :n_pos]], [ss[:, :n_pos]]
    if n_b >= 2:
        merged, den = match_merge(
            xs[:, n_pos : n_pos + n_b], ss[:, n_pos : n_pos + n_b], vs[:, n_pos : n_pos + n_b], scatter=scatter
        )
        parts.append(merged)
        scores.append(den)
    elif n_b == 1:
        parts.append(xs[:, n_pos : n_pos + 1])
        scores.append(ss[:, n_pos : n_pos + 1])
    if n_neg > 0:
        xn, sn = xs[:, n - n_neg :], ss[:, n - n_neg :]
        parts.append(_weighted_merge(xn, sn))
        scores.append(sn.sum(1, keepdim=True))
    return torch.cat(parts, 1), torch.cat(scores, 1)


def ppsm_macs(batch: int, num: int, dim: int, r_pos: float, r_neg: float) -> float:
    """Multiply-adds PPSM does (whole batch): the A x B similarity matmul and the weighted merges."""
    _, n_b, n_neg = ppsm_counts(num, r_pos, r_neg)
    n_a, n_bb = (n_b + 1) // 2, n_b // 2
    sim = n_a * n_bb * dim if n_b >= 2 else 0
    merge = ((n_b if n_b >= 2 else 0) + n_neg) * dim
    return float(batch * (sim + merge))


def layer_macs(n_tokens: int, dim: int, mlp_ratio: float = 4.0) -> float:
    """The paper's complexity model of one layer on N tokens: SA 4NC^2 + 2N^2C, FFN 8NC^2 (mlp 4)."""
    return 4 * n_tokens * dim**2 + 2 * n_tokens**2 * dim + 2 * mlp_ratio * n_tokens * dim**2


def mgis_token_schedule(n_patches: int, depth: int, ppsm_layers: list[int], r_pos: float, r_neg: float) -> list[int]:
    """Tokens (class token included) entering each MGIS layer, PPSM applied before ``ppsm_layers`` (1-based)."""
    out, n = [], n_patches
    for layer in range(1, depth + 1):
        if layer in ppsm_layers:
            n = ppsm_out_tokens(n, r_pos, r_neg)
        out.append(n + 1)
    return out


def resample_grid(pos: torch.Tensor, grid: int, new: int) -> torch.Tensor:
    """Position embeddings (1, grid*grid, D) sampled at the cell centres of a new x new grid.

    Bilinear interpolation with ``align_corners=False`` maps output cell centre i to input
    coordinate (i + 0.5) grid / new - 0.5, i.e. it reads the embedding at the sub-patch centre.
    """
    if new == grid:
        return pos
    D = pos.shape[-1]
    g = pos.reshape(1, grid, grid, D).permute(0, 3, 1, 2)
    g = F.interpolate(g, size=(new, new), mode="bilinear", align_corners=False)
    return g.permute(0, 2, 3, 1).reshape(1, new * new, D)


def resample_image(img: torch.Tensor, size: int) -> torch.Tensor:
    """(B, C, H, W) -> (B, C, size, size): bilinear, antialiased when shrinking; the input itself when
    it already has that size. An fp16 / bf16 image is shrunk in fp32 and cast back (PyTorch's CPU
    kernel for the antialiased filter has no reduced-precision version: an fp16 export's check ran it)."""
    if img.shape[-1] == size and img.shape[-2] == size:
        return img
    shrink = size < img.shape[-1]
    src = img.float() if shrink and img.dtype in (torch.float16, torch.bfloat16) else img
    return F.interpolate(src, size=(size, size), mode="bilinear", align_corners=False, antialias=shrink).to(img.dtype)


def patchify(img: torch.Tensor, p: int) -> torch.Tensor:
    """(B, C, H, W) -> (B, (H/p)*(W/p), C, p, p) row-major patches (a view-based reshape)."""
    B, C, H, W = img.shape
    x = img.reshape(B, C, H // p, p, W // p, p).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(B, (H // p) * (W // p), C, p, p)
