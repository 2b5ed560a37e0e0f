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
        if task == "latent_bounds":
            return self.latent_bounds(params, cfg)
        if task == "descriptor":
            return self.descriptor(params, cfg)
        if task == "ifca":
            return self.ifca(params, cfg, round_)
        if task == "validate_ensemble":
            return self.validate_ensemble(params, cfg)
        raise TaskError(f"{self.site}: unknown task {task!r}")

    def _eval_split(self, cfg):
        import torch

        xtr, ytr, xte, yte = self.data(cfg["data"]["image_size"], cfg["data"]["channels"])
        if cfg.get("evaluate_on") == "all":  # an unseen site never trained: all its data is test data
            return torch.cat([xtr, xte]), torch.cat([ytr, yte])
        return xte, yte

    def _served_metrics(self, model, cfg):
        from .train import evaluate

        xte, yte = self._eval_split(cfg)
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

    # ------------------------------------------------------------------ Flux (003_)
    def _latents(self, params, cfg, split: str = "train"):
        from .train import latents, set_params

        model = self.model(cfg)
        set_params(model, params)
        xtr, ytr, xte, yte = self.data(cfg["data"]["image_size"], cfg["data"]["channels"])
        x, y = (xtr, ytr) if split == "train" else (xte, yte)
        if split == "all":
            import torch

            x, y = torch.cat([xtr, xte]), torch.cat([ytr, yte])
        return latents(model, x), y.numpy()

    def latent_bounds(self, params, cfg):
        """Flux S1: element-wise min and max of the latents (two z-vectors leave the site)."""
        from .flux import latent_bounds

        z, _ = self._latents(params, cfg, "all" if cfg.get("flux", {}).get("label_free") else "train")
        lo, hi = latent_bounds(z, site=self.site)
        return {}, {"n_samples": float(z.shape[0])}, {"lo": lo, "hi": hi}

    def descriptor(self, params, cfg):
        """Flux S2-S4: the descriptor (label-free when ``flux.label_free``, e.g. an unseen site)."""
        from .flux import flux_descriptor, shared_pca

        f = cfg["flux"]
        label_free = bool(f.get("label_free"))
        z, y = self._latents(params, cfg, "all" if label_free else "train")
        pca = shared_pca(np.asarray(f["lo"]), np.asarray(f["hi"]), n_components=int(f.get("n_components", 10)),
                         seed=int(f.get("pca_seed", 0)))
        rng = np.random.default_rng((int(cfg.get("seed", 0)) * 7919 + zlib.crc32(self.site.encode())) % (2**32))
        d = flux_descriptor(z, pca, None if label_free else y, n_classes=None if label_free else cfg["data"]["n_classes"],
                            second_moment=f.get("second_moment", "std"), dp_epsilon=f.get("dp_epsilon"), rng=rng,
                            site=self.site)
        meta = {"label_free": d.label_free, "n_samples": d.n_samples, "warnings": d.warnings}
        if d.full is not None:
            meta["full"] = d.full
        for w in d.warnings:
            print(f"[fedmed] {w}", flush=True)
        return {}, {"descriptor_length": float(len(d.full) if d.full is not None else len(d.label_free))}, meta

    # ------------------------------------------------------------------ IFCA (Ghosh et al.)
    def ifca(self, params, cfg, round_):
        """IFCA: evaluate the K cluster models on local training data, train the one with the
        lowest loss, and report which (``params`` holds the K models as ``m<k>/<name>``)."""
        import torch

        from .train import get_params, set_params, train_local

        K = int(cfg["ifca"]["k"])
        model = self.model(cfg)
        xtr, ytr, _, _ = self.data(cfg["data"]["image_size"], cfg["data"]["channels"])
        losses = []
        for k in range(K):
            set_params(model, {n[len(f"m{k}/"):]: v for n, v in params.items() if n.startswith(f"m{k}/")})
            model.eval()
            with torch.no_grad():
                losses.append(float(torch.nn.functional.cross_entropy(model((xtr - 0.5) / 0.5), ytr)))
        best = int(np.argmin(losses))
        set_params(model, {n[len(f"m{best}/"):]: v for n, v in params.items() if n.startswith(f"m{best}/")})
        metrics, meta = self._served_metrics(model, cfg)
        meta.update(cluster=best, losses=losses)
        if cfg.get("ifca", {}).get("train", True):
            t = cfg["train"]
            out = train_local(model, xtr, ytr, epochs=t["local_epochs"], batch_size=t["batch_size"], lr=t["lr"],
                              momentum=t["momentum"], generator=self.generator(cfg, round_))
            meta.update(n_train=int(xtr.shape[0]), train_loss=out["loss"])
            return get_params(model), metrics, meta
        return {}, metrics, meta

    def validate_ensemble(self, params, cfg):
        """Score the weighted average of K models' class probabilities (how the Flux paper gives
        baselines without test-time assignment a prediction on unseen sites)."""
        from .metrics import site_metrics
        from .train import predict_proba, set_params

        model = self.model(cfg)
        weights = np.asarray(cfg["ensemble"]["weights"], dtype=np.float64)
        xte, yte = self._eval_split(cfg)
        prob = 0.0
        for k, w in enumerate(weights / weights.sum()):
            set_params(model, {n[len(f"m{k}/"):]: v for n, v in params.items() if n.startswith(f"m{k}/")})
            prob = prob + w * predict_proba(model, xte)
        res = site_metrics(yte.numpy(), prob, cfg["data"]["n_classes"])
        return {}, {k: res[k] for k in ("accuracy", "macro_f1", "auc")}, {
            "n_test": res["n_test"], "confusion": res["confusion"], "score_hist": res["score_hist"]}
