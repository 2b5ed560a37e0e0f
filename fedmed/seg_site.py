"""A segmentation site's tasks (``004_``): assessment, FedAvg/FedProx/FedAvg_w/cluster training, Ditto.

Config keys (``cfg``): ``task: "segmentation"``, ``data.shape``/``data.roi``/``data.in_channels``,
``model.channels``, ``train`` (epochs, lr, momentum, ``fedprox_mu``), ``ditto_lambda`` (Ditto:
a personal model trained with a proximal pull toward the served global model), ``assess``
(encoder, weights, per_value, per_image, edges).
"""

from __future__ import annotations

import zlib

import numpy as np

from .data import DataError
from .site import SiteRunner, TaskError

__all__ = ["SegSiteRunner"]


class SegSiteRunner(SiteRunner):
    def cases(self, cfg):
        from .seg import load_case

        shape = tuple(cfg["data"]["shape"])
        if self._data is None or self._data_key != shape:
            doc = self._datalist("segmentation")
            tr = [load_case(e, shape=shape, site=self.site) for e in doc["training"]]
            te = [load_case(e, shape=shape, site=self.site) for e in doc["test"]]
            if not tr:
                raise DataError(f"{self.site}: datalist {self.display(self.datalist_path)} has no training cases")
            self._data, self._data_key = (tr, te), shape
        return self._data

    def model(self, cfg):
        from .seg import seg_model

        key = (cfg["data"]["in_channels"], tuple(cfg["model"]["channels"]))
        if self._model is None or self._model_key != key:
            self._model = seg_model(cfg["data"]["in_channels"], channels=cfg["model"]["channels"], seed=cfg.get("seed", 0))
            self._model_key = key
        return self._model

    def _seed(self, cfg, round_):
        return (int(cfg.get("seed", 0)) * 1_000_003 + int(round_) * 7919 + zlib.crc32(self.site.encode())) % (2**31)

    def handle(self, task, params, cfg, round_=0):
        if task == "assess":
            return self.assess(cfg)
        if task in ("train", "validate"):
            return self.train(params, cfg, round_) if task == "train" else self.validate(params, cfg)
        raise TaskError(f"{self.site}: unknown task {task!r}")

    def _served(self, cfg):
        """The model this site uses: its Ditto personal model when personalising, else the global one."""
        import copy

        if cfg.get("ditto_lambda"):
            if "personal" not in self.state:
                self.state["personal"] = copy.deepcopy(self._model)
            return self.state["personal"]
        return self._model

    def _metrics(self, model, cfg):
        from .seg import dice_scores

        _, te = self.cases(cfg)
        roi = tuple(cfg["data"]["roi"])
        metrics = dice_scores(model, te, roi=roi) if te else {}
        return metrics, {"n_test": len(te)}

    def validate(self, params, cfg):
        from .train import set_params

        set_params(self.model(cfg), params)
        metrics, meta = self._metrics(self._served(cfg), cfg)
        return {}, metrics, meta

    def train(self, params, cfg, round_):
        from .seg import train_seg_local
        from .train import get_params, set_params

        model = self.model(cfg)
        set_params(model, params)
        served = self._served(cfg)
        metrics, meta = self._metrics(served, cfg)
        tr, _ = self.cases(cfg)
        t, roi, seed = cfg["train"], tuple(cfg["data"]["roi"]), self._seed(cfg, round_)
        anchor = [p.detach().clone() for p in model.parameters()]
        out = train_seg_local(model, tr, epochs=t["local_epochs"], lr=t["lr"], momentum=t["momentum"], roi=roi,
                              mu=t.get("fedprox_mu", 0.0), seed=seed)
        if cfg.get("ditto_lambda"):  # Ditto (Li et al. 2021): personal model pulled toward the global one
            train_seg_local(served, tr, epochs=t["local_epochs"], lr=t["lr"], momentum=t["momentum"], roi=roi,
                            mu=float(cfg["ditto_lambda"]), anchor=anchor, seed=seed + 1)
        if not np.isfinite(out["loss"]):
            raise TaskError(f"{self.site}: training diverged in round {round_}")
        meta.update(n_train=len(tr), train_loss=out["loss"])
        return get_params(model), metrics, meta

    def assess(self, cfg):
        from .assessment import site_assessment
        from .encoders import build_encoder

        a = cfg.get("assess", {})
        tr, te = self.cases(cfg)
        enc = build_encoder("medicalnet_resnet18", weights=a.get("weights"), seed=int(cfg.get("seed", 0)))
        meta = site_assessment(tr + te, enc, per_value=bool(a.get("per_value")), per_image=bool(a.get("per_image")),
                               edges=a.get("edges"))
        return {}, {"n_cases": float(len(tr) + len(te))}, meta


def load_datalist_seg(path):
    """A segmentation datalist: entries need ``image`` (a file or list of files) and ``label``."""
    from .data import load_datalist

    return load_datalist(path, task="segmentation")
