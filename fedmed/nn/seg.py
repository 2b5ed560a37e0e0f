"""The 3D U-Net of the segmentation workflows (MONAI): its training on patches, sliding-window inference and
the scores (Dice, HD95, false positives). Cases come from :mod:`fedmed.data.nifti`."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from fedmed.data.nifti import REGIONS, SegCase

__all__ = ["dice_scores", "keep_largest_component", "predict_masks", "score_masks", "seg_loss", "seg_metrics", "seg_model",
           "seg_step", "train_seg_local"]


def seg_model(in_channels: int, *, channels=(8, 16, 32, 64), seed: int = 0):
    """MONAI 3D U-Net with three sigmoid outputs (WT, TC, ET)."""
    from monai.networks.nets import UNet

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return UNet(spatial_dims=3, in_channels=in_channels, out_channels=3, channels=tuple(channels),
                    strides=(2,) * (len(channels) - 1), num_res_units=1)


def _train_transforms(roi, seed, patches: int = 4, pos_fraction: float = 0.5):
    from monai.transforms import (Compose, RandCropByPosNegLabeld, RandFlipd, RandScaleIntensityd,
                                  RandShiftIntensityd)

    pos = max(pos_fraction, 1e-6)
    neg = max(1.0 - pos_fraction, 0.0)
    t = Compose([
        RandCropByPosNegLabeld(keys=["image", "label"], label_key="label", spatial_size=roi, pos=pos, neg=neg,
                               num_samples=int(patches), allow_smaller=True, fg_indices_key="fg_indices",
                               bg_indices_key="bg_indices"),
        RandFlipd(keys=["image", "label"], prob=0.5, spatial_axis=0),
        RandFlipd(keys=["image", "label"], prob=0.5, spatial_axis=1),
        RandFlipd(keys=["image", "label"], prob=0.5, spatial_axis=2),
        RandScaleIntensityd(keys="image", factors=0.1, prob=1.0),
        RandShiftIntensityd(keys="image", offsets=0.1, prob=1.0),
    ])
    t.set_random_state(seed=seed)
    return t


def seg_loss(kind: str = "dice_focal"):
    """The training loss on the three sigmoid region outputs (WT, TC, ET).

    ``dice``: MONAI ``DiceLoss(sigmoid=True)`` (``004_``'s) — on a patch without foreground it is 1 with a gradient
    near 0, so tumour-free data teaches nothing; ``dice_focal``: ``DiceFocalLoss(sigmoid=True)`` (fedmed's default);
    ``dice_bce``: Dice + ``BCEWithLogitsLoss``. (MONAI's ``DiceCELoss(sigmoid=True)`` applies *softmax*
    cross-entropy over several output channels, which is wrong for overlapping regions, so it is not offered.)
    """
    from monai.losses import DiceFocalLoss, DiceLoss

    if kind == "dice":
        return DiceLoss(sigmoid=True)
    if kind == "dice_focal":
        return DiceFocalLoss(sigmoid=True)
    if kind == "dice_bce":
        dice, bce = DiceLoss(sigmoid=True), torch.nn.BCEWithLogitsLoss()
        return lambda out, y: dice(out, y) + bce(out, y)
    raise ValueError(f"loss should be 'dice', 'dice_focal' or 'dice_bce', got {kind!r}.")


def train_seg_local(model, cases: Sequence[SegCase], *, epochs: int = 1, optimizer=None, lr: float = 1e-3,
                    roi=(32, 32, 32), patches: int = 4, pos_fraction: float = 0.5, loss: str = "dice_focal",
                    mu: float | None = None, anchor=None, seed: int = 0, precision: str = "fp32", workers: int = 0) -> dict:
    """Local training: ``patches`` random ``roi`` patches per volume (``pos_fraction`` of them centred on tumour),
    flips p = 0.5 per axis, intensity scale and shift 0.1 (``004_`` App. A); ``optimizer`` kept by the caller
    between rounds (default: a fresh Adam). ``mu``/``anchor``: proximal term toward ``anchor`` parameters
    (FedProx, Ditto's personal objective). Patches go to the model's device; ``precision``: fp32 / bf16 / fp16
    autocast (:mod:`fedmed.core.device`); ``workers`` > 0: patches are cut in that many data-loader processes (MONAI's
    ``DataLoader``, which seeds each worker's transforms from ``seed``). ``cases`` may be a
    :class:`fedmed.nn.resident.DeviceVolumes` (a GPU site's volumes kept on its device): then the patches are cut
    there (``workers`` unused) and nothing is read back to the host until the end."""
    from fedmed.core.device import grad_scaler, model_device
    from fedmed.nn.resident import DeviceVolumes

    if not len(cases):
        raise ValueError("no training cases")
    device = model_device(model)
    scaler = grad_scaler(device, precision)
    if isinstance(cases, DeviceVolumes):
        return _train_on_device(model, cases, epochs=epochs, optimizer=optimizer, lr=lr, patches=patches,
                                pos_fraction=pos_fraction, loss=loss, mu=mu, anchor=anchor, seed=seed,
                                precision=precision, scaler=scaler)
    tf = _train_transforms(roi, seed, patches, pos_fraction)
    loss_fn = seg_loss(loss)
    opt = optimizer or torch.optim.Adam(model.parameters(), lr=lr)
    anchor = [a.detach().clone() for a in anchor] if anchor is not None else (
        [p.detach().clone() for p in model.parameters()] if mu else None)
    model.train()
    total, steps, skipped = 0.0, 0, 0
    rng = np.random.default_rng(seed)
    for epoch in range(epochs):
        for x, y in _patch_batches(cases, rng.permutation(len(cases)), tf, workers, seed + epoch):
            loss_v, ok = seg_step(model, loss_fn, x, y, opt, scaler, precision=precision, mu=mu, anchor=anchor)
            skipped += not ok
            total += loss_v
            steps += 1
    return {"loss": total / max(steps, 1), "steps": steps, "skipped": skipped}


def _train_on_device(model, vols, *, epochs, optimizer, lr, patches, pos_fraction, loss, mu, anchor, seed, precision,
                     scaler) -> dict:
    """:func:`train_seg_local` over volumes kept on the device: per epoch the cases in a seeded order, each giving
    one batch of ``patches`` patches cut on the device; the loss and skipped steps summed there, read once."""
    from fedmed.core.device import autocast, backward_step_on_device, model_device

    device = model_device(model)
    loss_fn = seg_loss(loss)
    opt = optimizer or torch.optim.Adam(model.parameters(), lr=lr)
    anchor = [a.detach().clone() for a in anchor] if anchor is not None else (
        [p.detach().clone() for p in model.parameters()] if mu else None)
    model.train()
    total = torch.zeros((), dtype=torch.float64, device=device)
    skipped = torch.zeros((), device=device)
    steps = 0
    rng = np.random.default_rng(seed)
    for _ in range(epochs):
        for i in rng.permutation(len(vols)):
            x, y = vols.patches(int(i), patches, pos_fraction, rng)
            with autocast(device, precision):
                loss_v = loss_fn(model(x).float(), y)
            if anchor is not None and mu:
                loss_v = loss_v + 0.5 * mu * sum(((p - a) ** 2).sum() for p, a in zip(model.parameters(), anchor))
            skipped += backward_step_on_device(loss_v, opt, scaler)
            total += loss_v.detach().double()
            steps += 1
    return {"loss": float(total) / max(steps, 1), "steps": steps, "skipped": int(skipped)}


def seg_step(model, loss_fn, x, y, optimizer, scaler, *, precision: str = "fp32", mu: float | None = None,
             anchor=None) -> tuple[float, bool]:
    """One optimisation step of a segmentation network (3D patches or 2D images): the loss on the sigmoid outputs
    under ``precision`` autocast, plus ``mu / 2 * ||theta - anchor||^2`` when ``mu`` (FedProx, Ditto). Returns the
    loss and whether the step was taken (a non-finite gradient is skipped, :func:`fedmed.core.device.backward_step`)."""
    from fedmed.core.device import autocast, backward_step, model_device

    device = model_device(model)
    x, y = x.to(device), y.to(device)
    with autocast(device, precision):
        loss_v = loss_fn(model(x).float(), y)
    if anchor is not None and mu:
        loss_v = loss_v + 0.5 * mu * sum(((p - a) ** 2).sum() for p, a in zip(model.parameters(), anchor))
    return float(loss_v.detach()), bool(backward_step(loss_v, optimizer, scaler))


def _plain(t) -> torch.Tensor:
    """A transform's output as a plain tensor (the same storage): MONAI's ``MetaTensor`` routes every operation of the
    network's forward and backward pass through its ``__torch_function__`` (metadata tracking a training step has no
    use for; MONAI's fast-training guide turns it off), the values are the same."""
    return torch.as_tensor(t).as_subclass(torch.Tensor)


def _stack(out):
    return (torch.stack([_plain(p["image"]) for p in out]).float(),
            torch.stack([_plain(p["label"]) for p in out]).float())


def _first(batch):
    return batch[0]  # one case's list of patches (a module-level function: data-loader processes pickle it)


_INDICES: dict = {}  # id(label array) -> (the array, its foreground and background voxel indices)


def _crop_indices(label: np.ndarray) -> dict:
    """The foreground and background voxel indices of a case's label, as ``RandCropByPosNegLabeld`` computes them on
    every call (``map_binary_to_indices``), computed once per case in this process and handed to it: the same crops,
    without a pass over the whole volume per step."""
    from monai.transforms.utils import map_binary_to_indices

    hit = _INDICES.get(id(label))
    if hit is None or hit[0] is not label:
        if len(_INDICES) > 256:  # a bound: cases of earlier runs in a long-lived process
            _INDICES.clear()
        hit = _INDICES[id(label)] = (label, *map_binary_to_indices(torch.from_numpy(label), None, 0.0))
    return {"fg_indices": hit[1], "bg_indices": hit[2]}


class _Untracked:
    """A transform run with MONAI's metadata tracking off (``set_track_meta(False)``, as MONAI's fast-training guide
    does): plain tensors with the same values and the same random draws, about 4x faster per case on small volumes
    (no affine bookkeeping per crop and flip). The process's setting is restored after each call."""

    def __init__(self, tf):
        self.tf = tf

    def __call__(self, data):
        from monai.data import get_track_meta, set_track_meta

        before = get_track_meta()
        set_track_meta(False)
        try:
            return self.tf(data)
        finally:
            set_track_meta(before)


def _patch_batches(cases, order, tf, workers: int, seed: int):
    """(image, label) patch batches, one per case in ``order``: in this process (``workers == 0``: the transform's
    own seeded random state, case after case; each case's crop indices computed once, :func:`_crop_indices`) or in
    ``workers`` data-loader processes (which compute them per call, as before: the indices of a large volume would
    cost more to send than to compute)."""
    tf = _Untracked(tf)
    if workers <= 0:
        for i in order:
            c = cases[i]
            yield _stack(tf({"image": torch.from_numpy(c["image"]), "label": torch.from_numpy(c["label"]),
                             **_crop_indices(c["label"])}))
        return
    from monai.data import DataLoader, Dataset

    data = [{"image": torch.from_numpy(cases[i]["image"]), "label": torch.from_numpy(cases[i]["label"])} for i in order]
    g = torch.Generator().manual_seed(int(seed))
    loader = DataLoader(Dataset(data, transform=tf), batch_size=1, num_workers=int(workers), shuffle=False,
                        generator=g, collate_fn=_first)
    for out in loader:
        yield _stack(out)


@torch.no_grad()
def predict_masks(model, image: np.ndarray, roi=(32, 32, 32), largest_component: bool = True) -> np.ndarray:
    """(C, D, H, W) image -> (3, D, H, W) 0/1 masks (sliding-window inference, sigmoid > 0.5).

    ``largest_component`` (default): a glioma is one lesion, so only the largest 26-connected component of the
    whole-tumour mask is kept and TC / ET are restricted to it (:func:`keep_largest_component`; chosen on an
    inner validation subject, docs/readings.md "3D recipe")."""
    from monai.inferers import sliding_window_inference

    from fedmed.core.device import model_device

    model.eval()
    dev = model_device(model)
    x = torch.from_numpy(image)[None]
    logits = sliding_window_inference(x, roi, 4, model, overlap=0.25, sw_device=dev, device=torch.device("cpu"))
    masks = (torch.sigmoid(logits.float()) > 0.5).numpy()[0].astype(np.uint8)
    return keep_largest_component(masks) if largest_component else masks


def keep_largest_component(masks: np.ndarray) -> np.ndarray:
    """(3, D, H, W) WT / TC / ET masks -> the same with WT reduced to its largest 26-connected component and TC,
    ET set to 0 outside it. (MONAI's ``KeepLargestConnectedComponent`` does the same but needs scikit-image on
    CPU, which fedmed does not install.)"""
    from scipy import ndimage

    wt = masks[0] > 0
    lab, n = ndimage.label(wt, structure=np.ones((3, 3, 3)))
    if n <= 1:
        return masks
    sizes = ndimage.sum_labels(wt, lab, index=np.arange(1, n + 1))
    keep = lab == 1 + int(np.argmax(sizes))
    return (masks * keep[None]).astype(masks.dtype)


@torch.no_grad()
def seg_metrics(model, cases: Sequence[SegCase], roi=(32, 32, 32), largest_component: bool = True) -> dict:
    """BraTS-style scores of a model on test cases (:func:`score_masks` of its :func:`predict_masks`)."""
    return score_masks([predict_masks(model, c["image"], roi, largest_component) for c in cases], cases)


def _edge_points_mm(mask: np.ndarray, meta: dict) -> np.ndarray:
    """Surface voxels of a (D, H, W) mask (the mask minus its erosion, as MONAI's ``get_mask_edges``) as (n, 3)
    voxel centres in the original volume's mm. A hemisphere's mask is padded by its own cut face before the
    erosion, so the cut through the brain's midline is not taken for the lesion's surface."""
    from scipy import ndimage

    region = meta.get("region", "whole")
    pad = [(0, 0)] * 3
    if region in ("left", "right"):
        pad[0] = (0, 1) if region == "left" else (1, 0)
    m = np.pad(mask > 0, pad, mode="edge")
    edges = m & ~ndimage.binary_erosion(m)
    edges = edges[pad[0][0]:edges.shape[0] - pad[0][1]]
    spacing = np.asarray(meta.get("spacing_mm") or [1.0, 1.0, 1.0], dtype=np.float64)
    origin = np.asarray(meta.get("origin_mm") or [0.0, 0.0, 0.0], dtype=np.float64)
    return origin + np.argwhere(edges) * spacing


def _hd95(pred_pts: np.ndarray, gt_pts: np.ndarray) -> float:
    """Symmetric 95th-percentile Hausdorff distance between two point sets (MONAI's ``directed=False``: the larger
    of the two directed 95th percentiles)."""
    from scipy.spatial import cKDTree

    d_pg = cKDTree(gt_pts).query(pred_pts)[0]
    d_gp = cKDTree(pred_pts).query(gt_pts)[0]
    return float(max(np.percentile(d_pg, 95), np.percentile(d_gp, 95)))


def score_masks(preds: Sequence[np.ndarray], cases: Sequence[SegCase]) -> dict:
    """BraTS scores of predicted (3, D, H, W) masks, **per subject** (BraTS and ``004_`` score a patient; a subject's
    hemisphere samples are put back together — ``meta["subject"]``, each sample weighted by its voxel volume and
    placed by ``meta["origin_mm"]``), per region (WT, TC, ET):

    * ``dice_<r>``: Dice on the subjects whose ground truth holds the region (as ``DiceMetric(ignore_empty=True)``:
      a subject without the region is left out, not scored 0 or 1); ``dice_mean`` over regions;
    * ``hd95_<r>``: symmetric 95th-percentile Hausdorff distance in mm on those subjects (MONAI's definition, on
      the resampled grids placed in the original volume's mm); an empty prediction scores the subject's diagonal,
      as BraTS penalises it;
    * ``dice_wt_per_sample``: WT Dice averaged over the tumour-bearing *samples* (hemispheres) instead — a
      hemisphere holding a few voxels of a lesion centred in the other one weighs as much as the lesion;
    * ``fp_voxels``: predicted whole-tumour voxels on the tumour-free samples (mean; 0 when there are none).
    """
    if len(preds) != len(cases):
        raise ValueError(f"{len(preds)} predictions for {len(cases)} cases")
    subjects: dict[str, list[int]] = {}
    for k, c in enumerate(cases):
        subjects.setdefault(str(c["meta"].get("subject") or c["meta"].get("id", k)), []).append(k)
    fp, per_sample = [], []
    for p, c in zip(preds, cases):
        if c["label"][0].sum() == 0:
            fp.append(float(p[0].sum()))
        else:
            per_sample.append(2.0 * float((p[0] * c["label"][0]).sum()) / float(p[0].sum() + c["label"][0].sum()))
    dice_rows, hd_rows = [], []
    for ks in subjects.values():
        vox = [float(np.prod(cases[k]["meta"].get("spacing_mm") or [1.0, 1.0, 1.0])) for k in ks]
        if sum(float(cases[k]["label"][0].sum()) for k in ks) == 0:
            continue
        d, h = [], []
        for j in range(3):
            gt_n = sum(v * float(cases[k]["label"][j].sum()) for k, v in zip(ks, vox))
            pr_n = sum(v * float(preds[k][j].sum()) for k, v in zip(ks, vox))
            if gt_n == 0:
                d.append(np.nan)
                h.append(np.nan)
                continue
            tp = sum(v * float((preds[k][j] * cases[k]["label"][j]).sum()) for k, v in zip(ks, vox))
            d.append(2.0 * tp / (gt_n + pr_n))
            gt_pts = np.concatenate([_edge_points_mm(cases[k]["label"][j], cases[k]["meta"]) for k in ks])
            if pr_n == 0:
                lo = np.min([np.asarray(cases[k]["meta"].get("origin_mm") or [0.0] * 3) for k in ks], axis=0)
                hi = np.max([np.asarray(cases[k]["meta"].get("origin_mm") or [0.0] * 3)
                             + np.asarray(cases[k]["label"].shape[1:])
                             * np.asarray(cases[k]["meta"].get("spacing_mm") or [1.0] * 3) for k in ks], axis=0)
                h.append(float(np.linalg.norm(hi - lo)))
            else:
                pr_pts = np.concatenate([_edge_points_mm(preds[k][j], cases[k]["meta"]) for k in ks])
                h.append(_hd95(pr_pts, gt_pts))
        dice_rows.append(d)
        hd_rows.append(h)
    out: dict = {"n_tumour_cases": len(dice_rows), "n_tumour_free_cases": len(fp)}
    for j, r in enumerate(REGIONS):
        for key, rows in ((f"dice_{r.lower()}", dice_rows), (f"hd95_{r.lower()}", hd_rows)):
            col = np.array([row[j] for row in rows], dtype=np.float64)
            col = col[np.isfinite(col)]
            out[key] = float(col.mean()) if col.size else float("nan")
    vals = [out[f"dice_{r.lower()}"] for r in REGIONS if np.isfinite(out[f"dice_{r.lower()}"])]
    out["dice_mean"] = float(np.mean(vals)) if vals else float("nan")
    out["dice_wt_per_sample"] = float(np.mean(per_sample)) if per_sample else float("nan")
    out["fp_voxels"] = float(np.mean(fp)) if fp else 0.0
    return out


def dice_scores(model, cases: Sequence[SegCase], roi=(32, 32, 32)) -> dict:
    """Per-region Dice of :func:`seg_metrics` (kept for callers that want only Dice)."""
    m = seg_metrics(model, cases, roi)
    return {k: m[k] for k in ("dice_wt", "dice_tc", "dice_et", "dice_mean")}
