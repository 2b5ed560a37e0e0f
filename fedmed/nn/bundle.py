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
import os
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
    inference = {
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


# --------------------------------------------------------------------------------------------- a bundle brought in

# a bundle's loss (its train.json "loss") -> fedmed's segmentation loss (train.seg.loss); classification trains with
# cross-entropy
_SEG_LOSSES = {"DiceFocalLoss": "dice_focal", "DiceLoss": "dice", "DiceCELoss": "dice_bce"}
_CLS_LOSSES = ("CrossEntropyLoss",)


def read_bundle(path) -> dict:
    """What fedmed takes from a MONAI bundle folder (``model.bundle``): its network (``network_def`` of
    ``configs/inference.json``, else ``configs/train.json``: a network of ``monai.networks.nets`` with its arguments),
    its weights (``models/model.pt``, when there: a state dict), the inputs and outputs its ``configs/metadata.json``
    declares, and the loss of its ``train.json``.

    A bundle is read as **data**: its files are parsed as JSON (or YAML without tags) and nothing in them is ever
    evaluated. A value fedmed reads may be a plain value or an ``@id`` reference to one; a ``$`` expression, a ``%``
    macro or a reference that leads to one is refused in one line naming the key, before anything runs. Every file
    fedmed reads is a regular file inside the bundle folder (no symbolic link), and ``models/model.pt`` must load as
    a state dict (``weights_only``) before it is shipped to any party.

    Returns ``{"arch", "args", "init_weights", "inputs", "outputs", "loss", "name", "preprocessing"}``.

    Raises:
        BundleExportError: one line naming the bundle and what does not fit (no configs, a network that is not a
            MONAI network fedmed can name, an expression or macro, a file outside the bundle, weights that are no
            state dict, a loss fedmed cannot drive, anything else that does not read).
    """
    try:
        return _read_bundle(path)
    except BundleExportError:
        raise
    except Exception as e:  # a bundle of an unexpected shape (a section that is not a mapping, ...): one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise BundleExportError(f"model.bundle {Path(path).name}: cannot be read as a MONAI bundle "
                                f"({type(e).__name__}: {first:.120})") from None


def _read_bundle(path) -> dict:
    root = Path(path)
    where = f"model.bundle {root.name}"
    if not root.is_dir():
        raise BundleExportError(f"model.bundle {root.name}: no such bundle folder")
    configs = [root / "configs" / f for f in ("inference.json", "train.json", "inference.yaml", "train.yaml")]
    found = [c for c in configs if c.is_file() or c.is_symlink()]
    meta_file = root / "configs" / "metadata.json"
    if not found or not (meta_file.is_file() or meta_file.is_symlink()):
        if (root / "configs").is_symlink():
            raise BundleExportError(f"{where}: configs is a symbolic link; a bundle's files must be regular files "
                                    f"inside its folder")
        raise BundleExportError(f"{where}: a MONAI bundle has configs/metadata.json and configs/inference.json (or "
                                f"train.json); found {sorted(p.name for p in (root / 'configs').glob('*'))}"
                                if (root / "configs").is_dir() else f"{where}: no configs/ folder (not a MONAI bundle)")
    meta = _bundle_data(root, meta_file, where)
    if not isinstance(meta, dict):
        raise BundleExportError(f"{where}: configs/metadata.json is not a JSON object")
    parsers = []
    for c in found:
        cfg = _bundle_data(root, c, where)
        if not isinstance(cfg, dict):
            raise BundleExportError(f"{where}: configs/{c.name} is not a mapping of ids to values")
        parsers.append((c.name, cfg))
    file, cfg = next(((f, p) for f, p in parsers if "network_def" in p), (None, None))
    if cfg is None:
        raise BundleExportError(f"{where}: no network_def in {', '.join(c.name for c in found)}")
    own = meta.get("fedmed") if isinstance(meta.get("fedmed"), dict) else {}
    if own.get("network_def") == "torchscript" and isinstance(own.get("model"), dict):
        raise BundleExportError(_own_export_line(root, where, own["model"]))
    net_cfg = _plain(cfg, cfg["network_def"], "network_def", f"{where} ({file})")
    target = net_cfg.get("_target_") if isinstance(net_cfg, dict) else None
    import monai.networks.nets as nets

    name = str(target or "").split(".")[-1]
    if not target or not (str(target).startswith("monai.networks.nets.") or "." not in str(target)) \
            or not hasattr(nets, name):
        raise BundleExportError(f"{where}: its network_def ({target or net_cfg!r:.80}) is not a network of "
                                f"monai.networks.nets, which fedmed's sites build by name (a bundle's own network "
                                f"code is not run)")
    args = {k: v for k, v in net_cfg.items() if not k.startswith("_")}
    weights = root / "models" / "model.pt"
    init = None
    if os.path.lexists(weights) or (root / "models").is_symlink():  # there in any form: it must be the weights
        _inside(root, weights, where)
        _check_state_dict(weights, where)
        init = str(weights)
    loss = None
    train = dict(parsers).get("train.json")
    if train is not None and isinstance(train.get("loss"), (dict, str)):
        lc = _plain(train, train["loss"], "loss", f"{where} (train.json)")
        if isinstance(lc, dict):
            loss = str(lc.get("_target_", "")).split(".")[-1]
    fmt = meta.get("network_data_format") or {}
    if not isinstance(fmt, dict) or not all(isinstance(fmt.get(k, {}), dict) for k in ("inputs", "outputs")):
        raise BundleExportError(f"{where}: configs/metadata.json's network_data_format should map inputs and outputs "
                                f"to their descriptions")
    steps = _preprocessing(parsers, where)
    return {"name": str(meta.get("name") or root.name), "arch": name, "args": args,
            "init_weights": init, "inputs": fmt.get("inputs") or {}, "outputs": fmt.get("outputs") or {},
            "loss": loss, "preprocessing": steps}


def _own_export_line(root: Path, where: str, model: dict) -> str:
    """The refusal of a bundle fedmed itself exported with its network as TorchScript (fedmed's own networks, which no
    MONAI ``network_def`` names), with the settings that train from its weights instead."""
    from fedmed.core.schema import ModelSection

    default = ModelSection.model_validate({"arch": model.get("arch", "resnet9")}).model_dump()
    keys = [k for k, v in model.items() if k not in ("init_weights", "bundle", "preprocessing") and
            (k == "arch" or v != default.get(k))]
    sets = " ".join(f"--set model.{k}={json.dumps(model[k]) if not isinstance(model[k], str) else model[k]}"
                    for k in keys)
    return (f"{where}: a bundle fedmed exported, its network fedmed's own as TorchScript, which a site does not "
            f"train from; start from its weights instead: --set model.bundle=null {sets} "
            f"--set model.init_weights={root / 'models' / 'model.pt'}")


def _inside(root: Path, f: Path, where: str) -> None:
    """``f`` is a regular file of the bundle folder: no symbolic link on its way, nothing outside ``root``."""
    rel = f.relative_to(root)
    p = root
    for part in rel.parts:
        p = p / part
        if p.is_symlink():
            raise BundleExportError(f"{where}: {rel.as_posix()} is a symbolic link; a bundle's files must be regular "
                                    f"files inside its folder")
    if not f.is_file():
        raise BundleExportError(f"{where}: {rel.as_posix()} is not a regular file")


def _bundle_data(root: Path, f: Path, where: str):
    """A bundle's config file as plain data: JSON, or YAML without tags (nothing constructed, nothing evaluated)."""
    _inside(root, f, where)
    text = f.read_text()
    try:
        if f.suffix == ".json":
            return json.loads(text)
        import yaml

        return yaml.safe_load(text)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise BundleExportError(f"{where}: configs/{f.name} does not parse ({type(e).__name__}: {first:.120})") \
            from None


def _check_state_dict(f: Path, where: str) -> None:
    """``models/model.pt`` loads as a state dict (string keys, tensors; ``weights_only``: no pickle runs)."""
    from fedmed.nn.encoders import EncoderError, check_weights_file

    try:
        check_weights_file(f, where, shown="models/model.pt")
    except EncoderError as e:
        raise BundleExportError(str(e)) from None


# MONAI's id separators: "::" (and the older "#")
_ID_SEP = ("::", "#")


def _id_parts(ref: str) -> list[str]:
    return [p for p in ref.replace("#", "::").split("::")]


def _plain(cfg: dict, value, key: str, where: str, *, _seen: tuple = ()):
    """``value`` (at ``key`` of the bundle config ``cfg``) as plain data: ``@id`` references to plain values
    resolved, anything MONAI would evaluate refused (a component's ``_target_`` stays a name; nothing is built)."""
    if isinstance(value, str):
        if value.startswith("$"):
            raise BundleExportError(f"{where}: {key} is a Python expression ({value:.60}); fedmed reads a bundle as "
                                    f"data and evaluates nothing: give a plain value")
        if value.startswith("%"):
            raise BundleExportError(f"{where}: {key} is a macro ({value:.60}); fedmed reads a bundle as data and "
                                    f"expands no macro: give a plain value")
        if value.startswith("@"):
            ref = value[1:]
            if not ref or ref.startswith(_ID_SEP):
                raise BundleExportError(f"{where}: {key} is a relative reference ({value:.60}); fedmed resolves "
                                        f"only whole-id references (@id) to plain values")
            if ref in _seen:
                raise BundleExportError(f"{where}: {key} refers to itself through @{ref}")
            node = cfg
            for part in _id_parts(ref):
                if isinstance(node, dict) and part in node:
                    node = node[part]
                elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                    node = node[int(part)]
                else:
                    raise BundleExportError(f"{where}: {key} refers to @{ref:.60}, which the bundle does not define")
            return _plain(cfg, node, f"{key} (@{ref})", where, _seen=_seen + (ref,))
        return value
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise BundleExportError(f"{where}: {key} has a key {k!r} that is not a string")
            out[k] = _plain(cfg, v, f"{key}#{k}", where, _seen=_seen)
        return out
    if isinstance(value, (list, tuple)):
        return [_plain(cfg, v, f"{key}#{i}", where, _seen=_seen)
                for i, v in enumerate(value)]
    if value is None or isinstance(value, (bool, int, float)):
        return value
    raise BundleExportError(f"{where}: {key} is a {type(value).__name__}, not a plain value")


# a bundle's preprocessing steps that fedmed's own reading does (loading, channels first, types, resizing to the
# federation's size, orientation, spacing, the brain crop): not applied a second time
_READ_BY_FEDMED = ("LoadImage", "EnsureChannelFirst", "AddChannel", "AsChannelFirst", "EnsureType", "ToTensor",
                   "CastToType", "Resize", "Orientation", "Spacing", "CropForeground", "Identity", "ToDevice",
                   "SqueezeDim", "RepeatChannel")
# arguments of a dictionary transform that say which keys, not what it does to the image
_KEY_ARGS = ("keys", "allow_missing_keys", "dtype", "meta_keys", "meta_key_postfix")


def _preprocessing(parsers: list, where: str) -> list | None:
    """``model.preprocessing`` from the bundle's ``preprocessing`` (``inference.json``; else ``validate#preprocessing``
    of ``train.json``; ``parsers``: ``[(file name, its data)]``): its intensity transforms
    (``fedmed.core.schema.INPUT_TRANSFORMS``) on the image, with their arguments as plain values (:func:`_plain`);
    the steps fedmed's own reading does (:data:`_READ_BY_FEDMED`) and steps on other keys left out. None: no
    preprocessing."""
    from fedmed.core.schema import INPUT_TRANSFORMS

    for file, p in parsers:
        w = f"{where} ({file})"
        for key in ("preprocessing", "validate#preprocessing"):
            node = p
            for part in _id_parts(key):
                node = node.get(part) if isinstance(node, dict) else None
                if isinstance(node, str):  # a reference (or an expression: refused, naming the key)
                    node = _plain(p, node, key, w)
            if isinstance(node, dict) and "transforms" in node:
                transforms = node["transforms"]
                if isinstance(transforms, str):
                    transforms = _plain(p, transforms, f"{key}#transforms", w)
                if not isinstance(transforms, list):
                    raise BundleExportError(f"{w}: {key}#transforms should be a list of transforms, got "
                                            f"{transforms!r:.60}")
                break
        else:
            continue
        steps = []
        for i, t in enumerate(transforms):
            at = f"{key}#transforms#{i}"
            if isinstance(t, str) and t.startswith("@"):
                t = _plain(p, t, at, w)
            target = _plain(p, t.get("_target_"), f"{at}#_target_", w) if isinstance(t, dict) else None
            name = str(target or t).split(".")[-1]
            base = name[:-1] if name.endswith("d") and name[:-1] in INPUT_TRANSFORMS + _READ_BY_FEDMED else name
            if base in _READ_BY_FEDMED:
                continue
            if base not in INPUT_TRANSFORMS:
                raise BundleExportError(
                    f"{where}: its preprocessing step {name:.60} ({file}) is not one fedmed's sites apply: they read, "
                    f"resize and crop images themselves and apply the intensity transforms {', '.join(INPUT_TRANSFORMS)}")
            if name != base:  # a dictionary transform: only the image's counts (not a label's, a mask's)
                keys = _plain(p, t.get("keys"), f"{at}#keys", w)
                if "image" not in ([keys] if isinstance(keys, str) else list(keys or [])):
                    continue
            args = {}
            for k in t:
                if k.startswith("_") or k in _KEY_ARGS:
                    continue
                v = _plain(p, t[k], f"{at}#{k}", w)
                if isinstance(v, dict):
                    raise BundleExportError(f"{where}: its preprocessing step {name} has argument {k} = {v!r:.60}, "
                                            f"not a plain value the sites can rebuild it from")
                args[k] = v
            steps.append({"name": base, "args": args})
        return steps
    return None


def check_bundle_fits(b: dict, *, task: str, channels: int, size, n_out: int | None, where: str) -> str | None:
    """The first thing of a bundle (:func:`read_bundle`) that does not fit the federation's data, as one line; None when
    it fits. ``size``: the image size (2D) or ROI (3D) fedmed trains at; ``n_out``: classes, or the segmentation
    outputs (None: not known yet)."""
    def count(d: dict, side: str):  # a count metadata.json declares: a whole number, never an expression
        v = d.get("num_channels")
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise BundleExportError(f"{where}: configs/metadata.json's network_data_format.{side}.num_channels should "
                                    f"be a positive whole number, got {v!r:.60}")
        return v

    inputs = list(b["inputs"].items())
    outputs = list(b["outputs"].items())
    for side, items in (("inputs", inputs), ("outputs", outputs)):
        for name, d in items:
            if not isinstance(d, dict):
                raise BundleExportError(f"{where}: configs/metadata.json's network_data_format.{side}.{name} should "
                                        f"describe it (a mapping), got {d!r:.60}")
            count(d, f"{side}.{name}")
    inputs, outputs = [d for _, d in inputs], [d for _, d in outputs]
    if inputs:
        i = inputs[0]
        if i.get("num_channels") is not None and int(i["num_channels"]) != int(channels):
            return (f"{where}: its input has {i['num_channels']} channel(s) (metadata.json), the federation's images "
                    f"{channels}")
        shape = i.get("spatial_shape")
        if shape and all(isinstance(v, int) for v in shape) and list(shape) != list(size):
            return (f"{where}: its input is {'x'.join(map(str, shape))} (metadata.json), the federation trains at "
                    f"{'x'.join(map(str, size))}")
    if outputs and n_out is not None:
        o = outputs[0]
        if task == "classification" and o.get("format") not in (None, "classes"):
            return f"{where}: its output is '{o.get('format')}', not classes: a bundle of another task"
        if task == "segmentation" and o.get("format") == "classes":
            return f"{where}: its output is classes: a classification bundle, not a segmentation one"
        if o.get("num_channels") is not None and int(o["num_channels"]) != int(n_out):
            what = "classes" if task == "classification" else "output channels"
            return f"{where}: its output has {o['num_channels']} channel(s) (metadata.json), the federation {n_out} {what}"
    loss = b.get("loss")
    if loss:
        if task == "classification" and loss not in _CLS_LOSSES:
            return f"{where}: its loss {loss} is not one fedmed trains a classifier with (cross-entropy)"
        if task == "segmentation" and loss not in _SEG_LOSSES:
            return (f"{where}: its loss {loss} is not one fedmed drives (DiceLoss, DiceFocalLoss, DiceCELoss: "
                    f"train.seg.loss)")
    return None
