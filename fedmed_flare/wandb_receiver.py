"""FLARE's Weights & Biases receiver with the server as a run of its own, the run's settings as its W&B config, and
offline runs kept in the run's folder by default (:mod:`fedmed_flare.tracking`). Imported only when a job turns W&B on
(it needs ``wandb``).

FLARE's receiver (``nvflare.app_opt.tracking.wandb.WandBReceiver``) opens one W&B run per connected site, each in a
process of its own fed by a queue, and logs what the sites stream. Here, besides: the arguments FLARE requires but
fedmed has no use for (``job_type``) are filled; ``dir`` (where ``wandb`` writes, offline runs included) defaults to
``fedmed/wandb/`` in the server's run folder (``fedmed experiment``: ``<out>/wandb``, one for the experiment); the
server's own per-round metrics (site mean and pooled) are a run named after the server; the run's parameters become
that run's W&B config, its status a tag and its ``result.json`` a file of the run.
"""

from __future__ import annotations

import time
from multiprocessing import get_context
from pathlib import Path

from nvflare.apis.analytix import AnalyticsData, AnalyticsDataType, LogWriterName
from nvflare.apis.dxo import from_shareable
from nvflare.apis.fl_constant import ProcessType
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.app_opt.tracking.wandb.wandb_receiver import WandBReceiver as _FlareWandBReceiver
from nvflare.app_opt.tracking.wandb.wandb_receiver import WandBTask, _check_wandb_args, _get_job_id_tag

from fedmed_flare.destinations import check_receiver

__all__ = ["WandBReceiver"]


class WandBReceiver(_FlareWandBReceiver):
    """FLARE's W&B receiver (same arguments, and ``wandb_dir``); see the module notes."""

    def __init__(self, wandb_args: dict, mode: str = "offline", events=None, process_timeout: float = 60.0,
                 wandb_dir: str | None = None):
        # "config": FLARE's receiver fills each site's W&B config (job id, site, run name) into this dict if there is
        # one, and drops it otherwise
        super().__init__(wandb_args={"job_type": "fedmed", "config": {}, **wandb_args}, mode=mode, events=events,
                         process_timeout=process_timeout)
        self.wandb_dir = wandb_dir

    def initialize(self, fl_ctx: FLContext):
        """One W&B run per connected site and one for the server, as FLARE's receiver opens them, each in a process
        of its own — *spawned* (a fresh interpreter), where FLARE's receiver forks the server's process while FLARE's
        threads run in it (Python's documentation warns that a child forked from a multi-threaded process can
        deadlock). A run that never reaches ``run.finish()`` loses everything: W&B buffers an offline run's records
        until then, so its file keeps only its 7-byte header (measured: a run stopped 1, 3 or 8 s after
        ``wandb.init``)."""
        check_receiver(self)  # the server's policy decides where metrics may go, before anything is contacted
        folder = Path(self.wandb_dir) if self.wandb_dir else (
            Path(fl_ctx.get_engine().get_workspace().get_run_dir(fl_ctx.get_job_id())) / "fedmed" / "wandb")
        folder.mkdir(parents=True, exist_ok=True)
        self.wandb_args.setdefault("dir", str(folder))
        self.fl_ctx = fl_ctx
        if self.mode == "online":  # as FLARE's receiver: offline when W&B cannot be reached
            import wandb

            try:
                wandb.login(timeout=1, verify=True)
            except Exception as e:  # noqa: BLE001
                self.log_warning(fl_ctx, f"Unsuccessful login: {e}. Using wandb offline mode.")
                self.mode = "offline"
        run_name, job = self.wandb_args["name"], _get_job_id_tag(fl_ctx)
        owners = [c.name for c in fl_ctx.get_engine().get_clients()] if (
            fl_ctx.get_process_type() == ProcessType.SERVER_JOB) else [fl_ctx.get_identity_name()]
        me = fl_ctx.get_identity_name()  # the server: its own metrics, the run's parameters and result
        if me and me not in owners:
            owners.append(me)
        ctx = get_context("spawn")
        for owner in owners:
            args = {**self.wandb_args, "name": f"{owner}-{job}-{run_name}", "group": f"{run_name}-{job}",
                    "mode": self.mode, "config": {"job_id": job, "client": owner, "run_name": run_name}}
            _check_wandb_args(args)
            q = ctx.Queue()
            q.put(WandBTask(task_owner=owner, task_type="init", task_data=args, step=0))
            self.queues[owner] = q
            self.processes[owner] = ctx.Process(target=run_queue, args=(q,), name=f"wandb-{owner}")
            self.processes[owner].start()

    def finalize(self, fl_ctx: FLContext):
        """Stop every run (each logs its last step and finishes), wait up to ``process_timeout`` seconds for all of
        them together, then end those still going — and say which: their offline files are incomplete."""
        for owner, q in self.queues.items():
            q.put(WandBTask(task_owner=owner, task_type="stop", task_data={}, step=0))
        deadline = time.monotonic() + self.process_timeout
        for owner, p in self.processes.items():
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                self.log_error(fl_ctx, f"the W&B run of {owner} did not finish within {self.process_timeout:.0f} s; "
                                       f"it is stopped and its offline run file is incomplete")
                p.terminate()
            elif p.exitcode:
                self.log_error(fl_ctx, f"the W&B run of {owner} ended with exit code {p.exitcode}; see its "
                                       f"debug.log under {Path(self.wandb_args['dir']).name}/wandb")

    def save(self, fl_ctx: FLContext, shareable: Shareable, record_origin: str):
        """The run's parameters, tags and result text (the server's ``fedmed.run_info``) as W&B config, tags and a
        file; metrics as FLARE's receiver logs them."""
        data = AnalyticsData.from_dxo(from_shareable(shareable), receiver=LogWriterName.WANDB)
        q = self.get_task_queue(record_origin)
        if not data or q is None:
            return
        if data.data_type == AnalyticsDataType.PARAMETERS:
            q.put(WandBTask(task_owner=record_origin, task_type="config", task_data=dict(data.value), step=None))
        elif data.data_type == AnalyticsDataType.TAGS:
            q.put(WandBTask(task_owner=record_origin, task_type="tags", task_data=dict(data.value), step=None))
        elif data.data_type == AnalyticsDataType.TEXT:
            name = (data.kwargs or {}).get("path") or f"{data.tag}.txt"
            q.put(WandBTask(task_owner=record_origin, task_type="file", task_data={name: str(data.value)}, step=None))
        else:
            super().save(fl_ctx, shareable, record_origin)



def run_queue(queue) -> None:
    """One W&B run's process: FLARE's queue loop (metrics of a step buffered until the next step begins; a step older
    than the current one dropped, as FLARE's), and the config, tags and files :meth:`WandBReceiver.save` adds. A
    module function, so that a spawned process can run it."""
    import wandb

    run, step, buffer = None, 0, {}
    try:
        while True:
            task = queue.get()
            if task.task_type == "stop":
                if run is not None and step in buffer:
                    wandb.log(buffer.pop(step), step=step)
                break
            if task.task_type == "init":
                run = wandb.init(**task.task_data)
            elif run is None:
                continue
            elif task.task_type == "config":
                run.config.update(task.task_data, allow_val_change=True)
            elif task.task_type == "tags":
                run.tags = tuple(run.tags or ()) + tuple(f"{k}={v}" for k, v in task.task_data.items())
            elif task.task_type == "file":
                for name, text in task.task_data.items():
                    (Path(run.dir) / name).write_text(text)
                    run.save(str(Path(run.dir) / name), base_path=run.dir, policy="now")
            elif task.task_type == "log":
                s = step if task.step is None else int(task.step)
                if s < step:
                    continue
                if s > step and step in buffer:
                    wandb.log(buffer.pop(step), step=step)
                buffer.setdefault(s, {}).update(task.task_data)
                step = s
    finally:
        if run is not None:
            run.finish()
