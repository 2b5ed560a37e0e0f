"""Per-round metrics: what the server records, summarises and writes (JSON, TensorBoard).

Evaluation convention (every workflow): each site scores the model it is served (the global
model for FedAvg, its cluster's model later) on its own test split. A round's summary is the
mean ± std over sites of the per-site metrics, and the pooled figure over all test samples
(from the sites' confusion matrices and score histograms, see :mod:`fedmed.metrics`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from .metrics import pooled_metrics

__all__ = ["METRICS", "Recorder", "summarize_sites"]

METRICS = ("accuracy", "macro_f1", "auc")


def _finite(xs):
    return [x for x in xs if x is not None and math.isfinite(x)]


def metric_keys(sites: dict[str, dict]) -> list[str]:
    keys = []
    for s in sites.values():
        for k, v in s.items():
            if k not in keys and k not in ("n_test", "cluster", "confusion", "score_hist") and isinstance(v, (int, float)):
                keys.append(k)
    return keys or list(METRICS)


def summarize_sites(sites: dict[str, dict]) -> dict:
    """Mean/std over sites (NaN entries, e.g. AUC of a one-class test split, left out) + pooled."""
    out = {"mean": {}, "std": {}, "n_sites": len(sites)}
    for m in metric_keys(sites):
        vals = _finite([s.get(m) for s in sites.values()])
        out["mean"][m] = float(np.mean(vals)) if vals else float("nan")
        out["std"][m] = float(np.std(vals)) if vals else float("nan")
    confs = [s["confusion"] for s in sites.values() if "confusion" in s]
    hists = [s["score_hist"] for s in sites.values() if "score_hist" in s]
    out["pooled"] = pooled_metrics(confs, hists) if confs else {}
    return out


class Recorder:
    """Collects each round's site results; writes ``metrics.json`` and TensorBoard scalars."""

    def __init__(self, out_dir, *, tensorboard: bool = True, meta: dict | None = None):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.doc = {"rounds": [], "errors": [], "meta": meta or {}}
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.out_dir / "tb"))
            except Exception:  # tensorboard is optional for the JSON record
                self._tb = None

    def record(self, round_: int, results: list[tuple[str, dict, dict]], *, task: str = "train") -> list[str]:
        """Record ``(site, metrics, meta)`` triples of one round; returns the sites that succeeded."""
        sites, ok = {}, []
        for site, metrics, meta in results:
            if meta.get("error"):
                self.doc["errors"].append({"round": round_, "site": site, "task": task, "error": meta["error"]})
                continue
            ok.append(site)
            entry = {m: float(v) for m, v in metrics.items() if isinstance(v, (int, float)) and m != "failed"}
            entry.update(n_test=meta.get("n_test"), cluster=meta.get("cluster"))
            if meta.get("confusion") is not None:
                entry["confusion"] = np.asarray(meta["confusion"]).tolist()
                entry["score_hist"] = np.asarray(meta["score_hist"]).tolist()
            sites[site] = entry
        summary = summarize_sites(sites)
        for entry in sites.values():  # the histograms served the pooled AUC; keep the record small
            entry.pop("score_hist", None)
        self.doc["rounds"].append({"round": round_, "task": task, "sites": sites, "summary": summary})
        if self._tb is not None:
            for m in summary["mean"]:
                for kind in ("mean", "pooled"):
                    v = summary.get(kind, {}).get(m)
                    if v is not None and math.isfinite(v):
                        self._tb.add_scalar(f"{kind}/{m}", v, round_)
            self._tb.flush()
        self.write()
        return ok

    def note(self, key: str, value) -> None:
        self.doc[key] = value
        self.write()

    def write(self) -> None:
        from .io import json_default

        slim = json.loads(json.dumps(self.doc, default=json_default))
        (self.out_dir / "metrics.json").write_text(json.dumps(slim, indent=1))

    def close(self):
        if self._tb is not None:
            self._tb.close()
