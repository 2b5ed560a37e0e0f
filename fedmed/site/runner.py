"""A site, independent of the FL framework: its state between tasks (:class:`SiteRunner`: its settings, data, model,
optimizers, notes), the one seed rule of its random draws (:func:`task_seed`), and the one reply loop every
federation runs (:func:`answer`: the FLARE site executor and the in-process federation alike).

The tasks themselves are functions (:mod:`fedmed.site.tasks` for classification, :mod:`fedmed.site.seg`,
:mod:`fedmed.site.mae`) of (runner, params, typed task config, round); each runner class lists the ones it serves.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedmed.core.schema import TaskConfig, task_config
from fedmed.site.tasks import CLASSIFICATION, PLUGIN_TASKS, Reply, TaskError, task_seed
from fedmed.data.images import DataError, conversion_note, load_images, near_duplicates
from fedmed.data.datalists import load_datalist, patients_of
from fedmed.site.settings import SiteSettings, private_tokens, settings_for_dir

__all__ = ["SiteRunner", "Splits", "TaskError", "task_seed"]


_SAID: set = set()  # the data notes this process printed: a command's jobs and references reload a site's data


def _say_once(note: str) -> None:
    """Print a site's data note once per process (the server still hears it with each job's replies)."""
    if note not in _SAID:
        _SAID.add(note)
        print(f"[fedmed] {note}", flush=True)


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
        self.local_norm: dict = {}  # FedBN: this site's own batch-norm values per served model (the task's to set)
        self.notes: list[str] = []  # notes for this site's log and the server, sent with the next reply
        self._labels_checked = None
        self._device = self._device_spec = None
        self.private_tokens: set = set()  # the datalist's names, kept out of every text that leaves (settings.redact)
        self.epsilon_spent = 0.0  # the DP epsilon this site has released in this run (all signatures composed)
        self._policy_sent = False
        self._k_min_noted: set = set()
        self._cache_noted = False
        self._resident: dict = {}  # id(split tensor) -> (the tensor, its DeviceImages): a GPU site's data, kept
        self._resident_bytes = 0
        self._budget = None

    @property
    def policy(self):
        """This site's :class:`~fedmed.core.policy.SitePolicy` (what a job may make it do)."""
        return self.settings.policy

    @property
    def datalist_path(self) -> Path:
        return self.settings.datalist

    def display(self, path) -> str:
        return self.settings.display(path)

    def k_min(self, cfg: TaskConfig) -> int:
        """The job's minimum group size, raised to this site's floor (its policy's ``k_min``) if that is larger."""
        return self.policy.effective_k_min(task_config(cfg).privacy.k_min)

    def device(self, cfg: TaskConfig):
        """This site's torch device: its own setting, else the job's ``train.device`` (:mod:`fedmed.core.device`)."""
        from fedmed.core.device import resolve_device

        spec = self.settings.device or task_config(cfg).train.device
        if self._device_spec != spec:
            self._device, self._device_spec = resolve_device(spec, where=self.site), spec
        if task_config(cfg).train.deterministic:  # process-wide: a site runs in its own process
            import torch

            torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
        return self._device

    def weights(self, cfg: TaskConfig):
        """The encoder weights file the job names (``cfg.encoder_weights``), from this site's weights folder (its
        policy's ``weights_dir``; a path or a file of another hash is refused); ``None`` for a seeded random init."""
        ref = task_config(cfg).encoder_weights
        return None if ref is None else str(self.policy.weights_path(ref))

    def precision(self, cfg: TaskConfig) -> str:
        return task_config(cfg).train.precision

    def require_k_min(self, n: int, what: str, cfg: TaskConfig, task: str) -> None:
        """A reply computed from ``n`` samples leaves only when ``n >= k_min``; else this site sits out ``task``
        (the error, which names no count below k_min but this site's own total, is what the server records)."""
        k = self.k_min(cfg)
        if n < k:
            raise TaskError(f"{self.site}: sits out {task}: fewer {what} than k_min={k} (privacy.k_min): its reply "
                            f"would describe fewer than k_min samples")

    # ------------------------------------------------------------------ data and model
    def _datalist(self, task: str = "classification", classes=None) -> dict:
        """The site's datalist, checked (``classes``: the job's class names, which a label may be written as)."""
        from fedmed.data.images import check_input_file

        try:  # its names, even from a datalist load_datalist then refuses (the error must not show them); a datalist
            check_input_file(self.datalist_path, self.policy.limits)  # larger than the site reads is never read
            self.private_tokens |= private_tokens(json.loads(self.datalist_path.read_text()), classes)
        except (OSError, ValueError):
            pass  # load_datalist says what is wrong with it
        return load_datalist(self.datalist_path, task=task, root=self.settings.data_root,
                             name=f"{self.site}: datalist {self.display(self.datalist_path)}",
                             public=f"{self.site}: its datalist", limits=self.policy.limits, classes=classes)

    def data(self, image_size: int, channels: int, classes=None) -> Splits:
        key = (image_size, channels, tuple(classes or ()))
        if self._data is None or self._data_key != key:
            doc = self._datalist(classes=classes)
            self.policy.check_task_bytes(sum(len(doc[k]) for k in ("training", "validation", "test")),
                                         image_size * image_size * channels, f"{self.site}: its images at "
                                         f"{image_size}x{image_size}x{channels}")
            done: set = set()
            splits = Splits(*(self._load_split(doc[k], image_size, channels, done, k)
                              for k in ("training", "validation", "test")))
            note = conversion_note(self.site, done)
            if note:  # said once per site: its log and the server's (the next reply's notes)
                _say_once(note)
                self.notes.append(note)
            if splits.train[0].shape[0] == 0:
                raise DataError(f"{self.site}: datalist {self.display(self.datalist_path)} has no training images",
                                f"{self.site}: its datalist has no training images")
            near = sum(len(near_duplicates(splits.train[0], x)) for x in (splits.val[0], splits.test[0]))
            if near:  # said once, as a count (which images: `fedmed check-data`, at the site)
                note = (f"{self.site}: {near} validation/test image(s) nearly identical to training images (thumbnail "
                        f"correlation >= 0.98): scores may be inflated; `fedmed check-data` lists them at the site")
                _say_once(note)
                self.notes.append(note)
            self._data, self._data_key = splits, key
            self._val_units = patients_of(doc["validation"])
            self._resident, self._resident_bytes = {}, 0  # the old splits' device copies go with them
        return self._data

    def device_budget(self, dev) -> int:
        """Bytes of data this site keeps on ``dev``: its ``device_data_gb``, else half the device memory free when it
        first places data there (:func:`fedmed.nn.resident.default_budget`); fixed for the run."""
        if self._budget is None:
            from fedmed.nn.resident import default_budget

            gb = self.settings.device_data_gb
            self._budget = default_budget(dev) if gb is None else int(gb * 2**30)
        return self._budget

    CPU_KEEPS_ITS_PATH = True  # a CPU site trains as it always did (tests turn the device path on to compare)

    def on_device(self, x, cfg: TaskConfig):
        """``x`` as this site's device takes it: on the CPU the tensor itself (the path as it always was); on a GPU a
        :class:`fedmed.nn.resident.DeviceImages` — for the site's own splits placed once and reused by every round
        and task while their bytes fit the site's budget (``device_data_gb`` in its settings; by default half the
        device memory free at first use), else in pinned host memory, said once in one line."""
        dev = self.device(cfg)
        if dev.type == "cpu" and self.CPU_KEEPS_ITS_PATH:
            return x
        hit = self._resident.get(id(x))
        if hit is not None and hit[0] is x:
            return hit[1]
        from fedmed.nn.resident import DeviceImages

        d = DeviceImages(x, dev, budget=self.device_budget(dev) - self._resident_bytes)
        own = self._data is not None and any(x is t for t in (self._data.train[0], self._data.val[0],
                                                              self._data.test[0]))
        if not d.resident and own:
            note = (f"{self.site}: its images do not fit its device-data budget ({self._budget / 2**30:.2f} GiB, "
                    f"device_data_gb): {d.describe()}, each batch copied as it is used")
            print(f"[fedmed] {note}", flush=True)
            self.notes.append(note)
        if own:
            self._resident[id(x)] = (x, d)
            self._resident_bytes += d.nbytes if d.resident else 0
        return d

    @property
    def cache(self):
        """This site's decoded-data cache (:mod:`fedmed.site.cache`), or ``None`` when it is off."""
        if not hasattr(self, "_cache"):
            from fedmed.site.cache import SiteCache, cache_root

            root = cache_root(self.settings.cache_dir, getattr(self.settings, "workspace", None))
            self._cache = SiteCache(root, self.site) if root is not None else None
        return self._cache

    def personal_file(self, key: str) -> Path | None:
        """Where this site keeps its personal model of a run (FedBN's batch-norm layers, ``TaskConfig.personal_key``):
        ``personal/<key>.pt`` in its own cache folder (it holds what the site's data made and is never sent; ``fedmed
        cache clear`` removes it too); ``None`` when the site has no cache folder."""
        import re

        if not re.fullmatch(r"[0-9a-f]{16}", str(key)):  # the schema checks it; a file name is built from it here
            raise TaskError(f"{self.site}: a personal model's key should be 16 hex digits, got {key!r}")
        c = self.cache
        return None if c is None else c.dir / "personal" / f"{key}.pt"

    def skipped_note(self, out: dict, cfg: TaskConfig) -> None:
        """Say (this site's log and the server's) how many local steps were skipped for non-finite gradients."""
        if out.get("skipped"):
            note = (f"{self.site}: {out['skipped']} of {out['steps']} local step(s) skipped: non-finite gradients "
                    f"(train.precision={task_config(cfg).train.precision})")
            print(f"[fedmed] {note}", flush=True)
            self.notes.append(note)

    def cache_note(self) -> None:
        """Say once (this site's log and the server's) that its cache cannot be written and it runs without it."""
        c = self.cache
        if c is not None and c.unwritable and not self._cache_noted:
            self._cache_noted = True
            note = f"{self.site}: its data cache cannot be written ({c.unwritable}); it decodes without one"
            print(f"[fedmed] {note}", flush=True)
            self.notes.append(note)

    def _load_split(self, entries, image_size: int, channels: int, done: set, split: str = "entries"):
        """One split's images and labels: from this site's cache when the same files were decoded with the same
        settings before, else decoded (and cached)."""
        import torch

        c = self.cache
        key = c.key([e["image"] for e in entries], {"kind": "images", "size": image_size, "channels": channels,
                                                       "limits": vars(self.policy.limits)}) \
            if c is not None and entries else None
        hit = c.get(key) if c is not None else None
        if hit is not None:
            arrays, meta = hit
            done.update(meta.get("conversions", []))
            return torch.from_numpy(arrays["x"]), torch.tensor([int(e["label"]) for e in entries], dtype=torch.long)
        mine: set = set()
        x, y = load_images(entries, image_size=image_size, channels=channels, site=self.site, display=self.display,
                           conversions=mine, split=split, limits=self.policy.limits)
        done.update(mine)
        if c is not None:
            c.put(key, {"x": x.numpy()}, {"conversions": sorted(mine)})
            self.cache_note()
        return x, y

    def val_units(self, cfg: TaskConfig) -> list | None:
        """Each validation item's patient, in the order the validation split is scored (the datalist's ``patient``
        or ``subject``); ``None`` when an entry names none: each item is its own unit of evidence (#86)."""
        self.splits(cfg)
        return getattr(self, "_val_units", None)

    def splits(self, cfg: TaskConfig) -> Splits:
        """The site's training, validation and test splits for the task config (its labels checked against the
        job's classes once)."""
        cfg = task_config(cfg)
        s = self.data(cfg.data.image_size, cfg.data.channels, cfg.classes)
        n = cfg.data.n_classes
        if n and self._labels_checked != n:
            self.check_label_space(s, int(n), cfg.classes)
            self._labels_checked = n
        return s

    def images_at(self, cfg: TaskConfig, image_size: int, splits=("training",)):
        """The images of ``splits`` (concatenated, in datalist order) decoded at ``image_size`` — an encoder's own input
        size: a signature sees each image at the size its encoder was trained on, not upsampled from the classifier's
        training size (docs/readings.md "Encoder input size"). The classifier's splits stay as they are."""
        import torch

        cfg = task_config(cfg)
        s = self.splits(cfg)  # the datalist checked, the labels in the job's space
        if image_size == cfg.data.image_size:
            parts = {"training": s.train[0], "validation": s.val[0], "test": s.test[0]}
            return torch.cat([parts[k] for k in splits])
        doc = self._datalist(classes=cfg.classes)
        self.policy.check_task_bytes(sum(len(doc[k]) for k in splits), image_size * image_size * cfg.data.channels,
                                     f"{self.site}: its images at the encoder's {image_size}x{image_size}")
        return torch.cat([self._load_split(doc[k], image_size, cfg.data.channels, set(), k)[0] for k in splits])

    def check_label_space(self, s: Splits, n: int, names=None) -> None:
        """Every label must be a class id of the job's global label space ``0..n-1``."""
        for split, (_, y) in zip(("training", "validation", "test"), (s.train, s.val, s.test)):
            ys = y.tolist()
            bad = sorted({int(v) for v in ys if v >= n})
            if bad:
                space = f" ({', '.join(map(str, names))})" if names else ""
                first = next(i for i, v in enumerate(ys) if v >= n)
                raise DataError(f"{self.site}: datalist {self.display(self.datalist_path)} {split} has label(s) "
                                f"{bad[:5]} outside the job's global label space 0..{n - 1}{space}",
                                f"{self.site}: {split}[{first}]: a label outside the job's global label space "
                                f"0..{n - 1}{space} ({sum(v >= n for v in ys)} such entries in {split})")

    def model(self, cfg: TaskConfig):
        from fedmed.nn.models import model_from_config

        cfg = task_config(cfg)
        m = cfg.model
        key = (m.arch, cfg.data.channels, cfg.data.n_classes, m.width, m.norm, repr(sorted(m.args.items())))
        if self._model is None or self._model_key != key:
            self._model = model_from_config({**m.model_dump(), "init_weights": None}, cfg.data.channels,
                                            cfg.data.n_classes, seed=cfg.seed, modules=self.policy.modules).to(
                self.device(cfg))  # weights: the server's
            from fedmed.core.device import to_channels_last

            to_channels_last(self._model)  # on a GPU, a 2D convolutional network
            self._model_key = key
            self._optimizers = {}
        return self._model

    def optimizer(self, model, cfg: TaskConfig, key=None, *, make=None, keep=None):
        """The optimizer of the model served as ``key`` (a cluster id): made by ``make()`` — the task's choice; by
        default the recipe's (``fedmed.nn.train.make_optimizer``) — and kept between rounds when ``keep`` (default:
        ``train.keep_optimizer_state``), so momentum / Adam moments carry over. The runner only holds it."""
        from fedmed.nn.recipe import resolved
        from fedmed.nn.train import make_optimizer

        cfg = task_config(cfg)
        t = cfg.train
        if cfg.task != "classification":  # a per-part learning rate needs a classifier's head (its last Linear)
            t = t.model_copy(update={"backbone_lr_scale": 1.0})
        make = make or (lambda: make_optimizer(model, t, cfg.model))
        if not (resolved(t, cfg.model)["keep_optimizer_state"] if keep is None else keep):
            return make()
        if key not in self._optimizers:
            self._optimizers[key] = make()
        return self._optimizers[key]

    def generator(self, cfg: TaskConfig, round_: int):
        import torch

        g = torch.Generator()
        g.manual_seed(task_seed(cfg, self.site, round_) % (2**63))
        return g

    # ------------------------------------------------------------------ tasks
    def handle(self, task: str, params: dict, cfg: dict, round_: int = 0) -> Reply:
        """Run ``task``; its :class:`~fedmed.site.tasks.Reply` (the site, scalar metrics, meta aggregates, the
        parameters to send). Notes the site has not sent yet
        (e.g. what its image loading converted) go with the reply. ``cfg`` is read as a
        :class:`~fedmed.core.schema.TaskConfig` (validated, the schema's defaults for what it leaves out)."""
        cfg = task_config(cfg)
        self.check_policy(task, cfg)
        if cfg.plugins:  # a plugin method's module (its site tasks), if this site's policy lists it
            from fedmed.core.plugins import import_plugins

            import_plugins(cfg.plugins, self.policy.modules)
        reply = self.run_task(task, params, cfg, round_)
        meta = self.account(reply.meta)
        if not self._policy_sent:  # the effective policy, once per run, into the run's record
            meta = {**meta, "site_policy": self.policy.summary()}
            self._policy_sent = True
        if self.notes:
            meta = {**meta, "notes": list(meta.get("notes") or []) + self.notes}
            self.notes = []
        return reply._replace(meta=meta)

    # the tasks whose reply is a statistic of the site's data released once (a signature): the DP rules apply
    SIGNATURE_TASKS = ("signature", "descriptor", "latent_bounds", "assess")
    # the encoder this kind of site's ``assess`` task embeds its images with (the policy checks this one)
    ASSESS_ENCODER: str | None = None

    NETWORK = "model.arch"  # how a refusal names a network this kind of site builds whatever model.arch says

    def networks(self, cfg: TaskConfig) -> list[str]:
        """The networks this site's tasks build for ``cfg`` (what the policy's ``architectures`` is checked
        against): the job's ``model.arch``, unless the kind of site builds another (Fed-MAE's ViT)."""
        return [cfg.model.arch]

    def check_policy(self, task: str, cfg: TaskConfig) -> None:
        """Refuse, in one line naming the setting, what this site's policy does not allow a job to make it do; note
        (once) a job's k_min raised to the site's floor."""
        p = self.policy
        for arch in self.networks(cfg):
            p.check_arch(arch, "model.arch" if arch == cfg.model.arch else self.NETWORK)
        p.check_task_sizes(cfg.data)
        if task in self.SIGNATURE_TASKS:
            p.check_dp(cfg.privacy.dp_epsilon, cfg.privacy.dp_delta)
        if task == "signature" and cfg.signature is not None:
            p.check_encoder(cfg.signature.encoder, dp=cfg.privacy.dp_epsilon is not None)
        if task == "assess" and self.ASSESS_ENCODER is not None:
            p.check_encoder(self.ASSESS_ENCODER, dp=cfg.privacy.dp_epsilon is not None)
        job_k = cfg.privacy.k_min
        if job_k < p.k_min and job_k not in self._k_min_noted:
            self._k_min_noted.add(job_k)
            note = (f"{self.site}: the job's privacy.k_min={job_k} is below this site's floor; this site applies "
                    f"k_min={p.k_min} (its policy's k_min)")
            print(f"[fedmed] {note}", flush=True)
            self.notes.append(note)

    def account(self, meta: dict) -> dict:
        """Compose the epsilon of a DP release with what this site already released in this run (basic composition);
        refuse a release above the policy's ceiling (nothing is sent). The reply then carries the run's total."""
        dp = meta.get("dp")
        eps = dp.get("epsilon") if isinstance(dp, dict) else None
        if eps is None:
            return meta
        self.policy.check_budget(self.epsilon_spent, float(eps))
        self.epsilon_spent += float(eps)
        return {**meta, "dp": {**dp, "run_epsilon": self.epsilon_spent}}

    # the tasks this runner serves: name -> function(runner, params, cfg, round_) -> Reply (fedmed.site.tasks); a
    # segmentation or Fed-MAE runner lists only its own
    TASKS = CLASSIFICATION
    KIND = "classification"  # the plugin tasks it serves (fedmed.site.tasks.register_task)

    def run_task(self, task: str, params: dict, cfg, round_: int = 0) -> Reply:
        tasks = {**PLUGIN_TASKS[self.KIND], **self.TASKS}
        if task not in tasks:
            raise TaskError(f"{self.site}: unknown task {task!r} (this site's {type(self).__name__} serves "
                            f"{', '.join(sorted(tasks))})")
        return tasks[task](self, params, task_config(cfg), round_)
