"""2D lesion segmentation (one foreground class, e.g. BUS-BRA's breast lesions): MONAI's 2D U-Net with one sigmoid
output, its local training on whole images and its scores (Dice per image, false-positive pixels). Cases come from
:class:`fedmed.site.seg2d.Seg2DSiteRunner`: ``x`` (N, C, H, W) in [0, 1], ``y`` (N, 1, H, W) in {0, 1}."""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["dice_per_image", "predict_masks2d", "seg2d_metrics", "seg2d_model", "train_seg2d_local"]


def seg2d_model(in_channels: int, *, channels=(8, 16, 32, 64), seed: int = 0):
    """MONAI 2D U-Net (one residual unit per level, stride 2) with one sigmoid output: the lesion."""
    from monai.networks.nets import UNet

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return UNet(spatial_dims=2, in_channels=in_channels, out_channels=1, channels=tuple(channels),
                    strides=(2,) * (len(channels) - 1), num_res_units=1)


def train_seg2d_local(model, x: torch.Tensor, y: torch.Tensor, *, epochs: int = 1, batch_size: int = 16,
                      optimizer=None, lr: float = 1e-3, loss: str = "dice_focal", mu: float | None = None, anchor=None,
                      generator: torch.Generator | None = None, precision: str = "fp32") -> dict:
    """``epochs`` over the images in seeded random batches, each flipped left-right with p = 0.5 (image and mask
    together); the loss on the sigmoid output (:func:`fedmed.nn.seg.seg_loss`). ``mu`` / ``anchor``: a proximal term
    (FedProx, Ditto). Returns ``{"loss": mean, "steps": n, "skipped": k}``."""
    from fedmed.core.device import grad_scaler, model_device
    from fedmed.nn.seg import seg_loss, seg_step

    n = int(x.shape[0])
    if n == 0:
        raise ValueError("no training images")
    device = model_device(model)
    scaler = grad_scaler(device, precision)
    loss_fn = seg_loss(loss)
    opt = optimizer or torch.optim.Adam(model.parameters(), lr=lr)
    anchor = [a.detach().clone() for a in anchor] if anchor is not None else (
        [p.detach().clone() for p in model.parameters()] if mu else None)
    g = generator or torch.Generator().manual_seed(0)
    model.train()
    total, steps, skipped = 0.0, 0, 0
    for _ in range(epochs):
        order = torch.randperm(n, generator=g)
        for s in range(0, n, batch_size):
            idx = order[s:s + batch_size]
            if idx.numel() < 2 and n > 1:
                continue  # one image cannot be batch-normalised in train mode
            xb, yb = x[idx].clone(), y[idx].clone()
            flip = torch.rand(idx.numel(), generator=g) < 0.5
            xb[flip], yb[flip] = xb[flip].flip(-1), yb[flip].flip(-1)
            loss_v, ok = seg_step(model, loss_fn, xb, yb, opt, scaler, precision=precision, mu=mu, anchor=anchor)
            skipped += not ok
            total += loss_v
            steps += 1
    return {"loss": total / max(steps, 1), "steps": steps, "skipped": skipped}


@torch.no_grad()
def predict_masks2d(model, x: torch.Tensor, batch_size: int = 32) -> np.ndarray:
    """(N, C, H, W) images -> (N, H, W) 0/1 masks (sigmoid > 0.5)."""
    from fedmed.core.device import model_device

    model.eval()
    dev = model_device(model)
    outs = [(torch.sigmoid(model(x[s:s + batch_size].to(dev)).float()) > 0.5).cpu()
            for s in range(0, int(x.shape[0]), batch_size)]
    return torch.cat(outs)[:, 0].numpy().astype(np.uint8) if outs else np.zeros((0,) + tuple(x.shape[2:]), np.uint8)


def dice_per_image(pred: np.ndarray, gt: np.ndarray) -> np.ndarray:
    """Dice of each (H, W) mask pair; NaN where the ground truth is empty (a lesion-free image has no Dice: it is
    scored by its false-positive pixels)."""
    p, g = pred.reshape(len(pred), -1).astype(bool), gt.reshape(len(gt), -1).astype(bool)
    inter, size = (p & g).sum(1), p.sum(1) + g.sum(1)
    out = np.full(len(p), np.nan)
    has = g.sum(1) > 0
    out[has] = 2.0 * inter[has] / size[has]
    return out


def seg2d_metrics(model, x: torch.Tensor, y: torch.Tensor) -> dict:
    """``dice_mean``: the mean Dice over the images holding a lesion; ``fp_pixels``: the mean predicted lesion pixels
    on lesion-free images (NaN — "n/a" in a table — when there are none: BUS-BRA has none); the image counts."""
    pred = predict_masks2d(model, x)
    gt = y[:, 0].numpy() > 0.5 if len(y) else np.zeros_like(pred, dtype=bool)
    d = dice_per_image(pred, gt)
    free = gt.reshape(len(gt), -1).sum(1) == 0
    return {"dice_mean": float(np.nanmean(d)) if np.isfinite(d).any() else float("nan"),
            "fp_pixels": float(pred[free].reshape(int(free.sum()), -1).sum(1).mean()) if free.any() else float("nan"),
            "n_lesion_images": int(np.isfinite(d).sum()), "n_lesion_free_images": int(free.sum())}
