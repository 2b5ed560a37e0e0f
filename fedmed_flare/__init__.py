"""fedmed's NVIDIA FLARE adapters, installed with fedmed at every party — so a fedmed job carries no code.

* :class:`fedmed_flare.controller.WorkflowController` (the server): runs any workflow of ``fedmed.workflows``.
* :class:`fedmed_flare.executor.SiteExecutor` (each site): answers every task through ``fedmed.site.reply.answer``.

A job names them by class path (``fedmed_flare.controller.WorkflowController``), so it has no ``custom/`` folder and
FLARE does not count it as custom code (BYOC): a site whose ``local/authorization.json`` gives its submitters
``"byoc": "none"`` runs every fedmed workflow. FLARE holds such a job to the site's ``class_allow_list``
(``local/resources.json``): :data:`ALLOW_LIST` is what a fedmed job needs there (docs/deployment.md). A job whose model
is the user's own class carries that code (``custom/fedmed_user_code/``) and is BYOC: FLARE's authorization decides,
and fedmed's site policy must still allow the module (``fedmed.site.policy``).

This package is the only fedmed code that imports ``nvflare``; ``fedmed/`` never does.
"""

__all__ = ["ALLOW_LIST", "COMPONENTS", "allow_list"]

# what a fedmed job names, by class path
COMPONENTS = {
    "controller": "fedmed_flare.controller.WorkflowController",
    "executor": "fedmed_flare.executor.SiteExecutor",
    "tb_receiver": "nvflare.app_opt.tracking.tb.tb_receiver.TBAnalyticsReceiver",
    "mlflow_receiver": "fedmed_flare.mlflow_receiver.MLflowReceiver",  # tracking.mlflow
    "wandb_receiver": "fedmed_flare.wandb_receiver.WandBReceiver",  # tracking.wandb
    "event_to_fed": "nvflare.app_common.widgets.convert_to_fed_event.ConvertToFedEvent",
}
# the prefix a site adds to its class_allow_list (FLARE's other two are on its default list)
ALLOW_LIST = ["fedmed_flare."]  # FLARE: a package prefix ends with "."


def allow_list() -> list[str]:
    """FLARE's default ``class_allow_list`` with fedmed's adapters added: what a site's ``local/resources.json``
    lists so that FLARE builds a fedmed job's components (docs/deployment.md §4)."""
    from nvflare.app_common.default_component_policy import DEFAULT_CLASS_ALLOW_LIST

    return list(DEFAULT_CLASS_ALLOW_LIST) + [p for p in ALLOW_LIST if p not in DEFAULT_CLASS_ALLOW_LIST]
