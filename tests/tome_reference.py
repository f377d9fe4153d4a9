"""An independent reference of ToMe (Bolya et al., ICLR 2023), written from the paper's algorithm
with plain per-image loops, for the parity tests; it shares no code with nascompress.methods.tome.

Bipartite soft matching (paper section 3): alternate the tokens into A (even positions) and B
(odd positions); draw one edge from each A token to its most similar B token (cosine similarity
of the keys, mean over heads); keep the r most similar edges; merge each kept A token into its B
token by a size-weighted average; concatenate the rest. The class token (and any other prefix
token) takes no part. Proportional attention: softmax(QK^T / sqrt(d) + log s) with s the sizes.
"""

from __future__ import annotations

import torch


def merge_one_image(
    x: torch.Tensor, keys: torch.Tensor, size: torch.Tensor, r: int, prefix: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (N, C), keys (H, N, d), size (N,) of one image -> the merged (N - r', C) and sizes."""
    n = x.shape[0]
    r = min(r, (n - prefix) // 2)
    if r <= 0:
        return x, size
    metric = keys.mean(0)
    metric = metric / metric.norm(dim=-1, keepdim=True)
    a_set = [i for i in range(n) if i % 2 == 0 and i >= prefix]
    b_set = [j for j in range(n) if j % 2 == 1 and j >= prefix]
    edges = []
    for i in a_set:
        sims = torch.stack([metric[i] @ metric[j] for j in b_set])
        j = b_set[int(sims.argmax())]
        edges.append((float(sims.max()), i, j))
    edges.sort(key=lambda e: -e[0])
    weighted = {i: x[i] * size[i] for i in range(n)}
    sizes = {i: size[i] for i in range(n)}
    gone = set()
    for _, i, j in edges[:r]:
        weighted[j] = weighted[j] + weighted[i]
        sizes[j] = sizes[j] + sizes[i]
        gone.add(i)
    order = (
        list(range(prefix))
        + [i for i in range(prefix, n) if i % 2 == 0 and i not in gone]
        + [j for j in range(prefix, n) if j % 2 == 1]
    )
    new_size = torch.stack([sizes[i] for i in order])
    return torch.stack([weighted[i] for i in order]) / new_size[:, None], new_size


def merge_batch(x: torch.Tensor, keys: torch.Tensor, size: torch.Tensor, r: int, prefix: int):
    """:func:`merge_one_image` over a batch: x (B, N, C), keys (B, H, N, d), size (B, N)."""
    outs = [merge_one_image(x[b], keys[b], size[b], r, prefix) for b in range(x.shape[0])]
    return torch.stack([o[0] for o in outs]), torch.stack([o[1] for o in outs])


def tome_forward(model, x: torch.Tensor, r: list[int], *, prop_attn: bool = True) -> torch.Tensor:
    """A plain timm ViT's forward written out with ToMe merging ``r[i]`` tokens after block i's
    attention (explicit attention matrices, the model's own weights)."""
    p = model.num_prefix_tokens
    t = model._pos_embed(model.patch_embed(x))
    size = t.new_ones(t.shape[0], t.shape[1])
    for i, blk in enumerate(model.blocks):
        a = blk.attn
        B, N, C = t.shape
        q, k, v = a.qkv(blk.norm1(t)).reshape(B, N, 3, a.num_heads, a.head_dim).permute(2, 0, 3, 1, 4)
        q, k = a.q_norm(q), a.k_norm(k)
        logits = (q * a.head_dim**-0.5) @ k.transpose(-2, -1)
        if prop_attn:
            logits = logits + size.log()[:, None, None, :]
        o = (logits.softmax(-1) @ v).transpose(1, 2).reshape(B, N, C)
        t = t + blk.ls1(a.proj(o))
        if r[i] > 0:
            t, size = merge_batch(t, k, size, r[i], p)
        t = t + blk.ls2(blk.mlp(blk.norm2(t)))
    return model.forward_head(model.norm(t))
