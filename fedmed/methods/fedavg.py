"""FedAvg (McMahan et al. 2017): the sites' updates averaged by their sizes, one global model."""

from __future__ import annotations

from typing import ClassVar, Literal

from fedmed.methods.base import Method, register_method


@register_method
class FedAvgMethod(Method):
    workflow: Literal["fedavg"] = "fedavg"
    serves: ClassVar[tuple] = ("classification", "segmentation")
    onboards: ClassVar[bool] = True
