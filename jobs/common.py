"""Shared job-building code: the fedmed config for the FLARE components, and the FedJob scaffold.

A job is built from the experiment config alone: it names its sites (or deploys to every connected
site) and carries no path to anyone's data — each site finds its own data through its site-local
settings (``fedmed.site.settings``). Job folders produced here run unchanged in the simulator
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

from fedmed.run.taskconfig import WEIGHTS_DIR, BuildError, fedmed_config, min_clients  # noqa: E402,F401  (re-exported)


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




def check_encoder(name: str, weights: str | None, *, in_channels: int = 1, image_size=None):
    """Catch a bad encoder before anything is sent: an unknown name, a missing or mismatched weights file."""
    from fedmed.nn.encoders import ENCODERS, EncoderError, build_encoder

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
    quorum = min_clients(fed.min_clients, sites)
    if quorum < fed.min_clients:
        print(f"note: federation.min_clients={fed.min_clients} lowered to {quorum}: the job targets {len(sites)} "
              f"named site(s) {sites}", file=sys.stderr)
    client_files = [(Path(src).resolve(), dest) for src, dest in client_files]  # the caller's folder, not ROOT
    server_files = [(Path(src).resolve(), dest) for src, dest in server_files]
    with in_repo_root():  # ScriptRunner resolves custom/client.py against the working directory
        job = FedJob(name=name, min_clients=quorum)
        job.set_app_packages(["fedmed"])  # installed at every site; not copied into the job
        job.to_server(controller, id="controller")
        job.to_server(TBAnalyticsReceiver(events=["fed.analytix_log_stats"]), id="tb_receiver")
        # FLARE reads it at the path server.task_request_interval (server_json_config.py); a top-level key is ignored
        job.to_server({"server": {"task_request_interval": fed.task_request_interval}})
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
    out = Path(out_dir).resolve()  # relative to the caller's folder (the export runs from ROOT)
    out.mkdir(parents=True, exist_ok=True)
    with in_repo_root():
        job.export_job(str(out))
    return out / job.name
