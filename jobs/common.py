"""Shared job-building code: fedmed config for the FLARE components, and the FedJob scaffold.

Job folders produced here run unchanged in ``nvflare simulator JOB -w WS -n N -t N``, in POC mode
(``poc/run_poc.py`` submits through the admin API) and on provisioned sites (admin console
``submit_job``). Sites need ``fedmed`` installed; the job carries only ``custom/`` (client
script and controllers).
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@contextmanager
def in_repo_root():
    """FLARE records script paths relative to the working directory; build from the repo root."""
    old = os.getcwd()
    os.chdir(ROOT)
    try:
        yield
    finally:
        os.chdir(old)


def fedmed_config(exp, dataset_meta: dict, seed: int, method=None) -> dict:
    """The plain-dict config that travels to sites in each task's ``meta['fedmed']``."""
    train = exp.train.model_dump()
    if method is not None and method.fedprox_mu is not None:
        train["fedprox_mu"] = method.fedprox_mu
    elif method is not None and method.workflow == "fedprox" and train["fedprox_mu"] == 0:
        train["fedprox_mu"] = 0.01
    if exp.dataset.task == "segmentation":
        cfg = {"task": "segmentation", "seed": int(seed), "model": exp.model.model_dump(), "train": train,
               "data": {"shape": exp.dataset.shape, "roi": exp.dataset.roi,
                        "in_channels": len(dataset_meta["modalities"])}}
        if method is not None and method.workflow == "ditto":
            cfg["ditto_lambda"] = method.ditto_lambda
        if method is not None:
            cfg["assess"] = {"per_value": method.per_value, "weights": method.encoder_weights}
        return cfg
    return {
        "seed": int(seed),
        "model": exp.model.model_dump(),
        "train": train,
        "data": {"image_size": exp.dataset.image_size, "channels": exp.dataset.channels,
                 "n_classes": int(dataset_meta["n_classes"])},
    }


def new_job(name: str, sites: list[str], datalist_dir: str, controller, threads_per_site: int = 1):
    """A FedJob with ``controller`` on the server and the fedmed client script on every site."""
    from nvflare.app_opt.tracking.tb.tb_receiver import TBAnalyticsReceiver
    from nvflare.app_common.widgets.convert_to_fed_event import ConvertToFedEvent
    from nvflare.job_config.api import FedJob
    from nvflare.job_config.script_runner import FrameworkType, ScriptRunner

    job = FedJob(name=name, min_clients=1)
    job.set_app_packages(["fedmed"])  # installed at every site; not copied into the job
    job.to_server(controller, id="controller")
    job.to_server(TBAnalyticsReceiver(events=["fed.analytix_log_stats"]), id="tb_receiver")
    for site in sites:
        runner = ScriptRunner(script="custom/client.py", framework=FrameworkType.NUMPY,
                              script_args=f"--datalist-dir {Path(datalist_dir).resolve()} --threads {threads_per_site}")
        job.to(runner, site)
        job.to(ConvertToFedEvent(events_to_convert=["analytix_log_stats"], fed_event_prefix="fed."), site,
               id="event_to_fed")
    return job


def export(job, out_dir) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with in_repo_root():
        job.export_job(str(out))
    return out / job.name


def read_dataset_meta(datalist_dir) -> dict:
    p = Path(datalist_dir) / "dataset.json"
    if not p.is_file():
        raise FileNotFoundError(f"{p}: dataset.json not found; write datalists with `fedmed data` first")
    return json.loads(p.read_text())
