"""Per-source numbers of a natural-federation experiment (fedmed experiment app_configs/breast_us_natural.yaml): for
every method's run, at the round the experiment reports (its ``selection``: final, or validation-selected
— never test), the balanced accuracy of each source pooled over its sites' test splits (from the sites' confusion
matrices, the aggregates the sites sent; n/a where a site withheld a class row of fewer than k_min test images, as
U-Systems' 5-6 test images do) and the site-mean AUC of the source's sites; mean ± std over seeds.

    python benchmarks/natural_per_source.py results/breast_us_natural

With ``--paired REF`` a second table gives each method minus the row ``REF`` (e.g. "Serving plan: global model"),
paired over the seeds both have, per source: mean ± std of the differences, in bold where the mean is larger than
its spread (the project's "beyond the spread").

Writes ``per_source.md`` into the experiment folder and prints it. Of the references only "Each source alone" is here (it
keeps its sites' records, as a site would send them); the centralized model keeps none and the IID reference's sites mix
the sources (their numbers are in ``summary.md``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def balanced_accuracy(conf: np.ndarray) -> float | None:
    """Mean recall over the classes present (rows of the confusion matrix: true class)."""
    rows = conf.sum(axis=1)
    present = rows > 0
    return float(np.mean(np.diag(conf)[present] / rows[present])) if present.any() else None


def source_metrics(site_records: dict, groups: dict) -> dict:
    """Per source, from the sites' records as they sent them (``{site: {"confusion", "auc", "withheld"}}``) and
    ``groups`` (site -> source): ``{source: {"bacc": balanced accuracy of its sites' pooled confusion matrices,
    "auc": the mean of its sites' AUCs}}``, each left out where it cannot be read (a site withheld a class row of fewer
    than k_min images, a class absent from the pooled test images, no AUC)."""
    out: dict = {}
    for src in dict.fromkeys(groups.values()):
        sites = [s for s, g in groups.items() if g == src and s in site_records]
        got = out.setdefault(src, {})
        confs = [np.asarray(site_records[s]["confusion"]) for s in sites if site_records[s].get("confusion")]
        withheld = any(site_records[s].get("withheld") for s in sites)  # rows below k_min, zeroed at the site
        if confs and not withheld:
            b = balanced_accuracy(sum(confs))
            if b is not None and (sum(confs).sum(axis=1) > 0).all():
                got["bacc"] = b
        aucs = [site_records[s]["auc"] for s in sites if site_records[s].get("auc") is not None]
        if aucs:
            got["auc"] = float(np.mean(aucs))
    return out


def paired_cell(values: dict, reference: dict) -> str:
    """``values`` minus ``reference`` (each ``{seed: value}``, in fractions) over the seeds both have, in points: mean
    ± std (population std over seeds, as every table), bold when the mean's size exceeds the std (beyond the spread);
    "n/a" with no common seed."""
    common = sorted(set(values) & set(reference))
    if not common:
        return "n/a"
    d = 100 * np.array([values[k] - reference[k] for k in common])
    cell = f"{d.mean():+.1f} ± {d.std():.1f}"
    return f"**{cell}**" if len(d) > 1 and abs(d.mean()) > d.std() else cell


def run_record(out: Path, method: str, seed: int) -> Path | None:
    from fedmed.run.experiment import run_dir

    folder = run_dir(out, seed, method)
    for f in (folder / "server" / "metrics.json", folder / "metrics.json"):
        if f.is_file():
            return f
    return None


def reference_round(out: Path, method: str, seed: int, round_) -> dict | None:
    """A reference row's per-site records (``{"sites": ...}``) for "Each source alone", the one reference whose sites
    are the sources' own; None for the others (the IID federation's reference keeps records too, but of sites that mix
    the sources, which say nothing per source)."""
    if method != "Each source alone":
        return None
    f = out / "runs" / f"seed{seed}" / "_references" / "run.json"
    if not f.is_file():
        return None
    for r in json.loads(f.read_text()).get("rows", []):
        if r.get("method") == method and r.get("round") == round_ and r.get("sites"):
            return {"sites": r["sites"]}
    return None


def summary_selection(text: str) -> str:
    """The reporting rule a ``summary.md`` says it used (``fedmed.report.summary.write_outputs``' wording)."""
    if "best AUC on the sites' validation images" in text:
        return "validation_auc"
    return "validation" if "validation-selected" in text else "final"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="the experiment's output folder")
    ap.add_argument("--selection", choices=("final", "validation", "validation_auc"), default=None,
                    help="default: the experiment config's, as its summary.md says")
    ap.add_argument("--paired", metavar="REF", help="also each method minus the row REF, paired over seeds, per source")
    a = ap.parse_args(argv)
    from fedmed.report.summary import read_results, reported_rows

    out = Path(a.out)
    selection = a.selection or summary_selection((out / "summary.md").read_text())
    rows = read_results(out / "results.csv")
    chosen = reported_rows(rows, selection)
    cells: dict = {}  # (method, source) -> {"bacc": {seed: value}, "auc": {seed: value}}
    sources: list = []
    for (method, seed), row in sorted(chosen.items()):
        if row.get("kind") == "reference":  # each source alone keeps its sites' records; the others have none
            rnd = reference_round(out, method, seed, row.get("round"))
        else:
            f = run_record(out, method, seed)
            rnd = None
            if f is not None:
                doc = json.loads(f.read_text())
                rnd = next((r for r in doc["rounds"] if r["round"] == row["round"]), None)
        meta = json.loads((out / "data" / f"seed{seed}" / "dataset.json").read_text())
        groups = meta.get("groups") or {}
        if not groups:
            continue
        if rnd is None:
            continue
        for src, got in source_metrics(rnd["sites"], groups).items():
            if src not in sources:
                sources.append(src)
            c = cells.setdefault((method, src), {"bacc": {}, "auc": {}})
            for k, v in got.items():
                c[k][seed] = v

    def fmt(v):
        v = list((v or {}).values())
        return f"{100 * np.mean(v):.1f} ± {100 * np.std(v):.1f}" if v else "n/a"

    methods = list(dict.fromkeys(m for m, _ in cells))
    head = "| Method | " + " | ".join(f"{s}: bal. acc | {s}: AUC" for s in sources) + " |"
    lines = [head, "|---|" + "---|---|" * len(sources)]
    for m in methods:
        lines.append(f"| {m} | " + " | ".join(f"{fmt(cells.get((m, s), {}).get('bacc'))} | "
                                              f"{fmt(cells.get((m, s), {}).get('auc'))}" for s in sources) + " |")
    cmd = "python benchmarks/natural_per_source.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = (f"Per source ({selection} round; balanced accuracy from the source's pooled test confusion matrices, AUC "
            f"the mean over its sites; %, mean ± std over seeds). Produced by: `{cmd}`\n\n" + "\n".join(lines) + "\n")
    if a.paired:
        if a.paired not in methods:
            raise SystemExit(f"--paired {a.paired!r}: no such row (rows: {', '.join(methods)})")
        plines = [head.replace("| Method |", f"| Method minus {a.paired} |"), lines[1]]
        for m in methods:
            if m != a.paired:
                plines.append(f"| {m} | " + " | ".join(
                    f"{paired_cell(cells.get((m, s), {}).get(k, {}), cells.get((a.paired, s), {}).get(k, {}))}"
                    for s in sources for k in ("bacc", "auc")) + " |")
        text += (f"\nPaired over seeds: each method minus {a.paired}, per source (points; mean ± std of the "
                 f"differences; **bold**: the mean beyond its spread).\n\n" + "\n".join(plines) + "\n")
    (out / "per_source.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
