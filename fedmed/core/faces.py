"""The public face of a fedmed subpackage: its names, loaded from their modules on first use (PEP 562)."""

from __future__ import annotations

import sys
from importlib import import_module

__all__ = ["lazy_face"]


def lazy_face(package: str, public: dict):
    """``(__getattr__, __dir__)`` for ``package`` whose ``public`` maps a name to the submodule defining it."""
    def __getattr__(name):
        if name in public:
            value = getattr(import_module(f"{package}.{public[name]}"), name)
            setattr(sys.modules[package], name, value)
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__():
        return sorted(set(vars(sys.modules[package])) | set(public))

    return __getattr__, __dir__
