"""Segmentation federations from NIfTI subject folders (``004_`` Appendix D builder).

A subject folder holds one file per modality (matched by glob patterns), a label map and
optionally a brain mask. With ``hemispheres=True`` every subject gives two samples (its left and
right halves), which with the six BraTS-2013 subjects makes 12 samples.

Federations keep **subjects whole**: a subject's samples are all at one site, and a common held-out
**test set of whole subjects** (``test_fraction`` of the subjects) is scored by every site; the seed picks
the fold, so seeds 0, 1, 2 rotate the test subjects when data is this small. No subject is ever in both
training and test data (:func:`check_no_leakage` raises if it happens). Training subjects are sorted by
label volume and cut into contiguous sites (``004_`` Appendix D), so every site holds tumour.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from fedmed.data.images import DataError

__all__ = ["check_no_leakage", "discover_subjects", "subject_of", "write_seg_federation"]


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
            entries.append({**base, "region": region, "subject": d.name,
                            "id": d.name + ("" if region == "whole" else f"_{region[0].upper()}")})
    if not entries:
        raise DataError(f"{root}: no subject folder with a label matching {label_pattern!r}")
    return entries


def region_volume(entry: dict, region: str = "WT") -> float:
    """The lesion volume (mm^3) of one sample's region, from its label map (cropped as loaded)."""
    from fedmed.data.nifti import load_case

    case = load_case(entry, shape=(8, 8, 8), site="builder")
    return case["meta"]["volume_mm3"][region]


def subject_of(entry: dict) -> str:
    """The subject a sample comes from (its ``subject``, else its label file's folder)."""
    return str(entry.get("subject") or Path(str(entry["label"])).parent.name)


def check_no_leakage(training, test=None, where: str = "federation") -> None:
    """Raise when a subject has samples in two splits: ``training`` is a datalist (its ``training``, ``validation``
    and ``test`` splits, each pair checked) or, with ``test``, the training samples against the test samples.

    Raises:
        DataError: naming the subjects, the two splits (and ``where``).
    """
    splits = {"training": training, "test": test} if test is not None else \
        {k: training.get(k) or [] for k in ("training", "validation", "test")}
    names = list(splits)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            both = sorted({subject_of(e) for e in splits[a]} & {subject_of(e) for e in splits[b]})
            if both:
                raise DataError(f"{where}: subject(s) {both} are in both the {a} and the {b} data (subject leakage)",
                                f"{where}: {len(both)} subject(s) are in both the {a} and the {b} data (subject "
                                f"leakage; the site's log names them)")


def write_seg_federation(entries: list[dict], n_sites: int, out_dir, *, partition: str = "label_volume",
                         region: str = "WT", test_fraction: float = 0.25, val_fraction: float = 0.0, seed: int = 0,
                         site_names: list[str] | None = None) -> Path:
    """Split whole subjects into a common test set (fold ``seed``) and training sites; write ``<site>.json`` +
    ``dataset.json``.

    ``label_volume`` (``004_`` App. D): training subjects ordered by lesion volume (``region``), contiguous blocks
    form the sites, so the last site holds the largest lesions. ``iid``: a seeded random split of subjects.

    Raises:
        DataError: fewer training subjects than sites, or (never expected) a subject in training and test.
    """
    from fedmed.data.datalists import split_sizes

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    by_subject: dict[str, list[int]] = {}
    for i, e in enumerate(entries):
        by_subject.setdefault(subject_of(e), []).append(i)
    subjects = sorted(by_subject)
    n_test = min(max(1, int(round(test_fraction * len(subjects)))), len(subjects) - n_sites)
    if n_test < 1:
        raise DataError(f"{len(subjects)} subjects cannot give {n_sites} training sites and a test set")
    n_folds = max(1, len(subjects) // n_test)
    fold = int(seed) % n_folds
    test_subjects = subjects[fold * n_test:(fold + 1) * n_test]
    train_subjects = [s for s in subjects if s not in test_subjects]
    if partition == "label_volume":
        vols = {s: sum(region_volume(entries[i], region) for i in by_subject[s]) for s in train_subjects}
        order = sorted(train_subjects, key=lambda s: (vols[s], s))
        blocks = [list(b) for b in np.array_split(np.asarray(order, dtype=object), n_sites)]
    elif partition == "iid":
        vols = None
        rng = np.random.default_rng(seed)
        blocks = [list(b) for b in np.array_split(rng.permutation(np.asarray(train_subjects, dtype=object)), n_sites)]
    else:
        raise DataError(f"segmentation federations support partition label_volume or iid, got {partition!r}")
    names = list(site_names) if site_names else [f"site-{k + 1}" for k in range(n_sites)]
    test_entries = [entries[i] for s in test_subjects for i in by_subject[s]]
    for name, block in zip(names, blocks):
        if not block:
            raise DataError(f"{len(train_subjects)} training subjects cannot fill {n_sites} sites")
        n_val = split_sizes(len(block), 0.0, val_fraction)[1] if len(block) >= 3 else 0
        val_subj, train_subj = block[:n_val], block[n_val:]
        doc = {"site": name, "training": [entries[i] for s in train_subj for i in by_subject[s]],
               "validation": [entries[i] for s in val_subj for i in by_subject[s]], "test": test_entries}
        check_no_leakage(doc, where=name)
        (out / f"{name}.json").write_text(json.dumps(doc, indent=1))
    meta = {"task": "segmentation", "sites": names, "modalities": entries[0]["modalities"], "partition": partition,
            "region": region, "seed": seed, "fold": fold, "n_folds": n_folds, "test_subjects": test_subjects,
            "site_subjects": dict(zip(names, blocks)),
            "site_samples": {n: [entries[i]["id"] for s in b for i in by_subject[s]] for n, b in zip(names, blocks)}}
    if vols is not None:
        meta["site_volumes_mm3"] = {n: [float(vols[s]) for s in b] for n, b in zip(names, blocks)}
    (out / "dataset.json").write_text(json.dumps(meta, indent=1))
    return out
