"""Signatures of the one-shot clustering baselines compared in FMCL (``000_`` §4.3).

* PACFL (Vahidian et al., AAAI 2023): each site sends, per class, the ``p`` leading left
  singular vectors of its (features x samples) data matrix; the server compares sites by the
  angles between the spanned subspaces and clusters with threshold hierarchical clustering.
  :func:`pacfl_distance_matrix` offers two readings (docs/readings.md): ``mode="smallest"``
  (default) is the smallest true principal angle in degrees (``scipy.linalg.subspace_angles``, what
  the paper's Eq. 2 defines); ``mode="official"`` is what the authors' code computes — the
  smallest ``arccos`` of the single entries of ``U_i^T U_j`` clipped to [-1, 1], which depends on
  the arbitrary signs of singular vectors; ``mode="mean"`` averages all principal angles.
* FECFL (Kang et al.): each site sends the mean feature embedding of all its samples (a frozen
  encoder, pretrained or randomly initialised); sites are compared by cosine distance.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from fedmed.core.validation import check_finite_number, check_site_names

__all__ = ["fecfl_distance_matrix", "fecfl_signature", "pacfl_distance_matrix", "pacfl_signature"]


def pacfl_signature(features, labels, *, n_basis: int = 3) -> np.ndarray:
    """Per-class truncated-SVD bases of one site, stacked column-wise: (d, sum_c p_c).

    Args:
        features: (n, d) raw flattened pixels or encoder features.
        labels: (n,) class of each sample.
        n_basis: ``p``, leading left singular vectors kept per class (fewer if a class has fewer
            samples).
    """
    X = np.asarray(features, dtype=np.float64)
    y = np.asarray(labels)
    if X.ndim != 2 or X.shape[0] == 0:
        raise ValueError(f"features should be a non-empty (n, d) array, got shape {X.shape}.")
    if y.shape != (X.shape[0],):
        raise ValueError(f"labels should be ({X.shape[0]},), got shape {y.shape}.")
    if not np.isfinite(X).all():
        raise ValueError("features contain NaN or inf.")
    check_finite_number(n_basis, "n_basis", low=1, integer=True)
    bases = []
    for c in np.unique(y):
        A = X[y == c].T  # (d, n_c)
        U, S, _ = np.linalg.svd(A, full_matrices=False)
        k = min(int(n_basis), int((S > S.max() * 1e-12).sum()) if S.size else 0)
        if k:
            bases.append(U[:, :k])
    return np.concatenate(bases, axis=1)


def pacfl_distance_matrix(bases: Sequence[np.ndarray], *, mode: str = "smallest", site_names=None) -> np.ndarray:
    """Principal-angle proximity (degrees) between the sites' class subspaces."""
    if mode not in ("smallest", "mean", "official"):
        raise ValueError(f"mode should be 'smallest', 'mean' or 'official', got {mode!r}.")
    names = check_site_names(site_names, len(bases))
    if len(bases) < 2:
        raise ValueError(f"PACFL needs at least 2 sites, got {len(bases)}.")
    B = []
    for n, b in zip(names, bases):
        b = np.asarray(b, dtype=np.float64)
        if b.ndim != 2 or b.shape[1] == 0:
            raise ValueError(f"{n}: PACFL basis should be (d, p>0), got shape {b.shape}.")
        B.append(b)
    dims = {b.shape[0] for b in B}
    if len(dims) != 1:
        raise ValueError(f"PACFL bases should share one feature dimension, got { {n: b.shape[0] for n, b in zip(names, B)} }.")
    from scipy.linalg import subspace_angles  # scipy.linalg costs ~80 ms: not at import (fedmed.config loads this)

    k = len(B)
    D = np.zeros((k, k))
    for i in range(k):
        for j in range(i + 1, k):
            if mode == "official":
                D[i, j] = D[j, i] = float(np.degrees(np.arccos(np.clip(B[i].T @ B[j], -1.0, 1.0))).min())
                continue
            ang = np.degrees(subspace_angles(B[i], B[j]))
            D[i, j] = D[j, i] = float(ang.min() if mode == "smallest" else ang.mean())
    return D


def fecfl_signature(features) -> np.ndarray:
    """Mean feature embedding of one site: (d,)."""
    X = np.asarray(features, dtype=np.float64)
    if X.ndim != 2 or X.shape[0] == 0:
        raise ValueError(f"features should be a non-empty (n, d) array, got shape {X.shape}.")
    if not np.isfinite(X).all():
        raise ValueError("features contain NaN or inf.")
    return X.mean(axis=0)


def fecfl_distance_matrix(means: Sequence[np.ndarray], *, site_names=None) -> np.ndarray:
    """Cosine distance ``1 - cos`` between the sites' mean embeddings (clipped to [0, 2])."""
    names = check_site_names(site_names, len(means))
    if len(means) < 2:
        raise ValueError(f"FECFL needs at least 2 sites, got {len(means)}.")
    M = []
    for n, m in zip(names, means):
        m = np.asarray(m, dtype=np.float64).ravel()
        if not np.isfinite(m).all():
            raise ValueError(f"{n}: mean embedding contains NaN or inf.")
        if np.linalg.norm(m) == 0:
            raise ValueError(f"{n}: mean embedding is all zeros; cosine distance is undefined.")
        M.append(m)
    if len({m.size for m in M}) != 1:
        raise ValueError(f"FECFL embeddings should share one dimension, got { {n: m.size for n, m in zip(names, M)} }.")
    M = np.stack(M)
    M = M / np.linalg.norm(M, axis=1, keepdims=True)
    D = np.clip(1.0 - M @ M.T, 0.0, 2.0)
    np.fill_diagonal(D, 0.0)
    return (D + D.T) / 2.0
