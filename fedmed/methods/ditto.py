"""Ditto (Li et al. 2021): FedAvg's global model and a personal model at each site."""

from __future__ import annotations

from typing import ClassVar, Literal, Optional

from pydantic import Field

from fedmed.methods.base import Method, register_method


@register_method
class DittoMethod(Method):
    """Ditto (Li et al. 2021): FedAvg's global model, and at each site a personal model trained on the same data with
    a proximal term ``ditto_lambda`` toward the round's global model; the site serves (and is scored with) its
    personal model."""

    workflow: Literal["ditto"]
    ditto_lambda: float = Field(0.1, gt=0)
    serves: ClassVar[tuple] = ("classification", "segmentation")
    personal: ClassVar[Optional[str]] = "not_kept"

    def check_experiment(self, exp):
        super().check_experiment(exp)
        if exp.dataset.task == "segmentation" and exp.dataset.sources:
            raise ValueError(f"method {self.name!r}: Ditto is not available for 2D lesion segmentation (3D "
                             f"segmentation and classification have it)")

    def task_options(self, exp, seed):
        return {"ditto_lambda": self.ditto_lambda}
