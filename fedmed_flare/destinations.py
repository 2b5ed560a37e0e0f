"""Where a tracking receiver of a fedmed job sends metrics, and whether this party's policy allows it
(:mod:`fedmed_flare.tracking` has the rules). The receivers (:mod:`fedmed_flare.mlflow_receiver`,
:mod:`fedmed_flare.wandb_receiver`) and the server's controller import these checks; this module imports no receiver,
so the tracking modules import in one direction only (``tests/test_layering.py``)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["allow_file_store", "check_receiver", "file_store_uri", "receiver_destinations", "refused",
           "refused_receivers"]


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
