"""The ``004_`` methods (Alekseenko et al.): the heterogeneity assessment (metadata EMD and embedding distances),
FedAvg down-weighting the most distant site (FedAvg_w) and 2-cluster personalization.

Its server workflow: ``004_`` (Alekseenko et al.): assess the federation, then train a model that is better for it.
"""

from __future__ import annotations

from typing import ClassVar, Literal, Optional

from pydantic import Field
from pydantic import field_validator

from fedmed.methods.base import Method, check_encoder, register_method
from fedmed.site.seg_aggregates import AssessOptions
from fedmed.workflows.fedavg import FedAvg
from fedmed.workflows.federation import RunFailed


# what a site's assessment reply holds that the distances read (histograms, their edges, embedding centroids)
ASSESSMENT_KEYS = ("intensity__", "label__", "edges__", "embedding_centroid", "embeddings", "encoder")


class SegAssessment(FedAvg):
    """Algorithm box (``004_`` §2-3):

    1. one ``assess`` task: sites send metadata histograms and an embedding centroid (aggregates of at
       least k_min cases); the server computes D_EMD and D_EUC, the most distant site (Eq. 3) and the
       two-cluster split (Alg. 1) and writes the report (``assessment/``: CSVs, JSON, heatmaps, report.md);
    2. ``mode``: ``"assess"`` stops there; ``"fedavg_w"`` runs FedAvg with the most distant site (by
       ``distance``, or ``site`` if given) weighted ``omega`` (Eq. 2); ``"clusters"`` runs FedAvg per cluster
       (Alg. 1's split by ``distance``, or ``clusters`` if given).
    With the site or clusters given, the assessment round is skipped.
    """

    record_name = "SegAssessment"
    earlier_record_names = ("SegAssessmentController",)  # what runs of fedmed before 2026-11-25 recorded

    def __init__(self, num_rounds: int, task_config: dict, *, mode: str, distance: str | None = None,
                 omega: float | None = None, site: str | None = None, clusters: list | None = None, **kw):
        """``mode`` and the options of its method (``fedmed.methods``: FedAvg_w's distance, omega, site; the two-cluster
        split's distance, clusters); None: an option the mode does not take."""
        super().__init__(num_rounds, task_config, **kw)
        self.omega = omega
        self.assessed: dict = {}
        self.max_intensity = None  # the modality of EMD_maxI in the run's assessment
        self.mode, self.distance, self.site, self.clusters = mode, distance, site, clusters or []

    def assess_sites(self) -> dict:
        from fedmed.algorithms.assessment import assess
        from fedmed.report.assessment_report import write_assessment_report

        sites = {s: r.meta for s, r in self.gather("assess", self.task({}, 0), "assessment").items()}
        if len(sites) < max(2, self.min_clients):
            raise RunFailed(f"{len(sites)} site(s) sent an assessment; the 004_ assessment needs at least "
                            f"{max(2, self.min_clients)}")
        self.assessed = {s: {k: v for k, v in m.items() if k.startswith(ASSESSMENT_KEYS)} for s, m in sites.items()}
        report = assess(sites)
        self.max_intensity = report["emd"]["max_intensity"]
        write_assessment_report(report, self.out_dir / "assessment")
        summary = {k: {kk: vv for kk, vv in v.items() if kk != "matrix"} for k, v in report.items() if k in ("emd", "euc")}
        self.recorder.note("assessment", {"sites": report["sites"], **summary,
                                          "privacy": {s: m.get("dp", {}) for s, m in sites.items()}})
        self.info("assessment: " + "; ".join(f"{k} most distant {v['most_distant']}" for k, v in summary.items()))
        return report

    def run(self):
        st = self.resumed.get("state", {})
        if self.mode == "fedavg_w":
            site = st.get("down_weight_site") or self.site
            if not site:
                site = self.assess_sites()[self.distance]["most_distant"]
            from fedmed.workflows.aggregators import DownWeighted

            self.aggregator = DownWeighted(site, self.omega)
            self.recorder.note("down_weighted", {"site": site, "omega": self.omega,
                                                 "source": "given" if self.site else f"assessment ({self.distance})"})
            self.train_global(self.resumed_models().get("global") or self.initial_params(), down_weight_site=site)
        elif self.mode == "clusters":
            self.assessed, self.max_intensity = st.get("assessed", {}), st.get("max_intensity")
            groups = st.get("clusters") or self.clusters or self.assess_sites()[self.distance]["clusters"]
            self.recorder.note("clustering", {"clusters": groups, "rule": "given" if self.clusters
                                              else f"004_ Alg. 1 on D_{self.distance.upper()}"})
            groups = self.train_clusters([list(g) for g in groups], assessed=self.assessed,
                                         max_intensity=self.max_intensity)
            self.save_onboarding("assess", dict(enumerate(groups)), assessed=self.assessed, distance=self.distance,
                                 max_intensity=self.max_intensity)
        else:
            self.assess_sites()

    # ------------------------------------------------------------------ a new site after training (fedmed.workflows.onboard)
    onboard_label_free = True
    onboard_needs_state = True  # the run's onboarding.json: its clusters and the training sites' assessment
    onboard_pseudo_labels = True

    @classmethod
    def onboard_is_label_free(cls, state: dict) -> bool:
        return True

    @classmethod
    def onboarding_state_problem(cls, state: dict):
        if not state.get("state", {}).get("assessed"):
            return ("the run's clusters were given in its config, not assessed: there is no training-site assessment "
                    "to compare a new site with")
        return None

    @classmethod
    def assign_new_sites(cls, ob, st: dict, models: dict) -> dict:
        """The new site's assessment; D_EMD on the image-intensity features only (label-free) or D_EUC on the
        embedding centroids, as the run clustered; mean distance to the cluster's members."""
        import numpy as np

        from fedmed.algorithms.assessment import assess, intensity_emd
        from fedmed.algorithms.clustered import assign_by_linkage

        state, clusters = st["state"], st["clusters"]
        trained, distance = state["assessed"], state["distance"]
        if not trained:
            raise RunFailed("the training run's clusters were given in its config, not assessed: there are no "
                            "training-site assessments to compare a new site with")
        assign, dists = {}, {}
        for s, (meta, _) in ob.new_site_replies("assess", ob.task({}, 0), "assessment").items():
            sites = {**{t: m for t, m in trained.items() if t != s}, s: meta}
            try:
                if distance == "emd":  # label-free: the run's EMD_maxI feature, image intensities only
                    names, D, feature = intensity_emd(sites, state.get("max_intensity"))
                else:
                    rep = assess(sites)
                    names, D = rep["sites"], np.asarray(rep[distance]["matrix"])
            except (KeyError, ValueError) as e:
                ob.recorder.error(0, s, "assess", str(e))
                ob.error(f"new site {s} cannot be compared with the training sites: {e}")
                continue
            i = names.index(s)
            row = {n: float(D[i, j]) for j, n in enumerate(names) if n != s}
            assign[s], dists[s] = assign_by_linkage(row, clusters, "average")
        ob.recorder.note("onboarding", {"distances": dists, "distance": distance,
                                          "features": (f"maximum intensity of {state.get('max_intensity')}"
                                                       if distance == "emd" else "embedding centroids")})
        return ob.assigned(assign)


@register_method
class SegAssessMethod(Method):
    workflow: Literal["seg_assess"]
    per_value: bool = Field(False, description="ask for per-image metadata values (the paper's form); a site answers "
                            "only if its own settings allow per-image data")
    encoder_weights: Optional[str] = Field(None, description="the embedding encoder's weights file (3D: MedicalNet; 2D "
                                           "lesions: EfficientNet-Lite0, or imagenet: its installed release)")
    server: ClassVar = SegAssessment

    @field_validator("encoder_weights")
    @classmethod
    def _release_by_name(cls, v):
        if isinstance(v, str) and v.strip().lower() == "imagenet":
            from fedmed.nn.releases import release_file

            return release_file("efficientnet_lite0", "encoder_weights")
        return v
    serves: ClassVar[tuple] = ("segmentation",)
    site_tasks: ClassVar[tuple] = ("assess",)
    site_options_model: ClassVar = AssessOptions
    mode: ClassVar[str] = "assess"

    @property
    def weights_file(self):
        return self.encoder_weights

    def check_files(self, exp):
        if self.weights_file:  # 3D: MedicalNet; 2D lesions: EfficientNet-Lite0
            check_encoder("efficientnet_lite0" if exp.dataset.sources else "medicalnet_resnet18", self.weights_file,
                          in_channels=exp.dataset.channels if exp.dataset.sources else 1)

    def workflow_options(self, exp, seed):
        return {"mode": self.mode, **self.assessment_options()}

    def assessment_options(self) -> dict:
        return {}

    def site_options(self, exp, seed):
        return {"per_value": self.per_value}


@register_method
class FedAvgWMethod(SegAssessMethod):
    workflow: Literal["fedavg_w"]
    omega: float = Field(1.0, ge=0, le=1, description="weight of the most distant site (004_ Eq. 2)")
    distance: Literal["emd", "euc"] = "emd"
    site: str = Field("", description="down-weight this site instead of the assessed one")
    site_tasks: ClassVar[tuple] = ("assess", "train", "validate")
    mode: ClassVar[str] = "fedavg_w"

    def assessment_options(self):
        return {"distance": self.distance, "omega": self.omega, "site": self.site}


@register_method
class SegClustersMethod(SegAssessMethod):
    workflow: Literal["seg_clusters"]
    distance: Literal["emd", "euc"] = "emd"
    clusters: list[list[str]] = Field(default_factory=list, description="given clusters instead of the assessed ones")
    site_tasks: ClassVar[tuple] = ("assess", "train", "validate")
    clustered: ClassVar[bool] = True
    onboards: ClassVar[bool] = True
    mode: ClassVar[str] = "clusters"

    def assessment_options(self):
        return {"distance": self.distance, "clusters": self.clusters}
