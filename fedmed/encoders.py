"""Frozen feature extractors for client signatures (FMCL, PACFL, FECFL) and site embeddings.

Registry (architectures of the papers' foundation models; weights never downloaded):

| name | architecture | input | dim |
|---|---|---|---|
| ``vit_tiny`` | timm ``vit_tiny_patch16_224`` (ViT-Tiny, FMCL's ImageNet encoder) | 3 x S x S | 192 |
| ``ctranspath`` | CTransPath-style Swin-T: timm ``swin_tiny_patch4_window7_224`` with a convolutional stem (CHIEF's tile encoder) | 3 x 224 x 224 | 768 |
| ``usfm`` | ViT-B/16 (MONAI ``ViT``; USFM's backbone) | 3 x 224 x 224 | 768 |
| ``random_cnn`` | a 4-block CNN (FECFL's "randomly initialised lightweight encoder") | C x S x S | 128 |
| ``pixels`` | raw flattened pixels (PACFL's original input) | C x S x S | C S^2 |
| ``medicalnet_resnet18`` | MONAI ``resnet18(spatial_dims=3, shortcut_type="A", bias_downsample=True)`` (MedicalNet layout) | 1 x D x H x W | 512 |
| ``fedmae_vit`` | the encoder of a Fed-MAE run (``fedmed.ssl``, small ViT; weights: its ``models/encoder.pt``) | 3 x 32 x 32 | 128 |

Each encoder either loads a local weights file (``.pt``/``.pth``/``.safetensors``; a wrapping
``{"state_dict": ...}`` or ``{"model": ...}`` and ``module.`` prefixes are unwrapped; missing,
unexpected or mis-shaped keys are a clear error) or runs in an explicit seeded ``random`` mode.
:attr:`Encoder.description` says which, and every report prints it.

timm imports torchvision, whose only build here is a CUDA one that fails to import on CPU torch
(``operator torchvision::nms does not exist``). :func:`import_timm` defines the two operator
schemas torchvision's meta registrations expect before the first import; torchvision's compiled
ops (nms, roi_align) are not used by these encoders and would raise if called.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import nn

__all__ = ["ENCODERS", "Encoder", "EncoderError", "build_encoder", "extract_features", "import_timm"]


class EncoderError(ValueError):
    """Bad encoder name or weights file; the message names the file and the offending keys."""


_TIMM = None


def import_timm():
    """Import timm on CPU-only torch (see the module notes); idempotent."""
    global _TIMM
    if _TIMM is None:
        try:
            import torchvision  # noqa: F401
        except RuntimeError:
            lib = torch.library.Library("torchvision", "DEF")
            lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            import sys

            for k in [k for k in sys.modules if k.startswith("torchvision")]:
                del sys.modules[k]
            _import_timm_lib = lib  # keep the library object alive for the process
            globals()["_TV_LIB"] = _import_timm_lib
        import timm

        _TIMM = timm
    return _TIMM


class _ConvStem(nn.Module):
    """CTransPath's convolutional patch embedding (two stride-2 convs) for Swin-T."""

    def __init__(self, img_size=224, patch_size=4, in_chans=3, embed_dim=96, norm_layer=None, flatten=False,
                 output_fmt=None, **kwargs):
        super().__init__()
        self.img_size = (img_size, img_size) if isinstance(img_size, int) else tuple(img_size)
        self.patch_size = (patch_size, patch_size)
        self.grid_size = (self.img_size[0] // 4, self.img_size[1] // 4)
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        layers, cin, cout = [], in_chans, embed_dim // 8
        for _ in range(2):
            layers += [nn.Conv2d(cin, cout, 3, 2, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]
            cin, cout = cout, cout * 2
        layers.append(nn.Conv2d(cin, embed_dim, 1))
        self.proj = nn.Sequential(*layers)
        self.norm = norm_layer(embed_dim) if norm_layer else nn.Identity()

    def forward(self, x):
        return self.norm(self.proj(x).permute(0, 2, 3, 1))  # NHWC, as timm's Swin expects


class _RandomCNN(nn.Module):
    def __init__(self, in_channels: int):
        super().__init__()
        chans = [in_channels, 16, 32, 64, 128]
        blocks = []
        for a, b in zip(chans, chans[1:]):
            blocks += [nn.Conv2d(a, b, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2, ceil_mode=True)]
        self.net = nn.Sequential(*blocks, nn.AdaptiveAvgPool2d(1), nn.Flatten())

    def forward(self, x):
        return self.net(x)


class _Pixels(nn.Module):
    def forward(self, x):
        return x.flatten(1)


class _MonaiViT(nn.Module):
    def __init__(self, img_size):
        super().__init__()
        from monai.networks.nets import ViT

        self.vit = ViT(in_channels=3, img_size=(img_size, img_size), patch_size=16, hidden_size=768, mlp_dim=3072,
                       num_layers=12, num_heads=12, classification=False, spatial_dims=2)

    def forward(self, x):
        out, _ = self.vit(x)
        return out.mean(dim=1)


class _MedicalNet18(nn.Module):
    def __init__(self):
        super().__init__()
        from monai.networks.nets import resnet18

        self.net = resnet18(spatial_dims=3, n_input_channels=1, feed_forward=False, shortcut_type="A",
                            bias_downsample=True)

    def bottleneck(self, x):
        n = self.net
        x = n.maxpool(n.act(n.bn1(n.conv1(x)))) if not n.no_max_pool else n.act(n.bn1(n.conv1(x)))
        return n.layer4(n.layer3(n.layer2(n.layer1(x))))

    def forward(self, x):
        return torch.flatten(self.net.avgpool(self.bottleneck(x)), 1)


class _FedMAEViT(nn.Module):
    """The encoder of a Fed-MAE run (``fedmed.ssl``): patch embedding, class token, blocks; mean patch token."""

    def __init__(self, in_channels, img_size):
        super().__init__()
        from .ssl import mae_model

        mae = mae_model(in_channels, spec={"img_size": img_size})
        self.patch_embedding, self.cls_token, self.blocks = mae.patch_embedding, mae.cls_token, mae.blocks

    def forward(self, x):
        x = self.patch_embedding(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        return self.blocks(x)[:, 1:].mean(dim=1)


def _vit_tiny(c, s):
    return import_timm().create_model("vit_tiny_patch16_224", pretrained=False, num_classes=0, img_size=s)


def _ctranspath(c, s):
    return import_timm().create_model("swin_tiny_patch4_window7_224", pretrained=False, num_classes=0,
                                      embed_layer=_ConvStem, img_size=s)


ENCODERS: dict[str, dict] = {
    "vit_tiny": {"build": _vit_tiny, "channels": 3, "size": 224, "dim": 192},
    "ctranspath": {"build": _ctranspath, "channels": 3, "size": 224, "dim": 768},
    "usfm": {"build": lambda c, s: _MonaiViT(s), "channels": 3, "size": 224, "dim": 768},
    "random_cnn": {"build": lambda c, s: _RandomCNN(c), "channels": None, "size": None, "dim": 128},
    "pixels": {"build": lambda c, s: _Pixels(), "channels": None, "size": None, "dim": None},
    "medicalnet_resnet18": {"build": lambda c, s: _MedicalNet18(), "channels": 1, "size": None, "dim": 512},
    "fedmae_vit": {"build": lambda c, s: _FedMAEViT(c, s), "channels": 3, "size": 32, "dim": 128},
}


@dataclass
class Encoder:
    name: str
    module: nn.Module
    in_channels: int
    image_size: int | None
    weights: str  # "random(seed=N)", "none (raw pixels)" or the weights file
    dim: int | None

    @property
    def description(self) -> str:
        n = sum(p.numel() for p in self.module.parameters())
        return f"{self.name} [{self.weights}; {n / 1e6:.2f}M params]"


def _unwrap(state):
    for key in ("state_dict", "model", "module"):
        if isinstance(state, dict) and key in state and isinstance(state[key], dict):
            state = state[key]
    return {(k[len("module."):] if k.startswith("module.") else k): v for k, v in state.items()}


def load_weights(module: nn.Module, path: str, name: str) -> None:
    """Strictly load a local weights file into ``module``; mismatches are a clear error."""
    p = Path(path)
    if not p.is_file():
        raise EncoderError(f"{name}: weights file {p} not found")
    try:
        if p.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(p))
        else:
            state = torch.load(str(p), map_location="cpu", weights_only=True)
    except Exception as e:
        raise EncoderError(f"{name}: cannot read weights file {p} ({type(e).__name__}: {e})") from None
    state = _unwrap(state)
    own = module.state_dict()
    # MedicalNet checkpoints are saved from the bare ResNet; ours nests it under "net."
    if not (set(state) & set(own)) and any(k.startswith("net.") for k in own):
        state = {f"net.{k}": v for k, v in state.items()}
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    shapes = [f"{k}: file {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
              for k in sorted(set(own) & set(state)) if tuple(state[k].shape) != tuple(own[k].shape)]
    if missing or unexpected or shapes:
        raise EncoderError(f"{name}: weights file {p} does not match the architecture: "
                           f"{len(missing)} missing keys {missing[:3]}, {len(unexpected)} unexpected keys "
                           f"{unexpected[:3]}, {len(shapes)} shape mismatches {shapes[:3]}")
    module.load_state_dict(state)


def build_encoder(name: str, *, weights: str | None = None, seed: int = 0, in_channels: int = 1,
                  image_size: int | None = None) -> Encoder:
    """A frozen encoder in eval mode: ``weights`` file if given, else seeded random init.

    Args:
        in_channels: channels of the data (used by ``random_cnn``/``pixels``; 1-channel images
            are repeated to 3 for the 3-channel foundation models).
        image_size: input side length (default: the architecture's, e.g. 224).
    """
    if name not in ENCODERS:
        import difflib

        hint = difflib.get_close_matches(name, ENCODERS, n=1)
        raise EncoderError(f"unknown encoder {name!r}" + (f"; did you mean {hint[0]!r}?" if hint else "")
                           + f" (known: {sorted(ENCODERS)})")
    spec = ENCODERS[name]
    size = image_size or spec["size"]
    chans = spec["channels"] or in_channels
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = spec["build"](chans, size)
    if weights:
        load_weights(module, weights, name)
        desc = f"weights {weights_id(weights)}"
    else:
        desc = "none (raw pixels)" if name == "pixels" else f"random init (seed={seed}), no pretrained weights"
    module.eval()
    for p in module.parameters():
        p.requires_grad_(False)
    return Encoder(name, module, chans, size, desc, spec["dim"])


def weights_id(path) -> str:
    """How a weights file is named in a description that leaves a site: its file name and the first 12 hex
    digits of its SHA-256 — the same file gives the same id at every site, and no folder is shown."""
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return f"{Path(path).name} (sha256 {h.hexdigest()[:12]})"


@torch.no_grad()
def extract_features(encoder: Encoder, images: torch.Tensor, *, batch_size: int = 32,
                     progress: Callable[[str], None] | None = None) -> np.ndarray:
    """Batched, no-grad features of (N, C, H, W) images in [0, 1] -> (N, dim) float64.

    Each batch is brought to the encoder's input in one go: bilinear resize to its image size
    (``torch.nn.functional.interpolate``, as MONAI's ``Resize`` does per image), channel repeat (1 -> 3) for
    3-channel models, and intensity normalisation ``(x - 0.5) / 0.25`` (ImageNet-style input scale).
    """
    n = images.shape[0]
    if n == 0:
        return np.zeros((0, encoder.dim or 0))
    size = encoder.image_size
    outs = []
    t0 = time.time()
    for s in range(0, n, batch_size):
        outs.append(_encode_batch(encoder, images[s:s + batch_size], size))
        if progress and (s // batch_size) % 10 == 9:
            progress(f"{encoder.name}: {min(s + batch_size, n)}/{n} images, {time.time() - t0:.1f} s")
    feats = torch.cat(outs).numpy()
    if not np.isfinite(feats).all():
        raise EncoderError(f"{encoder.name}: features contain NaN or inf")
    return feats


def _encode_batch(encoder: Encoder, xb: torch.Tensor, size: int | None) -> torch.Tensor:
    xb = xb.float()
    if size and tuple(xb.shape[-2:]) != (size, size):
        xb = torch.nn.functional.interpolate(xb, size=(size, size), mode="bilinear", align_corners=False)
    if encoder.in_channels == 3 and xb.shape[1] == 1:
        xb = xb.repeat(1, 3, 1, 1)
    if encoder.name != "pixels":
        xb = (xb - 0.5) / 0.25
    return encoder.module(xb).reshape(xb.shape[0], -1).double()
