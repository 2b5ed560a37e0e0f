"""Self-supervised FL for label-scarce sites (``001_``): Fed-MAE pre-training, fine-tuning, PreP-WFL.

* :func:`mae_model` — MONAI's ``MaskedAutoEncoderViT`` (2D), a small ViT sized for CPU (:data:`VIT_SMALL`:
  32 px, patch 4, 64 patches, width 128, 4 blocks; decoder width 64, 1 block), mask ratio 75 %.
* :func:`mae_loss` — MSE on the masked patches only (``001_`` §3.2, the MAE objective).
* :func:`train_mae_local` — AdamW (beta = 0.9, 0.95), lr = ``base_lr x batch / 256`` (base 1.5e-4) with linear warm-up then
  cosine decay over the whole federated run, random resized crop (scale 0.7-1.0) and horizontal / vertical flips
  (``001_`` §4.1).
* :class:`ViTClassifier` — the MAE's encoder (patch embedding, class token, blocks) with a linear head on the mean
  patch token; :func:`layerwise_param_groups` gives layer-wise lr decay (0.75 per block below the head, ``001_``
  §4.2) and :func:`scheduled_lr` the warm-up + cosine schedule.
* :func:`encoder_state` — the encoder part of a Fed-MAE model, the weights file the encoder registry loads as
  ``fedmae_vit`` (a foundation model the federation trains for itself, for FMCL / PACFL / FECFL signatures).

PreP-WFL (Eq. 1-3) is :func:`fedmed.algorithms.aggregation.prep_weights` on the sites' class-id sets (the only thing they
send in that round) and the weighted cross-entropy of :func:`fedmed.nn.train.train_local`.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

__all__ = ["VIT_SMALL", "ViTClassifier", "encoder_state", "layerwise_param_groups", "mae_loss", "mae_model",
           "patchify", "scheduled_lr", "train_mae_local"]

VIT_SMALL = {"img_size": 32, "patch_size": 4, "hidden_size": 128, "mlp_dim": 256, "num_layers": 4, "num_heads": 4,
             "decoder_hidden_size": 64, "decoder_mlp_dim": 128, "decoder_num_layers": 1, "decoder_num_heads": 4}
ENCODER_PREFIXES = ("patch_embedding.", "cls_token", "blocks.")


def mae_model(in_channels: int = 3, *, spec: dict | None = None, mask_ratio: float = 0.75, seed: int = 0):
    """A 2D masked autoencoder (MONAI ``MaskedAutoEncoderViT``) with fixed sin-cos position embeddings."""
    from monai.networks.nets import MaskedAutoEncoderViT

    s = {**VIT_SMALL, **(spec or {})}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return MaskedAutoEncoderViT(in_channels=in_channels, img_size=s["img_size"], patch_size=s["patch_size"],
                                    hidden_size=s["hidden_size"], mlp_dim=s["mlp_dim"], num_layers=s["num_layers"],
                                    num_heads=s["num_heads"], masking_ratio=mask_ratio,
                                    decoder_hidden_size=s["decoder_hidden_size"], decoder_mlp_dim=s["decoder_mlp_dim"],
                                    decoder_num_layers=s["decoder_num_layers"], decoder_num_heads=s["decoder_num_heads"],
                                    spatial_dims=2)


def patchify(x: torch.Tensor, p: int) -> torch.Tensor:
    """(B, C, H, W) -> (B, H/p * W/p, p*p*C), patches in the row-major order of MONAI's conv patch embedding."""
    b, c, h, w = x.shape
    x = x.reshape(b, c, h // p, p, w // p, p)
    return x.permute(0, 2, 4, 3, 5, 1).reshape(b, (h // p) * (w // p), p * p * c)


def mae_loss(model, x: torch.Tensor, mask_ratio: float | None = None) -> torch.Tensor:
    """Mean squared error of the reconstruction on the masked patches only."""
    pred, mask = model(x, masking_ratio=mask_ratio)
    target = patchify(x, model.patch_embedding.patch_embeddings.kernel_size[0])
    err = ((pred - target) ** 2).mean(dim=-1)
    return (err * mask).sum() / mask.sum().clamp_min(1)


def scheduled_lr(base: float, progress: float, warmup: float) -> float:
    """Linear warm-up over the first ``warmup`` fraction of the run, then cosine decay to 0 (``progress`` in [0, 1])."""
    if warmup > 0 and progress < warmup:
        return base * progress / warmup
    span = max(1e-12, 1.0 - warmup)
    return base * 0.5 * (1.0 + math.cos(math.pi * min(1.0, (progress - warmup) / span)))


def augment_ssl(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Random resized crop (area scale 0.7-1.0, aspect 3/4-4/3) back to the input size, then h/v flips p = 0.5."""
    n, _, h, w = x.shape
    out = []
    for i in range(n):
        scale = 0.7 + 0.3 * float(torch.rand(1, generator=generator))
        ratio = math.exp(math.log(3 / 4) + (math.log(4 / 3) - math.log(3 / 4)) * float(torch.rand(1, generator=generator)))
        ch = min(h, max(2, int(round(math.sqrt(scale * h * w / ratio)))))
        cw = min(w, max(2, int(round(math.sqrt(scale * h * w * ratio)))))
        y0 = int(torch.randint(0, h - ch + 1, (1,), generator=generator))
        x0 = int(torch.randint(0, w - cw + 1, (1,), generator=generator))
        crop = x[i:i + 1, :, y0:y0 + ch, x0:x0 + cw]
        img = nn.functional.interpolate(crop, size=(h, w), mode="bilinear", align_corners=False)[0]
        if float(torch.rand(1, generator=generator)) < 0.5:
            img = img.flip(-1)
        if float(torch.rand(1, generator=generator)) < 0.5:
            img = img.flip(-2)
        out.append(img)
    return torch.stack(out)


def train_mae_local(model, x: torch.Tensor, *, epochs: int, batch_size: int, optimizer, progress: tuple[float, float],
                    base_lr: float = 1.5e-4, warmup: float = 0.05, generator=None) -> dict:
    """Local Fed-MAE training on unlabeled images (N, C, H, W) in [0, 1].

    ``progress = (start, end)``: where this round sits in the whole federated run (for the lr schedule);
    lr = ``base_lr x batch_size / 256`` following MAE's scaling rule, warmed up then cosine-decayed.
    """
    from fedmed.core.device import model_device

    n = x.shape[0]
    if n == 0:
        raise ValueError("no unlabeled images")
    model.train()
    dev = model_device(model)
    peak = base_lr * batch_size / 256
    steps_total = epochs * max(1, math.ceil(n / batch_size))
    total, steps = 0.0, 0
    for _ in range(epochs):
        order = torch.randperm(n, generator=generator)
        for s in range(0, n, batch_size):
            frac = progress[0] + (progress[1] - progress[0]) * steps / steps_total
            for g in optimizer.param_groups:
                g["lr"] = scheduled_lr(peak, frac, warmup) * g.get("lr_scale", 1.0)
            xb = augment_ssl(x[order[s:s + batch_size]], generator).to(dev)
            with torch.random.fork_rng(devices=[]):  # MONAI draws the mask from torch's global generator: seed it
                torch.manual_seed(int(torch.randint(0, 2**62, (1,), generator=generator)))  # from the injected one
                loss = mae_loss(model, (xb - 0.5) / 0.5)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += float(loss.detach())
            steps += 1
    return {"loss": total / max(steps, 1), "steps": steps}


@torch.no_grad()
def mae_eval_loss(model, x: torch.Tensor, seed: int = 0, batch_size: int = 128) -> float:
    """Reconstruction loss on held-out images with a fixed random mask (comparable across rounds)."""
    if x.shape[0] == 0:
        return float("nan")
    from fedmed.core.device import model_device

    model.eval()
    dev = model_device(model)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vals = [float(mae_loss(model, (x[s:s + batch_size].to(dev) - 0.5) / 0.5)) * min(batch_size, x.shape[0] - s)
                for s in range(0, x.shape[0], batch_size)]
    return sum(vals) / x.shape[0]


def encoder_state(mae_params: dict) -> dict:
    """The encoder part of a Fed-MAE model's parameters (patch embedding, class token, blocks)."""
    return {k: v for k, v in mae_params.items() if k.startswith(ENCODER_PREFIXES)}


class ViTClassifier(nn.Module):
    """The MAE's encoder (no masking) with a linear head on the mean of the patch tokens.

    ``forward_features`` returns the pooled ``hidden_size`` embedding (the Fed-MAE encoder of the registry).
    """

    def __init__(self, in_channels: int = 3, num_classes: int = 10, spec: dict | None = None):
        super().__init__()
        mae = mae_model(in_channels, spec=spec)
        # MONAI's MAE encoder: patch embedding, class token, transformer blocks (ending with its LayerNorm)
        self.patch_embedding, self.cls_token, self.blocks = mae.patch_embedding, mae.cls_token, mae.blocks
        self.head = nn.Linear(mae.cls_token.shape[-1], num_classes)

    def forward_features(self, x):
        x = self.patch_embedding(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        return self.blocks(x)[:, 1:].mean(dim=1)

    def forward(self, x):
        return self.head(self.forward_features(x))


def layerwise_param_groups(model: ViTClassifier, decay: float = 0.75) -> list[dict]:
    """Parameter groups with ``lr_scale = decay ** (depth from the top)``: head and final norm 1, the last block
    ``decay``, ..., the patch embedding and class token ``decay ** (L + 1)`` (BEiT / MAE fine-tuning)."""
    transformer = [i for i, b in enumerate(model.blocks) if not isinstance(b, nn.LayerNorm)]
    L = len(transformer)
    groups: dict[float, list] = {}
    for name, p in model.named_parameters():
        if name.startswith("blocks."):
            i = int(name.split(".")[1])
            depth = L - transformer.index(i) if i in transformer else 0  # the encoder's final LayerNorm: as the head
        elif name.startswith("head."):
            depth = 0
        else:  # patch embedding, class token
            depth = L + 1
        groups.setdefault(decay ** depth, []).append(p)
    return [{"params": ps, "lr_scale": s} for s, ps in sorted(groups.items())]
