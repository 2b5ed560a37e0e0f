"""FedProx (Li et al. 2020): FedAvg with a proximal term ``fedprox_mu`` toward the round's global model in each
site's loss."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from fedmed.methods.base import Method, register_method


@register_method
class FedProxMethod(Method):
    workflow: Literal["fedprox"]
    fedprox_mu: float = Field(0.01, ge=0, description="proximal weight mu (Li et al. 2020)")
    serves: ClassVar[tuple] = ("classification", "segmentation")
    onboards: ClassVar[bool] = True

    def task_options(self, exp, seed):
        return {"train": {"fedprox_mu": self.fedprox_mu}}
