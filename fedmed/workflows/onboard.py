"""A new site gets the cluster model that fits it: onboarding after a finished clustered run, and the unseen-site test
phase of ``fedmed experiment`` (Flux ``003_`` Algorithm 2 and its counterparts for every clustered method).

The job carries the training run's result (``TRAINING_DIR``: its final models, ``onboarding.json`` /
``onboarding.npz`` — what the run kept for this, written by :meth:`Workflow.save_onboarding` — and Flux's
``flux_state.npz``). Each new site computes what its method compares sites by, with the same site task, privacy rules
(``k_min``, DP) and seed rule as in training; the server assigns it with the method's own distance and sends it that
cluster's model, which it scores. **How a new site is assigned is the training workflow's own**
(``assign_new_sites`` of its class; this workflow only dispatches to it):

* ``OneShotClustered`` (FMCL, PACFL, FECFL): the new site's signature (FMCL: class prototypes of its labeled training split;
  PACFL: its class subspaces; FECFL: its mean embedding, label-free); its distance to every training site by the method's
  distance; the cluster at the smallest linkage distance (average linkage: mean distance to the cluster's members;
  single: the nearest member; complete: the farthest).
* ``SegAssessment`` (``004_`` two clusters): the new site's assessment; D_EMD on the image-intensity features only
  (label-free) or D_EUC on the embedding centroids, as the run clustered; mean distance to the cluster's members.
* ``Flux``: the label-free descriptor with ``theta*`` and the training box; the nearest label-free centroid (Eq. 9).
* ``IFCA``: the K models' losses on the new site's labeled training split; the lowest (IFCA's own rule).
* ``CFL``: down CFL's parameter tree (Sattler et al. 2020): at each split the site computes its update from the
  model the split was made at, and follows the half whose mean update is most cosine-similar; the leaf is its cluster.
* ``FedAvg``: the global model. With ``ensemble``: the cluster models' probabilities averaged with weights equal
  to their training-site counts (how the Flux paper scores baselines without test-time assignment).

With ``labels=False`` (a new site without labels) FMCL and PACFL compare, for each cluster c, the site's signature
under cluster c's model's predicted classes with cluster c's members, and IFCA scores each model against its own
predicted classes (the lowest loss: the most confident model); CFL needs labels.

Scored on: all the site's data when the assignment used no labels (``signature`` with FECFL or pseudo-labels,
``assess``, ``flux``, ``global``, ``ensemble``, IFCA with pseudo-labels), its test split (and validation split, as
``val_``) when it used the training split's labels (FMCL, PACFL, IFCA, CFL) — never data the assignment saw
(docs/readings.md). Recorded phases:
``test_phase`` (the assigned model), ``known_association`` (the cluster of the site's true group, when given),
``cluster<c>`` (with ``references``: every cluster model — a reference, never a selection); IFCA also
``ensemble``. The assigned model of each
site is written as ``models/<site>.pt`` (``fedmed predict --model``).
"""

from __future__ import annotations

from fedmed.core.errors import FedmedError

import json
import shutil
from pathlib import Path

import numpy as np

from fedmed.core import jobfiles
from fedmed.core.packing import pack_models
from fedmed.workflows.base import Workflow
from fedmed.workflows.federation import RunFailed

__all__ = ["assignment_lines", "FALLBACK", "FALLBACK_FILE", "Onboard", "OnboardingError", "TRAINING_DIR", "assign_by_linkage", "check_training_result",
           "find_result", "load_models", "training_files"]

FALLBACK = -1  # the cluster id of the global model a new site is served when its cluster cannot (Onboard.guard)
FALLBACK_FILE = "fallback/global.pt"  # under TRAINING_DIR: that model, from a FedAvg-family run


def assignment_lines(doc: dict) -> list[str]:
    """What an onboarding run gave each new site, one line each, from its record (``metrics.json``): the cluster and
    the method that chose it, or the global model and why, and the model file the site takes (``models/<site>.pt``)."""
    a = doc.get("assignment") or {}
    guarded = a.get("guarded") or {}
    out = []
    for site, c in sorted((a.get("test_phase") or {}).items()):
        given = (f"the global model ({guarded[site]})" if int(c) == FALLBACK and site in guarded else
                 "the global model" if int(c) == FALLBACK else f"cluster {c}'s model ({a.get('mode', 'its method')})")
        out.append(f"{site}: {given}; its model: models/{site}.pt")
    return out
TRAINING_DIR = jobfiles.TRAINING  # inside what the job carries (Federation.job_files): the training run's models and state


def load_models(root: Path) -> dict:
    """cluster id -> params of the ``cluster<c>.pt`` (or ``global.pt`` as cluster 0) saved in ``root``."""
    import torch

    out = {}
    for p in sorted(root.glob("cluster*.pt")):
        out[int(p.stem[len("cluster"):])] = {k: v.numpy() for k, v in torch.load(p, weights_only=True)["state_dict"].items()}
    if not out and (root / "global.pt").is_file():
        out[0] = {k: v.numpy() for k, v in torch.load(root / "global.pt", weights_only=True)["state_dict"].items()}
    return out


from fedmed.algorithms.clustered import assign_by_linkage  # noqa: E402,F401  (re-exported)


class Onboard(Workflow):
    """Algorithm box (see the module notes): 1. each new site sends what its method compares sites by; 2. the server
    assigns it a cluster by the method's own distance; 3. the site scores that cluster's model (and its true group's,
    and every cluster's as references)."""

    record_name = "Onboard"
    earlier_record_names = ("OnboardController",)  # what runs of fedmed before 2026-11-25 recorded

    def __init__(self, num_rounds: int, task_config: dict, training: str = "fedavg", known_clusters: dict = None,
                 references: bool = False, labels: bool = True, ensemble: bool = False, min_cluster_images: int = 0,
                 **kw):
        """``training``: the server workflow of the finished run (``module:Class``, :func:`server_workflow`), whose
        ``assign_new_sites`` assigns each new site; ``ensemble``: score the cluster models' weighted ensemble instead
        of assigning (how the Flux paper scores baselines without test-time assignment); ``min_cluster_images``: a
        new site is never served a cluster model trained on no site or on fewer images than this (:meth:`guard`)."""
        from fedmed.workflows.registry import server_workflow

        super().__init__(num_rounds, task_config, **kw)
        self.training = server_workflow(training)
        if not labels and self.training.onboard_needs_labels:
            raise ValueError(self.training.onboard_needs_labels)
        self.labels = bool(labels)
        self.ensemble_only = bool(ensemble)
        self.known_clusters = dict(known_clusters or {})
        self.references = bool(references)
        self.min_cluster_images = int(min_cluster_images)

    # ------------------------------------------------------------------ the training run's result
    @property
    def root(self) -> Path:
        return Path(self.job_files) / TRAINING_DIR

    def state(self) -> dict:
        f = self.root / "onboarding.json"
        if not f.is_file():
            if self.ensemble_only or not self.training.onboard_needs_state:
                return {}
            raise RunFailed(f"the job carries no onboarding state ({TRAINING_DIR}/onboarding.json): the training run "
                            f"kept nothing to assign new sites by (a run of an earlier fedmed, or one that did not "
                            f"finish)")
        return json.loads(f.read_text())

    def arrays(self) -> dict:
        f = self.root / "onboarding.npz"
        out: dict = {}
        if f.is_file():
            z = np.load(f)
            for key in z.files:
                name, param = key.split("/", 1)
                out.setdefault(name, {})[param] = z[key]
        return out

    # ------------------------------------------------------------------ run
    def run(self):
        models = load_models(self.root)
        if not models:
            raise RunFailed(f"the job carries no trained models ({TRAINING_DIR}/)")
        st = self.state()
        method = self.training.__name__
        label_free = self.ensemble_only or self.training.onboard_is_label_free(st) or not self.labels
        self.task_extra = {"evaluate_on": "all" if label_free else "split"}
        sizes = {c: len(m) for c, m in st.get("clusters", {}).items()}  # training sites per cluster
        if self.ensemble_only:
            self.ensemble(models, sizes)
        else:
            assign = self.training.assign_new_sites(self, st, models)
            self.recorder.note("assignment", {"test_phase": assign, "known_association": self.known_clusters,
                                              "mode": method, "label_free": label_free,
                                              "pseudo_labels": not self.labels and self.training.onboard_pseudo_labels,
                                              "evaluated_on": "all data" if label_free else "test split"})
            assign, guarded, served = self.guard(assign, models)
            if guarded:
                self.recorder.note("assignment", {**self.recorder.doc["assignment"], "test_phase": assign,
                                                  "guarded": guarded})
            for s, c in assign.items():
                self.info(f"{s} is assigned " + (f"cluster {c} ({method})" if c != FALLBACK else
                                                  f"the global model: {guarded[s]}"))
            self.validate_assigned("test_phase", 0, assign, served)
            self.write_site_models(assign, served)
            self.training.after_onboarding(self, models, sizes)
        if self.known_clusters:
            self.validate_assigned("known_association", 1, {s: int(c) for s, c in self.known_clusters.items()
                                                            if s in self.sites and int(c) in models}, models)
        if self.references:
            for i, c in enumerate(sorted(models)):
                self.validate_assigned(f"cluster{c}", 2 + i, {s: c for s in self.sites}, models)

    def guard(self, assign: dict, models: dict) -> tuple[dict, dict, dict]:
        """Clusters that can serve (#57): a new site assigned a cluster whose model was trained on no site, or on
        fewer than ``min_cluster_images`` training images (the counts the run saved in each ``cluster<c>.pt``), is
        served the global model the job carries instead (``fallback/global.pt``; cluster id :data:`FALLBACK`), or,
        without one, is left unassigned with the reason. Returns the assignment, ``{site: reason}`` of the sites it
        moved, and the models to serve (``models``, with the global one under :data:`FALLBACK` when served)."""
        import torch

        info = {}
        for c in models:
            f = self.root / f"cluster{c}.pt"
            ck = torch.load(f, map_location="cpu", weights_only=True) if f.is_file() else {}
            info[c] = (ck.get("sites"), ck.get("train_images"))
        fallback = self.root / FALLBACK_FILE
        out, moved, served = {}, {}, dict(models)
        for s, c in assign.items():
            sites, images = info.get(c, (None, None))
            why = None
            if c not in models or sites == []:
                why = f"cluster {c} was trained on no site"
            elif images is not None and images < self.min_cluster_images:
                why = (f"cluster {c} was trained on {images} images (< min_cluster_images={self.min_cluster_images})")
            if why is None:
                out[s] = c
            elif fallback.is_file():
                out[s], moved[s] = FALLBACK, why + ": the global model is served"
                served.setdefault(FALLBACK, {k: v.numpy() for k, v in torch.load(
                    fallback, weights_only=True)["state_dict"].items()})
            else:
                self.recorder.error(0, s, "test_phase", f"{s}: not assigned: {why}, and the job carries no global "
                                                        f"model to serve instead")
                self.error(f"new site {s} is not assigned: {why}, and the job carries no global model")
        return self.assigned(out), moved, served

    def validate_assigned(self, phase, index, mapping, models):
        """Each new site scores the model it is mapped to (recorded as ``phase``)."""
        groups = {c: (self.task(models[c], 0, cluster=c), [s for s, m in mapping.items() if m == c]) for c in models}
        replies = self.send_groups("validate", {c: g for c, g in groups.items() if g[1]})
        self.record_rows(index, [row for rows in replies.values() for row in rows], phase)

    def write_site_models(self, assign: dict, models: dict):
        """``models/<site>.pt``: the assigned cluster's saved model file, as the training run wrote it."""
        out = self.out_dir / "models"
        out.mkdir(parents=True, exist_ok=True)
        for s, c in assign.items():
            src = self.root / (FALLBACK_FILE if c == FALLBACK else f"cluster{c}.pt")
            shutil.copy(src if src.is_file() else self.root / "global.pt", out / f"{s}.pt")

    def new_site_replies(self, task: str, message, what: str) -> dict:
        """Step: ``{site: (meta, params)}`` of each new site's reply to ``task``; a site that could not answer is
        recorded and left unassigned; none answering fails the run."""
        out = {s: (r.meta, r.params) for s, r in self.gather(task, message, what, round_=0, who="new site",
                                                              consequence="cannot be assigned").items()}
        if not out:
            raise RunFailed(f"no new site sent its {what}: " + "; ".join(self.recorder.recent_errors(3)))
        return out

    # ------------------------------------------------------------------ one assignment per mode
    def assigned(self, assign: dict) -> dict:
        """``assign`` ({new site: cluster}), or the run fails when no new site could be assigned."""
        if not assign:
            raise RunFailed("no new site could be assigned a cluster (see the errors)")
        return assign

    def ensemble(self, models: dict, sizes: dict, index: int = 0, phase: str = "test_phase"):
        packed = pack_models(dict(sorted(models.items())))
        weights = [float(sizes.get(str(k), sizes.get(k, 0)) or 0) for k in sorted(models)]
        weights = weights if sum(weights) > 0 else [1.0] * len(models)
        rows = self.send("validate_ensemble", self.task(packed, 0, method_options={"weights": weights}))
        self.record_rows(index, rows, phase)


# ------------------------------------------------------------------ the training result an onboarding job is built from
ONBOARDING_FILES = ("onboarding.json", "onboarding.npz", "flux_state.npz")


class OnboardingError(FedmedError, ValueError):
    """A training result no new site can be onboarded from; the message is one line naming it."""


def find_result(path) -> Path:
    """The run folder (``metrics.json`` and ``models/``) in ``path``: a run's ``fedmed/`` folder, a run folder of
    ``fedmed experiment`` or a downloaded FLARE job result."""
    root = Path(path)
    if not root.is_dir():
        raise OnboardingError(f"{path}: no such folder")
    hits = [p.parent for p in [root / "metrics.json", *root.rglob("metrics.json")] if p.is_file()
            and "test_phase" not in p.relative_to(root).parts]
    if not hits:
        raise OnboardingError(f"{path}: not a fedmed run result (no metrics.json in it)")
    # a run folder of fedmed experiment keeps a copy of metrics.json beside server/ (which holds the models)
    with_models = [h for h in hits if (h / "models").is_dir()]
    return min(with_models or hits, key=lambda p: (len(p.parts), str(p)))


def check_training_result(path, workflow: str, training: str, *, onboards: bool, clustered: bool,
                          require_clusters: bool = True, serving: tuple = ()) -> Path:
    """The run folder of a *finished* run of method ``workflow`` (server workflow ``training``, ``module:Class``) in
    ``path`` that a new site can be onboarded from; a one-line :class:`OnboardingError` otherwise (no such run, a run
    that did not finish, a run of another method, a method that ends without clusters). ``onboards`` / ``clustered``:
    the method's (``fedmed.methods``); ``serving``: the methods onboarding serves (named in the error)."""
    from fedmed.workflows.registry import server_workflow

    if not onboards or (require_clusters and not clustered):
        raise OnboardingError(f"workflow {workflow!r} ends with one model and no clusters: there is no cluster to "
                              f"onboard a new site to (a new site uses the run's models/global.pt with `fedmed "
                              f"predict`); onboarding serves {', '.join(serving)}")
    cls = server_workflow(training)
    folder = find_result(path)
    doc = json.loads((folder / "metrics.json").read_text())
    status = doc.get("status", "running")
    if status != "finished":
        why = f": {doc['reason']}" if doc.get("reason") else ""
        raise OnboardingError(f"{path}: the training run did not finish (status {status}{why}); onboarding needs a "
                              f"finished run's models")
    expect = cls.record_name
    if doc.get("workflow") not in (None, expect, *cls.earlier_record_names):
        raise OnboardingError(f"{path}: a run of {doc.get('workflow')}, not of workflow {workflow!r} ({expect})")
    if not list((folder / "models").glob("*.pt")):
        raise OnboardingError(f"{path}: the run saved no model (models/*.pt)")
    if cls.onboard_needs_state:
        f = folder / "onboarding.json"
        if not f.is_file():
            raise OnboardingError(f"{path}: the run kept no onboarding state (onboarding.json; a run of an earlier "
                                  f"fedmed): run it again to onboard new sites")
        st = json.loads(f.read_text())
        kind = st.get("state", {}).get("signature", {}).get("kind")
        if kind is not None and kind != workflow:
            raise OnboardingError(f"{path}: a run of {kind}, not of workflow {workflow!r}: its signatures cannot be "
                                  f"compared with a {workflow} signature")
        problem = cls.onboarding_state_problem(st)
        if problem:
            raise OnboardingError(f"{path}: {problem}")
    return folder


def training_files(folder: Path) -> list[Path]:
    """What an onboarding job carries of a checked run folder (:func:`check_training_result`)."""
    return sorted(p for p in (folder / "models").glob("*.pt") if not p.name.startswith("selected_")) + \
        [folder / f for f in ONBOARDING_FILES if (folder / f).is_file()]
