"""What a site does for each task, independent of the FL framework.

``custom/client.py`` (NVFlare Client API) only moves data between FLARE and
:class:`SiteRunner`; the same runner could sit behind any other framework. Tasks:

* ``train``: score the served model on the local test split, train it locally, return the
  update with the served model's metrics.
* ``validate``: score the served model only.
* further tasks (signatures, descriptors) are added by the workflows that need them.

What a reply carries: parameters (training tasks), metric values, and aggregates (confusion
matrix, score histograms, sample counts). Never images, labels or per-sample outputs.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np

from .data import DataError, load_datalist, load_images

__all__ = ["SiteRunner", "TaskError"]


class TaskError(RuntimeError):
    """A task this site cannot perform; the message says why (names files where relevant)."""


class SiteRunner:
    """Holds one site's data and model between tasks."""

    def __init__(self, site: str, datalist_dir: str | Path):
        self.site = site
        self.datalist_path = Path(datalist_dir) / f"{site}.json"
        self._data = None
        self._data_key = None
        self._model = None
        self._model_key = None
        self.state: dict = {}  # workflow state kept between tasks (e.g. a personal model)

    # ------------------------------------------------------------------ data and model
    def data(self, image_size: int, channels: int):
        key = (image_size, channels)
        if self._data is None or self._data_key != key:
            doc = load_datalist(self.datalist_path)
            xtr, ytr = load_images(doc["training"], image_size=image_size, channels=channels, site=self.site)
            xte, yte = load_images(doc["validation"], image_size=image_size, channels=channels, site=self.site)
            if xtr.shape[0] == 0:
                raise DataError(f"{self.site}: datalist {self.datalist_path} has no training images")
            self._data, self._data_key = (xtr, ytr, xte, yte), key
        return self._data

    def model(self, cfg: dict):
        from .models import build_model

        m = cfg["model"]
        key = (m["arch"], cfg["data"]["channels"], cfg["data"]["n_classes"], m.get("width", 16))
        if self._model is None or self._model_key != key:
            self._model = build_model(m["arch"], cfg["data"]["channels"], cfg["data"]["n_classes"],
                                      width=m.get("width", 16), seed=cfg.get("seed", 0))
            self._model_key = key
        return self._model

    def generator(self, cfg: dict, round_: int):
        import torch

        g = torch.Generator()
        g.manual_seed((int(cfg.get("seed", 0)) * 1_000_003 + int(round_) * 7919 + zlib.crc32(self.site.encode())) % (2**63))
        return g

    # ------------------------------------------------------------------ tasks
    def handle(self, task: str, params: dict, cfg: dict, round_: int = 0) -> tuple[dict, dict, dict]:
        """Run ``task``; returns (params to send, scalar metrics, meta aggregates)."""
        if task == "train":
            return self.train(params, cfg, round_)
        if task == "validate":
            return self.validate(params, cfg)
        if task == "signature":
            return self.signature(cfg)
        raise TaskError(f"{self.site}: unknown task {task!r}")

    def _served_metrics(self, model, cfg):
        from .train import evaluate

        _, _, xte, yte = self.data(cfg["data"]["image_size"], cfg["data"]["channels"])
        res = evaluate(model, xte, yte, cfg["data"]["n_classes"])
        metrics = {k: res[k] for k in ("accuracy", "macro_f1", "auc")}
        meta = {"n_test": res["n_test"], "confusion": res["confusion"], "score_hist": res["score_hist"]}
        return metrics, meta

    def validate(self, params, cfg):
        from .train import set_params

        model = self.model(cfg)
        set_params(model, params)
        metrics, meta = self._served_metrics(model, cfg)
        return {}, metrics, meta

    def train(self, params, cfg, round_):
        from .train import get_params, set_params, train_local

        model = self.model(cfg)
        set_params(model, params)
        metrics, meta = self._served_metrics(model, cfg)
        xtr, ytr, _, _ = self.data(cfg["data"]["image_size"], cfg["data"]["channels"])
        t = cfg["train"]
        weights = cfg.get("class_weights")
        out = train_local(model, xtr, ytr, epochs=t["local_epochs"], batch_size=t["batch_size"], lr=t["lr"],
                          momentum=t["momentum"], weight_decay=t.get("weight_decay", 0.0), mu=t.get("fedprox_mu", 0.0),
                          class_weights=weights, generator=self.generator(cfg, round_))
        if not np.isfinite(out["loss"]):
            raise TaskError(f"{self.site}: training diverged (loss {out['loss']}) in round {round_}")
        meta.update(n_train=int(xtr.shape[0]), train_loss=out["loss"])
        return get_params(model), metrics, meta

    def signature(self, cfg):
        """One-shot clustering signature of the site's training data (only aggregates leave).

        ``cfg["signature"]``: ``kind`` (fmcl | pacfl | fecfl), ``encoder``, ``weights`` (local
        file or None for seeded random init), ``image_size``, ``n_basis`` (PACFL).
        """
        from .baselines import fecfl_signature, pacfl_signature
        from .encoders import build_encoder, extract_features
        from .fmcl import class_signature

        sc = cfg["signature"]
        xtr, ytr, _, _ = self.data(cfg["data"]["image_size"], cfg["data"]["channels"])
        enc = build_encoder(sc["encoder"], weights=sc.get("weights"), seed=int(sc.get("seed", 0)),
                            in_channels=cfg["data"]["channels"], image_size=sc.get("image_size"))
        feats = extract_features(enc, xtr, progress=lambda m: print(f"[{self.site}] {m}", flush=True))
        y = ytr.numpy()
        meta = {"encoder": enc.description, "n_train": int(y.size)}
        kind = sc["kind"]
        if kind == "fmcl":
            s = class_signature(feats, y)
            meta.update(classes=s.classes, means=s.means, counts=s.counts)
        elif kind == "pacfl":
            meta["basis"] = pacfl_signature(feats, y, n_basis=int(sc.get("n_basis", 3)))
        elif kind == "fecfl":
            meta["mean"] = fecfl_signature(feats)
        else:
            raise TaskError(f"{self.site}: unknown signature kind {kind!r}")
        if np.unique(y).size == 1:
            meta["note"] = f"{self.site} holds a single class ({int(y[0])})"
        return {}, {"n_classes_present": float(np.unique(y).size)}, meta
