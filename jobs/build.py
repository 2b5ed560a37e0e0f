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
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedmed.core import jobfiles  # noqa: E402
from fedmed.workflows.registry import method_entry  # noqa: E402
from jobs.common import BuildError, check_encoder, export, fedmed_config, job_name, new_job  # noqa: E402


def find_checkpoint(result) -> Path:
    """The ``checkpoint/`` folder of a run result (its ``fedmed/`` folder, a run folder of ``fedmed experiment``,
    or a downloaded FLARE job result)."""
    root = Path(result)
    if not root.exists():
        raise BuildError(f"--resume-from {result}: no such folder")
    hits = sorted(root.rglob("checkpoint/state.json"))
    if not hits:
        raise BuildError(f"--resume-from {result}: no checkpoint (checkpoint/state.json) in it; the run stopped "
                         f"before its first round completed, so there is nothing to resume")
    return hits[0].parent


def controller_for(exp, method, seed: int, cfg: dict, resume: bool):
    """The server side of ``method``: FLARE's adapter running its workflow (``fedmed.workflows.METHODS``)."""
    from fedmed.workflows import workflow_args
    from fedmed_flare.controller import WorkflowController

    try:
        name, args = workflow_args(exp, method, seed, cfg)
    except KeyError:
        raise BuildError(f"method {method.name!r}: workflow {method.workflow!r} has no job builder") from None
    return WorkflowController(num_rounds=exp.train.rounds, fedmed_config=cfg, workflow_name=name, workflow_args=args,
                              resume=resume)


def build_job(exp, method, seed: int = 0, *, sites="config", name: str | None = None, resume_from=None,
              onboard: dict | None = None):
    """The FedJob of ``method`` for ``seed``.

    Args:
        sites: ``"config"`` (``federation.site_names`` or site-1..N), ``"all"`` (every connected site), or a list.
        resume_from: a run result holding ``checkpoint/`` (see :func:`find_checkpoint`).
        onboard: ``{"training_result": DIR, "known_clusters": {...}, "references": bool, "require_clusters": bool}``
            builds the onboarding job over ``sites`` instead (``fedmed.workflows.onboard``): each new site is
            assigned the cluster of ``method``'s finished run in DIR that fits it, and scores its model.
    """
    names = exp.site_names() if sites == "config" else (None if sites == "all" else list(sites))
    if names is not None:
        from fedmed.core.validation import check_federation_site_names

        try:
            check_federation_site_names(names, what="--sites")
        except ValueError as e:
            raise BuildError(str(e)) from None
    cfg = fedmed_config(exp, seed, method, names)
    user_code, server_files = [], []
    _network_files(exp, cfg, user_code, server_files)
    weights = getattr(method, "encoder_weights", None)
    if method.workflow == "finetune":
        if method.init == "fedmae":
            if not weights or not Path(weights).is_file():
                raise BuildError(f"method {method.name!r}: init 'fedmae' needs encoder_weights, the Fed-MAE run's "
                                 f"models/encoder.pt (got {weights!r})")
            import shutil

            init_dir = Path(tempfile.mkdtemp(prefix="fedmed_init_"))
            shutil.copy(weights, init_dir / "encoder.pt")
            server_files.append((init_dir, jobfiles.FINETUNE_INIT))
    elif method_entry(method.workflow).signature:
        check_encoder(method.encoder, weights, in_channels=exp.dataset.channels, image_size=method.encoder_image_size)
    elif weights:
        check_encoder("medicalnet_resnet18", weights)
    if onboard is not None:
        return _onboarding_job(exp, method, seed, cfg, names, onboard, user_code, server_files, name)
    if resume_from is not None:
        server_files.append((find_checkpoint(resume_from), jobfiles.RESUME))
    ctrl = controller_for(exp, method, seed, cfg, resume=resume_from is not None)
    return new_job(name or job_name(exp, method, seed), exp, ctrl, names, user_code=user_code,
                   server_files=server_files)


def _onboarding_job(exp, method, seed, cfg, names, onboard, user_code, server_files, name):
    import shutil

    from fedmed.workflows.onboard import TRAINING_DIR, OnboardingError, check_training_result, training_files
    from fedmed_flare.controller import WorkflowController

    if not names:
        raise BuildError("an onboarding job names its new sites (--sites)")
    try:
        folder = check_training_result(onboard["training_result"], method.workflow,
                                       require_clusters=onboard.get("require_clusters", True))
    except OnboardingError as e:
        raise BuildError(str(e)) from None
    if not onboard.get("labels", True) and method_entry(method.workflow).onboard == "cfl":
        raise BuildError(f"method {method.name!r}: CFL sends a new site down its tree by the site's training updates, "
                         f"which need labels; --no-labels serves FMCL, PACFL, IFCA (pseudo-labels), FECFL, Flux, 004_")
    tmp = Path(tempfile.mkdtemp(prefix="fedmed_training_"))
    for f in training_files(folder):
        shutil.copy(f, tmp / f.name)
    server_files.append((tmp, TRAINING_DIR))
    ctrl = WorkflowController(num_rounds=1, fedmed_config=cfg, workflow_name="onboard", workflow_args={
        "mode": method_entry(method.workflow).onboard, "known_clusters": onboard.get("known_clusters") or {},
        "references": bool(onboard.get("references")),
        "labels": bool(onboard.get("labels", True))})
    return new_job(name or job_name(exp, method, seed, "_onboard"), exp, ctrl, names, user_code=user_code,
                   server_files=server_files)


def _network_files(exp, cfg: dict, user_code: list, server_files: list) -> None:
    """Check the configured network once (an unknown arch, a bad argument, an output of the wrong shape is one line
    here, before anything runs); ship ``model.init_weights`` to the server (which sends the initial model to every
    site) and a user's network class to the server and the sites (which makes the job custom code to FLARE)."""
    from fedmed.nn.models import USER_CODE_DIR, ArchError, check_arch, user_code_files

    m = cfg["model"]
    seg = cfg.get("task") == "segmentation"
    if cfg.get("task") in ("classification", "segmentation"):
        try:
            if seg:
                check_arch(m, task="segmentation", in_channels=cfg["data"]["in_channels"], n_out=3,
                           size=tuple(cfg["data"]["roi"]))
            else:
                check_arch(m, task="classification", in_channels=cfg["data"]["channels"], n_out=cfg["data"]["n_classes"],
                           size=cfg["data"]["image_size"])
            code = user_code_files(m["arch"])
        except ArchError as e:
            raise BuildError(str(e)) from None
        for src, name in code:
            dest = f"{USER_CODE_DIR}/{name}" if Path(src).is_dir() else USER_CODE_DIR
            user_code.append((Path(src), dest))
    if m.get("init_weights"):
        src = Path(m["init_weights"]).resolve()
        if not src.is_file():
            raise BuildError(f"model.init_weights: file {m['init_weights']} not found")
        server_files.append((src, jobfiles.MODEL_INIT))
        cfg["model"] = {**m, "init_weights": f"{jobfiles.MODEL_INIT}/{src.name}"}


def select_method(exp, name: str, source: str):
    methods = {m.name: m for m in exp.methods}
    if name not in methods:
        raise BuildError(f"method {name!r} is not in {source} (it has {sorted(methods)})")
    return methods[name]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
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
