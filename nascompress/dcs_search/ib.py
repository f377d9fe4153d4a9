"""The information-bottleneck (IB) loss and its variational upper bound (DCS paper, section 3.3).

Pure tensor functions, no hidden state (Algorithm 1's bookkeeping lives in :mod:`nascompress.retraining.run`):

* :func:`kmeans` -- batched torch K-means (seeded k-means++ init, vectorised Lloyd steps) that
  runs on whatever device its input lives on.
* :func:`soft_assign` -- ``phi(x, a) = softmax_a(-||x - c_a||^2)``, the soft cluster memberships.
* :func:`variational_q` -- ``Q(a | y)`` of eq. (7): the mean membership of each class.
* :func:`ib_bound` -- the batch bound ``IBB_j`` of eq. (2), a differentiable loss.
* :func:`ib_loss` -- the IB loss ``I(X~; X) - I(X~; Y)`` from the cluster probabilities (a metric).
* :func:`lemma_d1_marginal_term` -- the W-independent term that Lemma D.1 proves but eq. (1)
  omits (see :func:`ib_bound`).

Notation: ``A`` clusters of the learned features X~, ``B`` clusters of the input features X,
``C`` classes (the paper takes A = B = C); ``N`` samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class KMeansResult:
    """Output of :func:`kmeans`: ``centroids`` (K, D), hard ``labels`` (N,), ``inertia`` (sum of
    squared distances to the assigned centroid) and the number of Lloyd ``iterations`` run."""

    centroids: torch.Tensor
    labels: torch.Tensor
    inertia: float
    iterations: int


def sq_dists(x: torch.Tensor, c: torch.Tensor, *, x_sq: torch.Tensor | None = None) -> torch.Tensor:
    """Squared Euclidean distances ``||x_i - c_k||^2``: x (N, D), c (K, D) -> (N, K), >= 0.

    Uses ``|x|^2 - 2 x.c + |c|^2`` (one matmul); differentiable in both arguments. ``x_sq``
    (N, 1) may pass a precomputed ``|x|^2``.
    """
    if x_sq is None:
        x_sq = (x * x).sum(-1, keepdim=True)
    d = torch.addmm(x_sq + (c * c).sum(-1).unsqueeze(0), x, c.transpose(0, 1), alpha=-2.0)
    return d.clamp_min(0.0)


def _kmeanspp(x: torch.Tensor, k: int, generator: torch.Generator, max_points: int = 8192) -> torch.Tensor:
    """k-means++ seeding: x (N, D) -> centroids (K, D). Random draws come from the CPU generator.

    Seeds from a random subsample of at most ``max_points`` points (Lloyd then uses all).
    """
    if x.shape[0] > max_points:
        x = x[torch.randperm(x.shape[0], generator=generator)[:max_points].to(x.device)]
    n = x.shape[0]
    x_sq = (x * x).sum(-1, keepdim=True)
    first = int(torch.randint(n, (1,), generator=generator))
    cents = [x[first]]
    d2 = sq_dists(x, x[first : first + 1], x_sq=x_sq).squeeze(1)  # (N,)
    for _ in range(1, k):
        total = d2.sum()
        if not total > 0:  # fewer distinct points than clusters: pick uniformly
            idx = int(torch.randint(n, (1,), generator=generator))
        else:
            u = torch.rand((), generator=generator).to(x.device, x.dtype) * total
            idx = int(torch.searchsorted(d2.cumsum(0), u.reshape(1)).clamp_max(n - 1))
        cents.append(x[idx])
        d2 = torch.minimum(d2, sq_dists(x, x[idx : idx + 1], x_sq=x_sq).squeeze(1))
    return torch.stack(cents)


@torch.no_grad()
def kmeans(
    x: torch.Tensor,
    k: int,
    *,
    iters: int = 20,
    init: str = "k-means++",
    tol: float = 1e-6,
    generator: torch.Generator | None = None,
) -> KMeansResult:
    """Cluster ``x`` (N, D) into ``k`` groups with Lloyd's algorithm, on ``x``'s device.

    Args:
        x: points (N, D), any float dtype (computed in float32 at least).
        k: number of clusters (1 <= k <= N).
        iters: maximum Lloyd iterations (each one is an (N, K) distance matmul plus a one-hot
            matmul for the means; no Python loop over points).
        init: ``"k-means++"`` (default) or ``"random"`` (k distinct points).
        tol: stop when the centroids move less than ``tol`` times the data variance.
        generator: CPU ``torch.Generator`` for the seeding draws (deterministic given its seed).

    Returns:
        :class:`KMeansResult` with centroids (K, D), labels (N,), inertia, iterations.
        An empty cluster is re-seeded at the point farthest from its current centroid.
    """
    if x.ndim != 2:
        raise ValueError(f"kmeans expects (N, D) points, got shape {tuple(x.shape)}")
    n = x.shape[0]
    if not 1 <= k <= n:
        raise ValueError(f"kmeans needs 1 <= k <= N, got k={k}, N={n}")
    g = generator if generator is not None else torch.Generator().manual_seed(0)
    x = x.detach().float() if x.dtype in (torch.float16, torch.bfloat16) else x.detach()
    if init == "k-means++":
        c = _kmeanspp(x, k, g)
    elif init == "random":
        c = x[torch.randperm(n, generator=g)[:k].to(x.device)].clone()
    else:
        raise ValueError(f"unknown init {init!r}; use 'k-means++' or 'random'")
    scale = x.var(0).sum().clamp_min(1e-12)
    x_sq = (x * x).sum(-1, keepdim=True)  # (N, 1)
    it = 0
    for it in range(1, iters + 1):
        d = sq_dists(x, c, x_sq=x_sq)  # (N, K)
        labels = d.argmin(1)  # (N,)
        onehot = torch.zeros_like(d).scatter_(1, labels[:, None], 1.0)  # (N, K); matmul beats index_add_ on CPU
        counts = onehot.sum(0)  # (K,)
        new = (onehot.transpose(0, 1) @ x) / counts.clamp_min(1).unsqueeze(1)  # (K, D)
        empty = counts == 0
        if empty.any():  # re-seed empty clusters at the worst-fitted points
            far = d.gather(1, labels[:, None]).squeeze(1).topk(int(empty.sum())).indices
            new[empty] = x[far]
        shift = (new - c).pow(2).sum()
        c = new
        if shift <= tol * scale:
            break
    d = sq_dists(x, c, x_sq=x_sq)
    labels = d.argmin(1)
    inertia = float(d.gather(1, labels[:, None]).sum())
    return KMeansResult(centroids=c, labels=labels, inertia=inertia, iterations=it)


def soft_assign(x: torch.Tensor, centroids: torch.Tensor, *, log: bool = False) -> torch.Tensor:
    """Soft memberships ``phi(x_i, a) = softmax_a(-||x_i - c_a||^2)``: x (N, D), centroids (A, D)
    -> (N, A), rows sum to 1 (``log=True`` returns ``log phi``, computed stably).

    Differentiable in ``x`` (the centroids are constants of the current epoch in Algorithm 1).
    """
    logits = -sq_dists(x, centroids.to(x.dtype))
    return F.log_softmax(logits, dim=-1) if log else F.softmax(logits, dim=-1)


def variational_q(phi: torch.Tensor, labels: torch.Tensor, num_classes: int, *, eps: float = 1e-8) -> torch.Tensor:
    """``Q(a | y) = sum_i phi(X~_i, a) 1[y_i = y] / sum_i 1[y_i = y]`` (eq. 7).

    Args:
        phi: memberships of the learned features (N, A).
        labels: class labels (N,), int in [0, C).
        num_classes: C.
        eps: floor added before renormalising, so ``log Q`` stays finite where no sample of a
            class falls in a cluster. A class with no sample gets the uniform distribution.

    Returns:
        Q (C, A), each row a distribution over clusters.
    """
    onehot = F.one_hot(labels.long(), num_classes).to(phi.dtype)  # (N, C)
    mass = onehot.transpose(0, 1) @ phi  # (C, A)
    counts = onehot.sum(0)  # (C,)
    q = torch.where(counts[:, None] > 0, mass / counts.clamp_min(1)[:, None], torch.full_like(mass, 1.0 / phi.shape[1]))
    q = q + eps
    return q / q.sum(1, keepdim=True)


def ib_bound(
    phi_feat: torch.Tensor,
    phi_in: torch.Tensor,
    labels: torch.Tensor,
    q: torch.Tensor,
    *,
    log_phi_in: torch.Tensor | None = None,
) -> torch.Tensor:
    """The batch bound ``IBB_j`` of eq. (2), averaged over the batch (a differentiable loss).

    ``IBB_j = 1/|B_j| [ sum_{i,a,b} phi(X~_i,a) phi(X_i,b) log phi(X_i,b)
                        - sum_{i,a,y} phi(X~_i,a) 1[y_i=y] log Q(a|y) ]``

    Args:
        phi_feat: memberships of the learned features, phi(X~_i, a): (N, A); gradients flow here.
        phi_in: memberships of the input features, phi(X_i, b): (N, B) (constants).
        labels: (N,) class labels in [0, C).
        q: the variational Q(a | y) of the previous epoch, (C, A), rows summing to 1.
        log_phi_in: optional ``log phi_in`` (N, B) from ``soft_assign(..., log=True)`` (stabler).

    Returns:
        A scalar tensor. Note: since ``sum_a phi(X~_i, a) = 1`` the first term equals
        ``-mean_i H(phi(X_i, .))`` and does not depend on the network; only the second (a
        cross-entropy of the memberships against ``Q(.|y_i)``) gives gradients. The paper's
        Lemma D.1 also proves a second W-independent term, ``lemma_d1_marginal_term``, that
        eq. (1) drops; ``IB <= ib_bound + lemma_d1_marginal_term`` always holds, while the
        literal ``IB <= ib_bound`` can fail when ``phi_in`` is far from one-hot.
    """
    if log_phi_in is None:
        neg_ent = torch.xlogy(phi_in, phi_in).sum(1)  # (N,) sum_b phi log phi
    else:
        neg_ent = (phi_in * log_phi_in).sum(1)
    term1 = (phi_feat.sum(1) * neg_ent).mean()  # sum_a phi(X~_i, a) (= 1) times sum_b phi log phi
    log_q = q.clamp_min(torch.finfo(q.dtype).tiny).log()  # (C, A)
    term2 = -(phi_feat * log_q.to(phi_feat.dtype)[labels.long()]).sum(1).mean()
    return term1 + term2


def lemma_d1_marginal_term(phi_in: torch.Tensor) -> torch.Tensor:
    """``-1/n^2 sum_{i,j,b} phi(X_i,b) log phi(X_j,b)`` (>= 0): phi_in (N, B) -> scalar.

    The second term of Lemma D.1's bound on ``I(X~; X)``, constant in the network weights.
    Computed as ``-sum_b mean_i phi(X_i,b) * mean_j log phi(X_j,b)`` in O(N B).
    """
    log_phi = phi_in.clamp_min(torch.finfo(phi_in.dtype).tiny).log()
    return -(phi_in.mean(0) * log_phi.mean(0)).sum()


def mutual_information(joint: torch.Tensor) -> torch.Tensor:
    """``I = sum_{u,v} p(u,v) log(p(u,v) / (p(u) p(v)))`` for a joint distribution (U, V) -> scalar (nats)."""
    joint = joint / joint.sum()
    pu, pv = joint.sum(1, keepdim=True), joint.sum(0, keepdim=True)
    return (torch.xlogy(joint, joint) - torch.xlogy(joint, pu * pv)).sum()


@torch.no_grad()
def ib_loss(phi_feat: torch.Tensor, phi_in: torch.Tensor, labels: torch.Tensor, num_classes: int) -> dict[str, float]:
    """The IB loss ``I(X~; X) - I(X~; Y)`` from the cluster probabilities of section 3.3.

    ``Pr[X~ in a, X in b] = 1/n sum_i phi(X~_i,a) phi(X_i,b)`` and
    ``Pr[X~ in a, Y = y] = 1/n sum_i phi(X~_i,a) 1[y_i = y]``.

    Args:
        phi_feat: (N, A) memberships of the learned features.
        phi_in: (N, B) memberships of the input features.
        labels: (N,) labels in [0, C).
        num_classes: C.

    Returns:
        ``{"i_xt_x": I(X~;X), "i_xt_y": I(X~;Y), "ib": I(X~;X) - I(X~;Y)}`` in nats.
    """
    n = phi_feat.shape[0]
    phi_feat, phi_in = phi_feat.double(), phi_in.double()  # sums over N samples: keep precision
    joint_ab = phi_feat.transpose(0, 1) @ phi_in / n  # (A, B)
    onehot = F.one_hot(labels.long(), num_classes).double()
    joint_ay = phi_feat.transpose(0, 1) @ onehot / n  # (A, C)
    i_x = float(mutual_information(joint_ab))
    i_y = float(mutual_information(joint_ay))
    return {"i_xt_x": i_x, "i_xt_y": i_y, "ib": i_x - i_y}


__all__ = [
    "KMeansResult",
    "kmeans",
    "sq_dists",
    "soft_assign",
    "variational_q",
    "ib_bound",
    "lemma_d1_marginal_term",
    "mutual_information",
    "ib_loss",
]
