"""FECFL: one mean embedding per site and the cosine distance between them (label-free)."""

from __future__ import annotations

from typing import Literal

from fedmed.algorithms.baselines import fecfl_distance_matrix
from fedmed.algorithms.privacy import fecfl_release
from fedmed.algorithms.signatures import FECFLSignature, SignatureKind, register_signature_kind
from fedmed.methods.base import register_method
from fedmed.methods.signature import SignatureMethod


@register_method
class FECFLMethod(SignatureMethod):
    workflow: Literal["fecfl"]


def _distances(sigs, names):
    return fecfl_distance_matrix([s.mean for s in sigs], site_names=names)


# one statistic of all the site's images: a site without labels can send it (onboarding)
KIND = register_signature_kind(SignatureKind("fecfl", FECFLSignature, ("mean",), fecfl_release, _distances,
                                             per_class=False))
