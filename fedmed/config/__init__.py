"""Typed, validated experiment configurations (pydantic, unknown keys rejected).

An experiment file (YAML or JSON) has ``dataset``, ``federation``, ``model``, ``train``,
``privacy``, ``methods`` and ``seeds``; sweeps are small overrides
(``fedmed experiment CONFIG --set train.rounds=5``). Every validation error names the key path,
e.g. ``train.lr: Input should be greater than 0`` or ``model.depth: Extra inputs are not permitted``.

Each method is a model of its own, chosen by its ``workflow`` (a discriminated union): an option
that belongs to another workflow (``omega`` on an FMCL method) is rejected with its name and the
options the workflow does take.

A job can be built from the config alone (no site data on the coordinator): the dataset schema
(``dataset.classes`` for classification, ``dataset.modalities`` for segmentation) and the site
names (``federation.site_names``, or every connected site) are all it needs. ``fedmed experiment``
fills ``dataset.classes`` from the data it partitions.
"""

from __future__ import annotations

from fedmed.core.errors import FedmedError

import re
from pathlib import Path
from typing import Annotated, Literal, Optional

from pydantic import Field, PrivateAttr, field_validator, model_validator

from fedmed.core.schema import FederationTiming, ModelSection, PrivacyConfig, Strict, TrainConfig
from fedmed.core.validation import SITE_NAME as _SITE_NAME_RE
from fedmed.site.tasks import FinetuneLocalOptions
from fedmed.methods import (METHODS, FedAvgMethod, Method, PluginError, load_plugins, method_class,  # noqa: F401
                            method_union, on_register)
from fedmed.methods import *  # noqa: F401,F403  (the method models, importable from here as before)

__all__ = ["ConfigError", "DatasetConfig", "ExperimentConfig", "FederationConfig", "MethodConfig", "ModelConfig",
           "PrivacyConfig", "SourceConfig", "TrainConfig", "WORKFLOWS", "apply_overrides", "load_config", "method_options"]


RELEASE = "imagenet"  # init_weights / encoder_weights: the installed release, by name (fedmed.nn.encoders.release_file)


class ConfigError(FedmedError, ValueError):
    """A config file that does not validate; the message names the file and every bad key."""


_Strict = Strict


SITE_NAME = _SITE_NAME_RE.pattern  # what FLARE accepts as a client name (fedmed.core.validation)


class SourceConfig(_Strict):
    """One source of a multi-source dataset (``dataset.sources``, :mod:`fedmed.data.sources`)."""

    path: str = Field(description="a hospital-style index CSV (image, label, site, patient or case, optional mask; "
                      "other columns ignored; paths relative to the CSV), or a folder of class folders (one source)")
    site: Optional[str] = Field(None, pattern=SITE_NAME, description="the source's site name: required for a folder; "
                                "for a CSV, every row's site instead of its site column")
    image_column: str = "image"
    label_column: str = Field("label", description="class names, or integer indices into dataset.classes")
    site_column: str = "site"
    patient_column: Optional[str] = Field(None, description="the patient or case id (default: 'patient', else 'case'); "
                                          "a folder source has none: each image is its own patient")
    mask_column: Optional[str] = Field(None, description="lesion masks (2D segmentation)")
    ignore_labels: list[str] = Field(default_factory=list, description="labels left out of this source (e.g. BUSI's "
                                     "'normal' in a benign-vs-malignant study); any other label outside "
                                     "dataset.classes is an error")
    drop_sites: list[str] = Field(default_factory=list, description="sites of this index left out of the study (their "
                                  "rows are not read: a source dropped without a filtered copy of the index); each "
                                  "must be a site the index names")


class DatasetConfig(_Strict):
    path: Optional[str] = Field(None, description="dataset root (class folders, MedMNIST .npz, NIfTI subjects) or "
                                "'builtin:digits'; or leave it out and give sources")
    sources: list[SourceConfig] = Field(default_factory=list, description="several sources (hospitals, scanners) "
                                        "pooled, each image knowing its source and patient: federation.partition "
                                        "natural makes a site per source; every split is by patient")
    task: Literal["classification", "segmentation"] = "classification"
    classes: Optional[list[str]] = Field(None, min_length=2, description="class names, in label order (the schema a job "
                                         "is built from); filled from the data by `fedmed experiment`")
    image_size: int = Field(32, gt=3, le=1024)
    channels: Literal[1, 3] = 1
    max_per_class: Optional[int] = Field(None, gt=0, description="cap images per class (quick runs)")
    # segmentation (NIfTI subject folders)
    modalities: dict[str, str] = Field(default_factory=dict, description="modality name -> file glob in a subject folder")
    label_pattern: str = "OTMultiClass*.nii*"
    mask_pattern: Optional[str] = "brainmask*.nii*"
    hemispheres: bool = Field(False, description="each subject gives two samples, its left and right halves")
    shape: list[int] = Field(default_factory=lambda: [32, 48, 40], min_length=3, max_length=3)
    roi: list[int] = Field(default_factory=lambda: [32, 32, 32], min_length=3, max_length=3)

    @model_validator(mode="after")
    def _one_origin(self):
        if (self.path is None) == (not self.sources):
            raise ValueError("give dataset.path or dataset.sources (one of them)")
        if self.sources and self.task == "segmentation":  # 2D lesion segmentation: every source names its masks
            bad = [s.path for s in self.sources if not s.mask_column]
            if bad:
                raise ValueError(f"dataset.sources: a segmentation dataset reads each image's mask; source(s) {bad} "
                                 f"name no mask_column")
        return self

    def describe(self) -> str:
        """Where the data comes from, in one line."""
        return self.path if self.path is not None else " + ".join(
            s.path + (f" ({s.site})" if s.site else "") for s in self.sources)

    @field_validator("classes")
    @classmethod
    def _unique_classes(cls, v):
        if v is not None and len(set(v)) != len(v):
            raise ValueError(f"class names should be unique, got {v}")
        return v


class FederationConfig(FederationTiming):
    sites: int = Field(4, ge=1, le=10000, description="number of training sites of a generated federation")
    site_names: Optional[list[Annotated[str, Field(pattern=SITE_NAME)]]] = Field(
        None, min_length=1, description="the sites' names (default site-1..N for generated federations; a deployed "
        "job targets these sites, or every connected site when left out)")
    partition: Literal["iid", "dirichlet", "quantity", "predi", "anda", "label_volume", "natural"] = Field(
        "iid", description="how the pool becomes sites; natural: a site per source of dataset.sources (the sites "
        "count and names come from the data)")
    split_sources: dict[str, int] = Field(default_factory=dict, description="natural: a large source dealt by "
                                          "patient into this many sites (<source>-1..n)")
    holdout_sources: list[str] = Field(default_factory=list, description="natural: sources held out of training as "
                                       "unseen sites (unseen-<source>), for onboarding")
    holdout_sites: dict[str, int] = Field(default_factory=dict, description="natural: of a source split into n "
                                          "sites, hold out the last k (unseen-<source>-1..k) for onboarding; its "
                                          "other sites train, so the newcomer's own source has a cluster")
    dirichlet_scheme: Literal["hsu", "per_client"] = Field(
        "hsu", description="hsu: q_k ~ Dir(alpha p) per site (Hsu et al., FMCL); per_client: each class split over "
        "sites ~ Dir(alpha) (FedLab / NIID-Bench)")
    volume_region: Literal["WT", "TC", "ET"] = "WT"
    alpha: float = Field(0.5, gt=0)
    test_fraction: float = Field(0.2, gt=0, lt=1, description="share of each site's samples held out as its test split")
    val_fraction: float = Field(0.15, ge=0, lt=1, description="share of each site's remaining samples held out of "
                                "training as its validation split (model selection; never the test split)")
    predi_prevalence: float = Field(2.0, ge=1)
    predi_disparity: float = Field(0.0, ge=0)
    predi_samples_per_cell: Optional[int] = Field(None, ge=1, description="PreDi: labeled images per (class, site) "
                                                  "cell (001_: 50); None splits each class's images evenly")
    common_test_fraction: float = Field(0.0, ge=0, lt=1, description="> 0: hold this share of every class out as one "
                                        "common test set that every site scores (001_ §4.3) instead of per-site test "
                                        "splits")
    anda_shift: Literal["feature", "label", "p_y_given_x", "p_x_given_y", "quantity"] = "feature"
    anda_level: int = Field(3, ge=1, le=8)
    anda_groups: int = Field(2, ge=1)
    anda_colour: Literal["channel", "anda"] = Field(
        "channel", description="colour shift: 'channel' keeps the gray image in one RGB channel (others 0); 'anda' "
        "sets that channel to 1 and keeps gray in the others (ANDA's code)")
    unseen_sites: int = Field(0, ge=0, description="extra sites held out of training, for test-time assignment")
    task_request_interval: float = Field(0.2, gt=0, le=60, description="seconds an idle site waits before asking the "
                                         "server for its next task (FLARE's default is 2 s)")

    @field_validator("site_names")
    @classmethod
    def _unique_names(cls, v):
        if v is not None:
            dup = sorted({s for s in v if v.count(s) > 1})
            if dup:
                raise ValueError(f"site names should be unique, got duplicates {dup}")
            if "server" in v:
                raise ValueError("'server' is reserved by NVFlare and cannot name a site")
        return v


def _in_file_units(step: dict) -> bool:
    """A preprocessing step whose arguments are intensities of the image file (not invariant to its scaling)."""
    a = step.get("args") or {}
    if step["name"] in ("ScaleIntensityRange", "ThresholdIntensity"):
        return True
    if step["name"] == "NormalizeIntensity":
        return a.get("subtrahend") is not None or a.get("divisor") is not None
    return step["name"] == "ScaleIntensity" and a.get("factor") is not None


class ModelConfig(ModelSection):
    """``model``: :class:`~fedmed.core.schema.ModelSection` with the checks a coordinator can make (a known network, an
    init-weights file that exists), and ``bundle``: a MONAI bundle folder whose network and weights the sites train
    (:func:`fedmed.nn.bundle_read.read_bundle`: its ``network_def`` becomes ``arch`` and ``args``, its ``models/model.pt``
    ``init_weights``; its inputs, outputs and loss are checked against the federation when the config is read)."""

    bundle: Optional[str] = Field(None, description="a MONAI bundle folder on the coordinator: its network_def (a "
                                  "network of monai.networks.nets) and models/model.pt are the sites' model")
    _bundle: Optional[dict] = PrivateAttr(None)

    @model_validator(mode="before")
    @classmethod
    def _release_by_name(cls, data):
        """``init_weights: imagenet``: the ImageNet release of ``arch`` as an installed package ships it (no shell
        variable, no path: ``fedmed.nn.encoders.released_weights``)."""
        if isinstance(data, dict) and isinstance(data.get("init_weights"), str) \
                and data["init_weights"].strip().lower() == RELEASE:
            from fedmed.nn.releases import release_file

            data = {**data, "init_weights": release_file(str(data.get("arch", "resnet9")), "model.init_weights")}
        return data

    @model_validator(mode="before")
    @classmethod
    def _from_bundle(cls, data):
        if not isinstance(data, dict) or not data.get("bundle"):
            return data
        from fedmed.nn.bundle import BundleExportError
        from fedmed.nn.bundle_read import read_bundle

        try:
            b = read_bundle(data["bundle"])
        except BundleExportError as e:
            raise ValueError(str(e)) from None
        # a dump of a config read before (arch, args, init_weights already the bundle's) validates again as it was
        clash = sorted(k for k in ("arch", "args", "init_weights", "preprocessing")
                       if data.get(k) is not None and data.get(k) != b[k])
        if clash:
            raise ValueError(f"model.bundle: the bundle names the network, its weights and its preprocessing; drop "
                             f"{', '.join('model.' + k for k in clash)} from the config (on the command line: "
                             f"{' '.join(f'--set model.{k}=null' for k in clash)})")
        return {**data, "arch": b["arch"], "args": b["args"], "init_weights": b["init_weights"],
                "preprocessing": b["preprocessing"]}

    def model_post_init(self, context):
        super().model_post_init(context)
        if self.bundle:
            from fedmed.nn.bundle_read import read_bundle

            self._bundle = read_bundle(self.bundle)

    @field_validator("arch")
    @classmethod
    def _known_arch(cls, v):
        if v in ("resnet9", "resnet18", "vit_small", "unet", "efficientnet_lite0", "efficientnet_lite1",
                 "efficientnet_lite2"):
            return v
        from fedmed.nn.models import ArchError, resolve_arch

        try:
            resolve_arch(v, modules=("*",))  # the coordinator's own config and modules
        except ArchError as e:
            raise ValueError(str(e)) from None
        return v

    @field_validator("init_weights")
    @classmethod
    def _init_file(cls, v):
        if v is not None and not v.strip():
            raise ValueError("model.init_weights is empty (an unset shell variable?): name a weights file, or leave "
                             "the key out to start from a seeded initialisation")
        if v is not None and not Path(v).is_file():
            raise ValueError(f"model.init_weights: file {v} not found")
        return v


# --------------------------------------------------------------------------------------------- methods
# every method's options are its own model's (fedmed.methods, defined once); a plugin's register there too

def _methods_annotation():
    return list[method_union()]


def method_options(workflow: str) -> list[str]:
    """The options a workflow's method takes (besides ``name`` and ``workflow``)."""
    return sorted(k for k in method_class(workflow).model_fields if k not in ("name", "workflow"))


WORKFLOWS = METHODS  # workflow -> method class, as registered now (a plugin's too)
MethodConfig = Method


class SweepCase(_Strict):
    """One cell of a committed sweep: overrides applied to the config, and optionally a subset of methods."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.+-]+$", description="output folder of this case")
    set: list[str] = Field(default_factory=list, description="overrides key.path=value, as with --set")
    methods: Optional[list[str]] = Field(None, min_length=1, description="method names; None = all of the config's")


REFERENCES = ("centralized", "iid_fedavg", "majority", "cluster_majority")


class TrackingConfig(_Strict):
    """Where a run's metrics go besides ``metrics.json``: FLARE's own receivers at the server
    (``nvflare.app_opt.tracking``), each site's per-round metrics as its own run and the server's (site mean and pooled
    metrics, the run's settings as parameters, its result as an artifact) as another. Nothing here changes a result."""

    tensorboard: bool = Field(True, description="TensorBoard event files in the run's server folder (tb/<site>/)")
    mlflow: bool = Field(False, description="MLflow (pip install 'fedmed[mlflow]')")
    mlflow_uri: Optional[str] = Field(None, description="MLflow tracking URI: a server (http(s)://...), a database "
                                      "(sqlite:///...) or a file: store; None: a file: store, mlruns/ in the run's "
                                      "server folder")
    wandb: bool = Field(False, description="Weights & Biases (pip install 'fedmed[wandb]')")
    wandb_mode: Literal["offline", "online"] = Field("offline", description="online sends to W&B's servers")
    wandb_dir: Optional[str] = Field(None, description="where wandb writes (offline runs: offline-run-*/; sync them "
                                     "later with `wandb sync`); None: wandb/ in the run's server folder (fedmed "
                                     "experiment: <out>/wandb)")
    experiment: Optional[str] = Field(None, min_length=1, description="MLflow experiment / W&B project (default: the "
                                      "config's name)")


class ServingConfig(_Strict):
    """The serving plan of ``fedmed experiment`` (issue #57; ``fedmed.workflows.plan``): after a seed's methods, each
    training site is served the reference's global model unless a candidate beats it on the site's validation split
    beyond the noise (docs/readings.md "Serving plan")."""

    reference: str = Field(description="the method whose global model is the reference (one that saves "
                           "models/global.pt: FedAvg, FedProx, ...)")
    candidates: list[str] = Field(default_factory=list, description="methods whose models a site may be served "
                                  "instead (its cluster's model in a clustered method); 'local': each site's own "
                                  "model, trained on its data alone from the run's starting model (train.rounds "
                                  "blocks, train.stop), which never leaves it")
    finetune: Optional[FinetuneLocalOptions] = Field(None, description="also the global model fine-tuned at each "
                                                     "site (epochs, lr_scale); it never leaves the site")
    pool: bool = Field(True, description="the sites a cluster model serves pool their validation evidence for it")
    test: Literal["score", "sign"] = Field("score", description="the paired test against the global model: 'score' "
                                           "(a t-test on the per-image Brier-score differences a classifier's sites "
                                           "send; a 2D lesion segmenter's are judged by the sign test) or 'sign' "
                                           "(the exact sign test on the images where the two models' answers differ)")


class ExperimentConfig(_Strict):
    name: str = Field(min_length=1)
    dataset: DatasetConfig
    federation: FederationConfig = FederationConfig()
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    privacy: PrivacyConfig = PrivacyConfig()
    plugins: list[str] = Field(default_factory=list, description="modules adding methods of your own (fedmed.methods): "
                               "a .py file (relative to this config's folder) or an importable module")
    methods: _methods_annotation() = Field(default_factory=lambda: [FedAvgMethod(name="FedAvg")], min_length=1)
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1)
    selection: Literal["final", "validation", "validation_auc"] = Field(
        "final", description="which round the tables report: the final one, the one with the best validation "
        "accuracy (Dice for segmentation), or (classifiers) the one with the best AUC on the sites' validation "
        "images pooled (validation splits are held out of the sites' training data; test data never selects)")
    references: list[Literal["centralized", "iid_fedavg", "majority", "cluster_majority", "alone"]] = Field(
        default_factory=lambda: list(REFERENCES), description="reference rows of classification tables ('alone': each "
        "source of a natural federation trains alone, else each site; not in the default set)")
    sweep: list[SweepCase] = Field(default_factory=list, description="cases run by `fedmed sweep CONFIG`")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig, description="experiment tracking (TensorBoard, "
                                     "MLflow, W&B) through FLARE's receivers")
    serving: Optional[ServingConfig] = Field(None, description="after each seed's methods, the serving plan: which "
                                             "model each site is served (fedmed.workflows.plan)")

    @model_validator(mode="before")
    @classmethod
    def _default_workflow(cls, data):
        if isinstance(data, dict) and isinstance(data.get("methods"), list):
            data = dict(data)
            data["methods"] = [({"workflow": "fedavg", **m} if isinstance(m, dict) and "workflow" not in m else m)
                               for m in data["methods"]]
        return data

    def _check_bundle(self):
        """A bundle's inputs, outputs and loss against this federation (one line, before any round); its segmentation
        loss becomes train.seg.loss unless the config sets that loss itself (other train.seg settings keep it)."""
        from fedmed.nn.bundle_read import _SEG_LOSSES, check_bundle_fits

        d, b = self.dataset, self.model._bundle
        where = f"model.bundle {Path(self.model.bundle).name}"
        if d.task == "classification":
            spec = dict(task="classification", channels=d.channels, size=[d.image_size] * 2,
                        n_out=len(d.classes) if d.classes else None)
        elif d.sources:  # 2D lesion segmentation: one output
            spec = dict(task="segmentation", channels=d.channels, size=[d.image_size] * 2, n_out=1)
        else:  # 3D: one channel per modality, the three BraTS regions
            spec = dict(task="segmentation", channels=len(d.modalities) or 1, size=list(d.roi), n_out=3)
        problem = check_bundle_fits(b, where=where, **spec)
        if problem:
            raise ValueError(problem)
        for step in (b.get("preprocessing") or []) if len(spec["size"]) == 2 else []:
            if _in_file_units(step):  # a 2D image reaches the sites' transforms as fedmed reads it: [0, 1]
                raise ValueError(f"{where}: its preprocessing {step['name']} {step['args']} is in the image file's "
                                 f"intensity units, and fedmed's sites read 2D images to [0, 1] (8-bit / 255, wider "
                                 f"images by their own range): it would not do what it does in the bundle (a "
                                 f"ScaleIntensity or a NormalizeIntensity without fixed values fits)")
        if d.task == "segmentation" and b.get("loss") in _SEG_LOSSES and "loss" not in self.train.seg.model_fields_set:
            self.train.seg.loss = _SEG_LOSSES[b["loss"]]

    @model_validator(mode="after")
    def _consistent(self):
        self._check_names()
        self._check_sources()
        self._check_training()
        seg = self.dataset.task == "segmentation"
        from fedmed.methods import check_vit_input

        for m in self.methods:  # each method's own checks (fedmed.methods.Method.check_experiment)
            m.check_experiment(self)
            if self.model.arch == "vit_small" and not seg:
                check_vit_input(m, self)
        return self

    def _check_names(self) -> None:
        """Method and sweep-case names unique and known where they are named (the serving plan, the sweep)."""
        names = [m.name for m in self.methods]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"method names should be unique, got duplicates {dup}")
        cases = [c.name for c in self.sweep]
        dup = sorted({n for n in cases if cases.count(n) > 1})
        if dup:
            raise ValueError(f"sweep case names should be unique, got duplicates {dup}")
        for m in self.methods:
            if "fedavg_warmup" in type(m).model_fields and m.fedavg_warmup >= self.train.rounds:
                raise ValueError(f"method {m.name!r}: fedavg_warmup={m.fedavg_warmup} should be below train.rounds="
                                 f"{self.train.rounds} (the cluster models train the rounds after it)")
        if self.serving is not None:
            sv = self.serving
            unknown = sorted({sv.reference, *sv.candidates} - set(names) - {"local"})
            if unknown:
                raise ValueError(f"serving names unknown method(s) {unknown}; the config has {names}")
            if sv.reference in sv.candidates or len(set(sv.candidates)) != len(sv.candidates):
                raise ValueError(f"serving.candidates should be distinct methods other than the reference "
                                 f"{sv.reference!r}, got {sv.candidates}")
            if not sv.candidates and sv.finetune is None:
                raise ValueError("serving: name a candidate method or set finetune")
            gone = [m.name for m in self.methods if m.name in sv.candidates and type(m).personal == "not_kept"]
            if gone:
                raise ValueError(f"serving.candidates: {gone} serve a model made at each site that is gone after the "
                                 f"run (Ditto's personal model, a local fine-tuning); serving.finetune fine-tunes the "
                                 f"global model at each site as a candidate")
            seg2d = self.dataset.task == "segmentation" and bool(self.dataset.sources)  # 2D lesion masks
            if self.dataset.task != "classification" and not seg2d:
                raise ValueError("serving: the plan scores classifiers and 2D lesion segmenters (this config's task: "
                                 f"{self.dataset.task}, 3D)")
        for c in self.sweep:
            unknown = sorted(set(c.methods or []) - set(names))
            if unknown:
                raise ValueError(f"sweep case {c.name!r} names unknown method(s) {unknown}; the config has {names}")

    def _check_sources(self) -> None:
        """A natural federation's options only with sources; the IID reference without part of a source; a bundle."""
        fed = self.federation
        if fed.partition == "natural" and not self.dataset.sources:
            raise ValueError("federation.partition natural makes a site per source: it needs dataset.sources")
        if fed.partition != "natural" and (fed.split_sources or fed.holdout_sources or fed.holdout_sites):
            raise ValueError("federation.split_sources / holdout_sources / holdout_sites are for federation.partition "
                             "natural")
        if fed.holdout_sites and "iid_fedavg" in self.references:
            if "references" in self.model_fields_set:  # asked for: say why it cannot be
                raise ValueError("federation.holdout_sites: the IID reference cannot leave out part of a source's "
                                 "patients; drop iid_fedavg from references")
            self.references = [r for r in self.references if r != "iid_fedavg"]  # the default set, without it
        if self.model.bundle:
            self._check_bundle()

    def _check_training(self) -> None:
        """Training options that fit the task, the privacy and the federation."""
        fed = self.federation
        if self.train.lr_schedule != "constant" and self.dataset.task == "segmentation":
            raise ValueError(f"train.lr_schedule: {self.train.lr_schedule!r} schedules classifiers' training; "
                             "segmentation trains at a constant train.lr (set train.lr_schedule: constant)")
        if self.train.norm_recalibrate and self.dataset.task != "classification":
            raise ValueError("train.norm_recalibrate re-estimates a classifier's batch-norm statistics; it is for "
                             "dataset.task classification")
        if self.train.norm_recalibrate and self.privacy.dp_epsilon:
            raise ValueError("train.norm_recalibrate: the sites' batch-norm statistics are not sent under differential "
                             "privacy (privacy.dp_epsilon); drop one of the two")
        if self.selection == "validation_auc" and self.dataset.task == "segmentation":
            raise ValueError("selection: 'validation_auc' selects a classifier's round on its validation AUC; "
                             "segmentation selects on validation Dice (selection: validation)")
        if "alone" in self.references and self.dataset.task == "segmentation":
            raise ValueError("references: 'alone' is a classification reference; segmentation's 'centralized' "
                             "reference already trains each site (3D) or each source (2D) alone")
        if self.dataset.sources and fed.common_test_fraction > 0:
            raise ValueError("federation.common_test_fraction is not available for dataset.sources (a common test set "
                             "would have to be drawn by patient across sources)")
        if fed.partition == "natural" and fed.unseen_sites:
            raise ValueError("federation.unseen_sites: a natural federation holds out whole sources "
                             "(federation.holdout_sources)")
        if any(n < 1 for n in fed.split_sources.values()):
            raise ValueError(f"federation.split_sources: site counts should be at least 1, got {fed.split_sources}")
        # natural: the sites' names and count come from the data (fedmed experiment fills them in)
        if fed.site_names is not None and fed.partition != "label_volume" and len(fed.site_names) != fed.sites:
            raise ValueError(f"federation.site_names has {len(fed.site_names)} names but federation.sites is "
                             f"{fed.sites}")
        if fed.min_clients > fed.sites and not (fed.partition == "natural" and fed.site_names is None):
            raise ValueError(f"federation.min_clients ({fed.min_clients}) should not exceed federation.sites "
                             f"({fed.sites})")

    _base_dir: Optional[Path] = PrivateAttr(None)
    _path_origins: dict = PrivateAttr(default_factory=dict)

    def check_data_paths(self) -> None:
        """:class:`ConfigError` for a dataset path that does not exist, naming it as written, the folder it was
        resolved against (the config file's, or the working folder for a path from ``--set``) and how to point the
        config at the data."""
        d = self.dataset
        given = [("dataset.path", d.path)] if d.path is not None else [
            (f"dataset.sources.{i}.path", s.path) for i, s in enumerate(d.sources)]
        for name, p in given:
            if p.startswith("builtin:") or Path(p).expanduser().exists():
                continue
            written, folder = self._path_origins.get(p, (p, Path.cwd()))
            what = "the config file's folder" if p in self._path_origins else "the working folder"
            raise ConfigError(f"{name} {written!r} does not exist: a path in a config file is relative to the file's "
                              f"folder, one given with --set to the working folder; it was resolved against {what} "
                              f"{folder} (-> {Path(folder, written).resolve()}); point it at the data with "
                              f"--set {name}=DIR or edit the config")

    @property
    def base_dir(self) -> Path:
        """The folder the config was read from (its plugins' files are relative to it); the working folder for a
        config given as a dict."""
        return self._base_dir or Path.cwd()

    def site_names(self) -> list[str]:
        """The training sites' names: ``federation.site_names`` or ``site-1..N``."""
        fed = self.federation
        return list(fed.site_names) if fed.site_names else [f"site-{k + 1}" for k in range(fed.sites)]


def _rebuild_methods() -> None:
    """A method registered after import (a plugin): ``methods:`` takes it from now on."""
    from pydantic.fields import FieldInfo

    old = ExperimentConfig.model_fields["methods"]
    new = FieldInfo.from_annotated_attribute(_methods_annotation(), old)
    ExperimentConfig.model_fields["methods"] = new
    ExperimentConfig.model_rebuild(force=True)


on_register(_rebuild_methods)


# --------------------------------------------------------------------------------------------- loading


_PATH_KEY = re.compile(r"^(dataset\.path|dataset\.sources\.[^.=]+\.path|model\.bundle|model\.init_weights|"
                       r"methods\.[^=]+\.encoder_weights)$")


MAX_CONFIG_VALUES = 100_000  # a config expands to far fewer values (the largest shipped one: a few hundred)


# reading a config file (fedmed.config.loading), importable from here as the package's entry point
from fedmed.config.loading import apply_overrides, load_config, load_raw, shipped_or_given  # noqa: E402,F401
