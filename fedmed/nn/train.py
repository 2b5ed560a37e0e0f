"""Local training and evaluation of a classifier (torch), framework-free.

The recipe (``TrainConfig``; chosen once on validation data, docs/readings.md "2D recipe"):
SGD, Adam or AdamW; cross-entropy (optionally PreP-weighted, ``001_`` Eq. 3); FedProx's proximal
term ``mu/2 ||w - w_global||^2`` (Li et al. 2020) when ``mu > 0``; horizontal flips and random
crops of a 4-pixel zero-padded image. The optimizer is created by the caller and may be kept
between rounds (its state then carries over, as NVFlare's Client API examples do by creating it
once per site).
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch
from torch import nn

from fedmed.algorithms.metrics import site_metrics
from fedmed.nn.resident import DeviceImages

__all__ = ["augment_batch", "evaluate", "get_params", "make_optimizer", "norm_statistics", "set_params", "train_local"]


def get_params(model: nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}


def set_params(model: nn.Module, params: Mapping[str, np.ndarray]) -> None:
    """Load numpy params into ``model`` in place (its Parameter objects stay the same, so an optimizer
    built on them keeps working); a missing/unexpected key or shape is a clear error."""
    state = model.state_dict()
    missing = sorted(set(state) - set(params))
    extra = sorted(set(params) - set(state))
    if missing or extra:
        raise ValueError(f"model parameters do not match the architecture: missing {missing[:3]}, unexpected {extra[:3]}")
    new = {}
    for k, v in state.items():
        a = np.asarray(params[k])
        if tuple(a.shape) != tuple(v.shape):
            raise ValueError(f"parameter '{k}' has shape {tuple(a.shape)}, the model expects {tuple(v.shape)}")
        new[k] = torch.as_tensor(a, dtype=v.dtype)
    model.load_state_dict(new)


def norm_keys(model: nn.Module) -> list[str]:
    """The state-dict keys of ``model``'s batch-norm layers (affine weights and biases, running statistics): what a
    FedBN site keeps for itself (Li et al. 2021, "FedBN: federated learning on non-IID features via local batch
    normalization")."""
    keys = []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.modules.batchnorm._NormBase):
            keys += [f"{name}.{k}" if name else k for k in mod.state_dict()]
    return keys


def make_optimizer(model: nn.Module, train: Mapping, model_cfg: Mapping | None = None) -> torch.optim.Optimizer:
    """The optimizer of a ``train`` config section (``optimizer``, ``lr``, ``momentum``, ``weight_decay``; what it
    leaves out: the defaults of :class:`fedmed.core.schema.TrainConfig`), with the recipe's learning rate for the
    parts of the network (``backbone_lr_scale``, :mod:`fedmed.nn.recipe`; ``model_cfg``: the ``model`` section,
    which says whether the network started from weights)."""
    from fedmed.core.device import fused_kwargs
    from fedmed.core.schema import TrainTask
    from fedmed.nn.recipe import param_groups, resolved

    t = train if isinstance(train, TrainTask) else TrainTask.model_validate(dict(train))
    kind, lr, wd = t.optimizer, t.lr, t.weight_decay
    params = param_groups(model, lr, resolved(t, model_cfg or {})["backbone_lr_scale"]) or model.parameters()
    fused = fused_kwargs(model)  # on a GPU: one kernel, and a step skipped without a host read
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=t.momentum, weight_decay=wd, **fused)
    if kind == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=wd, **fused)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=wd, **fused)
    raise ValueError(f"optimizer should be 'sgd', 'adam' or 'adamw', got {kind!r}.")


def augment_batch(x: torch.Tensor, mode: str, generator: torch.Generator | None) -> torch.Tensor:
    """``"flip"``: horizontal flip with p = 0.5; ``"flip_crop"``: plus a random crop of the image padded by
    4 pixels (zeros), per sample; ``"none"``: unchanged."""
    if mode == "none":
        return x
    if mode not in ("flip", "flip_crop"):
        raise ValueError(f"augment should be 'none', 'flip' or 'flip_crop', got {mode!r}.")
    n = x.shape[0]
    flip = torch.rand(n, generator=generator) < 0.5
    x = torch.where(flip[:, None, None, None], x.flip(-1), x)
    if mode == "flip_crop":
        pad = 4
        h, w = x.shape[-2:]
        xp = torch.nn.functional.pad(x, (pad, pad, pad, pad))
        dy = torch.randint(0, 2 * pad + 1, (n,), generator=generator)
        dx = torch.randint(0, 2 * pad + 1, (n,), generator=generator)
        x = torch.stack([xp[i, :, dy[i]:dy[i] + h, dx[i]:dx[i] + w] for i in range(n)])
    return x


def train_local(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, epochs: int = 1, batch_size: int = 16,
                optimizer: torch.optim.Optimizer | None = None, lr: float = 0.01, momentum: float = 0.9,
                weight_decay: float = 0.0, mu: float | None = None, class_weights=None,
                generator: torch.Generator | None = None, augment: str = "flip", lr_at=None,
                precision: str = "fp32", anchor: list | None = None, frozen_norm: bool = False) -> dict:
    """Run ``epochs`` over (x, y) in place; returns ``{"loss": mean loss, "steps": n}``.

    ``optimizer`` (kept by the caller between rounds) defaults to a fresh SGD with ``lr``/``momentum``.
    ``generator`` (seeded by the caller) drives shuffling and augmentation. A trailing batch of one
    sample is skipped (BatchNorm cannot normalise it in train mode) unless the site has one sample.
    ``lr_at(f)`` (optional) gives the learning rate at fraction ``f`` of this call's steps; each parameter group's
    ``lr_scale`` multiplies it (layer-wise decay). ``class_weights`` gives PyTorch's weighted cross-entropy: per batch,
    ``sum_i w_{y_i} l_i / sum_i w_{y_i}`` (docs/readings.md, PreP-WFL Eq. 3). Batches go to the model's device
    (shuffling and augmentation stay on the CPU, so a seed gives the same batches anywhere); ``precision``: fp32,
    bf16 or fp16 autocast (:mod:`fedmed.core.device`). ``x`` may be a :class:`fedmed.nn.resident.DeviceImages` (a
    GPU site's split kept on its device): then each batch is gathered, flipped and cropped there from the same draws
    of ``generator`` (the same batches), the loss and the skipped steps stay on the device until the end, and with a
    fused optimizer a non-finite step is skipped without a host read. ``frozen_norm``: batch-norm layers normalise
    with their running statistics and leave them as they are (the recipe's ``norm_stats: frozen``); their weights
    still train.
    """
    from fedmed.core.device import autocast, backward_step, grad_scaler, model_device

    n = x.shape[0]
    if n == 0:
        raise ValueError("no training samples")
    from fedmed.nn.recipe import norm_layers

    frozen = norm_layers(model) if frozen_norm else []

    def train_mode():
        model.train()
        for m in frozen:
            m.eval()

    train_mode()
    opt = optimizer or torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    device = model_device(model)
    scaler = grad_scaler(device, precision)
    w = None if class_weights is None else torch.as_tensor(np.asarray(class_weights), dtype=torch.float32, device=device)
    loss_fn = nn.CrossEntropyLoss(weight=w)
    # the proximal term's centre: the model as it starts (FedProx), or the one given (Ditto: the global model)
    anchor = (anchor if anchor is not None else [p.detach().clone() for p in model.parameters()]) if mu else None
    if isinstance(x, DeviceImages):
        total, steps, skipped = _epochs_on_device(model, x, y, opt, loss_fn, scaler, train_mode, epochs=epochs,
                                                  batch_size=batch_size, generator=generator, augment=augment,
                                                  lr_at=lr_at, precision=precision, anchor=anchor, mu=mu)
        model.train()
        return {"loss": total / max(steps, 1), "steps": steps, "skipped": skipped}
    total, steps, skipped = 0.0, 0, 0
    per_epoch = _steps_per_epoch(n, batch_size)
    for _ in range(epochs):
        order = torch.randperm(n, generator=generator)
        for s in range(0, n, batch_size):
            idx = order[s:s + batch_size]
            if idx.numel() < 2 and n >= 2:
                continue
            _schedule(opt, lr_at, steps / max(1, epochs * per_epoch))
            xb, yb = augment_batch(x[idx], augment, generator).to(device), y[idx].to(device)
            if idx.numel() == 1:
                model.eval()  # a single sample cannot be batch-normalised in train mode
            with autocast(device, precision):
                out = model((xb - 0.5) / 0.5)
                loss = loss_fn(out.float(), yb)
            if anchor is not None:
                loss = loss + 0.5 * mu * sum(((p - a) ** 2).sum() for p, a in zip(model.parameters(), anchor))
            skipped += not backward_step(loss, opt, scaler)
            train_mode()
            total += float(loss.detach())
            steps += 1
    model.train()  # handed back in train mode (frozen batch norm only while this call trains)
    return {"loss": total / max(steps, 1), "steps": steps, "skipped": skipped}


def _steps_per_epoch(n: int, batch_size: int) -> int:
    """Batches that train per epoch: a trailing batch of one is skipped unless the site has one sample."""
    return sum(1 for s in range(0, n, batch_size) if n - s >= 2 or n < 2)


def _schedule(opt, lr_at, frac: float) -> None:
    """``lr_at(frac)`` as every parameter group's learning rate, times its ``lr_scale`` (layer-wise decay)."""
    if lr_at is not None:
        lr_now = lr_at(frac)
        for g in opt.param_groups:
            g["lr"] = lr_now * g.get("lr_scale", 1.0)


def _epochs_on_device(model, x, y, opt, loss_fn, scaler, train_mode, *, epochs, batch_size, generator, augment,
                      lr_at, precision, anchor, mu):
    """:func:`train_local`'s epochs over images kept on the device (:class:`~fedmed.nn.resident.DeviceImages`): the
    same draws, batches and steps as its CPU loop, with nothing read back to the host until the end."""
    from fedmed.core.device import autocast, backward_step_on_device, model_device, uses_channels_last
    from fedmed.nn.resident import augment_on_device, epoch_draws

    device = model_device(model)
    n = len(x)
    yd = y.to(device)
    cl = uses_channels_last(model)
    total = torch.zeros((), dtype=torch.float64, device=device)
    skipped = torch.zeros((), device=device)
    steps = 0
    per_epoch = _steps_per_epoch(n, batch_size)
    for _ in range(epochs):
        host = epoch_draws(n, batch_size, augment, generator)
        dev = host.on(device)
        for s in range(0, n, batch_size):
            if s not in host.starts:
                continue
            _schedule(opt, lr_at, steps / max(1, epochs * per_epoch))
            idx, flips, crop = dev.batch(s, batch_size)
            xb = augment_on_device(x.take(idx if x.resident else host.batch(s, batch_size)[0]), flips, crop)
            yb = yd.index_select(0, idx)
            if cl:
                xb = xb.contiguous(memory_format=torch.channels_last)
            if idx.numel() == 1:
                model.eval()  # a single sample cannot be batch-normalised in train mode
            with autocast(device, precision):
                out = model((xb - 0.5) / 0.5)
                loss = loss_fn(out.float(), yb)
            if anchor is not None:
                loss = loss + 0.5 * mu * sum(((p - a) ** 2).sum() for p, a in zip(model.parameters(), anchor))
            skipped += backward_step_on_device(loss, opt, scaler)
            train_mode()
            total += loss.detach().double()
            steps += 1
    return float(total), steps, int(skipped)


def _input_batches(x, dev, batch_size: int, channels_last: bool = False):
    """``x`` (a CPU tensor or :class:`~fedmed.nn.resident.DeviceImages`) in order, ``batch_size`` images at a time,
    normalised on ``dev``."""
    it = x.batches(batch_size) if isinstance(x, DeviceImages) else \
        (x[s:s + batch_size].to(dev) for s in range(0, x.shape[0], batch_size))
    for xb in it:
        xb = (xb - 0.5) / 0.5
        yield xb.contiguous(memory_format=torch.channels_last) if channels_last else xb


@torch.no_grad()
def norm_statistics(model: nn.Module, x, batch_size: int) -> tuple[dict[str, np.ndarray], int]:
    """The running statistics ``model``'s batch-norm layers hold after one pass over ``x`` (in order, ``batch_size``
    images a batch, the loop's input scaling) with a cumulative average over the batches — PyTorch's
    :func:`torch.optim.swa_utils.update_bn` on a copy, ``model`` itself untouched — as ``{state-dict key:
    array}`` of every ``running_mean`` and ``running_var``, and the number of batches. Sites' statistics weighted
    by their batches (:func:`fedmed.algorithms.aggregation.pooled_norm_stats`) are the statistics of one such pass
    over all their batches: FedAvg's averaged running statistics are not those of the averaged network."""
    import copy

    from torch.optim.swa_utils import update_bn

    from fedmed.core.device import model_device, uses_channels_last

    m = copy.deepcopy(model)
    update_bn(_input_batches(x, model_device(m), int(batch_size), uses_channels_last(m)), m)  # streamed, not held
    out = {}
    for name, mod in m.named_modules():
        if isinstance(mod, nn.modules.batchnorm._BatchNorm) and mod.track_running_stats:
            pre = f"{name}." if name else ""
            out[pre + "running_mean"] = mod.running_mean.detach().cpu().numpy().copy()
            out[pre + "running_var"] = mod.running_var.detach().cpu().numpy().copy()
    return out, -(-int(len(x)) // int(batch_size))  # the batches of the pass: ceil(n / batch_size)


def scoring_batch(dev) -> int:
    """Images per forward pass when scoring: 256 on a GPU (filling it), 128 on the CPU (as before)."""
    return 256 if torch.device(dev).type == "cuda" else 128


@torch.no_grad()
def predict_proba(model: nn.Module, x, batch_size: int | None = None, precision: str = "fp32") -> np.ndarray:
    """Class probabilities of ``model`` on ``x`` (a CPU tensor, or a split kept on the device), in the training
    precision; on a GPU everything stays there until the one copy of the result."""
    from fedmed.core.device import autocast, model_device, uses_channels_last

    model.eval()
    dev = model_device(model)
    outs = []
    for xb in _input_batches(x, dev, batch_size or scoring_batch(dev), uses_channels_last(model)):
        with autocast(dev, precision):
            out = model(xb)
        outs.append(torch.softmax(out.float(), dim=1))
    return torch.cat(outs).cpu().numpy() if outs else np.zeros((0, 0))


@torch.no_grad()
def latents(model: nn.Module, x, batch_size: int | None = None) -> np.ndarray:
    """Final-hidden-layer activations (Flux's latents)."""
    from fedmed.core.device import model_device, uses_channels_last

    model.eval()
    dev = model_device(model)
    outs = [model.forward_features(xb).float()
            for xb in _input_batches(x, dev, batch_size or scoring_batch(dev), uses_channels_last(model))]
    return torch.cat(outs).cpu().numpy() if outs else np.zeros((0, 0))


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, n_classes: int, *, k_min: int = 1) -> dict:
    """:func:`fedmed.algorithms.metrics.site_metrics` of the model on (x, y)."""
    prob = predict_proba(model, x) if x.shape[0] else np.zeros((0, n_classes))
    return site_metrics(y.numpy(), prob, n_classes, k_min=k_min)
