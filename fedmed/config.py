"""Typed, validated experiment configurations (pydantic, unknown keys rejected).

An experiment file (YAML or JSON) has ``dataset``, ``federation``, ``model``, ``train`` and
``methods``; sweeps are small overrides (``fedmed experiment CONFIG --set train.rounds=5``).
Every validation error names the key path, e.g. ``train.lr: Input should be greater than 0``
or ``model.depth: Extra inputs are not permitted``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

__all__ = ["ConfigError", "DatasetConfig", "ExperimentConfig", "FederationConfig", "MethodConfig", "ModelConfig",
           "TrainConfig", "apply_overrides", "load_config"]


class ConfigError(ValueError):
    """A config file that does not validate; the message names the file and every bad key."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)


class DatasetConfig(_Strict):
    path: str = Field(description="dataset root (class folders, MedMNIST .npz, NIfTI subjects) or 'builtin:digits'")
    task: Literal["classification", "segmentation"] = "classification"
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


class FederationConfig(_Strict):
    sites: int = Field(4, ge=1, le=10000)
    partition: Literal["iid", "dirichlet", "quantity", "predi", "anda", "label_volume"] = "iid"
    volume_region: Literal["WT", "TC", "ET"] = "WT"
    alpha: float = Field(0.5, gt=0)
    test_fraction: float = Field(0.2, gt=0, lt=1)
    predi_prevalence: float = Field(2.0, ge=1)
    predi_disparity: float = Field(0.0, ge=0)
    anda_shift: Literal["feature", "label", "p_y_given_x", "p_x_given_y", "quantity"] = "feature"
    anda_level: int = Field(3, ge=1, le=8)
    anda_groups: int = Field(2, ge=1)
    unseen_sites: int = Field(0, ge=0, description="extra sites held out of training, for test-time assignment")


class ModelConfig(_Strict):
    arch: Literal["resnet9", "resnet18"] = "resnet9"
    width: int = Field(16, ge=4, le=512, description="channels of the first ResNet-9 stage")
    channels: list[int] = Field(default_factory=lambda: [8, 16, 32, 64], min_length=2,
                                description="3D U-Net channels per level (segmentation)")


class TrainConfig(_Strict):
    rounds: int = Field(3, ge=1, le=10000)
    local_epochs: int = Field(1, ge=1, le=1000)
    batch_size: int = Field(16, ge=1)
    lr: float = Field(0.01, gt=0)
    momentum: float = Field(0.9, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    fedprox_mu: float = Field(0.0, ge=0)
    prep_weights: bool = False


class MethodConfig(_Strict):
    name: str = Field(min_length=1)
    workflow: Literal["fedavg", "fedprox", "fmcl", "pacfl", "fecfl", "cfl", "flux", "ifca", "seg_assess", "fedavg_w",
                      "seg_clusters", "ditto"] = "fedavg"
    fedprox_mu: Optional[float] = Field(None, ge=0)
    overlap: bool = True
    n_clusters: Optional[int] = Field(None, ge=1, description="fixed K; None = auto-K (FMCL) ")
    threshold: Optional[float] = Field(None, ge=0, description="agglomerative threshold instead of K")
    encoder: str = Field("random_cnn", description="see fedmed.encoders.ENCODERS")
    encoder_weights: Optional[str] = Field(None, description="local weights file; None = seeded random init")
    encoder_image_size: Optional[int] = Field(None, gt=7)
    n_basis: int = Field(3, ge=1, description="PACFL: singular vectors per class")
    participation: float = Field(1.0, gt=0, le=1, description="fraction of sites sampled per round (Flux, IFCA)")
    dp_epsilon: Optional[float] = Field(None, gt=0, description="Flux: Laplace DP budget for descriptors")
    dbscan_scale: float = Field(1.0, gt=0, description="Flux: eps scale factor")
    omega: float = Field(1.0, ge=0, le=1, description="FedAvg_w weight of the most distant site")
    distance: Literal["emd", "euc"] = "emd"
    site: str = Field("", description="FedAvg_w: down-weight this site instead of the assessed one")
    clusters: list[list[str]] = Field(default_factory=list, description="given clusters instead of the assessed ones")
    ditto_lambda: float = Field(0.1, gt=0)
    per_value: bool = Field(False, description="assessment: send per-image metadata values (paper) not histograms")
    cfl_eps1: float = Field(0.4, gt=0)
    cfl_eps2: float = Field(1.6, gt=0)


class SweepCase(_Strict):
    """One cell of a committed sweep: overrides applied to the config, and optionally a subset of methods."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.+-]+$", description="output folder of this case")
    set: list[str] = Field(default_factory=list, description="overrides key.path=value, as with --set")
    methods: Optional[list[str]] = Field(None, min_length=1, description="method names; None = all of the config's")


class ExperimentConfig(_Strict):
    name: str = Field(min_length=1)
    dataset: DatasetConfig
    federation: FederationConfig = FederationConfig()
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    methods: list[MethodConfig] = Field(default_factory=lambda: [MethodConfig(name="FedAvg")], min_length=1)
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1)
    sweep: list[SweepCase] = Field(default_factory=list, description="cases run by `fedmed sweep CONFIG`")

    @model_validator(mode="after")
    def _unique_methods(self):
        names = [m.name for m in self.methods]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"method names should be unique, got duplicates {dup}")
        cases = [c.name for c in self.sweep]
        dup = sorted({n for n in cases if cases.count(n) > 1})
        if dup:
            raise ValueError(f"sweep case names should be unique, got duplicates {dup}")
        for c in self.sweep:
            unknown = sorted(set(c.methods or []) - set(names))
            if unknown:
                raise ValueError(f"sweep case {c.name!r} names unknown method(s) {unknown}; the config has {names}")
        return self


def _format(e: ValidationError, source: str) -> str:
    lines = []
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(root)"
        lines.append(f"  {loc}: {err['msg']} (got {err.get('input')!r})" if err["type"] != "missing"
                     else f"  {loc}: required key is missing")
    return f"{source}: invalid configuration\n" + "\n".join(lines)


def _key(cur, key: str, dotted: str):
    """``key`` as it indexes ``cur``: a mapping key, or a list index given as a number or an item's ``name``."""
    if not isinstance(cur, list):
        return key
    if key.lstrip("-").isdigit() and -len(cur) <= int(key) < len(cur):
        return int(key)
    names = [x.get("name") for x in cur if isinstance(x, dict)]
    if key in names:
        return names.index(key)
    raise ConfigError(f"override {dotted!r}: no list item {key!r} (names: {names}, or an index < {len(cur)})")


def _set_path(d: dict, dotted: str, value):
    keys = dotted.split(".")
    cur = d
    for k in keys[:-1]:
        k = _key(cur, k, dotted)
        if isinstance(cur, dict) and (k not in cur or not isinstance(cur[k], (dict, list))):
            cur[k] = {}
        cur = cur[k]
    cur[_key(cur, keys[-1], dotted)] = value


def apply_overrides(raw: dict, overrides: list[str] | None) -> dict:
    """``["train.rounds=5", "seeds=[0,1]", "methods.IFCA.n_clusters=2"]`` -> updated copy (values parsed as YAML
    scalars/lists; list items are addressed by index or by their ``name``)."""
    import copy

    import yaml

    out = copy.deepcopy(raw)
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r} should look like key.path=value")
        k, v = item.split("=", 1)
        _set_path(out, k.strip(), yaml.safe_load(v))
    return out


def load_config(path_or_dict, overrides: list[str] | None = None) -> ExperimentConfig:
    """Read and validate an experiment config (YAML/JSON file or dict).

    Raises:
        ConfigError: missing/unreadable file, or a validation error naming each bad key.
    """
    import yaml

    if isinstance(path_or_dict, dict):
        raw, source = path_or_dict, "config"
    else:
        path = Path(path_or_dict)
        source = str(path)
        if not path.is_file():
            raise ConfigError(f"{path}: config file not found")
        try:
            text = path.read_text()
            raw = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
        except Exception as e:
            raise ConfigError(f"{path}: cannot parse ({type(e).__name__}: {e})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: top level should be a mapping, got {type(raw).__name__}")
        base = raw.pop("extends", None)
        if base:
            parent = (path.parent / base)
            raw = _merge(load_raw(parent), raw)
    raw = apply_overrides(raw, overrides)
    try:
        return ExperimentConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_format(e, source)) from None


def load_raw(path: Path) -> dict:
    import yaml

    if not path.is_file():
        raise ConfigError(f"{path}: base config (extends) not found")
    raw = yaml.safe_load(path.read_text())
    base = raw.pop("extends", None)
    return _merge(load_raw(path.parent / base), raw) if base else raw


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out
