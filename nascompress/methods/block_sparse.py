"""Block-sparse attention for Sparsifiner: block layout, block predictor, and three equal paths
(the layout and the predictor are :mod:`.block_sparse_layout`'s, re-exported here).

Sparsifiner's unstructured per-query mask saves nothing on a CPU (masking a dense n x n matrix
costs the full matmul; gathering top-k keys per query is 30-60x slower than fused SDPA). A
block-structured mask does pay. The layout (:class:`BlockLayout`):

* the prefix (CLS) query rows attend to every key, and every query attends to the prefix keys
  (the CLS token is the global token of the sequence, as in the official code's CLS handling);
* the patch tokens ``prefix .. n-1`` are cut into ``nb`` blocks of ``bs`` tokens (``bs`` a
  divisor of the patch count when one is close to the target size, so no block is short);
* each patch query block keeps its ``keep`` best patch key blocks per head, with
  ``prefix + keep * bs >= budget`` (the per-query budget B = ceil(keep ratio * n)).

The predictor's scores are pooled over (query block, key block) tiles without ever building the
n x n map: pooling is linear, so tile scores = (row sums of the thresholded coefficients per query
block) @ (column sums of the thresholded W_up per key block); the pooled W_up depends on the
weights only and is cached at inference.

Three paths compute the same attention given the same kept blocks (tested):

* :func:`masked_block_attention`: a dense bool mask (:func:`dense_block_mask`) and masked SDPA
  (training, and the reference);
* :func:`gather_block_attention` (the inference path): every query block's prefix keys and kept
  key blocks are gathered with one ``index_select`` per K and V straight from the qkv projection's
  memory (no transposing copy), and one fused SDPA runs over the (B, H * nb) query blocks; the
  prefix query rows run a dense SDPA beside it;
* :func:`flex_block_attention`: ``torch.nn.attention.flex_attention`` (compiled) with a
  ``BlockMask`` built directly from the block indices (``BlockMask.from_kv_blocks``; no
  ``create_block_mask``, no Python loop) for the patch queries, the prefix keys riding along as
  one more kept block; the prefix query rows run a dense SDPA.

The compiled kernel is not trusted blindly: on an AMD EPYC CPU with torch 2.13 it is wrong
(up to ~2 off SDPA, or NaN) at ``BLOCK_SIZE`` 8, 24, 40, 56, 104 and exact at 12, 16, 20, 28,
32, 36, 64, 98, 128. :func:`flex_kernel_ok` refuses block sizes below 16 and of 16 k + 8 outright and
checks every other configuration once, at first use, against :func:`masked_block_attention`; a
refused configuration warns once and runs the gather path.

On CUDA, Inductor's flex kernel tiles each BlockMask block by BLOCK_M x BLOCK_N and refuses blocks
its tiles do not divide (a 28-token block under its default 128 x 64 tiles): with ``kernel="flex"``
the automatic block side is a multiple of 16 (:func:`flex_multiple`; on the CPU too, so the blocks
do not depend on the device; an explicit ``block_size`` CUDA cannot tile is refused with one line)
and the tiles are passed as ``kernel_options`` (:func:`cuda_kernel_options`).

Measured on this CPU (torch 2.13, 785 tokens, 6 heads, head dim 64, 1 thread): the compiled CPU
flex kernel costs about dense time per kept tile, so the gather path is the default; see
bench/sparsifiner.py for the figures.
"""

from __future__ import annotations

import math
import threading
import warnings
from typing import Callable

import torch
import torch.nn.functional as F
import torch._dynamo
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from torch.utils._python_dispatch import _get_current_dispatch_mode

from ..errors import NascompressError
from .block_sparse_layout import (  # noqa: F401  (re-exported: the layout and predictor are this module's API)
    CUDA_FLEX_MULTIPLE,
    BlockLayout,
    auto_block_size,
    block_scores,
    block_sizes,
    plan_blocks,
    pool_patch_rows,
    pooled_basis,
    predict_blocks,
    top_blocks,
)

_COMPILED: dict[str, Callable] = {}
_FLEX_OK: dict[tuple, bool] = {}  # flex_kernel_ok's verdicts, per compiled configuration
MIN_FLEX_BLOCK = 16  # smaller BlockMask blocks are wrong on some CPUs (see flex_kernel_ok)


# ---------------------------------------------------------------------------------------------
# The reference: a dense bool mask


def dense_block_mask(idx: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """The token-level bool mask (B, H, n, n) of kept blocks ``idx`` (True = attend), prefix rows and
    prefix columns all True."""
    B, H, nb, _ = idx.shape
    p, bs, n = layout.prefix, layout.bs, layout.n
    blk = torch.zeros(B, H, nb, nb, dtype=torch.bool, device=idx.device)
    blk.scatter_(-1, idx, True)
    tile = blk.repeat_interleave(bs, -2).repeat_interleave(bs, -1)[..., : n - p, : n - p]
    m = torch.ones(B, H, n, n, dtype=torch.bool, device=idx.device)
    m[..., p:, p:] = tile
    return m


def masked_block_attention(q, k, v, idx, layout: BlockLayout, *, scale: float, dropout_p: float = 0.0):
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=dense_block_mask(idx, layout), dropout_p=dropout_p, scale=scale
    )


def kept_pairs(idx: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """(query, key) pairs attended, per (B, H): prefix rows n each, patch rows prefix + their kept keys."""
    sizes = block_sizes(layout, device=idx.device)
    kept = sizes[idx].sum(-1)  # (B, H, nb) kept patch keys per query block
    return ((kept + layout.prefix) * sizes).sum(-1) + layout.prefix * layout.n


# ---------------------------------------------------------------------------------------------
# The inference path: gathered blocks + fused SDPA


def _row_view(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """A (rows, d) view of ``t``'s memory and the row strides of its (B, H, n) dims.

    ``t`` (B, H, n, d) is typically a strided view of the qkv projection (B, n, 3, H, d); its rows
    are read in place when every stride is a multiple of d (else ``t`` is made contiguous).
    """
    d = t.shape[-1]
    if torch.compiler.is_compiling():  # storage views break the graph: a contiguous copy, rows of it
        t = t.contiguous()
        return t.view(-1, d), (t.shape[1] * t.shape[2], t.shape[2], 1)
    st = t.stride()
    if st[-1] != 1 or any(s % d for s in st[:-1]) or t.storage_offset() % d:
        t = t.contiguous()
        st = t.stride()
    rows = (t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()) // d
    flat = t.as_strided((rows, d), (d, 1), t.storage_offset())
    return flat, (st[0] // d, st[1] // d, st[2] // d)


def gather_index(
    idx: torch.Tensor, layout: BlockLayout, strides: tuple[int, int, int]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Row indices of the keys each query block attends (prefix keys, then its kept blocks).

    Returns (rows (B * H * nb * L,), pad mask (B, H * nb, 1, L) or None when no block is short),
    L = prefix + keep * bs.
    """
    B, H, nb, keep = idx.shape
    p, bs, n = layout.prefix, layout.bs, layout.n
    dev = idx.device
    tok = p + idx.unsqueeze(-1) * bs + torch.arange(bs, device=dev)  # (B, H, nb, keep, bs)
    tok = tok.flatten(-2)
    mask = None
    if not layout.exact:
        mask = tok < n
        tok = tok.clamp(max=n - 1)
        mask = F.pad(mask, (p, 0), value=True).view(B, H * nb, 1, -1)
    if p:
        tok = torch.cat([torch.arange(p, device=dev).expand(B, H, nb, p), tok], -1)
    sb, sh, sn = strides
    base = (torch.arange(B, device=dev) * sb).view(B, 1, 1, 1) + (torch.arange(H, device=dev) * sh).view(1, H, 1, 1)
    return (tok * sn + base).view(-1), mask


_WORKSPACE = threading.local()


def _workspace(tag: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """A reused scratch buffer, one per thread (inference only; its contents never leave the call).

    Fresh multi-MB buffers on every call come from newly mapped pages (glibc returns big freed
    blocks to the OS), and the page faults cost as much as the gather itself (measured: 0.68 ms
    against 0.14 ms for one 2.4 MB index_select at 785 tokens). The buffers grow to the largest
    shape seen (at 3137 tokens, 6 heads: about 75 MB).
    """
    bufs = _WORKSPACE.__dict__.setdefault("bufs", {})
    key = (tag, like.dtype, like.device)
    buf = bufs.get(key)
    numel = math.prod(shape)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=like.dtype, device=like.device)
        bufs[key] = buf
    return buf[:numel].view(shape)


def gather_block_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor, layout: BlockLayout, *, scale: float
) -> torch.Tensor:
    """Attention over the prefix keys and the kept key blocks ``idx``, via gathered rows + fused SDPA.

    Args:
        q, k: (B, H, n, d), v: (B, H, n, d_v), any strides (views of the qkv projection are read in place).
        idx: (B, H, nb, keep) kept key blocks per query block.
    Returns:
        (B, H, n, d_v), equal to :func:`masked_block_attention` with the same ``idx``.
    """
    B, H, n, d = q.shape
    dv = v.shape[-1]  # may differ from d (DCS-materialized q/k keep fewer channels than v)
    p, bs, nb = layout.prefix, layout.bs, layout.nb
    kf, kst = _row_view(k)
    vf, vst = _row_view(v)
    rows, mask = gather_index(idx, layout, kst)
    vrows = rows if vst == kst else gather_index(idx, layout, vst)[0]
    L = rows.numel() // (B * H * nb)
    if torch.is_grad_enabled() or torch.compiler.is_compiling():  # no scratch buffers (autograd, Inductor)
        ks = kf.index_select(0, rows).view(B, H * nb, L, d)
        vs = vf.index_select(0, vrows).view(B, H * nb, L, dv)
        qp = q[:, :, p:]
        qs = (qp if layout.exact else F.pad(qp, (0, 0, 0, nb * bs - layout.n_patch))).reshape(B, H * nb, bs, d)
    else:
        ks = torch.index_select(kf, 0, rows, out=_workspace("k", (rows.numel(), d), kf)).view(B, H * nb, L, d)
        vs = torch.index_select(vf, 0, vrows, out=_workspace("v", (rows.numel(), dv), vf)).view(B, H * nb, L, dv)
        qs = _workspace("q", (B, H, nb * bs, d), q)
        qs[:, :, : layout.n_patch].copy_(q[:, :, p:])
        qs[:, :, layout.n_patch :].zero_()  # padding rows of a short last block (discarded)
        qs = qs.view(B, H * nb, bs, d)
    out = q.new_empty(B, H, n, dv)
    # reshape, not view: CUDA's fp32 kernels may return the output in another memory layout
    o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale).reshape(B, H, nb * bs, dv)
    out[:, :, p:] = o[:, :, : layout.n_patch]
    if p:
        out[:, :, :p] = F.scaled_dot_product_attention(q[:, :, :p], k, v, scale=scale)
    return out


# ---------------------------------------------------------------------------------------------
# The FlexAttention path


def make_block_mask(idx: torch.Tensor, layout: BlockLayout):
    """A FlexAttention ``BlockMask`` for patch queries over the keys [patch blocks (padded to nb * bs),
    prefix keys]: each query block keeps its blocks ``idx`` plus the prefix block (index nb)."""
    B, H, nb, keep = idx.shape
    extra = 1 if layout.prefix else 0  # the prefix keys form block nb
    kv_idx = torch.cat([idx, idx.new_full((B, H, nb, extra), nb)], -1).to(torch.int32)
    kv_idx = F.pad(kv_idx, (0, nb + extra - keep - extra))  # (B, H, nb, nb + extra); past kv_num: ignored
    kv_num = torch.full((B, H, nb), keep + extra, dtype=torch.int32, device=idx.device)
    kv_len = nb * layout.bs + layout.prefix
    mask_mod = None
    if not layout.exact:  # the padding of the short last patch block is not a key
        n_patch, pad_end = layout.n_patch, nb * layout.bs

        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx < n_patch) | (kv_idx >= pad_end)

    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, BLOCK_SIZE=layout.bs, mask_mod=mask_mod, seq_lengths=(layout.n_patch, kv_len)
    )


def compiled_flex_attention() -> Callable:
    """``torch.compile(flex_attention, dynamic=False)``, built once per process."""
    if "flex" not in _COMPILED:
        # every (shape, block size) is its own specialization (dynamic=False); past dynamo's
        # default limit of 8 it would silently fall back to the eager, dense flex_attention
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        _COMPILED["flex"] = torch.compile(flex_attention, dynamic=False)
    return _COMPILED["flex"]


def flex_multiple(kernel: str, block_size: int | None, device: torch.device) -> int:
    """The multiple an automatic block side is for ``kernel``: 16 for ``flex`` (on every device, so
    a model computes the same blocks on the CPU and on a GPU), else 1. An explicit ``block_size``
    that CUDA's flex kernel cannot tile is refused with one line."""
    if kernel != "flex":
        return 1
    if device.type == "cuda" and block_size is not None and block_size % CUDA_FLEX_MULTIPLE:
        raise NascompressError(
            f"Sparsifiner's flex kernel on CUDA needs blocks of a multiple of {CUDA_FLEX_MULTIPLE} "
            f"tokens (Inductor tiles them by BLOCK_M x BLOCK_N), got block_size={block_size}; set "
            f"block_size to a multiple of {CUDA_FLEX_MULTIPLE}, leave it out, or use kernel=gather"
        )
    return CUDA_FLEX_MULTIPLE


def cuda_kernel_options(layout: BlockLayout) -> dict[str, int]:
    """Inductor's CUDA flex tile sizes for ``layout``: BLOCK_M = BLOCK_N = gcd(block side, 64), so
    every BlockMask block is whole tiles (its default tiles, e.g. 128 x 64, need not divide it)."""
    tile = math.gcd(layout.bs, 64)
    return {"BLOCK_M": tile, "BLOCK_N": tile}


def flex_usable() -> bool:
    """False under a dispatch / torch-function mode (FlopCounterMode, tracing), where the compiled
    kernel cannot run; callers then use an equivalent path."""
    return _get_current_dispatch_mode() is None and not torch._C._is_torch_function_mode_enabled()


def flex_kernel_ok(layout: BlockLayout, q: torch.Tensor) -> bool:
    """Whether the compiled flex kernel may run ``layout`` for queries shaped like ``q`` (B, H, n, d).

    False under a dispatch mode (:func:`flex_usable`; not cached). Otherwise one verdict per
    configuration (layout, q's shape, dtype, device, CPU threads: what the compiled kernel
    specializes on, plus ``keep``), cached for the process; a False verdict warns once.

    * False without compiling for block sizes known to be wrong on some CPUs: below 16, and
      16 k + 8 (on an AMD EPYC with torch 2.13, 8, 24, 40, 56 and 104 are off by up to ~2 or NaN,
      for some kept blocks only, so a self-check could pass by luck; 8 was exact elsewhere).
    * Else the kernel runs once on seeded random q/k/v and kept blocks of this layout (q's
      shapes: the same compiled kernel as the real call) and must match
      :func:`masked_block_attention` within 1e-4 (float32; 2e-2 in half precision).
    """
    if not flex_usable():
        return False
    threads = torch.get_num_threads() if q.device.type == "cpu" else 0
    key = (layout, tuple(q.shape), q.dtype, q.device, threads)
    if key not in _FLEX_OK:
        bs = layout.bs
        if q.is_cuda:
            why = (
                f"blocks of {bs} tokens are not a multiple of {CUDA_FLEX_MULTIPLE}"
                if bs % CUDA_FLEX_MULTIPLE
                else _flex_self_check(layout, q)
            )
        else:
            why = (
                f"blocks of {bs} tokens (below {MIN_FLEX_BLOCK}, or 16 k + 8) are wrong on some CPUs"
                if bs < MIN_FLEX_BLOCK or bs % 16 == 8
                else _flex_self_check(layout, q)
            )
        _FLEX_OK[key] = why is None
        if why:
            warnings.warn(
                f"Sparsifiner: compiled FlexAttention disabled for BLOCK_SIZE={bs} "
                f"(q {tuple(q.shape)}, prefix {layout.prefix}, keep {layout.keep}, {q.dtype}, "
                f"{q.device}): {why}; using the gather path",
                RuntimeWarning,
                stacklevel=3,
            )
    return _FLEX_OK[key]


def _flex_self_check(layout: BlockLayout, q: torch.Tensor) -> str | None:
    """Why the compiled kernel is wrong for ``layout`` and q's shape (see :func:`flex_kernel_ok`), or None."""
    g = torch.Generator().manual_seed(0)  # the global RNG is left alone
    B, H, _, d = q.shape
    qkv = torch.randn(3, *q.shape, generator=g).to(q.device, q.dtype).unbind(0)
    idx = top_blocks(torch.rand(B, H, layout.nb, layout.nb, generator=g), layout.keep).to(q.device)
    got = _flex_kernel_attention(*qkv, idx, layout, scale=d**-0.5).float()
    want = masked_block_attention(*(t.float() for t in qkv), idx, layout, scale=d**-0.5)
    err = (got - want).abs().max().item()
    tol = 1e-4 if q.dtype in (torch.float32, torch.float64) else 2e-2
    return None if err <= tol else f"its self-check is {err:.3g} off the masked path (tolerance {tol:g})"


def flex_block_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor, layout: BlockLayout, *, scale: float
) -> torch.Tensor:
    """The same attention as :func:`gather_block_attention`, with compiled FlexAttention where
    :func:`flex_kernel_ok` accepts the configuration (and q/k and v share a head dim, which is
    what the self-check covers), else with :func:`gather_block_attention`."""
    same_dims = v.shape[-1] == q.shape[-1]
    attend = _flex_kernel_attention if same_dims and flex_kernel_ok(layout, q) else gather_block_attention
    return attend(q, k, v, idx, layout, scale=scale)


def _flex_kernel_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor, layout: BlockLayout, *, scale: float
) -> torch.Tensor:
    """The compiled flex kernel, unchecked (use :func:`flex_block_attention`).

    The patch queries attend over [patch keys padded to whole blocks, prefix keys] with the
    BlockMask of :func:`make_block_mask` (the compiled CPU kernel has no ``return_lse``, so the
    prefix keys ride along as one more kept block); prefix query rows run a dense SDPA.
    """
    p, pad = layout.prefix, layout.nb * layout.bs - layout.n_patch

    def keys(t):
        return torch.cat([F.pad(t[:, :, p:], (0, 0, 0, pad)), t[:, :, :p]], 2)

    qp = q[:, :, p:].contiguous()
    extra = {"kernel_options": cuda_kernel_options(layout)} if q.is_cuda else {}
    o = compiled_flex_attention()(qp, keys(k), keys(v), block_mask=make_block_mask(idx, layout), scale=scale, **extra)
    out = q.new_empty(q.shape)
    out[:, :, p:] = o
    if p:
        out[:, :, :p] = F.scaled_dot_product_attention(q[:, :, :p], k, v, scale=scale)
    return out


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w_down: torch.Tensor,
    basis_pooled: torch.Tensor,
    layout: BlockLayout,
    *,
    scale: float,
    tau: float,
    kernel: str = "gather",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole inference path (no grad): block predictor -> kept blocks -> attention.

    Args:
        w_down: (H, r, n); basis_pooled: (H, r, nb) from :func:`pooled_basis` (weights only: the
            module computes it once per weights).
        kernel: ``gather`` or ``flex`` (``flex`` runs the gather path where :func:`flex_kernel_ok`
            refuses the configuration).
    Returns:
        (out (B, H, n, d), idx (B, H, nb, keep)).
    """
    idx = predict_blocks(q, k, w_down, basis_pooled, scale=scale, tau=tau, layout=layout)
    attend = flex_block_attention if kernel == "flex" else gather_block_attention
    return attend(q, k, v, idx, layout, scale=scale), idx
