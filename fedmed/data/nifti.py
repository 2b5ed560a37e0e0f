"""NIfTI subjects as segmentation cases (``004_`` §3): reading, cropping, resampling, BraTS regions.

A segmentation datalist entry::

    {"image": ["/x/Flair.nii.gz", "/x/T1c.nii.gz"], "label": "/x/OTMultiClass.nii.gz",
     "mask": "/x/brainmask.nii.gz", "modalities": ["FLAIR", "T1c"], "region": "left", "id": "pat0001_L"}

``region`` (``whole``/``left``/``right``) lets one subject give two samples (its hemispheres):
with only six BraTS-2013 subjects this makes 12 samples to build federations from (a subject's
samples always stay together: :func:`fedmed.data.seg_federation.check_no_leakage`). Each case is cropped to
the brain-mask bounding box (the region's half of it), resampled to ``shape`` (trilinear image;
label map with ``nearest-exact``, which keeps it aligned with the trilinear image grid — plain
``nearest`` shifts it by about half a voxel) and its label map turned into the BraTS regions
WT = {1,2,3,4}, TC = {1,3,4}, ET = {4} (labels: 1 necrosis, 2 edema, 3 non-enhancing,
4 enhancing).

Every problem with a case raises :class:`~fedmed.data.images.DataError` naming the site and the file:
a non-NIfTI or unreadable file, a missing modality, image and label of different shapes, a
label map with unexpected labels.

"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from fedmed.data.images import DataError

__all__ = ["ALLOWED_LABELS", "REGIONS", "SegCase", "case_metadata", "load_case", "region_masks"]

REGIONS = {"WT": (1, 2, 3, 4), "TC": (1, 3, 4), "ET": (4,)}
ALLOWED_LABELS = (0, 1, 2, 3, 4)


def load_volume(path, site: str, what: str) -> tuple[np.ndarray, np.ndarray]:
    """A 3-D volume as ``(array (x, y, z) float32, affine voxel -> RAS mm)``: a NIfTI file, or a folder holding one
    DICOM series (read with SimpleITK/GDCM: slices sorted by position, spacing and orientation from the headers;
    SimpleITK's LPS affine turned into RAS as NIfTI's). No DICOM header value enters a message."""
    import nibabel as nib

    p = Path(path)
    if p.is_dir():
        return _load_dicom_series(p, site, what)
    if not p.is_file():
        raise DataError(f"{site}: {what} file {p} not found")
    if not (p.name.endswith(".nii") or p.name.endswith(".nii.gz")):
        raise DataError(f"{site}: {what} file {p} is not a NIfTI file (.nii or .nii.gz) or a DICOM series folder")
    try:
        img = nib.load(str(p))
        arr = np.asarray(img.dataobj, dtype=np.float32)
    except Exception as e:
        raise DataError(f"{site}: cannot read {what} file {p} ({type(e).__name__}: {e})") from None
    if arr.ndim != 3:
        raise DataError(f"{site}: {what} file {p} should be a 3-D volume, got shape {arr.shape}")
    return arr, np.asarray(img.affine, dtype=np.float64)


def _load_dicom_series(p: Path, site: str, what: str) -> tuple[np.ndarray, np.ndarray]:
    import SimpleITK as sitk

    reader = sitk.ImageSeriesReader()
    ids = reader.GetGDCMSeriesIDs(str(p))
    if not ids:
        raise DataError(f"{site}: {what} folder {p} holds no DICOM series")
    if len(ids) > 1:
        raise DataError(f"{site}: {what} folder {p} holds {len(ids)} DICOM series; one series per folder")
    files = reader.GetGDCMSeriesFileNames(str(p), ids[0])  # sorted along the slice normal
    if len(files) < 2:
        raise DataError(f"{site}: {what} folder {p} holds a single slice, not a 3-D series")
    reader.SetFileNames(files)
    try:
        img = reader.Execute()
    except RuntimeError as e:
        raise DataError(f"{site}: cannot read the DICOM series in {what} folder {p} ({str(e).splitlines()[0][:120]})") \
            from None
    arr = sitk.GetArrayFromImage(img).astype(np.float32)
    if arr.ndim != 3:
        raise DataError(f"{site}: the DICOM series in {what} folder {p} is not a 3-D grayscale volume ({arr.shape})")
    arr = arr.transpose(2, 1, 0)  # SimpleITK's (z, y, x) to NIfTI's (x, y, z)
    direction = np.asarray(img.GetDirection(), dtype=np.float64).reshape(3, 3)
    lps = np.eye(4)
    lps[:3, :3] = direction * np.asarray(img.GetSpacing())[None, :]
    lps[:3, 3] = img.GetOrigin()
    return arr, np.diag([-1.0, -1.0, 1.0, 1.0]) @ lps  # LPS -> RAS


def _to_orientation(arr: np.ndarray, affine: np.ndarray, target: np.ndarray) -> np.ndarray:
    """``arr`` with its axes permuted and flipped into the orientation of ``target`` (an affine)."""
    from nibabel.orientations import apply_orientation, io_orientation, ornt_transform

    t = ornt_transform(io_orientation(affine), io_orientation(target))
    return np.ascontiguousarray(apply_orientation(arr, t))


def _load_nifti(path, site: str, what: str):
    """(array, voxel volume in mm^3) of :func:`load_volume`."""
    arr, affine = load_volume(path, site, what)
    return arr, float(abs(np.linalg.det(affine[:3, :3])))


def _zooms(affine) -> tuple:
    return tuple(float(z) for z in np.sqrt((np.asarray(affine)[:3, :3] ** 2).sum(axis=0)))


def region_masks(label: np.ndarray) -> np.ndarray:
    """(D, H, W) label map -> (3, D, H, W) uint8 masks for WT, TC, ET."""
    return np.stack([np.isin(label, v) for v in REGIONS.values()]).astype(np.uint8)


class SegCase(dict):
    """``image`` (C, D, H, W) float32, ``label`` (3, D, H, W) uint8, ``meta`` (metadata, id)."""


def _resize(a: np.ndarray, shape, mode: str) -> np.ndarray:
    t = torch.from_numpy(np.ascontiguousarray(a))[None]
    if t.ndim == 4:
        t = t[None]
    kw = {"align_corners": False} if mode == "trilinear" else {}
    out = torch.nn.functional.interpolate(t.float(), size=tuple(shape), mode=mode, **kw)
    return out[0].numpy()


def load_case(entry: dict, *, shape: Sequence[int] = (32, 48, 40), site: str = "site",
              allowed_labels: Sequence[int] = ALLOWED_LABELS) -> SegCase:
    """Read, check, crop and resample one case (see the module notes)."""
    images = entry.get("image")
    if isinstance(images, str):
        images = [images]
    mods = entry.get("modalities") or [f"ch{i}" for i in range(len(images or []))]
    if not images:
        raise DataError(f"{site}: case {entry.get('id', '?')} lists no image files")
    if len(mods) != len(images):
        raise DataError(f"{site}: case {entry.get('id', '?')} names {len(mods)} modalities for {len(images)} images")
    vols, affines = [], []
    for m, f in zip(mods, images):
        if f is None:
            raise DataError(f"{site}: case {entry.get('id', '?')} is missing modality {m}")
        a, aff = load_volume(f, site, f"{m} image")
        bad = int(a.size - np.isfinite(a).sum())
        if bad:
            raise DataError(f"{site}: case {entry.get('id', Path(str(f)).parent.name)}: {m} image {f} has {bad} NaN or "
                            f"infinite voxel(s)")
        vols.append(a)
        affines.append(aff)
    lab, lab_aff = load_volume(entry["label"], site, "label")
    # the label map's voxel axes rule: an image stored in another orientation (a DICOM series is LPS, an export
    # RAS) is permuted/flipped to it, so that voxel (i, j, k) is the same place in the image and in its label
    vols = [_to_orientation(a, aff, lab_aff) for a, aff in zip(vols, affines)]
    affines = [lab_aff] * len(vols)
    voxel = float(abs(np.linalg.det(lab_aff[:3, :3])))
    for m, f, a in zip(mods, images, vols):
        if a.shape != vols[0].shape:
            raise DataError(f"{site}: {m} image {f} has shape {a.shape} but {mods[0]} image {images[0]} has {vols[0].shape}")
    if lab.shape != vols[0].shape:
        raise DataError(f"{site}: image {images[0]} has shape {vols[0].shape} but label {entry['label']} has {lab.shape}")
    values = np.unique(lab)
    bad = sorted(set(values.astype(int).tolist()) - set(allowed_labels))
    if bad or not np.allclose(values, np.round(values)):
        raise DataError(f"{site}: label {entry['label']} has unexpected labels {bad or values.tolist()} "
                        f"(allowed {list(allowed_labels)})")
    lab = lab.astype(np.int16)
    if entry.get("mask"):
        brain, brain_aff = load_volume(entry["mask"], site, "brain mask")
        brain = _to_orientation(brain, brain_aff, lab_aff)
        if brain.shape != lab.shape:
            raise DataError(f"{site}: brain mask {entry['mask']} has shape {brain.shape}, image has {lab.shape}")
        fg = brain > 0
    else:
        fg = vols[0] != 0
    if not fg.any():
        raise DataError(f"{site}: case {entry.get('id', images[0])} has an empty foreground")
    lo = np.array([np.flatnonzero(fg.any(axis=tuple(j for j in range(3) if j != i))).min() for i in range(3)])
    hi = np.array([np.flatnonzero(fg.any(axis=tuple(j for j in range(3) if j != i))).max() + 1 for i in range(3)])
    region = entry.get("region", "whole")
    if region in ("left", "right"):
        mid = (lo[0] + hi[0]) // 2
        lo[0], hi[0] = (lo[0], mid) if region == "left" else (mid, hi[0])
    elif region != "whole":
        raise DataError(f"{site}: case {entry.get('id', '?')} region should be whole/left/right, got {region!r}")
    sl = tuple(slice(a, b) for a, b in zip(lo, hi))
    crop_lab = lab[sl]
    zooms = np.asarray(_zooms(lab_aff), dtype=np.float64)
    extent = (hi - lo) * zooms
    meta = {"id": entry.get("id", Path(images[0]).parent.name + ("" if region == "whole" else f"_{region}")),
            "subject": entry.get("subject", Path(images[0]).parent.name),
            "max_intensity": {m: float(v[sl].max()) for m, v in zip(mods, vols)},
            "volume_mm3": {r: float(np.isin(crop_lab, labs).sum() * voxel) for r, labs in REGIONS.items()},
            "spacing_mm": (extent / np.asarray(shape)).tolist(), "region": region,
            # centre of the resampled voxel (0, 0, 0) in the original grid's mm (trilinear, align_corners=False)
            "origin_mm": ((lo - 0.5) * zooms + 0.5 * extent / np.asarray(shape)).tolist()}
    img = np.stack([_resize(v[sl], shape, "trilinear")[0] for v in vols]).astype(np.float32)
    lab_small = _resize(crop_lab.astype(np.float32), shape, "nearest-exact")[0].astype(np.int16)
    return SegCase(image=img, label=region_masks(lab_small), meta=meta)


def case_metadata(cases: Sequence[SegCase]) -> dict[str, np.ndarray]:
    """``004_`` §2.1 site metadata, measured on the original volumes (the maximum intensity of each modality, the
    volume of each region in mm^3 from the NIfTI header): per-feature value arrays of a site's cases: ``intensity__<mod>`` and ``label__<region>``."""
    out: dict[str, list] = {}
    for c in cases:
        for m, v in c["meta"]["max_intensity"].items():
            out.setdefault(f"intensity__{m}", []).append(v)
        for r, v in c["meta"]["volume_mm3"].items():
            out.setdefault(f"label__{r}", []).append(v)
    return {k: np.asarray(v, dtype=np.float64) for k, v in out.items()}
