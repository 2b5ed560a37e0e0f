"""FMCL (``000_``/``002_``): class prototypes from a frozen foundation model, the overlap-aware cosine distance,
average linkage and auto-K."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedmed.algorithms.fmcl import ClassSignature, fmcl_distance_matrix
from fedmed.algorithms.privacy import fmcl_release
from fedmed.algorithms.signatures import SignatureKind, register_signature_kind
from fedmed.methods.base import register_method
from fedmed.methods.signature import SignatureMethod


@register_method
class FMCLMethod(SignatureMethod):
    workflow: Literal["fmcl"]
    overlap: bool = Field(True, description="overlap-aware multiplier m_ij (False: the paper's 'no overlap' ablation)")

    def clustering_options(self):
        return {"overlap": self.overlap}


def _distances(sigs, names, *, overlap: bool = True, alpha: float = 1.0, beta: float = 100.0, eps: float = 1e-3):
    return fmcl_distance_matrix(sigs, overlap=overlap, alpha=alpha, beta=beta, eps=eps, site_names=names)


# the site's class prototypes (per-class means and counts of classes with >= k_min images) and Alg. 3's distance
KIND = register_signature_kind(SignatureKind("fmcl", ClassSignature, ("classes", "means", "counts"), fmcl_release,
                                             _distances))
