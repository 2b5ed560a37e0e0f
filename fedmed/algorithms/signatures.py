"""One payload type per one-shot clustering signature, and its one wire format.

A site builds its signature as a typed object (FMCL :class:`~fedmed.algorithms.fmcl.ClassSignature`,
:class:`PACFLSignature`, :class:`FECFLSignature`); :func:`signature_to_wire` turns it into the arrays of its reply
(``FIELDS[kind]``: what the reply's meta, a ``<site>.npz`` of ``fedmed distances`` and the server read), and
:func:`signature_from_wire` turns a reply back into the typed object, checked: a missing array, a wrong shape or a
non-finite value is an error naming the site, before any distance is computed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

__all__ = ["FECFLSignature", "PACFLSignature", "SIGNATURE_KINDS", "SignatureKind", "register_signature_kind",
           "signature_distances", "signature_from_wire", "signature_kind", "signature_to_wire", "wire_only"]


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


@dataclass(frozen=True)
class SignatureKind:
    """One kind of one-shot clustering signature, as data: what a site computes and sends, and how the server turns
    the sites' signatures into distances. A method registers its kind (:func:`register_signature_kind`) in its own
    module (``fedmed.methods.fmcl``, ``pacfl``, ``fecfl``; a plugin's likewise); nothing else names a kind.

    ``release(feats, y, classes, *, epsilon, delta, clip, rng, **options) -> (signature, DP releases)``: the
    signature of the site's features (per class: only the ``classes`` of at least ``k_min`` samples, ``y`` their
    labels; label-free: every feature, ``y`` None), with its mechanism under DP. ``distances(signatures, names,
    **options) -> D``. ``site_notes(encoder, dp_epsilon) -> [str]``: warnings a site logs and sends."""

    name: str
    payload: type  # the typed signature (validate(site) -> checked copy)
    fields: tuple  # the arrays on the wire
    release: Callable
    distances: Callable
    optional: tuple = ()  # arrays on the wire when present
    per_class: bool = True  # False: one statistic of all the site's images (a site without labels can send it)
    site_notes: Callable = lambda encoder, dp_epsilon: []


SIGNATURE_KINDS: dict[str, SignatureKind] = {}  # name -> kind, filled by the methods that define them


def register_signature_kind(kind: SignatureKind) -> SignatureKind:
    """Add a kind of signature (the same object again is a no-op; another under a taken name is refused)."""
    known = SIGNATURE_KINDS.get(kind.name)
    if known is not None and known != kind:
        raise ValueError(f"signature kind {kind.name!r} is taken")
    SIGNATURE_KINDS[kind.name] = kind
    return kind


def signature_kind(name: str) -> SignatureKind:
    """The registered kind ``name`` (fedmed's own are registered when ``fedmed.methods`` is imported)."""
    if name not in SIGNATURE_KINDS:
        raise ValueError(f"signature kind should be one of {sorted(SIGNATURE_KINDS)}, got {name!r} (a method's "
                         f"module registers its kind: import fedmed.methods, or the plugin that defines it)")
    return SIGNATURE_KINDS[name]


def _kind_of(sig) -> SignatureKind:
    for kind in SIGNATURE_KINDS.values():
        if type(sig) is kind.payload:
            return kind
    raise TypeError(f"not a registered signature: {type(sig).__name__}")


def signature_to_wire(sig) -> dict:
    """The arrays a reply carries for ``sig`` (``FIELDS`` of its kind, and PACFL's classes)."""
    kind = _kind_of(sig)
    out = {f: np.asarray(getattr(sig, f)) for f in kind.fields}
    out.update({f: np.asarray(getattr(sig, f)) for f in kind.optional if getattr(sig, f) is not None})
    return out


def signature_from_wire(kind: str, payload: Mapping, site: str = "site"):
    """The typed, checked signature of ``kind`` in a reply (or a ``<site>.npz``) of ``site``."""
    sk = signature_kind(kind)
    missing = [f for f in sk.fields if f not in payload]
    if missing:
        raise ValueError(f"{site}: its {kind} signature lacks {missing} (it has {sorted(payload)}).")
    fields = {f: np.asarray(payload[f]) for f in sk.fields + sk.optional if f in payload}
    try:
        return sk.payload(**fields).validate(site)
    except (TypeError, ValueError) as e:
        raise ValueError(str(e) if str(e).startswith(site) else f"{site}: {e}") from None


def wire_only(kind: str, meta: dict) -> dict:
    """The signature arrays of a reply's meta (its kind's fields, the classes, the encoder's description)."""
    sk = signature_kind(kind)
    keep = sk.fields + sk.optional + ("classes", "encoder")
    return {k: v for k, v in meta.items() if k in keep}


def signature_distances(kind: str, signatures: dict[str, dict], **options) -> tuple[list[str], np.ndarray]:
    """Distance matrix from ``{site: signature meta}`` (sites sorted by name) by the kind's own rule, with its own
    ``options`` (FMCL: ``overlap``; PACFL: ``angle``)."""
    names = sorted(signatures)
    sigs = [signature_from_wire(kind, signatures[n], n) for n in names]
    return names, signature_kind(kind).distances(sigs, names, **options)
