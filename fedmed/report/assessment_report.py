"""The ``004_`` assessment's report: ``distances_emd.csv``, ``distances_euc.csv``, ``assessment.json``, heatmaps and
``report.md`` (from :func:`fedmed.algorithms.assessment.assess`)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

__all__ = ["write_assessment_report"]


def write_assessment_report(report: dict, out_dir) -> Path:
    from fedmed.core.io import readable, write_distance_csv
    from fedmed.report.plots import plot_heatmap

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = report["sites"]
    lines = ["# Site heterogeneity assessment", "", f"Sites: {', '.join(names)}", ""]
    for key, title in (("emd", "metadata EMD (D_EMD, 004_ App. C)"), ("euc", "embedding distance (D_EUC, Eq. 1)")):
        if key not in report:
            continue
        r = report[key]
        D = np.asarray(r["matrix"])
        write_distance_csv(out / f"distances_{key}.csv", names, D)
        plot_heatmap(D, names, out / f"heatmap_{key}.png", title=title)
        lines += [f"## {title}", ""]
        if key == "emd":
            lines += [f"EMD_maxI: {r['max_intensity']}, EMD_maxL: {r['max_label']}", ""]
        else:
            lines += [f"Encoder: {', '.join(r['encoder'])}", ""]
        lines += ["| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        lines += [f"| {n} | " + " | ".join(readable(v) for v in D[i]) + " |" for i, n in enumerate(names)]
        lines += ["| **Sum** | " + " | ".join(readable(r['column_sums'][n]) for n in names) + " |", ""]
        lines += [f"Most distant site: **{r['most_distant']}**" +
                  (f"; two clusters: {r['clusters'][0]} / {r['clusters'][1]}" if "clusters" in r else ""), ""]
    (out / "report.md").write_text("\n".join(lines))

    from fedmed.core.io import json_default

    (out / "assessment.json").write_text(json.dumps(report, indent=1, default=json_default))
    return out
