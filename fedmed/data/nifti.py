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

Hospital formats: an image may be a folder holding one DICOM series (SimpleITK; its headers checked for a regular
grid by :func:`series_geometry_problem`), and a label a DICOM-SEG file (highdicom; :func:`load_dicom_seg` places its
segments on the first image's grid, segment number = label value).

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

__all__ = ["ALLOWED_LABELS", "REGIONS", "SEG_SOP_CLASS", "SegCase", "case_metadata", "is_dicom_seg", "load_case",
           "load_dicom_seg", "load_label", "region_masks", "series_geometry_problem"]

REGIONS = {"WT": (1, 2, 3, 4), "TC": (1, 3, 4), "ET": (4,)}
ALLOWED_LABELS = (0, 1, 2, 3, 4)


def _limits(limits):
    from fedmed.core.policy import ReadLimits

    return limits or ReadLimits()


def _kind(what: str) -> str:
    """How a message that leaves the site names a file of a case: by its role (``its FLAIR image``, ``its label``),
    never by its path, the case's id or a modality name its datalist gives."""
    return "its image" if what.endswith("image") else f"its {what}"


def _check_voxels(n: int, limits, site: str, what: str, p) -> None:
    if n > limits.max_volume_voxels:
        raise DataError(f"{site}: {what} {p} has {n} voxels, more than this site reads (its policy's "
                        f"max_volume_voxels={limits.max_volume_voxels})",
                        f"{site}: {_kind(what)} has {n} voxels, more than this site reads (its policy's "
                        f"max_volume_voxels={limits.max_volume_voxels})")


def load_volume(path, site: str, what: str, limits=None) -> tuple[np.ndarray, np.ndarray]:
    """A 3-D volume as ``(array (x, y, z) float32, affine voxel -> RAS mm)``: a NIfTI file, or a folder holding one
    DICOM series (read with SimpleITK/GDCM: slices sorted by position, spacing and orientation from the headers;
    SimpleITK's LPS affine turned into RAS as NIfTI's). No DICOM header value enters a message. Only regular files
    within ``limits`` (:class:`fedmed.core.policy.ReadLimits`: bytes, and voxels read from the header before any
    voxel is decoded: a small compressed file can hold a huge volume) are read."""
    import nibabel as nib

    from fedmed.data.images import check_input_file

    limits = _limits(limits)
    p = Path(path)
    if p.is_dir():
        return _load_dicom_series(p, site, what, limits)
    if not p.exists():
        raise DataError(f"{site}: {what} file {p} not found", f"{site}: {_kind(what)} file not found")
    try:
        check_input_file(p, limits)
    except DataError as e:
        raise DataError(f"{site}: {what} file {p} {e.public}", f"{site}: {_kind(what)} file {e.public}") from None
    if not (p.name.endswith(".nii") or p.name.endswith(".nii.gz")):
        seg_note = " (a DICOM-SEG file is read as a case's label only)" if what != "label" and is_dicom_seg(p) else ""
        raise DataError(f"{site}: {what} file {p} is not a NIfTI file (.nii or .nii.gz) or a DICOM series folder"
                        + seg_note, f"{site}: {_kind(what)} file is not a NIfTI file (.nii or .nii.gz) or a DICOM "
                        f"series folder" + seg_note)
    try:
        img = nib.load(str(p))
    except Exception as e:
        raise DataError(f"{site}: cannot read {what} file {p} ({type(e).__name__}: {e})",
                        f"{site}: {_kind(what)} file cannot be read: not a readable NIfTI ({type(e).__name__})") from None
    _check_voxels(int(np.prod(img.shape)), limits, site, f"{what} file", p)
    try:
        arr = np.asarray(img.dataobj, dtype=np.float32)
    except Exception as e:
        raise DataError(f"{site}: cannot read {what} file {p} ({type(e).__name__}: {e})",
                        f"{site}: {_kind(what)} file's voxels cannot be read: damaged or truncated "
                        f"({type(e).__name__})") from None
    if arr.ndim != 3:
        raise DataError(f"{site}: {what} file {p} should be a 3-D volume, got shape {arr.shape}",
                        f"{site}: {_kind(what)} file should be a 3-D volume, got {arr.ndim} dimension(s)")
    return arr, np.asarray(img.affine, dtype=np.float64)


def _load_dicom_series(p: Path, site: str, what: str, limits) -> tuple[np.ndarray, np.ndarray]:
    import SimpleITK as sitk

    from fedmed.data.images import check_input_file

    reader = sitk.ImageSeriesReader()
    ids = reader.GetGDCMSeriesIDs(str(p))
    if not ids:
        raise DataError(f"{site}: {what} folder {p} holds no DICOM series",
                        f"{site}: {_kind(what)} folder holds no DICOM series")
    if len(ids) > 1:
        raise DataError(f"{site}: {what} folder {p} holds {len(ids)} DICOM series; one series per folder",
                        f"{site}: {_kind(what)} folder holds {len(ids)} DICOM series; one series per folder")
    files = reader.GetGDCMSeriesFileNames(str(p), ids[0])  # sorted along the slice normal
    if len(files) < 2:
        raise DataError(f"{site}: {what} folder {p} holds a single slice, not a 3-D series",
                        f"{site}: {_kind(what)} folder holds a single slice, not a 3-D series")
    for f in files:
        try:
            check_input_file(f, limits)
        except DataError as e:
            raise DataError(f"{site}: a file of the DICOM series in {what} folder {p} {e.public}",
                            f"{site}: a file of the DICOM series of {_kind(what)} {e.public}") from None
    problem = series_geometry_problem(files)
    if problem:
        raise DataError(f"{site}: the DICOM series in {what} folder {p} is not a 3-D volume: {problem}",
                        f"{site}: the DICOM series of {_kind(what)} is not a 3-D volume: {problem}")
    _check_voxels(len(files) * _slice_pixels(files[0]), limits, site, f"DICOM series in {what} folder", p)
    reader.SetFileNames(files)
    try:
        img = reader.Execute()
    except RuntimeError as e:
        raise DataError(f"{site}: cannot read the DICOM series in {what} folder {p} ({str(e).splitlines()[0][:120]})",
                        f"{site}: cannot read the DICOM series of {_kind(what)} (SimpleITK)") from None
    arr = sitk.GetArrayFromImage(img).astype(np.float32)
    if arr.ndim != 3:
        raise DataError(f"{site}: the DICOM series in {what} folder {p} is not a 3-D grayscale volume ({arr.shape})",
                        f"{site}: the DICOM series of {_kind(what)} is not a 3-D grayscale volume ({arr.shape})")
    arr = arr.transpose(2, 1, 0)  # SimpleITK's (z, y, x) to NIfTI's (x, y, z)
    direction = np.asarray(img.GetDirection(), dtype=np.float64).reshape(3, 3)
    lps = np.eye(4)
    lps[:3, :3] = direction * np.asarray(img.GetSpacing())[None, :]
    lps[:3, 3] = img.GetOrigin()
    return arr, np.diag([-1.0, -1.0, 1.0, 1.0]) @ lps  # LPS -> RAS


def _slice_pixels(f) -> int:
    import pydicom

    try:
        ds = pydicom.dcmread(f, stop_before_pixels=True)
        return int(ds.get("Rows", 0) or 0) * int(ds.get("Columns", 0) or 0)
    except Exception:
        return 0  # SimpleITK says what is wrong with the file


def series_geometry_problem(files, *, tol: float = 1e-3) -> str:
    """Why the slices of one DICOM series (sorted along their normal) do not make a regular 3-D grid, or ``""``.

    SimpleITK reads any series as a volume with the first slice's orientation; these header checks (pydicom, no pixel
    data read) refuse what would be a wrong volume: slices of different orientations (a radial or localizer series),
    different sizes or pixel spacings, a slice missing or doubled (uneven positions along the normal), a slice
    without position/orientation. The sentence names counts and millimetres only, never a header's identifiers."""
    import pydicom

    oris, pos, sizes, spacing = [], [], set(), set()
    for f in files:
        ds = pydicom.dcmread(f, stop_before_pixels=True)
        if "ImageOrientationPatient" not in ds or "ImagePositionPatient" not in ds:
            return "a slice has no ImagePositionPatient/ImageOrientationPatient"
        oris.append(np.asarray([float(v) for v in ds.ImageOrientationPatient]))
        pos.append(np.asarray([float(v) for v in ds.ImagePositionPatient]))
        sizes.add((int(ds.Rows), int(ds.Columns)))
        spacing.add(tuple(round(float(v), 4) for v in ds.get("PixelSpacing", [0, 0])))
    if any(np.abs(o - oris[0]).max() > tol for o in oris):
        n = len({tuple(np.round(o, 3)) for o in oris})
        return f"its {len(files)} slices have {n} different orientations (a radial or localizer series?)"
    if len(sizes) > 1 or len(spacing) > 1:
        return f"its slices differ in size or pixel spacing ({len(sizes)} sizes, {len(spacing)} spacings)"
    normal = np.cross(oris[0][:3], oris[0][3:])
    d = np.diff(np.sort(np.asarray(pos) @ normal))
    if (d < tol).any():
        return f"{int((d < tol).sum())} slice(s) at the same position (a doubled slice, or two acquisitions)"
    if len(d) > 1 and np.abs(d - np.median(d)).max() > max(tol, 0.01 * float(np.median(d))):
        k = int(np.argmax(np.abs(d - np.median(d))))
        return (f"uneven slice positions: {float(np.median(d)):.3g} mm apart but {float(d[k]):.3g} mm after slice "
                f"{k + 1} of {len(files)} (a slice missing?)")
    return ""


SEG_SOP_CLASS = "1.2.840.10008.5.1.4.1.1.66.4"  # DICOM Segmentation Storage


def is_dicom_seg(path) -> bool:
    """A DICOM Segmentation (DICOM-SEG) file."""
    p = Path(path)
    if not p.is_file():
        return False
    from fedmed.data.images import is_dicom

    if not is_dicom(p):
        return False
    import pydicom

    try:
        return str(pydicom.dcmread(p, stop_before_pixels=True, specific_tags=["SOPClassUID"]).SOPClassUID) \
            == SEG_SOP_CLASS
    except Exception:
        return False


def load_dicom_seg(path, site: str, shape: Sequence[int], affine: np.ndarray,
                   frame_of_reference: str | None = None) -> np.ndarray:
    """A DICOM-SEG label on its image's voxel grid (``shape``, ``affine`` voxel -> RAS mm, as :func:`load_volume`).

    Read with highdicom (``Segmentation.get_volume(combine_segments=True)``): each voxel holds the number of the
    segment it belongs to (0 background), so segment ``n`` is label ``n`` — for BraTS regions segments 1-4 are
    necrosis, edema, non-enhancing and enhancing tumour. The SEG's frames usually cover only the slices with a
    segment: they are placed on the image grid by their positions (the SEG must share the image's frame of
    reference and voxel grid — any flip or axis order is fine; a resampled grid is refused). Overlapping or
    fractional segments are refused. No header value enters a message."""
    import highdicom as hd

    p = Path(path)
    try:
        seg = hd.seg.segread(str(p))
    except Exception as e:
        raise DataError(f"{site}: cannot read DICOM-SEG label {p} ({type(e).__name__})",
                        f"{site}: cannot read its DICOM-SEG label ({type(e).__name__})") from None
    if frame_of_reference and str(seg.get("FrameOfReferenceUID", "")) != frame_of_reference:
        raise DataError(f"{site}: DICOM-SEG label {p} is in another frame of reference than its image series",
                        f"{site}: its DICOM-SEG label is in another frame of reference than its image series")
    if seg.segmentation_type == hd.seg.SegmentationTypeValues.FRACTIONAL:
        raise DataError(f"{site}: DICOM-SEG label {p} is FRACTIONAL; a label map needs BINARY or LABELMAP segments",
                        f"{site}: its DICOM-SEG label is FRACTIONAL; a label map needs BINARY or LABELMAP segments")
    try:
        vol = seg.get_volume(combine_segments=True)
    except Exception as e:  # overlapping segments, an irregular stack of frames
        raise DataError(f"{site}: DICOM-SEG label {p} is not one label per voxel on a regular grid "
                        f"({str(e).splitlines()[0][:120] if str(e) else type(e).__name__})",
                        f"{site}: its DICOM-SEG label is not one label per voxel on a regular grid") from None
    arr = np.asarray(vol.array)
    if arr.ndim == 4:
        arr = arr[..., 0]
    ras = np.diag([-1.0, -1.0, 1.0, 1.0]) @ np.asarray(vol.affine, dtype=np.float64)  # highdicom: LPS
    t = np.linalg.inv(np.asarray(affine, dtype=np.float64)) @ ras  # SEG voxel index -> image voxel index
    rot, off = t[:3, :3], t[:3, 3]
    if not (np.allclose(np.abs(rot).sum(axis=0), 1, atol=1e-3) and np.allclose(np.abs(rot), np.round(np.abs(rot)),
                                                                                    atol=1e-3)
            and np.allclose(off, np.round(off), atol=1e-2)):
        raise DataError(f"{site}: DICOM-SEG label {p} is not on its image's voxel grid (resample it onto the series)",
                        f"{site}: its DICOM-SEG label is not on its image's voxel grid (resample it onto the series)")
    nz = np.argwhere(arr > 0)
    idx = np.rint(nz @ np.round(rot).T + np.round(off)).astype(np.int64)
    if len(idx) and ((idx < 0).any() or (idx >= np.asarray(shape)).any()):
        raise DataError(f"{site}: DICOM-SEG label {p} has segment voxels outside its image volume",
                        f"{site}: its DICOM-SEG label has segment voxels outside its image volume")
    out = np.zeros(tuple(shape), np.float32)
    out[tuple(idx.T)] = arr[tuple(nz.T)]
    return out


def series_frame_of_reference(path) -> str | None:
    """The FrameOfReferenceUID of a DICOM series folder (compared, never shown), else ``None``."""
    p = Path(path)
    if not p.is_dir():
        return None
    import pydicom

    for f in sorted(p.iterdir()):
        try:
            v = pydicom.dcmread(f, stop_before_pixels=True, specific_tags=["FrameOfReferenceUID"]).get(
                "FrameOfReferenceUID")
        except Exception:
            continue
        return str(v) if v else None
    return None


def load_label(path, site: str, image_shape: Sequence[int], image_affine: np.ndarray, image_path=None, limits=None):
    """A case's label map as ``(array, affine)``: a NIfTI file (its own grid) or a DICOM-SEG file (placed on the
    first image's grid by :func:`load_dicom_seg`)."""
    if is_dicom_seg(path):
        return load_dicom_seg(path, site, image_shape, image_affine,
                              series_frame_of_reference(image_path) if image_path is not None else None), \
            np.asarray(image_affine, dtype=np.float64)
    return load_volume(path, site, "label", limits)


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


def _read_images(entry: dict, images: list, mods: list, site: str, limits) -> tuple[list, list]:
    """A case's images, one per modality, each read within the site's limits and free of NaN or infinite voxels:
    (volumes, affines)."""
    vols, affines = [], []
    for m, f in zip(mods, images):
        if f is None:
            raise DataError(f"{site}: case {entry.get('id', '?')} is missing modality {m}",
                            f"{site}: is missing its image {mods.index(m) + 1} of {len(mods)}")
        a, aff = load_volume(f, site, f"{m} image", limits)
        bad = int(a.size - np.isfinite(a).sum())
        if bad:
            raise DataError(f"{site}: case {entry.get('id', Path(str(f)).parent.name)}: {m} image {f} has {bad} NaN or "
                            f"infinite voxel(s)", f"{site}: its image {images.index(f) + 1} of {len(images)} has {bad} "
                            f"NaN or infinite voxel(s)")
        vols.append(a)
        affines.append(aff)
    return vols, affines


def load_case(entry: dict, *, shape: Sequence[int] = (32, 48, 40), site: str = "site",
              allowed_labels: Sequence[int] = ALLOWED_LABELS, limits=None) -> SegCase:
    """Read, check, crop and resample one case (see the module notes); ``limits``: what the site reads at most."""
    images = entry.get("image")
    if isinstance(images, str):
        images = [images]
    mods = entry.get("modalities") or [f"ch{i}" for i in range(len(images or []))]
    if not images:
        raise DataError(f"{site}: case {entry.get('id', '?')} lists no image files", f"{site}: lists no image files")
    if len(mods) != len(images):
        raise DataError(f"{site}: case {entry.get('id', '?')} names {len(mods)} modalities for {len(images)} images",
                        f"{site}: names {len(mods)} modalities for {len(images)} images")
    vols, affines = _read_images(entry, images, mods, site, limits)
    lab, lab_aff = load_label(entry["label"], site, vols[0].shape, affines[0], images[0], limits)
    # the label map's voxel axes rule: an image stored in another orientation (a DICOM series is LPS, an export
    # RAS) is permuted/flipped to it, so that voxel (i, j, k) is the same place in the image and in its label
    vols = [_to_orientation(a, aff, lab_aff) for a, aff in zip(vols, affines)]
    affines = [lab_aff] * len(vols)
    voxel = float(abs(np.linalg.det(lab_aff[:3, :3])))
    for m, f, a in zip(mods, images, vols):
        if a.shape != vols[0].shape:
            raise DataError(f"{site}: {m} image {f} has shape {a.shape} but {mods[0]} image {images[0]} has {vols[0].shape}",
                            f"{site}: its images differ in shape ({a.shape} and {vols[0].shape})")
    if lab.shape != vols[0].shape:
        raise DataError(f"{site}: image {images[0]} has shape {vols[0].shape} but label {entry['label']} has {lab.shape}",
                        f"{site}: its image has shape {vols[0].shape} but its label map {lab.shape}")
    values = np.unique(lab)
    bad = sorted(set(values.astype(int).tolist()) - set(allowed_labels))
    if bad or not np.allclose(values, np.round(values)):
        raise DataError(f"{site}: label {entry['label']} has unexpected labels {bad or values.tolist()} "
                        f"(allowed {list(allowed_labels)})",
                        f"{site}: its label map has {len(bad) or 'non-integer'} value(s) outside the allowed labels "
                        f"{list(allowed_labels)}")
    lab = lab.astype(np.int16)
    if entry.get("mask"):
        brain, brain_aff = load_volume(entry["mask"], site, "brain mask")
        brain = _to_orientation(brain, brain_aff, lab_aff)
        if brain.shape != lab.shape:
            raise DataError(f"{site}: brain mask {entry['mask']} has shape {brain.shape}, image has {lab.shape}",
                            f"{site}: its brain mask has shape {brain.shape}, its image {lab.shape}")
        fg = brain > 0
    else:
        fg = vols[0] != 0
    if not fg.any():
        raise DataError(f"{site}: case {entry.get('id', images[0])} has an empty foreground",
                        f"{site}: has an empty foreground (no brain-mask or nonzero image voxel)")
    lo = np.array([np.flatnonzero(fg.any(axis=tuple(j for j in range(3) if j != i))).min() for i in range(3)])
    hi = np.array([np.flatnonzero(fg.any(axis=tuple(j for j in range(3) if j != i))).max() + 1 for i in range(3)])
    region = entry.get("region", "whole")
    if region in ("left", "right"):
        mid = (lo[0] + hi[0]) // 2
        lo[0], hi[0] = (lo[0], mid) if region == "left" else (mid, hi[0])
    elif region != "whole":
        raise DataError(f"{site}: case {entry.get('id', '?')} region should be whole/left/right, got {region!r}",
                        f"{site}: its region should be whole, left or right")
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
