"""Per-round metrics: what the server records, summarises and writes (JSON, TensorBoard).

Evaluation convention (every workflow): each site scores the model it is served (the global
model for FedAvg, its cluster's model later) on its own validation split (held out of training;
``val_*`` metrics, the only ones that may select a round) and its test split (what tables report).
A round's summary is the mean ± std over sites of the per-site metrics, and the pooled figure over
all test samples (from the sites' confusion matrices and score histograms, see
:mod:`fedmed.algorithms.metrics`; ``pooled_val`` likewise for validation samples).

``metrics.json`` is strict JSON (NaN and inf are written as ``null``) and carries the run's
``status`` (``running``, ``finished``, ``stopped`` or ``failed``, with ``reason``) and its
``attempts`` (which rounds ran in which attempt, when a run was resumed from a checkpoint).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np

from fedmed.algorithms.metrics import pooled_metrics

__all__ = ["METRICS", "Recorder", "missing_sentence", "site_entry", "strict_json", "summarize_sites"]

METRICS = ("accuracy", "macro_f1", "auc")
_AGGREGATES = ("confusion", "score_hist", "val_confusion", "val_score_hist")
_NOT_METRICS = ("n_test", "val_n_test", "cluster", "withheld", "val_withheld", "steps", "n_train") + _AGGREGATES


def _finite(xs):
    return [x for x in xs if x is not None and math.isfinite(x)]


def metric_keys(sites: dict[str, dict]) -> list[str]:
    keys = []
    for s in sites.values():
        for k, v in s.items():
            if k not in keys and k not in _NOT_METRICS and isinstance(v, (int, float)):
                keys.append(k)
    return keys or list(METRICS)


def summarize_sites(sites: dict[str, dict]) -> dict:
    """Mean/std over sites (NaN entries, e.g. AUC of a one-class test split, left out) + pooled."""
    out = {"mean": {}, "std": {}, "n_sites": len(sites)}
    for m in metric_keys(sites):
        vals = _finite([s.get(m) for s in sites.values()])
        out["mean"][m] = float(np.mean(vals)) if vals else float("nan")
        out["std"][m] = float(np.std(vals)) if vals else float("nan")
    for pre, key in (("", "pooled"), ("val_", "pooled_val")):
        confs = [s[pre + "confusion"] for s in sites.values() if pre + "confusion" in s]
        hists = [s[pre + "score_hist"] for s in sites.values() if pre + "score_hist" in s]
        if confs:
            out[key] = pooled_metrics(confs, hists)
            out[key]["withheld"] = int(sum(s.get(pre + "withheld", 0) or 0 for s in sites.values()))
        elif key == "pooled":
            out[key] = {}
    return out


def strict_json(obj) -> object:
    """A copy of ``obj`` that ``json.dumps(allow_nan=False)`` accepts: arrays as lists, NaN/inf as None."""
    if isinstance(obj, dict):
        return {str(k): strict_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict_json(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return strict_json(obj.tolist())
    if isinstance(obj, (np.integer, np.bool_)):
        return obj.item()
    if isinstance(obj, (float, np.floating)):
        return float(obj) if math.isfinite(obj) else None
    if isinstance(obj, Path):
        return str(obj)
    return obj


def _spans(rounds: list[int]) -> str:
    rounds = sorted(rounds)
    parts, a = [], None
    for i, r in enumerate(rounds):
        a = r if a is None else a
        if i + 1 == len(rounds) or rounds[i + 1] != r + 1:
            parts.append(str(a) if a == r else f"{a}-{r}")
            a = None
    return ", ".join(parts)


def missing_sentence(missing: dict) -> str:
    """``"finished without every site: site-3 sat out rounds 0-9 (site-3: cannot read image a.png)"``."""
    parts = []
    for site, m in sorted(missing.items()):
        where = f"round(s) {_spans(m['rounds'])}" if m["rounds"] else "/".join(m["tasks"])
        parts.append(f"{site} sat out {where} ({m['reason']})")
    return "finished without every site: " + "; ".join(parts)


def round_scalars(summary: dict) -> dict:
    """``{tag: value}`` of a round's summary: every site-mean metric and the pooled test and validation metrics."""
    out = {}
    for m, v in summary["mean"].items():
        if v is not None and math.isfinite(v):
            group = "train" if m == "train_loss" else ("val" if m.startswith("val_") else "test")
            name = m[4:] if m.startswith("val_") else m
            out[f"{group}/{name}_site_mean"] = float(v)
    for key in ("pooled", "pooled_val"):
        for m, v in (summary.get(key) or {}).items():
            if m in METRICS and v is not None and math.isfinite(v):
                out[f"{'val' if key == 'pooled_val' else 'test'}/{m}_pooled"] = float(v)
    return out


def site_entry(metrics: dict, meta: dict) -> dict:
    """What the record keeps of one site's reply in a round: its numeric metrics, its counts and cluster, and the
    aggregates the pooled metrics are made of."""
    entry = {m: float(v) for m, v in metrics.items() if isinstance(v, (int, float)) and m != "failed"}
    entry.update({k: meta.get(k) for k in ("n_test", "val_n_test", "n_train", "withheld", "val_withheld")
                  if meta.get(k) is not None})
    entry["cluster"] = meta.get("cluster")
    for k in _AGGREGATES:
        if meta.get(k) is not None:
            entry[k] = np.asarray(meta[k]).tolist()
    return entry


class Recorder:
    """Collects each round's site results; writes ``metrics.json`` and TensorBoard scalars."""

    def __init__(self, out_dir, *, tensorboard: bool = True, meta: dict | None = None, sink=None):
        """``sink(scalars, round)``, when given, also receives each recorded round's :func:`round_scalars` (the FLARE
        server sends them to its tracking receivers)."""
        self.out_dir = Path(out_dir)
        self._sink = sink
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.doc = {"status": "running", "reason": "", "rounds": [], "errors": [], "attempts": [], "meta": meta or {}}
        self._tb = None
        self._t0 = time.time()
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.out_dir / "tb"))
            except Exception:  # tensorboard is optional for the JSON record
                self._tb = None

    # ------------------------------------------------------------------ attempts and status
    def begin_attempt(self, first_round: int) -> None:
        self.doc["attempts"].append({"attempt": len(self.doc["attempts"]) + 1, "first_round": int(first_round),
                                     "rounds": [], "status": "running"})
        self.write()

    def resume_from(self, doc: dict, next_round: int) -> None:
        """Continue the record of an earlier attempt (checkpoint up to ``next_round - 1``)."""
        keep = {k: v for k, v in doc.items() if k not in ("status", "reason", "meta")}
        keep["rounds"] = [r for r in doc.get("rounds", []) if r["round"] < next_round]
        self.doc.update(keep)
        for a in self.doc["attempts"]:
            if a.get("status") == "running":
                a["status"] = "stopped"
        self.begin_attempt(next_round)

    def sites_missing(self) -> dict:
        """``{site: {"rounds": [...], "tasks": [...], "reason": first error}}`` of every site that sat out a round or a
        task of this run (left out: an error reply, no answer, never registered, no signature)."""
        out: dict = {}
        for e in self.doc["errors"]:
            m = out.setdefault(e["site"], {"rounds": [], "tasks": [], "reason": e["error"]})
            if e.get("round") is not None and e["round"] >= 0 and e["round"] not in m["rounds"]:
                m["rounds"].append(e["round"])
            if e["task"] not in m["tasks"]:
                m["tasks"].append(e["task"])
        return out

    def finish(self, status: str, reason: str = "") -> None:
        missing = self.sites_missing()
        self.doc["sites_missing"] = missing
        if status == "finished" and missing and not reason:
            reason = missing_sentence(missing)
        self.doc["status"], self.doc["reason"] = status, reason
        if self.doc["attempts"]:
            self.doc["attempts"][-1].update(status=status, reason=reason)
        self.doc["wall_seconds"] = time.time() - self._t0
        self.write()

    def error(self, round_, site: str, task: str, message: str) -> None:
        self.doc["errors"].append({"round": round_, "site": site, "task": task, "error": message})
        self.write()

    # ------------------------------------------------------------------ rounds
    def record(self, round_: int, results: list[tuple[str, dict, dict]], *, task: str = "train") -> list[str]:
        """Record ``(site, metrics, meta)`` triples of one round; returns the sites that succeeded."""
        sites, ok = {}, []
        for site, metrics, meta in results:
            if meta.get("error"):
                self.doc["errors"].append({"round": round_, "site": site, "task": task, "error": meta["error"]})
                continue
            ok.append(site)
            sites[site] = site_entry(metrics, meta)
        summary = summarize_sites(sites)
        for entry in sites.values():  # the histograms served the pooled AUC; keep the record small
            entry.pop("score_hist", None)
            entry.pop("val_score_hist", None)
        attempt = self.doc["attempts"][-1]["attempt"] if self.doc["attempts"] else 1
        self.doc["rounds"].append({"round": round_, "task": task, "attempt": attempt, "sites": sites,
                                   "summary": summary, "elapsed": time.time() - self._t0})
        if self.doc["attempts"]:
            self.doc["attempts"][-1]["rounds"].append(round_)
        if self._tb is not None or self._sink is not None:
            scalars = round_scalars(summary)
            if self._tb is not None:
                for tag, v in scalars.items():
                    self._tb.add_scalar(tag, v, round_)
                self._tb.flush()
            if self._sink is not None and scalars:
                self._sink(scalars, round_)
        self.write()
        return ok

    def account(self, rows) -> None:
        """What every reply says about the site's own rules, whatever the task: its effective policy (``site_policies``,
        the first reply of a run) and the differential-privacy epsilon it released (``epsilon_spent``: per site, the
        basic composition of every DP release of the run — training, onboarding — with the number of releases)."""
        changed = False
        for row in rows:
            site, meta = row[0], row[2]
            if isinstance(meta.get("site_policy"), dict):
                self.doc.setdefault("site_policies", {})[site] = meta["site_policy"]
                changed = True
            dp = meta.get("dp")
            eps = dp.get("epsilon") if isinstance(dp, dict) else None
            if eps and not meta.get("error"):
                led = self.doc.setdefault("epsilon_spent", {}).setdefault(site, {"epsilon": 0.0, "releases": 0})
                led["epsilon"] = float(led["epsilon"]) + float(eps)
                led["releases"] += 1
                changed = True
        if changed:
            self.write()

    def note(self, key: str, value) -> None:
        self.doc[key] = value
        self.write()

    def set_sites(self, sites: list[str]) -> None:
        """The sites the run started with (registered, or named)."""
        self.doc["sites"] = list(sites)

    def log_task(self, task: str, round_: int, sites: list[str], cluster) -> None:
        """One message sent: its task, round, receiving sites and the cluster whose model it carried."""
        self.doc.setdefault("task_log", []).append({"task": task, "round": round_, "sites": list(sites),
                                                     "cluster": cluster})

    def checkpointed(self, round_: int) -> None:
        """The last round a checkpoint holds."""
        self.doc["checkpoint_round"] = int(round_)

    def recent_errors(self, n: int = 3) -> list[str]:
        """The last ``n`` site errors, as recorded."""
        return [e["error"] for e in self.doc["errors"][-n:]]

    def write(self) -> None:
        text = json.dumps(strict_json(self.doc), indent=1, allow_nan=False)
        tmp = self.out_dir / "metrics.json.tmp"
        tmp.write_text(text)
        tmp.replace(self.out_dir / "metrics.json")

    def close(self):
        if self._tb is not None:
            self._tb.close()
