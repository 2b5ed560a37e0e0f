"""DP mechanisms of fedmed.algorithms.privacy, checked against independent computations."""

import numpy as np
import pytest
from scipy.stats import norm

from fedmed.algorithms.privacy import analytic_gaussian_sigma, private_histogram, private_mean, signature_payload


def gaussian_delta(sigma, sens, eps):
    """delta(eps) of the Gaussian mechanism (Balle & Wang 2018, Thm 8), written with scipy.stats."""
    a, b = sens / (2 * sigma), eps * sigma / sens
    return norm.cdf(a - b) - np.exp(eps) * norm.cdf(-a - b)


@pytest.mark.parametrize("eps", [0.1, 1.0, 10.0])
def test_analytic_gaussian_sigma_is_the_smallest_that_meets_delta(eps):
    s = analytic_gaussian_sigma(2.0, eps, 1e-5)
    assert gaussian_delta(s, 2.0, eps) <= 1e-5 * (1 + 1e-6)
    assert gaussian_delta(0.99 * s, 2.0, eps) > 1e-5
    if eps < 1:  # tighter than the classical bound where that bound holds
        assert s <= 2.0 * np.sqrt(2 * np.log(1.25 / 1e-5)) / eps


def test_private_mean_noise_matches_its_sensitivity(rng):
    X = rng.normal(size=(40, 6)) * 5
    clean, _ = private_mean(X, clip=1.0, epsilon=None, delta=1e-5, rng=rng)
    assert np.linalg.norm(X, axis=1).max() > 1 and np.allclose(clean, (X / np.linalg.norm(X, axis=1, keepdims=True)).mean(0))
    draws = np.stack([private_mean(X, clip=1.0, epsilon=1.0, delta=1e-5, rng=np.random.default_rng(s))[0]
                      for s in range(3000)]) - clean
    _, rec = private_mean(X, clip=1.0, epsilon=1.0, delta=1e-5, rng=rng)
    assert rec["l2_sensitivity"] == pytest.approx(2 * 1.0 / 40)
    assert draws.std() == pytest.approx(analytic_gaussian_sigma(2 / 40, 1.0, 1e-5), rel=0.05)


def test_histogram_laplace_scale(rng):
    h = np.array([10.0, 20.0, 30.0])
    draws = np.stack([private_histogram(h, epsilon=0.5, rng=np.random.default_rng(s))[0] for s in range(4000)])
    assert np.abs(draws - h).mean() == pytest.approx(2 / 0.5, rel=0.05)  # Laplace(b = 2/eps): mean |noise| = b


def test_fmcl_signature_with_dp_records_what_it_spent(rng):
    feats = rng.normal(size=(60, 8))
    y = np.repeat([0, 1, 2], 20)
    out = signature_payload("fmcl", feats, y, k_min=5, privacy={"dp_epsilon": 2.0, "dp_delta": 1e-5, "clip": 1.0},
                            rng=rng)
    rel = out["dp"]["releases"]
    assert len(rel) == 4 and sum(r["epsilon"] for r in rel) == pytest.approx(2.0)  # 3 means + counts
    assert out["dp"]["epsilon"] == 2.0 and out["means"].shape == (3, 8)
    plain = signature_payload("fmcl", feats, y, k_min=5, privacy={})
    assert not np.allclose(out["means"], plain["means"])
