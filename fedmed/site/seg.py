"""A segmentation site's tasks (``004_``): assessment, FedAvg/FedProx/FedAvg_w/cluster training, Ditto.

Config keys (``cfg``): ``task: "segmentation"``, ``data.shape``/``data.roi``/``data.in_channels``,
``model.channels``, ``train`` (local epochs, optimizer and lr, ``fedprox_mu``, ``seg``: loss, patches per
volume, share of tumour-centred patches), ``ditto_lambda`` (Ditto: a personal model trained with a proximal
pull toward the served global model), ``assess`` (encoder weights, ``per_value``), ``privacy``.

Each site scores the model it is served on its test cases (:func:`fedmed.nn.seg.seg_metrics`: Dice on
tumour-bearing cases, HD95, false-positive voxels on tumour-free cases). A site checks that no subject is in
both its training and its test data.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from fedmed.core.schema import TaskConfig, task_config
from fedmed.data.images import DataError
from fedmed.site.runner import SiteRunner
from fedmed.site.tasks import Reply, TaskError, task_seed

__all__ = ["SegSiteRunner"]


def _seed(runner, cfg, round_):
    return task_seed(cfg, runner.site, round_) % (2**31)


def _metrics(runner, model, cfg):
    from fedmed.nn.seg import seg_metrics

    tr, te = runner.cases(cfg)
    if task_config(cfg).evaluate_on == "all":  # a new site scored on everything it has (fedmed.workflows.onboard)
        te = list(tr) + list(te)
    if len({str(c["meta"].get("subject") or c["meta"].get("id")) for c in te}) < runner.k_min(cfg):
        return {}, {"n_test": 0}  # scores of fewer than k_min test subjects are not sent (privacy.k_min)
    metrics = seg_metrics(model, te, roi=tuple(task_config(cfg).data.roi)) if te else {}
    va = runner.validation_cases(cfg) if task_config(cfg).evaluate_on != "all" else []
    if len({str(c["meta"].get("subject") or c["meta"].get("id")) for c in va}) >= max(1, runner.k_min(cfg)):
        # the site's validation subjects (held out of its training): what `selection: validation` reads
        val = seg_metrics(model, va, roi=tuple(task_config(cfg).data.roi))
        metrics.update({f"val_{k}": val[k] for k in ("dice_mean", "dice_wt") if k in val})
    return metrics, {"n_test": len(te)}


def validate(runner, params: dict, cfg: TaskConfig, round_: int = 0) -> Reply:
    from fedmed.nn.train import set_params

    set_params(runner.model(cfg), params)
    metrics, meta = _metrics(runner, served_model(runner, cfg), cfg)
    return Reply(runner.site, metrics, meta, {})


def _local(runner, model, cases, cfg, seed, key, **kw):
    from fedmed.nn.seg import train_seg_local

    cfg = task_config(cfg)
    t, s = cfg.train, cfg.train.seg
    return train_seg_local(model, runner.volumes_on_device(cases, cfg), epochs=t.local_epochs, optimizer=runner.optimizer(model, cfg, key),
                           roi=tuple(cfg.data.roi), patches=s.patches_per_volume, pos_fraction=s.pos_fraction,
                           loss=s.loss, seed=seed, precision=runner.precision(cfg), workers=t.workers, **kw)


def served_model(runner, cfg: TaskConfig):
    """The model this site uses: with Ditto (``ditto_lambda``, Li et al. 2021) its personal model, which the runner
    keeps in its state between rounds; else the global one."""
    import copy

    if task_config(cfg).ditto_lambda:
        if "personal" not in runner.state:
            runner.state["personal"] = copy.deepcopy(runner.model(cfg))
        return runner.state["personal"]
    return runner.model(cfg)


def train(runner, params: dict, cfg: TaskConfig, round_: int = 0) -> Reply:
    from fedmed.nn.train import get_params, set_params

    tr, _ = runner.cases(cfg)
    runner.require_k_min(len({c["meta"]["subject"] for c in tr}), "training subjects", cfg, "training")
    model = runner.model(cfg)
    set_params(model, params)
    served = served_model(runner, cfg)
    metrics, meta = _metrics(runner, served, cfg)
    seed = _seed(runner, cfg, round_)
    anchor = [p.detach().clone() for p in model.parameters()]
    cfg = task_config(cfg)
    out = _local(runner, model, tr, cfg, seed, cfg.cluster, mu=cfg.train.fedprox_mu)
    runner.skipped_note(out, cfg)
    if cfg.ditto_lambda:  # Ditto (Li et al. 2021): personal model pulled toward the global one
        _local(runner, served, tr, cfg, seed + 1, "personal", mu=cfg.ditto_lambda, anchor=anchor)
    if not np.isfinite(out["loss"]):
        raise TaskError(f"{runner.site}: training diverged in round {round_}")
    meta.update(n_train=len(tr), train_loss=out["loss"])
    metrics["train_loss"] = out["loss"]
    return Reply(runner.site, metrics, meta, get_params(model))


def assess(runner, params: dict, cfg: TaskConfig, round_: int = 0) -> Reply:
    """``004_`` assessment of this site's cases (only aggregates unless the site allows per-image data)."""
    from fedmed.site.seg_aggregates import per_image_asked, site_assessment
    from fedmed.nn.encoders import build_encoder
    from fedmed.data.seg_federation import subject_of

    cfg = task_config(cfg)
    tr, te = runner.cases(cfg, raw=True)  # the data as read, not as a bundle's preprocessing makes it for the network
    doc = runner._datalist("segmentation")
    n_subjects = len({subject_of(e) for e in doc["training"] + doc["validation"]})
    k = runner.k_min(cfg)
    if n_subjects < k:
        raise TaskError(f"{runner.site}: {n_subjects} subject(s) < k_min={k}; the assessment would describe fewer "
                        f"than k_min patients and is not sent")
    per_image, notes = per_image_asked(runner, cfg)
    enc = build_encoder(runner.ASSESS_ENCODER, weights=runner.weights(cfg), seed=cfg.seed,
                        device=runner.device(cfg))
    rng = np.random.default_rng(task_seed(cfg, runner.site, salt=5))
    meta = site_assessment(tr, enc, per_value=per_image, per_image=per_image, privacy=cfg.privacy.model_dump(),
                           rng=rng)
    meta["notes"] = notes
    return Reply(runner.site, {"n_cases": float(len(tr))}, meta, {})


class SegSiteRunner(SiteRunner):
    _pre, _pre_key = None, None  # the cases with model.preprocessing applied, and for which settings

    def cases(self, cfg: TaskConfig, *, raw: bool = False):
        """(training cases, test cases) of this site as the network takes them: each whole case put through
        ``model.preprocessing`` (a bundle's intensity transforms) when the model has one; ``raw``: as read (what the
        ``004_`` assessment measures)."""
        tr, te = self._read_cases(cfg)
        steps = task_config(cfg).model.preprocessing
        if raw or steps is None:
            return tr, te
        key = (self._data_key, json.dumps(steps, sort_keys=True))
        if self._pre_key != key:
            from fedmed.data.nifti import SegCase
            from fedmed.nn.preprocessing import case_transform

            f = case_transform(steps)
            self._pre = tuple([SegCase(image=f(c["image"]), label=c["label"], meta=c["meta"]) for c in cases]
                              for cases in (tr, te, self._val))
            self._pre_key = key
        return self._pre[0], self._pre[1]

    def _read_cases(self, cfg: TaskConfig):
        """(training cases, test cases) of this site as read, loaded once per shape (from its cache when it can)."""
        from fedmed.data.seg_federation import check_no_leakage

        shape = tuple(task_config(cfg).data.shape)
        if self._data is None or self._data_key != shape:
            doc = self._datalist("segmentation")
            check_no_leakage(doc, where=self.site)
            tr = [self._case(e, shape, "training", i) for i, e in enumerate(doc["training"])]
            te = [self._case(e, shape, "test", i) for i, e in enumerate(doc["test"])]
            if not tr:
                raise DataError(f"{self.site}: datalist {self.display(self.datalist_path)} has no training cases",
                                f"{self.site}: its datalist has no training cases")
            va = [self._case(e, shape, "validation", i) for i, e in enumerate(doc.get("validation", []))]
            self._data, self._data_key, self._val = (tr, te), shape, va
            self._resident, self._resident_bytes = {}, 0  # the old cases' device copies go with them
        return self._data

    def validation_cases(self, cfg: TaskConfig) -> list:
        """This site's validation cases (held out of its training; none when the federation has no validation
        split), as the network takes them."""
        self.cases(cfg)
        return self._val if task_config(cfg).model.preprocessing is None else self._pre[2]

    def _case(self, entry: dict, shape, split: str = "entries", index: int = 0):
        """One case, from this site's cache when its files were loaded with the same settings before. An error names
        the case's split and position for the server (``training[3]``; the site's log has the files)."""
        try:
            return self._load_case(entry, shape)
        except DataError as e:  # the server gets the position and fedmed's own words for the kind, never an id
            text = e.public or "cannot be read (the site's log says why)"
            kind = text[len(self.site) + 2:] if text.startswith(f"{self.site}: ") else text
            raise DataError(str(e), f"{self.site}: {split}[{index}]: {kind}") from None

    def _load_case(self, entry: dict, shape):
        from fedmed.data.nifti import SegCase, load_case

        c = self.cache
        images = entry["image"] if isinstance(entry["image"], list) else [entry["image"]]
        files = [f for f in (*images, entry.get("label"), entry.get("mask")) if f]
        settings = {"kind": "case", "shape": list(shape), "folders": [Path(str(f)).parent.name for f in images],
                    "limits": vars(self.policy.limits),
                    **{k: v for k, v in entry.items() if k not in ("image", "label", "mask")}}
        key = c.key(files, settings) if c is not None else None
        hit = c.get(key) if c is not None else None
        if hit is not None:
            arrays, meta = hit
            return SegCase(image=arrays["image"], label=arrays["label"], meta=meta)
        case = load_case(entry, shape=shape, site=self.site, limits=self.policy.limits)
        if c is not None:
            c.put(key, {"image": case["image"], "label": case["label"]}, case["meta"])
            self.cache_note()
        return case

    def model(self, cfg: TaskConfig):
        from fedmed.nn.models import seg_model_from_config

        cfg = task_config(cfg)
        m = cfg.model
        key = (cfg.data.in_channels, tuple(m.channels), m.arch, repr(sorted(m.args.items())))
        if self._model is None or self._model_key != key:  # the server sends the (initialised) weights every round
            self._model = seg_model_from_config({**m.model_dump(), "init_weights": None}, cfg.data.in_channels,
                                                seed=cfg.seed, modules=self.policy.modules).to(self.device(cfg))
            self._model_key = key
            self._optimizers = {}
        return self._model

    def volumes_on_device(self, cases, cfg: TaskConfig):
        """The training ``cases`` as this site's device takes them: on the CPU the cases themselves (MONAI's crops,
        in loader processes when ``train.workers``: the path as it always was); on a GPU a
        :class:`fedmed.nn.resident.DeviceVolumes`, placed once and reused every round while it fits the site's
        device-data budget (``device_data_gb``), else the CPU's crops, said once in one line."""
        dev = self.device(cfg)
        if dev.type == "cpu" and self.CPU_KEEPS_ITS_PATH:
            return cases
        roi = tuple(task_config(cfg).data.roi)
        hit = self._resident.get(id(cases))
        if hit is not None and hit[0] is cases and hit[1] is not None and hit[1].roi == roi:
            return hit[1]
        if hit is not None and hit[0] is cases and hit[1] is None:
            return cases
        from fedmed.nn.resident import DeviceVolumes

        need = DeviceVolumes.nbytes_of(cases)
        if need > self.device_budget(dev) - self._resident_bytes:
            note = (f"{self.site}: its training volumes ({need / 2**30:.2f} GiB) do not fit its device-data budget "
                    f"({self._budget / 2**30:.2f} GiB, device_data_gb): patches are cut on the CPU")
            print(f"[fedmed] {note}", flush=True)
            self.notes.append(note)
            self._resident[id(cases)] = (cases, None)
            return cases
        vols = DeviceVolumes(cases, dev, roi)
        self._resident[id(cases)] = (cases, vols)
        self._resident_bytes += vols.nbytes
        return vols

    TASKS = {"assess": assess, "train": train, "validate": validate}
    KIND = "segmentation"
    ASSESS_ENCODER = "medicalnet_resnet18"  # 004_'s 3D embedding



def load_datalist_seg(path):
    """A segmentation datalist: entries need ``image`` (a file or list of files) and ``label``."""
    from fedmed.data.datalists import load_datalist

    return load_datalist(path, task="segmentation")
