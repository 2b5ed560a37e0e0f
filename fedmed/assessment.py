"""Site heterogeneity assessment for segmentation federations (``004_``), framework-free.

A site computes :func:`site_assessment` on its own cases and sends only aggregates:

* metadata — per feature (max intensity of each modality, volume of each region) a histogram of
  counts on shared bin edges (default; the EMD of histograms is within one bin width of the
  per-value EMD, see ``tests/test_heterogeneity.py``), or the per-image values when
  ``per_value=True`` (the paper's form);
* embeddings — the centroid of the per-image PCA(2) MedicalNet vectors (1024 floats) and the
  image count; with ``per_image=True`` the (n, 1024) matrix instead (the paper's form).

:func:`assess` turns all sites' replies into ``D_EMD`` (Appendix C), ``D_EUC`` (Eq. 1), the most
distant site of each (Eq. 3) and each matrix's two-cluster split (Alg. 1); :func:`write_report`
writes ``distances_emd.csv``, ``distances_euc.csv``, ``assessment.json``, heatmaps and
``report.md``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .clustering import farthest_split, most_distant_site
from .heterogeneity import d_emd, emd_matrix, embedding_distance_matrix

__all__ = ["DEFAULT_EDGES", "assess", "site_assessment", "write_report"]

# z-scored MR intensities and lesion volumes in mm^3 (values outside fall into the end bins)
DEFAULT_EDGES = {"intensity": (-5.0, 25.0, 121), "label": (0.0, 300_000.0, 151)}


def _edges(feature: str, edges: dict | None) -> np.ndarray:
    spec = (edges or {}).get(feature) or DEFAULT_EDGES["intensity" if feature.startswith("intensity__") else "label"]
    if isinstance(spec, (list, tuple)) and len(spec) == 3 and not isinstance(spec[0], (list, tuple)):
        return np.linspace(float(spec[0]), float(spec[1]), int(spec[2]))
    return np.asarray(spec, dtype=np.float64)


def site_assessment(cases, encoder=None, *, per_value: bool = False, per_image: bool = False,
                    edges: dict | None = None, privacy: dict | None = None, rng=None) -> dict:
    """What one site sends for the assessment (see the module notes).

    With ``privacy["dp_epsilon"]`` (and aggregates, not per-image values) every histogram gets Laplace noise
    (L1 sensitivity 2 per feature) and the embedding centroid analytic Gaussian noise on vectors clipped to
    ``privacy["clip"]`` (L2 sensitivity 2 clip / n); the budget is split evenly over the releases
    (:mod:`fedmed.privacy`). Per-image values are never noised: a site only sends them when its own settings
    allow it.
    """
    from .heterogeneity import metadata_histogram
    from .privacy import private_histogram, private_mean
    from .seg import case_metadata, site_embeddings

    privacy = privacy or {}
    values = case_metadata(cases)
    eps = privacy.get("dp_epsilon") if not (per_value or per_image) else None
    releases = len(values) + (1 if encoder is not None else 0)
    share = eps / releases if eps else None
    rng = rng if rng is not None else np.random.default_rng(0)
    out: dict = {"n_cases": len(cases), "dp": {"epsilon": eps, "releases": []}}
    for k, v in values.items():
        if per_value:
            out[k] = v
        else:
            e = _edges(k, edges)
            out[k], rec = private_histogram(metadata_histogram(v, e), epsilon=share, rng=rng)
            out[f"edges__{k}"] = e
            if rec:
                out["dp"]["releases"].append({"feature": k, **rec})
    if encoder is not None:
        emb = site_embeddings(cases, encoder)
        if per_image:
            out["embeddings"] = emb
        elif share:
            out["embedding_centroid"], rec = private_mean(emb, clip=float(privacy.get("clip", 1.0)), epsilon=share,
                                                          delta=float(privacy.get("dp_delta", 1e-5)), rng=rng)
            out["dp"]["releases"].append({"embedding_centroid": True, **rec})
        else:
            out["embedding_centroid"] = emb.mean(axis=0)
        out["encoder"] = encoder.description
    return out


def assess(sites: dict[str, dict], *, rule: str = "objective") -> dict:
    """Distances, most distant site and two-cluster split from all sites' assessment replies."""
    names = sorted(sites)
    if len(names) < 2:
        raise ValueError(f"the assessment needs at least 2 sites with data, got {names}")
    feats = sorted(set.intersection(*[{k for k in sites[n] if k.startswith(("intensity__", "label__"))} for n in names]))
    if not feats:
        raise ValueError("no metadata feature is present at every site")
    mats = {}
    for f in feats:
        edges = sites[names[0]].get(f"edges__{f}")
        mats[f] = emd_matrix([sites[n][f] for n in names], edges=edges, site_names=names, feature=f)
    emd = d_emd({f: m for f, m in mats.items() if f.startswith("intensity__")},
                {f: m for f, m in mats.items() if f.startswith("label__")})
    report: dict = {"sites": names, "features": feats,
                    "emd": {"matrix": emd["D"], "max_intensity": emd["max_intensity"].split("__", 1)[1],
                            "max_label": emd["max_label"].split("__", 1)[1], "summaries": emd["summaries"]}}
    with_emb = [n for n in names if "embedding_centroid" in sites[n] or "embeddings" in sites[n]]
    if len(with_emb) == len(names):
        vecs = [np.asarray(sites[n].get("embeddings", sites[n].get("embedding_centroid"))) for n in names]
        report["euc"] = {"matrix": embedding_distance_matrix(vecs, site_names=names),
                         "encoder": sorted({sites[n].get("encoder", "?") for n in names})}
    for key in ("emd", "euc"):
        if key in report:
            D = np.asarray(report[key]["matrix"])
            report[key]["column_sums"] = dict(zip(names, D.sum(axis=0).tolist()))
            report[key]["most_distant"] = names[most_distant_site(D)]
            if len(names) >= 3:
                split = farthest_split(D, rule=rule)
                report[key]["clusters"] = [[names[i] for i in c] for c in split["clusters"]]
    return report


def write_report(report: dict, out_dir) -> Path:
    from .io import write_distance_csv
    from .plots import plot_heatmap

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
        lines += [f"| {n} | " + " | ".join(f"{v:.3g}" for v in D[i]) + " |" for i, n in enumerate(names)]
        lines += ["| **Sum** | " + " | ".join(f"{r['column_sums'][n]:.3g}" for n in names) + " |", ""]
        lines += [f"Most distant site: **{r['most_distant']}**" +
                  (f"; two clusters: {r['clusters'][0]} / {r['clusters'][1]}" if "clusters" in r else ""), ""]
    (out / "report.md").write_text("\n".join(lines))

    from .io import json_default

    (out / "assessment.json").write_text(json.dumps(report, indent=1, default=json_default))
    return out
