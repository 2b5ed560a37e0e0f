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
from multiprocessing import Process, Queue
from pathlib import Path

from nvflare.apis.analytix import AnalyticsData, AnalyticsDataType, LogWriterName
from nvflare.apis.dxo import from_shareable
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.app_opt.tracking.wandb.wandb_receiver import WandBReceiver as _FlareWandBReceiver
from nvflare.app_opt.tracking.wandb.wandb_receiver import WandBTask, _get_job_id_tag

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
        check_receiver(self)  # the server's policy decides where metrics may go, before anything is contacted
        folder = Path(self.wandb_dir) if self.wandb_dir else (
            Path(fl_ctx.get_engine().get_workspace().get_run_dir(fl_ctx.get_job_id())) / "fedmed" / "wandb")
        folder.mkdir(parents=True, exist_ok=True)
        self.wandb_args.setdefault("dir", str(folder))
        run_name = self.wandb_args["name"]
        super().initialize(fl_ctx)
        me = fl_ctx.get_identity_name()  # the server: its own metrics, the run's parameters and result
        if me and me not in self.queues:
            job = _get_job_id_tag(fl_ctx)
            args = {**self.wandb_args, "name": f"{me}-{job}-{run_name}", "group": f"{run_name}-{job}",
                    "mode": self.mode, "config": {"job_id": job, "client": me, "run_name": run_name}}
            q = Queue()
            q.put(WandBTask(task_owner=me, task_type="init", task_data=args, step=0))
            self.queues[me] = q
            self.processes[me] = Process(target=self._process_queue_tasks, args=(q,))
            self.processes[me].start()
            time.sleep(0.2)

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

    def _process_queue_tasks(self, queue):
        """One W&B run's process: FLARE's queue loop (metrics of a step buffered until the next step begins; a step
        older than the current one dropped, as FLARE's), and the config, tags and files :meth:`save` adds."""
        import wandb

        run, step, buffer = None, 0, {}
        try:
            while True:
                task = queue.get()
                if task.task_type == "stop":
                    if step in buffer:
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
