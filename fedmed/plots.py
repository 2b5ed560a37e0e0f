"""PNG figures for clustering reports: distance heatmap, dendrogram with its cut, silhouette curve."""

from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["plot_dendrogram", "plot_heatmap", "plot_silhouette"]


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _plt().close(fig)
    return Path(path)


def plot_heatmap(D, names, path, title="site distances", labels=None) -> Path:
    plt = _plt()
    D = np.asarray(D)
    order = np.argsort(labels, kind="mergesort") if labels is not None else np.arange(len(names))
    fig, ax = plt.subplots(figsize=(0.35 * len(names) + 3, 0.35 * len(names) + 2.5))
    im = ax.imshow(D[np.ix_(order, order)], cmap="viridis")
    ax.set_xticks(range(len(names)), [names[i] for i in order], rotation=90, fontsize=7)
    ax.set_yticks(range(len(names)), [names[i] for i in order], fontsize=7)
    fig.colorbar(im, ax=ax, fraction=0.046)
    ax.set_title(title)
    return _save(fig, path)


def plot_dendrogram(D, names, path, *, k: int, linkage_method="average", title="dendrogram") -> Path:
    from scipy.cluster.hierarchy import dendrogram

    from .clustering import linkage_matrix

    plt = _plt()
    Z = linkage_matrix(D, linkage_method)
    fig, ax = plt.subplots(figsize=(max(6, 0.3 * len(names)), 4))
    dendrogram(Z, labels=list(names), ax=ax, leaf_rotation=90, leaf_font_size=7)
    n = len(names)
    if 1 < k <= n:
        heights = Z[:, 2]
        lo = heights[n - k - 1] if n - k - 1 >= 0 else 0.0
        hi = heights[n - k] if n - k < len(heights) else heights[-1]
        ax.axhline((lo + hi) / 2, color="red", ls="--", lw=1, label=f"cut: K={k}")
        ax.legend(fontsize=8)
    ax.set_title(title)
    return _save(fig, path)


def plot_silhouette(scores: dict, window, chosen: int, path, title="silhouette over K") -> Path:
    plt = _plt()
    ks = sorted(int(k) for k in scores)
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot(ks, [scores[k] if k in scores else scores[str(k)] for k in ks], "o-")
    if window:
        ax.axvspan(min(window) - 0.5, max(window) + 0.5, alpha=0.12, label="CV window")
    ax.axvline(chosen, color="red", ls="--", lw=1, label=f"K*={chosen}")
    ax.set_xlabel("K")
    ax.set_ylabel("silhouette")
    ax.legend(fontsize=8)
    ax.set_title(title)
    return _save(fig, path)
