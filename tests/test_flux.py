"""Flux (003_): S1-S4 descriptors, Eq. 9 assignment, Eq. 14 start rule."""

import numpy as np
import pytest
from sklearn.metrics import adjusted_rand_score

from fedmed.algorithms.clustering import adaptive_dbscan
from fedmed.algorithms.flux import (assign_nearest, cluster_centroids, descriptor_length, flux_descriptor, latent_bounds,
                         merge_bounds, shared_pca, should_start_clustering)


def test_descriptor_length_matches_paper():
    assert descriptor_length(10, 10) == 220  # MNIST, §C.1.4
    assert descriptor_length(100, 10) == 2020  # CIFAR-100


def test_shared_pca_identical_across_parties(rng):
    lo, hi = -rng.random(64), rng.random(64)
    a, b = shared_pca(lo, hi, seed=7), shared_pca(lo.copy(), hi.copy(), seed=7)
    np.testing.assert_array_equal(a.components, b.components)
    assert a.components.shape == (10, 64)
    np.testing.assert_allclose(a.components @ a.components.T, np.eye(10), atol=1e-12)
    assert not np.allclose(shared_pca(lo, hi, seed=8).components, a.components)


def test_bounds_merge():
    b1 = latent_bounds(np.array([[0., 5.], [2., 1.]]))
    b2 = latent_bounds(np.array([[-1., 3.]]))
    lo, hi = merge_bounds([b1, b2])
    assert lo.tolist() == [-1, 1] and hi.tolist() == [2, 5]


def test_descriptor_layout_and_moments(rng):
    z = rng.normal(size=(200, 16))
    y = rng.integers(0, 3, size=200)
    y[y == 2] = 0  # class 2 absent -> zeros
    pca = shared_pca(z.min(0), z.max(0), n_components=4)
    d = flux_descriptor(z, pca, y, n_classes=3)
    proj = pca.project(z)
    assert d.full.shape == (descriptor_length(3, 4),)
    np.testing.assert_allclose(d.full[:4], proj.mean(0))
    np.testing.assert_allclose(d.full[4:8], proj.std(0))
    np.testing.assert_allclose(d.full[8:12], proj[y == 0].mean(0))
    np.testing.assert_allclose(d.full[16:20], proj[y == 1].mean(0))
    assert np.all(d.full[24:32] == 0)
    np.testing.assert_array_equal(d.label_free, d.full[:8])
    v = flux_descriptor(z, pca, y, n_classes=3, second_moment="var")
    np.testing.assert_allclose(v.full[4:8], proj.var(0))


def test_std_descriptor_distance_is_w2_for_diagonal_gaussians(rng):
    # Proposition C.1 with commuting (diagonal) covariances: ||d1 - d2|| equals W2 exactly.
    pca = shared_pca(-np.ones(8) * 50, np.ones(8) * 50, n_components=8)
    z1 = rng.normal(size=(20000, 8)) * 1.0
    z2 = rng.normal(size=(20000, 8)) * 2.0 + 0.5
    d1 = flux_descriptor(z1, pca).label_free
    d2 = flux_descriptor(z2, pca).label_free
    p1, p2 = pca.project(z1), pca.project(z2)
    w2 = np.sqrt(np.sum((p1.mean(0) - p2.mean(0)) ** 2) + np.sum((p1.std(0) - p2.std(0)) ** 2))
    assert np.linalg.norm(d1 - d2) == pytest.approx(w2, rel=1e-12)


def test_dp_noise_scale(rng):
    z = rng.uniform(0, 1, size=(500, 12))
    pca = shared_pca(np.zeros(12), np.ones(12), n_components=3)
    clean = flux_descriptor(z, pca).label_free
    noisy = np.stack([flux_descriptor(z, pca, dp_epsilon=1.0, rng=np.random.default_rng(s)).label_free
                      for s in range(3000)])
    b = pca.coordinate_range() / 500 / 1.0  # Laplace scale for means, Range/n/eps
    # Laplace(0, b) has mean absolute deviation b
    np.testing.assert_allclose(np.abs(noisy[:, :3] - clean[:3]).mean(0), b, rtol=0.08)
    with pytest.raises(ValueError, match="rng"):
        flux_descriptor(z, pca, dp_epsilon=1.0)


def test_planted_groups_cluster_and_unseen_site_assignment(rng):
    """Sites of three feature-shifted groups cluster apart; an unseen unlabeled site of group 2
    is assigned to group 2's cluster (Algorithm 2)."""
    z_dim, groups = 32, [rng.normal(size=32) * 4 for _ in range(3)]

    def site(g, n=300):
        return groups[g] + rng.normal(size=(n, z_dim)), rng.integers(0, 4, size=n)

    data = [site(g) for g in (0, 0, 0, 1, 1, 1, 2, 2, 2, 2)]
    truth = np.array([0, 0, 0, 1, 1, 1, 2, 2, 2, 2])
    lo, hi = merge_bounds([latent_bounds(z) for z, _ in data])
    pca = shared_pca(lo, hi, seed=0)
    descs = [flux_descriptor(z, pca, y, n_classes=4) for z, y in data]
    out = adaptive_dbscan(np.stack([d.full for d in descs]))
    assert adjusted_rand_score(truth, out["labels"]) == 1.0
    centroids = cluster_centroids(np.stack([d.label_free for d in descs]), out["labels"])
    unseen_z, _ = site(2, n=150)
    got = assign_nearest(flux_descriptor(unseen_z, pca).label_free, centroids)
    assert got == out["labels"][truth == 2][0]


class TestBadInput:
    def test_nan_latents_name_site(self):
        z = np.ones((5, 4))
        z[3, 2] = np.nan
        pca = shared_pca(np.zeros(4), np.ones(4), n_components=2)
        with pytest.raises(ValueError, match="hospital-7: latents contain NaN or inf in 1 of 5 samples"):
            flux_descriptor(z, pca, site="hospital-7")

    def test_empty_site(self):
        pca = shared_pca(np.zeros(4), np.ones(4), n_components=2)
        with pytest.raises(ValueError, match="no samples"):
            flux_descriptor(np.zeros((0, 4)), pca)

    def test_few_samples_warn_not_fail(self, rng):
        pca = shared_pca(np.zeros(16), np.ones(16), n_components=10)
        d = flux_descriptor(rng.random((3, 16)), pca, site="tiny")
        assert d.warnings and "3 samples < 10 descriptor dimensions" in d.warnings[0]
        assert np.isfinite(d.label_free).all()

    def test_pca_larger_than_latent(self):
        with pytest.raises(ValueError, match="n_components should be <="):
            shared_pca(np.zeros(4), np.ones(4), n_components=10)


@pytest.mark.parametrize("acc, R, expected", [
    ([0.1, 0.3], 10, False),  # r < 3
    ([0.1, 0.3, 0.5], 10, False),  # gain 0.2 >= T
    ([0.1, 0.3, 0.34], 10, True),  # gain 0.04 < 0.06
    ([0.1, 0.3, 0.5, 0.7, 0.9, 1.1, 1.3, 1.5], 10, True),  # r = 8 >= 0.8 R
    ([0.1, 0.3, 0.5, 0.7, 0.9, 1.1, 1.3], 10, False),
])
def test_start_rule_eq14(acc, R, expected):
    assert should_start_clustering(acc, R) is expected
