"""PACFL (Vahidian et al. 2023): class subspaces and their principal angles."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedmed.algorithms.baselines import pacfl_distance_matrix
from fedmed.algorithms.privacy import pacfl_release
from fedmed.algorithms.signatures import PACFLSignature, SignatureKind, register_signature_kind
from fedmed.methods.base import register_method
from fedmed.methods.signature import SignatureMethod


@register_method
class PACFLMethod(SignatureMethod):
    workflow: Literal["pacfl"]
    encoder: str = "pixels"
    n_basis: int = Field(3, ge=1, description="singular vectors per class")
    angle: Literal["principal", "official"] = Field(
        "principal", description="principal: smallest principal angle between the class subspaces; official: PACFL "
        "code's arccos of single entries of U_i^T U_j (sign dependent)")

    def signature_options(self):
        return {"n_basis": self.n_basis}

    def clustering_options(self):
        return {"angle": self.angle}


def _distances(sigs, names, *, angle: str = "principal"):
    mode = {"principal": "smallest", "official": "official"}[angle]
    return pacfl_distance_matrix([s.basis for s in sigs], mode=mode, site_names=names)


def _site_notes(encoder: str, dp_epsilon) -> list:
    if encoder == "pixels" and not dp_epsilon:
        return ["WARNING PACFL on raw pixels without DP: each class's leading singular vector is close to an average "
                "image of that class (docs/privacy.md); set privacy.dp_epsilon or use an encoder"]
    return []


KIND = register_signature_kind(SignatureKind("pacfl", PACFLSignature, ("basis",), pacfl_release, _distances,
                                             optional=("classes",), site_notes=_site_notes))
