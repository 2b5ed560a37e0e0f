"""What a site does for each task, independent of the FL framework.

``custom/client.py`` (NVFlare Client API) only moves data between FLARE and
:class:`SiteRunner`; the same runner could sit behind any other framework. Tasks:

* ``train``: score the served model on the local validation and test splits, train it locally,
  return the update with the served model's metrics.
* ``validate``: score the served model only.
* ``signature`` (FMCL, PACFL, FECFL), ``latent_bounds`` / ``descriptor`` (Flux), ``ifca``,
  ``validate_ensemble``: see each method.

What a reply carries: parameters (training tasks), metric values over at least ``k_min``
samples, and aggregates (confusion matrices and score histograms with rows of fewer than
``k_min`` samples zeroed, sample counts, signatures of classes with at least ``k_min`` samples).
Never images, labels or per-sample outputs (docs/privacy.md).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedmed.core.schema import FluxTask, task_config
from fedmed.data.images import DataError, conversion_note, load_datalist, load_images
from fedmed.site.settings import SiteSettings, settings_for_dir

__all__ = ["SiteRunner", "Splits", "TaskError", "task_seed", "answer", "make_runner", "scrubbed", "to_meta"]


def task_seed(cfg: dict, site: str, round_: int | None = None, *, salt: int = 0) -> int:
    """The one seed rule of every site task: from the run's seed, the site's name and — for what changes every round
    (training batches, augmentation, patches) — the round; ``salt`` keeps a site's one-off draws apart (signatures,
    descriptors, assessments). Deterministic across processes (``zlib.crc32``, not ``hash``)."""
    seed, crc = task_config(cfg).seed, zlib.crc32(site.encode())
    if round_ is not None:
        return seed * 1_000_003 + int(round_) * 7919 + crc
    return (seed * 7919 + crc + int(salt)) % (2**32)


class TaskError(RuntimeError):
    """A task this site cannot perform; the message says why (names files where relevant)."""


@dataclass
class Splits:
    """A site's images, (N, C, H, W) in [0, 1], and labels (N,) per split."""

    train: tuple
    val: tuple
    test: tuple


class SiteRunner:
    """Holds one site's data, model and optimizer state between tasks.

    Args:
        site: the site's name.
        source: its :class:`~fedmed.site.settings.SiteSettings`, or a folder holding ``<site>.json``.
    """

    def __init__(self, site: str, source):
        self.site = site
        self.settings = source if isinstance(source, SiteSettings) else settings_for_dir(site, source)
        self._data = None
        self._data_key = None
        self._model = None
        self._model_key = None
        self._optimizers: dict = {}
        self.state: dict = {}  # workflow state kept between tasks (e.g. a personal model)
        self.notes: list[str] = []  # notes for this site's log and the server, sent with the next reply
        self._labels_checked = None
        self._device = self._device_spec = None

    @property
    def datalist_path(self) -> Path:
        return self.settings.datalist

    def display(self, path) -> str:
        return self.settings.display(path)

    def k_min(self, cfg: dict) -> int:
        """The job's minimum group size, raised by the site's own setting if that is larger."""
        k = task_config(cfg).privacy.k_min
        return max(k, int(self.settings.k_min or 0))

    def device(self, cfg: dict):
        """This site's torch device: its own setting, else the job's ``train.device`` (:mod:`fedmed.core.device`)."""
        from fedmed.core.device import resolve_device

        spec = self.settings.device or task_config(cfg).train.device
        if self._device_spec != spec:
            self._device, self._device_spec = resolve_device(spec, where=self.site), spec
        return self._device

    def precision(self, cfg: dict) -> str:
        return task_config(cfg).train.precision

    def require_k_min(self, n: int, what: str, cfg: dict, task: str) -> None:
        """A reply computed from ``n`` samples leaves only when ``n >= k_min``; else this site sits out ``task``
        (the error, which names no count below k_min but this site's own total, is what the server records)."""
        k = self.k_min(cfg)
        if n < k:
            raise TaskError(f"{self.site}: sits out {task}: fewer {what} than k_min={k} (privacy.k_min): its reply "
                            f"would describe fewer than k_min samples")

    # ------------------------------------------------------------------ data and model
    def _datalist(self, task: str = "classification") -> dict:
        return load_datalist(self.datalist_path, task=task, root=self.settings.data_root,
                             name=f"{self.site}: datalist {self.display(self.datalist_path)}")

    def data(self, image_size: int, channels: int) -> Splits:
        key = (image_size, channels)
        if self._data is None or self._data_key != key:
            doc = self._datalist()
            done: set = set()
            kw = dict(image_size=image_size, channels=channels, site=self.site, display=self.display, conversions=done)
            splits = Splits(*(load_images(doc[k], **kw) for k in ("training", "validation", "test")))
            note = conversion_note(self.site, done)
            if note:  # said once per site: its log and the server's (the next reply's notes)
                print(f"[fedmed] {note}", flush=True)
                self.notes.append(note)
            if splits.train[0].shape[0] == 0:
                raise DataError(f"{self.site}: datalist {self.display(self.datalist_path)} has no training images")
            self._data, self._data_key = splits, key
        return self._data

    def _splits(self, cfg) -> Splits:
        cfg = task_config(cfg)
        s = self.data(cfg.data.image_size, cfg.data.channels)
        n = cfg.data.n_classes
        if n and self._labels_checked != n:
            self.check_label_space(s, int(n), cfg.classes)
            self._labels_checked = n
        return s

    def check_label_space(self, s: Splits, n: int, names=None) -> None:
        """Every label must be a class id of the job's global label space ``0..n-1``."""
        for split, (_, y) in zip(("training", "validation", "test"), (s.train, s.val, s.test)):
            bad = sorted({int(v) for v in y.tolist() if v >= n})
            if bad:
                space = f" ({', '.join(map(str, names))})" if names else ""
                raise DataError(f"{self.site}: datalist {self.display(self.datalist_path)} {split} has label(s) "
                                f"{bad[:5]} outside the job's global label space 0..{n - 1}{space}")

    def model(self, cfg: dict):
        from fedmed.nn.models import model_from_config

        cfg = task_config(cfg)
        m = cfg.model
        key = (m.arch, cfg.data.channels, cfg.data.n_classes, m.width, m.norm, repr(sorted(m.args.items())))
        if self._model is None or self._model_key != key:
            self._model = model_from_config({**m.model_dump(), "init_weights": None}, cfg.data.channels,
                                            cfg.data.n_classes, seed=cfg.seed).to(self.device(cfg))  # weights: the server's
            self._model_key = key
            self._optimizers = {}
        return self._model

    def optimizer(self, model, cfg: dict, key=None):
        """The optimizer for the model served as ``key`` (a cluster id); kept between rounds when the
        recipe says so, so momentum / Adam moments carry over."""
        from fedmed.nn.train import make_optimizer

        cfg = task_config(cfg)
        t = cfg.train

        def new():
            if cfg.finetune:  # 001_ fine-tuning: AdamW with layer-wise lr decay groups
                import torch

                from fedmed.nn.mae import layerwise_param_groups

                return torch.optim.AdamW(layerwise_param_groups(model, cfg.finetune.layer_decay), lr=t.lr,
                                         weight_decay=t.weight_decay)
            return make_optimizer(model, t.model_dump())

        if not t.keep_optimizer_state:
            return new()
        if key not in self._optimizers:
            self._optimizers[key] = new()
        return self._optimizers[key]

    def lr_schedule(self, cfg, round_):
        """Fine-tuning (``cfg["finetune"]``): warm-up then cosine over the whole federated run, as a function of the
        fraction of this round's local steps; None otherwise (constant lr)."""
        cfg = task_config(cfg)
        ft = cfg.finetune
        if not ft:
            return None
        from fedmed.nn.mae import scheduled_lr

        rounds, base, warmup = ft.rounds, cfg.train.lr, ft.warmup
        return lambda f: scheduled_lr(base, (round_ + f) / rounds, warmup)

    def generator(self, cfg: dict, round_: int):
        import torch

        g = torch.Generator()
        g.manual_seed(task_seed(cfg, self.site, round_) % (2**63))
        return g

    # ------------------------------------------------------------------ tasks
    def handle(self, task: str, params: dict, cfg: dict, round_: int = 0) -> tuple[dict, dict, dict]:
        """Run ``task``; returns (params to send, scalar metrics, meta aggregates). Notes the site has not sent yet
        (e.g. what its image loading converted) go with the reply. ``cfg`` is read as a
        :class:`~fedmed.core.schema.TaskConfig` (validated, the schema's defaults for what it leaves out)."""
        out, metrics, meta = self.run_task(task, params, task_config(cfg), round_)
        if self.notes:
            meta = {**meta, "notes": list(meta.get("notes") or []) + self.notes}
            self.notes = []
        return out, metrics, meta

    # the tasks this runner serves: task name -> (method, what it takes); a subclass lists only the ones it serves
    TASKS = {"train": ("train", "params", "round"), "validate": ("validate", "params"), "signature": ("signature",),
             "latent_bounds": ("latent_bounds", "params"), "descriptor": ("descriptor", "params"),
             "ifca": ("ifca", "params", "round"), "validate_ensemble": ("validate_ensemble", "params"),
             "class_set": ("class_set",)}

    def run_task(self, task: str, params: dict, cfg: dict, round_: int = 0) -> tuple[dict, dict, dict]:
        if task not in self.TASKS:
            raise TaskError(f"{self.site}: unknown task {task!r} (this site's {type(self).__name__} serves "
                            f"{', '.join(sorted(self.TASKS))})")
        method, *takes = self.TASKS[task]  # every task method takes ([params,] cfg[, round_])
        args = ([params] if "params" in takes else []) + [cfg] + ([round_] if "round" in takes else [])
        return getattr(self, method)(*args)

    def _eval_sets(self, cfg):
        """(name, x, y) of what the served model is scored on: validation and test splits; an unseen
        site that never trained is scored on all its data."""
        import torch

        s = self._splits(cfg)
        if task_config(cfg).evaluate_on == "all":
            return [("test", torch.cat([s.train[0], s.val[0], s.test[0]]), torch.cat([s.train[1], s.val[1], s.test[1]]))]
        return [("val", *s.val), ("test", *s.test)]

    def _metrics_of(self, prob_fn, cfg):
        """Metrics of the served model (``prob_fn(x) -> (n, C)`` probabilities) on each evaluation set:
        test metrics under their plain names, validation metrics prefixed ``val_``."""
        from fedmed.algorithms.metrics import site_metrics

        metrics, meta = {}, {}
        k = self.k_min(cfg)
        n_classes = task_config(cfg).data.n_classes
        for name, x, y in self._eval_sets(cfg):
            if x.shape[0] == 0:
                continue
            res = site_metrics(y.numpy(), prob_fn(x), n_classes, k_min=k)
            pre = "" if name == "test" else "val_"
            metrics.update({pre + m: res[m] for m in ("accuracy", "macro_f1", "macro_acc", "auc")})
            meta.update({pre + "n_test": res["n_test"], pre + "confusion": res["confusion"],
                         pre + "score_hist": res["score_hist"], pre + "withheld": res["withheld"]})
        return metrics, meta

    def _served_metrics(self, model, cfg):
        from fedmed.nn.train import predict_proba

        return self._metrics_of(lambda x: predict_proba(model, x, precision=self.precision(cfg)), cfg)

    def validate(self, params, cfg):
        from fedmed.nn.train import set_params

        model = self.model(cfg)
        set_params(model, params)
        metrics, meta = self._served_metrics(model, cfg)
        return {}, metrics, meta

    def _train(self, model, cfg, round_, key):
        from fedmed.nn.train import train_local

        s = self._splits(cfg)
        self.require_k_min(int(s.train[0].shape[0]), "training images", cfg, "training")
        cfg = task_config(cfg)
        t = cfg.train
        out = train_local(model, s.train[0], s.train[1], epochs=t.local_epochs, batch_size=t.batch_size,
                          optimizer=self.optimizer(model, cfg, key), mu=t.fedprox_mu,
                          class_weights=cfg.class_weights, generator=self.generator(cfg, round_),
                          augment=t.augment, lr_at=self.lr_schedule(cfg, round_),
                          precision=self.precision(cfg))
        if not np.isfinite(out["loss"]):
            raise TaskError(f"{self.site}: training diverged (loss {out['loss']}) in round {round_}")
        return {"n_train": int(s.train[0].shape[0]), "train_loss": out["loss"], "steps": out["steps"]}

    def train(self, params, cfg, round_):
        from fedmed.nn.train import get_params, set_params

        model = self.model(cfg)
        set_params(model, params)
        metrics, meta = self._served_metrics(model, cfg)
        meta.update(self._train(model, cfg, round_, task_config(cfg).cluster))
        metrics["train_loss"] = meta["train_loss"]
        return get_params(model), metrics, meta

    def class_set(self, cfg):
        """PreP-WFL's statistics round (``001_`` Alg. 2): only the ids of the classes this site holds leave it."""
        y = self._splits(cfg).train[1].numpy()
        ids, counts = np.unique(y, return_counts=True)
        k = self.k_min(cfg)
        held = sorted(int(c) for c, n in zip(ids, counts) if n >= k)
        meta = {"classes": held}
        if len(held) < ids.size:
            meta["notes"] = [f"{self.site}: {ids.size - len(held)} class(es) with fewer than k_min={k} training "
                             f"images not reported (privacy.k_min)"]
            print(f"[fedmed] {meta['notes'][0]}", flush=True)
        return {}, {"n_classes_held": float(len(held))}, meta

    def signature(self, cfg):
        """One-shot clustering signature of the site's training data (only aggregates leave).

        ``cfg["signature"]``: ``kind`` (fmcl | pacfl | fecfl), ``encoder``, ``weights`` (local
        file or None for seeded random init), ``image_size``, ``n_basis`` (PACFL); ``cfg["privacy"]``:
        ``k_min`` (classes with fewer samples are withheld), DP settings (:mod:`fedmed.algorithms.privacy`).
        """
        from fedmed.nn.encoders import build_encoder, extract_features
        from fedmed.algorithms.privacy import signature_payload

        cfg = task_config(cfg)
        sc = cfg.signature
        s = self._splits(cfg)
        enc = build_encoder(sc.encoder, weights=sc.weights, seed=sc.seed, in_channels=cfg.data.channels,
                            image_size=sc.image_size, device=self.device(cfg))
        feats = extract_features(enc, s.train[0], progress=lambda m: print(f"[{self.site}] {m}", flush=True))
        y = s.train[1].numpy()
        rng = np.random.default_rng(task_seed(cfg, self.site, salt=17))
        meta = signature_payload(sc.kind, feats, y, k_min=self.k_min(cfg), privacy=cfg.privacy.model_dump(),
                                 n_basis=sc.n_basis, rng=rng, site=self.site)
        meta.update(encoder=enc.description, n_train=int(y.size))
        if sc.kind == "pacfl" and sc.encoder == "pixels" and not cfg.privacy.dp_epsilon:
            meta["notes"] = meta.get("notes", []) + [
                f"{self.site}: WARNING PACFL on raw pixels without DP: each class's leading singular vector is close "
                f"to an average image of that class (docs/privacy.md); set privacy.dp_epsilon or use an encoder"]
        for note in meta.get("notes", []):
            print(f"[fedmed] {note}", flush=True)
        return {}, {"n_classes_sent": float(len(meta.get("classes", [])))}, meta

    # ------------------------------------------------------------------ Flux (003_)
    def _latents(self, params, cfg, split: str = "train"):
        import torch

        from fedmed.nn.train import latents, set_params

        model = self.model(cfg)
        set_params(model, params)
        s = self._splits(cfg)
        if split == "all":
            x, y = torch.cat([s.train[0], s.val[0], s.test[0]]), torch.cat([s.train[1], s.val[1], s.test[1]])
        else:
            x, y = s.train
        return latents(model, x), y.numpy()

    def latent_bounds(self, params, cfg):
        """Flux S1: the box of the latents (two z-vectors leave the site; with DP or k_min they are
        clipped quantile bounds, :func:`fedmed.algorithms.privacy.private_bounds`)."""
        from fedmed.algorithms.privacy import private_bounds

        cfg = task_config(cfg)
        f = cfg.flux or FluxTask()
        z, _ = self._latents(params, cfg, "all" if f.label_free else "train")
        rng = np.random.default_rng(task_seed(cfg, self.site, salt=3))
        lo, hi, note = private_bounds(z, k_min=self.k_min(cfg), privacy=cfg.privacy.model_dump(), rng=rng,
                                      site=self.site, box=f.box)
        return {}, {"n_samples": float(z.shape[0])}, {"lo": lo, "hi": hi, "notes": [note] if note else []}

    def descriptor(self, params, cfg):
        """Flux S2-S4: the descriptor (label-free when ``flux.label_free``, e.g. an unseen site)."""
        from fedmed.algorithms.flux import flux_descriptor, shared_pca

        cfg = task_config(cfg)
        f = cfg.flux
        label_free = f.label_free
        z, y = self._latents(params, cfg, "all" if label_free else "train")
        pca = shared_pca(np.asarray(f.lo), np.asarray(f.hi), n_components=f.n_components, seed=f.pca_seed)
        rng = np.random.default_rng(task_seed(cfg, self.site))
        d = flux_descriptor(z, pca, None if label_free else y, n_classes=None if label_free else cfg.data.n_classes,
                            second_moment=f.second_moment, dp_epsilon=cfg.privacy.dp_epsilon, rng=rng,
                            site=self.site, k_min=self.k_min(cfg), absent=f.absent_class)
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

        from fedmed.nn.train import get_params, set_params

        cfg = task_config(cfg)
        K = cfg.ifca.k
        model = self.model(cfg)
        xtr, ytr = self._splits(cfg).train
        self.require_k_min(int(xtr.shape[0]), "training images", cfg, "IFCA")  # the K losses average them
        dev = self.device(cfg)
        xd, yd = (xtr.to(dev) - 0.5) / 0.5, ytr.to(dev)
        losses = []
        for k in range(K):
            set_params(model, {n[len(f"m{k}/"):]: v for n, v in params.items() if n.startswith(f"m{k}/")})
            model.eval()
            with torch.no_grad():
                losses.append(float(torch.nn.functional.cross_entropy(model(xd), yd)))
        best = int(np.argmin(losses))
        set_params(model, {n[len(f"m{best}/"):]: v for n, v in params.items() if n.startswith(f"m{best}/")})
        metrics, meta = self._served_metrics(model, cfg)
        meta.update(cluster=best, losses=losses)
        if cfg.ifca.train:
            meta.update(self._train(model, cfg, round_, ("ifca", best)))
            metrics["train_loss"] = meta["train_loss"]
            return get_params(model), metrics, meta
        return {}, metrics, meta

    def validate_ensemble(self, params, cfg):
        """Score the weighted average of K models' class probabilities (how the Flux paper gives
        baselines without test-time assignment a prediction on unseen sites)."""
        from fedmed.nn.train import predict_proba, set_params

        model = self.model(cfg)
        weights = np.asarray(task_config(cfg).ensemble.weights, dtype=np.float64)
        weights = weights / weights.sum()

        def prob(x):
            out = 0.0
            for k, w in enumerate(weights):
                set_params(model, {n[len(f"m{k}/"):]: v for n, v in params.items() if n.startswith(f"m{k}/")})
                out = out + w * predict_proba(model, x, precision=self.precision(cfg))
            return out

        metrics, meta = self._metrics_of(prob, cfg)
        return {}, metrics, meta


# ---------------------------------------------------------------------- one reply loop, for every federation
def make_runner(site: str, settings, cfg: dict) -> SiteRunner:
    """The runner of the site tasks ``cfg`` asks for (image classification, Fed-MAE or segmentation)."""
    task = task_config(cfg).task
    if task == "mae":
        from fedmed.site.mae import MAESiteRunner

        return MAESiteRunner(site, settings)
    if task == "segmentation":
        from fedmed.site.seg import SegSiteRunner

        return SegSiteRunner(site, settings)
    return SiteRunner(site, settings)


def to_meta(d: dict) -> dict:
    """Arrays travel in the reply's meta as lists (NVFlare: ``FLModel.meta``)."""
    return {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in d.items()}


def scrubbed(site: str, runner: SiteRunner | None, err: Exception) -> str:
    """The one-line error a site sends for ``err``: named by the site, no absolute path (files under the site's data
    roots relative to them, others by file name)."""
    from fedmed.site.settings import scrub

    msg = str(err) if str(err).startswith(site) else f"{site}: {type(err).__name__}: {err}"
    return runner.settings.scrub(msg) if runner is not None else scrub(msg, [])


def answer(site: str, runner: SiteRunner | None, task: str, params: dict, cfg: dict, round_: int,
           settings=None) -> tuple[SiteRunner | None, dict, dict, dict, str | None]:
    """One task at one site, as every federation runs it: (runner, params, metrics, meta, error).

    The runner is made at the site's first task (``settings``: its :class:`~fedmed.site.settings.SiteSettings` or a
    folder holding ``<site>.json``; by default what :func:`~fedmed.site.settings.resolve_site_settings` finds). A
    task the site cannot do is answered with ``meta = {"error": message}`` naming the site and files relative to its
    data root; every string of a reply is scrubbed of absolute paths. ``error`` is the message with the traceback's
    summary for the site's own log (``None`` when the task succeeded)."""
    import traceback

    try:
        if runner is None:
            if settings is None:  # the site's own settings (FEDMED_* variables or its startup kit)
                from fedmed.site.settings import resolve_site_settings

                settings = resolve_site_settings(site)
            runner = make_runner(site, settings, cfg)
        out, metrics, meta = runner.handle(task, params or {}, cfg, round_)
        meta = runner.settings.scrub_reply(meta)  # no absolute path in any text that leaves the site
    except Exception as e:  # reported to the server by name; the federation goes on
        msg = scrubbed(site, runner, e)
        return runner, {}, {"failed": 1.0}, {"error": msg, "task": task}, f"{msg}\n{traceback.format_exc()}"
    meta = to_meta({**meta, "task": task, "round": round_, "cluster": meta.get("cluster", task_config(cfg).cluster)})
    return runner, out, metrics, meta, None
