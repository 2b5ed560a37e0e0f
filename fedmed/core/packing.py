"""Several models in one message: ``{"m<key>/<param>": array}`` (IFCA's K models to every site, the cluster models
of an ensemble). One packing rule for the server workflows and the site tasks."""

from __future__ import annotations

__all__ = ["pack_models", "unpack_model", "unpack_models"]


def _prefix(key) -> str:
    return f"m{key}/"


def pack_models(models) -> dict:
    """``{key: params}`` (or a list, keyed by position) as one parameter dict."""
    items = models.items() if hasattr(models, "items") else enumerate(models)
    return {f"{_prefix(k)}{name}": v for k, params in items for name, v in params.items()}


def unpack_model(packed: dict, key) -> dict:
    """The parameters of model ``key`` of a packed dict."""
    pre = _prefix(key)
    return {name[len(pre):]: v for name, v in packed.items() if name.startswith(pre)}


def unpack_models(packed: dict) -> dict:
    """``{key (int): params}`` of a packed dict."""
    keys = sorted({int(name[1:name.index("/")]) for name in packed})
    return {k: unpack_model(packed, k) for k in keys}
