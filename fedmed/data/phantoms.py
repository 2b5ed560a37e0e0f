"""Synthetic NIfTI phantoms: a fresh machine's stand-in for BraTS in the demo and the tests.

Each subject is a ``size^3`` volume with two modalities (a smooth "brain" ellipsoid plus noise,
z-scored), a brain mask and a label map with a spherical lesion (1 necrosis core, 2 edema shell,
4 enhancing rim) whose radius the caller chooses, so federations with a known outlier (the site
with the largest lesions) can be built. Clearly synthetic: reports say so.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["write_phantom_subjects"]


def write_phantom_subjects(out_dir, radii, *, size: int = 40, seed: int = 0) -> Path:
    import nibabel as nib

    out = Path(out_dir)
    rng = np.random.default_rng(seed)
    g = np.indices((size,) * 3).astype(np.float32) - (size - 1) / 2
    brain = ((g[0] / (0.45 * size)) ** 2 + (g[1] / (0.4 * size)) ** 2 + (g[2] / (0.35 * size)) ** 2) <= 1
    affine = np.diag([1.5, 1.5, 1.5, 1.0])
    for k, r in enumerate(radii):
        d = out / f"phantom_{k:03d}"
        d.mkdir(parents=True, exist_ok=True)
        c = rng.uniform(-0.15, 0.15, 3) * size
        dist = np.sqrt(((g - c[:, None, None, None]) ** 2).sum(0))
        lab = np.zeros((size,) * 3, np.uint8)
        if r > 0:
            lab[(dist <= r) & brain] = 2
            lab[(dist <= 0.7 * r) & brain] = 4
            lab[(dist <= 0.4 * r) & brain] = 1
        for name, gain in (("Flair", 2.0), ("T1c", 1.5)):
            img = brain * (1.0 + 0.1 * rng.standard_normal((size,) * 3)) + gain * (lab > 0) + 0.05 * rng.standard_normal((size,) * 3)
            img = (img - img[brain].mean()) / img[brain].std()
            nib.save(nib.Nifti1Image(img.astype(np.float32), affine), str(d / f"{name}_phantom.nii.gz"))
        nib.save(nib.Nifti1Image(lab, affine), str(d / "OTMultiClass.nii.gz"))
        nib.save(nib.Nifti1Image(brain.astype(np.uint8), affine), str(d / "brainmask.nii.gz"))
    return out
