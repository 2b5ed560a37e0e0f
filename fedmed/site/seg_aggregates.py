"""What a segmentation site sends for the ``004_`` assessment: aggregates of its own cases (the server's side is
:func:`fedmed.algorithms.assessment.assess`)."""

from __future__ import annotations

import numpy as np
from pydantic import Field

from fedmed.core.schema import Strict, TaskConfig

__all__ = ["AssessOptions", "assessment_payload", "per_image_asked", "site_assessment"]


class AssessOptions(Strict):
    """The ``assess`` task's options (the task config's ``method_options``; ``fedmed.methods.SegAssessMethod``)."""

    per_value: bool = Field(False, description="per-image metadata values and embeddings asked for (the paper's "
                            "form); sent only where the site's settings allow per-image data")


def per_image_asked(runner, cfg: TaskConfig) -> tuple[bool, list[str]]:
    """Whether this site sends per-image values for the ``assess`` task — the job asks (:class:`AssessOptions`) and
    the site's settings allow it — and the notes saying so (printed here, and sent with the assessment)."""
    per_image, notes = AssessOptions.model_validate(cfg.method_options).per_value, []
    if per_image and not runner.settings.allow_per_image:
        notes.append(f"{runner.site}: per-image metadata requested by the job but not allowed by this site's "
                     f"settings; histograms and an embedding centroid are sent instead")
        per_image = False
    elif per_image:
        notes.append(f"{runner.site}: WARNING sending per-image metadata and embeddings (allowed by this site's "
                     f"settings)")
    for n in notes:
        print(f"[fedmed] {n}", flush=True)
    return per_image, notes


def site_assessment(cases, encoder=None, *, per_value: bool = False, per_image: bool = False,
                    edges: dict | None = None, privacy: dict | None = None, rng=None) -> dict:
    """What one 3D site sends for the assessment (see the module notes): :func:`assessment_payload` of its cases'
    metadata (:func:`fedmed.data.nifti.case_metadata`) and, with ``encoder``, their embeddings."""
    from fedmed.data.nifti import case_metadata
    from fedmed.nn.encoders import site_embeddings

    emb = site_embeddings(cases, encoder) if encoder is not None else None
    return assessment_payload(case_metadata(cases), emb, encoder.description if encoder is not None else None,
                              n_cases=len(cases), per_value=per_value, per_image=per_image, edges=edges,
                              privacy=privacy, rng=rng)


def assessment_payload(values: dict, embeddings=None, encoder: str | None = None, *, n_cases: int,
                       per_value: bool = False, per_image: bool = False, edges: dict | None = None,
                       privacy: dict | None = None, rng=None) -> dict:
    """The assessment reply from per-case metadata ``values`` (``{"intensity__<m>" | "label__<r>": values}``) and
    ``embeddings`` (rows, or None): histograms on shared edges and the embeddings' centroid — or, when the site allows
    them, the values and embeddings themselves (3D cases and 2D images alike, :mod:`fedmed.site.seg2d`).

    With ``privacy["dp_epsilon"]`` (and aggregates, not per-image values) every histogram gets Laplace noise
    (L1 sensitivity 2 per feature) and the embedding centroid analytic Gaussian noise on vectors clipped to
    ``privacy["clip"]`` (L2 sensitivity 2 clip / n); the budget is split evenly over the releases
    (:mod:`fedmed.algorithms.privacy`). Per-image values are never noised: a site only sends them when its own settings
    allow it.
    """
    from fedmed.algorithms.assessment import histogram_edges
    from fedmed.algorithms.heterogeneity import metadata_histogram
    from fedmed.algorithms.privacy import privacy_settings, private_histogram, private_mean

    settings = privacy_settings(privacy)
    eps = settings.dp_epsilon if not (per_value or per_image) else None
    releases = len(values) + (1 if embeddings is not None else 0)
    share = eps / releases if eps else None
    rng = rng if rng is not None else np.random.default_rng(0)
    out: dict = {"n_cases": int(n_cases), "dp": {"epsilon": eps, "releases": []}}
    for k, v in values.items():
        if per_value:
            out[k] = v
        else:
            e = histogram_edges(k, edges)
            out[k], rec = private_histogram(metadata_histogram(v, e), epsilon=share, rng=rng)
            out[f"edges__{k}"] = e
            if rec:
                out["dp"]["releases"].append({"feature": k, **rec})
    if embeddings is not None:
        emb = embeddings
        if per_image:
            out["embeddings"] = emb
        elif share:
            out["embedding_centroid"], rec = private_mean(emb, clip=settings.clip, epsilon=share,
                                                          delta=settings.dp_delta, rng=rng)
            out["dp"]["releases"].append({"embedding_centroid": True, **rec})
        else:
            out["embedding_centroid"] = emb.mean(axis=0)
        out["encoder"] = encoder
    return out
