"""Federated fine-tuning of a (Fed-MAE pre-trained) ViT, optionally with PreP-WFL (``001_`` Algorithm 2)."""

from pathlib import Path

from fedmed.core import jobfiles

from fedmed.workflows.federation import RunFailed
from fedmed.workflows.fedavg import FedAvg

INIT_DIR = jobfiles.FINETUNE_INIT  # inside what the job carries (Federation.job_files): the pre-trained encoder.pt


class Finetune(FedAvg):
    """Algorithm box (``001_`` Alg. 2):

    (PreP-WFL only) each site sends its set of class ids; the server computes the prevalence
    p_c = sum_k 1{c in C_k} (Eq. 1) and w_c = 1 / p_c (Eq. 2) and broadcasts them; sites train with the weighted
    cross-entropy of Eq. 3. Then FedAvg over the encoder and the head for R rounds, from the Fed-MAE encoder
    (``init="fedmae"``, carried in the job) or from random weights.
    """

    record_name = "Finetune"
    earlier_record_names = ("FinetuneController",)  # what runs of fedmed before 2026-11-25 recorded

    def __init__(self, num_rounds: int, task_config: dict, *, init: str, prep_wfl: bool, **kw):
        """Every option from the method (``fedmed.methods.FinetuneMethod``)."""
        super().__init__(num_rounds, task_config, **kw)
        self.init = init
        self.prep_wfl = bool(prep_wfl)

    def start_params(self) -> dict:
        params = self.initial_params()
        if self.init == "fedmae":
            import torch

            f = Path(self.job_files) / INIT_DIR / "encoder.pt"
            if not f.is_file():
                raise RunFailed(f"init 'fedmae' but the job carries no pre-trained encoder ({INIT_DIR}/encoder.pt)")
            enc = torch.load(f, weights_only=True)
            missing = sorted(set(enc) - set(params))
            if missing:
                raise RunFailed(f"the pre-trained encoder does not fit the classifier (unexpected {missing[:3]})")
            params.update({k: v.numpy() for k, v in enc.items()})
        return params

    def prevalence_round(self):
        from fedmed.algorithms.aggregation import prep_weights

        sets = {}
        for site, _, meta, _ in self.send("class_set", self.task({}, 0)):
            if meta.get("error"):
                self.recorder.error(-1, site, "class_set", meta["error"])
            else:
                sets[site] = meta["classes"]
        p, w = prep_weights(list(sets.values()), self.cfg["data"]["n_classes"])
        self.task_extra = {"class_weights": w.tolist()}
        self.recorder.note("prep_wfl", {"class_sets": sets, "prevalence": p.tolist(), "weights": w.tolist()})
        self.info(f"PreP-WFL: prevalence {p.tolist()}, weights {[round(x, 3) for x in w]}")

    def run(self):
        st = self.resumed.get("state", {})
        if self.prep_wfl:
            if st.get("class_weights"):
                self.task_extra = {"class_weights": st["class_weights"]}
            else:
                self.prevalence_round()
        theta = self.resumed_models().get("global") or self.start_params()
        self.train_global(theta, class_weights=self.task_extra.get("class_weights"))
