"""The stop rule's scores from what a round's sites sent (:mod:`fedmed.algorithms.stopping` holds the rule itself)."""

from __future__ import annotations

import numpy as np

from fedmed.algorithms.stopping import STILL_IMPROVING, Stopper, stop_metric

__all__ = ["STILL_IMPROVING", "Stopper", "reply_entries", "stop_metric", "summary_score", "val_histograms",
           "val_score"]


def val_score(entries: dict, metric: str) -> float:
    """The validation score of one round from its sites' entries (``{site: metrics and meta}``, as the run's record
    keeps them): the site mean of ``val_accuracy`` / ``val_dice_mean``, or the pooled ``auc`` of the sites'
    validation confusion and score histograms (``pooled_val_auc``); NaN when no site has it."""
    from fedmed.report.record import summarize_sites

    if not entries:
        return float("nan")
    return summary_score(summarize_sites(entries), metric)


def summary_score(summ: dict, metric: str) -> float:
    """A round summary's validation score (``fedmed.report.record.summarize_sites``' form) as ``metric`` reads it."""
    v = (summ.get("pooled_val") or {}).get("auc") if metric == "pooled_val_auc" else summ["mean"].get(metric)
    return float("nan") if v is None else float(v)


def val_histograms(rows):
    """The replies' validation score histograms summed (what the pooled validation AUC is made of), or None."""
    hs = [np.asarray(r[2]["val_score_hist"]) for r in rows if (r[2] or {}).get("val_score_hist") is not None]
    return np.sum(hs, axis=0) if hs else None


def reply_entries(rows) -> dict:
    """``{site: entry}`` of replies, as the run's record keeps them (:func:`fedmed.report.record.site_entry`)."""
    from fedmed.report.record import site_entry

    return {r[0]: site_entry(r[1] or {}, r[2] or {}) for r in rows}
