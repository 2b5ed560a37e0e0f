"""fedmed's methods, one module each, every one written as a plugin is (:mod:`fedmed.methods.base` has the contract):
its :class:`Method` (its options, declared once, and what it hands to its workflow and to the sites), registered with
:func:`register_method`; a kind of signature it defines registered with
:func:`fedmed.algorithms.signatures.register_signature_kind`. A job names its method's module among the task config's
``plugins``, so every party imports it before it answers, as it imports a plugin's.

Importing this package registers them all, in this order (the order ``methods:`` lists them in help and errors).
"""

from fedmed.methods.assess import FedAvgWMethod, SegAssessMethod, SegClustersMethod
from fedmed.methods.base import (METHODS, Method, MethodError, PluginError, check_encoder, check_vit_input,
                                 clustering_workflows, load_plugins, method_class, method_union, on_register,
                                 plugin_module, register_method, server_workflow_path, workflows_for)
from fedmed.methods.cfl import CFLMethod
from fedmed.methods.ditto import DittoMethod
from fedmed.methods.fecfl import FECFLMethod
from fedmed.methods.fedavg import FedAvgMethod
from fedmed.methods.fedbn import FedBNMethod
from fedmed.methods.fedmae import FedMAEMethod
from fedmed.methods.fedprox import FedProxMethod
from fedmed.methods.finetune import FinetuneMethod
from fedmed.methods.finetune_local import FinetuneLocalMethod
from fedmed.methods.flux import FluxMethod
from fedmed.methods.fmcl import FMCLMethod
from fedmed.methods.ifca import IFCAMethod
from fedmed.methods.pacfl import PACFLMethod
from fedmed.methods.signature import SignatureMethod

__all__ = ["CFLMethod", "DittoMethod", "FECFLMethod", "FMCLMethod", "FedAvgMethod", "FedAvgWMethod", "FedBNMethod",
           "FedMAEMethod", "FedProxMethod", "FinetuneLocalMethod", "FinetuneMethod", "FluxMethod", "IFCAMethod",
           "METHODS", "Method", "MethodError", "PACFLMethod", "PluginError", "SegAssessMethod", "SegClustersMethod",
           "SignatureMethod", "check_encoder", "check_vit_input", "clustering_workflows", "load_plugins",
           "method_class", "method_union", "on_register", "plugin_module", "register_method",
           "server_workflow_path", "workflows_for"]
