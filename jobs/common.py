"""Shared job-building code: the fedmed config for the FLARE components, and the FedJob scaffold.

A job is built from the experiment config alone: it names its sites (or deploys to every connected
site) and carries no path to anyone's data — each site finds its own data through its site-local
settings (``fedmed.site_settings``). Job folders produced here run unchanged in the simulator
(``jobs/run.py --env sim``), in POC mode and on provisioned sites (admin console ``submit_job``).
Sites need ``fedmed`` installed; the job carries ``custom/`` (client script and controllers) and, where
a method uses them, the encoder weights every site must share and a checkpoint to resume from.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

WEIGHTS_DIR = "fedmed_weights"  # inside every site app's custom folder


class BuildError(ValueError):
    """A job that cannot be built from this config; the message names the key or file."""


@contextmanager
def in_repo_root():
    """FLARE records script paths relative to the working directory; build from the repo root."""
    old = os.getcwd()
    os.chdir(ROOT)
    try:
        yield
    finally:
        os.chdir(old)


def job_name(exp, method, seed: int, suffix: str = "") -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in f"{exp.name}_{method.name}{suffix}_s{seed}").lower()


def fedmed_config(exp, seed: int, method, sites: list[str] | None) -> dict:
    """The plain-dict config that travels to sites in each task's ``meta['fedmed']`` (and to the server)."""
    train = exp.train.model_dump()
    if method.workflow == "fedprox":
        train["fedprox_mu"] = method.fedprox_mu
    fed = exp.federation
    common = {"seed": int(seed), "model": exp.model.model_dump(), "train": train,
              "privacy": exp.privacy.model_dump(),
              "federation": {"sites": sites, "min_clients": fed.min_clients, "task_timeout": fed.task_timeout,
                             "startup_timeout": fed.startup_timeout}}
    if exp.dataset.task == "segmentation":
        if not exp.dataset.modalities:
            raise BuildError("dataset.modalities is empty: a segmentation job needs the modality names")
        cfg = {"task": "segmentation", **common,
               "data": {"shape": exp.dataset.shape, "roi": exp.dataset.roi, "modalities": list(exp.dataset.modalities),
                        "in_channels": len(exp.dataset.modalities)}}
        if method.workflow == "ditto":
            cfg["ditto_lambda"] = method.ditto_lambda
        if method.workflow in ("seg_assess", "fedavg_w", "seg_clusters"):
            cfg["assess"] = {"per_value": method.per_value, "weights": _ship_name(method.encoder_weights)}
        return cfg
    if not exp.dataset.classes:
        raise BuildError("dataset.classes is not set: a job is built from the config alone, so the config must name "
                         "the classes (fedmed experiment fills it from the data it partitions)")
    return {"task": "classification", **common, "classes": list(exp.dataset.classes),
            "data": {"image_size": exp.dataset.image_size, "channels": exp.dataset.channels,
                     "n_classes": len(exp.dataset.classes)}}


def _ship_name(weights: str | None) -> str | None:
    return f"{WEIGHTS_DIR}/{Path(weights).name}" if weights else None


def check_encoder(name: str, weights: str | None, *, in_channels: int = 1, image_size=None):
    """Catch a bad encoder before anything is sent: an unknown name, a missing or mismatched weights file."""
    from fedmed.encoders import ENCODERS, EncoderError, build_encoder

    if name not in ENCODERS:
        try:
            build_encoder(name)
        except EncoderError as e:
            raise BuildError(str(e)) from None
    if weights:
        if not Path(weights).is_file():
            raise BuildError(f"encoder {name}: weights file {weights} not found (it is shipped to every site in the job)")
        try:
            build_encoder(name, weights=weights, in_channels=in_channels, image_size=image_size)
        except EncoderError as e:
            raise BuildError(str(e)) from None


def new_job(name: str, exp, controller, sites: list[str] | None, *, client_files=(), server_files=()):
    """A FedJob with ``controller`` on the server and the fedmed client script on the named sites (all
    connected sites when ``sites`` is None)."""
    from nvflare.app_common.widgets.convert_to_fed_event import ConvertToFedEvent
    from nvflare.app_opt.tracking.tb.tb_receiver import TBAnalyticsReceiver
    from nvflare.job_config.api import FedJob
    from nvflare.job_config.script_runner import FrameworkType, ScriptRunner

    fed = exp.federation
    job = FedJob(name=name, min_clients=min(fed.min_clients, len(sites)) if sites else fed.min_clients)
    job.set_app_packages(["fedmed"])  # installed at every site; not copied into the job
    job.to_server(controller, id="controller")
    job.to_server(TBAnalyticsReceiver(events=["fed.analytix_log_stats"]), id="tb_receiver")
    job.to_server({"task_request_interval": fed.task_request_interval})
    targets = sites if sites else [None]
    for site in targets:
        runner = ScriptRunner(script="custom/client.py", framework=FrameworkType.NUMPY, script_args="--threads 1")
        event = ConvertToFedEvent(events_to_convert=["analytix_log_stats"], fed_event_prefix="fed.")
        if site is None:
            job.to_clients(runner)
            job.to_clients(event, id="event_to_fed")
        else:
            job.to(runner, site)
            job.to(event, site, id="event_to_fed")
    for src, dest in client_files:
        for site in targets:
            job.add_file_to(str(src), site or "@ALL", dest_dir=dest)
    for src, dest in server_files:
        job.add_file_to_server(str(src), dest_dir=dest)
    return job


def export(job, out_dir) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with in_repo_root():
        job.export_job(str(out))
    return out / job.name
