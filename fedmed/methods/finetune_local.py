"""Local fine-tuning (#57): FedAvg, then every site fine-tunes the final model on its own data and is served it.

Its server workflow: FedAvg, then each site fine-tunes the global model on its own data and is served that model: the standard
personalisation baseline (local fine-tuning of the federated model; e.g. Wang et al. 2019, "Federated evaluation of
on-device personalization").
"""

from __future__ import annotations

from typing import ClassVar, Literal, Optional

from pydantic import Field

from fedmed.methods.base import Method, register_method
from fedmed.site.tasks import FinetuneLocalOptions
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


@register_method
class FinetuneLocalMethod(Method):
    """Local fine-tuning (#57): FedAvg, then every site trains the final global model ``ft_epochs`` more on its own
    training split at ``ft_lr_scale`` x ``train.lr`` and is served that model (which never leaves the site)."""

    workflow: Literal["finetune_local"]
    ft_epochs: int = Field(2, ge=1, description="local epochs of the final fine-tuning at each site")
    ft_lr_scale: float = Field(0.1, gt=0, le=1, description="its learning rate as a share of train.lr")
    server: ClassVar = FinetuneLocal
    personal: ClassVar[Optional[str]] = "not_kept"
    site_tasks: ClassVar[tuple] = ("train", "validate", "finetune_local")

    site_options_model: ClassVar = FinetuneLocalOptions  # what its site task reads (fedmed.site.tasks)

    def site_options(self, exp, seed):
        return {"epochs": self.ft_epochs, "lr_scale": self.ft_lr_scale}
