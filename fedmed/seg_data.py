"""Segmentation federations from NIfTI subject folders (``004_`` Appendix D builder).

A subject folder holds one file per modality (matched by glob patterns), a label map and
optionally a brain mask. With ``hemispheres=True`` every subject gives two samples (its left and
right halves), which with the six BraTS-2013 subjects makes 12 samples.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .data import DataError
from .partition import iid_partition, label_volume_federation

__all__ = ["discover_subjects", "write_seg_federation"]


def discover_subjects(root, modalities: dict[str, str], label_pattern: str, mask_pattern: str | None = None,
                      hemispheres: bool = False) -> list[dict]:
    """Datalist entries for every folder under ``root`` that holds a label and all modalities."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"{root}: dataset folder does not exist")
    if not modalities:
        raise DataError("dataset.modalities should map modality names to file patterns, e.g. {FLAIR: 'Flair*.nii.gz'}")
    entries = []
    for lab in sorted(root.rglob(label_pattern)):
        d = lab.parent
        files = {}
        for m, pat in modalities.items():
            hits = sorted(d.glob(pat))
            if not hits:
                raise DataError(f"{d}: subject has no {m} image matching {pat!r}")
            files[m] = str(hits[0].resolve())
        mask = sorted(d.glob(mask_pattern)) if mask_pattern else []
        base = {"image": [files[m] for m in modalities], "label": str(lab.resolve()), "modalities": list(modalities)}
        if mask:
            base["mask"] = str(mask[0].resolve())
        for region in (("left", "right") if hemispheres else ("whole",)):
            entries.append({**base, "region": region, "id": d.name + ("" if region == "whole" else f"_{region[0].upper()}")})
    if not entries:
        raise DataError(f"{root}: no subject folder with a label matching {label_pattern!r}")
    return entries


def region_volume(entry: dict, region: str = "WT") -> float:
    """The lesion volume (mm^3) of one sample's region, from its label map (cropped as loaded)."""
    from .seg import load_case

    case = load_case(entry, shape=(8, 8, 8), site="builder")
    return case["meta"]["volume_mm3"][region]


def write_seg_federation(entries: list[dict], n_sites: int, out_dir, *, partition: str = "label_volume",
                         region: str = "WT", test_fraction: float = 0.25, val_fraction: float = 0.0, seed: int = 0,
                         site_names: list[str] | None = None) -> Path:
    """Split samples into sites and write ``<site>.json`` + ``dataset.json``.

    ``label_volume`` (``004_`` App. D): samples ordered by lesion volume, contiguous blocks form
    the sites, so the last site holds the largest lesions. ``iid``: a seeded random split.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if partition == "label_volume":
        vols = np.array([region_volume(e, region) for e in entries])
        parts = label_volume_federation(vols, n_sites)
    elif partition == "iid":
        vols = None
        parts = iid_partition(len(entries), n_sites, seed)
    else:
        raise DataError(f"segmentation federations support partition label_volume or iid, got {partition!r}")
    from .data import split_sizes

    rng = np.random.default_rng(seed)
    names = list(site_names) if site_names else [f"site-{k + 1}" for k in range(n_sites)]
    for name, idx in zip(names, parts):
        idx = rng.permutation(np.asarray(idx, dtype=np.int64)).tolist()
        n_test, n_val = split_sizes(len(idx), test_fraction, val_fraction)
        doc = {"site": name, "training": [entries[i] for i in idx[n_test + n_val:]],
               "validation": [entries[i] for i in idx[n_test:n_test + n_val]], "test": [entries[i] for i in idx[:n_test]]}
        (out / f"{name}.json").write_text(json.dumps(doc, indent=1))
    meta = {"task": "segmentation", "sites": names, "modalities": entries[0]["modalities"], "partition": partition,
            "region": region, "seed": seed,
            "site_samples": {n: [entries[i]["id"] for i in p] for n, p in zip(names, parts)}}
    if vols is not None:
        meta["site_volumes_mm3"] = {n: [float(vols[i]) for i in p] for n, p in zip(names, parts)}
    (out / "dataset.json").write_text(json.dumps(meta, indent=1))
    return out
