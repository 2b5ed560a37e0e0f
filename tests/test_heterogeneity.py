import numpy as np
import pytest
from scipy.linalg import orth

from fedmed.algorithms.baselines import fecfl_distance_matrix, fecfl_signature, pacfl_distance_matrix, pacfl_signature
from fedmed.algorithms.heterogeneity import (emd_1d, emd_matrix, embedding_distance_matrix, metadata_histogram,
                                  pca2_embedding)


def test_emd_known_values():
    assert emd_1d([0, 0], [1, 1]) == pytest.approx(1.0)
    assert emd_1d([0, 1, 3], [5, 6, 8]) == pytest.approx(5.0)


def test_histogram_emd_within_one_bin_width(rng):
    sites = [rng.gamma(2.0, s, size=40) for s in (1.0, 1.5, 3.0)]
    edges = np.linspace(0, max(v.max() for v in sites) + 1e-9, 65)
    exact = emd_matrix(sites)
    binned = emd_matrix([metadata_histogram(v, edges) for v in sites], edges=edges)
    width = edges[1] - edges[0]
    assert np.abs(exact - binned).max() <= width
    assert np.argmax(exact.sum(0)) == np.argmax(binned.sum(0)) == 2


def test_emd_matrix_errors():
    with pytest.raises(ValueError, match="FLAIR: b has no values"):
        emd_matrix([[1.0], []], site_names=["a", "b"], feature="FLAIR")


def test_pca2_embedding_shape_and_sign(rng):
    fmap = rng.normal(size=(512, 4, 4, 4))
    v = pca2_embedding(fmap)
    assert v.shape == (1024,)
    np.testing.assert_allclose(pca2_embedding(fmap), v)
    # scores equal sklearn's PCA scores up to sign
    from sklearn.decomposition import PCA
    ref = PCA(2, svd_solver="full").fit_transform(fmap.reshape(512, -1))
    np.testing.assert_allclose(np.abs(v.reshape(512, 2)), np.abs(ref), atol=1e-8)
    assert np.abs(v.reshape(512, 2)[:, 0]).argmax() == v.reshape(512, 2)[:, 0].argmax()  # largest score positive


def test_embedding_distance_centroid_and_order_invariance(rng):
    a = rng.normal(size=(5, 8))
    b = rng.normal(size=(9, 8)) + 2
    D = embedding_distance_matrix([a, b])
    assert D[0, 1] == pytest.approx(np.linalg.norm(a.mean(0) - b.mean(0)))
    assert embedding_distance_matrix([a[::-1], b])[0, 1] == pytest.approx(D[0, 1])
    Dp = embedding_distance_matrix([a, b], mode="pairwise")
    assert Dp[0, 1] >= D[0, 1]
    with pytest.raises(ValueError, match="share one dimension"):
        embedding_distance_matrix([a, rng.normal(size=(3, 7))])


def test_pacfl_principal_angles(rng):
    B = orth(rng.normal(size=(20, 3)))
    C = orth(rng.normal(size=(20, 3)))
    D = pacfl_distance_matrix([B, B @ orth(rng.normal(size=(3, 3))), C])
    assert D[0, 1] == pytest.approx(0.0, abs=1e-5) and D[0, 2] > 1.0
    X = rng.normal(size=(30, 20))
    sig = pacfl_signature(X, np.repeat([0, 1, 2], 10), n_basis=2)
    assert sig.shape == (20, 6)


def test_fecfl_cosine(rng):
    m = [fecfl_signature(np.array([[1.0, 0.0], [1.0, 0.0]])), np.array([0.0, 2.0]), np.array([3.0, 0.0])]
    D = fecfl_distance_matrix(m)
    assert D[0, 1] == pytest.approx(1.0) and D[0, 2] == pytest.approx(0.0)
    with pytest.raises(ValueError, match="site-2: mean embedding is all zeros"):
        fecfl_distance_matrix([np.ones(2), np.zeros(2)])


def test_vectorised_emd_matrix_equals_the_scipy_loop(rng):
    """Every changed computation gives the same result: the all-pairs CDF form vs scipy per pair (1e-12)."""
    from scipy.stats import wasserstein_distance

    from fedmed.algorithms.heterogeneity import emd_matrix

    vals = [rng.normal(loc=rng.uniform(-2, 2), size=rng.integers(3, 40)) for _ in range(9)]
    loop = np.array([[wasserstein_distance(a, b) for b in vals] for a in vals])
    np.testing.assert_allclose(emd_matrix(vals), loop, rtol=1e-12, atol=1e-12)
    edges = np.linspace(-5, 5, 31)
    hists = [np.histogram(v, bins=edges)[0].astype(float) for v in vals]
    centres = (edges[:-1] + edges[1:]) / 2
    loop_h = np.array([[wasserstein_distance(centres, centres, a, b) for b in hists] for a in hists])
    np.testing.assert_allclose(emd_matrix(hists, edges=edges), loop_h, rtol=1e-12, atol=1e-12)


def test_blocked_threaded_weighted_l1_equals_pdist(rng):
    """The blocked, two-thread all-pairs L1 (constant columns dropped, upper triangle mirrored) is pdist's matrix."""
    from scipy.spatial.distance import pdist, squareform

    from fedmed.algorithms.heterogeneity import _pairwise_weighted_l1

    F = np.cumsum(rng.dirichlet(np.ones(12), size=53), axis=1)
    F[:, :3] = 0.0  # columns every row shares: dropped, must not change the result
    widths = rng.uniform(0.5, 2.0, size=12)
    want = squareform(pdist(F, "minkowski", p=1, w=widths))
    for block in (1, 7, 53, 512):
        got = _pairwise_weighted_l1(F, widths, block=block)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)
        assert np.array_equal(got, got.T) and not np.diag(got).any()
    assert _pairwise_weighted_l1(F[:1], widths).shape == (1, 1)
    assert not _pairwise_weighted_l1(np.ones((4, 3)), np.ones(3)).any()
