"""Apply a trained fedmed model to new data: ``fedmed predict MODEL INPUTS...``.

A run's final models (``models/global.pt``, ``models/cluster<k>.pt``) are PyTorch checkpoints::

    {"format": "fedmed-model-1", "state_dict": ..., "task": "classification" | "segmentation",
     "model": {...}, "data": {...}, "classes": [...], "cluster": k, "sites": [...], ...}

:func:`load_model` rebuilds the network from the stored config and loads the weights strictly (a file from
another architecture is a one-line error naming the file and the mismatch). :func:`predict_images` classifies
image files with the same preprocessing as training (resize, channels, intensity scaling);
:func:`predict_volume` segments one NIfTI case (one file per modality, in the model's modality order) and writes
a BraTS-style label map (1 necrotic/non-enhancing core, 2 edema, 4 enhancing) on the input's grid.
"""

from __future__ import annotations

from fedmed.core.errors import FedmedError

from pathlib import Path

import numpy as np

from fedmed.core.schema import ModelSection

__all__ = ["ModelFileError", "load_model", "predict_images", "predict_volume", "save_model"]


class ModelFileError(FedmedError, ValueError):
    """A file that is not a usable fedmed model; the message names it."""


def save_model(path, params: dict, cfg: dict, *, cluster=None, sites=None, workflow: str = "", rounds: int = 0,
               train_images: int | None = None, decision: dict | None = None):
    """Write a model checkpoint (the format :func:`load_model` reads) from numpy ``params`` and the task config;
    ``sites`` / ``train_images``: the sites whose updates went into it and their training images; ``decision``: a
    binary classifier's decision threshold chosen on validation data (:func:`fedmed.algorithms.metrics.
    decision_threshold`), which ``predict`` and the exported bundle apply."""
    import torch

    from fedmed.core.schema import task_config

    t = task_config(cfg)  # what the task config leaves out: the schema's defaults
    torch.save({"format": "fedmed-model-1", "state_dict": {k: torch.as_tensor(np.asarray(v)) for k, v in params.items()},
                "task": t.task, "model": t.model.model_dump(), "data": cfg["data"], "classes": t.classes, "seed": t.seed,
                "cluster": cluster,
                "sites": sorted(sites) if sites is not None else None, "train_images": train_images,
                "workflow": workflow, "rounds": rounds,
                **({"personal_key": t.personal_key} if t.personal_key else {}),
                **({"decision": dict(decision)} if decision else {})}, str(path))
    return Path(path)


def load_model(path, policy=None):
    """``(torch module in eval mode, checkpoint info)``. The network a checkpoint names must be one this site runs
    (``policy``: its :class:`~fedmed.core.policy.SitePolicy`, by default this site's — ``FEDMED_SITE_POLICY``, the kit's
    ``local/fedmed_policy.json`` — else the defaults, which import no user module): a checkpoint can name any
    ``module:Class``, and nothing is imported before that check.

    Raises:
        ModelFileError: missing or unreadable file, not a fedmed checkpoint, a network the policy does not allow, or
            weights that do not fit the architecture the file describes.
    """
    import torch

    from fedmed.core.policy import PolicyError, load_policy
    from fedmed.nn.models import ArchError

    policy = policy if policy is not None else load_policy()

    p = Path(path)
    if not p.is_file():
        raise ModelFileError(f"{p}: model file not found")
    try:
        ck = torch.load(str(p), map_location="cpu", weights_only=True)
    except Exception as e:
        raise ModelFileError(f"{p}: not a readable PyTorch file ({type(e).__name__})") from None
    if not isinstance(ck, dict) or ck.get("format") != "fedmed-model-1":
        raise ModelFileError(f"{p}: not a fedmed model checkpoint (expected a dict with format 'fedmed-model-1', as "
                             f"a run saves in models/*.pt)")
    from pydantic import ValidationError

    try:  # what the entry leaves out (a checkpoint of an earlier fedmed): the schema's defaults
        arch = ModelSection.model_validate(ck.get("model")).arch
    except ValidationError:
        raise ModelFileError(f"{p}: its 'model' entry names no network") from None
    try:
        policy.check_arch(arch)
        if isinstance(ck.get("data"), dict):  # sizes a checkpoint names are allocated: this machine's limits first
            policy.check_task_sizes(ck["data"])
        return _build_and_load(p, ck, policy)
    except (PolicyError, ArchError) as e:
        raise ModelFileError(f"{p}: {e}") from None


def _build_and_load(p, ck, policy):
    if ck["task"] == "mae":
        from fedmed.nn.mae import mae_model

        net = mae_model(ck["data"]["channels"])
        desc = "a Fed-MAE masked autoencoder"
    elif ck["task"] == "segmentation" and (ck.get("data") or {}).get("spatial_dims") == 2:
        raise ModelFileError(f"{p}: a 2D lesion-segmentation model; fedmed predict applies classifiers and 3D "
                           f"segmentation models (2D lesion prediction is not there yet)")
    elif ck["task"] == "segmentation":
        from fedmed.nn.models import seg_model_from_config

        net = seg_model_from_config({**ck["model"], "init_weights": None}, ck["data"]["in_channels"],
                                    modules=policy.modules)
        m = ModelSection.model_validate(ck["model"])  # an earlier checkpoint's gaps: the schema's defaults
        desc = (f"a 3D U-Net with channels {m.channels}" if m.arch in ("unet", "resnet9", "resnet18", "vit_small")
                else f"a {m.arch} ({m.args})") + f" and {ck['data']['in_channels']} input channels"
    else:
        from fedmed.nn.models import model_from_config

        net = model_from_config({**ck["model"], "init_weights": None}, ck["data"]["channels"], ck["data"]["n_classes"],
                                modules=policy.modules)
        names = ck.get("classes")
        if names is not None and len(names) != int(ck["data"]["n_classes"]):
            raise ModelFileError(f"{p}: names {len(names)} class(es) for a model of {ck['data']['n_classes']} "
                                 f"outputs; every output needs its class name (or none: they are numbered)")
        m = ModelSection.model_validate(ck["model"])
        shape = f"width {m.width}, {m.norm} norm" if m.arch in ("resnet9", "resnet18", "vit_small") else f"{m.args}"
        desc = f"a {m.arch} ({shape}) with {ck['data']['channels']} input channels and {ck['data']['n_classes']} classes"
    own = net.state_dict()
    sd = ck["state_dict"]
    missing, extra = sorted(set(own) - set(sd)), sorted(set(sd) - set(own))
    shapes = [k for k in sorted(set(own) & set(sd)) if tuple(own[k].shape) != tuple(sd[k].shape)]
    if missing or extra or shapes:
        raise ModelFileError(f"{p}: its weights do not fit {desc} (the architecture the file describes): "
                             f"{len(missing)} missing, {len(extra)} unexpected, {len(shapes)} mis-shaped parameters"
                             + (f", e.g. {(shapes or missing or extra)[0]}" if (shapes or missing or extra) else ""))
    net.load_state_dict(sd)
    net.eval()
    return net, ck


def predict_images(model_path, images, *, device: str = "auto") -> list[dict]:
    """Classify image files; one dict per image: ``image``, ``prediction`` (class name), ``probabilities``.

    Raises:
        ModelFileError: bad model file; DataError: an unreadable image (named).
    """
    from fedmed.data.images import load_images
    from fedmed.nn.train import predict_proba

    from fedmed.core.device import resolve_device

    net, ck = load_model(model_path)
    net = net.to(resolve_device(device, where="fedmed predict", setting="--device"))
    if ck["task"] != "classification":
        raise ModelFileError(f"{model_path}: a segmentation model; give NIfTI files of one case instead")
    d = ck["data"]
    done: set = set()
    x, _ = load_images([{"image": str(f), "label": 0} for f in images], image_size=d["image_size"],
                       channels=d["channels"], site="predict", conversions=done)
    if done:  # the same conversions as training, said once
        import sys

        from fedmed.data.images import conversion_note

        print(conversion_note("predict", done), file=sys.stderr)
    prob = predict_proba(net, x)
    names = ck.get("classes") or [str(c) for c in range(d["n_classes"])]
    from fedmed.algorithms.metrics import decide

    pred = decide(prob, (ck.get("decision") or {}).get("threshold"))  # the threshold chosen on validation, if any
    return [{"image": str(f), "prediction": names[int(c)],
             "probabilities": {n: round(float(v), 6) for n, v in zip(names, p)}} for f, p, c in zip(images, prob, pred)]


def predict_volume(model_path, modality_files, out_path, *, mask=None, device: str = "auto") -> Path:
    """Segment one case and write its label map (NIfTI, the first modality's grid and affine).

    The case is prepared as in training (crop to the brain mask — ``mask`` or the first modality's non-zero
    voxels —, resample to the model's shape); the predicted regions are resampled back (nearest-exact) and
    written as BraTS labels: 4 = ET, 1 = TC without ET, 2 = WT without TC.
    """
    import nibabel as nib
    import torch

    from fedmed.data.nifti import _load_nifti, _resize
    from fedmed.nn.seg import predict_masks

    net, ck = load_model(model_path)
    from fedmed.core.device import resolve_device

    net = net.to(resolve_device(device, where="fedmed predict", setting="--device"))
    if ck["task"] != "segmentation":
        raise ModelFileError(f"{model_path}: a classification model; give image files instead")
    files = [Path(f) for f in modality_files]
    need = ck["data"]["in_channels"]
    if len(files) != need:
        mods = ck["data"].get("modalities") or [f"modality {i + 1}" for i in range(need)]
        raise ValueError(f"the model takes {need} modalities ({', '.join(mods)}), got {len(files)} file(s)")
    vols = [_load_nifti(f, "predict", f"modality {i + 1}")[0] for i, f in enumerate(files)]
    shape = tuple(ck["data"]["shape"])
    fg = (_load_nifti(mask, "predict", "mask")[0] > 0) if mask else vols[0] != 0
    if not fg.any():
        raise ValueError(f"{files[0]}: empty foreground, nothing to segment")
    idx = np.argwhere(fg)
    lo, hi = idx.min(0), idx.max(0) + 1
    sl = tuple(slice(a, b) for a, b in zip(lo, hi))
    img = np.stack([_resize(v[sl], shape, "trilinear")[0] for v in vols]).astype(np.float32)
    from fedmed.nn.preprocessing import case_transform

    img = case_transform(ck["model"].get("preprocessing"))(img)  # a bundle's intensity steps, as the sites applied them
    with torch.no_grad():
        masks = predict_masks(net, img, roi=tuple(ck["data"]["roi"]))
    crop = [_resize(m.astype(np.float32), tuple(hi - lo), "nearest-exact")[0] > 0.5 for m in masks]
    lab = np.zeros(vols[0].shape, np.uint8)
    region = np.zeros(tuple(hi - lo), np.uint8)
    region[crop[0]] = 2
    region[crop[1]] = 1
    region[crop[2]] = 4
    lab[sl] = region
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    nib.save(nib.Nifti1Image(lab, nib.load(str(files[0])).affine), str(out))
    return out
