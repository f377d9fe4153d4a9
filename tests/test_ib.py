"""The IB loss, its variational bound IBB (DCS paper, section 3.3, Appendix D) and K-means."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from sklearn.cluster import KMeans
from sklearn.metrics import adjusted_rand_score

from nascompress.dcs_search.ib import (
    ib_bound,
    ib_loss,
    kmeans,
    lemma_d1_marginal_term,
    mutual_information,
    soft_assign,
    variational_q,
)

from .conftest import TORCH_DEVICE


def blobs(seed: int, n: int = 600, k: int = 10, d: int = 16, spread: float = 10.0):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(k, d, generator=g) * spread
    labels = torch.arange(n) % k
    return centers[labels] + torch.randn(n, d, generator=g), labels


def memberships(xt: torch.Tensor, x: torch.Tensor, y: torch.Tensor, c: int, seed: int):
    """phi of learned and input features from fresh K-means, and Q of eq. (7) (the paper's recipe)."""
    ca = kmeans(xt, c, generator=torch.Generator().manual_seed(seed)).centroids
    cb = kmeans(x, c, generator=torch.Generator().manual_seed(seed + 1)).centroids
    phi_f, phi_i = soft_assign(xt, ca), soft_assign(x, cb)
    return phi_f, phi_i, variational_q(phi_f, y, c)


@pytest.mark.parametrize("init", ["k-means++", "random"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kmeans_recovers_separable_blobs(seed, init):
    x, labels = blobs(seed)
    res = kmeans(x, 10, init=init, generator=torch.Generator().manual_seed(seed))
    if init == "k-means++":  # random init may merge two blobs; k-means++ on well-separated blobs must not
        assert adjusted_rand_score(labels.numpy(), res.labels.numpy()) == pytest.approx(1.0)
    sk = KMeans(10, n_init=10, random_state=seed).fit(x.numpy())
    assert res.inertia >= sk.inertia_ * (1 - 1e-4)  # sklearn's best-of-10 is a floor
    if init == "k-means++":
        assert res.inertia == pytest.approx(sk.inertia_, rel=1e-4)
    assert res.centroids.shape == (10, 16) and res.labels.shape == (600,)


def test_kmeans_is_seeded_and_handles_duplicates():
    x, _ = blobs(3)
    a = kmeans(x, 10, generator=torch.Generator().manual_seed(7))
    b = kmeans(x, 10, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(a.centroids, b.centroids, rtol=0, atol=0)
    same = torch.ones(20, 4)  # fewer distinct points than clusters: no NaN, no crash
    r = kmeans(same, 5)
    assert torch.isfinite(r.centroids).all() and r.inertia == pytest.approx(0.0)
    with pytest.raises(ValueError, match="1 <= k <= N"):
        kmeans(same, 21)


@pytest.mark.skipif(TORCH_DEVICE == "cpu" or not torch.cuda.is_available(), reason="needs TORCH_DEVICE=cuda")
def test_kmeans_runs_on_the_input_device():
    x, _ = blobs(0)
    res = kmeans(x.to(TORCH_DEVICE), 10)
    assert res.centroids.device.type == "cuda" and res.labels.device.type == "cuda"


def test_soft_assign_variational_q_and_ib_loss_against_direct_formulas():
    g = torch.Generator().manual_seed(0)
    xt, x, c = torch.randn(50, 4, generator=g), torch.randn(50, 3, generator=g), torch.randn(5, 4, generator=g)
    y = torch.randint(3, (50,), generator=g)
    phi = soft_assign(xt, c)
    d = ((xt[:, None, :] - c[None]) ** 2).sum(-1)
    torch.testing.assert_close(phi, torch.softmax(-d, -1))
    torch.testing.assert_close(soft_assign(xt, c, log=True).exp(), phi)
    q = variational_q(phi, y, 3, eps=0.0)
    for cls in range(3):
        torch.testing.assert_close(q[cls], phi[y == cls].mean(0))
    # ib_loss against a NumPy evaluation of section 3.3's probabilities
    phi_in = soft_assign(x, torch.randn(4, 3, generator=g))
    pf, pi = phi.double().numpy(), phi_in.double().numpy()
    p_ab = pf.T @ pi / 50
    p_ay = np.stack([pf[y.numpy() == k].sum(0) / 50 for k in range(3)], 1)

    def mi(p):
        pu, pv = p.sum(1, keepdims=True), p.sum(0, keepdims=True)
        return float((p * np.log(p / (pu * pv))).sum())

    res = ib_loss(phi, phi_in, y, 3)
    assert res["i_xt_x"] == pytest.approx(mi(p_ab), rel=1e-6)
    assert res["i_xt_y"] == pytest.approx(mi(p_ay), rel=1e-6)
    assert res["ib"] == pytest.approx(mi(p_ab) - mi(p_ay), rel=1e-6)
    # perfectly label-aligned one-hot memberships: I(X~;Y) = H(Y) = log 3 for balanced labels
    yy = torch.arange(90) % 3
    assert ib_loss(torch.eye(3)[yy], torch.full((90, 3), 1 / 3), yy, 3)["i_xt_y"] == pytest.approx(math.log(3))
    assert float(mutual_information(torch.full((3, 4), 1 / 12))) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("seed", range(8))
def test_theorem_3_1_ib_below_ibb_on_random_features(seed):
    """IB <= IBB (eq. 1) with the paper's recipe: fresh K-means, A = B = C, Q from eq. (7)."""
    g = torch.Generator().manual_seed(seed)
    n, c = 300, 10
    xt, x = torch.randn(n, 24, generator=g), torch.randn(n, 49, generator=g)
    y = torch.randint(c, (n,), generator=g)
    phi_f, phi_i, q = memberships(xt, x, y, c, seed)
    ib = ib_loss(phi_f, phi_i, y, c)["ib"]
    assert ib <= float(ib_bound(phi_f, phi_i, y, q)) + 1e-6
    # Lemma D.2 holds for any variational Q, not only eq. (7)'s
    q_any = -torch.rand(c, c, generator=g).log()  # Dirichlet(1) rows
    q_any = q_any / q_any.sum(1, keepdim=True)
    assert ib <= float(ib_bound(phi_f, phi_i, y, q_any)) + 1e-6


@pytest.mark.parametrize("scale", [0.02, 0.1, 0.3, 1.0, 5.0])
@pytest.mark.parametrize("seed", range(4))
def test_appendix_d_bound_holds_at_every_feature_scale(seed, scale):
    """IB <= IBB + Lemma D.1's marginal term (what Appendix D proves) for soft and hard memberships."""
    g = torch.Generator().manual_seed(100 + seed)
    n, c = 200, 6
    xt, x = torch.randn(n, 8, generator=g) * scale, torch.randn(n, 12, generator=g) * scale
    y = torch.randint(c, (n,), generator=g)
    phi_f, phi_i, q = memberships(xt, x, y, c, seed)
    ib = ib_loss(phi_f, phi_i, y, c)["ib"]
    assert ib <= float(ib_bound(phi_f, phi_i, y, q) + lemma_d1_marginal_term(phi_i)) + 1e-6


def test_literal_eq1_can_fail_without_the_lemma_d1_term():
    """A counterexample to eq. (1) as printed: every X~ in one cluster, X memberships uniform.

    IB = 0 - 0 = 0 but IBB = -log B < 0; adding Lemma D.1's dropped (W-independent) term, log B,
    restores the bound. Training is unaffected (the term has no gradient)."""
    n, c = 40, 4
    y = torch.arange(n) % c
    phi_f = torch.zeros(n, c)
    phi_f[:, 0] = 1.0
    phi_i = torch.full((n, c), 1.0 / c)
    q = variational_q(phi_f, y, c)
    ib = ib_loss(phi_f, phi_i, y, c)["ib"]
    ibb = float(ib_bound(phi_f, phi_i, y, q))
    assert ib == pytest.approx(0.0, abs=1e-6) and ibb == pytest.approx(-math.log(c), abs=1e-4)
    assert ib > ibb
    assert ib <= ibb + float(lemma_d1_marginal_term(phi_i)) + 1e-6


def test_ibb_decreases_as_features_separate_the_classes():
    c, n = 10, 400
    values = []
    for s in (0.0, 0.5, 1.0, 2.0, 4.0):
        g = torch.Generator().manual_seed(0)
        y = torch.arange(n) % c
        means, noise, x = (
            torch.randn(c, 16, generator=g),
            torch.randn(n, 16, generator=g),
            torch.randn(n, 12, generator=g),
        )
        phi_f, phi_i, q = memberships(means[y] * s + noise, x, y, c, 0)
        values.append(float(ib_bound(phi_f, phi_i, y, q)))
    assert all(b <= a + 1e-6 for a, b in zip(values, values[1:])), values
    assert values[-1] < values[0] - 1.0, values


def test_ib_bound_is_differentiable_and_its_gradient_separates_classes():
    """Gradient steps on IBB alone (fixed centroids and Q, as within an epoch) lower it."""
    c, n = 4, 200
    g = torch.Generator().manual_seed(1)
    y = torch.arange(n) % c
    feats = (torch.randn(c, 6, generator=g)[y] * 0.7 + torch.randn(n, 6, generator=g)).requires_grad_(True)
    x = torch.randn(n, 5, generator=g)
    phi_f, phi_i, q = memberships(feats.detach(), x, y, c, 1)
    centroids = kmeans(feats.detach(), c, generator=torch.Generator().manual_seed(1)).centroids
    opt = torch.optim.SGD([feats], lr=0.5)
    first = None
    for _ in range(30):
        loss = ib_bound(soft_assign(feats, centroids), phi_i, y, q)
        first = first if first is not None else float(loss.detach())
        opt.zero_grad()
        loss.backward()
        assert torch.isfinite(feats.grad).all() and feats.grad.abs().sum() > 0
        opt.step()
    assert float(ib_bound(soft_assign(feats.detach(), centroids), phi_i, y, q)) < first - 0.05
