"""Classification networks: ResNet-9 (fedmed) and ResNet-18 (MONAI), 1 or 3 input channels."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["ResNet9", "build_model", "feature_extractor"]


def _conv_bn(cin, cout, pool=False):
    layers = [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]
    if pool:
        layers.append(nn.MaxPool2d(2))
    return nn.Sequential(*layers)


class _Residual(nn.Module):
    def __init__(self, ch):
        super().__init__()
        self.body = nn.Sequential(_conv_bn(ch, ch), _conv_bn(ch, ch))

    def forward(self, x):
        return x + self.body(x)


class ResNet9(nn.Module):
    """The DAWNBench ResNet-9 (prep, 3 pooled stages, 2 residual blocks) with width ``w``.

    Channels are ``w, 2w, 4w, 8w`` (``w = 64`` is the original; fedmed defaults to 16 for CPU).
    ``forward_features`` returns the pooled ``8w``-dimensional latent (Flux's final hidden layer).
    """

    def __init__(self, in_channels: int = 1, num_classes: int = 10, width: int = 16):
        super().__init__()
        w = width
        self.features = nn.Sequential(
            _conv_bn(in_channels, w), _conv_bn(w, 2 * w, pool=True), _Residual(2 * w),
            _conv_bn(2 * w, 4 * w, pool=True), _conv_bn(4 * w, 8 * w, pool=True), _Residual(8 * w),
            nn.AdaptiveMaxPool2d(1), nn.Flatten())
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


def build_model(arch: str, in_channels: int, num_classes: int, *, width: int = 16, seed: int = 0) -> nn.Module:
    """A freshly initialised classifier; the same seed gives the same weights everywhere."""
    if in_channels not in (1, 3):
        raise ValueError(f"in_channels should be 1 or 3, got {in_channels}.")
    if num_classes < 2:
        raise ValueError(f"num_classes should be >= 2, got {num_classes}.")
    if arch not in ("resnet9", "resnet18"):
        raise ValueError(f"arch should be 'resnet9' or 'resnet18', got {arch!r}.")
    with torch.random.fork_rng(devices=[]):  # seeded init without touching the caller's RNG state
        torch.manual_seed(seed)
        return ResNet9(in_channels, num_classes, width) if arch == "resnet9" else _MonaiResNet18(in_channels, num_classes)


def feature_extractor(model: nn.Module):
    """``x -> latent`` of a classifier built by :func:`build_model`."""
    return model.forward_features
