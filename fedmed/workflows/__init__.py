"""fedmed's server workflows — each method's algorithm box — written against a small
:class:`~fedmed.workflows.federation.Federation`, so the same code runs on NVFlare (``fedmed_flare/controller.py``:
simulator, POC, provisioned sites) and in this process (:class:`InProcessFederation`).

:data:`METHODS` maps a method's ``workflow`` (as an experiment config names it) to its server workflow, its options,
its site tasks and whether it ends with clusters.
"""

from fedmed.workflows.base import Workflow, initial_params
from fedmed.workflows.federation import RESUME_DIR, Federation, RunFailed, RunStopped
from fedmed.workflows.inprocess import InProcessFederation, fedavg_in_process, run_in_process
from fedmed.workflows.registry import (METHODS, SERVER_WORKFLOWS, MethodEntry, clustering_workflows, method_entry, server_workflow,
                       workflow_args, workflows_for)

__all__ = ["METHODS", "RESUME_DIR", "SERVER_WORKFLOWS", "Federation", "InProcessFederation", "MethodEntry", "RunFailed",
           "RunStopped", "Workflow", "clustering_workflows", "fedavg_in_process", "initial_params", "method_entry", "run_in_process",
           "server_workflow", "workflow_args", "workflows_for"]
