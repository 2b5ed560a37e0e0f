"""Datasets of several sources (hospitals, scanners): a hospital-style index CSV, or a folder of class folders that is
one source of its own, pooled into one :class:`~fedmed.data.images.ImagePool` that knows each image's source and
patient.

An index CSV has a row per image: ``image`` (relative to the CSV's folder), ``label`` (a class name, or an integer
index into the dataset's classes), ``site`` (the source), a patient or case id (``patient``, else ``case``; two views
of one lesion share it), optionally ``mask``; any other column is ignored. BUS-BRA's ``index.csv`` is such a file.
A patient belongs to one source: a federation is split by patient, never by image (two images of one patient in
different splits would put a test patient in training).

Every problem is one line naming the file (and the row or patient): a missing column, a label outside the classes,
one patient at two sites, a source name FLARE cannot take as a client name.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Sequence

import numpy as np

from fedmed.core.validation import SITE_NAME
from fedmed.data.images import DataError, ImagePool, discover

__all__ = ["PATIENT_COLUMNS", "read_index", "read_folder_source", "read_sources"]

PATIENT_COLUMNS = ("patient", "case")  # looked for in this order when a source names no patient column


def _label_index(value: str, classes: Sequence[str] | None, ignore: Sequence[str], where: str):
    """The class index of a label cell, or None for an ignored label."""
    v = value.strip()
    if v in ignore:
        return None
    if classes is not None and v in classes:
        return list(classes).index(v)
    try:
        i = int(v)
    except ValueError:
        raise DataError(f"{where}: label {v!r} is not one of the classes {list(classes or [])}"
                        + (f" (ignored: {list(ignore)})" if ignore else "")) from None
    if classes is None and i >= 0:  # no classes named: integer labels are class ids (a segmentation index)
        return i
    if classes is None or not 0 <= i < len(classes):
        raise DataError(f"{where}: label {i} is outside the classes {list(classes or [])} (an integer label is an "
                        f"index into dataset.classes)")
    return i


def read_index(path, *, classes: Sequence[str] | None = None, image_column: str = "image", label_column: str = "label",
               site_column: str = "site", patient_column: str | None = None, mask_column: str | None = None,
               site: str | None = None, ignore_labels: Sequence[str] = (), drop_sites: Sequence[str] = ()) -> ImagePool:
    """An index CSV as a pool with ``sites`` (the ``site_column``, or ``site`` for every row), ``groups`` (the patient
    ids, as ``<site>/<id>``) and, with ``mask_column``, ``masks``. Rows whose label is in ``ignore_labels`` are left
    out (said in one line).

    Raises:
        DataError: the file is missing or not a CSV; a column is missing (the columns it has are listed); a label is
            outside ``classes``; one patient appears at two sites; a site name FLARE cannot take.
    """
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{p}: index file not found")
    try:
        with p.open(newline="") as fh:
            rows = list(csv.DictReader(fh))
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise DataError(f"{p}: not a readable CSV index ({type(e).__name__}: {e})") from None
    if not rows:
        raise DataError(f"{p}: the index has no rows")
    cols = list(rows[0].keys())
    if patient_column is None:
        patient_column = next((c for c in PATIENT_COLUMNS if c in cols), None)
    needed = [c for c in (image_column, label_column, None if site else site_column, patient_column, mask_column) if c]
    missing = [c for c in needed if c not in cols]
    if missing:
        raise DataError(f"{p}: no column {missing[0]!r} (the index has {cols}; an index needs {image_column!r}, "
                        f"{label_column!r}, {site_column!r} and a patient or case column)")
    if patient_column is None:
        raise DataError(f"{p}: no patient column (looked for {list(PATIENT_COLUMNS)}; the index has {cols}): a "
                        f"federation is split by patient, so an index names each image's patient or case")
    items, labels, sites, groups, masks = [], [], [], [], []
    where_patient: dict[str, tuple[str, int]] = {}
    ignored = 0
    drop, dropped = set(drop_sites), {}
    for j, r in enumerate(rows, start=2):  # row 1 is the header
        where = f"{p} row {j}"
        s = site or (r.get(site_column) or "").strip()
        if s in drop:
            dropped[s] = dropped.get(s, 0) + 1
            continue
        if not SITE_NAME.fullmatch(s or ""):
            raise DataError(f"{where}: site {s!r} cannot name a FLARE site (letters, digits, '-' and '_')")
        pid = (r.get(patient_column) or "").strip()
        if not pid:
            raise DataError(f"{where}: empty {patient_column!r}")
        first = where_patient.setdefault(pid, (s, j))
        if first[0] != s:
            raise DataError(f"{p}: patient {pid!r} appears at two sites ({first[0]!r} row {first[1]}, {s!r} row {j}); "
                            f"a patient's images belong to one site")
        lab = _label_index(r.get(label_column) or "", classes, ignore_labels, where)
        if lab is None:
            ignored += 1
            continue
        img = (r.get(image_column) or "").strip()
        if not img:
            raise DataError(f"{where}: empty {image_column!r}")
        items.append(str((p.parent / img).resolve()))
        labels.append(lab)
        sites.append(s)
        groups.append(f"{s}/{pid}")
        if mask_column:
            m = (r.get(mask_column) or "").strip()
            masks.append(str((p.parent / m).resolve()) if m else None)
    if drop - set(dropped):
        raise DataError(f"{p}: drop_sites names {sorted(drop - set(dropped))}, which the index does not have")
    if dropped:
        print(f"[fedmed] {p}: site(s) dropped by drop_sites: "
              + ", ".join(f"{s} ({n} row(s))" for s, n in sorted(dropped.items())), flush=True)
    if ignored:
        print(f"[fedmed] {p}: {ignored} row(s) with an ignored label {list(ignore_labels)} left out", flush=True)
    if not items:
        raise DataError(f"{p}: no rows left after ignoring labels {list(ignore_labels)}")
    names = list(classes) if classes is not None else [str(c) for c in range(max(labels) + 1)]
    return ImagePool(items, np.asarray(labels, dtype=np.int64), names, str(p), sites=sites, groups=groups,
                     masks=masks if mask_column else None)


def read_folder_source(path, site: str, *, classes: Sequence[str] | None = None,
                       ignore_labels: Sequence[str] = ()) -> ImagePool:
    """A folder of class folders as one source named ``site``; with no patient ids, each image is its own patient
    (BUSI publishes none)."""
    if not SITE_NAME.fullmatch(site):
        raise DataError(f"{path}: source name {site!r} cannot name a FLARE site")
    pool = discover(str(path))
    keep = [i for i, c in enumerate(pool.labels) if pool.class_names[c] not in ignore_labels]
    if len(keep) < len(pool.items):
        print(f"[fedmed] {path}: {len(pool.items) - len(keep)} image(s) with an ignored label {list(ignore_labels)} "
              f"left out", flush=True)
    pool = pool.subset(np.asarray(keep, dtype=np.int64))
    names = list(classes) if classes is not None else [c for c in pool.class_names if c not in ignore_labels]
    found = sorted({pool.class_names[c] for c in pool.labels})
    outside = [c for c in found if c not in names]
    if outside:
        raise DataError(f"{path}: class folder(s) {outside} are not among the classes {names} (name them in "
                        f"dataset.classes, or in the source's ignore_labels)")
    labels = np.asarray([names.index(pool.class_names[c]) for c in pool.labels], dtype=np.int64)
    return ImagePool(pool.items, labels, names, str(path), sites=[site] * len(labels),
                     groups=[f"{site}/{Path(f).name}" for f in pool.items])


def read_sources(sources, classes: Sequence[str] | None = None) -> ImagePool:
    """The pool of several sources (``dataset.sources``: each an index CSV or a folder with its ``site``).

    Raises:
        DataError: a source's own error, or two sources naming the same site.
    """
    from fedmed.data.images import drop_exact_duplicates

    if classes is None and len(sources) > 1:
        raise DataError("dataset.sources: several sources need dataset.classes (the label order they share)")
    pools = []
    for s in sources:
        p = Path(s.path)
        if p.is_file() and p.suffix.lower() == ".csv":
            pools.append(read_index(p, classes=classes, image_column=s.image_column, label_column=s.label_column,
                                    site_column=s.site_column, patient_column=s.patient_column,
                                    mask_column=s.mask_column, site=s.site, ignore_labels=s.ignore_labels,
                                    drop_sites=getattr(s, "drop_sites", ())))
        elif p.is_dir():
            if getattr(s, "drop_sites", None):
                raise DataError(f"{p}: a folder source is one site; leave the source out of dataset.sources instead "
                                f"of drop_sites")
            if not s.site:
                raise DataError(f"{p}: a folder source needs its site name (site: NAME)")
            pools.append(read_folder_source(p, s.site, classes=classes, ignore_labels=s.ignore_labels))
        else:
            raise DataError(f"{p}: a source is an index .csv or a folder of class folders (not found or neither)")
    seen: dict[str, str] = {}
    for pool in pools:
        for site in sorted(set(pool.sites)):
            if site in seen and seen[site] != pool.source:
                raise DataError(f"site {site!r} is named by two sources ({seen[site]} and {pool.source})")
            seen[site] = pool.source
    names = pools[0].class_names
    masks = None
    if any(p.masks is not None for p in pools):
        masks = [m for p in pools for m in (p.masks if p.masks is not None else [None] * len(p.items))]
    pool = ImagePool([x for p in pools for x in p.items], np.concatenate([p.labels for p in pools]), names,
                     " + ".join(p.source for p in pools), sites=[x for p in pools for x in p.sites],
                     groups=[x for p in pools for x in p.groups], masks=masks)
    return drop_exact_duplicates(pool)
