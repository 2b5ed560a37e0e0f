"""Classification networks: ResNet-9 (fedmed), ResNet-18 (MONAI) and a small ViT (``fedmed.ssl``), 1 or 3 input
channels."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["ResNet9", "build_model", "feature_extractor", "model_from_config"]


def _norm(kind: str, ch: int) -> nn.Module:
    if kind == "batch":
        return nn.BatchNorm2d(ch)
    groups = 8
    while ch % groups:
        groups //= 2
    return nn.GroupNorm(groups, ch)


def _conv_bn(cin, cout, pool=False, norm="batch"):
    layers = [nn.Conv2d(cin, cout, 3, padding=1, bias=False), _norm(norm, cout), nn.ReLU(inplace=True)]
    if pool:
        layers.append(nn.MaxPool2d(2))
    return nn.Sequential(*layers)


class _Residual(nn.Module):
    def __init__(self, ch, norm="batch"):
        super().__init__()
        self.body = nn.Sequential(_conv_bn(ch, ch, norm=norm), _conv_bn(ch, ch, norm=norm))

    def forward(self, x):
        return x + self.body(x)


class ResNet9(nn.Module):
    """The DAWNBench ResNet-9 (prep, 3 pooled stages, 2 residual blocks) with width ``w``.

    Channels are ``w, 2w, 4w, 8w`` (``w = 64`` is the original; fedmed defaults to 16 for CPU).
    ``norm="group"`` replaces BatchNorm by GroupNorm (up to 8 groups): batch statistics of FL's tiny,
    label-skewed local batches are noisy and BatchNorm's running statistics average badly across
    sites (Hsieh et al. 2020). ``forward_features`` returns the pooled ``8w``-dimensional latent
    (Flux's final hidden layer).
    """

    def __init__(self, in_channels: int = 1, num_classes: int = 10, width: int = 16, norm: str = "batch"):
        super().__init__()
        if norm not in ("batch", "group"):
            raise ValueError(f"norm should be 'batch' or 'group', got {norm!r}.")
        w = width
        self.features = nn.Sequential(
            _conv_bn(in_channels, w, norm=norm), _conv_bn(w, 2 * w, pool=True, norm=norm), _Residual(2 * w, norm),
            _conv_bn(2 * w, 4 * w, pool=True, norm=norm), _conv_bn(4 * w, 8 * w, pool=True, norm=norm),
            _Residual(8 * w, norm), nn.AdaptiveMaxPool2d(1), nn.Flatten())
        self.fc = nn.Linear(8 * w, num_classes)

    def forward_features(self, x):
        return self.features(x)

    def forward(self, x):
        return self.fc(self.features(x))


class _MonaiResNet18(nn.Module):
    def __init__(self, in_channels, num_classes):
        super().__init__()
        from monai.networks.nets import resnet18

        self.net = resnet18(spatial_dims=2, n_input_channels=in_channels, num_classes=num_classes)

    def forward_features(self, x):
        n = self.net
        x = n.maxpool(n.act(n.bn1(n.conv1(x))))
        x = n.layer4(n.layer3(n.layer2(n.layer1(x))))
        return torch.flatten(n.avgpool(x), 1)

    def forward(self, x):
        return self.net.fc(self.forward_features(x))


def build_model(arch: str, in_channels: int, num_classes: int, *, width: int = 16, seed: int = 0,
                norm: str = "batch") -> nn.Module:
    """A freshly initialised classifier; the same seed gives the same weights everywhere."""
    if in_channels not in (1, 3):
        raise ValueError(f"in_channels should be 1 or 3, got {in_channels}.")
    if num_classes < 2:
        raise ValueError(f"num_classes should be >= 2, got {num_classes}.")
    if arch not in ("resnet9", "resnet18", "vit_small"):
        raise ValueError(f"arch should be 'resnet9', 'resnet18' or 'vit_small', got {arch!r}.")
    with torch.random.fork_rng(devices=[]):  # seeded init without touching the caller's RNG state
        torch.manual_seed(seed)
        if arch == "resnet9":
            return ResNet9(in_channels, num_classes, width, norm)
        if arch == "vit_small":
            from .ssl import ViTClassifier

            return ViTClassifier(in_channels, num_classes)
        return _MonaiResNet18(in_channels, num_classes)


def model_from_config(model_cfg: dict, in_channels: int, num_classes: int, seed: int = 0) -> nn.Module:
    """:func:`build_model` from a config's ``model`` section (a dict)."""
    return build_model(model_cfg["arch"], in_channels, num_classes, width=model_cfg.get("width", 16), seed=seed,
                       norm=model_cfg.get("norm", "batch"))


def feature_extractor(model: nn.Module):
    """``x -> latent`` of a classifier built by :func:`build_model`."""
    return model.forward_features
