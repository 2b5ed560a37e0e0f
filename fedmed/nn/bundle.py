"""A trained classifier or 3D segmentation model as a MONAI bundle (``models/<name>_bundle/``): what MONAI Label, MONAI Deploy and
``python -m monai.bundle run`` take, runnable without fedmed.

::

    <name>_bundle/
      configs/metadata.json    MONAI's metadata: inputs, outputs, classes; "fedmed": the sites or cluster it serves and
                               how it was trained
      configs/inference.json   network_def, preprocessing, inferer, postprocessing (the keys MONAI Label and MONAI
                               Deploy read) and a run that writes predictions.csv for every image of dataset_dir
      models/model.pt          the state dict (MONAI's convention: loaded into network_def)
      models/model.ts          TorchScript of the network, where it scripts (or traces)
      scripts/fedmed_image.py  the image reading fedmed trains with (8-bit and wider images, channels, bilinear
                               resize, [0, 1]), standalone: numpy and PIL; preprocessing then scales to [-1, 1]
                               as fedmed feeds every network (fedmed.nn.train)
      scripts/fedmed_volume.py (3D segmentation, instead) a case folder's modalities cropped to the brain and
                               resampled as fedmed trains and predicts; the label map written back on the case's grid
      docs/README.md

``network_def`` is the MONAI network itself for a network of ``monai.networks.nets`` (``_target_`` with its
arguments: the standard, editable form) and the TorchScript file otherwise (fedmed's own networks, a user's class),
so nothing of fedmed is imported when the bundle runs::

    python -m monai.bundle run --config_file configs/inference.json --meta_file configs/metadata.json \\
        --bundle_root . --dataset_dir IMAGES --output_dir OUT

:func:`export_bundle` writes one from a fedmed checkpoint (``models/*.pt``); a run writes one beside each final
classifier and 3D segmentation model (``Federation.save_final``). 2D lesion-segmentation models and DICOM inputs are
not exported yet (one line says so).
"""

from __future__ import annotations

from fedmed.core.errors import FedmedError

import json
from pathlib import Path

__all__ = ["BundleExportError", "export_bundle"]


class BundleExportError(FedmedError, ValueError):
    """A model this exporter cannot write as a bundle; the message says why."""


# the bundle's own image reader: kept equal to fedmed.data.images.decode_image for PNG/JPEG/TIFF (tests/test_bundle.py
# compares them on 8-bit grayscale, colour and 16-bit images)
_READER = '''"""Image reading as the fedmed run that made this bundle trained: one file -> float32 (C, H, W) in [0, 1].

8-bit images / 255 (colour to grayscale by PIL's ITU-R 601-2 luma, grayscale repeated to RGB); 16-bit, 32-bit integer and
float images scaled by their own range; bilinear resize to the training size. Needs numpy and PIL only.
"""

import numpy as np
import torch
from PIL import Image

WIDE_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I", "F")


def read(path, image_size, channels):
    size = (int(image_size), int(image_size))
    with Image.open(str(path)) as im:
        if im.mode in WIDE_MODES:
            a = np.asarray(im, dtype=np.float64)
            if a.ndim == 3:
                a = a.mean(axis=2)
            lo, hi = float(a.min()), float(a.max())
            a = (a - lo) / (hi - lo) if hi > lo else np.zeros_like(a)
            arr = np.clip(np.asarray(Image.fromarray(a.astype(np.float32), mode="F").resize(size, Image.BILINEAR),
                                     dtype=np.float32), 0.0, 1.0)
            if int(channels) != 1:
                arr = np.repeat(arr[..., None], 3, axis=2)
        else:
            arr = np.asarray(im.convert("L" if int(channels) == 1 else "RGB").resize(size, Image.BILINEAR),
                             dtype=np.float32) / 255.0
    arr = arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1)
    return torch.from_numpy(np.ascontiguousarray(arr))


def load(image_size, channels):
    """A MONAI dictionary transform's function: {"image": path} -> {"image": tensor, "filename": path}."""
    def f(d):
        return {**d, "image": read(d["image"], image_size, channels), "filename": str(d["image"])}
    return f


def predict(network, preprocessing, inferer, postprocessing, images, classes, output_dir, device, threshold=None):
    """Every image through preprocessing, the inferer and postprocessing; predictions.csv in output_dir. A binary
    model's class is 1 where its class-1 probability reaches ``threshold`` (chosen on validation data), else the most
    probable class."""
    import csv
    import os

    os.makedirs(output_dir, exist_ok=True)
    rows = []
    with torch.no_grad():
        for f in images:
            d = preprocessing({"image": f})
            x = torch.as_tensor(d["image"])[None].to(device)
            d["pred"] = inferer(x, network)[0]
            d = postprocessing(d)
            p = torch.as_tensor(d["pred"]).float().cpu().numpy()
            c = int(p[1] >= threshold) if threshold is not None and len(p) == 2 else int(p.argmax())
            rows.append([d["filename"], classes[c]] + [f"{v:.6f}" for v in p])
    with open(os.path.join(output_dir, "predictions.csv"), "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["image", "prediction"] + list(classes))
        w.writerows(rows)
    return rows
'''


def _network_def(ck, *, spatial_dims: int, in_channels: int, n_out: int) -> tuple[dict | str, bool]:
    """``(network_def, uses model.pt)``: the MONAI network with its arguments, or the TorchScript file."""
    from fedmed.core.schema import ModelSection
    from fedmed.nn.models import BUILTIN_ARCHS, PRETRAINED_ARCHS

    m = ModelSection.model_validate(ck["model"])
    if ck["task"] == "segmentation" and m.arch in ("unet", "resnet9", "resnet18", "vit_small"):
        # fedmed's 3D U-Net (fedmed.nn.seg.seg_model) is MONAI's UNet with these arguments
        ch = [int(c) for c in m.channels]
        return {"_target_": "monai.networks.nets.UNet", "spatial_dims": 3, "in_channels": in_channels,
                "out_channels": n_out, "channels": ch, "strides": [2] * (len(ch) - 1), "num_res_units": 1}, True
    torchscript = "$torch.jit.load(@bundle_root + '/models/model.ts', map_location='cpu')"
    if m.arch in BUILTIN_ARCHS or m.arch in PRETRAINED_ARCHS or ":" in m.arch:
        return torchscript, False  # fedmed's own or a user's network: no MONAI import (~9 s) to learn that
    import monai.networks.nets as nets

    if hasattr(nets, m.arch):
        import inspect

        params = inspect.signature(getattr(nets, m.arch)).parameters
        d = {"_target_": f"monai.networks.nets.{m.arch}", **dict(m.args)}
        for key, value in (("spatial_dims", spatial_dims), ("in_channels", in_channels),
                           ("out_channels", n_out), ("num_classes", n_out)):
            if key in params and key not in d:
                d[key] = value
        if "pretrained" in params:
            d["pretrained"] = False  # the bundle's weights are model.pt; nothing is downloaded
        return d, True
    return torchscript, False


def _dict_steps(steps: list) -> list:
    """``model.preprocessing`` as MONAI dictionary transforms on the image."""
    return [{"_target_": f"{st['name']}d", "keys": "image", **dict(st.get("args") or {})} for st in steps]


def _torchscript(net, example):
    import torch

    try:
        return torch.jit.script(net), "scripted"
    except Exception:
        try:
            return torch.jit.trace(net, example, check_trace=False), "traced"
        except Exception:
            return None, ""


def _write_network(net, ck, ck_path: Path, out: Path, example, *, spatial_dims: int, in_channels: int, n_out: int,
                   script: str, source: str) -> tuple[dict | str, bool, str]:
    """The bundle's folders, ``models/model.pt``, ``models/model.ts`` (where the network scripts or traces) and its
    reading script (``scripts/<script>.py``); returns ``(network_def, uses model.pt, how it became TorchScript)``."""
    import torch

    net = net.cpu().eval()
    net._forward_pre_hooks.clear()  # model.preprocessing is the bundle's preprocessing, not the network's
    ts, how = _torchscript(net, example)
    network_def, uses_pt = _network_def(ck, spatial_dims=spatial_dims, in_channels=in_channels, n_out=n_out)
    if not uses_pt and ts is None:
        raise BundleExportError(f"{ck_path.name}: model.arch {ck['model'].get('arch')} is not a MONAI network and "
                                f"neither scripts nor traces to TorchScript; no bundle can rebuild it without fedmed")
    for sub in ("configs", "models", "scripts", "docs"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    torch.save(net.state_dict(), out / "models" / "model.pt")
    if ts is not None:
        ts.save(str(out / "models" / "model.ts"))
    (out / "scripts" / "__init__.py").write_text("")
    (out / "scripts" / f"{script}.py").write_text(source)
    return network_def, uses_pt, how


def _write_configs(out: Path, inference: dict, uses_pt: bool, meta: dict, readme: str) -> None:
    """``configs/inference.json`` (loading ``model.pt`` into ``network_def`` when it is a MONAI network),
    ``configs/metadata.json`` and ``docs/README.md`` (its how-to-run line added)."""
    if uses_pt:
        inference["load_weights"] = ("$@network.load_state_dict(torch.load(@bundle_root + '/models/model.pt', "
                                     "map_location=@device, weights_only=True))")
        inference["initialize"] = ["$@load_weights"]
    (out / "configs" / "inference.json").write_text(json.dumps(inference, indent=2))
    (out / "configs" / "metadata.json").write_text(json.dumps(meta, indent=2, default=str))
    (out / "docs" / "README.md").write_text(
        readme + "\n\n```bash\npython -m monai.bundle run --config_file configs/inference.json --meta_file "
        "configs/metadata.json --bundle_root . --dataset_dir INPUTS --output_dir OUT\n```\n")


def _cls_inference(network_def: dict, size: int, ch: int, classes: list, pre, ck: dict) -> dict:
    """A classifier bundle's ``configs/inference.json``: the bundle's own image reader, fedmed's input scaling or the
    sites' preprocessing, softmax, and the decision threshold chosen on validation data (None: argmax)."""
    return {
        "imports": ["$import glob", "$import importlib", "$import os", "$import torch"],
        "bundle_root": ".",
        # the bundle's own reader (scripts/; monai.bundle run puts the bundle's folder on the path before "run")
        "reader": "$importlib.import_module('scripts.fedmed_image')",
        "device": "$torch.device('cuda' if torch.cuda.is_available() else 'cpu')",
        "dataset_dir": "$@bundle_root + '/sample'",
        "output_dir": "$@bundle_root + '/eval'",
        "images": "$sorted(f for f in glob.glob(os.path.join(@dataset_dir, '*')) if os.path.isfile(f))",
        "image_size": size,
        "channels": ch,
        "classes": classes,
        "network_def": network_def,
        "network": "$@network_def.to(@device).eval()",
        "preprocessing": {"_target_": "Compose", "transforms": [
            {"_target_": "Lambda", "func": "$@reader.load(@image_size, @channels)"},
            {"_target_": "EnsureTyped", "keys": "image", "dtype": "$torch.float32"}] + (
            # fedmed's input scaling (fedmed.nn.train): [0, 1] -> [-1, 1]
            [{"_target_": "NormalizeIntensityd", "keys": "image", "subtrahend": 0.5, "divisor": 0.5}] if pre is None
            else _dict_steps(pre))},  # the sites' model.preprocessing (a bundle's) on the [0, 1] image instead
        "inferer": {"_target_": "SimpleInferer"},
        "postprocessing": {"_target_": "Compose", "transforms": [
            {"_target_": "Activationsd", "keys": "pred", "softmax": True}]},
        "threshold": (ck.get("decision") or {}).get("threshold"),  # chosen on validation data (None: argmax)
        "run": ["$@reader.predict(@network, @preprocessing, @inferer, @postprocessing, @images, @classes, "
                "@output_dir, @device, @threshold)"],
    }


def export_bundle(checkpoint, out_dir=None, *, description: str = "", policy=None) -> Path:
    """Write the bundle of a fedmed classifier or 3D segmentation checkpoint (default: ``<checkpoint stem>_bundle/``
    beside it).

    ``policy``: the :class:`~fedmed.core.policy.SitePolicy` deciding which network module may be imported (default:
    this machine's, as :func:`fedmed.nn.predict.load_model`).

    Raises:
        BundleExportError: neither a classifier nor a 3D segmentation model, or a network that is neither a MONAI
            network nor scriptable/traceable.
        fedmed.nn.predict.ModelFileError: not a fedmed checkpoint.
    """
    import torch

    from fedmed.nn.predict import load_model

    ck_path = Path(checkpoint)
    net, ck = load_model(ck_path, policy=policy)
    out = Path(out_dir) if out_dir is not None else ck_path.with_name(f"{ck_path.stem}_bundle")
    if ck["task"] == "segmentation":
        return _export_seg3d(net, ck, ck_path, out, description)
    if ck["task"] != "classification":
        raise BundleExportError(f"{ck_path.name}: a {ck['task']} model; the bundle export writes classifiers and 3D "
                                f"segmentation models")
    d = ck["data"]
    size, ch, n = int(d["image_size"]), int(d["channels"]), int(d["n_classes"])
    classes = list(ck.get("classes") or [str(c) for c in range(n)])
    pre = ck["model"].get("preprocessing")
    _check_literal(ck_path, classes=classes, model=ck["model"], data=ck["data"], sites=ck.get("sites"),
                   workflow=ck.get("workflow"), cluster=ck.get("cluster"), description=description)
    network_def, uses_pt, how = _write_network(net, ck, ck_path, out, torch.zeros(1, ch, size, size), spatial_dims=2,
                                               in_channels=ch, n_out=n, script="fedmed_image", source=_READER)
    inference = _cls_inference(network_def, size, ch, classes, pre, ck)
    served = _served(ck)
    meta = {
        **_meta_header({"pillow": __import__("PIL").__version__}),
        "name": f"fedmed {ck.get('workflow') or 'federated'} classifier ({served})",
        "task": f"{n}-class image classification",
        "description": description or (f"A {ck['model'].get('arch')} trained with fedmed ({ck.get('workflow')}, "
                                       f"{ck.get('rounds')} rounds) for {', '.join(classes)}."),
        "authors": "fedmed",
        "copyright": "the federation that trained it",
        "network_data_format": {
            "inputs": {"image": {"type": "image", "format": "magnitude", "modality": "image file",
                                 "num_channels": ch, "spatial_shape": [size, size], "dtype": "float32",
                                 "value_range": [-1, 1] if pre is None else [], "is_patch_data": False,
                                 "channel_def": ({"0": "grayscale"} if ch == 1 else
                                                 {"0": "red", "1": "green", "2": "blue"})}},
            "outputs": {"pred": {"type": "probabilities", "format": "classes", "num_channels": n,
                                 "spatial_shape": [n], "dtype": "float32", "value_range": [0, 1],
                                 "is_onehot": False, "channel_def": {str(i): c for i, c in enumerate(classes)}}}},
        "fedmed": _fedmed_meta(ck, how, uses_pt),
    }
    scaled = ("then scaled to [-1, 1] as fedmed feeds its networks" if pre is None else
              "then through the preprocessing the sites applied (" + ", ".join(st["name"] for st in pre) + ")")
    _write_configs(out, inference, uses_pt, meta, readme=(
        f"# {meta['name']}\n\n{meta['description']}\n\nServes: "
        f"{'sites ' + ', '.join(ck['sites']) if ck.get('sites') else served}.\n\n"
        f"Input: an image file (PNG/JPEG/TIFF), read as in training (scripts/fedmed_image.py) to {ch} x {size} x "
        f"{size} in [0, 1], {scaled}. Output: OUT/predictions.csv, the probabilities of {', '.join(classes)}."))
    return out


def _live_strings(value, at: str = ""):
    """``(where, string)`` for every string (or key) of ``value`` that MONAI's config parser would act on: a ``$``
    expression, an ``@`` reference or a ``%`` macro."""
    if isinstance(value, str):
        if value.startswith(("$", "@", "%")):
            yield at, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _live_strings(k, f"{at}.{k}" if at else str(k))
            yield from _live_strings(v, f"{at}.{k}" if at else str(k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _live_strings(v, f"{at}[{i}]")


def _check_literal(ck_path: Path, **job_values) -> None:
    """Every string of the job (class and modality names, the model's arguments and preprocessing, site names, the
    description) goes into the bundle's configs, which ``monai.bundle run`` parses as code: one that MONAI would
    evaluate, follow or expand (``$``, ``@``, ``%`` at its start) is refused before anything is written."""
    for at, v in _live_strings(job_values):
        raise BundleExportError(f"{ck_path.name}: {at} = {v[:40]!r} would be a live expression, reference or macro in "
                                f"the bundle's configs (a string starting with $, @ or %); no bundle written")


def _served(ck) -> str:
    return f"cluster {ck['cluster']}" if ck.get("cluster") is not None else "the federation's global model"


def _meta_header(optional_packages: dict) -> dict:
    from importlib.metadata import version

    import numpy
    import torch

    return {"schema": "https://github.com/Project-MONAI/MONAI-extra-test-data/releases/download/0.8.1/"
                      "meta_schema_20220324.json",
            "version": "0.1.0", "changelog": {"0.1.0": "exported by fedmed"},
            "monai_version": version("monai"),  # MONAI's own import takes ~9 s here, at the end of every run
            "pytorch_version": torch.__version__.split("+")[0], "numpy_version": numpy.__version__,
            "optional_packages_version": optional_packages}


def _fedmed_meta(ck, how: str, uses_pt: bool) -> dict:
    return {"format": ck.get("format"), "task": ck.get("task"), "workflow": ck.get("workflow"),
            "rounds": ck.get("rounds"), "seed": ck.get("seed"), "cluster": ck.get("cluster"), "sites": ck.get("sites"),
            "model": ck.get("model"), "data": ck.get("data"), "torchscript": how or None,
            "network_def": "monai" if uses_pt else "torchscript"}


# the bundle's own case reading and writing for a 3D segmentation model: kept equal to fedmed.nn.predict.predict_volume
# (tests/test_bundle.py compares the label maps voxel for voxel)
_VOLUME = '''"""Brain-tumour cases as the fedmed run that made this bundle trained and predicts (fedmed.nn.predict.predict_volume).

A case is a folder with one NIfTI file per modality (found by its pattern, case-insensitive) and optionally a brain
mask. Each case is cropped to the brain mask (else the first modality's non-zero voxels), resampled (trilinear) to the
model's grid, segmented with the bundle's inferer (sliding windows), the whole tumour kept to its largest 26-connected
component with TC and ET inside it, resampled back (nearest-exact) and written as BraTS labels (4 = ET, 1 = TC without
ET, 2 = WT without TC) on the first modality's grid and affine: <case>_seg.nii.gz. Needs numpy, scipy and nibabel.
"""

import fnmatch
import os

import numpy as np
import torch


def _resize(a, shape, mode):
    t = torch.from_numpy(np.ascontiguousarray(a))[None][None]
    kw = {"align_corners": False} if mode == "trilinear" else {}
    return torch.nn.functional.interpolate(t.float(), size=tuple(shape), mode=mode, **kw)[0].numpy()


def _find(folder, pattern, what):
    hits = sorted(f for f in os.listdir(folder) if fnmatch.fnmatchcase(f.lower(), pattern.lower())
                  and (f.lower().endswith(".nii") or f.lower().endswith(".nii.gz")))
    if len(hits) != 1:
        raise ValueError(f"case {os.path.basename(folder)}: {len(hits)} NIfTI files match the {what} pattern "
                         f"{pattern!r} (one is needed; set it with --modality_patterns / --mask_pattern)")
    return os.path.join(folder, hits[0])


def cases(dataset_dir, modalities, patterns, mask_pattern):
    """dataset_dir: one case folder, or a folder of case folders -> [{"case", "image": [files], "mask": file | None}]."""
    def is_case(d):
        names = [f.lower() for f in os.listdir(d)]
        return any(fnmatch.fnmatchcase(n, patterns[modalities[0]].lower()) for n in names)

    root = str(dataset_dir)
    folders = [root] if is_case(root) else sorted(
        os.path.join(root, d) for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    out = []
    for f in folders:
        mask = None
        if mask_pattern and any(fnmatch.fnmatchcase(n.lower(), mask_pattern.lower()) for n in os.listdir(f)):
            mask = _find(f, mask_pattern, "mask")
        out.append({"case": os.path.basename(os.path.normpath(f)),
                    "image": [_find(f, patterns[m], m) for m in modalities], "mask": mask})
    return out


def load(shape):
    """A MONAI dictionary transform's function: a case -> its cropped, resampled (C, D, H, W) image and the crop."""
    import nibabel as nib

    def f(d):
        imgs = [nib.load(p) for p in d["image"]]
        vols = [np.asarray(i.dataobj, dtype=np.float32) for i in imgs]
        fg = (np.asarray(nib.load(d["mask"]).dataobj) > 0) if d.get("mask") else vols[0] != 0
        if not fg.any():
            raise ValueError(f"case {d['case']}: empty foreground, nothing to segment")
        idx = np.argwhere(fg)
        lo, hi = idx.min(0), idx.max(0) + 1
        sl = tuple(slice(int(a), int(b)) for a, b in zip(lo, hi))
        x = np.stack([_resize(v[sl], shape, "trilinear")[0] for v in vols]).astype(np.float32)
        return {**d, "image": torch.from_numpy(x), "crop": (lo.tolist(), hi.tolist()), "grid": vols[0].shape,
                "affine": imgs[0].affine}
    return f


def largest_component(masks):
    from scipy import ndimage

    wt = masks[0] > 0
    lab, n = ndimage.label(wt, structure=np.ones((3, 3, 3)))
    if n <= 1:
        return masks
    sizes = ndimage.sum_labels(wt, lab, index=np.arange(1, n + 1))
    keep = lab == 1 + int(np.argmax(sizes))
    return (masks * keep[None]).astype(masks.dtype)


def predict(network, preprocessing, inferer, postprocessing, cases, output_dir, device):
    """Every case through preprocessing, the inferer and postprocessing; <case>_seg.nii.gz in output_dir."""
    import nibabel as nib

    os.makedirs(output_dir, exist_ok=True)
    written = []
    with torch.no_grad():
        for c in cases:
            d = preprocessing(c)
            x = torch.as_tensor(d["image"])[None].to(device)
            d["pred"] = inferer(x, network)[0].cpu()
            d = postprocessing(d)
            masks = largest_component(torch.as_tensor(d["pred"]).numpy().astype(np.uint8))
            (lo, hi) = d["crop"]
            size = tuple(int(b) - int(a) for a, b in zip(lo, hi))
            crop = [_resize(m.astype(np.float32), size, "nearest-exact")[0] > 0.5 for m in masks]
            region = np.zeros(size, np.uint8)
            region[crop[0]] = 2
            region[crop[1]] = 1
            region[crop[2]] = 4
            lab = np.zeros(d["grid"], np.uint8)
            lab[tuple(slice(int(a), int(b)) for a, b in zip(lo, hi))] = region
            f = os.path.join(output_dir, f"{d['case']}_seg.nii.gz")
            nib.save(nib.Nifti1Image(lab, d["affine"]), f)
            written.append(f)
    return written
'''


def _export_seg3d(net, ck, ck_path: Path, out: Path, description: str) -> Path:
    """The bundle of a 3D brain-tumour segmentation model: its case reading, sliding-window inference and label map
    writing as :func:`fedmed.nn.predict.predict_volume`."""
    import torch

    d = ck["data"]
    c, shape, roi = int(d["in_channels"]), [int(v) for v in d["shape"]], [int(v) for v in d["roi"]]
    mods = list(d.get("modalities") or [f"ch{i}" for i in range(c)])
    pre = ck["model"].get("preprocessing")
    _check_literal(ck_path, modalities=mods, model=ck["model"], data=ck["data"], sites=ck.get("sites"),
                   workflow=ck.get("workflow"), cluster=ck.get("cluster"), description=description)
    network_def, uses_pt, how = _write_network(net, ck, ck_path, out, torch.zeros(1, c, *roi), spatial_dims=3,
                                               in_channels=c, n_out=3, script="fedmed_volume", source=_VOLUME)
    inference = {
        "imports": ["$import importlib", "$import torch"],
        "bundle_root": ".",
        "reader": "$importlib.import_module('scripts.fedmed_volume')",
        "device": "$torch.device('cuda' if torch.cuda.is_available() else 'cpu')",
        "dataset_dir": "$@bundle_root + '/sample'",
        "output_dir": "$@bundle_root + '/eval'",
        "modalities": mods,
        # each modality's file in a case folder (fnmatch, case-insensitive); the training data's own names may differ
        "modality_patterns": {m: f"{m}*" for m in mods},
        "mask_pattern": "brainmask*",
        "shape": shape,
        "cases": "$@reader.cases(@dataset_dir, @modalities, @modality_patterns, @mask_pattern)",
        "network_def": network_def,
        "network": "$@network_def.to(@device).eval()",
        "preprocessing": {"_target_": "Compose", "transforms": [
            {"_target_": "Lambda", "func": "$@reader.load(@shape)"}] + _dict_steps(pre or [])},
        "inferer": {"_target_": "SlidingWindowInferer", "roi_size": roi, "sw_batch_size": 4, "overlap": 0.25},
        "postprocessing": {"_target_": "Compose", "transforms": [
            {"_target_": "Activationsd", "keys": "pred", "sigmoid": True},
            {"_target_": "AsDiscreted", "keys": "pred", "threshold": 0.5}]},
        "run": ["$@reader.predict(@network, @preprocessing, @inferer, @postprocessing, @cases, @output_dir, @device)"],
    }
    served = _served(ck)
    regions = {"0": "whole tumour (WT: labels 1, 2, 3, 4)", "1": "tumour core (TC: 1, 3, 4)",
               "2": "enhancing tumour (ET: 4)"}
    meta = {
        **_meta_header({"nibabel": __import__("nibabel").__version__, "scipy": __import__("scipy").__version__}),
        "name": f"fedmed {ck.get('workflow') or 'federated'} brain-tumour segmenter ({served})",
        "task": "3D brain-tumour segmentation (WT, TC, ET)",
        "description": description or (f"A 3D {ck['model'].get('arch')} trained with fedmed ({ck.get('workflow')}, "
                                       f"{ck.get('rounds')} rounds) on {', '.join(mods)}."),
        "authors": "fedmed",
        "copyright": "the federation that trained it",
        "network_data_format": {
            "inputs": {"image": {"type": "image", "format": "magnitude", "modality": "MR", "num_channels": c,
                                 "spatial_shape": roi, "dtype": "float32", "value_range": [],
                                 "is_patch_data": True, "channel_def": {str(i): m for i, m in enumerate(mods)}}},
            "outputs": {"pred": {"type": "image", "format": "segmentation", "num_channels": 3,
                                 "spatial_shape": roi, "dtype": "float32", "value_range": [0, 1],
                                 "is_patch_data": True, "channel_def": regions}}},
        "fedmed": {**_fedmed_meta(ck, how, uses_pt), "grid": shape},
    }
    _write_configs(out, inference, uses_pt, meta, readme=(
        f"# {meta['name']}\n\n{meta['description']}\n\nServes: "
        f"{'sites ' + ', '.join(ck['sites']) if ck.get('sites') else served}.\n\n"
        f"Input: a case folder (or a folder of case folders) with one NIfTI file per modality ({', '.join(mods)}; "
        f"found by `modality_patterns`) and optionally a brain mask (`mask_pattern`). Each case is cropped to its "
        f"brain, resampled to {'x'.join(map(str, shape))}"
        + ("" if pre is None else " and put through the preprocessing the sites applied ("
           + ", ".join(st["name"] for st in pre) + ")")
        + f" and segmented in {'x'.join(map(str, roi))} sliding windows, as fedmed trained and predicts "
        f"(scripts/fedmed_volume.py). Output: OUT/<case>_seg.nii.gz, BraTS labels (4 = ET, 1 = TC without ET, "
        f"2 = WT without TC) on the first modality's grid."))
    return out
