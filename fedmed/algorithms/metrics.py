"""Classification metrics per site, and pooled over sites from aggregates only.

Per site (the served model on the site's local test split): accuracy, macro-F1 over the
classes present in that site's labels or predictions (scikit-learn's default), macro accuracy (the
mean per-class recall over the classes present in the labels, ``001_`` §4.3), one-vs-rest AUC
over the classes present in the labels (NaN when the test split holds one class).

Pooled over sites, from what sites send — a confusion matrix and, per (true class, output
class), a histogram of predicted probabilities in 100 bins — never per-sample predictions:
accuracy and macro-F1 over all classes from the summed confusion matrix, and one-vs-rest AUC
from the summed histograms (ties within a bin count one half; the error against the exact AUC
is below the bin width).

Minimum group size (``k_min``, docs/privacy.md): a site's metrics over fewer than ``k_min`` test
samples are withheld (NaN, nothing sent), and a confusion-matrix / score-histogram row of a class
with fewer than ``k_min`` test samples is zeroed; ``withheld`` counts the samples left out, so a
pooled figure says how much of the test data it covers.
"""

from __future__ import annotations

import numpy as np

__all__ = ["N_BINS", "auc_from_histograms", "binary_auc", "decide", "decision_threshold", "macro_f1", "pooled_metrics",
           "site_metrics"]

N_BINS = 100


def binary_auc(positive, scores) -> float:
    """ROC AUC = P(score_pos > score_neg) + 0.5 P(tie), from average ranks (Mann-Whitney U).

    The same number as ``sklearn.metrics.roc_auc_score`` (to ~1e-15) without importing scikit-learn and SciPy
    at the sites (~3 s of start-up per site process); NaN when one of the two groups is empty.
    """
    pos = np.asarray(positive, dtype=bool)
    s = np.asarray(scores, dtype=np.float64)
    n1 = int(pos.sum())
    n0 = pos.size - n1
    if n1 == 0 or n0 == 0:
        return float("nan")
    order = np.argsort(s, kind="mergesort")
    _, start, counts = np.unique(s[order], return_index=True, return_counts=True)
    ranks = np.empty(s.size)
    ranks[order] = np.repeat(start + (counts + 1) / 2.0, counts)
    return float((ranks[pos].sum() - n1 * (n1 + 1) / 2.0) / (n1 * n0))


def macro_f1(y_true, y_pred) -> float:
    """Macro-F1 over the classes present in the labels or the predictions (``sklearn.metrics.f1_score`` with
    ``average="macro"``; a class with no true and no predicted sample is not counted, 0/0 counts as 0)."""
    y = np.asarray(y_true, dtype=np.int64)
    p = np.asarray(y_pred, dtype=np.int64)
    labels = np.union1d(y, p)
    if labels.size == 0:
        return float("nan")
    f1 = []
    for c in labels:
        tp = float(np.sum((y == c) & (p == c)))
        denom = float(np.sum(y == c) + np.sum(p == c))
        f1.append(2 * tp / denom if denom > 0 else 0.0)
    return float(np.mean(f1))


def site_metrics(y_true, prob, n_classes: int, *, k_min: int = 1) -> dict:
    """Metrics and the aggregates (confusion, score histograms) of one site's predictions.

    Args:
        y_true: (n,) labels.
        prob: (n, C) predicted class probabilities.
        k_min: minimum group size (see the module notes).
    """
    y = np.asarray(y_true, dtype=np.int64)
    p = np.asarray(prob, dtype=np.float64)
    C = int(n_classes)
    conf = np.zeros((C, C), dtype=np.int64)
    hist = np.zeros((C, C, N_BINS), dtype=np.int64)
    if y.size == 0 or y.size < k_min:
        return {"accuracy": float("nan"), "macro_f1": float("nan"), "macro_acc": float("nan"), "auc": float("nan"),
                "n_test": 0, "confusion": conf, "score_hist": hist, "withheld": int(y.size)}
    pred = p.argmax(1)
    np.add.at(conf, (y, pred), 1)
    bins = np.clip((p * N_BINS).astype(int), 0, N_BINS - 1)
    for c in range(C):
        np.add.at(hist[:, c, :], (y, bins[:, c]), 1)
    present = np.unique(y)
    auc = float("nan")
    if present.size >= 2:
        if C == 2:
            auc = binary_auc(y == 1, p[:, 1])
        else:
            auc = float(np.mean([binary_auc(y == c, p[:, c]) for c in present]))
    small = conf.sum(axis=1) < k_min
    withheld = int(conf[small].sum())
    conf[small] = 0
    hist[small] = 0
    recall = [float((pred[y == c] == c).mean()) for c in present]
    out = {"accuracy": float((pred == y).mean()), "macro_f1": macro_f1(y, pred),
           "macro_acc": float(np.mean(recall)), "auc": auc, "n_test": int(y.size), "confusion": conf, "score_hist": hist,
           "withheld": withheld}
    return out


def auc_from_histograms(pos: np.ndarray, neg: np.ndarray) -> float:
    """P(score_pos > score_neg) + 0.5 P(same bin) from two histograms on the same bins."""
    pos = np.asarray(pos, dtype=np.float64)
    neg = np.asarray(neg, dtype=np.float64)
    if pos.sum() == 0 or neg.sum() == 0:
        return float("nan")
    neg_below = np.concatenate([[0.0], np.cumsum(neg)[:-1]])
    return float((pos * (neg_below + 0.5 * neg)).sum() / (pos.sum() * neg.sum()))


def pooled_metrics(confusions, histograms) -> dict:
    """Sample-weighted metrics over all sites' test samples (each scored by its served model)."""
    conf = np.sum(np.stack([np.asarray(c) for c in confusions]), axis=0).astype(np.float64)
    hist = np.sum(np.stack([np.asarray(h) for h in histograms]), axis=0).astype(np.float64)
    n = conf.sum()
    if n == 0:
        return {"accuracy": float("nan"), "macro_f1": float("nan"), "auc": float("nan"), "n_test": 0}
    tp = np.diag(conf)
    with np.errstate(divide="ignore", invalid="ignore"):
        prec = np.where(conf.sum(0) > 0, tp / conf.sum(0), 0.0)
        rec = np.where(conf.sum(1) > 0, tp / conf.sum(1), 0.0)
        f1 = np.where(prec + rec > 0, 2 * prec * rec / (prec + rec), 0.0)
    C = conf.shape[0]
    present = [c for c in range(C) if conf[c].sum() > 0]
    if C == 2:
        auc = auc_from_histograms(hist[1, 1], hist[0, 1])
    else:
        aucs = [auc_from_histograms(hist[c, c], hist[np.arange(C) != c, c].sum(0)) for c in present]
        aucs = [a for a in aucs if np.isfinite(a)]
        auc = float(np.mean(aucs)) if aucs else float("nan")
    return {"accuracy": float(tp.sum() / n), "macro_f1": float(f1[present].mean()) if present else float("nan"),
            "auc": auc, "n_test": int(n)}


def decision_threshold(hist) -> dict | None:
    """A binary classifier's decision threshold chosen on validation data (#85: decide, not only rank): from the
    pooled validation score histograms (``hist[true class, 1, bin]``: the class-1 probability of the items of each
    true class, as the sites send them), the bin edge ``t = k / N_BINS`` whose rule "class 1 when ``p_1 >= t``" gets
    the most validation items right (ties: the edge nearest 0.5, the argmax rule's). ``{"threshold", "val_accuracy",
    "val_accuracy_at_half", "n"}``; None for more than two classes or no validation item."""
    h = np.asarray(hist, dtype=np.float64)
    if h.ndim != 3 or h.shape[0] != 2:
        return None
    pos, neg = h[1, 1], h[0, 1]
    n = pos.sum() + neg.sum()
    if n == 0:
        return None
    edges = np.arange(N_BINS + 1)
    right = np.array([pos[k:].sum() + neg[:k].sum() for k in edges])  # class 1 from bin k on
    best = right.max()
    k = min((e for e in edges if right[e] == best), key=lambda e: (abs(e - N_BINS / 2), e))
    return {"threshold": float(k / N_BINS), "val_accuracy": float(best / n),
            "val_accuracy_at_half": float(right[N_BINS // 2] / n), "n": int(n)}


def decide(prob, threshold: float | None = None) -> np.ndarray:
    """Each item's class from its probabilities: a binary model's ``p_1 >= threshold`` where a threshold travels with
    it (:func:`decision_threshold`), else the most probable class."""
    p = np.asarray(prob, dtype=np.float64)
    if threshold is not None and p.ndim == 2 and p.shape[1] == 2:
        return (p[:, 1] >= float(threshold)).astype(np.int64)
    return p.argmax(axis=1)
