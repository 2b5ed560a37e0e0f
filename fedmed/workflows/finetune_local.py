"""FedAvg, then each site fine-tunes the global model on its own data and is served that model: the standard
personalisation baseline (local fine-tuning of the federated model; e.g. Wang et al. 2019, "Federated evaluation of
on-device personalization")."""

from fedmed.workflows.fedavg import FedAvg


class FinetuneLocal(FedAvg):
    """Algorithm box:

    1. FedAvg for R rounds (the global model, scored by every site in round R, saved as ``global``);
    2. round R + 1 (``finetune_local``): every site trains that model a few more epochs on its own training split at a
       smaller learning rate (``fedmed.site.tasks.finetune_local``) and is scored with it; the fine-tuned models stay
       at the sites — only their scores are recorded.
    """

    record_name = "FinetuneLocal"

    def run(self):
        theta = self.train_global(self.resumed_models().get("global") or self.initial_params())
        r = self.num_rounds + 1
        self.record_rows(r, self.send("finetune_local", self.task(theta, r)), "finetune_local")
