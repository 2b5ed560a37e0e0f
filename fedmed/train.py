"""Local training and evaluation of a classifier (torch), framework-free.

SGD with cross-entropy (optionally PreP-weighted, ``001_`` Eq. 3), and FedProx's proximal term
``mu/2 ||w - w_global||^2`` (Li et al. 2020) when ``mu > 0``.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch
from torch import nn

from .metrics import site_metrics

__all__ = ["evaluate", "get_params", "set_params", "train_local"]


def get_params(model: nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}


def set_params(model: nn.Module, params: Mapping[str, np.ndarray]) -> None:
    """Load numpy params into ``model``; a missing/unexpected key or shape is a clear error."""
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


def train_local(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, epochs: int = 1, batch_size: int = 16,
                lr: float = 0.01, momentum: float = 0.9, weight_decay: float = 0.0, mu: float = 0.0,
                class_weights=None, generator: torch.Generator | None = None, augment: bool = True) -> dict:
    """Run ``epochs`` of SGD over (x, y) in place; returns ``{"loss": mean loss, "steps": n}``.

    ``generator`` (seeded by the caller) drives shuffling and the horizontal-flip augmentation.
    BatchNorm layers see at least two samples per batch (a trailing batch of one is dropped).
    """
    n = x.shape[0]
    if n == 0:
        raise ValueError("no training samples")
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    w = None if class_weights is None else torch.as_tensor(np.asarray(class_weights), dtype=torch.float32)
    loss_fn = nn.CrossEntropyLoss(weight=w)
    anchor = [p.detach().clone() for p in model.parameters()] if mu > 0 else None
    total, steps = 0.0, 0
    for _ in range(epochs):
        order = torch.randperm(n, generator=generator)
        for s in range(0, n, batch_size):
            idx = order[s:s + batch_size]
            if idx.numel() < 2 and n >= 2:
                continue
            xb, yb = x[idx], y[idx]
            if augment:
                flip = torch.rand(xb.shape[0], generator=generator) < 0.5
                xb = torch.where(flip[:, None, None, None], xb.flip(-1), xb)
            if idx.numel() == 1:
                model.eval()  # a single sample cannot be batch-normalised in train mode
            out = model((xb - 0.5) / 0.5)
            loss = loss_fn(out, yb)
            if anchor is not None:
                loss = loss + 0.5 * mu * sum(((p - a) ** 2).sum() for p, a in zip(model.parameters(), anchor))
            opt.zero_grad()
            loss.backward()
            opt.step()
            model.train()
            total += float(loss.detach())
            steps += 1
    return {"loss": total / max(steps, 1), "steps": steps}


@torch.no_grad()
def predict_proba(model: nn.Module, x: torch.Tensor, batch_size: int = 128) -> np.ndarray:
    model.eval()
    outs = [torch.softmax(model((x[s:s + batch_size] - 0.5) / 0.5), dim=1) for s in range(0, x.shape[0], batch_size)]
    return torch.cat(outs).numpy() if outs else np.zeros((0, 0))


@torch.no_grad()
def latents(model: nn.Module, x: torch.Tensor, batch_size: int = 128) -> np.ndarray:
    """Final-hidden-layer activations (Flux's latents)."""
    model.eval()
    outs = [model.forward_features((x[s:s + batch_size] - 0.5) / 0.5) for s in range(0, x.shape[0], batch_size)]
    return torch.cat(outs).numpy() if outs else np.zeros((0, 0))


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, n_classes: int) -> dict:
    """:func:`fedmed.metrics.site_metrics` of the model on (x, y)."""
    prob = predict_proba(model, x) if x.shape[0] else np.zeros((0, n_classes))
    return site_metrics(y.numpy(), prob, n_classes)
