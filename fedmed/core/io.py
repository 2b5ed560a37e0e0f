"""Small file formats: distance-matrix CSVs and per-site signature ``.npz`` files."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

__all__ = ["json_default", "read_distance_csv", "read_signature_dir", "readable", "shown_path", "write_distance_csv"]


def read_distance_csv(path) -> tuple[list[str], np.ndarray]:
    """A square matrix whose header row and first column are the site names.

    Raises:
        ValueError: naming the file and what is wrong (missing file, ragged rows, names that do
            not match, non-numeric cells).
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: distance matrix file not found.")
    with path.open(newline="") as fh:
        rows = [r for r in csv.reader(fh) if any(c.strip() for c in r)]
    if len(rows) < 2:
        raise ValueError(f"{path}: expected a header row and at least one row of distances, got {len(rows)} rows.")
    header = [c.strip() for c in rows[0][1:]]
    names, values = [], []
    for ln, r in enumerate(rows[1:], start=2):
        if len(r) != len(header) + 1:
            raise ValueError(f"{path}:{ln}: expected {len(header) + 1} cells (site name + {len(header)} distances), got {len(r)}.")
        names.append(r[0].strip())
        try:
            values.append([float(c) for c in r[1:]])
        except ValueError as e:
            raise ValueError(f"{path}:{ln}: non-numeric distance ({e}).") from None
    if names != header:
        raise ValueError(f"{path}: first-column site names {names} should equal the header {header}.")
    if any(not n for n in names):
        raise ValueError(f"{path}: a site name is empty.")
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"{path}: site names should be unique, got duplicates {dup}.")
    return names, np.asarray(values, dtype=np.float64)


def write_distance_csv(path, names, D) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["site", *names])
        for n, row in zip(names, np.asarray(D)):
            w.writerow([n, *[repr(float(x)) for x in row]])


def read_signature_dir(directory, required: tuple[str, ...] = ()) -> dict[str, dict[str, np.ndarray]]:
    """``<site>.npz`` files of a folder, sorted by site name, each as a dict of arrays."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"{directory}: signature folder not found.")
    files = sorted(directory.glob("*.npz"))
    if not files:
        raise ValueError(f"{directory}: no <site>.npz signature files found.")
    out = {}
    for f in files:
        try:
            with np.load(f, allow_pickle=False) as z:
                arrs = {k: z[k] for k in z.files}
        except Exception as e:  # a corrupt or non-npz file
            raise ValueError(f"{f}: not a readable .npz file ({type(e).__name__}: {e}).") from None
        missing = [k for k in required if k not in arrs]
        if missing:
            raise ValueError(f"{f}: missing arrays {missing} (has {sorted(arrs)}).")
        out[f.stem] = arrs
    return out


def json_default(o):
    """``json.dumps(default=...)`` for numpy arrays and scalars and paths."""
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, (np.integer, np.floating, np.bool_)):
        return o.item()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"{type(o).__name__} is not JSON serialisable")


def shown_path(path, out_dir=None) -> str:
    """A data path as a report shows it: as given when relative, else relative to the working folder or the output
    folder, else ``.../<name>`` — a report never carries an absolute path (a hospital's folder names)."""
    p = Path(str(path))
    if str(path).startswith("builtin:") or not p.is_absolute():
        return str(path)
    for base in (Path.cwd(), out_dir):
        if base is None:
            continue
        try:
            return str(p.resolve().relative_to(Path(base).resolve()))
        except (ValueError, OSError):
            pass
    return f".../{p.name}"


def readable(v, digits: int = 3) -> str:
    """A number as a report shows it to a reader: thousands separated and no exponent (``2,670``, not ``2.67e+03``),
    counts without decimals (``1,634``, not ``1634.00``), small values to ``digits`` significant digits (``0.0412``)."""
    import math

    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "n/a"
    v = float(v)
    if v == 0:
        return "0"
    if abs(v) >= 10 ** (digits - 1) or float(v).is_integer():
        return f"{v:,.0f}"
    if abs(v) >= 1e-4:
        decimals = max(digits - 1 - int(math.floor(math.log10(abs(v)))), 0)
        return f"{v:,.{decimals}f}"
    return f"{v:.{digits - 1}e}"
