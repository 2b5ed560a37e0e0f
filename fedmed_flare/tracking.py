"""Experiment tracking through FLARE's own receivers (``nvflare.app_opt.tracking``), as a fedmed job uses them.

Each site's executor sends its per-round metrics as FLARE analytics (``analytix_log_stats``, turned into a federated
event); the server's controller sends its own (the site mean and pooled metrics of every round) as a local one, and the
run's settings and result as :data:`RUN_EVENT`. The receivers sit at the server (``tracking`` of the experiment config,
:class:`fedmed.config.TrackingConfig`):

* **TensorBoard** (default): FLARE's ``TBAnalyticsReceiver``, one event folder per site and one for the server under
  the run's ``fedmed/tb/`` — the folder the run keeps.
* **MLflow**: :class:`MLflowReceiver`, FLARE's receiver with three changes: the server's own metrics, parameters and
  result are a run beside each site's (FLARE's opens runs for the connected clients only); without a URI the store
  is a ``file:`` store in the run's ``fedmed/mlruns/`` (``fedmed experiment`` gives all its runs one store,
  ``<out>/mlruns/``); a new experiment's artifacts go beside a ``file:`` or ``sqlite:`` store (``mlartifacts/``), not
  into the job's workspace. MLflow 3 asks ``MLFLOW_ALLOW_FILE_STORE=true`` for a file store: set for this process
  when the store is one.
* **W&B**: :class:`WandBReceiver`, FLARE's receiver (``wandb_mode`` offline by default) with the server as a run of
  its own as for MLflow (the run's parameters its W&B config), and offline runs in the run's ``fedmed/wandb/`` by
  default (``fedmed experiment``: ``<out>/wandb/``).

**Where metrics may go is the parties' choice, not the job's.** The run's own folder at the server (TensorBoard, a
``file:`` MLflow store, offline W&B) is always allowed; anything else a job names — an MLflow server or database, W&B
online, a folder of its choosing — must be listed in the server's policy (``tracking`` of its
``local/fedmed_policy.json``). fedmed's receivers check that before they contact anything (a refused receiver sends
nothing) and the server's controller fails the run in one line naming the setting
(:func:`fedmed_flare.destinations.refused_receivers`); each site sends its per-round metrics to the trackers only where
its own policy allows every destination the job names (``fedmed_flare.executor``).

Layout: this module names the events and builds the receivers (it imports a receiver's module only when a job turns
it on); the receivers import the checks and the store helpers from :mod:`fedmed_flare.destinations`, which imports
no receiver — so no import runs in a circle.
"""

from __future__ import annotations

from nvflare.apis.analytix import ANALYTIC_EVENT_TYPE

__all__ = ["RUN_EVENT", "SERVER_EVENTS", "SITE_EVENTS", "receivers"]

SITE_EVENTS = [f"fed.{ANALYTIC_EVENT_TYPE}"]  # the sites' analytics, as federated events at the server
SERVER_EVENTS = [ANALYTIC_EVENT_TYPE]  # the server's own
RUN_EVENT = "fedmed.run_info"  # the run's parameters and result: for trackers that keep them (not TensorBoard)


def receivers(tracking: dict) -> list:
    """``[(component id, receiver)]`` for the server of a job with these settings (``JobSpec.tracking``)."""
    out = []
    if tracking.get("tensorboard", True):
        from nvflare.app_opt.tracking.tb.tb_receiver import TBAnalyticsReceiver

        out.append(("tb_receiver", TBAnalyticsReceiver(tb_folder="fedmed/tb", events=SITE_EVENTS + SERVER_EVENTS)))
    if tracking.get("mlflow"):
        from fedmed_flare.mlflow_receiver import MLflowReceiver

        out.append(("mlflow_receiver", MLflowReceiver(
            tracking_uri=tracking.get("mlflow_uri") or None, kw_args={"experiment_name": tracking["experiment"]},
            events=SITE_EVENTS + SERVER_EVENTS + [RUN_EVENT])))
    if tracking.get("wandb"):
        from fedmed_flare.wandb_receiver import WandBReceiver

        out.append(("wandb_receiver", WandBReceiver(
            wandb_args={"project": tracking["experiment"], "name": tracking["experiment"]},
            mode=tracking["wandb_mode"], wandb_dir=tracking["wandb_dir"],
            events=SITE_EVENTS + SERVER_EVENTS + [RUN_EVENT])))
    return out
