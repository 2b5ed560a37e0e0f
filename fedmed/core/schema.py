"""The sections of fedmed's configs, defined once: the experiment config (``fedmed.config``) is made of them, and a
site reads the task config a job sends it through :func:`task_view` — typed, with the defaults of these models
(never a default restated where a value is read).

The task-only sections the common site tasks read are here too: ``signature`` (every kind of one-shot signature)
and the training loop's switches a method turns on (``train.fedprox_mu``, ``train.local_norm``,
``ditto_lambda``, ``finetune``). A method's option in them has **no default here**: its one definition (and default)
is the method's model (``fedmed.methods``), whose hooks fill these sections; a field a method does not use is ``None``
(``tests/test_methods.py`` pins this). What a method's *own* site tasks read (IFCA's, Flux's, Fed-MAE's, the
assessment's, the serving plan's) travels in ``method_options``, validated by the task's own model where it is read.
"""

from __future__ import annotations

from fedmed.core.errors import FedmedError

import math
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

__all__ = ["ClusteringTask", "DataSection", "FederationTiming", "FinetuneTask", "ModelSection", "PrivacyConfig", "SegTrainConfig", "ServerOptConfig", "SignatureTask", "Strict", "TaskConfig",
           "TaskConfigError", "TrainConfig", "TrainTask", "WeightsRef", "error_lines", "task_config"]


def _number_field(annotation) -> bool:
    """A field whose values are numbers (``int``, ``float``, optionally ``None``)."""
    import types
    import typing

    if annotation in (int, float):
        return True
    args = typing.get_args(annotation)
    return typing.get_origin(annotation) in (typing.Union, types.UnionType) \
        and all(a in (int, float, type(None)) for a in args) and any(a in (int, float) for a in args)


class Strict(BaseModel):
    """Every config section: unknown keys refused; a number is a finite number (no NaN, no infinity: ``.inf``,
    ``1e999``) and never a boolean or a string (``true`` is not read as 1) — one rule for every numeric option,
    wherever the section is read (the coordinator's config, a site's task config, a plugin method's options)."""

    model_config = ConfigDict(extra="forbid", frozen=False, allow_inf_nan=False)

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs):
        super().__pydantic_init_subclass__(**kwargs)
        from pydantic.functional_validators import BeforeValidator

        numbers = [f for f in cls.model_fields.values() if _number_field(f.annotation)
                   and not any(getattr(m, "func", None) is _no_boolean for m in f.metadata)]
        for f in numbers:
            f.metadata.append(BeforeValidator(_no_boolean))
        if numbers:
            cls.model_rebuild(force=True)


def _no_boolean(v):
    if isinstance(v, bool):
        raise ValueError(f"should be a number, got the boolean {str(v).lower()}")
    return v


# the monai.transforms a site applies to its inputs (ModelSection.preprocessing): intensity only, each rebuilt by name
# from plain arguments (fedmed's own reading does the loading, channels and resizing)
INPUT_TRANSFORMS = ("ScaleIntensity", "ScaleIntensityRange", "ScaleIntensityRangePercentiles", "NormalizeIntensity",
                    "ThresholdIntensity", "ClipIntensityPercentiles")


def _literal(v) -> bool:
    if isinstance(v, str):
        return not v.startswith(("$", "@", "%"))
    if isinstance(v, (list, tuple)):
        return all(_literal(x) for x in v)
    return v is None or isinstance(v, (bool, int, float))


class ModelSection(Strict):
    """The network a site trains (``fedmed.nn.models``); the experiment config's ``ModelConfig`` adds the checks
    that need the coordinator's files and fedmed's networks."""

    arch: str = Field("resnet9", description="resnet9 | resnet18 | vit_small (fedmed's; for segmentation fedmed's 3D "
                      "U-Net), a network of monai.networks.nets by name (DenseNet121, SegResNet, ...), or "
                      "package.module:Class (fedmed.nn.models)")
    args: dict = Field(default_factory=dict, description="arguments of a MONAI or user network (spatial_dims, input "
                       "channels and outputs are filled from the task)")
    init_weights: Optional[str] = Field(None, description="start the network from this local state-dict file (the "
                                        "job carries it)")
    width: int = Field(16, ge=4, le=512, description="channels of the first ResNet-9 stage")
    norm: Literal["batch", "group"] = Field("batch", description="ResNet-9 normalisation: BatchNorm (the DAWNBench "
                                            "original; chosen on validation data, docs/readings.md) or GroupNorm")
    channels: list[int] = Field(default_factory=lambda: [8, 16, 32, 64], min_length=2,
                                description="3D U-Net channels per level (segmentation)")
    bundle: Optional[str] = Field(None, description="the MONAI bundle arch, args and init_weights were read from "
                                  "(fedmed.config.ModelConfig; the coordinator's path, never in a job's task config)")
    preprocessing: Optional[list[dict]] = Field(
        None, description="intensity transforms of monai.transforms applied to every input at the sites before the "
        "network, as [{name: ScaleIntensity, args: {...}}] (a MONAI bundle's preprocessing: fedmed.nn.bundle; only "
        "the names of INPUT_TRANSFORMS, literal arguments); None: fedmed's own input scaling alone")

    @field_validator("preprocessing")
    @classmethod
    def _known_transforms(cls, v):
        if v is None:
            return v
        for i, step in enumerate(v):
            name, args = step.get("name"), step.get("args", {})
            if set(step) - {"name", "args"}:
                raise ValueError(f"preprocessing[{i}]: keys name and args only, got {sorted(step)}")
            if name not in INPUT_TRANSFORMS:
                raise ValueError(f"preprocessing[{i}]: {name!r} is not one of the intensity transforms the sites "
                                 f"apply ({', '.join(INPUT_TRANSFORMS)})")
            if not isinstance(args, dict) or not all(_literal(a) for a in args.values()):
                raise ValueError(f"preprocessing[{i}] {name}: arguments must be plain numbers, booleans, lists or "
                                 f"names (no expressions), got {args!r}")
        return v


class SegTrainConfig(Strict):
    """Segmentation-only training options (``004_`` §3.2 and fedmed's recipe, docs/readings.md)."""

    loss: Literal["dice", "dice_focal", "dice_bce"] = "dice_focal"
    patches_per_volume: int = Field(4, ge=1)
    pos_fraction: float = Field(0.5, ge=0, le=1, description="share of patches centred on tumour")


class StopConfig(Strict):
    """When a run stops before ``train.rounds`` (a ceiling): the sites' validation score has not improved by more than
    ``min_delta`` for ``patience`` rounds (``fedmed.workflows.stopping``; #85)."""

    patience: Optional[int] = Field(None, ge=1, le=10000, description="rounds without a validation improvement before "
                                    "the run stops (None: every round of train.rounds runs)")
    min_delta: float = Field(0.0, ge=0, description="the least rise of the validation score that counts as an "
                             "improvement (in the metric's own units: 0.01 is one accuracy point)")
    metric: Literal["auto", "val_accuracy", "pooled_val_auc", "val_dice_mean"] = Field(
        "auto", description="the validation score the rule reads; auto: the one the experiment's selection reads "
        "(pooled_val_auc under selection validation_auc, val_dice_mean for segmentation, else val_accuracy)")


class ServerOptConfig(Strict):
    """FedOpt (Reddi et al., ICLR 2021, "Adaptive Federated Optimization", Alg. 2): the server treats the averaged
    update ``Delta = avg_k theta_k - theta`` as a pseudo-gradient and steps with its own optimizer, one state per
    served model (per cluster): ``avgm`` (FedAvgM: ``m = beta1 m + Delta``, ``theta += lr m``), ``adam`` (FedAdam) or
    ``yogi`` (FedYogi). ``none``: FedAvg's ``theta = avg``. Batch-norm running statistics are averaged, not stepped
    (as NVFlare's FedOpt does for what is not a trainable parameter)."""

    kind: Literal["none", "avgm", "adam", "yogi"] = "none"
    lr: float = Field(1.0, gt=0, le=10, description="server learning rate eta (Reddi et al.'s grid: 1e-3 to 10)")
    beta1: float = Field(0.9, ge=0, lt=1, description="first-moment (momentum) decay")
    beta2: float = Field(0.99, ge=0, lt=1, description="second-moment decay (adam, yogi)")
    tau: float = Field(1e-3, gt=0, le=1, description="adaptivity tau: v starts at tau^2, the step divides by sqrt(v) + "
                       "tau (Reddi et al.'s grid: 1e-5 to 1e-1; above 1 the server barely moves the model)")


class TrainConfig(Strict):
    """The training recipe; defaults are the 2D recipe chosen on validation data (benchmarks/tune_recipe.py,
    docs/readings.md "2D recipe")."""

    rounds: int = Field(3, ge=1, le=10000, description="the most training rounds (a ceiling where train.stop is set)")
    stop: StopConfig = Field(default_factory=lambda: StopConfig(), description="stop before the ceiling when the "
                             "validation score stops improving (#85)")
    local_epochs: int = Field(3, ge=1, le=1000)
    batch_size: int = Field(16, ge=1)
    optimizer: Literal["sgd", "adam", "adamw"] = "adam"
    lr: float = Field(1e-3, gt=0)
    momentum: float = Field(0.9, ge=0, lt=1)
    weight_decay: float = Field(5e-4, ge=0)
    augment: Literal["none", "flip", "flip_crop"] = Field("flip", description="horizontal flips (flip), plus random "
                                                          "crops of a 4-pixel padded image (flip_crop)")
    recipe: Literal["auto", "scratch", "transfer"] = Field(
        "auto", description="which recipe fills the four choices below left unset (fedmed.nn.recipe): auto = transfer "
        "when the network starts from weights (model.init_weights), scratch otherwise; docs/readings.md 'Transfer "
        "learning'")
    keep_optimizer_state: Optional[bool] = Field(None, description="a site keeps its optimizer state (momentum, Adam "
                                                 "moments) between rounds, per served model (None: the recipe's)")
    head_init: Optional[Literal["seeded", "zero"]] = Field(None, description="the classifier's last layer as the "
                                                           "network initialises it, or zero (None: the recipe's)")
    backbone_lr_scale: Optional[float] = Field(None, gt=0, le=1, description="learning rate of all but the "
                                               "classifier's last layer, as a fraction of lr (None: the recipe's)")
    norm_stats: Optional[Literal["train", "frozen"]] = Field(None, description="batch-norm running statistics updated "
                                                             "by training, or frozen at the starting model's (None: "
                                                             "the recipe's)")
    norm_recalibrate: bool = Field(
        False, description="after every round's average, the served model's batch-norm running statistics "
        "re-estimated over the sites' training images: each site sends its layers' per-channel means and variances "
        "over its batches (aggregates of at least k_min images), the server averages them by batches "
        "(docs/readings.md 'Transfer learning federated'); FedAvg-family and cluster-training workflows")
    lr_schedule: Literal["constant", "cosine"] = Field(
        "constant", description="the learning rate over the run: constant, or cosine (from lr down to 0 over the "
        "rounds x local_epochs of a federated classifier's training, per local step; the centralized reference the "
        "same over its epochs); classification only")
    server_opt: ServerOptConfig = Field(default_factory=lambda: ServerOptConfig(),
                                        description="the server's optimizer over the averaged update (FedOpt)")
    seg: SegTrainConfig = SegTrainConfig()
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$", description="auto (a CUDA GPU when there is one), "
                        "cpu, cuda or cuda:N; a site may override it in its own settings (fedmed.core.device)")
    precision: Literal["fp32", "bf16", "fp16"] = Field("fp32", description="autocast precision of training and "
                                                       "inference (fp16 with a gradient scaler on a GPU)")
    workers: int = Field(0, ge=0, le=64, description="data-loader processes that cut 3D training patches (0: in the "
                         "site's process)")
    deterministic: bool = Field(False, description="on a GPU, cuDNN's deterministic algorithms only: the same seed "
                                "gives the same numbers (default fp32 cuDNN does not; docs/results.md 'On a GPU')")


class PrivacyConfig(Strict):
    """What may leave a site (docs/privacy.md)."""

    k_min: int = Field(5, ge=1, description="no per-class or per-group statistic leaves a site unless it aggregates "
                       "at least k_min samples")
    accept_k_min_below_2: bool = Field(False, description="explicit consent to k_min < 2 (single samples may leave)")
    dp_epsilon: Optional[float] = Field(None, description="differential privacy budget per signature (None: off)")
    dp_delta: float = Field(1e-5, gt=0, lt=1, description="Gaussian mechanism delta (signatures without a paper "
                            "mechanism use Laplace; see docs/privacy.md)")
    clip: float = Field(1.0, gt=0, description="L2 norm each embedding is clipped to before it enters a signature "
                        "(the DP sensitivity bound)")
    latent_bound: float = Field(10.0, gt=0, description="Flux with DP on: the public latent box [0, latent_bound]^z "
                                "(no site data; latents are clipped to it)")

    @field_validator("dp_epsilon")
    @classmethod
    def _finite_eps(cls, v):
        if v is not None and (not math.isfinite(v) or v <= 0):
            raise ValueError(f"dp_epsilon should be a finite number > 0 (or null to switch DP off), got {v}")
        return v

    @model_validator(mode="after")
    def _k_min_consent(self, info: ValidationInfo):
        if (info.context or {}).get("at_site"):  # the coordinator asked for consent; a site applies its own k_min too
            return self
        if self.k_min < 2 and not self.accept_k_min_below_2:
            raise ValueError(f"k_min={self.k_min} lets a single patient's statistics leave a site; set "
                             f"privacy.accept_k_min_below_2: true to accept that explicitly")
        return self


class FederationTiming(Strict):
    """How long a run waits for its sites (``federation`` of the experiment config and of a task)."""

    min_clients: int = Field(1, ge=1, description="fewest sites that must answer a round for the run to go on")
    task_timeout: float = Field(1800.0, gt=0, description="seconds a site has to answer a task before the round "
                                "goes on without it")
    startup_timeout: float = Field(300.0, gt=0, description="seconds to wait for every named site to register "
                                   "before starting without the missing ones")


# ------------------------------------------------------------------------------------- the task config
class FederationSection(FederationTiming):
    sites: Optional[list[str]] = None


class DataSection(Strict):
    """What a site needs to know of the data: classification (``image_size``, ``channels``, ``n_classes``) or
    segmentation (``shape``, ``roi``, ``modalities``, ``in_channels``)."""

    image_size: Optional[int] = None
    channels: Optional[int] = None
    n_classes: Optional[int] = None
    shape: Optional[list[int]] = None
    roi: Optional[list[int]] = None
    modalities: Optional[list[str]] = None
    in_channels: Optional[int] = None
    spatial_dims: Literal[2, 3] = Field(3, description="segmentation: 3 (NIfTI volumes, WT/TC/ET) or 2 (lesion masks "
                                        "of 2D images, fedmed.site.seg2d)")


class TrainTask(TrainConfig):
    """``train`` as a task carries it: the recipe, and FedProx's proximal weight (from the method)."""

    fedprox_mu: Optional[float] = Field(None, ge=0, description="FedProx's proximal weight mu (None: no proximal "
                                        "term; the value: fedmed.methods.FedProxMethod)")
    local_norm: bool = Field(False, description="FedBN: the site keeps its own batch-norm layers (weights, biases, "
                             "running statistics) and takes only the rest of the served model (fedmed.methods."
                             "FedBNMethod)")


class SignatureTask(Strict):
    """One-shot clustering signature (FMCL, PACFL, FECFL): ``fedmed.site.runner.SiteRunner.signature``."""

    kind: str = Field(min_length=1, description="a registered signature kind (fedmed.algorithms.signatures."
                      "SignatureKind: fmcl, pacfl, fecfl, a plugin's)")
    encoder: str
    image_size: Optional[int] = Field(None, description="the encoder's input size (None: its own)")
    seed: int = 0
    options: dict = Field(default_factory=dict, description="the kind's own options at the site (its method's, e.g. "
                          "PACFL's n_basis), passed to its release")
    pseudo_labels: bool = Field(False, description="a site without labels: class prototypes of all its images under "
                                "the served model's predicted classes (onboarding, fedmed.workflows.onboard)")
    halves: bool = Field(False, description="also the mean embedding of each of two random halves of the training "
                         "images (each of >= k_min; never under DP or on raw pixels): the 'do the sites differ?' test "
                         "(fedmed.algorithms.differ)")


class ClusteringTask(Strict):
    """How the server clusters one-shot signatures (from the method's options: ``fedmed.config``)."""

    n_clusters: Optional[int]
    threshold: Optional[float]
    linkage: Literal["average", "weighted", "complete", "single"]
    k1_silhouette: Optional[float]
    k1_rule: Optional[Literal["differ", "silhouette"]] = Field(None, description="the method's (None: a job from "
                                                               "before the option, the silhouette gate)")
    options: dict = Field(default_factory=dict, description="the kind's own distance options (its method's: FMCL's "
                          "overlap, PACFL's angle), passed to its distances")
    min_cluster_images: Optional[int] = Field(None, ge=0, description="merge a cluster with fewer training images into "
                                              "its nearest (the method's; None: a job from before the option, off)")


class FinetuneTask(Strict):
    """Fine-tuning (``001_`` Alg. 2): layer-wise lr decay, warm-up then cosine over the run."""

    layer_decay: float = Field(gt=0, le=1)
    warmup: float = Field(ge=0, lt=1)
    rounds: int = Field(ge=1)


class WeightsRef(Strict):
    """A weights file as a job names it (``fedmed.core.policy``): its name in every site's weights folder, and the
    SHA-256 of the coordinator's copy, which each site's file must match."""

    name: str = Field(min_length=1)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class TaskConfig(Strict):
    """What every task carries to a site (``fedmed.run.taskconfig.build_task_config`` builds it from the experiment
    config), typed: a site reads it through :func:`task_config`, with these models' defaults."""

    task: Literal["classification", "segmentation", "mae"] = "classification"
    seed: int = 0
    plugins: list[str] = Field(default_factory=list, description="modules of the plugin methods the job uses: a party "
                               "imports them (if its policy lists them) before it answers (fedmed.methods)")
    model: ModelSection = ModelSection()
    train: TrainTask = TrainTask()
    privacy: PrivacyConfig = PrivacyConfig()
    federation: FederationSection = FederationSection()
    data: DataSection = DataSection()
    classes: Optional[list[str]] = None
    cluster: Optional[int] = None
    evaluate_on: Literal["split", "all"] = "split"
    class_weights: Optional[list[float]] = None
    ditto_lambda: Optional[float] = None
    signature: Optional[SignatureTask] = None
    finetune: Optional[FinetuneTask] = None
    personal_key: Optional[str] = Field(None, pattern=r"^[0-9a-f]{16}$", description="FedBN: the key under which the "
                                        "site keeps its own batch-norm layers after each round (its personal model, "
                                        "in its own workspace; never sent), for a later serving plan")
    serve_personal: Optional[str] = Field(None, pattern=r"^[0-9a-f]{16}$", description="a serving plan's task: the "
                                          "site scores the model sent with its own batch-norm layers kept under this "
                                          "key (a FedBN run's personal model)")
    serve_keep: Optional[str] = Field(None, pattern=r"^[0-9a-f]{16}$", description="a serving plan's task: the site "
                                      "keeps the model it scores — the model it is served — in its own workspace, "
                                      "served/<key>/model.pt with its MONAI bundle beside it, and says it did "
                                      "(fedmed.site.served.keep_served)")
    encoder_weights: Optional[WeightsRef] = Field(None, description="the encoder's weights file, which every site "
                                                  "holds in its weights folder (None: seeded random init)")
    method_options: dict = Field(default_factory=dict, description="the options of the method's own site tasks (a "
                                 "plugin's): an open key, validated at the site by the method's own model "
                                 "(fedmed.methods.Method.site_options_model)")
    tracking: list[str] = Field(default_factory=list, description="where the job's server sends metrics besides its "
                                "own workspace (fedmed.core.policy.tracking_destinations): a site sends its per-round "
                                "metrics to the trackers only where its policy's 'tracking' allows every one")


class TaskConfigError(FedmedError, ValueError):
    """A task config that does not validate: one line per bad key, naming it (never pydantic's dump or its URL)."""


def error_lines(e) -> list[str]:
    """A pydantic ``ValidationError`` (or a list of its ``errors()``) as one line per bad key: ``train.lr: should be >
    0 (got -1)``. The value is shown only when it is short and not a section (a model-level check's input is the whole
    config: never dumped)."""
    out = []
    for err in (e if isinstance(e, list) else e.errors()):
        loc = ".".join(str(p) for p in err["loc"]) or "(root)"
        if err["type"] == "missing":
            out.append(f"{loc}: required key is missing")
            continue
        msg = str(err["msg"]).removeprefix("Value error, ").removeprefix("Assertion failed, ")
        got = err.get("input")
        shown = "" if isinstance(got, dict) or len(repr(got)) > 100 or err["loc"] == () else f" (got {got!r})"
        out.append(f"{loc}: {msg}{shown}")
    return out


def task_config(cfg) -> TaskConfig:
    """The typed view of a task config (a dict as it travels, or a :class:`TaskConfig`): validated, schema defaults
    for what it leaves out. The coordinator's checks (e.g. consent to ``k_min < 2``) were made when the job was
    built; a site applies its own settings on top."""
    from pydantic import ValidationError

    if isinstance(cfg, TaskConfig):
        return cfg
    try:
        return TaskConfig.model_validate(dict(cfg), context={"at_site": True})
    except ValidationError as e:
        raise TaskConfigError("the job's task config: " + "; ".join(error_lines(e))) from None
