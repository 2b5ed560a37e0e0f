"""Server-side math of one-shot clustered FL (FMCL, PACFL, FECFL) and of CFL, framework-free.

:func:`fedmed.algorithms.signatures.signature_distances` turns the sites' signature replies into a distance matrix
(each kind by its own rule);
:func:`choose_clusters` applies FMCL's auto-K (Alg. 5), a fixed K or a threshold (Alg. 4).
:func:`cfl_split` is Sattler et al.'s (2020) gradient-similarity bipartition criterion.
"""

from __future__ import annotations

import numpy as np

from fedmed.algorithms.clustering import agglomerative, auto_k, labels_to_clusters

__all__ = ["cfl_split", "choose_clusters", "flux_cluster"]

def choose_clusters(D, names, *, n_clusters: int | None = None, threshold: float | None = None,
                    linkage_method: str = "average", k1_silhouette: float | None = 0.5) -> dict:
    """Auto-K when neither ``n_clusters`` nor ``threshold`` is given, else Algorithm 4.

    Returns ``{"labels", "clusters" (lists of names), "rule", "k", and auto-K's cv/window/silhouette}``.
    """
    n = len(names)
    info: dict = {}
    if n == 1:
        labels = np.zeros(1, dtype=np.int64)
        info["rule"] = "single site"
    elif n_clusters is None and threshold is None:
        res = auto_k(D, linkage_method=linkage_method, k1_silhouette=k1_silhouette)
        labels = res.labels
        info.update(rule=f"auto-K ({res.rule})", cv=res.cv, window=res.window,
                    silhouette={int(k): float(v) for k, v in res.scores.items()}, local_maxima=res.local_maxima)
    else:
        k = min(int(n_clusters), n) if n_clusters is not None else None
        labels = agglomerative(D, n_clusters=k, threshold=threshold, linkage_method=linkage_method)
        info["rule"] = f"fixed K={k}" if threshold is None else f"threshold {threshold}"
    info.update(labels=labels.tolist(), clusters=labels_to_clusters(labels, names), k=int(labels.max()) + 1)
    return info


def _flat(update: dict) -> np.ndarray:
    return np.concatenate([np.asarray(v, dtype=np.float64).ravel() for _, v in sorted(update.items())])


def cfl_split(updates: list[dict], weights, *, eps1: float = 0.4, eps2: float = 1.6) -> dict:
    """Sattler, Müller & Samek (2020), CFL Algorithm 1 criterion for one cluster.

    With ``Delta_i`` the sites' weight updates, split when the weighted mean update is small
    (``||sum_i w_i Delta_i|| < eps1``: the cluster has reached a stationary point of the joint
    objective) while some site is still far from its own (``max_i ||Delta_i|| > eps2``), and the
    cluster has more than two sites. The bipartition maximises the cross-cluster cosine
    dissimilarity via complete-linkage clustering of ``1 - cos(Delta_i, Delta_j)`` into two groups.

    Returns ``{"split": bool, "mean_norm", "max_norm", "labels" (when split)}``.
    """
    U = np.stack([_flat(u) for u in updates])
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    mean_norm = float(np.linalg.norm((w[:, None] * U).sum(0)))
    max_norm = float(np.linalg.norm(U, axis=1).max())
    out = {"split": False, "mean_norm": mean_norm, "max_norm": max_norm}
    if len(updates) > 2 and mean_norm < eps1 and max_norm > eps2:
        norms = np.linalg.norm(U, axis=1, keepdims=True)
        norms[norms == 0] = 1.0
        S = (U / norms) @ (U / norms).T
        D = np.clip(1.0 - S, 0.0, 2.0)
        np.fill_diagonal(D, 0.0)
        out["labels"] = agglomerative((D + D.T) / 2, n_clusters=2, linkage_method="complete").tolist()
        out["split"] = True
    return out


def flux_cluster(descriptors: dict[str, dict], *, n_clusters: int | None = None, scale: float = 1.0,
                 seed: int = 0, scaling: str = "none", k1_silhouette: float | None = 0.25) -> dict:
    """Flux (``003_`` Alg. 1 lines 9-11): cluster the sites' full descriptors — adaptive DBSCAN, or
    K-means with the true K (Flux-prior) — and the centroids of the full and label-free parts.

    ``scaling="minmax"`` min-max scales every descriptor dimension over the sites first (the official
    code; the paper clusters raw descriptors). ``k1_silhouette`` (fedmed's K = 1 test, as in
    :func:`fedmed.algorithms.clustering.auto_k`): a DBSCAN split whose silhouette is below it is merged into one
    cluster, so federations without a shift train one model; ``None`` keeps the paper's literal DBSCAN.
    """
    from fedmed.algorithms.clustering import adaptive_dbscan, kmeans_prior, silhouette_points
    from fedmed.algorithms.flux import cluster_centroids

    if scaling not in ("none", "minmax"):
        raise ValueError(f"scaling should be 'none' or 'minmax', got {scaling!r}.")
    names = sorted(descriptors)
    X = np.stack([np.asarray(descriptors[n]["full"], dtype=np.float64) for n in names])
    XL = np.stack([np.asarray(descriptors[n]["label_free"], dtype=np.float64) for n in names])
    Xc = X
    if scaling == "minmax":
        span = X.max(axis=0) - X.min(axis=0)
        Xc = (X - X.min(axis=0)) / np.where(span > 0, span, 1.0)
    info: dict = {"sites": names, "scaling": scaling}
    if len(names) == 1:
        labels = np.zeros(1, dtype=np.int64)
        info["rule"] = "single site"
    elif n_clusters:
        labels = kmeans_prior(Xc, min(int(n_clusters), len(names)), seed=seed)
        info["rule"] = f"Flux-prior K-means (K={n_clusters})"
    else:
        res = adaptive_dbscan(Xc, scale=scale)
        labels = res["labels"]
        info.update(rule="adaptive DBSCAN", eps=res["eps"], eps_source=res["eps_source"], n_noise=res["n_noise"])
        if k1_silhouette is not None and labels.max() > 0:
            sil = silhouette_points(Xc, labels)
            info["silhouette"] = sil
            if sil < k1_silhouette:
                info["rule"] += (f"; {int(labels.max()) + 1} clusters with silhouette {sil:.3f} < {k1_silhouette} "
                                 f"(no substantial structure): one cluster")
                labels = np.zeros(len(names), dtype=np.int64)
    info.update(labels=labels.tolist(), clusters=labels_to_clusters(labels, names), k=int(labels.max()) + 1,
                centroids_full=cluster_centroids(X, labels), centroids_label_free=cluster_centroids(XL, labels),
                descriptor_length=int(X.shape[1]))
    return info


def assign_by_linkage(row: dict, clusters: dict, linkage: str = "average") -> tuple[int, dict]:
    """The cluster at the smallest linkage distance from a new site whose distance to each training site is ``row``
    (``{site: d}``); ``clusters``: cluster id -> its training sites. Returns (cluster, {cluster: linkage distance}).
    Clusters with no member in ``row`` are skipped; ties go to the smallest id."""
    agg = {"single": np.min, "complete": np.max}.get(linkage, np.mean)
    dist = {int(c): float(agg([row[s] for s in members if s in row]))
            for c, members in clusters.items() if any(s in row for s in members)}
    if not dist:
        raise ValueError("no training site of any cluster to compare with")
    return min(sorted(dist), key=lambda c: dist[c]), dist


def cosine_of_updates(a: dict, b: dict) -> float:
    """Cosine of two parameter dicts (keys of ``a``), flattened in key order."""
    x = np.concatenate([np.asarray(a[k], dtype=np.float64).ravel() for k in sorted(a)])
    y = np.concatenate([np.asarray(b[k], dtype=np.float64).ravel() for k in sorted(a)])
    n = np.linalg.norm(x) * np.linalg.norm(y)
    return float(x @ y / n) if n > 0 else 0.0

