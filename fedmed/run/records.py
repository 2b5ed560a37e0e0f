"""A finished run's record, read into the experiment's tables: its rows, the pooled validation AUC and clusters it
adds, the agreement of the clusterings, the line a finished run prints."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np



def load_saved(path: Path) -> dict:
    """A saved ``run.json`` (or a record), or ``{}`` when it is missing or unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _run_record(work: Path) -> dict | None:
    hits = [f for f in (work / "server" / "metrics.json", work / "metrics.json") if f.is_file()]
    hits = hits or sorted(work.rglob("fedmed/metrics.json"))
    return json.loads(hits[0].read_text()) if hits else None


def add_pooled_val_auc(saved: dict, work: Path) -> bool:
    """A finished classifier run saved before its rows carried the pooled validation AUC (``selection:
    validation_auc``): each round's row gets it from the run's own record. True where rows changed."""
    todo = [r for r in saved["rows"] if r.get("kind") != "reference" and not r.get("phase")
            and "pooled_val_auc" not in r]
    doc = _run_record(work) if todo else None
    if not doc:
        return False
    auc = {r["round"]: (r.get("summary", {}).get("pooled_val") or {}).get("auc") for r in doc.get("rounds", [])}
    for r in todo:
        if auc.get(r["round"]) is not None:
            r["pooled_val_auc"] = auc[r["round"]]
    return True


def add_clusters(saved: dict, work: Path, meta: dict) -> None:
    from fedmed.algorithms.clustering import clusters_ari  # scipy: only when a run needs it

    from fedmed.run.references import run_clusters

    doc = _run_record(work)
    if doc is None:
        return
    clusters = run_clusters(doc)
    saved["clusters"] = clusters
    for r in saved["rows"]:
        if r.get("kind") == "reference" or r.get("phase"):
            continue
        r["n_clusters"] = len(clusters)
        if meta.get("groups"):
            r["ari"] = clusters_ari(clusters, meta["groups"])


def clustering_agreement(parts: list[tuple[str, list, Path]]) -> str:
    """Markdown: per sweep case and clustering method, the clusters found per seed and the ARI against the
    clustering the same method found for the same seed in the first case it runs in (e.g. without DP).
    Empty when no case has recorded clusters."""
    from fedmed.algorithms.clustering import clusters_ari  # scipy: only when a run needs it

    found: dict = {}  # method -> case -> seed -> clusters
    for name, _, d in parts:
        for f in sorted(Path(d).glob("runs/seed*/*/run.json")):
            doc = load_saved(f)
            if doc.get("status") == "finished" and doc.get("clusters"):
                found.setdefault(doc["method"], {}).setdefault(name, {})[int(doc["seed"])] = doc["clusters"]
    lines = []
    for method, cases in found.items():
        first = next(n for n, _, _ in parts if n in cases)
        base = cases[first]
        for name, _, _ in parts:
            if name not in cases:
                continue
            seeds = sorted(cases[name])
            ks = ", ".join(str(len(cases[name][s])) for s in seeds)
            aris = [clusters_ari(cases[name][s], {x: k for k, c in enumerate(base[s]) for x in c})
                    for s in seeds if s in base]
            cell = f"{np.mean(aris):.2f} ± {np.std(aris):.2f}" if aris else "n/a"
            lines.append(f"| {name} | {method} | {ks} | {first} | {cell} |")
    if not lines:
        return ""
    return ("| Case | Method | K (per seed) | Compared with | ARI vs that case's clustering (same seed) |\n"
            "|---|---|---|---|---|\n" + "\n".join(lines) + "\n")


def checkpoint_round(server: Path):
    try:
        return json.loads((server / "checkpoint" / "state.json").read_text())["next_round"]
    except (OSError, ValueError, KeyError):
        return "?"


def pct(v) -> str:
    """A score for the console: a percentage, or "withheld" when no site could send it (every test split below
    k_min) or it is undefined."""
    import math

    return f"{100 * v:.2f}%" if isinstance(v, (int, float)) and math.isfinite(v) else "withheld"


def log_done(m, doc, new, selection, log, work):
    from fedmed.report.summary import reported_rows

    runs = [r for r in new if not r.get("phase") and r.get("kind") == "method"]
    errs = len(doc.get("errors", []))
    if not runs:  # an assessment-only job
        a = doc.get("assessment", {})
        log(f"    done in {doc.get('wall_seconds', 0):.0f} s: " + "; ".join(
            f"{k.upper()} most distant {v.get('most_distant')}, clusters {v.get('clusters')}"
            for k, v in a.items() if isinstance(v, dict) and "most_distant" in v)
            + f" (report: {work / 'server' / 'assessment'})")
        return
    row = next(iter(reported_rows(runs, selection).values()))
    key = "dice_mean" if row.get("dice_mean") is not None else "accuracy"
    label = {"final": "final", "validation": "validation-selected"}.get(selection, "validation-AUC-selected")
    log(f"    done in {doc.get('wall_seconds', 0):.0f} s: {label} round {row['round']}: test {key} "
        f"{pct(row.get(key))} (site mean)" + (f", pooled {pct(row['pooled_accuracy'])}"
                                               if row.get("pooled_accuracy") is not None else "")
        + (f"; {errs} site error(s), see metrics.json" if errs else ""))
    for key, st in sorted((doc.get("stop") or {}).items()):  # why and when it stopped (#85)
        log(f"    {key}: {st.get('why')}")
