"""A site's datalists: the split sizes, the patient-aware cuts into training, validation and test, the per-site
datalist files written and read back, and the check that no image or patient stands in two splits."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from fedmed.data.images import (SPLITS, DataError, ImagePool, check_input_file, file_problem, is_regular_file, read_array,
                                save_png)

__all__ = ["check_split_overlap", "load_datalist", "patients_of", "split_sizes", "write_site_datalists"]


def split_sizes(n: int, test_fraction: float, val_fraction: float) -> tuple[int, int]:
    """(n_test, n_val) of a site with ``n`` samples: ``round(test_fraction n)`` (at least one when
    ``n >= 2``), then ``round(val_fraction (n - n_test))`` of the rest (at least one when
    ``val_fraction > 0`` and at least three samples remain); training keeps at least one sample."""
    n_test = min(max(int(round(test_fraction * n)), 1), n - 1) if n >= 2 else 0
    rest = n - n_test
    n_val = 0
    if val_fraction > 0 and rest >= 3:
        n_val = min(max(int(round(val_fraction * rest)), 1), rest - 1)
    return n_test, n_val


def _patient_cuts(idx: np.ndarray, groups: list, n_test: int, n_val: int) -> tuple[np.ndarray, int, int]:
    """``idx`` reordered so that each patient's images are adjacent (patients in their shuffled order), and the test
    and validation cuts moved to patient boundaries: whole patients go to test until it holds at least ``n_test``
    images, then to validation likewise; training keeps at least one patient."""
    order = list(dict.fromkeys(groups))
    members = {g: [] for g in order}
    for i, g in zip(idx, groups):
        members[g].append(int(i))
    sizes = [len(members[g]) for g in order]
    cuts, at = [], 0
    for want in (n_test, n_val):
        got = 0
        while got < want and at < len(order) - 1:
            got += sizes[at]
            at += 1
        cuts.append(got)
    return np.asarray([i for g in order for i in members[g]], dtype=np.int64), cuts[0], cuts[1]


def write_site_datalists(pool: ImagePool, parts: Sequence[np.ndarray], out_dir, *, test_fraction: float = 0.2,
                         val_fraction: float = 0.0, seed: int = 0, site_names: Sequence[str] | None = None,
                         transforms: Sequence[Callable] | None = None, extra: dict | None = None,
                         common_test: np.ndarray | None = None, segmentation: bool = False) -> list[Path]:
    """Write one datalist per site (and ``dataset.json``) for a partition of ``pool``.

    Each site's samples are shuffled (seeded); :func:`split_sizes` gives its local ``test`` split and
    a ``validation`` split held out of its training data.
    ``transforms[k](array, label) -> (array, label)`` shifts site ``k``'s images (ANDA); shifted
    and array images are written as PNGs under ``out_dir/images/<site>/``. With ``common_test`` (indices into the
    pool, disjoint from every part) every site's ``test`` split is that common set and its own samples are split
    into validation and training only (``001_`` §4.3: one common test set in the global label space). A pool that
    knows its patients (``pool.groups``) is split by patient: no patient has images in two splits. ``segmentation``:
    each entry's label is its mask file (``pool.masks``) and its ``subject`` the patient (2D lesion segmentation).

    Returns:
        the site datalist paths.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = list(site_names) if site_names else [f"site-{k + 1}" for k in range(len(parts))]
    rng = np.random.default_rng(seed)
    paths = []
    common_entries = None
    if common_test is not None:
        common_entries = []
        for j, i in enumerate(np.asarray(common_test, dtype=np.int64)):
            item = pool.items[i]
            if isinstance(item, np.ndarray):
                target = out / "images" / "common_test" / f"{j:06d}_{int(i)}.png"
                save_png(read_array(item), target)
                item = str(target.relative_to(out))
            common_entries.append({"image": item, "label": int(pool.labels[i])})
    patients = pool.groups is not None and len(set(pool.groups)) < len(pool.groups)  # else each image is its own
    for k, (name, idx) in enumerate(zip(names, parts)):
        idx = rng.permutation(np.asarray(idx, dtype=np.int64))
        if common_entries is None:
            n_test, n_val = split_sizes(idx.size, test_fraction, val_fraction)
        else:
            n_test, n_val = 0, split_sizes(idx.size, 0.0, val_fraction)[1] if idx.size >= 3 else 0
        if pool.groups is not None:  # whole patients: the cuts move to the nearest patient boundary
            idx, n_test, n_val = _patient_cuts(idx, [pool.groups[i] for i in idx], n_test, n_val)
        entries = []
        for j, i in enumerate(idx):
            item, label = pool.items[i], int(pool.labels[i])
            tf = transforms[k] if transforms else None
            if tf is not None or isinstance(item, np.ndarray):
                arr = read_array(item)
                if tf is not None:
                    arr, label = tf(arr, label)
                target = out / "images" / name / f"{j:06d}_{int(i)}.png"
                save_png(arr, target)
                item = str(target.relative_to(out))  # relative to the datalist's folder (the default data root)
            if segmentation:  # 2D lesion segmentation: the mask is the label; the patient keeps the splits apart
                entries.append({"image": item, "label": pool.masks[i], "subject": pool.groups[i]})
            else:  # the patient, where the pool knows patients of several images: the plan's unit of evidence (#86)
                entries.append({"image": item, "label": label, **({"patient": pool.groups[i]} if patients else {})})
        doc = {"site": name, "training": entries[n_test + n_val:], "validation": entries[n_test:n_test + n_val],
               "test": entries[:n_test] if common_entries is None else common_entries}
        path = out / f"{name}.json"
        path.write_text(json.dumps(doc, indent=1))
        paths.append(path)
    meta = {"n_classes": pool.n_classes, "class_names": pool.class_names, "source": pool.source,
            "sites": names, **(extra or {})}
    (out / "dataset.json").write_text(json.dumps(meta, indent=1))
    return paths


def load_datalist(path, *, task: str = "classification", root=None, name: str | None = None,
                  public: str | None = None, limits=None, classes=None) -> dict:
    """Read and validate a site datalist (``task="segmentation"``: ``image`` may be a list of
    files and ``label`` a label-map file). Relative paths are resolved against ``root`` (default: the
    datalist's folder). ``name`` is how the site's log calls the file (default: its path), ``public`` how a message
    that leaves the site does (default: "datalist"): errors name the split and position, never an entry's content.

    Raises:
        DataError: missing file, bad JSON, missing keys or malformed entries (naming the file and
            the first bad entry; its ``public`` names the position only).
    """
    path = Path(path)
    name = name or str(path)
    public = public or "datalist"
    root = Path(root) if root is not None else path.parent
    what = file_problem(path)
    if what:
        raise DataError(f"{name}: datalist {what}", f"{public}: {what}")
    check_input_file(path, limits, public=f"{public}:")
    try:
        doc = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{name}: not valid JSON ({e})", f"{public}: not valid JSON ({type(e).__name__}"
                        + (f" at line {e.lineno} column {e.colno})" if isinstance(e, json.JSONDecodeError) else ")")) \
            from None
    if not isinstance(doc, dict) or "training" not in doc:
        raise DataError(f"{name}: datalist should be an object with a 'training' list",
                        f"{public}: should be an object with a 'training' list")
    unknown = sorted(k for k in doc if isinstance(doc.get(k), list) and k not in SPLITS)
    if unknown:
        raise DataError(f"{name}: unknown split(s) {unknown}; a datalist has {list(SPLITS)} "
                        f"('validation' is held out of training for selection, 'test' is what is reported)",
                        f"{public}: {len(unknown)} list(s) that are not splits; a datalist has {list(SPLITS)} "
                        f"(the site's log names them)")
    for key in SPLITS:
        entries = doc.setdefault(key, [])
        if not isinstance(entries, list):
            raise DataError(f"{name}: '{key}' should be a list", f"{public}: '{key}' should be a list")
        for j, e in enumerate(entries):
            if not isinstance(e, dict) or "image" not in e or "label" not in e:
                raise DataError(f"{name}: {key}[{j}] should have 'image' and 'label', got {e!r}",
                                f"{public}: {key}[{j}] should have 'image' and 'label'")
            files = ("image", "label", "mask") if task == "segmentation" else ("image",)
            for k in files:
                v = e.get(k)
                if k in e and not (_file_entry(v) or (k == "image" and task == "segmentation" and isinstance(v, list)
                                                      and v and all(_file_entry(x) for x in v))):
                    got = "null" if v is None else f"a {type(v).__name__}"
                    raise DataError(f"{name}: {key}[{j}] '{k}' should be a file (a path relative to the data root), "
                                    f"got {v!r:.60} (the entry: {e!r:.200})", f"{public}: {key}[{j}] '{k}' should be "
                                    f"a file (a path), got {got}")
            e.update({k: _resolve(e[k], root) for k in files if k in e})
            for k in ("patient", "subject"):
                if k in e and (isinstance(e[k], bool) or not isinstance(e[k], (str, int)) or e[k] == ""):
                    raise DataError(f"{name}: {key}[{j}] '{k}' should be a patient id (a string or an integer), got "
                                    f"{e[k]!r:.60}", f"{public}: {key}[{j}] '{k}' should be a patient id (a string or "
                                    f"an integer)")
            if task == "segmentation":
                continue
            if isinstance(e["label"], str) and classes:  # a class name: its index in the job's classes
                if e["label"] not in classes:
                    raise DataError(f"{name}: {key}[{j}] label {e['label']!r} is not one of the job's classes "
                                    f"{list(classes)}", f"{public}: {key}[{j}] label is a name that is not one of "
                                    f"the job's classes")
                e["label"] = list(classes).index(e["label"])
            if isinstance(e["label"], bool) or not isinstance(e["label"], int) or e["label"] < 0:
                raise DataError(f"{name}: {key}[{j}] label should be a non-negative integer (or a class name when "
                                f"the job names its classes), got {e['label']!r}",
                                f"{public}: {key}[{j}] label should be a non-negative integer class id or a class "
                                f"name")
    check_split_overlap(doc, name, root, public=public, limits=limits)
    return doc


def patients_of(entries) -> list | None:
    """Each entry's patient (its ``patient``, else its ``subject``), in order; ``None`` unless every entry names one
    (each image is then its own unit of evidence: the serving plan, #86)."""
    units = [e.get("patient", e.get("subject")) for e in entries]
    return None if not units or any(u is None for u in units) else units


def _sample_files(e: dict) -> list[str]:
    return [str(f) for f in (e["image"] if isinstance(e["image"], list) else [e["image"]])]


def _content_hash(files, cache: dict, max_bytes: int) -> str | None:
    """The files' content hash, read in 1 MiB chunks (memory stays bounded whatever the file's size); None when one
    is missing, not a regular file or larger than ``max_bytes`` (each refused, naming it, when the images are read)."""
    import hashlib
    import os

    h = hashlib.sha1()
    for f in files:
        if f not in cache:
            try:
                if not is_regular_file(f):  # a FIFO or a device is refused, naming it, when the images are read
                    raise OSError("not a regular file")
                if os.stat(f).st_size > max_bytes:  # refused when read (max_file_bytes): never read for a hash
                    raise OSError("larger than the site reads")
                fh_hash = hashlib.sha1()
                with open(f, "rb") as fh:
                    for chunk in iter(lambda: fh.read(1 << 20), b""):
                        fh_hash.update(chunk)
                cache[f] = fh_hash.hexdigest()
            except OSError:  # a missing file is reported, naming it, when the images are read
                cache[f] = None
        if cache[f] is None:
            return None
        h.update(cache[f].encode())
    return h.hexdigest()


def check_split_overlap(doc: dict, name: str, root, public: str = "datalist", limits=None) -> None:
    """No sample in two splits of one datalist — by path or by identical file content: a test image that was also
    trained on (or selected on) inflates every score. Raises a :class:`DataError` naming the first such images
    relative to the data root (never an absolute path) and the splits. Files are hashed in chunks; one larger than
    ``limits.max_file_bytes`` is never read (it is refused when the images are read)."""
    import os

    from fedmed.core.policy import ReadLimits

    max_bytes = (limits or ReadLimits()).max_file_bytes
    seen: dict = {}
    cache: dict = {}
    clashes = []
    for split in SPLITS:
        for e in doc.get(split, []):
            files = _sample_files(e)
            region = (e["region"],) if "region" in e else ()  # a hemisphere of a volume is its own sample
            digest = _content_hash(files, cache, max_bytes)
            ids = [("path", tuple(files) + region)] + ([("content", (digest,) + region)] if digest else [])
            for kind, k in ids:
                first = seen.setdefault(k, (split, e["image"], len(seen)))
                if first[0] != split:
                    clashes.append((first, (split, e["image"], doc[split].index(e)), kind))
                    break

    if clashes:
        def show(img):
            f = img[0] if isinstance(img, list) else img
            rel = os.path.relpath(f, root) if root is not None else Path(f).name
            return Path(f).name if rel.startswith("..") else rel

        (s1, a, i1), (s2, b, i2), kind = clashes[0]
        i1 = next((j for j, e in enumerate(doc[s1]) if e["image"] == a), i1)
        same = show(a) if kind == "path" else f"{show(a)} and {show(b)} (identical files)"
        more = f" (and {len(clashes) - 1} more)" if len(clashes) > 1 else ""
        why = "a test or validation image that is also trained on inflates every score; keep each image in one split"
        raise DataError(f"{name}: the same image in {s1} and {s2}: {same}{more} — {why}",
                        f"{public}: the same image in {s1}[{i1}] and {s2}[{i2}]"
                        f"{' (identical files)' if kind != 'path' else ''}{more} — {why}")


def _file_entry(v) -> bool:
    return isinstance(v, str) and bool(v.strip()) and "\x00" not in v


def _resolve(v, root: Path):
    if isinstance(v, list):
        return [_resolve(x, root) for x in v]
    if isinstance(v, str) and v and not Path(v).is_absolute():
        return str(root / v)
    return v
