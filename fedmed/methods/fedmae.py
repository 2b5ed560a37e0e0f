"""Fed-MAE (``001_`` §3.2, §4.1): masked-autoencoder pre-training on the sites' unlabeled images."""

from __future__ import annotations

from typing import ClassVar, Literal, Optional

from pydantic import Field

from fedmed.methods.base import Method, check_vit_input, register_method
from fedmed.site.mae import MAEOptions


@register_method
class FedMAEMethod(Method):
    """Fed-MAE pre-training (``001_`` §3.2, §4.1) on the sites' unlabeled images."""

    workflow: Literal["fedmae"]
    mask_ratio: float = Field(0.75, gt=0, lt=1)
    base_lr: float = Field(1.5e-4, gt=0, description="lr = base_lr x batch / 256 (MAE's scaling rule)")
    warmup: float = Field(0.05, ge=0, lt=1, description="share of the run spent warming the lr up")
    unlabeled_alpha: Optional[float] = Field(0.5, gt=0, description="Dirichlet quantity skew of the unlabeled pools "
                                             "over sites (001_ §3.2); None: IID")
    rounds: int = Field(40, ge=1, description="pre-training rounds (train.rounds is the fine-tuning's)")
    local_epochs: int = Field(10, ge=1)
    batch_size: int = Field(64, ge=2)

    ssl_role: ClassVar[Optional[str]] = "pretrain"
    site_options_model: ClassVar = MAEOptions

    def site_options(self, exp, seed):
        return {"mask_ratio": self.mask_ratio, "base_lr": self.base_lr, "warmup": self.warmup,
                "rounds": exp.train.rounds}

    def task_options(self, exp, seed):
        return {"task": "mae"}

    def check_experiment(self, exp):
        super().check_experiment(exp)
        check_vit_input(self, exp)
