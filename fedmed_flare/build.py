"""Build the NVFlare job of one method of an experiment config — from the config alone.

    python -m fedmed_flare.build --config app_configs/busi_fmcl.yaml --method FedAvg --out JOBS [--seed 0]
        [--sites hospital-a hospital-b | --all-sites] [--set key.path=value ...] [--resume-from RESULT]
    python -m fedmed_flare.build --config CONFIG --method FMCL --out JOBS --onboard TRAINING_RESULT --sites hospital-d

Prints the job folder, which runs in the simulator (:mod:`fedmed_flare.run`), in POC mode and on provisioned
sites (admin console ``submit_job``). The config must name the classes (``dataset.classes``) or, for
segmentation, the modalities; sites find their own data (docs/deployment.md). ``--resume-from`` takes a
finished/stopped run's result folder (or a downloaded job result) and continues from its last
checkpointed round. ``--onboard`` builds the job that gives new sites (``--sites``, e.g. a hospital that joined after
training) the cluster model of a finished run that fits them (``fedmed.workflows.onboard``). Errors are one line
naming the problem.

A job is built from the experiment config alone: it names its sites (or deploys to every connected
site) and carries no path to anyone's data — each site finds its own data through its site-local
settings (``fedmed.site.settings``). Job folders produced here run unchanged in the simulator
(``fedmed_flare.run --env sim``), in POC mode and on provisioned sites (admin console ``submit_job``).

**A job carries no code.** Every party has fedmed installed; the job names fedmed's FLARE components by class path
(``fedmed_flare.controller.WorkflowController`` at the server, ``fedmed_flare.executor.SiteExecutor`` at each site), so
it has no ``custom/`` folder and FLARE does not count it as custom code (BYOC). The data it may carry to the server (a
model's initial weights, a checkpoint to resume from, a finished run's models) goes into the server app's ``config/``
folder (``fedmed.core.jobfiles``). A site receives no file: a weights file it needs is named (file name and SHA-256)
and comes from the site's own weights folder (``fedmed.core.policy``). Only a model that is the user's own class
makes the job carry code (``custom/fedmed_user_code/``) — then it is BYOC and FLARE's authorization decides.

(``jobs/build.py`` in a clone is this module's entry point, as ``fedmed job build`` is.)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from fedmed.run.jobspec import BuildError, JobSpec, job_name, job_spec, select_method  # noqa: F401  (re-exported)
from fedmed.run.followups import Onboarding


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


def job_from_spec(spec: JobSpec):
    """FLARE's FedJob of a spec (``fedmed.run.jobspec``): fedmed's controller running the spec's workflow at the
    server, fedmed's executor at the sites; nothing is read or checked again."""
    from fedmed_flare.controller import WorkflowController

    ctrl = WorkflowController(num_rounds=spec.rounds, task_config=spec.task_config, workflow_name=spec.workflow,
                              workflow_args=spec.workflow_options, resume=spec.resume)
    return new_job(spec.name, spec, ctrl)


def build_job(exp, method, seed: int = 0, *, sites="config", name: str | None = None, resume_from=None,
              follows=None):
    """The FedJob of ``method`` for ``seed`` (:func:`fedmed.run.jobspec.job_spec` for the arguments)."""
    return job_from_spec(job_spec(exp, method, seed, sites=sites, name=name, resume_from=resume_from, follows=follows))


def parser() -> argparse.ArgumentParser:
    from fedmed.core.helpformat import HELP

    ap = argparse.ArgumentParser(prog=os.environ.get("FEDMED_PROG") or None, description=__doc__.splitlines()[0],
                                 formatter_class=HELP)
    ap.add_argument("--config", required=True, help="experiment config (YAML/JSON)")
    ap.add_argument("--method", required=True, help="name of one of the config's methods")
    ap.add_argument("--out", required=True, help="folder the job folder is written into")
    ap.add_argument("--seed", type=int, default=0, help="seed of the run (model init, sampling)")
    ap.add_argument("--name", help="job name (default: <config>_<method>_s<seed>)")
    ap.add_argument("--set", action="append", default=[], help="config override key.path=value (repeatable)")
    who = ap.add_mutually_exclusive_group()
    who.add_argument("--sites", nargs="+", help="the sites the job runs on (default: federation.site_names, or "
                     "site-1..N)")
    who.add_argument("--all-sites", action="store_true", help="deploy to every connected site")
    ap.add_argument("--resume-from", help="result folder of an earlier run of this method: continue from its "
                    "last checkpointed round")
    ap.add_argument("--onboard", metavar="TRAINING_RESULT", help="build the onboarding job instead: the new sites "
                    "(--sites) are each given the cluster model of this finished run of the method that fits them "
                    "(its fedmed/ folder, a downloaded job result or a run folder of fedmed experiment)")
    ap.add_argument("--known-clusters", default="", help="--onboard: JSON {new site: cluster of its true group}, "
                    "scored as a reference")
    ap.add_argument("--references", action="store_true", help="--onboard: also score every cluster model at each "
                    "new site (references, never a selection)")
    ap.add_argument("--no-labels", action="store_true", help="--onboard: the new sites have no labels: FMCL, PACFL "
                    "and IFCA assign by the served models' predicted classes (docs/readings.md)")
    ap.add_argument("--global", dest="global_result", metavar="RUN", help="--onboard: a finished FedAvg-family run "
                    "whose global model a new site is served when its cluster was trained on no site or too few images")
    ap.add_argument("--min-cluster-images", type=int, default=0, help="--onboard: a cluster model trained on fewer "
                    "images never serves a new site (default 0: any trained cluster)")
    return ap


def main(argv=None) -> int:
    import json

    from fedmed.config import ConfigError, load_config

    a = parser().parse_args(argv)
    try:
        exp = load_config(a.config, a.set)
        method = select_method(exp, a.method, a.config)
        sites = a.sites or ("all" if a.all_sites else "config")
        onboard = None
        if a.onboard and not a.sites:
            raise BuildError("--onboard needs --sites: the new sites to onboard")
        if a.onboard:
            onboard = Onboarding(a.onboard, json.loads(a.known_clusters) if a.known_clusters else {},
                                 references=a.references, labels=not a.no_labels,
                                 min_cluster_images=a.min_cluster_images, global_result=a.global_result)
        elif a.known_clusters or a.references or a.no_labels or a.global_result or a.min_cluster_images:
            raise BuildError("--known-clusters, --references, --no-labels, --global and --min-cluster-images go with "
                             "--onboard")
        job = build_job(exp, method, a.seed, sites=sites, name=a.name, resume_from=a.resume_from, follows=onboard)
        print(export(job, a.out))
    except (BuildError, ConfigError, ValueError) as e:
        print(f"{os.environ.get('FEDMED_PROG') or 'jobs/build.py'}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
