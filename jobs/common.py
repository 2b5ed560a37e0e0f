"""Shared job-building code: the fedmed config for the FLARE components, and the FedJob scaffold.

A job is built from the experiment config alone: it names its sites (or deploys to every connected
site) and carries no path to anyone's data — each site finds its own data through its site-local
settings (``fedmed.site.settings``). Job folders produced here run unchanged in the simulator
(``jobs/run.py --env sim``), in POC mode and on provisioned sites (admin console ``submit_job``).

**A job carries no code.** Every party has fedmed installed; the job names fedmed's FLARE components by class path
(``fedmed_flare.controller.WorkflowController`` at the server, ``fedmed_flare.executor.SiteExecutor`` at each site), so
it has no ``custom/`` folder and FLARE does not count it as custom code (BYOC). The data it may carry to the server (a
model's initial weights, a checkpoint to resume from, a finished run's models) goes into the server app's ``config/``
folder (``fedmed.core.jobfiles``). A site receives no file: a weights file it needs is named (file name and SHA-256)
and comes from the site's own weights folder (``fedmed.core.policy``). Only a model that is the user's own class
makes the job carry code (``custom/fedmed_user_code/``) — then it is BYOC and FLARE's authorization decides.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from fedmed.run.jobspec import BuildError, check_encoder, job_name  # noqa: E402,F401  (re-exported)
from fedmed.run.taskconfig import fedmed_config, min_clients  # noqa: E402,F401  (re-exported)


def new_job(name: str, spec, controller):
    """A FedJob with ``controller`` on the server and fedmed's site executor on the spec's sites (all connected sites
    when it names none). The spec's ``server_files``: ``(source, folder)`` data for the server, into its app's
    ``config/`` folder (never code); its ``user_code``: ``(source, folder)`` of a user's network class or a plugin
    method, into every app's ``custom/`` (the job is then custom code to FLARE)."""
    from nvflare.app_common.widgets.convert_to_fed_event import ConvertToFedEvent
    from nvflare.job_config.api import FedJob

    from fedmed_flare.tracking import receivers

    from fedmed.core.jobfiles import FILES_DIR
    from fedmed_flare.executor import SiteExecutor

    sites, quorum = spec.sites, spec.min_clients
    job = FedJob(name=name, min_clients=quorum)
    job.set_app_packages(["fedmed", "fedmed_flare"])  # installed at every party; never copied into the job
    job.to_server(controller, id="controller")
    for rid, receiver in receivers(spec.tracking):  # TensorBoard, MLflow, W&B: FLARE's receivers (tracking)
        job.to_server(receiver, id=rid)
    # FLARE reads it at the path server.task_request_interval (server_json_config.py); a top-level key is ignored
    job.to_server({"server": {"task_request_interval": spec.task_request_interval}})
    targets = sites if sites else [None]
    for site in targets:
        executor = SiteExecutor(threads=1)
        event = ConvertToFedEvent(events_to_convert=["analytix_log_stats"], fed_event_prefix="fed.")
        if site is None:
            job.to_clients(executor, tasks=["*"])
            job.to_clients(event, id="event_to_fed")
        else:
            job.to(executor, site, tasks=["*"])
            job.to(event, site, id="event_to_fed")
    for src, dest in spec.user_code:
        for site in targets:
            job.add_file_to(str(Path(src).resolve()), site or "@ALL", dest_dir=dest)
        job.add_file_to_server(str(Path(src).resolve()), dest_dir=dest)
    for src, dest in spec.server_files:
        job.add_file_to_server(str(Path(src).resolve()), dest_dir=f"{FILES_DIR}/{dest}", app_folder_type="config")
    return job


def export(job, out_dir) -> Path:
    out = Path(out_dir).resolve()  # relative to the caller's folder
    out.mkdir(parents=True, exist_ok=True)
    job.export_job(str(out))
    return out / job.name
