"""Site heterogeneity assessment for segmentation federations (``004_``), framework-free.

A site computes :func:`fedmed.site.seg_aggregates.site_assessment` on its own cases and sends only aggregates:

* metadata — per feature (max intensity of each modality, volume of each region) a histogram of
  counts on shared bin edges (default; the EMD of histograms is within one bin width of the
  per-value EMD, see ``tests/test_heterogeneity.py``), or the per-image values when
  ``per_value=True`` (the paper's form);
* embeddings — the centroid of the per-image PCA(2) MedicalNet vectors (1024 floats) and the
  image count; with ``per_image=True`` the (n, 1024) matrix instead (the paper's form).

:func:`assess` turns all sites' replies into ``D_EMD`` (Appendix C), ``D_EUC`` (Eq. 1), the most
distant site of each (Eq. 3) and each matrix's two-cluster split (Alg. 1);
:func:`fedmed.report.assessment_report.write_assessment_report` writes ``distances_emd.csv``, ``distances_euc.csv``, ``assessment.json``, heatmaps and
``report.md``.
"""

from __future__ import annotations


import numpy as np

from fedmed.algorithms.clustering import farthest_split, most_distant_site
from fedmed.algorithms.heterogeneity import d_emd, emd_matrix, embedding_distance_matrix

__all__ = ["DEFAULT_EDGES", "assess", "histogram_edges", "intensity_emd"]

# z-scored MR intensities and lesion volumes in mm^3 (values outside fall into the end bins)
DEFAULT_EDGES = {"intensity": (-5.0, 25.0, 121), "label": (0.0, 300_000.0, 151)}


def histogram_edges(feature: str, edges: dict | None) -> np.ndarray:
    spec = (edges or {}).get(feature) or DEFAULT_EDGES["intensity" if feature.startswith("intensity__") else "label"]
    if isinstance(spec, (list, tuple)) and len(spec) == 3 and not isinstance(spec[0], (list, tuple)):
        return np.linspace(float(spec[0]), float(spec[1]), int(spec[2]))
    return np.asarray(spec, dtype=np.float64)


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




def intensity_emd(sites: dict[str, dict], feature: str | None = None) -> tuple[list[str], np.ndarray, str]:
    """Label-free ``D_maxI``: the EMD matrix of one maximum-intensity feature (``feature``, e.g. the one a run's
    assessment selected as ``EMD_maxI``; default: the one with the largest summary here) between the sites' replies.
    Returns (sites sorted, matrix, the feature's modality)."""
    from fedmed.algorithms.heterogeneity import select_max_feature

    names = sorted(sites)
    feats = sorted(set.intersection(*[{k for k in sites[n] if k.startswith("intensity__")} for n in names]))
    if not feats:
        raise ValueError("no image-intensity feature is present at every site")
    key = f"intensity__{feature}" if feature else None
    if key is not None and key not in feats:
        raise ValueError(f"intensity feature {feature!r} is not present at every site (they share {feats})")
    mats = {f: emd_matrix([sites[n][f] for n in names], edges=sites[names[0]].get(f"edges__{f}"), site_names=names,
                          feature=f) for f in ([key] if key else feats)}
    best = key or select_max_feature(mats)[0]
    return names, np.asarray(mats[best], dtype=np.float64), best.split("__", 1)[1]
