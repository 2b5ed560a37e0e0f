"""Finding a server workflow by the name a job gives it: ``module:Class``. fedmed's own live in its installed
packages (``fedmed.workflows.onboard:Onboard``, a built-in method's module: ``fedmed.methods.flux:Flux``) and are
imported here; a plugin's (``toy_rule:ToyClusters``) must have been loaded first under the party's policy
(:func:`fedmed.methods.load_plugins`). Which method runs which workflow with which options is the method's to say
(``fedmed.methods``)."""

from __future__ import annotations

from fedmed.core.errors import FedmedError

import importlib
import sys

__all__ = ["WorkflowNotFound", "server_workflow"]

OWN_PACKAGES = ("fedmed.workflows.", "fedmed.methods.")  # installed code: imported when a job names it


class WorkflowNotFound(FedmedError, KeyError):
    def __str__(self):
        return str(self.args[0])


def server_workflow(path: str):
    """The workflow class ``path`` (``module:Class``) names: of a fedmed module, or of a plugin already imported
    (never imported here)."""
    from fedmed.workflows.base import Workflow

    if ":" not in path:
        raise WorkflowNotFound(f"server workflow {path!r} is not module:Class (e.g. fedmed.methods.flux:Flux)")
    module, cls = path.split(":", 1)
    if module.startswith(OWN_PACKAGES):
        try:
            mod = importlib.import_module(module)
        except ImportError:
            raise WorkflowNotFound(f"server workflow {path!r}: fedmed has no module {module!r}") from None
    elif module in sys.modules:
        mod = sys.modules[module]
    else:
        raise WorkflowNotFound(f"server workflow {path!r}: module {module!r} is not loaded (a plugin is loaded from the "
                               f"task config's plugins, under the server's policy)")
    out = getattr(mod, cls, None)
    if not (isinstance(out, type) and issubclass(out, Workflow)):
        raise WorkflowNotFound(f"server workflow {path!r}: {module} has no Workflow class {cls!r}")
    return out
