"""FedAvg (McMahan et al. 2017), FedProx (Li et al. 2020; the proximal term is local, ``train.fedprox_mu``),
FedAvg_w (``004_`` Eq. 2) and Ditto (Li et al. 2021; the personal models live at the sites)."""

from fedmed.algorithms.aggregation import down_weight, weighted_average

from fedmed.workflows.base import Workflow


class FedAvg(Workflow):
    """Algorithm box (FedAvg):

    for r = 0..R-1: send theta to every site; each trains locally and returns theta_k, n_k;
                    theta <- sum_k w_k theta_k / sum_k w_k  (w_k = n_k, or omega n_k for the down-weighted site)
    then every site scores the final theta ("validate"); the final model is saved.
    """

    record_name = "FedAvgController"
    onboard_label_free = True
    onboard_needs_state = False

    @classmethod
    def assign_new_sites(cls, ob, st: dict, models: dict) -> dict:
        """One model: every new site gets it."""
        return {s: 0 for s in ob.sites}

    def __init__(self, num_rounds: int, fedmed_config: dict, down_weight_site: str = "", omega: float = 1.0, **kw):
        super().__init__(num_rounds, fedmed_config, **kw)
        self.down_weight_site = down_weight_site
        self.omega = float(omega)

    def aggregate(self, rows) -> dict:
        names = [s for s, *_ in rows]
        n = [meta["n_train"] for _, _, meta, _ in rows]
        site = names.index(self.down_weight_site) if self.down_weight_site in names else None
        return weighted_average([p for *_, p in rows], down_weight(n, site, self.omega), names=names)

    def run(self):
        self.train_global(self.resumed_models().get("global") or self.initial_params())

    def train_global(self, theta, **state):
        for r in range(self.start_round(), self.num_rounds):
            updates = self.record_rows(r, self.send("train", self.task(theta, r)), "train")
            theta = self.aggregate(updates)
            self.checkpoint(r + 1, {"global": theta}, **state)
        self.record_rows(self.num_rounds, self.send("validate", self.task(theta, self.num_rounds)), "validate")
        self.save_final(theta, sites=self.recorder.doc["sites"])  # those that trained it: save_final
