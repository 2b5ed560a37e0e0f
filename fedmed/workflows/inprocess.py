"""Every site in this process: the :class:`~fedmed.workflows.federation.Federation` that runs fedmed's server
workflows without FLARE, for benchmarks, references (each site alone, centralized) and fast tests.

It runs the *same* workflow code as the FLARE adapter (``fedmed_flare/controller.py``) and each site's task through the
same reply loop as the FLARE site executor (:func:`fedmed.site.reply.answer`), one site after the other with one torch
thread each, as a simulated site runs; tasks carry copies of their config and parameters as FLARE's messages do.
A clustered workflow run here and in FLARE's simulator gives the same models bit for bit
(``tests/test_workflows.py``).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedmed.workflows.federation import Federation, RunFailed

__all__ = ["InProcessFederation", "Message", "fedavg_in_process", "run_in_process"]


@dataclass
class Message:
    """One task as the in-process federation carries it."""

    params: dict
    round: int
    config: dict


def _copy_config(cfg: dict) -> dict:
    """What a site receives of a config: FLARE serializes it (tuples arrive as lists)."""
    try:
        return json.loads(json.dumps(cfg))
    except (TypeError, ValueError):
        return copy.deepcopy(cfg)


# torch threads of a site computing in this process: 1, as each of FLARE's simulated sites (several experiments can
# then share a machine's cores); `fedmed experiment --in-process` trains its reference rows at the same count
SITE_THREADS = 1


@contextlib.contextmanager
def torch_threads(n: int):
    """torch computes at ``n`` threads inside; the count it had is given back after."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(int(n))
    try:
        yield
    finally:
        torch.set_num_threads(before)


class InProcessFederation(Federation):
    """Sites ``sites`` with their data found in ``datalists`` (a folder of ``<site>.json``, or ``{site: settings}``).

    Args:
        out_dir: the run's ``fedmed/`` folder (record, checkpoint, models).
        job_files: what a job would carry to the server (``model.init_weights``, a training run's models).
        policy: the :class:`~fedmed.core.policy.SitePolicy` of the server and every site; by default the
            experimenter's own (:meth:`~fedmed.core.policy.SitePolicy.simulating`: the config's ``k_min`` is the floor,
            weights come from ``weights_dir``).
        weights_dir: the sites' weights folder under the default policy.
        resume_from: a ``checkpoint/`` folder to continue from.
        threads: torch threads while the sites compute (1, as each simulated site).
        log: where the run's log lines go (default: print; ``None`` keeps quiet).
        on_round: called with each recorded round (``{"round", "task", "sites", "summary", ...}``).
        tensorboard: also write the record's TensorBoard scalars.
        site_dir: the folder holding each site's own workspace, ``<site_dir>/<site>`` (where it keeps the model a
            serving plan serves it); default ``<out_dir>/sites``.
    """

    def __init__(self, datalists, sites: list[str], out_dir, *, job_files=None, resume_from=None,
                 threads: int = SITE_THREADS, site_dir=None,
                 log=print, on_round=None, tensorboard: bool = False, policy=None, weights_dir=None):
        self._settings = datalists if isinstance(datalists, dict) else {s: Path(datalists) for s in sites}
        self.site_names = list(sites)
        self._out = Path(out_dir)
        self._site_dir = Path(site_dir) if site_dir is not None else self._out / "sites"
        self._job_files = Path(job_files) if job_files is not None else None
        self._resume = Path(resume_from) if resume_from is not None else None
        self.threads = int(threads)
        self._log = log
        self._on_round = on_round
        self.tensorboard = bool(tensorboard)
        self.runners: dict = {}
        self.sites: list = []
        self.active: set = set()
        self.task_log: list = []  # (task, round, site) in the order the sites ran them
        self._policy = policy
        self._weights_dir = weights_dir

    @property
    def policy(self):
        if self._policy is None:
            from fedmed.core.policy import SitePolicy
            from fedmed.core.schema import task_config

            self._policy = SitePolicy.simulating(task_config(self.cfg).privacy.k_min, weights_dir=self._weights_dir)
        return self._policy

    def site_settings(self, site: str):
        """The settings a simulated site answers with (its datalist, this federation's policy)."""
        from fedmed.site.settings import SiteSettings, settings_for_dir

        s = self._settings[site]
        if isinstance(s, SiteSettings):
            return s
        return settings_for_dir(site, s, policy=self.policy).in_workspace(self._site_dir / site)

    @property
    def out_dir(self) -> Path:
        return self._out

    @property
    def job_files(self):
        return self._job_files

    def resume_dir(self):
        return self._resume

    def message(self, params: dict, round_: int, config: dict) -> Message:
        return Message(params=params, round=int(round_), config=config)

    def log(self, level: str, msg: str) -> None:
        if self._log is not None:
            self._log(f"{level.upper()}: {msg}" if level != "info" else msg)

    def record_rows(self, round_, rows, task) -> list:
        ok = super().record_rows(round_, rows, task)
        if self._on_round is not None:
            self._on_round(self.recorder.doc["rounds"][-1])
        return ok

    def wait_for_sites(self) -> list:
        sites = sorted(self.site_names)
        if len(sites) < self.min_clients:
            raise RunFailed(f"{len(sites)} site(s) {sites}, fewer than min_clients={self.min_clients}")
        self.recorder.set_sites(sites)
        return sites

    def send_groups(self, task_name: str, groups: dict) -> dict:
        from fedmed.site.reply import Reply, answer

        replies = {}
        with torch_threads(self.threads):
            for key, (msg, sites) in groups.items():
                self.recorder.log_task(task_name, msg.round, sorted(sites), key)
                rows = []
                for s in sorted(sites):
                    params = {k: np.array(v, copy=True) for k, v in (msg.params or {}).items()}
                    runner, reply, err = answer(s, self.runners.get(s), task_name, params, _copy_config(msg.config),
                                                msg.round, settings=self.site_settings(s))
                    if runner is not None:
                        self.runners[s] = runner
                    if err is not None:  # one line; the traceback only with FEDMED_DEBUG=1
                        line, _, trace = err.partition("\n")
                        print(f"[fedmed] {line}" + (f"\n{trace}" if trace and os.environ.get("FEDMED_DEBUG") == "1"
                                                     else ""), file=sys.stderr, flush=True)
                    self.task_log.append((task_name, msg.round, s))
                    rows.append(Reply(s, dict(reply.metrics), {**reply.meta, "client_name": s}, reply.params))
                replies[key] = rows
        return replies


def run_in_process(workflow, datalists, sites: list[str], out_dir, **kw) -> tuple[str, InProcessFederation]:
    """Run ``workflow`` (a :class:`~fedmed.workflows.base.Workflow`) over ``sites``; (its status, the federation —
    ``fed.recorder.doc`` is the record, ``out_dir/models`` the final models)."""
    fed = InProcessFederation(datalists, sites, out_dir, **kw)
    return fed.run(workflow), fed


def fedavg_in_process(cfg: dict, datalists, sites: list[str], *, rounds: int, init: dict | None = None, log=None,
                      out_dir=None, threads: int | None = None) -> tuple[dict, list[dict]]:
    """FedAvg (the workflow every job runs, :class:`~fedmed.workflows.fedavg.FedAvg`) over ``sites`` in this process,
    for ``rounds`` rounds with the task config ``cfg``; ``init`` overrides entries of the initial parameters (e.g. a
    pre-trained encoder). Every site must answer every round (a failed site raises). ``threads``: torch threads of
    the sites' compute (default: this process's).

    Returns:
        (final global params, one summary per round — ``{"round", "task", "mean", "std", "pooled", ...}`` of the
        model served in rounds 0..R, as the run's record has them).
    """
    import tempfile

    import torch

    from fedmed.workflows.fedavg import FedAvg

    from fedmed.core.schema import task_config

    federation = task_config(cfg).federation.model_copy(update={"sites": list(sites), "min_clients": len(sites)})
    cfg = {**cfg, "federation": federation.model_dump()}
    final = {}

    class _FedAvg(FedAvg):
        def initial_params(self, c=None):
            theta = super().initial_params(c)
            if init:
                theta.update({k: v for k, v in init.items() if k in theta})
            return theta

        def save_final(self, params, name="global", *, sites=None, cluster=None, rounds=None, decision=None):
            final.update(params)

    def on_round(entry):
        if log is not None:
            m = entry["summary"]["mean"]
            log(f"round {entry['round']}: val acc {m.get('val_accuracy', np.nan):.3f} test acc "
                f"{m.get('accuracy', np.nan):.3f} loss {m.get('train_loss', np.nan):.3f}")

    with tempfile.TemporaryDirectory(prefix="fedmed_inproc_") as tmp:
        fed = InProcessFederation(datalists, sites, Path(out_dir) if out_dir else Path(tmp), log=None,
                                  on_round=on_round, threads=threads or torch.get_num_threads())
        status = fed.run(_FedAvg(rounds, cfg))
        doc = fed.recorder.doc
    if status != "finished":
        raise RuntimeError(f"in-process FedAvg {status}: {doc.get('reason')}")
    return final, [{"round": r["round"], "task": r["task"], **r["summary"]} for r in doc["rounds"]]
