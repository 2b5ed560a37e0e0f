"""Small real DICOM for the 3D tests: a series made of pydicom's ``MR_small.dcm`` (64 x 64 MR, 0.3125 mm pixels), its
slices stacked along the image normal, each with its own position, instance number and pixel values (a blob that
grows and moves with the slice, so a mis-sorted or flipped stack is visible), and a DICOM-SEG of it made by highdicom.

pydicom's own multi-slice sample (``dicomdirtests/98892003/MR700``) is a radial series — every slice turned by a
different angle — which is not a 3-D volume (``fedmed.data.nifti.series_geometry_problem`` refuses it).
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np


def write_series(folder, n: int = 6, *, thickness: float = 2.0, skip: int | None = None, shuffle_seed: int = 0,
                 orientation=None) -> list:
    """Write ``n`` slices to ``folder`` (file names in shuffled order, so sorting by position is needed); ``skip``
    leaves that slice out (a gap). Returns the written datasets sorted by position."""
    import pydicom
    from pydicom.data import get_testdata_file
    from pydicom.uid import generate_uid

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    base = pydicom.dcmread(get_testdata_file("MR_small.dcm"))
    series, frame = generate_uid(), generate_uid()
    ori = np.asarray([float(v) for v in (orientation or base.ImageOrientationPatient)])
    normal = np.cross(ori[:3], ori[3:])
    origin = np.asarray([float(v) for v in base.ImagePositionPatient])
    yy, xx = np.mgrid[:base.Rows, :base.Columns]
    out = []
    order = np.random.default_rng(shuffle_seed).permutation(n)
    for k in range(n):
        if k == skip:
            continue
        ds = copy.deepcopy(base)
        ds.SeriesInstanceUID, ds.FrameOfReferenceUID = series, frame
        ds.SOPInstanceUID = generate_uid()
        ds.file_meta.MediaStorageSOPInstanceUID = ds.SOPInstanceUID
        ds.InstanceNumber = k + 1
        ds.ImageOrientationPatient = [f"{v:.6f}" for v in ori]
        ds.ImagePositionPatient = [f"{v:.4f}" for v in origin + k * thickness * normal]
        ds.SliceThickness = thickness
        ds.SliceLocation = float(k * thickness)
        blob = ((yy - 20 - 3 * k) ** 2 + (xx - 30) ** 2) < (6 + k) ** 2
        px = (np.asarray(base.pixel_array, np.int32) // 4 + 900 * blob + 40 * k).astype(base.pixel_array.dtype)
        ds.PixelData = px.tobytes()
        ds.save_as(folder / f"img{order[k]:03d}.dcm", enforce_file_format=True)
        out.append(ds)
    return out


def blob_masks(datasets, threshold: int = 850) -> np.ndarray:
    """(slices, rows, columns) 0/1 where a slice's blob is (its pixel values above ``threshold``)."""
    return np.stack([(np.asarray(d.pixel_array) > threshold).astype(np.uint8) for d in datasets])


def write_seg(path, datasets, labels: np.ndarray, *, fractional: bool = False) -> None:
    """A DICOM-SEG of ``datasets`` (highdicom): ``labels`` (slices, rows, columns) holds label values; segment ``n`` is
    label ``n`` (segments 1..max, an absent label's segment empty); BINARY (FRACTIONAL with ``fractional``)."""
    import highdicom as hd
    from pydicom.sr.codedict import codes

    numbers = list(range(1, int(labels.max()) + 1))
    descs = [hd.seg.SegmentDescription(segment_number=n, segment_label=f"label {n}",
                                       segmented_property_category=codes.SCT.MorphologicallyAbnormalStructure,
                                       segmented_property_type=codes.SCT.Neoplasm,
                                       algorithm_type=hd.seg.SegmentAlgorithmTypeValues.MANUAL)
             for n in numbers]
    stack = np.stack([(labels == n) for n in numbers], axis=-1).astype(np.uint8)  # (frames, rows, cols, segments)
    kind = hd.seg.SegmentationTypeValues.FRACTIONAL if fractional else hd.seg.SegmentationTypeValues.BINARY
    seg = hd.seg.Segmentation(source_images=list(datasets), pixel_array=stack.astype(np.float32) if fractional
                              else stack, segmentation_type=kind, segment_descriptions=descs,
                              series_instance_uid=hd.UID(), series_number=100, sop_instance_uid=hd.UID(),
                              instance_number=1, manufacturer="fedmed tests", manufacturer_model_name="tests",
                              software_versions="0", device_serial_number="0")
    seg.save_as(str(path))
