"""PNG figures: distance heatmap, dendrogram with its cut, silhouette curve (clustering reports) and the
per-case bars of a sweep."""

from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["plot_dendrogram", "plot_heatmap", "plot_silhouette", "plot_sweep"]


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
    """Distance matrix, sites ordered by cluster; values in the cells (up to 30 sites) and a box around each
    cluster's block."""
    from matplotlib.patches import Rectangle

    plt = _plt()
    D = np.asarray(D)
    n = len(names)
    lab = np.asarray(labels) if labels is not None else np.zeros(n, dtype=int)
    order = np.argsort(lab, kind="mergesort")
    fig, ax = plt.subplots(figsize=(0.45 * n + 3, 0.45 * n + 2.5))
    M = D[np.ix_(order, order)]
    im = ax.imshow(M, cmap="viridis")
    ax.set_xticks(range(n), [names[i] for i in order], rotation=90, fontsize=7)
    ax.set_yticks(range(n), [names[i] for i in order], fontsize=7)
    if n <= 30:
        hi = np.nanmax(M) if M.size else 1.0
        for i in range(n):
            for j in range(n):
                ax.text(j, i, f"{M[i, j]:.2g}", ha="center", va="center", fontsize=max(4, 9 - n // 5),
                        color="white" if M[i, j] < 0.6 * hi else "black")
    if labels is not None:
        start = 0
        for c in np.unique(lab[order]):
            size = int((lab == c).sum())
            ax.add_patch(Rectangle((start - 0.5, start - 0.5), size, size, fill=False, edgecolor="red", lw=1.5))
            start += size
    fig.colorbar(im, ax=ax, fraction=0.046, label="distance")
    ax.set_title(title + (" (red boxes: clusters)" if labels is not None else ""))
    return _save(fig, path)


def plot_dendrogram(D, names, path, *, k: int, linkage_method="average", title="dendrogram") -> Path:
    from scipy.cluster.hierarchy import dendrogram

    from fedmed.algorithms.clustering import linkage_matrix

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
    ax.set_ylabel(f"merge distance ({linkage_method} linkage)")
    ax.set_xlabel("site")
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


def plot_sweep(stats: dict, path, title="sweep") -> Path:
    """Grouped bars, one group per case and one bar per method, for each panel.

    ``stats[panel][case][method] = (mean, std)``; e.g. panels "unseen sites, test phase accuracy",
    "unseen sites, known assoc. accuracy" and "clustering ARI". Missing entries are left blank.
    """
    plt = _plt()
    panels = list(stats)
    cases = list(dict.fromkeys(c for p in panels for c in stats[p]))
    methods = list(dict.fromkeys(m for p in panels for c in stats[p] for m in stats[p][c]))
    if not cases or not methods:
        raise ValueError("plot_sweep: nothing to plot (no case has results)")
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(6.0, 1.3 * len(cases) * len(methods) / 3), 2.8 * len(panels)),
                             squeeze=False)
    w = 0.8 / len(methods)
    x = np.arange(len(cases))
    for ax, panel in zip(axes[:, 0], panels):
        for j, m in enumerate(methods):
            mu = [stats[panel].get(c, {}).get(m, (np.nan, np.nan))[0] for c in cases]
            sd = [stats[panel].get(c, {}).get(m, (np.nan, np.nan))[1] for c in cases]
            ax.bar(x + (j - (len(methods) - 1) / 2) * w, mu, w, yerr=sd, capsize=2, label=m)
        ax.set_xticks(x, cases, fontsize=8)
        ax.set_title(panel, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes[0, 0].legend(fontsize=7, ncol=min(len(methods), 6))
    fig.suptitle(title)
    return _save(fig, path)
