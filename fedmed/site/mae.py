"""A site's Fed-MAE tasks (``001_`` §3.2): local masked-autoencoder training on its unlabeled images.

``cfg["task"] == "mae"``; the method's options in ``cfg["method_options"]`` (:class:`MAEOptions`). The site's
training images are its unlabeled pool (labels are never read); the reconstruction loss
on its held-out images (validation and test splits, a fixed mask) is what it reports each round.
"""

from __future__ import annotations

import numpy as np
from pydantic import Field

from fedmed.core.schema import Strict, TaskConfig, task_config
from fedmed.site.runner import SiteRunner
from fedmed.site.tasks import Reply, TaskError

__all__ = ["MAEOptions", "MAESiteRunner"]


class MAEOptions(Strict):
    """What a Fed-MAE site reads (the task config's ``method_options``; ``fedmed.methods.FedMAEMethod``'s values)."""

    mask_ratio: float = Field(gt=0, lt=1)
    base_lr: float = Field(gt=0)
    warmup: float = Field(ge=0, lt=1)
    rounds: int = Field(ge=1, description="the run's length, for the lr schedule")


def _mae_optimizer(model, cfg: TaskConfig):
    """MAE's AdamW, betas (0.9, 0.95) (He et al.); kept across rounds (its lr follows the run's schedule)."""
    import torch

    return torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=cfg.train.weight_decay)


def _held_out_loss(runner, model, cfg):
    import torch

    from fedmed.nn.mae import mae_eval_loss

    s = runner.splits(cfg)
    k = runner.k_min(cfg)  # a loss over fewer than k_min images is not sent (privacy.k_min)
    out = {}
    if s.val[0].shape[0] >= k:
        out["val_mae_loss"] = mae_eval_loss(model, s.val[0], seed=1)
    if s.test[0].shape[0] >= k:
        out["mae_loss"] = mae_eval_loss(model, torch.cat([s.test[0]]), seed=2)
    return out


def validate(runner, params: dict, cfg: TaskConfig, round_: int = 0) -> Reply:
    from fedmed.nn.train import set_params

    model = runner.model(cfg)
    set_params(model, params)
    n_test = int(runner.splits(cfg).test[0].shape[0])
    return Reply(runner.site, _held_out_loss(runner, model, cfg), {"n_test": n_test}, {})


def train(runner, params: dict, cfg: TaskConfig, round_: int = 0) -> Reply:
    from fedmed.nn.mae import train_mae_local
    from fedmed.nn.train import get_params, set_params

    model = runner.model(cfg)
    set_params(model, params)
    metrics = _held_out_loss(runner, model, cfg)
    x = runner.splits(cfg).train[0]
    runner.require_k_min(int(x.shape[0]), "training images", cfg, "training")
    cfg = task_config(cfg)
    m, t = MAEOptions.model_validate(cfg.method_options), cfg.train
    rounds = m.rounds
    out = train_mae_local(model, x, epochs=t.local_epochs, batch_size=t.batch_size,
                          optimizer=runner.optimizer(model, cfg, make=lambda: _mae_optimizer(model, cfg), keep=True),
                          progress=(round_ / rounds, (round_ + 1) / rounds),
                          base_lr=m.base_lr, warmup=m.warmup,
                          generator=runner.generator(cfg, round_))
    if not np.isfinite(out["loss"]):
        raise TaskError(f"{runner.site}: MAE training diverged in round {round_}")
    metrics["train_loss"] = out["loss"]
    meta = {"n_train": int(x.shape[0]), "train_loss": out["loss"], "steps": out["steps"]}
    return Reply(runner.site, metrics, meta, get_params(model))


class MAESiteRunner(SiteRunner):
    TASKS = {"train": train, "validate": validate}
    KIND = "mae"
    ARCH = "MaskedAutoEncoderViT"  # the network Fed-MAE pre-trains (fedmed.nn.mae.mae_model), whatever model.arch says
    NETWORK = "the network Fed-MAE pre-trains (whatever model.arch says)"

    def networks(self, cfg: TaskConfig) -> list[str]:
        return [self.ARCH]

    def model(self, cfg: TaskConfig):
        from fedmed.nn.mae import mae_model

        cfg = task_config(cfg)
        ratio = MAEOptions.model_validate(cfg.method_options).mask_ratio
        key = ("mae", cfg.data.channels, ratio)
        if self._model is None or self._model_key != key:
            self._model = mae_model(cfg.data.channels, mask_ratio=ratio, seed=cfg.seed).to(self.device(cfg))
            self._model_key = key
            self._optimizers = {}
        return self._model

    def check_label_space(self, s, n, names=None) -> None:
        """Pre-training never reads labels: an unlabeled pool may carry any (or placeholder) labels."""
