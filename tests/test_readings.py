"""Each reading of docs/readings.md pinned by a test that would fail under the other reading, or checked
against an independent computation (not the code's own formula)."""

import itertools

import numpy as np
import pytest
from scipy.cluster.hierarchy import linkage
from scipy.spatial.distance import squareform

from fedmed.algorithms.baselines import pacfl_distance_matrix
from fedmed.algorithms.clustering import agglomerative, auto_k
from fedmed.algorithms.flux import flux_descriptor, shared_pca, should_start_clustering
from fedmed.data.partition import dirichlet_label_partition


# ----------------------------------------------------------------------------------------- Flux Eq. 14
from fedmed.data.anda import SiteShift, apply_anda_transform

def test_start_rule_curve_separates_the_paper_from_the_official_code():
    """Round 2 gained little (0.02 < T) and rounds 3-4 gained a lot: the official code (which counts the round-2 gain)
    starts clustering at round 3, the paper's Eq. 14 (gains of rounds 3..r only) does not."""
    acc = [0.50, 0.52, 0.70, 0.85]
    assert should_start_clustering(acc[:3], 10, rule="official") is True
    assert should_start_clustering(acc[:3], 10, rule="paper") is False
    assert should_start_clustering(acc[:4], 10, rule="paper") is False
    assert should_start_clustering(acc + [0.86], 10, rule="paper") is True  # gain 0.01 < T at round 5
    assert should_start_clustering([0.5] * 8, 10, rule="paper") is True  # r >= 0.8 R


# ----------------------------------------------------------------------------------------- Flux W2 (Prop. C.1)

def _w2_squared_1d(a, b):
    """W2^2 between two 1-D samples of the same size from their quantile functions (sorted samples)."""
    return float(np.mean((np.sort(a) - np.sort(b)) ** 2))


def test_std_descriptor_distance_equals_w2_computed_independently(rng):
    """||d1' - d2'||^2 of the label-free descriptors is the sum over PCA coordinates of the squared 2-Wasserstein
    distance between the two sites' projected samples — checked against W2 computed from quantile functions, not
    through the descriptor code."""
    z = 6
    lo, hi = np.zeros(z), np.ones(z) * 4
    pca = shared_pca(lo, hi, n_components=3, seed=0)
    n = 20000
    a = rng.normal(1.5, 0.3, size=(n, z))
    b = rng.normal(2.2, 0.6, size=(n, z))
    d1 = flux_descriptor(a, pca).label_free
    d2 = flux_descriptor(b, pca).label_free
    pa, pb = pca.project(a), pca.project(b)
    w2 = sum(_w2_squared_1d(pa[:, j], pb[:, j]) for j in range(3))
    assert np.sum((d1 - d2) ** 2) == pytest.approx(w2, rel=0.02)


# ----------------------------------------------------------------------------------------- Flux DP (App. C.2)

def test_dp_noise_scale_is_the_papers_sensitivity_computed_from_the_box_corners(rng):
    """The Laplace scale of each descriptor entry is Range(g_i) / (n epsilon). Range(g_i) is computed here
    independently: the projection of every corner of the box (a linear map attains its extremes at corners)."""
    z, l, n, eps = 4, 2, 50, 0.5
    lo, hi = np.array([0.0, 0.5, 0.0, 1.0]), np.array([2.0, 1.5, 3.0, 2.0])
    pca = shared_pca(lo, hi, n_components=l, seed=3)
    corners = np.array(list(itertools.product(*zip(lo, hi))))
    proj = (corners - pca.mean) @ pca.components.T
    rng_g = proj.max(0) - proj.min(0)
    lat = rng.uniform(lo, hi, size=(n, z))
    clean = flux_descriptor(lat, pca).label_free
    draws = np.stack([flux_descriptor(lat, pca, dp_epsilon=eps, rng=np.random.default_rng(s)).label_free - clean
                      for s in range(4000)])
    # Laplace(0, b): mean absolute deviation = b; the same scale for the mean and the std entries
    expected = np.r_[rng_g, rng_g] / (n * eps)
    np.testing.assert_allclose(np.abs(draws).mean(0), expected, rtol=0.06)


# ----------------------------------------------------------------------------------------- PACFL

def test_pacfl_principal_angles_hand_computed():
    """span{e1} vs span{(cos t, sin t, 0)} meet at angle t; span{e1, e2} vs span{e3} at 90 degrees."""
    t = np.deg2rad(30.0)
    a = np.array([[1.0], [0.0], [0.0]])
    b = np.array([[np.cos(t)], [np.sin(t)], [0.0]])
    c = np.array([[0.0], [0.0], [1.0]])
    D = pacfl_distance_matrix([a, b, c])
    assert D[0, 1] == pytest.approx(30.0) and D[0, 2] == pytest.approx(90.0) and D[1, 2] == pytest.approx(90.0)


def test_pacfl_official_angle_depends_on_the_sign_of_a_singular_vector():
    """The official code's arccos of single entries of U_i^T U_j changes when a basis vector flips sign (which an
    SVD is free to do); the principal angle does not."""
    t = np.deg2rad(30.0)
    a = np.array([[1.0], [0.0], [0.0]])
    b = np.array([[np.cos(t)], [np.sin(t)], [0.0]])
    for mode, same in (("smallest", True), ("official", False)):
        d_pos = pacfl_distance_matrix([a, b], mode=mode)[0, 1]
        d_neg = pacfl_distance_matrix([a, -b], mode=mode)[0, 1]
        assert bool(d_pos == pytest.approx(d_neg)) is same
    assert pacfl_distance_matrix([a, -b], mode="official")[0, 1] == pytest.approx(150.0)


def test_weighted_linkage_is_wpgma_not_upgma():
    """PACFL's code merges by averaging the two merged rows (WPGMA, scipy 'weighted'); UPGMA averages all member
    pairs. On this matrix the third merge height differs, and so does the threshold clustering."""
    D = np.array([[0, 1, 4, 10], [1, 0, 6, 10], [4, 6, 0, 11], [10, 10, 11, 0]], float)
    zu = linkage(squareform(D), "average")
    zw = linkage(squareform(D), "weighted")
    assert zu[1, 2] == pytest.approx(5.0) and zw[1, 2] == pytest.approx(5.0)  # ({0,1}, 2): (4 + 6) / 2 both
    assert zu[2, 2] == pytest.approx((10 + 10 + 11) / 3) and zw[2, 2] == pytest.approx(((10 + 10) / 2 + 11) / 2)
    t = 10.4  # between the two final heights (UPGMA 10.33, WPGMA 10.5)
    assert agglomerative(D, threshold=t, linkage_method="average").max() == 0  # one cluster
    assert agglomerative(D, threshold=t, linkage_method="weighted").max() == 1  # two clusters


# ----------------------------------------------------------------------------------------- FMCL auto-K

def test_auto_k_accepts_a_peak_at_the_windows_first_value():
    """Three tight groups among ten sites (CV window {3..10}). The best silhouette is at K = 3, the window's first
    value. The literal reading (peaks strictly inside the window) cannot pick it; fedmed's reading compares K = 3
    with its neighbours on the silhouette curve, S(2) and S(4)."""
    x = np.r_[np.zeros(4), np.full(3, 10.0), np.full(3, 30.0)] + np.arange(10) * 0.05
    D = np.abs(x[:, None] - x[None])
    res = auto_k(D, k1_silhouette=None)
    assert res.window[0] == 3 and 3 in res.local_maxima and res.k == 3
    literal = [k for a, k, b in zip(res.window, res.window[1:], res.window[2:])
               if res.scores[k] > res.scores[a] and res.scores[k] > res.scores[b]]
    assert 3 not in literal  # the interior-only reading would not even consider it


def test_auto_k_keeps_one_cluster_without_structure(rng):
    """Sites drawn from one distribution: the paper's rule (S(1) = 0) always splits; the K = 1 test keeps them."""
    X = rng.normal(size=(20, 8))
    D = np.sqrt(((X[:, None] - X[None]) ** 2).sum(-1))
    assert auto_k(D, k1_silhouette=None).k > 1
    res = auto_k(D)
    assert res.k == 1 and "one cluster" in res.rule


# ----------------------------------------------------------------------------------------- ANDA colour

def test_anda_colour_readings():
    img = np.full((4, 4), 100, np.uint8)
    spec = SiteShift(indices=np.arange(1), group=0, color="red")
    ours, _ = apply_anda_transform(img, 0, spec, colour="channel")
    anda, _ = apply_anda_transform(img, 0, spec, colour="anda")
    assert ours[..., 0].max() == 100 and ours[..., 1:].max() == 0  # gray in red, nothing elsewhere
    assert anda[..., 0].min() == 255 and (anda[..., 1:] == 100).all()  # red full, gray kept elsewhere


# ----------------------------------------------------------------------------------------- Dirichlet

def _classes_per_site(parts, y):
    return np.array([len(np.unique(y[p])) for p in parts])


def test_dirichlet_schemes_differ_in_scale():
    """At alpha = 1 on 10 balanced classes Hsu's Dir(alpha p) leaves ~4 classes per site, FedLab's per-client
    Dir(alpha) ~9-10."""
    y = np.repeat(np.arange(10), 200)
    hsu = _classes_per_site(dirichlet_label_partition(y, 20, 1.0, 0, mode="per-site"), y).mean()
    fedlab = _classes_per_site(dirichlet_label_partition(y, 20, 1.0, 0, mode="per-client"), y).mean()
    assert hsu < 6 < 8.5 < fedlab


def test_dirichlet_last_sites_are_not_more_skewed():
    """Filling sites one after the other leaves the last sites with leftovers; taking turns does not."""
    y = np.repeat(np.arange(10), 100)
    first, last = [], []
    for seed in range(10):
        cps = _classes_per_site(dirichlet_label_partition(y, 20, 1.0, seed, mode="per-client"), y)
        first.append(cps[:10].mean())
        last.append(cps[10:].mean())
    assert abs(np.mean(first) - np.mean(last)) < 0.5


def test_flux_scaling_raw_vs_minmax_changes_which_dimension_decides(rng):
    """The paper clusters raw descriptors; the official code min-max scales each dimension first. A dimension
    with a tiny range but a clean two-group split decides the minmax clustering and is noise to the raw one."""
    from fedmed.algorithms.clustered import flux_cluster

    n = 12
    groups = np.repeat([0, 1], n // 2)
    big = rng.normal(0, 5.0, n)  # large-range noise
    small = groups * 1e-3 + rng.normal(0, 1e-5, n)  # tiny-range, perfectly split
    desc = {f"s{i:02d}": {"full": [big[i], small[i]], "label_free": [big[i]]} for i in range(n)}
    raw = flux_cluster(desc, n_clusters=2, scaling="none", seed=0)
    mm = flux_cluster(desc, n_clusters=2, scaling="minmax", seed=0)
    truth = [f"s{i:02d}" for i in range(n) if groups[i] == 1]
    assert truth in mm["clusters"] or sorted(set(desc) - set(truth)) in mm["clusters"]
    assert truth not in raw["clusters"]


def test_flux_box_elementwise_vs_the_codes_scalar_box(rng):
    """S1: fedmed sends per-coordinate bounds (means of the k_min extremes); the official code one scalar box
    [0, 1.02 max] for all coordinates."""
    from fedmed.algorithms.privacy import private_bounds

    z = np.abs(rng.normal(0, 1, (40, 3))) * np.array([1.0, 10.0, 100.0])
    lo, hi, _ = private_bounds(z, k_min=5, privacy={})
    lo_s, hi_s, _ = private_bounds(z, k_min=5, privacy={}, box="scalar")
    srt = np.sort(z, axis=0)
    np.testing.assert_allclose(hi, srt[-5:].mean(axis=0))
    np.testing.assert_allclose(lo, srt[:5].mean(axis=0))
    assert np.all(lo_s == 0) and np.allclose(hi_s, 1.02 * hi.max())
    assert hi[0] < 0.2 * hi_s[0]  # the scalar box is two orders too wide for the first coordinate


def test_flux_absent_class_zeros_vs_minus_one(rng):
    """A class the site does not hold (or, in the code, holds once) fills its slot with 0 (fedmed) or -1."""
    from fedmed.algorithms.flux import flux_descriptor, shared_pca

    z = np.abs(rng.normal(0, 1, (30, 6)))
    pca = shared_pca(np.zeros(6), np.full(6, 4.0), n_components=2, seed=0)
    y = np.r_[np.zeros(29, int), [1]]  # class 1: one sample; class 2: absent
    d0 = flux_descriptor(z, pca, y, n_classes=3, k_min=1, absent="zeros")
    d1 = flux_descriptor(z, pca, y, n_classes=3, k_min=1, absent="minus_one")
    full0, full1 = np.asarray(d0.full), np.asarray(d1.full)
    assert full0.shape == full1.shape
    slot = full0.size // 4  # marginal + 3 class blocks, each mean and second moment of 2 components
    assert np.all(full0[-slot:] == 0) and np.all(full1[-slot:] == -1)  # class 2 absent
    assert not np.all(full0[-2 * slot:-slot] == 0)  # one-sample class 1 is kept by fedmed (k_min=1) ...
    assert np.all(full1[-2 * slot:-slot] == -1)  # ... and -1 in the code


def test_ifca_unchosen_model_is_refilled_only_when_every_site_answered():
    """IFCA: a model no site chose stays unchanged in the paper; fedmed sets it to the round's average of all
    updates when every site answered (so alike sites that alternate between two models lose no rounds), and
    keeps it under partial participation (its sites may just not have been sampled)."""
    from fedmed.algorithms.aggregation import ifca_models

    m0, m1 = {"w": np.zeros(2)}, {"w": np.full(2, 9.0)}
    ups = [{"w": np.array([1.0, 1.0])}, {"w": np.array([3.0, 3.0])}]
    kept, r = ifca_models([m0, m1], ups, [1, 1], [0, 0], empty="keep")
    assert r == [] and np.allclose(kept[0]["w"], 2.0) and np.allclose(kept[1]["w"], 9.0)  # the paper: stale
    new, r = ifca_models([m0, m1], ups, [1, 1], [0, 0], empty="global")
    assert r == [1] and np.allclose(new[1]["w"], 2.0) and np.allclose(new[0]["w"], 2.0)
    part, r = ifca_models([m0, m1], ups, [1, 1], [0, 0], empty="global", all_answered=False)
    assert r == [] and np.allclose(part[1]["w"], 9.0)
    both, r = ifca_models([m0, m1], ups, [1, 3], [0, 1], empty="global")
    assert r == [] and np.allclose(both[0]["w"], 1.0) and np.allclose(both[1]["w"], 3.0)
    with pytest.raises(ValueError, match="empty should be"):
        ifca_models([m0], ups, [1, 1], [0, 0], empty="stale")


def test_k1_threshold_is_kaufman_rousseeuws_reasonable_structure_not_their_no_structure():
    """The K = 1 threshold: 0.5 (K & R: 0.26-0.50 'weak, could be artificial'), not 0.25 ('no substantial
    structure'). Uniform points in the plane have weak structure (S(K*) in 0.39-0.49): 0.25 splits them, 0.5 keeps
    them; three planted groups (S >= 0.5) are kept apart under both. Measured on BUSI with FMCL's signatures
    (no-shift table): IID federations S(K*) = 0.34-0.38, Dirichlet(0.1) label skew 0.62-0.83."""
    from scipy.spatial.distance import cdist

    for seed in range(6):
        X = np.random.default_rng(seed).uniform(size=(20, 2))
        D = cdist(X, X)
        lit = auto_k(D, k1_silhouette=None)
        assert 0.25 < lit.scores[lit.k] < 0.5
        assert auto_k(D, k1_silhouette=0.25).k == lit.k > 1
        assert auto_k(D).k == 1
    rng = np.random.default_rng(0)
    X = np.r_[rng.normal(0, 1, (7, 2)), rng.normal(8, 1, (7, 2)), rng.normal((0, 8), 1, (6, 2))]
    D = cdist(X, X)
    assert auto_k(D).k == 3 and auto_k(D).scores[3] >= 0.5
