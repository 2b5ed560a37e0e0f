"""A site checks its data before it joins (``fedmed check-data DATALIST``): every check its first task runs, and more,
in one report that stays at the site.

Problems (the site cannot join as it is; its first task would fail on the first of them): a datalist that does not
parse, an image in two splits (by path or identical content), an unreadable image (each one named, not only the
first), a label outside the job's classes, an empty training split, fewer training images than ``k_min``; for
segmentation a missing file, a DICOM series that is not a regular 3-D volume (slices of different orientations,
a missing or doubled slice: :func:`fedmed.data.nifti.series_geometry_problem`), a DICOM-SEG label that does not fit
its series, or an image whose shape differs from its label map's. Warnings (it can join; the
report says what would happen): near-duplicate images across splits (:func:`fedmed.data.images.near_duplicates`),
classes with fewer than ``k_min`` training images (withheld from signatures), a split that is empty. Counts per class
and split. Paths are shown relative to the datalist's data root.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

__all__ = ["check_datalist", "format_report"]


def _show(f, root: Path) -> str:
    rel = os.path.relpath(str(f), str(root))
    return Path(f).name if rel.startswith("..") else rel


def check_datalist(path, *, task: str = "classification", classes: list[str] | None = None, image_size: int = 32,
                   channels: int = 1, k_min: int = 1, near_threshold: float = 0.98, root=None, policy=None) -> dict:
    """The report of one site datalist (see the module notes): ``{"datalist", "task", "counts", "problems",
    "warnings", "near_duplicates"}``; ``counts[split][class] = n``. ``policy``: the site's
    (:class:`~fedmed.core.policy.SitePolicy`; default: fedmed's defaults): what a task may decode, in pixels per image
    and in bytes in all, is what the check may (a size beyond it is the report's problem, decoded never)."""
    from fedmed.core.policy import PolicyError, SitePolicy
    from fedmed.data.images import DataError
    from fedmed.data.datalists import load_datalist

    policy = policy or SitePolicy()
    path = Path(path)
    root = Path(root) if root is not None else path.parent
    rep: dict = {"datalist": path.name, "task": task, "counts": {}, "problems": [], "warnings": [],
                 "near_duplicates": []}
    try:
        doc = load_datalist(path, task=task, root=root, name=path.name, classes=classes, limits=policy.limits)
        if task != "segmentation":
            policy.check_task_sizes({"image_size": image_size, "channels": channels})
            policy.check_task_bytes(sum(len(doc[k]) for k in ("training", "validation", "test")),
                                    image_size * image_size * channels, f"the images at {image_size}x{image_size}")
    except (DataError, PolicyError) as e:
        rep["problems"].append(str(e))
        return rep
    if task == "segmentation":
        _check_seg(doc, root, rep)
    else:
        _check_classification(doc, root, rep, classes, image_size, channels, k_min, near_threshold, policy.limits)
    return rep


def _check_classification(doc, root, rep, classes, image_size, channels, k_min, near_threshold, limits=None):
    import torch

    from fedmed.data.images import DataError, decode_image, near_duplicates

    names = list(classes) if classes else None
    loaded = {}
    for split in ("training", "validation", "test"):
        entries = doc[split]
        counts: dict = {}
        xs = []
        for e in entries:
            label = int(e["label"])
            counts[names[label] if names and label < len(names) else str(label)] = counts.get(
                names[label] if names and label < len(names) else str(label), 0) + 1
            if names is not None and label >= len(names):
                rep["problems"].append(f"{split}: {_show(e['image'], root)} has label {label}, outside the job's "
                                       f"classes 0..{len(names) - 1} ({', '.join(names)})")
            try:
                arr, _ = decode_image(e["image"], image_size=image_size, channels=channels, limits=limits)
                xs.append(arr)
            except FileNotFoundError:
                rep["problems"].append(f"{split}: cannot read image {_show(e['image'], root)} (file not found)")
            except DataError as err:  # e.g. a multi-frame file; the message names no path
                rep["problems"].append(f"{split}: image {_show(e['image'], root)} {err}")
            except (OSError, ValueError) as err:  # PIL's messages carry the absolute path: the kind only
                rep["problems"].append(f"{split}: cannot read image {_show(e['image'], root)} (corrupt or not an "
                                       f"image: {type(err).__name__})")
        rep["counts"][split] = dict(sorted(counts.items()))
        loaded[split] = (torch.from_numpy(np.ascontiguousarray(np.stack(xs))) if xs else torch.zeros((0, channels, image_size, image_size)),
                         [e for e in entries])
        if not entries:
            (rep["problems"] if split == "training" else rep["warnings"]).append(f"{split}: empty")
    n_train = sum(rep["counts"]["training"].values())
    if 0 < n_train < k_min:
        rep["problems"].append(f"training: {n_train} image(s), fewer than k_min={k_min}: the site would sit out "
                               f"every training task (privacy.k_min)")
    few = [c for c, n in rep["counts"]["training"].items() if n < k_min]
    if few:
        rep["warnings"].append(f"training: class(es) {few} have fewer than k_min={k_min} images: withheld from "
                               f"signatures and class statistics")
    if any("cannot read" in p for p in rep["problems"]):
        return  # thumbnails would not line up with the entries
    xtr, etr = loaded["training"]
    for split in ("validation", "test"):
        x, ents = loaded[split]
        for i, j, r in near_duplicates(xtr, x, threshold=near_threshold):
            rep["near_duplicates"].append({"training": _show(etr[i]["image"], root), split: _show(ents[j]["image"], root),
                                           "r": round(r, 4)})
    if rep["near_duplicates"]:
        rep["warnings"].append(f"{len(rep['near_duplicates'])} validation/test image(s) nearly identical to training "
                               f"images (thumbnail correlation >= {near_threshold}); listed under near_duplicates: "
                               f"scores on them are inflated")


def _check_seg(doc, root, rep):
    from fedmed.data.images import DataError
    from fedmed.data.nifti import _to_orientation, is_dicom_seg, load_label, load_volume

    for split in ("training", "validation", "test"):
        rep["counts"][split] = {"cases": len(doc[split])}
        for e in doc[split]:
            images = e["image"] if isinstance(e["image"], list) else [e["image"]]
            vols = {}
            for f in images + ([e["mask"]] if e.get("mask") else []):
                try:
                    vols[f] = load_volume(f, "", "brain mask" if f == e.get("mask") else "image")
                except DataError as err:
                    rep["problems"].append(f"{split}: {_show(f, root)}: {_why(err, f)}")
            ref = vols.get(images[0]) if images else None  # a DICOM-SEG label is placed on the first image's grid
            try:
                if ref is not None:
                    vols[e["label"]] = load_label(e["label"], "", ref[0].shape, ref[1], images[0])
                elif not is_dicom_seg(e["label"]):  # a SEG without its image cannot be checked further
                    vols[e["label"]] = load_volume(e["label"], "", "label")
            except DataError as err:
                rep["problems"].append(f"{split}: {_show(e['label'], root)}: {_why(err, e['label'])}")
            if e["label"] in vols:  # shapes in the label map's orientation, as a site loads the case
                lab_aff = vols[e["label"]][1]
                shapes = {f: _to_orientation(a, aff, lab_aff).shape for f, (a, aff) in vols.items()}
                if len(set(shapes.values())) > 1:
                    rep["problems"].append(f"{split}: {_show(e['label'], root)}: image and label shapes differ ("
                                           + ", ".join(f"{_show(f, root)} {s}" for f, s in shapes.items()) + ")")
    if not doc["training"]:
        rep["problems"].append("training: empty")


def _why(err, f) -> str:
    """What is wrong with a volume, in the loader's words without its (absolute) path (its ``public`` text: not found,
    not a NIfTI file, unreadable voxels, not 3-D, too many voxels, a DICOM series or SEG that is not a regular
    volume, ...)."""
    full = str(err)
    if "is not a 3-D volume: " in full:  # the series' geometry, as the check has always said it
        return "DICOM series is not a 3-D volume: " + full.split("is not a 3-D volume: ", 1)[1]
    if "DICOM-SEG label" in full:
        return "DICOM-SEG label " + full.split(str(f), 1)[-1].strip()
    msg = (getattr(err, "public", None) or "").lstrip(": ").strip()
    if not msg:
        kind = "DICOM series" if Path(f).is_dir() else "NIfTI image or DICOM-SEG label"
        return f"missing or not a readable {kind}"
    return msg[4:] if msg.startswith("its ") else msg


def format_report(rep: dict) -> str:
    """The report as the site's data manager reads it."""
    lines = [f"{rep['datalist']} ({rep['task']}):"]
    for split, counts in rep["counts"].items():
        lines.append(f"  {split}: {sum(counts.values())} " + ("case(s)" if rep["task"] == "segmentation" else
                     "image(s)" + (f" — {', '.join(f'{c}: {n}' for c, n in counts.items())}" if counts else "")))
    for p in rep["problems"]:
        lines.append(f"  PROBLEM: {p}")
    for w in rep["warnings"]:
        lines.append(f"  warning: {w}")
    for d in rep["near_duplicates"][:20]:
        other = next(k for k in d if k not in ("training", "r"))
        lines.append(f"    near-duplicate: training {d['training']} ~ {other} {d[other]} (r = {d['r']})")
    lines.append("  ready to join" if not rep["problems"] else f"  not ready: {len(rep['problems'])} problem(s)")
    return "\n".join(lines)
