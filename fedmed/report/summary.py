"""Result rows, honest round selection, summary tables and plots of ``fedmed experiment`` / ``sweep``.

Round selection (never on test data):

* ``selection="final"`` (default): every run is reported at its final round (the ``validate`` round
  after the last aggregation).
* ``selection="validation"``: every run (each seed on its own) is reported at the round whose served
  model has the best site-mean accuracy (Dice for segmentation) on the sites' *validation* splits —
  held out of their training data. Test metrics are read at that round.
* ``selection="validation_auc"`` (classifiers): the round whose served model has the best AUC on the sites'
  validation images pooled. Accuracy at the 0.5 threshold reads a network's operating point, AUC its ranking; where
  more optimisation per round moves the first while the second still rises (a pretrained network fine-tuned
  federated, docs/results.md issue #53), the accuracy rule picks early rounds. Ties: the earliest round.

Every number of a table, and the per-method console line, is read at the same reported round, in %.
Reference rows (``fedmed.run.references``) sit beside the methods: the centralized model, FedAvg on an IID
federation, the majority-class constant predictor and, for each clustered method, the constant
predictor answering each cluster's majority class; a clustered method's margin over its
cluster-majority row is printed next to it.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np

__all__ = ["CLS_METRICS", "FIELDS", "SEG_METRICS", "SELECTIONS", "read_results", "reported_rows", "rows_from_metrics",
           "summarize", "sweep_stats", "sweep_table", "write_outputs"]

CLS_METRICS = ("accuracy", "macro_f1", "auc")
SELECTIONS = ("final", "validation", "validation_auc")
SEG_METRICS = ("dice_wt", "dice_tc", "dice_et", "dice_mean", "hd95_wt", "hd95_tc", "hd95_et", "dice_wt_per_sample",
               "fp_voxels", "fp_pixels")
FIELDS = ["method", "kind", "seed", "round", "task", "phase", "attempt", *CLS_METRICS, *[f"{m}_std" for m in CLS_METRICS],
          *[f"pooled_{m}" for m in CLS_METRICS], "val_accuracy", "val_macro_f1", "pooled_val_accuracy",
          "pooled_val_auc", *SEG_METRICS, "val_dice_mean", "train_loss", "ari", "n_clusters", "n_sites", "n_failed",
          "n_test", "withheld", "sat_out"]
_INT = ("seed", "round", "attempt", "n_clusters", "n_sites", "n_failed", "n_test", "withheld")
_STR = ("method", "kind", "task", "phase", "sat_out")


def sat_out(doc: dict) -> str:
    """The sites that sat out rounds of a run (``metrics.json``'s record), as every table flags them:
    ``"site-3 (all 2 rounds)"``, ``"site-2 (1 of 10 rounds)"``; empty when every site answered every round."""
    n = len({r["round"] for r in doc.get("rounds", [])})
    out = []
    for site, m in sorted((doc.get("sites_missing") or {}).items()):
        k = len(m.get("rounds") or [])
        if not k and not m.get("tasks"):
            continue
        if not k or k >= n:
            out.append(f"{site} (all {n} rounds)" if n else f"{site} ({'/'.join(m.get('tasks') or [])})")
        else:
            out.append(f"{site} ({k} of {n} rounds)")
    return "; ".join(out)


def _flag(e: dict) -> str:
    """A method cell's warning where sites sat out (``summarize``'s ``sat_out``): every table shows it."""
    return f" ⚠ sat out: {e['sat_out']}" if e.get("sat_out") else ""


UNTRAINED = "Untrained network"


def is_seg(rows) -> bool:
    return any("dice_mean" in r and r.get("dice_mean") is not None for r in rows)


def primary(rows) -> str:
    return "dice_mean" if is_seg(rows) else "accuracy"


def rows_from_metrics(method: str, seed: int, doc: dict, *, kind: str = "method") -> list[dict]:
    """One row per recorded round of a run's ``metrics.json`` (the model served in that round)."""
    rows = []
    failed: dict = {}
    missing = sat_out(doc)
    for e in doc.get("errors", []):
        failed[e["round"]] = failed.get(e["round"], 0) + 1
    for r in doc.get("rounds", []):
        s = r["summary"]
        mean, std, pooled = s.get("mean", {}), s.get("std", {}), s.get("pooled") or {}
        row = {"method": method, "kind": kind, "seed": seed, "round": r["round"], "task": r.get("task"),
               "attempt": r.get("attempt", 1), "n_sites": s.get("n_sites"), "n_failed": failed.get(r["round"], 0),
               "n_test": int(sum((v.get("n_test") or 0) for v in r.get("sites", {}).values())),
               "withheld": pooled.get("withheld"), **({"sat_out": missing} if missing else {})}
        for k, v in mean.items():
            if k in FIELDS:
                row[k] = v
        for m in CLS_METRICS:
            if m in std:
                row[f"{m}_std"] = std[m]
            if m in pooled:
                row[f"pooled_{m}"] = pooled[m]
        for m in ("accuracy", "auc"):
            if (s.get("pooled_val") or {}).get(m) is not None:
                row[f"pooled_val_{m}"] = s["pooled_val"][m]
        row["sites"] = {site: {k: v.get(k) for k in (*CLS_METRICS, *SEG_METRICS, "cluster") if k in v}
                        for site, v in r.get("sites", {}).items()}
        rows.append(row)
    return rows


def _finite(vals):
    return [float(v) for v in vals if v is not None and isinstance(v, (int, float)) and math.isfinite(v)]


def fmt(vals, scale: float = 100.0) -> str:
    """``mean ± std`` over seeds in % (just the value for one seed; ``n/a`` when nothing is finite)."""
    vals = _finite(vals)
    if not vals:
        return "n/a"
    if scale == 1.0 and len(vals) == 1 and (float(vals[0]).is_integer() or abs(vals[0]) >= 100):  # a count: 1,634
        return f"{vals[0]:,.0f}"  # (not 1634.00)
    if len(vals) == 1:
        return f"{scale * vals[0]:.2f}"
    if scale == 1.0 and min(abs(v) for v in vals) >= 100:  # counts over seeds
        return f"{np.mean(vals):,.0f} ± {np.std(vals):,.0f}"
    return f"{scale * np.mean(vals):.2f} ± {scale * np.std(vals):.2f}"


def reported_rows(rows: list[dict], selection: str = "final") -> dict:
    """``{(method, seed): row}`` at the reported round of every run (see the module notes)."""
    if selection not in SELECTIONS:
        raise ValueError(f"selection should be one of {', '.join(map(repr, SELECTIONS))}, got {selection!r}.")
    out = {}
    runs: dict = {}
    for r in rows:
        if r.get("phase"):
            continue
        runs.setdefault((r["method"], r["seed"]), []).append(r)
    for key, rs in runs.items():
        if len(rs) == 1:
            out[key] = rs[0]
            continue
        served = [r for r in rs if r.get("task") == "finetune_local"]
        if served:  # the finetune_local method serves its sites' fine-tuned models: that round is its row, never a
            out[key] = served[-1]  # round of the plain FedAvg before it (#86)
        elif selection == "final":
            out[key] = max(rs, key=lambda r: r["round"])
        else:
            if selection == "validation_auc" and is_seg(rs):
                raise ValueError(f"{key[0]} seed {key[1]}: selection 'validation_auc' is for classifiers; a "
                                 f"segmentation run selects on validation Dice ('validation')")
            vkey = ("val_dice_mean" if is_seg(rs) else "pooled_val_auc" if selection == "validation_auc"
                    else "val_accuracy")
            scored = [r for r in rs if r.get(vkey) is not None and math.isfinite(r[vkey])]
            if not scored:
                if vkey == "pooled_val_auc" and any(r.get("val_accuracy") is not None for r in rs):
                    raise ValueError(f"{key[0]} seed {key[1]}: selection 'validation_auc' needs the pooled "
                                     f"validation AUC, which these rows were saved without (a run reported before "
                                     f"the rule existed): `fedmed experiment CONFIG --out FOLDER --resume` writes it "
                                     f"back from the runs' own records, training nothing")
                raise ValueError(f"{key[0]} seed {key[1]}: selection {selection!r} needs validation metrics "
                                 f"({vkey}); the sites have no validation split (federation.val_fraction)")
            out[key] = max(scored, key=lambda r: (r[vkey], -r["round"]))
    return out


def still_improving(rows: list[dict], selection: str = "final") -> str:
    """The runs whose best validation score (the one ``selection`` reads, validation accuracy where it reads none)
    is at their last round, as one line (#85), or "" when there are none."""
    from fedmed.algorithms.stopping import STILL_IMPROVING

    runs: dict = {}
    for r in rows:
        if not r.get("phase") and r.get("task") not in PLAN_TASKS and r.get("round") is not None \
                and r.get("task") != "finetune_local":
            runs.setdefault(r["method"], {}).setdefault(r["seed"], []).append(r)
    hits = []
    for method, by_seed in runs.items():
        seeds = []
        for seed, rs in sorted(by_seed.items()):
            key = "val_dice_mean" if is_seg(rs) else "pooled_val_auc" if selection == "validation_auc" \
                else "val_accuracy"
            scored = [r for r in rs if r.get(key) is not None and math.isfinite(r[key])]
            if len(scored) > 1:
                best = max(scored, key=lambda r: (r[key], -r["round"]))
                if best["round"] == max(r["round"] for r in rs):
                    seeds.append(str(seed))
        if seeds:
            hits.append(f"{method} (seed{'s' if len(seeds) > 1 else ''} {', '.join(seeds)})")
    if not hits:
        return ""
    return (f"{STILL_IMPROVING.capitalize()}: {'; '.join(hits)} — the best validation score is at the last round "
            f"(raise train.rounds, a ceiling, and set train.stop: docs/recipes.md).")


def below_constant(rows: list[dict], selection: str = "final") -> str:
    """The methods whose served models decide worse than the constant answer (the majority class: the "Majority
    class" reference row), in site-mean test accuracy at the reported round, as one line (#85), or ""."""
    rep = reported_rows(rows, selection)
    const = [r["accuracy"] for (m, _), r in rep.items() if m == "Majority class" and r.get("accuracy") is not None]
    if not const:
        return ""
    floor = float(np.mean(const))
    means: dict = {}
    for (m, _), r in rep.items():
        if m != "Majority class" and r.get("accuracy") is not None and math.isfinite(r["accuracy"]):
            means.setdefault(m, []).append(r["accuracy"])
    low = [f"{m} ({100 * np.mean(v):.2f}%)" for m, v in means.items() if np.mean(v) < floor]
    if not low:
        return ""
    return (f"Below the constant answer ({100 * floor:.2f}%, the majority class): {'; '.join(low)} — these models rank "
            f"(see AUC) but decide worse than answering the majority class everywhere.")


def summarize(rows: list[dict], selection: str = "final") -> list[dict]:
    """Per method (methods first, then references): the reported round(s) and mean ± std over seeds. A
    segmentation table also gets the untrained network's row (the centralized reference before its first round:
    the same seeded initial model every method starts from)."""
    if is_seg(rows):
        rows = list(rows) + [{**r, "method": UNTRAINED} for r in rows
                             if r.get("method") == "Centralized" and r.get("round") == 0 and not r.get("phase")]
    rep = reported_rows(rows, selection)
    metrics = SEG_METRICS if is_seg(rows) else (*CLS_METRICS, *[f"pooled_{m}" for m in CLS_METRICS])
    order = list(dict.fromkeys(r["method"] for r in rows if not r.get("phase")))
    out = []
    for m in order:
        runs = [r for (meth, _), r in sorted(rep.items()) if meth == m]
        # no site could score its test split without describing fewer than k_min samples: the cell says so
        withheld = all("n_test" in r and not r["n_test"] for r in runs)
        entry = {"method": m, "kind": runs[0].get("kind", "method"), "seeds": len(runs), "task": runs[0].get("task"),
                 "rounds": [r["round"] for r in runs if r.get("round") is not None],  # one per seed, in seed order
                 **{k: _withheld(fmt([r.get(k) for r in runs], 1.0 if k.startswith("hd95") or k in ("fp_voxels", "fp_pixels")
                                     else 100.0), withheld)
                    for k in metrics},
                 "_values": {k: _finite([r.get(k) for r in runs]) for k in metrics},
                 "k": _k_cell([r.get("n_clusters") for r in runs]),
                 "ari": fmt([r.get("ari") for r in runs], 1.0),
                 "sat_out": "; ".join(f"seed {r['seed']}: {r['sat_out']}" if len(runs) > 1 else r["sat_out"]
                                      for r in runs if r.get("sat_out")),
                 "n_test": int(np.median([r.get("n_test") or 0 for r in runs])),
                 "n_sites": int(np.median([len(r.get("sites") or {}) for r in runs])),
                 "withheld": int(np.median([r.get("withheld") or 0 for r in runs]))}
        if is_seg(rows):
            sites = sorted({s for r in runs for s in r.get("sites", {})})
            entry["per_site"] = {s: fmt([r["sites"][s].get("dice_mean") for r in runs if s in r.get("sites", {})])
                                 for s in sites}
        out.append(entry)
    return sorted(out, key=lambda e: e["kind"] == "reference")


def _withheld(cell: str, withheld: bool) -> str:
    return "withheld" if withheld and cell == "n/a" else cell


def _k_cell(ks) -> str:
    """The number of clusters per seed, e.g. ``1, 1, 2`` (blank for methods that do not cluster)."""
    ks = [int(k) for k in ks if k is not None and not (isinstance(k, float) and math.isnan(k))]
    return ", ".join(map(str, ks))


def margin(entry: dict, ref: dict | None, key: str = "accuracy") -> str:
    """Method minus reference, mean ± std over the seeds both have (paired), in points."""
    if ref is None:
        return ""
    a, b = entry["_values"].get(key, []), ref["_values"].get(key, [])
    n = min(len(a), len(b))
    if not n:
        return "n/a"
    d = 100 * (np.asarray(a[:n]) - np.asarray(b[:n]))
    within = n > 1 and abs(d.mean()) <= d.std()  # the paired difference is no larger than its seed-to-seed spread
    return f"{d.mean():+.2f}" + (f" ± {d.std():.2f}" if n > 1 else "") + (" (within the spread)" if within else "")


PLAN_TASKS = {"served": "per site, on val.",  # fedmed.workflows.plan: each site's model chosen on its validation data
              "global": "final (reference)"}  # the plan's reference run's final global model, scored beside it


def _round_label(e, selection) -> str:
    if e["kind"] == "reference" or not e["rounds"]:
        return "—"
    if e.get("task") in PLAN_TASKS:  # a serving plan's rows: no round of training is selected there
        return PLAN_TASKS[e["task"]]
    per_seed = e["rounds"] if len(set(e["rounds"])) > 1 else e["rounds"][:1]  # one number when every seed agrees
    if selection == "final":
        return f"final ({', '.join(map(str, per_seed))})"
    by = "val-AUC-selected" if selection == "validation_auc" else "val-selected"
    return f"{by} ({', '.join(map(str, per_seed))})"


def has_margin(summ: list[dict]) -> bool:
    """Whether any method has a cluster-majority reference: the table's last column is shown only then (#89)."""
    names = {e["method"] for e in summ if e["kind"] == "reference"}
    return any(f"{e['method']}: cluster-majority" in names for e in summ)


def has_hemispheres(summ: list[dict]) -> bool:
    """Whether the per-hemisphere WT Dice differs from the WT Dice anywhere (a column equal to WT in every row goes)."""
    return any(e.get("dice_wt_per_sample", "n/a") not in ("n/a", e.get("dice_wt")) for e in summ)


def classification_table(summ: list[dict], selection: str) -> str:
    refs = {e["method"]: e for e in summ if e["kind"] == "reference"}
    has_cm = has_margin(summ)
    has_k = any(e.get("k") for e in summ)
    has_ari = any(e.get("ari") not in (None, "", "n/a") for e in summ if e["kind"] != "reference")
    extra = (" K (per seed) |" if has_k else "") + (" ARI vs true groups |" if has_ari else "")
    head = (f"| Method | Round |{extra} Acc (site mean) | Macro-F1 | AUC | Pooled Acc | Pooled F1 | Pooled AUC |"
            + (" vs cluster-majority (pp) |" if has_cm else "") + "\n" + "|---" * (8 + has_cm + has_k + has_ari) + "|\n")
    body = ""
    for e in summ:
        cm = refs.get(f"{e['method']}: cluster-majority")
        name = e["method"] + (" (reference)" if e["kind"] == "reference" else "") + _flag(e)
        cells = (f" {e.get('k', '')} |" if has_k else "") + (
            f" {e.get('ari') if e['kind'] != 'reference' and e.get('ari') != 'n/a' else ''} |" if has_ari else "")
        body += (f"| {name} | {_round_label(e, selection)} |{cells} {e['accuracy']} | {e['macro_f1']} | {e['auc']} | "
                 f"{e['pooled_accuracy']} | {e['pooled_macro_f1']} | {e['pooled_auc']} |"
                 + (f" {margin(e, cm)} |" if has_cm else "") + "\n")
    return head + body


def seg_table(summ: list[dict], selection: str) -> str:
    sites = sorted({s for e in summ for s in e.get("per_site", {})})
    if all(e.get("dice_wt", "n/a") == "n/a" for e in summ):  # 2D lesion segmentation (fedmed.site.seg2d)
        head = ("| Method | Round | Dice (lesion, image mean) | FP pixels (lesion-free) |" + "".join(f" {s} |" for s in sites)
                + "\n" + "|---" * (4 + len(sites)) + "|\n")
        return head + "".join(
            f"| {e['method']}{' (reference)' if e['kind'] == 'reference' else ''}{_flag(e)} | {_round_label(e, selection)} | "
            f"{e['dice_mean']} | {e.get('fp_pixels', 'n/a')} |" + "".join(f" {e.get('per_site', {}).get(s, 'n/a')} |"
                                                                         for s in sites) + "\n" for e in summ)
    hemi = has_hemispheres(summ)
    head = ("| Method | Round | WT | TC | ET | Mean Dice | HD95 WT (mm) |" + (" WT per hemisphere |" if hemi else "")
            + " FP voxels (tumour-free) |" + "".join(f" {s} |" for s in sites) + "\n"
            + "|---" * (8 + hemi + len(sites)) + "|\n")
    def per_site(e):  # one model served to every site, scored on the common test subjects: the same value everywhere
        cells = [e.get("per_site", {}).get(s, "n/a") for s in sites]
        return ["=" for _ in cells] if len(set(cells)) == 1 and len(cells) > 1 and cells[0] != "n/a" else cells

    body = "".join(f"| {e['method']}{' (reference)' if e['kind'] == 'reference' else ''}{_flag(e)} | {_round_label(e, selection)} | {e['dice_wt']} | {e['dice_tc']} | {e['dice_et']} | "
                   f"{e['dice_mean']} | {e['hd95_wt']} |" + (f" {e.get('dice_wt_per_sample', 'n/a')} |" if hemi else "")
                   + f" {e['fp_voxels']} |"
                   + "".join(f" {c} |" for c in per_site(e)) + "\n" for e in summ)
    return head + body


def summarize_phases(rows: list[dict]) -> str:
    """The unseen sites' table: per method the clustering ARI, and the unseen sites' accuracy with the model the
    method assigns them (FedAvg: its global model), with their true group's cluster model (known association), with
    the best cluster model per site (an oracle reference, never a selection), IFCA's ensemble; macro-F1 of the first
    two."""
    phased = [r for r in rows if r.get("phase")]
    if not phased:
        return ""
    lines = ["| Method | Clustering ARI | Assigned model acc | Known assoc. acc | Oracle: best cluster model acc | "
             "Ensemble acc | Assigned model F1 | Known assoc. F1 |", "|---|---|---|---|---|---|---|---|"]
    for m in dict.fromkeys(r["method"] for r in phased):
        get = lambda ph, k: [r.get(k) for r in phased if r["method"] == m and r["phase"] == ph]  # noqa: E731
        aris = _finite([r.get("ari") for r in phased if r["method"] == m and r["phase"] == "test phase"])
        ari = fmt(aris, 1.0)
        sat = "; ".join(dict.fromkeys(r["sat_out"] for r in rows if r.get("method") == m and r.get("sat_out")))
        lines.append(f"| {m}{_flag({'sat_out': sat})} | {ari} | {fmt(get('test phase', 'accuracy'))} | {fmt(get('known assoc.', 'accuracy'))} | "
                     f"{fmt(get('oracle', 'accuracy'))} | {fmt(get('ensemble', 'accuracy'))} | "
                     f"{fmt(get('test phase', 'macro_f1'))} | {fmt(get('known assoc.', 'macro_f1'))} |")
    return "\n".join(lines) + "\n"


def _phase_numbers(rows: list[dict]) -> list[dict]:
    """Per onboarding method: the unseen sites' accuracy with the assigned model and with the oracle (in %)."""
    phased = [r for r in rows if r.get("phase")]
    get = lambda m, ph: fmt([r.get("accuracy") for r in phased if r["method"] == m and r["phase"] == ph])  # noqa: E731
    return [{"method": m, "assigned": get(m, "test phase"), "oracle": get(m, "oracle")}
            for m in dict.fromkeys(r["method"] for r in phased) if get(m, "test phase") != "n/a"]


def _intro_and_table(rows: list[dict], summ: list[dict], selection: str) -> tuple[str, str, str]:
    """(how the values spread over seeds, the paragraph that says how to read the table, the table) of a
    classification, 2D lesion or 3D segmentation experiment."""
    seeds = max(e["seeds"] for e in summ)
    spread = (f"mean ± std over {seeds} seeds" if seeds > 1 else
              "from 1 seed (one run has no spread, so no ±; more seeds give mean ± std)")
    rule = ("at each run's final round" if selection == "final" else
            "at each run's validation-selected round (best AUC on the sites' validation images pooled, held out of "
            "training; test data never selects)" if selection == "validation_auc" else
            "at each run's validation-selected round (best site-mean accuracy on the sites' validation splits, "
            "held out of training; test data never selects)")
    if is_seg(rows) and all(e.get("dice_wt", "n/a") == "n/a" for e in summ):  # 2D lesion segmentation
        intro = (f"Dice in %, {spread} {rule}; Dice per test image holding a lesion, averaged "
                 f"over a site's test images and then over sites; FP pixels: predicted lesion pixels on lesion-free "
                 f"test images (n/a where there are none); per-site columns: each site's mean Dice with the model it "
                 f"is served, on its own test split.")
        table = seg_table(summ, selection)
    elif is_seg(rows):
        intro = (f"Dice in %, {spread.replace('seeds', 'seeds/folds')} {rule}; Dice and HD95 (mm) per test subject "
                 f"(a subject's hemisphere samples scored together, as BraTS scores a patient; regions a subject "
                 f"lacks left out, as DiceMetric's ignore_empty=True); "
                 + ("WT per hemisphere: the WT Dice averaged over tumour-bearing hemisphere samples instead; "
                    if has_hemispheres(summ) else "") + f"false-positive voxels on tumour-free hemispheres; "
                 f"per-site columns: each site's mean Dice with the model it is served on the common test subjects ('=': every "
                 f"site is served the same model, so each has the Mean Dice).")
        table = seg_table(summ, selection)
    else:
        intro = (f"Values in %, {spread} {rule}. Per-site metrics are averaged over sites "
                 f"(each site scores the model it is served on its own test split); pooled metrics use all sites' "
                 f"test samples (from confusion matrices; rows of fewer than k_min samples withheld at the sites). "
                 f"Rows marked (reference) are computed, not federated: see docs/results.md."
                 + (" The last column is the method minus the constant predictor answering its clusters' majority "
                    "classes." if has_margin(summ) else ""))
        table = classification_table(summ, selection)
    return spread, intro, table


def _saved_plans(out: Path) -> dict:
    """seed folder -> the serving plan it ran (each site's served model under the name the config gives it)."""
    plans = {}  # the serving plans of the seeds, where the experiment ran one
    for f in sorted(out.glob("runs/seed*/_serving_plan/server/plan.json")):
        try:
            doc = json.loads(f.read_text())
            run = f.parent.parent / "run.json"  # the candidates' names as the config writes them
            names = json.loads(run.read_text()).get("names", {}) if run.is_file() else {}
            plans[f.parts[-4]] = {s: {**v, "served": names.get(v["served"], v["served"])} for s, v in doc.items()}
        except (OSError, ValueError, KeyError, AttributeError):
            pass
    return plans


def _recorded_differ(out: Path) -> dict:
    """method -> the split-half tests ("do the sites differ?") its runs recorded before training, one per seed."""
    differ: dict = {}  # the split-half test each clustered run recorded before training
    for f in sorted(out.glob("runs/seed*/*/metrics.json")):
        try:
            doc = json.loads(f.read_text())
            d = doc.get("differ") or {}
            if d.get("p") is None:
                continue
            run = f.parent / "run.json"
            method = json.loads(run.read_text()).get("method", f.parent.name) if run.is_file() else f.parent.name
            enc = (doc.get("clustering") or {}).get("encoder") or []
            differ.setdefault(method, []).append({"seed": int(f.parts[-3].replace("seed", "") or 0), "p": d["p"],
                                                  "alpha": d.get("alpha", 0.05),
                                                  "encoder": enc if isinstance(enc, list) else [enc]})
        except (OSError, ValueError, KeyError, AttributeError, TypeError):
            pass
    return differ


def write_outputs(rows: list[dict], out_dir, *, title: str, command: str, selection: str = "final",
                  setup: list[str] | None = None, notes: list[str] | None = None) -> str:
    """``results.csv``, ``summary.csv``, ``summary.md`` and ``curves.png``; returns the markdown."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "results.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k) for k in FIELDS})
    summ = summarize(rows, selection)
    with (out / "summary.csv").open("w", newline="") as fh:
        keys = [k for k in summ[0] if not k.startswith("_") and k != "per_site"]
        w = csv.DictWriter(fh, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(summ)
    spread, intro, table = _intro_and_table(rows, summ, selection)
    from fedmed.report.findings import findings_section

    text = f"## {title}\n\nProduced by: `{command}`\n\n"
    plans, differ = _saved_plans(out), _recorded_differ(out)
    text += findings_section(summ, _phase_numbers(rows), plans=plans, differ=differ)
    if setup:
        text += "Setup: " + "; ".join(setup) + "\n\n"
    text += intro + "\n\n" + table
    phases = summarize_phases(rows)
    if phases:
        text += ("\n### Unseen sites (onboarded after training)\n\nAccuracy in %, " + spread + " of the mean "
                 "over unseen sites. Assigned model: the cluster model the method gives a new site (fedmed.workflows."
                 "onboard: Flux the nearest label-free centroid, Eq. 9; FMCL/PACFL/FECFL the run's linkage; IFCA the "
                 "lowest loss; CFL its parameter tree; FedAvg: the global model). Scored on all the site's data when "
                 "the assignment used no labels (Flux, FECFL, FedAvg), on its test split when it used the "
                 "training split's labels (FMCL, PACFL, IFCA, CFL). Known assoc.: the cluster model of the site's true group "
                 "(ANDA federations). Oracle: each site's best cluster model, chosen on its test labels — a reference, "
                 "never a method. Ensemble: IFCA's cluster models weighted by cluster size (label-free). ARI: the "
                 "training clustering against the true groups.\n\n" + phases)
    notes = list(notes or [])
    notes += [line for line in (still_improving(rows, selection), below_constant(rows, selection)) if line]
    if notes:
        text += "\n" + "\n".join(f"- {n}" for n in notes) + "\n"
    (out / "summary.md").write_text(text)
    curves = [r for r in rows if not r.get("phase") and r.get("kind") != "reference"]
    if curves:
        plot_curves(curves, out / "curves.png", title)
    return text


def read_results(path) -> list[dict]:
    """Rows of a ``results.csv`` written by :func:`write_outputs` (numbers parsed, empty cells dropped)."""
    rows = []
    with Path(path).open(newline="") as fh:
        for r in csv.DictReader(fh):
            row = {}
            for k, v in r.items():
                if v in ("", None):
                    continue
                row[k] = v if k in _STR else (int(float(v)) if k in _INT else float(v))
            rows.append(row)
    return rows


TEST_PANEL, KNOWN_PANEL, ARI_PANEL = ("unseen sites: test phase accuracy", "unseen sites: known assoc. accuracy",
                                      "clustering ARI vs true groups")


def sweep_stats(cases: list[tuple[str, list[str], list[dict]]]) -> dict:
    """The numbers behind :func:`fedmed.report.plots.plot_sweep`: per panel, case and method, (mean, std) over seeds."""
    panels = {TEST_PANEL: "test phase", KNOWN_PANEL: "known assoc.", ARI_PANEL: None}
    out: dict = {p: {} for p in panels}
    for name, _, rows in cases:
        for m in dict.fromkeys(r["method"] for r in rows if r.get("phase")):
            for panel, phase in panels.items():
                if phase is None:
                    vals = [r.get("ari") for r in rows if r["method"] == m and r.get("phase") == "test phase"]
                else:
                    vals = [r.get("accuracy") for r in rows if r["method"] == m and r.get("phase") == phase]
                vals = _finite(vals)
                if vals:
                    out[panel].setdefault(name, {})[m] = (float(np.mean(vals)), float(np.std(vals)))
    return {p: v for p, v in out.items() if v}


def sweep_table(cases: list[tuple[str, list[str], list[dict]]], selection: str = "final") -> str:
    """One table over a sweep's cases: per case and method, the clustering ARI against the true groups, the
    trained sites' accuracy at the reported round, and the unseen sites' known-association / test-phase accuracy
    (mean ± std over seeds, accuracies in %)."""
    lines = ["| Case | Method | Seeds | Clustering ARI | Trained sites acc | Unseen: known assoc. acc | "
             "Unseen: test phase acc |", "|---|---|---|---|---|---|---|"]
    for name, sets, rows in cases:
        summ = {s["method"]: s for s in summarize(rows, selection)}
        stats = sweep_stats([(name, sets, rows)])

        def cell(panel, m, scale):
            mu, sd = stats.get(panel, {}).get(name, {}).get(m, (None, None))
            return "n/a" if mu is None else f"{scale * mu:.2f} ± {scale * sd:.2f}"

        for m in dict.fromkeys(r["method"] for r in rows):
            s = summ.get(m, {})
            lines.append(f"| {name} | {m}{_flag(s)} | {s.get('seeds', 0)} | {cell(ARI_PANEL, m, 1)} | "
                         f"{s.get('accuracy', 'n/a')} | {cell(KNOWN_PANEL, m, 100)} | {cell(TEST_PANEL, m, 100)} |")
    return "\n".join(lines) + "\n"


def plot_curves(rows: list[dict], path: Path, title: str) -> None:
    """Learning curves, mean ± std over seeds: validation and test score of the served model, train loss."""
    from fedmed.report.plots import _plt, _save

    from matplotlib.ticker import MaxNLocator

    plt = _plt()
    key = primary(rows)
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8), sharex=True)  # one round axis for scores and loss (#89)
    seeds = len({r.get("seed") for r in rows})
    styles = ["-", "--", ":", "-."]
    handles: dict = {}
    for i, m in enumerate(dict.fromkeys(r["method"] for r in rows)):
        mr = [r for r in rows if r["method"] == m and r.get("round") is not None]
        rounds = sorted({r["round"] for r in mr})
        for ax, k in zip(axes, (f"val_{key}", key, "train_loss")):
            vals = [_finite([r.get(k) for r in mr if r["round"] == rd]) for rd in rounds]
            pts = [(rd, np.mean(v), np.std(v)) for rd, v in zip(rounds, vals) if v]
            if not pts:
                continue
            x, mu, sd = map(np.asarray, zip(*pts))
            # a style and a marker per method: two methods with equal curves stay both visible (#89)
            line, = ax.plot(x, mu, styles[i % len(styles)], marker="os^vD<>"[i % 7], markersize=3,
                            lw=2.2 if i == 0 else 1.3, label=m, zorder=3 + i)
            handles.setdefault(m, line)
            if seeds > 1:
                ax.fill_between(x, mu - sd, mu + sd, alpha=0.15, color=line.get_color())
    axes[0].set_ylabel(f"validation {key} (site mean)")
    axes[1].set_ylabel(f"test {key} (site mean)")
    axes[2].set_ylabel("train loss (site mean)")
    for ax in axes:
        ax.set_xlabel("round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds are whole numbers
        ax.grid(alpha=0.3)
        if not ax.lines:  # e.g. a run with no validation split: say so instead of a blank frame
            ax.text(0.5, 0.5, "no scores", ha="center", va="center", transform=ax.transAxes, color="0.4")
    with_curves = [ax for ax in axes if ax.lines]
    if with_curves:  # one legend, on the first panel with curves: every method, each entry a drawn line
        with_curves[0].legend(list(handles.values()), list(handles), fontsize=7)
    fig.suptitle(title + (f" (band: ± std over {seeds} seeds)" if seeds > 1 else " (one seed: no band)"))
    _save(fig, path)
