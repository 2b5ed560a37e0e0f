"""A 2D lesion-segmentation site (a hospital-style index with masks, :mod:`fedmed.data.sources`): the ``004_``
assessment computed on 2D images, FedAvg / FedProx / FedAvg_w / cluster training of a 2D U-Net, validation.

Its datalist entries are ``{"image": file, "label": mask file, "subject": patient}``. Each split is loaded once per
image size: images ``(N, C, H, W)`` in [0, 1] (:func:`fedmed.data.images.decode_image`), masks ``(N, 1, H, W)`` in
{0, 1} (resized bilinearly, then > 0.5). Scores of fewer than ``k_min`` test images are not sent.
"""

from __future__ import annotations

import numpy as np

from fedmed.core.schema import TaskConfig, task_config
from fedmed.data.images import DataError
from fedmed.data.datalists import patients_of
from fedmed.site.runner import SiteRunner
from fedmed.site.tasks import Reply, TaskError, task_seed

__all__ = ["Seg2DSiteRunner", "image_metadata"]

# the 2D assessment's histograms (values outside fall into the end bins)
EDGES_2D = {"intensity__image": (0.0, 1.0, 51), "label__lesion_area": (0.0, 0.5, 51)}


def image_metadata(x, y) -> dict:
    """``004_``'s metadata on 2D images, one value per image: ``intensity__image`` — the mean intensity (an 8-bit
    image's maximum is 255 almost everywhere, so the paper's maximum-intensity feature carries nothing here) — and
    ``label__lesion_area`` — the lesion's share of the image."""
    return {"intensity__image": x.mean(dim=(1, 2, 3)).numpy().astype(np.float64),
            "label__lesion_area": y.mean(dim=(1, 2, 3)).numpy().astype(np.float64)}


def _served(runner, params, cfg):
    from fedmed.nn.train import set_params

    model = runner.model(cfg)
    set_params(model, params)
    if task_config(cfg).ditto_lambda:
        raise TaskError(f"{runner.site}: Ditto is not available for 2D segmentation")
    return model


def _metrics(runner, model, cfg) -> tuple[dict, dict]:
    import torch

    from fedmed.nn.seg2d import seg2d_metrics

    cfg = task_config(cfg)
    s = runner.cases(cfg)
    k = runner.k_min(cfg)
    if cfg.evaluate_on == "all":  # a new site scored on everything it has (fedmed.workflows.onboard)
        sets = [("test", tuple(torch.cat([s[n][i] for n in ("training", "validation", "test")]) for i in (0, 1)))]
    else:
        sets = [("test", s["test"]), ("val", s["validation"])]
    metrics, meta = {}, {}
    for name, (x, y) in sets:
        pre = "" if name == "test" else "val_"
        if int(x.shape[0]) < k:  # scores of fewer than k_min images are not sent (privacy.k_min)
            meta[pre + "n_test"] = 0
            continue
        m = seg2d_metrics(model, x, y)
        metrics.update({pre + "dice_mean": m["dice_mean"], pre + "fp_pixels": m["fp_pixels"]})
        meta[pre + "n_test"] = int(x.shape[0])
    return {k_: v for k_, v in metrics.items() if k_ in ("dice_mean", "fp_pixels", "val_dice_mean")}, meta


def serve_score(runner, params: dict, cfg: TaskConfig, round_: int = 0) -> Reply:
    """#57's serving plan at a 2D lesion-segmentation site (:func:`fedmed.site.tasks.serving_reply`): every packed
    model's lesion Dice per **validation** image (a win where the candidate's is higher; lesion-free images are not
    scored), sent as sums of the per-image Dice differences (the score test) and, where none is below ``k_min``, the
    counts (the sign test). With ``finetune`` the site also trains the reference ``epochs`` more on its own training split at
    ``lr_scale`` x ``train.lr`` (a fresh optimizer, as the classifier's) and scores that model, which never leaves it,
    as ``finetuned``. The test split is not read."""
    from fedmed.nn.seg2d import dice_per_image, predict_masks2d
    from fedmed.site.tasks import finetune_config, serving_reply

    cfg = task_config(cfg)
    x, y = runner.cases(cfg)["validation"]
    gt = y[:, 0].numpy() > 0.5 if len(y) else None

    def dice(m) -> tuple[np.ndarray, np.ndarray]:  # the Dice is the item's score and its proper score: the sums of
        # the Dice differences travel as a classifier's Brier sums do (the score test; counts below k_min never do)
        d = dice_per_image(predict_masks2d(m, x), gt) if len(y) else np.zeros(0)
        return d, d

    def finetune(model, options):  # the same fine-tuning as finetune_local's (fedmed.site.tasks.finetune_at_site)
        from fedmed.site.tasks import FINETUNE_ROUND

        ft = finetune_config(cfg, options)
        _, loss = _fit(runner, model, ft, FINETUNE_ROUND, runner.optimizer(model, ft, keep=False), "fine-tuning")
        return dice(model), {"finetune_train_loss": loss}

    return serving_reply(runner, params, cfg, dice, "dice_mean", finetune)


def validate(runner, params: dict, cfg: TaskConfig, round_: int = 0) -> Reply:
    from fedmed.site.served import keep_served

    model = _served(runner, params, cfg)
    metrics, meta = _metrics(runner, model, cfg)
    meta.update(keep_served(runner, model, cfg))
    return Reply(runner.site, metrics, meta, {})


def _fit(runner, model, cfg: TaskConfig, round_: int, optimizer, what: str) -> tuple[int, float]:
    """``cfg.train.local_epochs`` of the site's training split into ``model`` (flips, the task's loss, FedProx's
    term when set); the number of training images and the mean loss. A diverged loss is an error."""
    import torch

    from fedmed.nn.seg2d import train_seg2d_local

    x, y = runner.cases(cfg)["training"]
    runner.require_k_min(int(x.shape[0]), "training images", cfg, "training")
    t = cfg.train
    g = torch.Generator().manual_seed(task_seed(cfg, runner.site, round_) % (2**63))
    out = train_seg2d_local(model, x, y, epochs=t.local_epochs, batch_size=t.batch_size, optimizer=optimizer,
                            loss=t.seg.loss, mu=t.fedprox_mu, generator=g, precision=runner.precision(cfg))
    runner.skipped_note(out, cfg)
    if not np.isfinite(out["loss"]):
        raise TaskError(f"{runner.site}: {what} diverged in round {round_}")
    return int(x.shape[0]), float(out["loss"])


def train(runner, params: dict, cfg: TaskConfig, round_: int = 0) -> Reply:
    from fedmed.nn.train import get_params

    cfg = task_config(cfg)
    model = _served(runner, params, cfg)
    metrics, meta = _metrics(runner, model, cfg)
    n, loss = _fit(runner, model, cfg, round_, runner.optimizer(model, cfg, cfg.cluster), "training")
    meta.update(n_train=n, train_loss=loss)
    metrics["train_loss"] = loss
    return Reply(runner.site, metrics, meta, get_params(model))


def finetune_local(runner, params: dict, cfg: TaskConfig, round_: int = 0) -> Reply:
    """The served model fine-tuned at the site (the plan's ``finetuned``, made again exactly as ``serve_score`` made
    it): ``epochs`` more on the site's training split at ``lr_scale`` x ``train.lr``, a fresh optimizer, then scored
    on its validation and test splits. The model never leaves the site; only its metrics do."""
    from fedmed.site.tasks import FinetuneLocalOptions, finetune_config

    cfg = task_config(cfg)
    from fedmed.site.tasks import FINETUNE_ROUND

    ft = finetune_config(cfg, FinetuneLocalOptions.model_validate(cfg.method_options))
    model = _served(runner, params, cfg)
    n, loss = _fit(runner, model, ft, FINETUNE_ROUND, runner.optimizer(model, ft, keep=False), "fine-tuning")
    metrics, meta = _metrics(runner, model, cfg)
    metrics["train_loss"] = loss
    meta.update(n_train=n, train_loss=loss)
    from fedmed.site.served import keep_served

    meta.update(keep_served(runner, model, cfg))
    return Reply(runner.site, metrics, meta, {})


def assess(runner, params: dict, cfg: TaskConfig, round_: int = 0) -> Reply:
    """``004_``'s assessment on 2D images: histograms of per-image mean intensity and lesion area, and the centroid
    of an image encoder's embeddings (EfficientNet-Lite0: the job's ImageNet release file when it names one, else
    seeded random) — aggregates of at least k_min images (per-image values only if this site allows them)."""
    import torch

    from fedmed.nn.encoders import build_encoder, extract_features
    from fedmed.site.seg_aggregates import assessment_payload, per_image_asked

    cfg = task_config(cfg)
    s = runner.cases(cfg)
    x = torch.cat([s["training"][0], s["validation"][0]])
    y = torch.cat([s["training"][1], s["validation"][1]])
    k = runner.k_min(cfg)
    if int(x.shape[0]) < k:
        raise TaskError(f"{runner.site}: {int(x.shape[0])} image(s) < k_min={k}; the assessment would describe fewer "
                        f"than k_min images and is not sent")
    per_image, notes = per_image_asked(runner, cfg)
    enc = build_encoder(runner.ASSESS_ENCODER, weights=runner.weights(cfg), seed=cfg.seed,
                        in_channels=cfg.data.in_channels, device=runner.device(cfg))
    emb = extract_features(enc, runner.images_at_size(cfg, enc.image_size))
    rng = np.random.default_rng(task_seed(cfg, runner.site, salt=5))
    meta = assessment_payload(image_metadata(x, y), emb, enc.description, n_cases=int(x.shape[0]),
                              per_value=per_image, per_image=per_image, edges=EDGES_2D,
                              privacy=cfg.privacy.model_dump(), rng=rng)
    meta["notes"] = notes
    return Reply(runner.site, {"n_cases": float(x.shape[0])}, meta, {})


class Seg2DSiteRunner(SiteRunner):
    """A site of a 2D lesion-segmentation federation (see the module notes)."""

    def cases(self, cfg: TaskConfig) -> dict:
        """``{"training" | "validation" | "test": (x, y)}`` at the task's image size (decoded once, cached)."""
        cfg = task_config(cfg)
        key = ("seg2d", cfg.data.image_size, cfg.data.in_channels)
        if self._data is None or self._data_key != key:
            doc = self._datalist("segmentation")
            seen = {e.get("subject") for e in doc["training"] + doc["validation"] if e.get("subject")}
            both = sorted(str(e["subject"]) for e in doc["test"] if e.get("subject") in seen)
            if both:
                raise DataError(f"{self.site}: datalist {self.display(self.datalist_path)}: patient(s) {both[:3]} in "
                                f"both training and test", f"{self.site}: its datalist has {len(both)} patient(s) in "
                                f"both training and test")
            out = {k: self._split(doc[k], cfg.data.image_size, cfg.data.in_channels, k)
                   for k in ("training", "validation", "test")}
            if int(out["training"][0].shape[0]) == 0:
                raise DataError(f"{self.site}: datalist {self.display(self.datalist_path)} has no training images",
                                f"{self.site}: its datalist has no training images")
            self._data, self._data_key = out, key
            self._val_units = patients_of(doc["validation"])
        return self._data

    def val_units(self, cfg: TaskConfig) -> list | None:
        self.cases(cfg)
        return getattr(self, "_val_units", None)

    def images_at_size(self, cfg: TaskConfig, size: int):
        """The training and validation images decoded at ``size`` (an encoder's input size)."""
        import torch

        cfg = task_config(cfg)
        doc = self._datalist("segmentation")
        return torch.cat([self._split(doc[k], size, cfg.data.in_channels, k)[0] for k in ("training", "validation")])

    def _split(self, entries, size: int, channels: int, split: str):
        import torch

        from fedmed.data.images import conversion_note, load_images

        for i, e in enumerate(entries):
            if not e.get("label") or isinstance(e["label"], (int, float)):
                raise DataError(f"{self.site}: {split}[{i}] has no mask file as its label",
                                f"{self.site}: {split}[{i}] has no mask file as its label")
        c = self.cache
        files = [str(e["image"]) for e in entries] + [str(e["label"]) for e in entries]
        ckey = c.key(files, {"kind": "seg2d", "size": size, "channels": channels,
                             "limits": vars(self.policy.limits)}) if c is not None and entries else None
        hit = c.get(ckey) if ckey is not None else None
        if hit is not None:
            return torch.from_numpy(hit[0]["x"]), torch.from_numpy(hit[0]["y"])
        done: set = set()
        x, _ = load_images([{"image": e["image"], "label": 0} for e in entries], image_size=size, channels=channels,
                           site=self.site, display=self.display, conversions=done, split=split,
                           limits=self.policy.limits)
        m, _ = load_images([{"image": e["label"], "label": 0} for e in entries], image_size=size, channels=1,
                           site=self.site, display=self.display, split=f"{split} masks", limits=self.policy.limits)
        y = (m > 0.5).float()
        note = conversion_note(self.site, done)
        if note and note not in self.notes:
            print(f"[fedmed] {note}", flush=True)
        if c is not None:
            c.put(ckey, {"x": x.numpy(), "y": y.numpy()}, {})
            self.cache_note()
        return x, y

    def model(self, cfg: TaskConfig):
        from fedmed.nn.models import seg_model_from_config

        cfg = task_config(cfg)
        m = cfg.model
        key = ("seg2d", cfg.data.in_channels, tuple(m.channels), m.arch, repr(sorted(m.args.items())))
        if self._model is None or self._model_key != key:
            self._model = seg_model_from_config({**m.model_dump(), "init_weights": None}, cfg.data.in_channels,
                                                seed=cfg.seed, modules=self.policy.modules, spatial_dims=2).to(
                self.device(cfg))
            self._model_key = key
            self._optimizers = {}
        return self._model

    TASKS = {"assess": assess, "train": train, "validate": validate, "serve_score": serve_score,
             "finetune_local": finetune_local}
    KIND = "segmentation_2d"
    ASSESS_ENCODER = "efficientnet_lite0"  # the 2D counterpart of 004_'s embedding
