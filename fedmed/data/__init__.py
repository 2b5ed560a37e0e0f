"""Data: 2D images found and decoded (images), their per-site datalists and splits (datalists), how a pool becomes a federation (partition), NIfTI subjects and cases (nifti), segmentation federations (seg_federation), synthetic phantoms (phantoms).

Every name below is importable from ``fedmed.data`` (loaded on first use)."""

from fedmed.core.faces import lazy_face

_PUBLIC = {
    "ALLOWED_LABELS": "nifti",
    "ANDA_SHIFTS": "anda",
    "DataError": "images",
    "ImagePool": "images",
    "PreDiResult": "partition",
    "REGIONS": "nifti",
    "SegCase": "nifti",
    "SiteShift": "anda",
    "anda_federation": "anda",
    "apply_anda_transform": "anda",
    "as_rng": "partition",
    "case_metadata": "nifti",
    "check_no_leakage": "seg_federation",
    "check_readable": "images",
    "conversion_note": "images",
    "decode_image": "images",
    "dirichlet_label_partition": "partition",
    "discover": "images",
    "discover_subjects": "seg_federation",
    "iid_partition": "partition",
    "label_volume_federation": "partition",
    "load_case": "nifti",
    "load_datalist": "datalists",
    "load_images": "images",
    "predi": "partition",
    "predi_partition": "partition",
    "quantity_partition": "partition",
    "region_masks": "nifti",
    "subject_of": "seg_federation",
    "unreadable_images": "images",
    "write_phantom_subjects": "phantoms",
    "write_seg_federation": "seg_federation",
    "write_site_datalists": "datalists",
}

__all__ = sorted(_PUBLIC)

__getattr__, __dir__ = lazy_face(__name__, _PUBLIC)
