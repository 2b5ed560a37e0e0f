"""The test phase on unseen, unlabeled sites (Flux ``003_`` Algorithm 2) and the baselines' counterparts."""

from pathlib import Path

import numpy as np

from fedmed.workflows.base import Workflow
from fedmed.workflows.federation import RunFailed

TRAINING_DIR = "fedmed_training"  # inside the server app's custom folder: the training run's models and flux_state


def load_models(root: Path) -> dict:
    import torch

    out = {}
    for p in sorted(root.glob("cluster*.pt")):
        out[int(p.stem[len("cluster"):])] = {k: v.numpy() for k, v in torch.load(p, weights_only=True)["state_dict"].items()}
    if not out and (root / "global.pt").is_file():
        out[0] = {k: v.numpy() for k, v in torch.load(root / "global.pt", weights_only=True)["state_dict"].items()}
    return out


class FluxTest(Workflow):
    """Algorithm box (Flux, Alg. 2), with the training run's result carried in the job:

    ``mode="flux"``: each unseen site sends its label-free descriptor ``d'`` (computed with ``theta*`` and the
    training box); the server assigns the nearest label-free centroid (Eq. 9) and the site scores that
    cluster's model ("test phase"). ``mode="global"`` (FedAvg): the global model. ``mode="ensemble"``
    (IFCA): the cluster models' probabilities averaged with weights equal to their training-site counts,
    as the Flux paper scores baselines without test-time assignment. With ``known_clusters`` (site ->
    cluster of its true group) each site also scores its known cluster's model ("known association").
    Unseen sites are scored on all their data.
    """

    record_name = "FluxTestController"

    def __init__(self, num_rounds: int, fedmed_config: dict, known_clusters: dict = None, mode: str = "flux",
                 cluster_sizes: dict = None, **kw):
        super().__init__(num_rounds, fedmed_config, **kw)
        self.known_clusters = dict(known_clusters or {})
        self.mode = mode
        self.cluster_sizes = dict(cluster_sizes or {})

    def run(self):
        from fedmed.algorithms.flux import assign_nearest

        self.task_extra = {"evaluate_on": "all"}  # unseen sites are scored on all their data
        root = Path(self.app_custom) / TRAINING_DIR
        models = load_models(root)
        if not models:
            raise RunFailed(f"the job carries no trained models ({TRAINING_DIR}/)")
        if self.mode == "flux":
            st = np.load(root / "flux_state.npz")
            theta_star = {k[len("theta_star/"):]: st[k] for k in st.files if k.startswith("theta_star/")}
            flux = {"lo": st["lo"].tolist(), "hi": st["hi"].tolist(), "pca_seed": int(st["pca_seed"]),
                    "n_components": int(st["n_components"]), "label_free": True}
            assign = {}
            for s, _, meta, _ in self.send("descriptor", self.task(theta_star, 0, flux=flux)):
                if meta.get("error"):
                    self.recorder.error(0, s, "descriptor", meta["error"])
                    self.error(f"unseen site {s} could not be assigned: {meta['error']}")
                else:
                    assign[s] = assign_nearest(meta["label_free"], st["centroids_label_free"])
            self.recorder.note("assignment", {"test_phase": assign, "known_association": self.known_clusters})
            self.validate_assigned("test_phase", 0, assign, models)
        elif self.mode == "global":
            self.validate_assigned("test_phase", 0, {s: 0 for s in self.sites}, models)
        else:
            packed = {f"m{k}/{n}": v for k, m in sorted(models.items()) for n, v in m.items()}
            weights = [float(self.cluster_sizes.get(str(k), self.cluster_sizes.get(k, 0)) or 0) for k in sorted(models)]
            weights = weights if sum(weights) > 0 else [1.0] * len(models)
            rows = self.send("validate_ensemble", self.task(packed, 0, ensemble={"weights": weights}))
            self.record_rows(0, rows, "test_phase")
        if self.known_clusters:
            self.validate_assigned("known_association", 1, {s: int(c) for s, c in self.known_clusters.items()
                                                            if s in self.sites}, models)

    def validate_assigned(self, phase, index, mapping, models):
        groups = {c: (self.task(models[c], 0, cluster=c), [s for s, m in mapping.items() if m == c]) for c in models}
        replies = self.send_groups("validate", {c: g for c, g in groups.items() if g[1]})
        self.record_rows(index, [row for rows in replies.values() for row in rows], phase)
