"""The server workflows by name: what a job's controller (and the in-process federation) constructs.

A job names its workflow as ``module:Class`` — fedmed's as a module of ``fedmed.workflows`` (``flux:Flux``), a
plugin's by its own module (``toy_rule:ToyClusters``), which must have been loaded first under the party's policy
(:func:`fedmed.methods.load_plugins`). Which method runs which workflow with which options is the method's to say
(``fedmed.methods``)."""

from __future__ import annotations

from fedmed.core.errors import FedmedError

import importlib
import sys

__all__ = ["SERVER_WORKFLOWS", "WorkflowNotFound", "server_workflow"]

# fedmed's server workflows: short name -> "module:Class" under fedmed.workflows
SERVER_WORKFLOWS = {"fedavg": "fedavg:FedAvg", "finetune": "finetune:Finetune", "clustered": "clustered:OneShotClustered",
                    "cfl": "cfl:CFL", "flux": "flux:Flux", "ifca": "ifca:IFCA", "assessment": "seg_assessment:SegAssessment",
                    "onboard": "onboard:Onboard",
                    "finetune_local": "finetune_local:FinetuneLocal", "plan": "plan:Plan"}
_OWN_MODULES = {v.split(":")[0] for v in SERVER_WORKFLOWS.values()}


class WorkflowNotFound(FedmedError, KeyError):
    def __str__(self):
        return str(self.args[0])


def server_workflow(name: str):
    """The workflow class ``name`` names: a short name of :data:`SERVER_WORKFLOWS`, ``module:Class`` of a fedmed
    workflow module, or ``plugin.module:Class`` of a plugin already imported (never imported here)."""
    from fedmed.workflows.base import Workflow

    path = SERVER_WORKFLOWS.get(name, name)
    if ":" not in path:
        raise WorkflowNotFound(f"server workflow {name!r} is not one of fedmed's ({sorted(SERVER_WORKFLOWS)}) nor "
                               f"module:Class")
    module, cls = path.split(":", 1)
    if module in _OWN_MODULES:
        mod = importlib.import_module(f"fedmed.workflows.{module}")
    elif module in sys.modules:
        mod = sys.modules[module]
    else:
        raise WorkflowNotFound(f"server workflow {path!r}: module {module!r} is not loaded (a plugin is loaded from the "
                               f"task config's plugins, under the server's policy)")
    out = getattr(mod, cls, None)
    if not (isinstance(out, type) and issubclass(out, Workflow)):
        raise WorkflowNotFound(f"server workflow {path!r}: {module} has no Workflow class {cls!r}")
    return out
