"""Boundary checks shared by every public function.

Every error names the parameter (or file/site) and what was wrong, in the MONAI style
``ValueError(f"... should ..., got {x}.")``. ``raise``, never ``assert``.
"""

from __future__ import annotations

import math
import re
from typing import Sequence

import numpy as np

__all__ = [
    "check_distance_matrix",
    "check_finite_number",
    "check_federation_site_names",
    "check_site_names",
]


def check_finite_number(value, name: str, *, low: float | None = None, high: float | None = None,
                        low_inclusive: bool = True, integer: bool = False) -> float:
    """Reject bool, NaN, inf and out-of-range values for a numeric hyperparameter.

    Raises:
        TypeError: ``value`` is not a real number (bools are rejected on purpose).
        ValueError: ``value`` is not finite or outside ``[low, high]``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} should be a number, got {type(value).__name__} {value!r}.")
    if integer and int(value) != value:
        raise ValueError(f"{name} should be an integer, got {value!r}.")
    if not math.isfinite(float(value)):
        raise ValueError(f"{name} should be finite, got {value!r}.")
    if low is not None:
        if (low_inclusive and value < low) or (not low_inclusive and value <= low):
            op = ">=" if low_inclusive else ">"
            raise ValueError(f"{name} should be {op} {low}, got {value!r}.")
    if high is not None and value > high:
        raise ValueError(f"{name} should be <= {high}, got {value!r}.")
    return value


# a site's name as FLARE accepts a client's (nvflare.apis.utils.format_check: "client"; tests/test_jobs.py compares)
SITE_NAME = re.compile(r"^[A-Za-z0-9_-]+$")


def check_site_names(names: Sequence[str] | None, n: int, what: str = "site_names") -> list[str]:
    """Default to ``site-1 .. site-n``; otherwise require ``n`` unique names."""
    if names is None:
        return [f"site-{i + 1}" for i in range(n)]
    names = [str(s) for s in names]
    if len(names) != n:
        raise ValueError(f"{what} should have {n} entries (one per site), got {len(names)}.")
    if len(set(names)) != n:
        dup = sorted({s for s in names if names.count(s) > 1})
        raise ValueError(f"{what} should be unique, got duplicates {dup}.")
    return names


def check_federation_site_names(names: Sequence[str], what: str = "site names") -> list[str]:
    """Names a federation can give its sites (FLARE's rule for a client: letters, digits, ``-`` and ``_``; no space,
    no newline, no path), each once — checked when a job is built, not when a site fails to register."""
    names = [s if isinstance(s, str) else repr(s) for s in names]
    bad = [s for s in names if not SITE_NAME.fullmatch(s)]
    if bad:
        raise ValueError(f"{what}: {bad[0]!r} is not a site name FLARE accepts (letters, digits, '-' and '_' only)")
    dup = sorted({s for s in names if names.count(s) > 1})
    if dup:
        raise ValueError(f"{what} names {', '.join(dup)} more than once; name each site once")
    return names


def check_distance_matrix(D, name: str = "distance matrix", *, symmetric: bool = True,
                          min_sites: int = 2, atol: float = 1e-8) -> np.ndarray:
    """Validate a site-by-site distance matrix and return it as float64.

    Checks, in order: 2-D and square, at least ``min_sites`` sites, finite, non-negative,
    zero diagonal, symmetric (within ``atol`` scaled by the largest entry).

    Raises:
        ValueError: naming the first problem found, e.g. ``"distance matrix should be
            symmetric, got D[0, 2]=1.0 but D[2, 0]=3.0."``
    """
    D = np.asarray(D, dtype=np.float64)
    if D.ndim != 2 or D.shape[0] != D.shape[1]:
        raise ValueError(f"{name} should be a square (N, N) matrix, got shape {D.shape}.")
    n = D.shape[0]
    if n < min_sites:
        raise ValueError(f"{name} should cover at least {min_sites} sites, got {n}.")
    # one pass in row blocks (no (N, N) temporaries; 10,000 sites validate in about a second); on a failure, the
    # whole-matrix checks below find the first problem and word the error
    block = 1024
    ok, top = True, 0.0
    for b0 in range(0, n, block):
        rows = D[b0:b0 + block]
        lo, hi = float(rows.min()), float(rows.max())  # nan propagates
        if not (np.isfinite(lo) and np.isfinite(hi)) or lo < 0:
            ok = False
            break
        top = max(top, hi)
    scale = max(1.0, top)
    if ok and (np.abs(np.diag(D)) > atol * scale).any():
        ok = False
    if ok and not symmetric:
        return D
    if ok:
        out = np.empty_like(D)
        for b0 in range(0, n, block):
            b1 = min(n, b0 + block)
            for c0 in range(b0, n, block):
                c1 = min(n, c0 + block)
                a, b = D[b0:b1, c0:c1], D[c0:c1, b0:b1].T
                if (np.abs(a - b) > atol * scale).any():
                    ok = False
                    break
                avg = (a + b) / 2.0
                out[b0:b1, c0:c1] = avg
                out[c0:c1, b0:b1] = avg.T
            if not ok:
                break
        if ok:
            return out
    return _distance_matrix_error(D, name, symmetric, atol)


def _distance_matrix_error(D: np.ndarray, name: str, symmetric: bool, atol: float) -> np.ndarray:
    """The whole-matrix checks of :func:`check_distance_matrix`, in order, raising on the first problem found."""
    bad = ~np.isfinite(D)
    if bad.any():
        i, j = np.argwhere(bad)[0]
        raise ValueError(f"{name} should be finite, got D[{i}, {j}]={D[i, j]}.")
    if (D < 0).any():
        i, j = np.argwhere(D < 0)[0]
        raise ValueError(f"{name} should be non-negative, got D[{i}, {j}]={D[i, j]}.")
    diag = np.abs(np.diag(D))
    scale = max(1.0, float(D.max()))
    if (diag > atol * scale).any():
        i = int(np.argmax(diag))
        raise ValueError(f"{name} should have a zero diagonal, got D[{i}, {i}]={D[i, i]}.")
    if symmetric:
        asym = np.abs(D - D.T)
        if (asym > atol * scale).any():
            i, j = np.unravel_index(int(np.argmax(asym)), asym.shape)
            raise ValueError(
                f"{name} should be symmetric, got D[{i}, {j}]={D[i, j]} but D[{j}, {i}]={D[j, i]}."
            )
        D = (D + D.T) / 2.0
    return D
