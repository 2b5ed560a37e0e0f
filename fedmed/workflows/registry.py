"""One table of fedmed's methods: a method's ``workflow`` (as written in an experiment config) → the server workflow
that runs it, the options it passes that workflow, the site runner and tasks it uses, and whether it ends with one
model per cluster. Nothing else in fedmed keeps lists of workflow names."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

__all__ = ["METHODS", "SERVER_WORKFLOWS", "MethodEntry", "clustering_workflows", "method_entry", "server_workflow",
           "workflow_args", "workflows_for"]

CLASSIFY_TASKS = ("train", "validate")


def _none(exp, method, seed, cfg) -> dict:
    return {}


def _finetune(exp, method, seed, cfg) -> dict:
    return {"init": method.init, "prep_wfl": method.prep_wfl}


def _signature(exp, method, seed, cfg) -> dict:
    from fedmed.core.schema import task_config

    return {"signature": {"kind": method.workflow, "encoder": method.encoder, "image_size": method.encoder_image_size, "n_basis": getattr(method, "n_basis", 3),
                          "seed": seed, "angle": getattr(method, "angle", "principal")},
            "clustering": {"n_clusters": method.n_clusters, "threshold": method.threshold,
                           "overlap": getattr(method, "overlap", True), "linkage": method.linkage,
                           "k1_silhouette": method.k1_silhouette},
            "fedavg_warmup": method.fedavg_warmup}


def _cfl(exp, method, seed, cfg) -> dict:
    return {"eps1": method.cfl_eps1, "eps2": method.cfl_eps2, "warmup_rounds": method.warmup_rounds}


def _assessment(mode):
    def args(exp, method, seed, cfg) -> dict:
        return {"mode": mode, "distance": getattr(method, "distance", "emd"), "omega": getattr(method, "omega", 1.0),
                "site": getattr(method, "site", ""), "clusters": getattr(method, "clusters", [])}
    return args


def _flux(exp, method, seed, cfg) -> dict:
    return {"flux": {"pca_seed": seed, "n_components": 10, "scale": method.dbscan_scale,
                     "k1_silhouette": method.k1_silhouette, "box": method.box, "scaling": method.scaling,
                     "start_rule": method.start_rule, "absent_class": method.absent_class},
            "participation": method.participation, "n_clusters": method.n_clusters or 0}


def _ifca(exp, method, seed, cfg) -> dict:
    return {"k": method.n_clusters, "participation": method.participation, "empty_cluster": method.empty_cluster}


@dataclass(frozen=True)
class MethodEntry:
    """What one ``workflow`` of an experiment config is made of."""

    workflow: str
    server: str  # key of SERVER_WORKFLOWS
    serves: tuple  # the dataset tasks it runs on ("classification", "segmentation")
    site_tasks: tuple = CLASSIFY_TASKS
    clusters: bool = False  # ends with one model per cluster
    signature: bool = False  # sends a one-shot signature (FMCL, PACFL, FECFL)
    args: Callable = field(default=_none, repr=False)  # (exp, method, seed, task config) -> the workflow's options
    onboard: str | None = None  # how a new site is given a model after training (fedmed.workflows.onboard.MODES)

    @property
    def test_phase_on_unseen(self) -> bool:
        """``fedmed experiment`` scores the federation's unseen sites after training (those of every method that
        serves a new site a model)."""
        return self.onboard is not None


METHODS: dict[str, MethodEntry] = {e.workflow: e for e in (
    MethodEntry("fedavg", "fedavg", ("classification", "segmentation"), onboard="global"),
    MethodEntry("fedprox", "fedavg", ("classification", "segmentation"), onboard="global"),
    MethodEntry("ditto", "fedavg", ("segmentation",)),
    MethodEntry("fedmae", "fedavg", ("classification",)),
    MethodEntry("finetune", "finetune", ("classification",), ("class_set", "train", "validate"), args=_finetune),
    *(MethodEntry(w, "clustered", ("classification",), ("signature", "train", "validate"), clusters=True, signature=True,
                  args=_signature, onboard="signature") for w in ("fmcl", "pacfl", "fecfl")),
    MethodEntry("cfl", "cfl", ("classification",), clusters=True, args=_cfl, onboard="cfl"),
    MethodEntry("flux", "flux", ("classification",), ("train", "latent_bounds", "descriptor", "validate"), clusters=True,
                args=_flux, onboard="flux"),
    MethodEntry("ifca", "ifca", ("classification",), ("ifca",), clusters=True, args=_ifca, onboard="ifca"),
    MethodEntry("seg_assess", "assessment", ("segmentation",), ("assess",), args=_assessment("assess")),
    MethodEntry("fedavg_w", "assessment", ("segmentation",), ("assess", "train", "validate"), args=_assessment("fedavg_w")),
    MethodEntry("seg_clusters", "assessment", ("segmentation",), ("assess", "train", "validate"), clusters=True,
                args=_assessment("clusters"), onboard="assess"),
)}

# server workflow name -> "module:Class" under fedmed.workflows (imported when a run needs it)
SERVER_WORKFLOWS = {"fedavg": "fedavg:FedAvg", "finetune": "finetune:Finetune", "clustered": "clustered:OneShotClustered",
                    "cfl": "cfl:CFL", "flux": "flux:Flux", "ifca": "ifca:IFCA", "assessment": "assessment:SegAssessment",
                    "onboard": "onboard:Onboard"}


def method_entry(workflow: str) -> MethodEntry:
    if workflow not in METHODS:
        raise KeyError(f"workflow {workflow!r} is not one of fedmed's ({sorted(METHODS)})")
    return METHODS[workflow]


def server_workflow(name: str):
    """The server workflow class registered as ``name`` (a key of :data:`SERVER_WORKFLOWS`)."""
    import importlib

    if name not in SERVER_WORKFLOWS:
        raise KeyError(f"server workflow {name!r} is not one of fedmed's ({sorted(SERVER_WORKFLOWS)})")
    module, cls = SERVER_WORKFLOWS[name].split(":")
    return getattr(importlib.import_module(f"fedmed.workflows.{module}"), cls)


def workflow_args(exp, method, seed: int, cfg: dict) -> tuple[str, dict]:
    """(server workflow name, its options) of ``method`` of the experiment ``exp`` for ``seed``."""
    e = method_entry(method.workflow)
    return e.server, e.args(exp, method, seed, cfg)


def workflows_for(task: str) -> tuple:
    """The config workflows that run on a dataset of ``task`` ("classification" or "segmentation")."""
    return tuple(w for w, e in METHODS.items() if task in e.serves)


def clustering_workflows() -> tuple:
    return tuple(w for w, e in METHODS.items() if e.clusters)
