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
nothing) and the server's controller fails the run in one line naming the setting (:func:`refused_receivers`); each
site sends its per-round metrics to the trackers only where its own policy allows every destination the job names
(``fedmed_flare.executor``).
"""

from __future__ import annotations

import os
from pathlib import Path

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


def receiver_destinations(component) -> list[str] | None:
    """Where a tracking receiver of a job (FLARE's or fedmed's MLflow and W&B receivers) sends metrics besides the
    run's own folder (:func:`fedmed.core.policy.tracking_destinations`); None for any other component."""
    from fedmed.core.policy import tracking_destinations

    cls = [c.__name__ for c in type(component).__mro__]
    if "MLflowReceiver" in cls:
        art = getattr(component, "artifact_location", None)
        out = tracking_destinations({"mlflow": True, "mlflow_uri": getattr(component, "tracking_uri", None)})
        if art not in (None, "artifacts"):  # FLARE's default: a folder of the run
            out.append(f"file:{art}")
        return out
    if "WandBReceiver" in cls:
        args = dict(getattr(component, "wandb_args", None) or {})
        modes = {str(getattr(component, "mode", "offline")), str(args.get("mode", "offline"))}
        out = tracking_destinations({"wandb": True, "wandb_mode": "online" if modes - {"offline", "disabled"}
                                     else "offline", "wandb_dir": getattr(component, "wandb_dir", None)})
        for key in ("dir", "base_url", "settings", "host"):
            if args.get(key) not in (None, ""):
                out.append(f"file:{args[key]}" if key == "dir" else f"wandb:{key}")
        return out
    return None


def refused(policy, component) -> str | None:
    """This party's refusal of a receiver's destinations, one line, or None."""
    dests = receiver_destinations(component)
    return None if dests is None else policy.refused_tracking(dests)


def refused_receivers(policy, components: dict) -> str | None:
    """The first receiver among a job's server ``components`` (``{id: component}``) whose destinations the server's
    policy refuses, as one line naming it; None when every one is allowed."""
    for cid, comp in (components or {}).items():
        why = refused(policy, comp)
        if why:
            return f"tracking ({cid}): {why}"
    return None


def check_receiver(component) -> None:
    """Raise :class:`fedmed.core.policy.PolicyError` before a receiver contacts anything, if the server's policy does
    not allow where it sends (FLARE then leaves the receiver uninitialised: it sends nothing)."""
    from fedmed.core.policy import PolicyError, load_policy

    why = refused(load_policy(), component)
    if why:
        raise PolicyError(why)


def file_store_uri(run_dir) -> str:
    """The default MLflow store of a run: ``mlruns/`` in its ``fedmed/`` folder (kept with the run's record)."""
    return (Path(run_dir) / "fedmed" / "mlruns").resolve().as_uri()


def allow_file_store(uri: str) -> None:
    if uri.startswith("file:"):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
