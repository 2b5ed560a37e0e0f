"""A new site gets the cluster model that fits it: onboarding after a finished clustered run, and the unseen-site test
phase of ``fedmed experiment`` (Flux ``003_`` Algorithm 2 and its counterparts for every clustered method).

The job carries the training run's result (``TRAINING_DIR``: its final models, ``onboarding.json`` /
``onboarding.npz`` — what the run kept for this, written by :meth:`Workflow.save_onboarding` — and Flux's
``flux_state.npz``). Each new site computes what its method compares sites by, with the same site task, privacy rules
(``k_min``, DP) and seed rule as in training; the server assigns it with the method's own distance and sends it that
cluster's model, which it scores. ``mode`` (``fedmed.workflows.METHODS[...].onboard``):

* ``signature`` (FMCL, PACFL, FECFL): the new site's signature (FMCL: class prototypes of its labeled training split;
  PACFL: its class subspaces; FECFL: its mean embedding, label-free); its distance to every training site by the method's
  distance; the cluster at the smallest linkage distance (average linkage: mean distance to the cluster's members;
  single: the nearest member; complete: the farthest).
* ``assess`` (``004_`` two clusters): the new site's assessment; D_EMD on the image-intensity features only
  (label-free) or D_EUC on the embedding centroids, as the run clustered; mean distance to the cluster's members.
* ``flux``: the label-free descriptor with ``theta*`` and the training box; the nearest label-free centroid (Eq. 9).
* ``ifca``: the K models' losses on the new site's labeled training split; the lowest (IFCA's own rule).
* ``cfl``: down CFL's parameter tree (Sattler et al. 2020): at each split the site computes its update from the
  model the split was made at, and follows the half whose mean update is most cosine-similar; the leaf is its cluster.
* ``global`` (FedAvg): the global model. ``ensemble``: the cluster models' probabilities averaged with weights equal
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

import json
import shutil
from pathlib import Path

import numpy as np

from fedmed.core import jobfiles
from fedmed.workflows.base import Workflow
from fedmed.workflows.federation import RunFailed

__all__ = ["LABEL_FREE", "MODES", "Onboard", "OnboardingError", "TRAINING_DIR", "assign_by_linkage", "check_training_result",
           "find_result", "load_models", "training_files"]

TRAINING_DIR = jobfiles.TRAINING  # inside what the job carries (Federation.job_files): the training run's models and state
MODES = ("signature", "assess", "flux", "ifca", "cfl", "global", "ensemble")
LABEL_FREE = {"assess", "flux", "global", "ensemble"}  # and "signature" of a label-free kind
LABEL_FREE_SIGNATURES = {"fecfl"}  # FMCL's prototypes and PACFL's subspaces are per class
PSEUDO_LABEL_MODES = {"signature", "ifca"}  # without labels: the served models' predicted classes instead


def load_models(root: Path) -> dict:
    """cluster id -> params of the ``cluster<c>.pt`` (or ``global.pt`` as cluster 0) saved in ``root``."""
    import torch

    out = {}
    for p in sorted(root.glob("cluster*.pt")):
        out[int(p.stem[len("cluster"):])] = {k: v.numpy() for k, v in torch.load(p, weights_only=True)["state_dict"].items()}
    if not out and (root / "global.pt").is_file():
        out[0] = {k: v.numpy() for k, v in torch.load(root / "global.pt", weights_only=True)["state_dict"].items()}
    return out


def assign_by_linkage(row: dict, clusters: dict, linkage: str = "average") -> tuple[int, dict]:
    """The cluster at the smallest linkage distance from a new site whose distance to each training site is ``row``
    (``{site: d}``); ``clusters``: cluster id -> its training sites. Returns (cluster, {cluster: linkage distance}).
    Clusters with no member in ``row`` are skipped; ties go to the smallest id."""
    agg = {"single": np.min, "complete": np.max}.get(linkage, np.mean)
    dist = {int(c): float(agg([row[s] for s in members if s in row]))
            for c, members in clusters.items() if any(s in row for s in members)}
    if not dist:
        raise ValueError("no training site of any cluster to compare with")
    return min(sorted(dist), key=lambda c: dist[c]), dist


def _cos(a: dict, b: dict) -> float:
    x = np.concatenate([np.asarray(a[k], dtype=np.float64).ravel() for k in sorted(a)])
    y = np.concatenate([np.asarray(b[k], dtype=np.float64).ravel() for k in sorted(a)])
    n = np.linalg.norm(x) * np.linalg.norm(y)
    return float(x @ y / n) if n > 0 else 0.0


class Onboard(Workflow):
    """Algorithm box (see the module notes): 1. each new site sends what its method compares sites by; 2. the server
    assigns it a cluster by the method's own distance; 3. the site scores that cluster's model (and its true group's,
    and every cluster's as references)."""

    record_name = "OnboardController"

    def __init__(self, num_rounds: int, fedmed_config: dict, mode: str = "global", known_clusters: dict = None,
                 references: bool = False, labels: bool = True, **kw):
        super().__init__(num_rounds, fedmed_config, **kw)
        if mode not in MODES:
            raise ValueError(f"onboarding mode should be one of {MODES}, got {mode!r}")
        if not labels and mode == "cfl":
            raise ValueError("CFL sends a new site down its tree by the site's training updates, which need labels")
        self.labels = bool(labels)
        self.mode = mode
        self.known_clusters = dict(known_clusters or {})
        self.references = bool(references)

    # ------------------------------------------------------------------ the training run's result
    @property
    def root(self) -> Path:
        return Path(self.job_files) / TRAINING_DIR

    def state(self) -> dict:
        f = self.root / "onboarding.json"
        if not f.is_file():
            if self.mode in ("global", "ensemble"):
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
        kind = st.get("state", {}).get("signature", {}).get("kind")
        label_free = (self.mode in LABEL_FREE or (self.mode == "signature" and kind in LABEL_FREE_SIGNATURES)
                      or not self.labels)
        self.task_extra = {"evaluate_on": "all" if label_free else "split"}
        sizes = {c: len(m) for c, m in st.get("clusters", {}).items()}  # training sites per cluster
        if self.mode == "ensemble":
            self.ensemble(models, sizes)
        else:
            assign = {s: 0 for s in self.sites} if self.mode == "global" else getattr(self, f"assign_{self.mode}")(st, models)
            self.recorder.note("assignment", {"test_phase": assign, "known_association": self.known_clusters,
                                              "mode": self.mode, "label_free": label_free,
                                              "pseudo_labels": not self.labels and self.mode in PSEUDO_LABEL_MODES,
                                              "evaluated_on": "all data" if label_free else "test split"})
            for s, c in assign.items():
                self.info(f"{s} is assigned cluster {c} ({self.mode})")
            self.validate_assigned("test_phase", 0, assign, models)
            self.write_site_models(assign, models)
            if self.mode == "ifca":  # IFCA's label-free counterpart, as the Flux paper scores it
                self.ensemble(models, sizes, 2 + len(models), "ensemble")
        if self.known_clusters:
            self.validate_assigned("known_association", 1, {s: int(c) for s, c in self.known_clusters.items()
                                                            if s in self.sites and int(c) in models}, models)
        if self.references:
            for i, c in enumerate(sorted(models)):
                self.validate_assigned(f"cluster{c}", 2 + i, {s: c for s in self.sites}, models)

    def validate_assigned(self, phase, index, mapping, models):
        groups = {c: (self.task(models[c], 0, cluster=c), [s for s, m in mapping.items() if m == c]) for c in models}
        replies = self.send_groups("validate", {c: g for c, g in groups.items() if g[1]})
        self.record_rows(index, [row for rows in replies.values() for row in rows], phase)

    def write_site_models(self, assign: dict, models: dict):
        """``models/<site>.pt``: the assigned cluster's saved model file, as the training run wrote it."""
        out = self.out_dir / "models"
        out.mkdir(parents=True, exist_ok=True)
        for s, c in assign.items():
            src = self.root / f"cluster{c}.pt"
            shutil.copy(src if src.is_file() else self.root / "global.pt", out / f"{s}.pt")

    def _replies(self, task: str, message, what: str) -> dict:
        """meta of each new site's reply to ``task``; a site that could not answer is recorded and left unassigned."""
        out = {}
        for s, _, meta, params in self.send(task, message):
            if meta.get("error"):
                self.recorder.error(0, s, task, meta["error"])
                self.error(f"new site {s} sent no {what} and cannot be assigned: {meta['error']}")
            else:
                out[s] = (meta, params)
        if not out:
            raise RunFailed(f"no new site sent its {what}: " + "; ".join(
                e["error"] for e in self.recorder.doc["errors"][-3:]))
        return out

    # ------------------------------------------------------------------ one assignment per mode
    def assign_signature(self, st: dict, models: dict) -> dict:
        from fedmed.algorithms.clustered import signature_distances

        state, clusters = st["state"], st["clusters"]
        sig = {k: v for k, v in state["signature"].items() if k != "weights"}  # the weights: cfg.encoder_weights
        trained = state["signatures"]
        encoders = sorted({m.get("encoder", "?") for m in trained.values()})
        if not self.labels and sig["kind"] not in LABEL_FREE_SIGNATURES:
            return self._assign_signature_pseudo(state, clusters, models, sig, trained)
        assign, dists = {}, {}
        for s, (meta, _) in self._replies("signature", self.task({}, 0, signature=sig), "signature").items():
            if meta.get("encoder", "?") not in encoders:
                self.recorder.error(0, s, "signature", f"{s}: signature made with encoder {meta.get('encoder')}, the "
                                    f"run's sites used {encoders}")
                self.error(f"new site {s}: its signature was made with {meta.get('encoder')}, not the run's encoder "
                           f"{encoders}; it is not compared")
                continue
            try:
                names, D = signature_distances(sig["kind"], {**{t: m for t, m in trained.items() if t != s}, s: meta},
                                               overlap=state["clustering"]["overlap"], angle=sig["angle"])
            except ValueError as e:
                self.recorder.error(0, s, "signature", str(e))
                self.error(f"new site {s} cannot be compared with the training sites: {e}")
                continue
            i = names.index(s)
            row = {n: float(D[i, j]) for j, n in enumerate(names) if n != s and np.isfinite(D[i, j])}
            assign[s], dists[s] = assign_by_linkage(row, clusters, state["clustering"]["linkage"])
        self.recorder.note("onboarding", {"distances": dists, "linkage": state["clustering"]["linkage"]})
        return self._some(assign)

    def _assign_signature_pseudo(self, state, clusters, models, sig, trained) -> dict:
        """No labels at the new site: for each cluster c, its signature under cluster c's model's predicted classes,
        compared with cluster c's members (the linkage of the run); the cluster whose model explains the site's
        images the way its members' data look wins (docs/readings.md, "Onboarding")."""
        from fedmed.algorithms.clustered import signature_distances

        linkage = state["clustering"]["linkage"]
        groups = {c: (self.task(models[c], 0, signature={**sig, "pseudo_labels": True}), list(self.sites))
                  for c in sorted(models) if str(c) in clusters}
        dists: dict = {}
        for c, rows in self.send_groups("signature", groups).items():
            for s, _, meta, _ in rows:
                if meta.get("error"):
                    self.recorder.error(0, s, "signature", meta["error"])
                    continue
                try:
                    names, D = signature_distances(sig["kind"], {**{t: m for t, m in trained.items() if t != s},
                                                                 s: meta}, overlap=state["clustering"]["overlap"],
                                                   angle=sig["angle"])
                except ValueError as e:
                    self.recorder.error(0, s, "signature", str(e))
                    continue
                i = names.index(s)
                row = {n: float(D[i, j]) for j, n in enumerate(names) if n != s and np.isfinite(D[i, j])}
                if any(m in row for m in clusters[str(c)]):
                    dists.setdefault(s, {})[int(c)] = assign_by_linkage(row, {c: clusters[str(c)]}, linkage)[1][int(c)]
        assign = {s: min(sorted(d), key=lambda c: d[c]) for s, d in dists.items()}
        self.recorder.note("onboarding", {"distances": dists, "linkage": linkage, "pseudo_labels": True})
        return self._some(assign)

    def assign_assess(self, st: dict, models: dict) -> dict:
        from fedmed.algorithms.assessment import assess, intensity_emd

        state, clusters = st["state"], st["clusters"]
        trained, distance = state["assessed"], state["distance"]
        if not trained:
            raise RunFailed("the training run's clusters were given in its config, not assessed: there are no "
                            "training-site assessments to compare a new site with")
        assign, dists = {}, {}
        for s, (meta, _) in self._replies("assess", self.task({}, 0), "assessment").items():
            sites = {**{t: m for t, m in trained.items() if t != s}, s: meta}
            try:
                if distance == "emd":  # label-free: the run's EMD_maxI feature, image intensities only
                    names, D, feature = intensity_emd(sites, state.get("max_intensity"))
                else:
                    rep = assess(sites)
                    names, D = rep["sites"], np.asarray(rep[distance]["matrix"])
            except (KeyError, ValueError) as e:
                self.recorder.error(0, s, "assess", str(e))
                self.error(f"new site {s} cannot be compared with the training sites: {e}")
                continue
            i = names.index(s)
            row = {n: float(D[i, j]) for j, n in enumerate(names) if n != s}
            assign[s], dists[s] = assign_by_linkage(row, clusters, "average")
        self.recorder.note("onboarding", {"distances": dists, "distance": distance,
                                          "features": (f"maximum intensity of {state.get('max_intensity')}"
                                                       if distance == "emd" else "embedding centroids")})
        return self._some(assign)

    def assign_flux(self, st: dict, models: dict) -> dict:
        from fedmed.algorithms.flux import assign_nearest

        f = self.root / "flux_state.npz"
        if not f.is_file():
            raise RunFailed(f"the job carries no Flux state ({TRAINING_DIR}/flux_state.npz)")
        z = np.load(f)
        theta_star = {k[len("theta_star/"):]: z[k] for k in z.files if k.startswith("theta_star/")}
        flux = {"lo": z["lo"].tolist(), "hi": z["hi"].tolist(), "pca_seed": int(z["pca_seed"]),
                "n_components": int(z["n_components"]), "label_free": True}
        return self._some({s: assign_nearest(meta["label_free"], z["centroids_label_free"]) for s, (meta, _) in
                           self._replies("descriptor", self.task(theta_star, 0, flux=flux), "descriptor").items()})

    def assign_ifca(self, st: dict, models: dict) -> dict:
        ids = sorted(models)
        packed = {f"m{j}/{n}": v for j, c in enumerate(ids) for n, v in models[c].items()}
        replies = self._replies("ifca", self.task(packed, 0, ifca={"k": len(ids), "train": False,
                                                                    "pseudo_labels": not self.labels}), "losses")
        self.recorder.note("onboarding", {"losses": {s: dict(zip(ids, m["losses"])) for s, (m, _) in replies.items()}})
        return self._some({s: ids[int(m["cluster"])] for s, (m, _) in replies.items()})

    def assign_cfl(self, st: dict, models: dict) -> dict:
        splits, clusters = st["state"]["splits"], {int(c): sorted(s) for c, s in st["clusters"].items()}
        tree = self.arrays()
        root = sorted({s for m in clusters.values() for s in m} | {s for sp in splits for s in sp["cluster"]})
        at = {s: root for s in self.sites}  # the node (its training sites) each new site is at
        path: dict = {s: [] for s in self.sites}
        leaf = {tuple(m): c for c, m in clusters.items()}
        for depth in range(len(splits) + 1):
            todo: dict = {}
            for s, node in at.items():
                i = next((i for i, sp in enumerate(splits) if sorted(sp["cluster"]) == node), None)
                if i is not None:
                    todo.setdefault(i, []).append(s)
            if not todo:
                break
            replies = self.send_groups("train", {i: (self.task(tree[f"split{i}_model"], 0), sites)
                                                 for i, sites in todo.items()})
            for i, rows in replies.items():
                for s, _, meta, params in rows:
                    if meta.get("error"):
                        self.recorder.error(0, s, "train", meta["error"])
                        self.error(f"new site {s} sent no update and cannot be assigned: {meta['error']}")
                        at.pop(s)
                        continue
                    theta = tree[f"split{i}_model"]
                    update = {k: np.asarray(params[k]) - np.asarray(theta[k]) for k in theta}
                    sims = [_cos(update, tree[f"split{i}_u{h}"]) for h in (0, 1)]
                    h = int(np.argmax(sims))
                    at[s] = sorted(splits[i]["into"][h])
                    path[s].append({"split": i, "cosine": sims, "half": h})
        assign = {}
        for s, node in at.items():
            c = leaf.get(tuple(node))
            if c is None:  # a node whose sites all left before the end: the cluster holding most of them
                c = max(clusters, key=lambda k: len(set(clusters[k]) & set(node)))
            assign[s] = c
        self.recorder.note("onboarding", {"cfl_path": path})
        return self._some(assign)

    def _some(self, assign: dict) -> dict:
        if not assign:
            raise RunFailed("no new site could be assigned a cluster (see the errors)")
        return assign

    def ensemble(self, models: dict, sizes: dict, index: int = 0, phase: str = "test_phase"):
        packed = {f"m{k}/{n}": v for k, m in sorted(models.items()) for n, v in m.items()}
        weights = [float(sizes.get(str(k), sizes.get(k, 0)) or 0) for k in sorted(models)]
        weights = weights if sum(weights) > 0 else [1.0] * len(models)
        rows = self.send("validate_ensemble", self.task(packed, 0, ensemble={"weights": weights}))
        self.record_rows(index, rows, phase)


# ------------------------------------------------------------------ the training result an onboarding job is built from
ONBOARDING_FILES = ("onboarding.json", "onboarding.npz", "flux_state.npz")


class OnboardingError(ValueError):
    """A training result no new site can be onboarded from; the message is one line naming it."""


def find_result(path) -> Path:
    """The run folder (``metrics.json`` and ``models/``) in ``path``: a run's ``fedmed/`` folder, a run folder of
    ``fedmed experiment`` or a downloaded FLARE job result."""
    root = Path(path)
    if not root.is_dir():
        raise OnboardingError(f"{path}: no such folder")
    if (root / "metrics.json").is_file():
        return root
    hits = [p.parent for p in root.rglob("metrics.json") if "test_phase" not in p.relative_to(root).parts]
    if not hits:
        raise OnboardingError(f"{path}: not a fedmed run result (no metrics.json in it)")
    return min(hits, key=lambda p: (len(p.parts), str(p)))


def check_training_result(path, workflow: str, *, require_clusters: bool = True) -> Path:
    """The run folder of a *finished* run of ``workflow`` in ``path`` that a new site can be onboarded from; a one-line
    :class:`OnboardingError` otherwise (no such run, a run that did not finish, a run of another method, a method that
    ends without clusters)."""
    from fedmed.workflows.registry import method_entry, server_workflow

    entry = method_entry(workflow)
    if entry.onboard is None or (require_clusters and not entry.clusters):
        raise OnboardingError(f"workflow {workflow!r} ends with one model and no clusters: there is no cluster to "
                              f"onboard a new site to (a new site uses the run's models/global.pt with `fedmed "
                              f"predict`); onboarding serves {', '.join(w for w, e in _clustered())}")
    folder = find_result(path)
    doc = json.loads((folder / "metrics.json").read_text())
    status = doc.get("status", "running")
    if status != "finished":
        why = f": {doc['reason']}" if doc.get("reason") else ""
        raise OnboardingError(f"{path}: the training run did not finish (status {status}{why}); onboarding needs a "
                              f"finished run's models")
    expect = server_workflow(entry.server).record_name
    if doc.get("workflow") not in (None, expect):
        raise OnboardingError(f"{path}: a run of {doc.get('workflow')}, not of workflow {workflow!r} ({expect})")
    if not list((folder / "models").glob("*.pt")):
        raise OnboardingError(f"{path}: the run saved no model (models/*.pt)")
    if entry.onboard not in ("global", "ensemble"):
        f = folder / "onboarding.json"
        if not f.is_file():
            raise OnboardingError(f"{path}: the run kept no onboarding state (onboarding.json; a run of an earlier "
                                  f"fedmed): run it again to onboard new sites")
        st = json.loads(f.read_text())
        kind = st.get("state", {}).get("signature", {}).get("kind")
        if kind is not None and kind != workflow:
            raise OnboardingError(f"{path}: a run of {kind}, not of workflow {workflow!r}: its signatures cannot be "
                                  f"compared with a {workflow} signature")
        if entry.onboard == "assess" and not st.get("state", {}).get("assessed"):
            raise OnboardingError(f"{path}: the run's clusters were given in its config, not assessed: there is no "
                                  f"training-site assessment to compare a new site with")
    return folder


def _clustered():
    from fedmed.workflows.registry import METHODS

    return [(w, e) for w, e in METHODS.items() if e.clusters and e.onboard]


def training_files(folder: Path) -> list[Path]:
    """What an onboarding job carries of a checked run folder (:func:`check_training_result`)."""
    return sorted((folder / "models").glob("*.pt")) + [folder / f for f in ONBOARDING_FILES if (folder / f).is_file()]
