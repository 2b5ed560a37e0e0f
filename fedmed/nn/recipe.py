"""The training recipe a network gets, from scratch or from pretrained weights (transfer learning).

A config's ``train`` section may leave four choices to the recipe (``None``); ``train.recipe`` says which recipe
fills them — ``auto`` (the default): **transfer** whenever ``model.init_weights`` is set (or a bundle brings
weights), **scratch** otherwise; ``scratch`` or ``transfer`` force one, and a value set in ``train`` always wins:

* ``head_init``: the classifier's last layer as its network initialises it (``seeded``) or zero (``zero``: every
  class starts at the same logit, the loss at ln K, whatever the scale of the pretrained features);
* ``backbone_lr_scale``: the learning rate of every parameter but the classifier's last layer, as a fraction of
  ``train.lr``;
* ``norm_stats``: batch-norm running statistics updated by training (``train``) or kept as the network started
  (``frozen``: the layers normalise with the pretrained statistics; their weights still train);
* ``keep_optimizer_state``: a site keeps its optimizer state (momentum, Adam moments) between rounds.

The transfer recipe's zero head was chosen on validation data of the natural breast-ultrasound federation; its
other values are the scratch recipe's, kept where the screen measured no gain (the optimizer state, batch norm at the
sites) and not yet measured for the learning rate per part and frozen statistics (``docs/readings.md`` "Transfer
learning federated"; ``benchmarks/transfer_factors.py``). Pure torch; no FLARE.
"""

from __future__ import annotations

from typing import Mapping

from torch import nn

__all__ = ["RECIPES", "head_keys", "norm_layers", "param_groups", "prepared", "recipe_name", "resolved", "round_schedule",
           "zero_head"]

RECIPES = {
    "scratch": {"head_init": "seeded", "backbone_lr_scale": 1.0, "norm_stats": "train", "keep_optimizer_state": True},
    "transfer": {"head_init": "zero", "backbone_lr_scale": 1.0, "norm_stats": "train", "keep_optimizer_state": True},
}
CHOICES = tuple(RECIPES["scratch"])


def _get(section, key):
    return section.get(key) if isinstance(section, Mapping) else getattr(section, key, None)


def recipe_name(train, model) -> str:
    """``scratch`` or ``transfer``: ``train.recipe``, or under ``auto`` whether the network starts from weights."""
    r = _get(train, "recipe") or "auto"
    if r != "auto":
        return r
    return "transfer" if (_get(model, "init_weights") or _get(model, "bundle")) else "scratch"


def resolved(train, model) -> dict:
    """The four choices of ``train`` (a ``train`` section, typed or a dict) for a network configured by ``model``:
    each the value ``train`` sets, else its recipe's."""
    base = RECIPES[recipe_name(train, model)]
    return {k: (base[k] if _get(train, k) is None else _get(train, k)) for k in CHOICES}


def head_keys(model: nn.Module) -> list[str]:
    """The state-dict keys of a classifier's last layer: the last ``nn.Linear`` of the network (EfficientNet-Lite's
    ``classifier``, ResNet-9's ``fc``, a MONAI DenseNet's ``class_layers.out``)."""
    last = None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            last = name
    if last is None:
        return []
    return [f"{last}.{k}" for k in dict(model.named_modules())[last].state_dict()]


def zero_head(model: nn.Module) -> list[str]:
    """Set the classifier's last layer to zero (weights and bias) in place; returns its keys."""
    import torch

    keys = head_keys(model)
    state = model.state_dict()
    with torch.no_grad():
        for k in keys:
            state[k].zero_()
    return keys


def prepared(model: nn.Module, train, model_cfg) -> nn.Module:
    """A classifier as its recipe starts it: under ``head_init: zero`` its last layer zeroed (in place) — unless the
    network's weights file gave that layer (a bundle's or a checkpoint's trained classifier for the job's classes is
    kept; a head the file did not have — the ImageNet release's, or one for another number of classes — is new)."""
    if resolved(train, model_cfg)["head_init"] != "zero":
        return model
    new = getattr(model, "fedmed_new_head", None)  # None: not started from a file
    if new is None or set(head_keys(model)) <= set(new):
        zero_head(model)
    return model


def param_groups(model: nn.Module, lr: float, backbone_lr_scale: float) -> list[dict] | None:
    """Optimizer parameter groups: the classifier's last layer at ``lr``, the rest at ``lr * backbone_lr_scale``;
    ``None`` (one group) when the scale is 1 or the network has no such layer."""
    head = {k.rsplit(".", 1)[0] for k in head_keys(model)}
    if backbone_lr_scale == 1.0 or not head:
        return None
    named = list(model.named_parameters())
    top = [p for n, p in named if n.rsplit(".", 1)[0] in head]
    rest = [p for n, p in named if n.rsplit(".", 1)[0] not in head]
    return [{"params": rest, "lr": lr * backbone_lr_scale, "lr_scale": backbone_lr_scale},
            {"params": top, "lr": lr, "lr_scale": 1.0}]


def round_schedule(train, round_: int):
    """``train.lr_schedule`` as the ``lr_at(f)`` of one round's local training (:func:`fedmed.nn.train.train_local`:
    ``f`` the fraction of the round's steps done): ``None`` for ``constant``; for ``cosine``, ``lr * (1 + cos(pi *
    t)) / 2`` at ``t = (round_ + f) / rounds`` of the run — ``lr`` at the first step of round 0, near 0 at the last step
    of round ``rounds - 1`` — so a site's rounds and the centralized reference's epochs follow one curve. ``round_``
    counts training rounds from 0 (the centralized reference: its ``local_epochs`` epoch blocks)."""
    from fedmed.nn.mae import scheduled_lr  # 001_'s warm-up + cosine, here without warm-up

    kind = _get(train, "lr_schedule") or "constant"
    if kind == "constant":
        return None
    if kind != "cosine":
        raise ValueError(f"train.lr_schedule should be 'constant' or 'cosine', got {kind!r}")
    lr, rounds = float(_get(train, "lr")), max(1, int(_get(train, "rounds")))
    return lambda f: scheduled_lr(lr, (round_ + f) / rounds, 0.0)


def norm_layers(model: nn.Module) -> list[nn.Module]:
    """The batch-norm layers of ``model`` (what ``norm_stats: frozen`` puts in eval mode while it trains)."""
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
