"""FedAvg (McMahan et al. 2017), FedProx (Li et al. 2020; the proximal term is local, ``train.fedprox_mu``),
FedAvg_w (``004_`` Eq. 2) and Ditto (Li et al. 2021; the personal models live at the sites)."""

from fedmed.workflows.base import Workflow


class FedAvg(Workflow):
    """Algorithm box (FedAvg):

    for r = 0..R-1: send theta to every site; each trains locally and returns theta_k, n_k;
                    theta <- the aggregator's model of the updates (FedAvg: sum_k n_k theta_k / sum_k n_k;
                    fedmed.workflows.aggregators); with train.norm_recalibrate, theta's batch-norm statistics
                    re-estimated over the sites' training images (Workflow.recalibrated)
    then every site scores the final theta ("validate"); the final model is saved.
    """

    record_name = "FedAvg"
    earlier_record_names = ("FedAvgController",)  # what runs of fedmed before 2026-11-25 recorded
    onboard_label_free = True
    onboard_needs_state = False

    @classmethod
    def assign_new_sites(cls, ob, st: dict, models: dict) -> dict:
        """One model: every new site gets it."""
        return {s: 0 for s in ob.sites}

    def run(self):
        self.train_global(self.resumed_models().get("global") or self.initial_params())

    def train_global(self, theta, **state):
        for r in range(self.start_round(), self.num_rounds):
            updates = self.record_rows(r, self.send("train", self.task(theta, r)), "train")
            theta = self.recalibrated(self.aggregate(updates, base=theta), r + 1,  # train.norm_recalibrate
                                      targets=sorted(x.site for x in updates))
            self.checkpoint(r + 1, {"global": theta}, **state)
        self.record_rows(self.num_rounds, self.send("validate", self.task(theta, self.num_rounds)), "validate")
        self.save_final(theta, sites=list(self.sites))  # the run's sites, which trained it
        return theta
