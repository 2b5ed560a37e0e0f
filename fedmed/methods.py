"""fedmed's methods, each in one place: a method is a config model (its options, defined once, with their defaults)
that says which server workflow runs it, which site tasks it uses, and what it hands to each (:class:`Method`).

* :meth:`Method.workflow_options` — the options its server workflow (``fedmed.workflows``) is constructed with;
* :meth:`Method.task_options` — what it adds to the task config every site receives (``fedmed.core.schema``; a
  section there holds no default of its own for a method option: the value always comes from here);
* class attributes: ``server`` (the workflow class, or ``"module:Class"`` under ``fedmed.workflows``), ``serves``
  (classification and/or segmentation), ``site_tasks``, ``clustered`` (ends with one model per cluster), ``onboards``
  (a new site is given a model after training; the workflow class says how: ``assign_new_sites``).

**A method of your own** (a plugin): subclass :class:`Method` in a module of your own with a ``workflow`` literal and
a server workflow (a :class:`fedmed.workflows.Workflow` subclass), register it with :func:`register_method`, and
name the module in the experiment config (``plugins: [my_method.py]``, a file relative to the config, or an
importable module). The module is imported when the config is read (where the job is built), by the server and by
every site (the job carries its source, as it carries a user's network class: ``custom/fedmed_user_code/``, and a
site imports it only when its policy lists it, ``fedmed_policy.json`` ``modules``). Site tasks of its own it registers
with :func:`fedmed.site.tasks.register_task`. ``docs/architecture.md`` has a complete example.
"""

from __future__ import annotations

from fedmed.core.errors import FedmedError

from pathlib import Path
from typing import Annotated, ClassVar, Literal, Optional, Union

from pydantic import Field, field_validator

from fedmed.core.plugins import PluginError, add_code_folder, import_plugins, module_allowed
from fedmed.core.schema import Strict
from fedmed.site.tasks import FinetuneLocalOptions

__all__ = ["CFLMethod", "DittoMethod", "FECFLMethod", "FMCLMethod", "FedAvgMethod", "FedAvgWMethod", "FedBNMethod",
           "FedMAEMethod", "FinetuneLocalMethod",
           "FedProxMethod", "FinetuneMethod", "FluxMethod", "IFCAMethod", "METHODS", "Method", "MethodError",
           "PACFLMethod", "PluginError", "SegAssessMethod", "SegClustersMethod", "SignatureMethod", "clustering_workflows",
           "load_plugins",
           "method_class", "method_union", "on_register", "register_method", "server_workflow_path", "workflows_for"]

CLASSIFY_TASKS = ("train", "validate")


class MethodError(FedmedError, ValueError):
    """A method that cannot be registered or found; one line naming it."""


class Method(Strict):
    """A method of an experiment config (``methods:``): its name, its ``workflow`` and its options.

    Subclasses set ``workflow: Literal["..."]`` and the class attributes below, and override the two hooks when the
    method hands options on."""

    name: str = Field(min_length=1)

    server: ClassVar = "fedavg:FedAvg"  # the server workflow: a Workflow subclass or "module:Class" (fedmed.workflows)
    serves: ClassVar[tuple] = ("classification",)  # the dataset tasks it runs on
    site_tasks: ClassVar[tuple] = CLASSIFY_TASKS  # the site tasks it sends
    clustered: ClassVar[bool] = False  # ends with one model per cluster
    onboards: ClassVar[bool] = False  # a new site is given a model after training (the workflow's assign_new_sites)
    plugin: ClassVar[Optional[str]] = None  # the module a plugin method comes from (set by register_method)
    ssl_role: ClassVar[Optional[str]] = None  # its part in `fedmed ssl` (001_): "pretrain", "finetune", "clusters"
    site_options_model: ClassVar[Optional[type]] = None  # a pydantic model of what its own site tasks read
    # what a site serves besides the server's models: None (the server's), "kept" (FedBN: the site keeps its own
    # batch-norm layers after the run, so a serving plan can score its personal model there), "not_kept" (a model
    # made at the site and gone with the run: Ditto's personal model, a local fine-tuning)
    personal: ClassVar[Optional[str]] = None

    def site_options(self, exp, seed: int) -> dict:
        """The values of :attr:`site_options_model` for a run: they travel in the task config's ``method_options``,
        validated by that model where the job is built and again at the site (:meth:`options_at_site`)."""
        return {}

    @classmethod
    def options_at_site(cls, cfg):
        """The method's site options as a site task reads them: ``cfg.method_options`` validated by the method's own
        model (its defaults for what the job leaves out)."""
        if cls.site_options_model is None:
            raise MethodError(f"method {getattr(cls, '__name__', cls)}: no site_options_model")
        from fedmed.core.schema import task_config

        return cls.site_options_model.model_validate(dict(task_config(cfg).method_options))

    def workflow_options(self, exp, seed: int) -> dict:
        """The keyword options of its server workflow for a run of ``exp`` with ``seed``."""
        return {}

    def task_options(self, exp, seed: int) -> dict:
        """What it adds to the task config every site receives (sections of :class:`fedmed.core.schema.TaskConfig`)."""
        return {}

    @property
    def weights_file(self) -> Optional[str]:
        """A local weights file the method names (its encoder's), or None."""
        return None

    @property
    def site_weights(self) -> Optional[str]:
        """The weights file every site holds in its weights folder and the task config names (its encoder's); None
        when the method names none, or when its file is the server's own (:meth:`server_files`)."""
        return self.weights_file

    def server_files(self) -> list[tuple[str, str, str]]:
        """``(local file, folder of the job's server files, file name there)`` of each file the server starts from
        (e.g. a fine-tuning run's pre-trained encoder); copied into the job when it is built."""
        return []

    def check_experiment(self, exp) -> None:
        """Raise ``ValueError`` (one line naming the method) when ``exp`` cannot run this method; called when the
        config is validated. The base checks the dataset task against :attr:`serves`."""
        seg = exp.dataset.task == "segmentation"
        if "classification" not in self.serves and not seg:
            raise ValueError(f"method {self.name!r}: workflow {self.workflow!r} needs dataset.task: segmentation")
        if seg and "segmentation" not in self.serves:
            raise ValueError(f"method {self.name!r}: workflow {self.workflow!r} is for classification, not "
                             f"segmentation")

    def check_files(self, exp) -> None:
        """Raise ``ValueError`` when a file the method names is missing or does not fit (before any run)."""
        w = self.weights_file
        if w and not Path(w).is_file():
            raise ValueError(f"method {self.name!r}: weights file {w} not found")

    @classmethod
    def training_assignment(cls, doc: dict) -> dict:
        """site -> cluster after a finished training run, from its record (``metrics.json``), for a run that kept no
        ``onboarding.json``: one cluster by default."""
        return {s: 0 for s in doc["rounds"][-1]["sites"]} if doc.get("rounds") else {}


def check_encoder(name: str, weights: Optional[str], *, in_channels: int = 1, image_size: Optional[int] = None) -> None:
    """An unknown encoder, a missing or mismatched weights file: ``ValueError`` before anything is sent."""
    from fedmed.nn.encoders import ENCODERS, build_encoder

    if name not in ENCODERS:
        build_encoder(name)  # EncoderError (a ValueError) naming it
    if weights:
        if not Path(weights).is_file():
            raise ValueError(f"encoder {name}: weights file {weights} not found")
        build_encoder(name, weights=weights, in_channels=in_channels, image_size=image_size)


def check_vit_input(method, exp) -> None:
    """The ViT of Fed-MAE and fine-tuning (``model.arch: vit_small`` too) takes 32 x 32 images."""
    if exp.dataset.task != "segmentation" and exp.dataset.image_size != 32:
        raise ValueError(f"method {method.name!r}: the Fed-MAE / fine-tuning ViT (fedmed.nn.mae.VIT_SMALL, patch 4) "
                         f"takes 32 x 32 images; set dataset.image_size: 32 (got {exp.dataset.image_size})")


# --------------------------------------------------------------------------------------------- built-in methods

class _Encoder(Strict):
    encoder: str = Field("random_cnn", description="see fedmed.nn.encoders.ENCODERS")
    encoder_weights: Optional[str] = Field(None, description="local weights file, or imagenet (the encoder's installed "
                                           "ImageNet release); None = seeded random init")
    encoder_image_size: Optional[int] = Field(None, gt=7)

    @field_validator("encoder_weights")
    @classmethod
    def _release_by_name(cls, v, info):
        if isinstance(v, str) and v.strip().lower() == "imagenet":
            from fedmed.nn.encoders import release_file

            return release_file(str(info.data.get("encoder", "")), "encoder_weights")
        return v


class _Clusters(Strict):
    n_clusters: Optional[int] = Field(None, ge=1, description="fixed K; None = auto-K")
    threshold: Optional[float] = Field(None, ge=0, description="agglomerative merge threshold instead of K")
    linkage: Literal["average", "weighted", "complete", "single"] = "average"
    k1_silhouette: Optional[float] = Field(0.5, ge=-1, le=1, description="auto-K keeps one cluster unless the chosen "
                                           "K's silhouette reaches this (Kaufman & Rousseeuw: 0.26-0.50 weak, could be "
                                           "artificial; docs/readings.md); None: no K = 1 test")
    k1_rule: Literal["differ", "silhouette"] = Field(
        "differ", description="how auto-K decides K = 1: 'differ' — the calibrated split-half test ('do the sites "
        "differ?', fedmed.algorithms.differ) answers it: sites that differ get FMCL's silhouette pick with no K = 1 "
        "gate, sites that do not get one cluster (the silhouette gate where the test cannot run); 'silhouette' — "
        "k1_silhouette alone (docs/readings.md 'Auto-K')")
    min_cluster_images: int = Field(0, ge=0, description="a cluster whose sites hold fewer training images than this "
                                    "is merged into its nearest cluster (average distance) before training, so that "
                                    "every cluster model has data to learn from (#57); 0: off")
    fedavg_warmup: int = Field(0, ge=0, description="rounds of FedAvg on the whole federation before the cluster "
                               "models start from its model (the idea of Flux's start rule; docs/readings.md); the "
                               "run keeps train.rounds in all. 0 = cluster models from scratch (FMCL's Alg. 5)")


class FedAvgMethod(Method):
    workflow: Literal["fedavg"] = "fedavg"
    serves: ClassVar[tuple] = ("classification", "segmentation")
    onboards: ClassVar[bool] = True


class FedProxMethod(Method):
    workflow: Literal["fedprox"]
    fedprox_mu: float = Field(0.01, ge=0, description="proximal weight mu (Li et al. 2020)")
    serves: ClassVar[tuple] = ("classification", "segmentation")
    onboards: ClassVar[bool] = True

    def task_options(self, exp, seed):
        return {"train": {"fedprox_mu": self.fedprox_mu}}


class FinetuneLocalMethod(Method):
    """Local fine-tuning (#57): FedAvg, then every site trains the final global model ``ft_epochs`` more on its own
    training split at ``ft_lr_scale`` x ``train.lr`` and is served that model (which never leaves the site)."""

    workflow: Literal["finetune_local"]
    ft_epochs: int = Field(2, ge=1, description="local epochs of the final fine-tuning at each site")
    ft_lr_scale: float = Field(0.1, gt=0, le=1, description="its learning rate as a share of train.lr")
    server: ClassVar = "finetune_local:FinetuneLocal"
    personal: ClassVar[Optional[str]] = "not_kept"
    site_tasks: ClassVar[tuple] = ("train", "validate", "finetune_local")

    site_options_model: ClassVar = FinetuneLocalOptions  # what its site task reads (fedmed.site.tasks)

    def site_options(self, exp, seed):
        return {"epochs": self.ft_epochs, "lr_scale": self.ft_lr_scale}


class FedBNMethod(Method):
    """FedBN (Li et al., ICLR 2021): FedAvg in which every site keeps its own batch-norm layers — the standard answer
    to scanner and feature shift. The server averages the whole model (its batch-norm values are only a new site's
    starting point); each site trains and is scored with the shared weights and its own batch norm."""

    workflow: Literal["fedbn"]
    onboards: ClassVar[bool] = True
    personal: ClassVar[Optional[str]] = "kept"

    def task_options(self, exp, seed):
        return {"train": {"local_norm": True}}

    def check_experiment(self, exp):
        super().check_experiment(exp)
        if exp.model.arch in ("resnet9", "resnet18") and exp.model.norm != "batch":
            raise ValueError(f"method {self.name!r}: FedBN keeps each site's batch-norm layers; model.norm is "
                             f"{exp.model.norm!r} (set model.norm: batch)")


class SignatureMethod(Method, _Encoder, _Clusters):
    """FMCL, PACFL and FECFL: one signature per site, clustered once (``fedmed.workflows.clustered``)."""

    server: ClassVar = "clustered:OneShotClustered"
    site_tasks: ClassVar[tuple] = ("signature", "train", "validate")
    clustered: ClassVar[bool] = True
    onboards: ClassVar[bool] = True
    ssl_role: ClassVar[Optional[str]] = "clusters"  # fedmed ssl: clusters from the Fed-MAE encoder (001_ + FMCL)

    @property
    def weights_file(self):
        return self.encoder_weights

    def check_files(self, exp):
        check_encoder(self.encoder, self.weights_file, in_channels=exp.dataset.channels,
                      image_size=self.encoder_image_size)

    def signature_options(self) -> dict:
        """The kind's own signature options (PACFL: its subspaces)."""
        return {}

    def clustering_options(self) -> dict:
        """The kind's own distance options (FMCL: the overlap-aware multiplier)."""
        return {}

    def workflow_options(self, exp, seed):
        return {"signature": {"kind": self.workflow, "encoder": self.encoder, "image_size": self.encoder_image_size,
                              "seed": seed, **self.signature_options()},
                "clustering": {"n_clusters": self.n_clusters, "threshold": self.threshold, "linkage": self.linkage,
                               "k1_silhouette": self.k1_silhouette, "k1_rule": self.k1_rule,
                               "min_cluster_images": self.min_cluster_images,
                               **self.clustering_options()},
                "fedavg_warmup": self.fedavg_warmup}


class FMCLMethod(SignatureMethod):
    workflow: Literal["fmcl"]
    overlap: bool = Field(True, description="overlap-aware multiplier m_ij (False: the paper's 'no overlap' ablation)")

    def clustering_options(self):
        return {"overlap": self.overlap}


class PACFLMethod(SignatureMethod):
    workflow: Literal["pacfl"]
    encoder: str = "pixels"
    n_basis: int = Field(3, ge=1, description="singular vectors per class")
    angle: Literal["principal", "official"] = Field(
        "principal", description="principal: smallest principal angle between the class subspaces; official: PACFL "
        "code's arccos of single entries of U_i^T U_j (sign dependent)")

    def signature_options(self):
        return {"n_basis": self.n_basis, "angle": self.angle}


class FECFLMethod(SignatureMethod):
    workflow: Literal["fecfl"]


class CFLMethod(Method):
    workflow: Literal["cfl"]
    cfl_eps1: float = Field(0.4, gt=0)
    cfl_eps2: float = Field(1.6, gt=0)
    warmup_rounds: int = Field(2, ge=0)
    server: ClassVar = "cfl:CFL"
    clustered: ClassVar[bool] = True
    onboards: ClassVar[bool] = True

    def workflow_options(self, exp, seed):
        return {"eps1": self.cfl_eps1, "eps2": self.cfl_eps2, "warmup_rounds": self.warmup_rounds}


class FluxMethod(Method):
    workflow: Literal["flux"]
    n_clusters: Optional[int] = Field(None, ge=1, description="Flux-prior: K-means with this K; None = adaptive DBSCAN")
    participation: float = Field(1.0, gt=0, le=1, description="fraction of sites sampled per round")
    dbscan_scale: float = Field(1.0, gt=0, description="eps scale factor (the paper's per-dataset factor)")
    k1_silhouette: Optional[float] = Field(0.25, ge=-1, le=1, description="keep a DBSCAN split only when its "
                                           "silhouette reaches this (None: the paper's literal DBSCAN)")
    box: Literal["elementwise", "scalar"] = Field("elementwise", description="S1 box: the paper's element-wise "
                                                  "min/max, or the official code's [0, 1.02 max]")
    scaling: Literal["none", "minmax"] = Field("none", description="min-max scale descriptors before clustering "
                                               "(official code)")
    start_rule: Literal["paper", "official"] = Field("paper", description="Eq. 14 gains from round 3 (paper) or "
                                                     "including round 2 (official code)")
    absent_class: Literal["zeros", "minus_one"] = Field("zeros", description="slot of a class with < 2 samples")
    server: ClassVar = "flux:Flux"
    site_tasks: ClassVar[tuple] = ("train", "latent_bounds", "descriptor", "validate")
    clustered: ClassVar[bool] = True
    onboards: ClassVar[bool] = True

    def check_experiment(self, exp):
        super().check_experiment(exp)
        from fedmed.nn.models import BUILTIN_ARCHS, PRETRAINED_ARCHS

        if exp.model.arch not in (*BUILTIN_ARCHS, *PRETRAINED_ARCHS):
            raise ValueError(f"method {self.name!r}: Flux describes a site by the latents of fedmed's networks "
                             f"(forward_features); model.arch {exp.model.arch!r} has none")

    @classmethod
    def training_assignment(cls, doc):
        return {k: int(v) for k, v in doc.get("assignment", {}).items()}  # the run's last clustering

    def workflow_options(self, exp, seed):
        return {"flux": {"pca_seed": seed, "box": self.box, "absent_class": self.absent_class},
                "participation": self.participation, "n_clusters": self.n_clusters or 0,
                "scale": self.dbscan_scale, "k1_silhouette": self.k1_silhouette, "scaling": self.scaling,
                "start_rule": self.start_rule}


class IFCAMethod(Method):
    workflow: Literal["ifca"]
    n_clusters: int = Field(2, ge=1, description="K models")
    participation: float = Field(1.0, gt=0, le=1)
    empty_cluster: Literal["global", "keep"] = Field(
        "global", description="a model no site chose in a round with every site answering: replaced by that "
        "round's average of all updates (fedmed; docs/readings.md), or kept unchanged (the paper)")
    server: ClassVar = "ifca:IFCA"
    site_tasks: ClassVar[tuple] = ("ifca",)
    clustered: ClassVar[bool] = True
    onboards: ClassVar[bool] = True

    @classmethod
    def training_assignment(cls, doc):
        train_rounds = [r for r in doc["rounds"] if r["task"] == "train"]  # each site's choice in the last round
        return {s: int(v["cluster"]) for s, v in train_rounds[-1]["sites"].items()} if train_rounds else {}

    def workflow_options(self, exp, seed):
        return {"k": self.n_clusters, "participation": self.participation, "empty_cluster": self.empty_cluster}


class SegAssessMethod(Method):
    workflow: Literal["seg_assess"]
    per_value: bool = Field(False, description="ask for per-image metadata values (the paper's form); a site answers "
                            "only if its own settings allow per-image data")
    encoder_weights: Optional[str] = Field(None, description="the embedding encoder's weights file (3D: MedicalNet; 2D "
                                           "lesions: EfficientNet-Lite0, or imagenet: its installed release)")
    server: ClassVar = "seg_assessment:SegAssessment"

    @field_validator("encoder_weights")
    @classmethod
    def _release_by_name(cls, v):
        if isinstance(v, str) and v.strip().lower() == "imagenet":
            from fedmed.nn.encoders import release_file

            return release_file("efficientnet_lite0", "encoder_weights")
        return v
    serves: ClassVar[tuple] = ("segmentation",)
    site_tasks: ClassVar[tuple] = ("assess",)
    mode: ClassVar[str] = "assess"

    @property
    def weights_file(self):
        return self.encoder_weights

    def check_files(self, exp):
        if self.weights_file:  # 3D: MedicalNet; 2D lesions: EfficientNet-Lite0
            check_encoder("efficientnet_lite0" if exp.dataset.sources else "medicalnet_resnet18", self.weights_file,
                          in_channels=exp.dataset.channels if exp.dataset.sources else 1)

    def workflow_options(self, exp, seed):
        return {"mode": self.mode, **self.assessment_options()}

    def assessment_options(self) -> dict:
        return {}

    def task_options(self, exp, seed):
        return {"assess": {"per_value": self.per_value}}


class FedAvgWMethod(SegAssessMethod):
    workflow: Literal["fedavg_w"]
    omega: float = Field(1.0, ge=0, le=1, description="weight of the most distant site (004_ Eq. 2)")
    distance: Literal["emd", "euc"] = "emd"
    site: str = Field("", description="down-weight this site instead of the assessed one")
    site_tasks: ClassVar[tuple] = ("assess", "train", "validate")
    mode: ClassVar[str] = "fedavg_w"

    def assessment_options(self):
        return {"distance": self.distance, "omega": self.omega, "site": self.site}


class SegClustersMethod(SegAssessMethod):
    workflow: Literal["seg_clusters"]
    distance: Literal["emd", "euc"] = "emd"
    clusters: list[list[str]] = Field(default_factory=list, description="given clusters instead of the assessed ones")
    site_tasks: ClassVar[tuple] = ("assess", "train", "validate")
    clustered: ClassVar[bool] = True
    onboards: ClassVar[bool] = True
    mode: ClassVar[str] = "clusters"

    def assessment_options(self):
        return {"distance": self.distance, "clusters": self.clusters}


class DittoMethod(Method):
    """Ditto (Li et al. 2021): FedAvg's global model, and at each site a personal model trained on the same data with
    a proximal term ``ditto_lambda`` toward the round's global model; the site serves (and is scored with) its
    personal model."""

    workflow: Literal["ditto"]
    ditto_lambda: float = Field(0.1, gt=0)
    serves: ClassVar[tuple] = ("classification", "segmentation")
    personal: ClassVar[Optional[str]] = "not_kept"

    def check_experiment(self, exp):
        super().check_experiment(exp)
        if exp.dataset.task == "segmentation" and exp.dataset.sources:
            raise ValueError(f"method {self.name!r}: Ditto is not available for 2D lesion segmentation (3D "
                             f"segmentation and classification have it)")

    def task_options(self, exp, seed):
        return {"ditto_lambda": self.ditto_lambda}


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

    def task_options(self, exp, seed):
        return {"task": "mae", "mae": {"mask_ratio": self.mask_ratio, "base_lr": self.base_lr, "warmup": self.warmup,
                                       "rounds": exp.train.rounds}}

    def check_experiment(self, exp):
        super().check_experiment(exp)
        check_vit_input(self, exp)


class FinetuneMethod(Method):
    """Federated fine-tuning of a ViT with a linear head (``001_`` §4.2), optionally with PreP-WFL (Alg. 2)."""

    workflow: Literal["finetune"]
    init: Literal["fedmae", "random"] = Field("fedmae", description="the encoder: Fed-MAE pre-trained or random")
    encoder_weights: Optional[str] = Field(None, description="init 'fedmae': the Fed-MAE run's models/encoder.pt "
                                           "(fedmed ssl fills it)")
    prep_wfl: bool = Field(False, description="PreP-WFL: one class-id round, then prevalence-weighted CE (Eq. 1-3)")
    layer_decay: float = Field(0.75, gt=0, le=1)
    warmup: float = Field(0.05, ge=0, lt=1)
    local_only: bool = Field(True, description="also report every site fine-tuning alone (reference)")
    server: ClassVar = "finetune:Finetune"
    site_tasks: ClassVar[tuple] = ("class_set", "train", "validate")
    ssl_role: ClassVar[Optional[str]] = "finetune"

    @property
    def weights_file(self):
        return self.encoder_weights  # the Fed-MAE encoder: the server's, carried in the job (never a site's)

    @property
    def site_weights(self):
        return None  # the server's file (server_files), never in a site's weights folder

    def server_files(self):
        from fedmed.core.jobfiles import FINETUNE_INIT

        return [(self.encoder_weights, FINETUNE_INIT, "encoder.pt")] if self.init == "fedmae" else []

    def check_experiment(self, exp):
        super().check_experiment(exp)
        check_vit_input(self, exp)

    def check_files(self, exp):
        w = self.weights_file
        if self.init == "fedmae" and (not w or not Path(w).is_file()):
            raise ValueError(f"method {self.name!r}: init 'fedmae' needs encoder_weights, the Fed-MAE run's "
                             f"models/encoder.pt (got {w!r})")

    def workflow_options(self, exp, seed):
        return {"init": self.init, "prep_wfl": self.prep_wfl}

    def task_options(self, exp, seed):
        return {"model": {"arch": "vit_small"},
                "finetune": {"layer_decay": self.layer_decay, "warmup": self.warmup, "rounds": exp.train.rounds}}


BUILTIN = (FedAvgMethod, FedProxMethod, FedBNMethod, FMCLMethod, PACFLMethod, FECFLMethod, CFLMethod, FluxMethod, IFCAMethod,
           SegAssessMethod, FedAvgWMethod, SegClustersMethod, DittoMethod, FedMAEMethod, FinetuneMethod,
           FinetuneLocalMethod)


# --------------------------------------------------------------------------------------------- the registry

def workflow_name(cls) -> str:
    """The ``workflow`` literal of a method class."""
    field = cls.model_fields.get("workflow")
    args = getattr(field.annotation, "__args__", ()) if field is not None else ()
    if len(args) != 1 or not isinstance(args[0], str):
        raise MethodError(f"{cls.__name__}: a method class declares workflow: Literal['<name>']")
    return args[0]


METHODS: dict[str, type] = {workflow_name(c): c for c in BUILTIN}
_listeners: list = []  # called after a registration (fedmed.config rebuilds its methods union)


def register_method(cls: type) -> type:
    """Add a method class (a :class:`Method` subclass with a ``workflow`` literal and a ``server`` workflow) to the
    methods an experiment config may name; usable as a class decorator. Registering the same class again is a no-op;
    another class under a workflow name already taken is refused."""
    if not (isinstance(cls, type) and issubclass(cls, Method)):
        raise MethodError(f"{cls!r} is not a fedmed.methods.Method subclass")
    name = workflow_name(cls)
    known = METHODS.get(name)
    if known is not None and known is not cls:
        if known.__qualname__ == cls.__qualname__ and known.__module__ == cls.__module__:
            METHODS[name] = cls  # the same module imported again (a plugin loaded by path)
        else:
            raise MethodError(f"workflow {name!r} is taken by {known.__module__}.{known.__qualname__}")
    server = cls.server
    if not (isinstance(server, str) and ":" in server) and not isinstance(server, type):
        raise MethodError(f"{cls.__name__}.server should be a Workflow class or 'module:Class', got {server!r}")
    if cls.__module__.split(".")[0] != "fedmed":
        cls.plugin = cls.__module__
    METHODS[name] = cls
    for f in _listeners:
        f()
    return cls


def on_register(callback) -> None:
    """Call ``callback()`` after every registration (``fedmed.config`` rebuilds its ``methods:`` type)."""
    _listeners.append(callback)


def method_class(workflow: str) -> type:
    if workflow not in METHODS:
        raise MethodError(f"workflow {workflow!r} is not a registered method ({', '.join(sorted(METHODS))}); a "
                          f"plugin method's module goes in the config's plugins:")
    return METHODS[workflow]


def method_union():
    """The type of one entry of ``methods:``: the registered method classes, told apart by ``workflow``."""
    classes = tuple(METHODS.values())
    return Annotated[Union[classes], Field(discriminator="workflow")] if len(classes) > 1 else classes[0]


def server_workflow_path(cls) -> str:
    """The server workflow of a method class as the job names it: ``module:Class`` (fedmed's under
    ``fedmed.workflows``, written short)."""
    s = cls.server
    if isinstance(s, str):
        return s
    return f"{s.__module__}:{s.__qualname__}"


def workflows_for(task: str) -> tuple:
    """The workflows that run on a dataset of ``task`` ("classification" or "segmentation")."""
    return tuple(w for w, c in METHODS.items() if task in c.serves)


def clustering_workflows() -> tuple:
    return tuple(w for w, c in METHODS.items() if c.clustered)


# --------------------------------------------------------------------------------------------- plugins

def plugin_module(ref: str, base: Path | None = None) -> tuple[str, Path | None]:
    """(module name, source file or None) of a plugin reference: a ``.py`` file (relative to ``base``, the config's
    folder) or a module name."""
    if ref.endswith(".py"):
        path = Path(ref) if Path(ref).is_absolute() or base is None else Path(base) / ref
        if not path.is_file():
            raise PluginError(f"plugins: {ref}: file not found" + (f" (relative to {base})" if base else ""))
        return path.stem, path.resolve()
    return ref, None


def load_plugins(refs, base: Path | None = None, modules=("*",)) -> list[str]:
    """Import each plugin (a module name, or a ``.py`` file relative to ``base``) — only a module ``modules`` allows
    (``("*",)``: the coordinator's own config) — so that its methods and site tasks register. Returns the module
    names."""
    names = []
    for ref in refs or ():
        name, path = plugin_module(str(ref), base)
        if path is not None and module_allowed(name, modules):
            add_code_folder(path.parent)
        import_plugins([name], modules)
        names.append(name)
    return names
