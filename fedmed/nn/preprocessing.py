"""A MONAI bundle's intensity preprocessing as fedmed's sites apply it (``model.preprocessing``, docs/recipes.md).

The steps are data (``[{"name": ..., "args": {...}}]``); each is rebuilt here by name from ``monai.transforms``
(:data:`fedmed.core.schema.INPUT_TRANSFORMS` only). A 2D network gets them on each input by a forward pre-hook
(:func:`with_preprocessing`); a 3D case gets them whole, where it is read (:func:`case_transform`)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

__all__ = ["case_transform", "input_transform", "with_preprocessing"]


def input_transform(steps):
    """``model.preprocessing`` as one callable: the named transforms of ``monai.transforms``, in order, each built from
    its plain arguments (:data:`fedmed.core.schema.INPUT_TRANSFORMS` only: the schema refuses any other)."""
    import monai.transforms as mt

    from fedmed.core.schema import INPUT_TRANSFORMS

    fns = []
    for s in steps:
        if s["name"] not in INPUT_TRANSFORMS:  # the schema's check, again where the transform is built
            raise ValueError(f"model.preprocessing: {s['name']!r} is not one of {', '.join(INPUT_TRANSFORMS)}")
        fns.append(getattr(mt, s["name"])(**dict(s.get("args") or {})))
    return mt.Compose(fns)


def with_preprocessing(model: nn.Module, steps, *, scaled: bool) -> nn.Module:
    """``model`` applying ``steps`` (``model.preprocessing``: a MONAI bundle's intensity transforms) to each input
    before its forward, by a forward pre-hook (its state dict, hence the exchanged weights, stay the network's own).
    ``scaled``: the input arrives as fedmed feeds a classifier, ``(x - 0.5) / 0.5`` of its [0, 1] reading; the steps
    get that [0, 1] image (a segmentation network's input arrives as read). An empty list: the [0, 1] image alone."""
    if steps is None:
        return model
    from monai.data import MetaTensor

    t = input_transform(steps)

    def hook(module, args):
        x = args[0]
        raw = x * 0.5 + 0.5 if scaled else x.clone()  # MONAI's transforms work in place: never on the caller's batch
        outs = []
        for xi in raw:
            y = t(xi)
            outs.append(y.as_tensor() if isinstance(y, MetaTensor) else torch.as_tensor(y))
        return (torch.stack(outs).to(dtype=x.dtype, device=x.device),) + tuple(args[1:])

    model.register_forward_pre_hook(hook)
    return model


def case_transform(steps):
    """``model.preprocessing`` (a bundle's intensity transforms) as a function of one (C, D, H, W) image (numpy) ->
    the same, applied to the whole case as read (cropped and resampled), before any patch or window; None: identity."""
    if steps is None:
        return lambda image: image
    from monai.data import MetaTensor

    t = input_transform(steps)

    def f(image):
        y = t(torch.from_numpy(np.array(image, dtype=np.float32, copy=True)))  # MONAI's transforms work in place
        y = y.as_tensor() if isinstance(y, MetaTensor) else torch.as_tensor(y)
        return y.numpy().astype(np.float32)
    return f
