"""FMCL: class-aware client signatures and the overlap-aware cosine distance.

Ali & Brattain, *FMCL: Class-Aware Client Clustering with Foundation Model Representations for
Heterogeneous Federated Learning* (seeds ``000_``/``002_``).

* :func:`class_signature` — Algorithm 2 (per-class element-wise mean embedding ``mu_{i,c}``, Eq. 1,
  and class weight ``w_{i,c} = n_{i,c} / |d_i|``, Eq. 2). Only class ids, means and counts leave a site.
* :func:`fmcl_distance_matrix` — Algorithm 3, vectorised (one Gram matrix per class, restricted to
  the sites that hold that class). :func:`fmcl_distance_matrix_loop` is the literal double loop
  over pairs and classes, kept as the reference the fast version is tested (and benchmarked)
  against.

Hyperparameters default to the paper's: ``alpha=1.0``, ``beta=100``, ``eps=1e-3``;
``D_big = min(2 * P95, P99)`` of the finite off-diagonal entries (both triangles, as the
algorithm box defines ``V = {D_ij : i != j, D_ij < inf}``) fills pairs with no shared class.
``overlap=False`` is the paper's "FMCL (no overlap)" ablation: the multiplier ``m_ij`` is 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from fedmed.core.validation import check_finite_number, check_site_names

__all__ = [
    "ClassSignature",
    "class_signature",
    "fmcl_distance_matrix",
    "fmcl_distance_matrix_loop",
]


@dataclass(frozen=True)
class ClassSignature:
    """A site's FMCL signature ``S_i = {(mu_{i,c}, w_{i,c})}``.

    Attributes:
        classes: (C_i,) int class ids present at the site (unique).
        means: (C_i, d) float mean embedding of each class.
        counts: (C_i,) number of samples of each class (``w_{i,c} = counts / counts.sum()``).
    """

    classes: np.ndarray
    means: np.ndarray
    counts: np.ndarray

    @property
    def weights(self) -> np.ndarray:
        return self.counts / self.counts.sum()

    @property
    def dim(self) -> int:
        return int(self.means.shape[1])

    def validate(self, site: str = "site") -> "ClassSignature":
        classes = np.asarray(self.classes)
        means = np.asarray(self.means, dtype=np.float64)
        counts = np.asarray(self.counts, dtype=np.float64)
        if classes.ndim != 1 or means.ndim != 2 or counts.ndim != 1:
            raise ValueError(
                f"{site}: signature should have classes (C,), means (C, d), counts (C,), got shapes "
                f"{classes.shape}, {means.shape}, {counts.shape}."
            )
        if not (len(classes) == len(means) == len(counts)):
            raise ValueError(
                f"{site}: signature arrays disagree on the number of classes: classes {len(classes)}, "
                f"means {len(means)}, counts {len(counts)}."
            )
        if len(classes) == 0 or counts.sum() <= 0:
            raise ValueError(f"{site}: signature holds no samples (a site with no data cannot be compared).")
        if len(np.unique(classes)) != len(classes):
            raise ValueError(f"{site}: signature classes should be unique, got {classes.tolist()}.")
        if not np.all(np.isfinite(means)):
            raise ValueError(f"{site}: signature means contain NaN or inf.")
        if (counts <= 0).any() or not np.all(np.isfinite(counts)):
            raise ValueError(f"{site}: signature counts should be positive and finite, got {counts.tolist()}.")
        return ClassSignature(classes.astype(np.int64), means, counts)


def class_signature(embeddings, labels) -> ClassSignature:
    """Algorithm 2: class-conditional mean embeddings and class weights of one site.

    Args:
        embeddings: (n, d) frozen-encoder features ``phi(x)`` of the site's samples.
        labels: (n,) integer class of each sample.

    Returns:
        :class:`ClassSignature` with classes in ascending order.

    Raises:
        ValueError: empty site, mismatched lengths, non-finite embeddings.

    Example:
        >>> sig = class_signature(np.array([[1., 0.], [3., 0.], [0., 2.]]), np.array([0, 0, 1]))
        >>> sig.means.tolist(), sig.weights.tolist()
        ([[2.0, 0.0], [0.0, 2.0]], [0.6666666666666666, 0.3333333333333333])
    """
    z = np.asarray(embeddings, dtype=np.float64)
    y = np.asarray(labels)
    if z.ndim != 2:
        raise ValueError(f"embeddings should be (n, d), got shape {z.shape}.")
    if y.shape != (z.shape[0],):
        raise ValueError(f"labels should be ({z.shape[0]},) to match embeddings, got shape {y.shape}.")
    if z.shape[0] == 0:
        raise ValueError("embeddings are empty: a site needs at least one sample to have a signature.")
    if not np.all(np.isfinite(z)):
        raise ValueError("embeddings contain NaN or inf.")
    classes, inverse, counts = np.unique(y, return_inverse=True, return_counts=True)
    sums = np.zeros((len(classes), z.shape[1]))
    np.add.at(sums, inverse, z)
    return ClassSignature(classes.astype(np.int64), sums / counts[:, None], counts.astype(np.float64))


def _check_signatures(signatures: Sequence[ClassSignature], site_names) -> tuple[list[ClassSignature], list[str]]:
    if len(signatures) < 2:
        raise ValueError(f"signatures should come from at least 2 sites, got {len(signatures)}.")
    names = check_site_names(site_names, len(signatures))
    sigs = [s.validate(n) for s, n in zip(signatures, names)]
    dims = {s.dim for s in sigs}
    if len(dims) != 1:
        by_dim = {n: s.dim for s, n in zip(sigs, names)}
        raise ValueError(f"signatures should share one embedding dimension, got {by_dim}.")
    return sigs, names


def _fill_no_overlap(D: np.ndarray, finite_off: np.ndarray) -> np.ndarray:
    """Replace inf (no shared class) by D_big = min(2 P95, P99) of the finite off-diagonal entries."""
    values = D[finite_off]
    if values.size == 0:
        raise ValueError(
            "no pair of sites shares a class, so the FMCL distance is undefined (Algorithm 3 needs at "
            "least one finite pair to set D_big)."
        )
    p95, p99 = np.percentile(values, [95, 99])
    d_big = min(2.0 * p95, p99)
    D = D.copy()
    off = ~np.eye(D.shape[0], dtype=bool)
    D[off & ~np.isfinite(D)] = d_big
    np.fill_diagonal(D, 0.0)
    return D


def _check_hparams(alpha, beta, eps):
    check_finite_number(alpha, "alpha", low=0.0)
    check_finite_number(beta, "beta", low=0.0, low_inclusive=False)
    check_finite_number(eps, "eps", low=0.0, low_inclusive=False)


def _shared_classes(sigs) -> list:
    """Per class at two or more sites (in order of first appearance): every site's mean (zeros where the site lacks
    the class), its norm and its weight (0 where it lacks the class: min(w_i, 0) = 0, so a missing class adds exactly 0
    to Algorithm 3's numerator and overlap)."""
    n = len(sigs)
    order: dict = {}
    for i, s in enumerate(sigs):
        for k, c in enumerate(s.classes.tolist()):
            order.setdefault(c, []).append((i, k))
    d = sigs[0].means.shape[1]
    classes = []
    for c, members in order.items():
        if len(members) < 2:
            continue
        mu, w = np.zeros((n, d)), np.zeros(n)
        for i, k in members:
            mu[i], w[i] = sigs[i].means[k], sigs[i].weights[k]
        classes.append((mu, np.linalg.norm(mu, axis=1), w))
    return classes


def fmcl_distance_matrix(signatures: Sequence[ClassSignature], *, alpha: float = 1.0, beta: float = 100.0,
                         eps: float = 1e-3, overlap: bool = True, site_names=None, block: int = 1024) -> np.ndarray:
    """Algorithm 3: class- and overlap-aware cosine distance between sites (vectorised, bounded memory).

    For each pair ``(i, j)`` with shared classes ``C_ij``::

        w~_c   = min(w_{i,c}, w_{j,c})
        d_cos  = 1 - mu_i,c . mu_j,c / (||mu_i,c|| ||mu_j,c|| + eps)
        d_cap  = sum_c w~_c d_cos / (sum_c w~_c + eps)
        m_ij   = min(max(Omega_ij, eps) ** -alpha, beta),   Omega_ij = sum_c w~_c
        D_ij   = d_cap * m_ij                  (d_cap alone when overlap=False)

    Pairs with no shared class get ``D_big = min(2 P95, P99)``; the diagonal is 0.

    The matrix is built in blocks of ``block`` rows (one matrix product per class and block, float64), so besides
    the (N, N) float64 result only O(block x N) memory is used; the result is symmetrised exactly. It equals
    :func:`fmcl_distance_matrix_loop` to ~1e-12 (``tests/test_fmcl.py``).

    Args:
        signatures: one :class:`ClassSignature` per site, same embedding dimension.
        alpha, beta, eps: the paper's overlap-scaling hyperparameters (defaults 1.0, 100, 1e-3).
        overlap: ``False`` gives the "no overlap" ablation (``m_ij = 1``).
        site_names: used in error messages only.

    Returns:
        (N, N) symmetric float64 matrix.

    Raises:
        ValueError: fewer than 2 sites, a site with no samples, signatures of different
            dimension, non-finite means, or no pair sharing any class.
    """
    _check_hparams(alpha, beta, eps)
    sigs, _ = _check_signatures(signatures, site_names)
    n = len(sigs)
    classes = _shared_classes(sigs)
    D = np.empty((n, n))
    num, omega, tmp = (np.empty((min(block, n), n)) for _ in range(3))
    for b0 in range(0, n, block):
        b1 = min(n, b0 + block)
        # only columns from b0 on: the blocks left of the diagonal are the mirror of blocks already computed
        cols = n - b0
        nb, ob, t = num[:b1 - b0, :cols], omega[:b1 - b0, :cols], tmp[:b1 - b0, :cols]
        nb.fill(0.0)
        ob.fill(0.0)
        for mu, norms, w in classes:
            g = mu[b0:b1] @ mu[b0:].T                         # mu_i . mu_j
            np.multiply(norms[b0:b1, None], norms[None, b0:], out=t)
            t += eps
            np.divide(g, t, out=g)
            np.subtract(1.0, g, out=g)                        # d_cos
            np.minimum(w[b0:b1, None], w[None, b0:], out=t)   # w~_c
            ob += t
            g *= t
            nb += g
        with np.errstate(divide="ignore", invalid="ignore"):
            dcap = D[b0:b1, b0:]
            np.add(ob, eps, out=t)
            np.divide(nb, t, out=dcap)
            if overlap:
                np.maximum(ob, eps, out=t)
                np.power(t, -alpha, out=t)
                np.minimum(t, beta, out=t)
                dcap *= t
            dcap[ob <= 0] = np.inf
    del num, omega, tmp
    _mirror_upper_inplace(D, block)
    np.fill_diagonal(D, np.inf)  # excluded from the percentiles; set to 0 below
    return _fill_no_overlap_inplace(D)


def _mirror_upper_inplace(D: np.ndarray, block: int) -> None:
    """Fill D's blocks below the diagonal blocks from the computed upper ones, and make each diagonal block exactly
    symmetric (its two triangles come from one product but different summation orders)."""
    n = D.shape[0]
    for b0 in range(0, n, block):
        b1 = min(n, b0 + block)
        d = D[b0:b1, b0:b1]
        d[...] = (d + d.T) / 2.0
        if b1 < n:
            D[b1:, b0:b1] = D[b0:b1, b1:].T


def _fill_no_overlap_inplace(D: np.ndarray) -> np.ndarray:
    """D_big = min(2 P95, P99) of the finite off-diagonal entries of both triangles (as Algorithm 3's V), computed
    exactly from the upper triangle (each value appears twice in V); inf entries -> D_big; diagonal -> 0."""
    n = D.shape[0]
    finite = np.empty(n * (n - 1) // 2)  # the upper triangle, row by row (no index arrays)
    pos = 0
    for i in range(n - 1):
        finite[pos:pos + n - 1 - i] = D[i, i + 1:]
        pos += n - 1 - i
    m = int(np.count_nonzero(np.isfinite(finite)))  # inf (no shared class) sorts after every finite value
    if m == 0:
        raise ValueError(
            "no pair of sites shares a class, so the FMCL distance is undefined (Algorithm 3 needs at "
            "least one finite pair to set D_big)."
        )
    big = 2 * m  # |V|: every value twice
    wanted = []  # numpy's "linear" percentile of the doubled sorted array b[k] = a[k // 2]
    for q in (95, 99):
        p = q / 100 * (big - 1)
        lo, hi = int(np.floor(p)), int(np.ceil(p))
        wanted.append((p, lo, hi))
    finite.partition(sorted({k // 2 for _, lo, hi in wanted for k in (lo, hi)}))
    pct = [finite[lo // 2] + (finite[hi // 2] - finite[lo // 2]) * (p - lo) for p, lo, hi in wanted]
    del finite
    d_big = min(2.0 * pct[0], pct[1])
    for b0 in range(0, n, 1024):
        rows = D[b0:b0 + 1024]
        rows[~np.isfinite(rows)] = d_big
    np.fill_diagonal(D, 0.0)
    return D


def fmcl_distance_matrix_loop(signatures: Sequence[ClassSignature], *, alpha: float = 1.0, beta: float = 100.0,
                              eps: float = 1e-3, overlap: bool = True, site_names=None) -> np.ndarray:
    """Algorithm 3 exactly as printed: a loop over pairs ``i < j`` and their shared classes.

    Reference implementation for tests and the benchmark; use :func:`fmcl_distance_matrix`.
    """
    _check_hparams(alpha, beta, eps)
    sigs, _ = _check_signatures(signatures, site_names)
    n = len(sigs)
    D = np.full((n, n), np.inf)
    lookup = [{int(c): k for k, c in enumerate(s.classes)} for s in sigs]
    weights = [s.weights for s in sigs]
    for i in range(n):
        for j in range(i + 1, n):
            shared = sorted(set(lookup[i]) & set(lookup[j]))
            if not shared:
                continue
            omega = num = den = 0.0
            for c in shared:
                a, b = lookup[i][c], lookup[j][c]
                wt = min(weights[i][a], weights[j][b])
                omega += wt
                mi, mj = sigs[i].means[a], sigs[j].means[b]
                dcos = 1.0 - float(mi @ mj) / (np.linalg.norm(mi) * np.linalg.norm(mj) + eps)
                num += wt * dcos
                den += wt
            dcap = num / (den + eps)
            m = min(max(omega, eps) ** (-alpha), beta) if overlap else 1.0
            D[i, j] = D[j, i] = dcap * m
    off = ~np.eye(n, dtype=bool)
    return _fill_no_overlap(D, off & np.isfinite(D))
