"""Site heterogeneity for segmentation federations: Alekseenko, Karargyris & Padoy (``004_``).

* Metadata EMD (§2.1, Appendix C): per site, one value per image — the maximum intensity of
  each modality and the volume (mm^3) of each label. For each feature, a site-by-site matrix of
  1-D Earth Mover's distances (:func:`emd_matrix`). Each feature's matrix is summarised by the
  mean of its off-diagonal entries (:func:`emd_summary`; this reproduces the paper's
  ``EMD_FLAIR = 0.595`` exactly from Table 6). ``EMD_maxI`` / ``EMD_maxL`` are the intensity and
  label features with the largest summary; ``D_EMD`` is the element-wise mean of their two
  matrices (:func:`d_emd`, Table 6 -> Table 7).
* Sites may send per-value metadata (as in the paper) or only a binned histogram
  (:func:`metadata_histogram`, the default in fedmed so that only aggregates leave a site). The
  EMD of two histograms on shared bins differs from the per-value EMD by at most one bin width
  (:func:`emd_1d` on bin centres; tested).
* Embedding distance (§2.2, Eq. 1): :func:`pca2_embedding` turns one image's bottleneck feature
  map ``(512, D, H, W)`` into ``(512, 2)`` PCA scores — the 512 channels are the observations,
  the spatial positions the variables — flattened to 1024. How sites with different numbers of
  samples are compared is not stated by the paper (Eq. 1 sums over ``k`` as if both sites had
  one vector). fedmed compares the **centroids**: ``EUC(i, j) = || mean_k VE_ik - mean_k VE_jk ||_2``
  (``mode="centroid"``, independent of sample counts and sample order). ``mode="pairwise"``
  gives the mean Euclidean distance over all cross-site sample pairs instead.
* Most distant site (Eq. 3) and the two-cluster split (Alg. 1) live in :mod:`fedmed.algorithms.clustering`.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
from scipy.stats import wasserstein_distance

from fedmed.core.validation import check_site_names

__all__ = ["d_emd", "embedding_distance_matrix", "emd_1d", "emd_matrix", "emd_summary", "metadata_histogram", "pca2_embedding", "select_max_feature"]


def emd_1d(u_values, v_values, u_weights=None, v_weights=None) -> float:
    """1-D Earth Mover's (Wasserstein-1) distance between two empirical distributions."""
    u = np.asarray(u_values, dtype=np.float64).ravel()
    v = np.asarray(v_values, dtype=np.float64).ravel()
    if u.size == 0 or v.size == 0:
        raise ValueError("EMD needs at least one value on each side, got an empty set.")
    if not (np.isfinite(u).all() and np.isfinite(v).all()):
        raise ValueError("EMD values contain NaN or inf.")
    return float(wasserstein_distance(u, v, u_weights, v_weights))


def metadata_histogram(values, edges) -> np.ndarray:
    """Counts of ``values`` in the shared ``edges`` (values outside are clipped to the end bins)."""
    edges = np.asarray(edges, dtype=np.float64)
    v = np.clip(np.asarray(values, dtype=np.float64).ravel(), edges[0], edges[-1])
    return np.histogram(v, bins=edges)[0].astype(np.float64)


def emd_matrix(site_values: Sequence, *, edges=None, site_names=None, feature: str = "feature") -> np.ndarray:
    """Site-by-site 1-D EMD of one metadata feature.

    Args:
        site_values: per site, either the raw values (one per image) or, when ``edges`` is
            given, a histogram of counts on those shared bin edges.
        edges: (B+1,) shared bin edges for histogram input.

    Returns:
        (N, N) symmetric matrix. All pairs are computed at once from cumulative distributions (``pdist`` on
        CDFs; ~800x faster than a loop of ``scipy.stats.wasserstein_distance`` at N = 400, equal to 1e-12).
    """
    names = check_site_names(site_names, len(site_values))
    if len(site_values) < 2:
        raise ValueError(f"{feature}: EMD needs at least 2 sites, got {len(site_values)}.")
    if edges is not None:
        edges = np.asarray(edges, dtype=np.float64)
        centres = (edges[:-1] + edges[1:]) / 2.0
        hists = []
        for name, h in zip(names, site_values):
            h = np.asarray(h, dtype=np.float64).ravel()
            if h.shape != centres.shape:
                raise ValueError(f"{feature}: {name} histogram should have {centres.size} bins, got {h.size}.")
            if h.sum() <= 0:
                raise ValueError(f"{feature}: {name} has no values (empty histogram).")
            hists.append(h)
        return _emd_histograms(np.stack(hists), centres)
    vals = []
    for name, v in zip(names, site_values):
        v = np.asarray(v, dtype=np.float64).ravel()
        if v.size == 0:
            raise ValueError(f"{feature}: {name} has no values.")
        vals.append(v)
    n = len(vals)
    grid = np.unique(np.concatenate(vals))
    if n * grid.size <= 50_000_000:  # every site's CDF on the common grid fits in memory
        cdf = np.stack([np.searchsorted(np.sort(v), grid[:-1], side="right") / v.size for v in vals])
        return _pairwise_weighted_l1(cdf, np.diff(grid))
    D = np.zeros((n, n))
    for i in range(n):
        for j in range(i + 1, n):
            D[i, j] = D[j, i] = emd_1d(vals[i], vals[j])
    return D


def _pairwise_weighted_l1(F: np.ndarray, widths: np.ndarray, *, block: int = 512) -> np.ndarray:
    """``D_ij = sum_k widths_k |F_ik - F_jk|`` for the rows of F.

    Columns on which every row agrees add exactly 0 and are dropped first (the CDF is 0 below every site's data and
    1 above it). The upper triangle is computed in row blocks (``cdist`` of a block against the rows after it) on two
    threads — SciPy's distance kernels release the GIL — and mirrored, without the condensed vector and
    ``squareform`` copy. Equal to ``squareform(pdist(F, "minkowski", p=1, w=widths))`` (``tests/test_heterogeneity.py``).
    """
    from concurrent.futures import ThreadPoolExecutor

    from scipy.spatial.distance import cdist

    n = F.shape[0]
    keep = np.any(F != F[:1], axis=0) if n else np.zeros(F.shape[1], dtype=bool)
    F, widths = np.ascontiguousarray(F[:, keep]), np.asarray(widths, dtype=np.float64)[keep]
    D = np.zeros((n, n))
    if F.shape[1] == 0 or n < 2:
        return D

    def rows(b0):
        b1 = min(n, b0 + block)
        D[b0:b1, b0:] = cdist(F[b0:b1], F[b0:], "minkowski", p=1, w=widths)

    with ThreadPoolExecutor(max_workers=2) as ex:
        list(ex.map(rows, range(0, n, block)))
    for b0 in range(0, n, block):  # mirror the upper triangle (diagonal blocks are whole: |a - b| = |b - a|)
        b1 = min(n, b0 + block)
        D[b1:, b0:b1] = D[b0:b1, b1:].T
    return D


def _emd_histograms(H: np.ndarray, centres: np.ndarray) -> np.ndarray:
    """1-D EMD of every pair of histograms on shared bins: the L1 distance of their normalised cumulative sums times
    the spacing of the bin centres (``W1 = integral |F - G|``), for all pairs at once — the same numbers as
    :func:`emd_1d` on each pair (``scipy.stats.wasserstein_distance`` with the counts as weights)."""
    F = np.cumsum(H / H.sum(axis=1, keepdims=True), axis=1)
    return _pairwise_weighted_l1(F[:, :-1], np.diff(centres))


def emd_summary(D) -> float:
    """One number per feature: the mean of the off-diagonal pairwise EMDs (Appendix C)."""
    D = np.asarray(D, dtype=np.float64)
    off = ~np.eye(D.shape[0], dtype=bool)
    return float(D[off].mean())


def select_max_feature(matrices: Mapping[str, np.ndarray]) -> tuple[str, dict[str, float]]:
    """The feature whose EMD summary is largest (``EMD_maxI`` or ``EMD_maxL``), and all summaries."""
    if not matrices:
        raise ValueError("select_max_feature needs at least one feature matrix.")
    summaries = {k: emd_summary(v) for k, v in matrices.items()}
    best = max(summaries, key=lambda k: (summaries[k], k))
    return best, summaries


def d_emd(intensity: Mapping[str, np.ndarray], labels: Mapping[str, np.ndarray]) -> dict:
    """Appendix C: ``D_EMD = (D_maxI + D_maxL) / 2`` (element-wise, no symmetrisation).

    Args:
        intensity: feature name (modality) -> site-by-site EMD matrix of max intensities.
        labels: feature name (label) -> site-by-site EMD matrix of label volumes.

    Returns:
        ``{"D": matrix, "max_intensity": name, "max_label": name, "summaries": {...}}``.
    """
    name_i, sum_i = select_max_feature(intensity)
    name_l, sum_l = select_max_feature(labels)
    Di = np.asarray(intensity[name_i], dtype=np.float64)
    Dl = np.asarray(labels[name_l], dtype=np.float64)
    if Di.shape != Dl.shape:
        raise ValueError(f"intensity matrix {name_i} {Di.shape} and label matrix {name_l} {Dl.shape} differ in shape.")
    return {"D": (Di + Dl) / 2.0, "max_intensity": name_i, "max_label": name_l,
            "summaries": {"intensity": sum_i, "label": sum_l}}


def pca2_embedding(feature_map, n_components: int = 2) -> np.ndarray:
    """Eq. 1's per-image vector: PCA of a bottleneck feature map to ``(channels, 2)``, flattened.

    Args:
        feature_map: (C, *spatial) activations of one image (C = 512 for MedicalNet ResNet-18).

    The C channels are the observations and the flattened spatial positions the variables;
    the scores ``U[:, :2] * S[:2]`` of the centred matrix are the ``(C, 2)`` output. PCA signs
    are arbitrary; each component is flipped so that its largest-magnitude score is positive
    (deterministic). Feature maps with a single spatial position (global pooling) have no
    spatial variance: the output is then ``[f, 0]`` per channel (the centred values as the
    first component).

    Returns:
        (C * n_components,) float64, channel-major (``[c0_pc1, c0_pc2, c1_pc1, ...]``).
    """
    f = np.asarray(feature_map, dtype=np.float64)
    if f.ndim < 1:
        raise ValueError(f"feature_map should be (C, *spatial), got shape {f.shape}.")
    X = f.reshape(f.shape[0], -1)
    if not np.isfinite(X).all():
        raise ValueError("feature_map contains NaN or inf.")
    Xc = X - X.mean(axis=0, keepdims=True)
    if X.shape[1] == 1:
        scores = np.zeros((X.shape[0], n_components))
        scores[:, 0] = Xc[:, 0]
    else:
        U, S, _ = np.linalg.svd(Xc, full_matrices=False)
        k = min(n_components, S.size)
        scores = np.zeros((X.shape[0], n_components))
        scores[:, :k] = U[:, :k] * S[:k]
    for j in range(n_components):
        col = scores[:, j]
        if col.size and col[np.argmax(np.abs(col))] < 0:
            scores[:, j] = -col
    return scores.reshape(-1)


def embedding_distance_matrix(site_vectors: Sequence, *, mode: str = "centroid", site_names=None) -> np.ndarray:
    """Eq. 1: Euclidean distance between sites' flattened PCA embeddings.

    Args:
        site_vectors: per site, an (n_i, F) array (one row per image; F = 1024 for Eq. 1).
        mode: ``"centroid"`` (default) compares the mean vectors; ``"pairwise"`` averages the
            distance over all cross-site pairs of images.
    """
    if mode not in ("centroid", "pairwise"):
        raise ValueError(f"mode should be 'centroid' or 'pairwise', got {mode!r}.")
    names = check_site_names(site_names, len(site_vectors))
    if len(site_vectors) < 2:
        raise ValueError(f"embedding distance needs at least 2 sites, got {len(site_vectors)}.")
    arrs = []
    for name, v in zip(names, site_vectors):
        v = np.asarray(v, dtype=np.float64)
        if v.ndim == 1:
            v = v[None, :]
        if v.ndim != 2 or v.shape[0] == 0:
            raise ValueError(f"{name}: embeddings should be (n >= 1, F), got shape {v.shape}.")
        if not np.isfinite(v).all():
            raise ValueError(f"{name}: embeddings contain NaN or inf.")
        arrs.append(v)
    dims = {a.shape[1] for a in arrs}
    if len(dims) != 1:
        raise ValueError(f"embeddings should share one dimension, got { {n: a.shape[1] for n, a in zip(names, arrs)} }.")
    n = len(arrs)
    D = np.zeros((n, n))
    if mode == "centroid":
        from scipy.spatial.distance import pdist, squareform

        return squareform(pdist(np.stack([a.mean(axis=0) for a in arrs])))
    from scipy.spatial.distance import cdist

    for i in range(n):
        for j in range(i + 1, n):
            D[i, j] = D[j, i] = float(cdist(arrs[i], arrs[j]).mean())
    return D
