"""Importing a plugin's module (a method of a user's own, ``fedmed.methods``) under a party's policy: the module is
imported only when the policy lists it (``fedmed_policy.json`` ``modules``; ``("*",)``: the coordinator's own
config), never before that check."""

from __future__ import annotations

from fedmed.core.errors import FedmedError

import importlib
import sys

__all__ = ["PluginError", "add_code_folder", "import_plugins", "module_allowed"]


def add_code_folder(folder) -> None:
    """Make the modules of ``folder`` (a job's ``custom/fedmed_user_code``, a plugin file's folder) importable
    **after** everything installed: the folder is appended to ``sys.path``, never put before it, so a job's
    ``numpy/__init__.py`` or ``scipy/`` cannot shadow the installed package of that name (FLARE appends its own
    ``custom/`` folder too)."""
    folder = str(folder)
    if folder not in sys.path:
        sys.path.append(folder)


class PluginError(FedmedError, ImportError):
    """A plugin module that may not or cannot be loaded; one line naming it."""

    def __str__(self):
        return str(self.args[0]) if self.args else ""


def module_allowed(module: str, modules) -> bool:
    """Whether ``module`` is among ``modules`` (package prefixes; ``"*"``: any)."""
    return any(m == "*" or module == m or module.startswith(m + ".") for m in (modules or ()))


OWN_METHODS = "fedmed.methods"  # fedmed's own methods: installed code, imported as a plugin is, under no policy


def import_plugins(names, modules=()) -> list:
    """Import the plugin modules ``names`` (importable: a job's ``custom/fedmed_user_code`` is on the path), each only
    if ``modules`` allows it (a built-in method's module of ``fedmed.methods`` always); returns the modules."""
    out = []
    for name in names or ():
        if not (name.startswith(OWN_METHODS + ".") or module_allowed(name, modules)):
            raise PluginError(f"plugin {name!r} may not be imported here (this party's policy lists the user modules "
                              f"a job may name: fedmed_policy.json 'modules': {list(modules or ())})")
        if name in sys.modules:
            out.append(sys.modules[name])
            continue
        try:
            out.append(importlib.import_module(name))
        except ImportError as e:
            raise PluginError(f"plugin {name!r}: cannot import it ({e})") from None
        except Exception as e:
            raise PluginError(f"plugin {name!r}: importing it failed ({type(e).__name__}: {e})") from None
    return out
