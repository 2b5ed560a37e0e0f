"""FedBN (Li et al., ICLR 2021): FedAvg in which every site keeps its own batch-norm layers."""

from __future__ import annotations

from typing import ClassVar, Literal, Optional

from fedmed.methods.base import Method, register_method


@register_method
class FedBNMethod(Method):
    """FedBN (Li et al., ICLR 2021): FedAvg in which every site keeps its own batch-norm layers — the standard answer
    to scanner and feature shift. The server averages the whole model (its batch-norm values are only a new site's
    starting point); each site trains and is scored with the shared weights and its own batch norm."""

    workflow: Literal["fedbn"]
    onboards: ClassVar[bool] = True
    personal: ClassVar[Optional[str]] = "kept"

    def task_options(self, exp, seed):
        return {"train": {"local_norm": True}}

    def check_experiment(self, exp):
        super().check_experiment(exp)
        if exp.model.arch in ("resnet9", "resnet18") and exp.model.norm != "batch":
            raise ValueError(f"method {self.name!r}: FedBN keeps each site's batch-norm layers; model.norm is "
                             f"{exp.model.norm!r} (set model.norm: batch)")
