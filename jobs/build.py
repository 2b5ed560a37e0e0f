"""Build the NVFlare job of one method of an experiment config — from the config alone.

    python jobs/build.py --config app_configs/busi_fmcl.yaml --method FedAvg --out JOBS [--seed 0]
        [--sites hospital-a hospital-b | --all-sites] [--set key.path=value ...] [--resume-from RESULT]
    python jobs/build.py --config CONFIG --method FMCL --out JOBS --onboard TRAINING_RESULT --sites hospital-d

Prints the job folder, which runs in the simulator (``jobs/run.py``), in POC mode and on provisioned
sites (admin console ``submit_job``). The config must name the classes (``dataset.classes``) or, for
segmentation, the modalities; sites find their own data (docs/deployment.md). ``--resume-from`` takes a
finished/stopped run's result folder (or a downloaded job result) and continues from its last
checkpointed round. ``--onboard`` builds the job that gives new sites (``--sites``, e.g. a hospital that joined after
training) the cluster model of a finished run that fits them (``fedmed.workflows.onboard``). Errors are one line
naming the problem.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedmed.run.jobspec import BuildError, JobSpec, job_spec, select_method  # noqa: E402,F401
from jobs.common import export, new_job  # noqa: E402


def job_from_spec(spec: JobSpec):
    """FLARE's FedJob of a spec (``fedmed.run.jobspec``): fedmed's controller running the spec's workflow at the
    server, fedmed's executor at the sites; nothing is read or checked again."""
    from fedmed_flare.controller import WorkflowController

    ctrl = WorkflowController(num_rounds=spec.rounds, fedmed_config=spec.task_config, workflow_name=spec.workflow,
                              workflow_args=spec.workflow_options, resume=spec.resume)
    return new_job(spec.name, spec, ctrl)


def build_job(exp, method, seed: int = 0, *, sites="config", name: str | None = None, resume_from=None,
              onboard: dict | None = None):
    """The FedJob of ``method`` for ``seed`` (:func:`fedmed.run.jobspec.job_spec` for the arguments)."""
    return job_from_spec(job_spec(exp, method, seed, sites=sites, name=name, resume_from=resume_from, onboard=onboard))


def parser() -> argparse.ArgumentParser:
    from fedmed.cli.help import HELP

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
            onboard = {"training_result": a.onboard, "references": a.references, "labels": not a.no_labels,
                       "known_clusters": json.loads(a.known_clusters) if a.known_clusters else {}}
        elif a.known_clusters or a.references or a.no_labels:
            raise BuildError("--known-clusters, --references and --no-labels go with --onboard")
        job = build_job(exp, method, a.seed, sites=sites, name=a.name, resume_from=a.resume_from, onboard=onboard)
        print(export(job, a.out))
    except (BuildError, ConfigError, ValueError) as e:
        print(f"jobs/build.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
