"""One payload type per one-shot clustering signature, and its one wire format.

A site builds its signature as a typed object (FMCL :class:`~fedmed.algorithms.fmcl.ClassSignature`,
:class:`PACFLSignature`, :class:`FECFLSignature`); :func:`signature_to_wire` turns it into the arrays of its reply
(``FIELDS[kind]``: what the reply's meta, a ``<site>.npz`` of ``fedmed distances`` and the server read), and
:func:`signature_from_wire` turns a reply back into the typed object, checked: a missing array, a wrong shape or a
non-finite value is an error naming the site, before any distance is computed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from fedmed.algorithms.fmcl import ClassSignature

__all__ = ["FECFLSignature", "FIELDS", "PACFLSignature", "SIGNATURES", "signature_from_wire", "signature_to_wire"]


@dataclass(frozen=True)
class PACFLSignature:
    """PACFL: the site's class subspaces side by side, ``basis`` (d, p * C), and the classes they span."""

    basis: np.ndarray
    classes: np.ndarray | None = None

    def validate(self, site: str = "site") -> "PACFLSignature":
        basis = np.asarray(self.basis, dtype=np.float64)
        if basis.ndim != 2 or min(basis.shape) == 0:
            raise ValueError(f"{site}: a PACFL signature's basis should be a non-empty (d, p) matrix, got shape "
                             f"{basis.shape}.")
        if not np.all(np.isfinite(basis)):
            raise ValueError(f"{site}: the PACFL basis contains NaN or inf.")
        classes = None if self.classes is None else np.asarray(self.classes).astype(np.int64)
        return PACFLSignature(basis, classes)


@dataclass(frozen=True)
class FECFLSignature:
    """FECFL: the site's mean embedding (d,)."""

    mean: np.ndarray

    def validate(self, site: str = "site") -> "FECFLSignature":
        mean = np.asarray(self.mean, dtype=np.float64)
        if mean.ndim != 1 or mean.size == 0:
            raise ValueError(f"{site}: a FECFL signature should be one mean embedding (d,), got shape {mean.shape}.")
        if not np.all(np.isfinite(mean)):
            raise ValueError(f"{site}: the FECFL mean contains NaN or inf.")
        return FECFLSignature(mean)


SIGNATURES = {"fmcl": ClassSignature, "pacfl": PACFLSignature, "fecfl": FECFLSignature}
FIELDS = {"fmcl": ("classes", "means", "counts"), "pacfl": ("basis",), "fecfl": ("mean",)}
_OPTIONAL = {"pacfl": ("classes",)}


def _kind_of(sig) -> str:
    for kind, cls in SIGNATURES.items():
        if isinstance(sig, cls):
            return kind
    raise TypeError(f"not a signature: {type(sig).__name__}")


def signature_to_wire(sig) -> dict:
    """The arrays a reply carries for ``sig`` (``FIELDS`` of its kind, and PACFL's classes)."""
    kind = _kind_of(sig)
    out = {f: np.asarray(getattr(sig, f)) for f in FIELDS[kind]}
    out.update({f: np.asarray(getattr(sig, f)) for f in _OPTIONAL.get(kind, ()) if getattr(sig, f) is not None})
    return out


def signature_from_wire(kind: str, payload: Mapping, site: str = "site"):
    """The typed, checked signature of ``kind`` in a reply (or a ``<site>.npz``) of ``site``."""
    if kind not in SIGNATURES:
        raise ValueError(f"signature kind should be one of {sorted(SIGNATURES)}, got {kind!r}.")
    missing = [f for f in FIELDS[kind] if f not in payload]
    if missing:
        raise ValueError(f"{site}: its {kind} signature lacks {missing} (it has {sorted(payload)}).")
    fields = {f: np.asarray(payload[f]) for f in FIELDS[kind] + _OPTIONAL.get(kind, ()) if f in payload}
    try:
        return SIGNATURES[kind](**fields).validate(site)
    except (TypeError, ValueError) as e:
        raise ValueError(str(e) if str(e).startswith(site) else f"{site}: {e}") from None
