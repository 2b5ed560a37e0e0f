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
        """Rounds from the start round up to ``train.rounds`` (a ceiling: ``train.stop`` may end them sooner,
        :mod:`fedmed.workflows.stopping`), the final ``validate`` round, the final model and the selected round's."""
        stop = self.stopper("global")
        last = self.num_rounds if stop.stopped_at is None else stop.stopped_at + 1  # a resumed run that had stopped
        for r in range(self.start_round(), self.num_rounds if stop.stopped_at is None else 0):
            updates = self.record_rows(r, self.send("train", self.task(theta, r)), "train")
            halt = self.observe(stop, r, updates, theta)
            theta = self.next_model(updates, theta, r)  # the average, train.server_opt, train.norm_recalibrate
            if halt:
                stop.stopped_at, last = r, r + 1
            self.checkpoint(r + 1, {"global": theta}, stoppers={"global": stop}, **state)
            if halt:
                break
        rows = self.record_rows(last, self.send("validate", self.task(theta, last)), "validate")
        self.observe(stop, last, rows, theta)
        self.save_final(theta, sites=list(self.sites), rounds=last,  # the run's sites, which trained it
                        decision=self.decision(stop.last_hist))
        self.save_selected({"global": stop}, last)
        return theta
