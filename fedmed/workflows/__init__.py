"""The server side every method's algorithm box is made of — the workflow steps, FedAvg's loop, onboarding, the
serving plan — written against a small :class:`~fedmed.workflows.federation.Federation`, so the same code runs on
NVFlare (``fedmed_flare/controller.py``: simulator, POC, provisioned sites) and in this process
(:class:`InProcessFederation`).

The loop every method's workflow is made of (:class:`Workflow`, FedAvg's :mod:`fedmed.workflows.fedavg`), the
onboarding of new sites and the serving plan live here; a method's own workflow lives in its module of
``fedmed.methods``, with its options. :func:`server_workflow` finds a workflow class by the name a job gives it.
"""

from fedmed.workflows.base import Workflow, initial_params
from fedmed.workflows.federation import RESUME_DIR, Federation, RunFailed, RunStopped
from fedmed.workflows.inprocess import InProcessFederation, fedavg_in_process, run_in_process
from fedmed.workflows.registry import WorkflowNotFound, server_workflow

__all__ = ["RESUME_DIR", "Federation", "InProcessFederation", "RunFailed", "RunStopped",
           "Workflow", "WorkflowNotFound", "fedavg_in_process", "initial_params", "run_in_process", "server_workflow"]
