"""The NVFlare side of every fedmed server workflow (installed with fedmed; a job names it by class path): one
controller that runs a workflow of ``fedmed.workflows`` (named in the job, with its options) as a
:class:`fedmed.workflows.Federation` on FLARE.

The workflows read like their papers' algorithm boxes; this adapter gives all of them the same behaviour at a
hospital:

* **Sites by name.** The job names its sites (``federation.sites``) or takes every connected one.
  The run waits up to ``startup_timeout`` for the named sites to register and starts without the
  missing ones (each named in the record) when at least ``min_clients`` are there.
* **Faults.** Every task has a response timeout (``task_timeout``). A site that does not answer is
  left out of that round (recorded as an error naming it) and put on probation: later rounds still
  send it the task, but wait for it only as long as the others took (twice, plus 10 s); when it
  answers again it rejoins. A round with fewer than ``min_clients`` answers fails the run.
* **Stop.** When FLARE ends the job (e.g. a site's job process died), ``abort_signal`` fires and the
  controller stops at once: no empty round is written and the run is marked ``stopped``.
* **Honest status.** ``metrics.json`` says ``finished``, ``stopped`` or ``failed`` with the reason; a run
  that did not finish saves no model called final, and a failed run panics so FLARE's job status
  shows the failure too.
* **Checkpoint and resume.** After every completed round the server writes ``fedmed/checkpoint/``
  (models, workflow state, the record so far). A job built with ``--resume-from`` carries it and
  continues from the next round; the record says which rounds ran in which attempt.
"""

import json
import os
import time
from functools import cached_property
from pathlib import Path

from nvflare.app_common.abstract.fl_model import FLModel
from nvflare.app_common.workflows.model_controller import ModelController

from fedmed.core import jobfiles
from fedmed.core.compat import serialize_ast_parse
from fedmed.core.schema import task_config
from fedmed.workflows import RESUME_DIR, Federation, RunFailed, RunStopped, server_workflow

serialize_ast_parse()  # the server decodes several sites' arrays at once (np.load -> ast.parse): fedmed/compat.py

__all__ = ["DEAD_SITES_ENV", "RESUME_DIR", "TASK_CHECK_PERIOD_S", "WorkflowController", "unpack"]

DEAD_SITES_ENV = "FEDMED_DEAD_SITES"  # set by fedmed_flare.simulator: a folder where it notes the sites whose worker died
TASK_CHECK_PERIOD_S = 0.05  # how often FLARE's task monitor looks for finished tasks (its default: 0.2 s)


def unpack(results) -> list:
    """FLModel results -> the sites' :class:`~fedmed.site.tasks.Reply` rows, sorted by site."""
    from fedmed.site.tasks import Reply

    out = [Reply(r.meta.get("client_name", "?"), dict(r.metrics or {}), dict(r.meta or {}), r.params or {})
           for r in results]
    return sorted(out, key=lambda t: t.site)


class WorkflowController(Federation, ModelController):
    """Runs the server workflow ``workflow_name`` (``module:Class``, :func:`fedmed.workflows.server_workflow`) with
    ``workflow_args`` for ``num_rounds`` rounds; ``task_config`` is the task config every task carries."""

    def set_communicator(self, communicator):
        """FLARE 2.9's ``Controller.set_communicator`` hands the controller's ``task_check_period`` to
        ``communicator.task_check_period``, but ``WFCommServer``'s monitor sleeps ``_task_check_period`` (set only by
        its constructor, 0.2 s): a finished round waited up to 0.2 s (0.1 s on average) before the workflow saw it.
        Set the attribute the monitor reads."""
        super().set_communicator(communicator)
        if hasattr(communicator, "_task_check_period"):
            communicator._task_check_period = self._task_check_period

    tensorboard = False  # FLARE's TensorBoard receiver writes the server's metrics (fedmed_flare.tracking)

    def __init__(self, num_rounds: int, task_config: dict, workflow_name: str = "fedmed.workflows.fedavg:FedAvg",
                 workflow_args: dict | None = None, resume: bool = False, **kwargs):
        super().__init__(persistor_id="", ignore_result_error=True, task_check_period=TASK_CHECK_PERIOD_S, **kwargs)
        # attribute names equal the constructor arguments: FedJob exports them from the instance
        self.num_rounds = int(num_rounds)
        self.task_config = dict(task_config)
        self.workflow_name = str(workflow_name)
        self.workflow_args = dict(workflow_args or {})
        self.resume = bool(resume)
        self.sites: list = []
        self.active: set = set()

    # ------------------------------------------------------------------ the Federation on FLARE
    @property
    def out_dir(self) -> Path:
        return Path(self.get_run_dir()) / "fedmed"

    @property
    def job_files(self) -> Path:
        """What this job carries to the server (init weights, a checkpoint, a training run's models): data in the app's
        ``config/`` folder (``fedmed.core.jobfiles``), so the job is not custom code to FLARE."""
        return Path(self.get_app_dir()) / "config" / jobfiles.FILES_DIR

    @property
    def policy(self):
        """The server's policy (``local/fedmed_policy.json`` of its kit, or ``FEDMED_SITE_POLICY``)."""
        if getattr(self, "_policy", None) is None:
            from fedmed.core.policy import load_policy

            self._policy = load_policy()
        return self._policy

    @property
    def user_code(self) -> Path:
        """A user's network class, in the app's ``custom/`` folder (only in a job FLARE authorised as BYOC)."""
        return Path(self.get_app_dir()) / "custom" / jobfiles.USER_CODE_DIR

    @cached_property
    def typed_config(self):
        """The task config, typed: validated once per job at the server (#88)."""
        return task_config(self.task_config)

    @cached_property
    def federation_settings(self):
        """The task config's ``federation`` section (sites, min_clients, timeouts)."""
        return self.typed_config.federation

    def resume_dir(self):
        return self.job_files / RESUME_DIR if self.resume else None

    def message(self, params: dict, round_: int, config: dict) -> FLModel:
        return FLModel(params=params, current_round=round_, total_rounds=self.num_rounds, meta={"task_config": config})

    def log(self, level: str, msg: str) -> None:
        {"info": ModelController.info, "warning": ModelController.warning}.get(level, ModelController.error)(self, msg)

    def failed(self, reason: str) -> None:
        self.panic(reason)

    def run(self):
        """FLARE's entry point: the named workflow, run on this federation."""
        from fedmed.core.plugins import PluginError, add_code_folder, import_plugins
        from fedmed.workflows import WorkflowNotFound

        if self.user_code.is_dir():
            add_code_folder(self.user_code)  # a plugin or a user's class the job carries (BYOC), after what is installed
        try:  # a plugin method's module, if the server's policy lists it
            import_plugins(self.typed_config.plugins, self.policy.modules)
            cls = server_workflow(self.workflow_name)
        except (PluginError, WorkflowNotFound) as e:
            self.panic(f"fedmed run failed: the server cannot run the job's workflow: {e}")
            return
        Federation.run(self, cls(self.num_rounds, self.task_config, **self.workflow_args))

    def preflight(self) -> None:
        """The job's tracking receivers against the server's policy: a refused one sent nothing
        (``fedmed_flare.destinations.check_receiver``), and the run does not go on without it."""
        from fedmed_flare.destinations import refused_receivers

        why = refused_receivers(self.policy, getattr(getattr(self.engine, "run_manager", None), "components", None))
        if why:
            raise RunFailed(f"the server does not send this job's metrics where it asks: {why}")

    # ------------------------------------------------------------------ tracking: FLARE analytics to the receivers
    def _send_analytics(self, dxo, event_type):
        from nvflare.apis.utils.analytix_utils import send_analytic_dxo

        try:
            with self.engine.new_context() as ctx:
                send_analytic_dxo(self, dxo, ctx, event_type=event_type)
        except Exception as e:  # a tracker never takes a run down
            self.warning(f"[fedmed] experiment tracking: {type(e).__name__}: {e}")

    def track_round(self, scalars: dict, round_: int) -> None:
        from nvflare.apis.analytix import AnalyticsDataType
        from nvflare.apis.utils.analytix_utils import create_analytic_dxo

        from fedmed_flare.tracking import SERVER_EVENTS

        for tag, v in scalars.items():
            self._send_analytics(create_analytic_dxo(tag, float(v), AnalyticsDataType.SCALAR, global_step=int(round_)),
                       SERVER_EVENTS[0])

    def track_run(self, params: dict | None = None, result: dict | None = None) -> None:
        from nvflare.apis.analytix import AnalyticsDataType
        from nvflare.apis.utils.analytix_utils import create_analytic_dxo

        from fedmed.core.io import json_default
        from fedmed_flare.tracking import RUN_EVENT

        if params:
            self._send_analytics(create_analytic_dxo("params", {k: v[:500] for k, v in params.items()},
                                           AnalyticsDataType.PARAMETERS), RUN_EVENT)
        if result is not None:
            tags = {"fedmed.status": str(result.get("status")), "fedmed.workflow": self.workflow_name}
            self._send_analytics(create_analytic_dxo("tags", tags, AnalyticsDataType.TAGS), RUN_EVENT)
            self._send_analytics(create_analytic_dxo("result", json.dumps(result, default=json_default, indent=1),
                                           AnalyticsDataType.TEXT, path="result.json"), RUN_EVENT)

    def aborted(self) -> bool:
        return self.abort_signal is not None and self.abort_signal.triggered

    def check_abort(self, where: str = ""):
        if self.aborted():
            raise RunStopped(f"FLARE ended the job{' ' + where if where else ''} (a site's job process may have "
                             f"died; resume from the last checkpoint without it)")

    def connected(self) -> list:
        return sorted(c.name for c in self.engine.get_clients())

    def wait_for_sites(self) -> list:
        """The sites this run uses: the job's named sites that registered within ``startup_timeout``
        (all connected sites when the job names none)."""
        expected = list(self.federation_settings.sites or [])
        deadline = time.time() + self.federation_settings.startup_timeout
        present = self.connected()
        while expected and any(s not in present for s in expected) and time.time() < deadline:
            self.check_abort("while waiting for sites")
            time.sleep(0.5)
            present = self.connected()
        sites = [s for s in present if not expected or s in expected]
        for s in sorted(set(expected) - set(present)):
            self.recorder.error(-1, s, "startup", f"{s}: never registered within startup_timeout "
                                f"{self.federation_settings.startup_timeout:g} s; the run goes on without it")
            self.error(f"site {s} never registered; going on without it")
        if len(sites) < self.min_clients:
            raise RunFailed(f"{len(sites)} site(s) registered {sites}, fewer than min_clients={self.min_clients}")
        self.recorder.set_sites(sites)
        return sites

    # ------------------------------------------------------------------ exchanges
    def dead_sites(self) -> dict:
        """``{site: exit code}`` of the sites whose process died (noted by the simulator, ``fedmed_flare.simulator``;
        a provisioned site's dead job process ends the job through FLARE instead)."""
        folder = os.environ.get(DEAD_SITES_ENV)
        if not folder or not os.path.isdir(folder):
            return {}
        out = {}
        for f in Path(folder).glob("*.json"):
            try:
                out[f.stem] = json.loads(f.read_text()).get("returncode")
            except (OSError, ValueError):
                continue
        return out

    def send_groups(self, task_name: str, groups: dict) -> dict:
        """Send one task to several groups of sites at once (``{key: (FLModel, sites)}``), each group with
        its own model; wait as the module notes say; ``{key: [rows]}``. Sites that did not answer are
        recorded as errors of this round and put on probation."""
        replies = {key: [] for key in groups}
        timeout = self.federation_settings.task_timeout
        targets = set()
        r_ = next((d.current_round for d, _ in groups.values()), None)
        gone = self.dead_sites()  # a dead simulated site never comes back: it sits out every later task
        for key, (data, sites) in groups.items():
            for s in sorted(set(sites) & set(gone)):
                self.recorder.error(r_, s, task_name, f"{s}: its process died (exit code {gone[s]}); left out of this "
                                    f"round and the rest of the run")
            sites = sorted(s for s in sites if s not in gone)
            if not sites:
                continue
            targets |= set(sites)
            self.recorder.log_task(task_name, data.current_round, sites, key)
            self.send_model(task_name=task_name, data=data, targets=sites, timeout=max(1, int(round(timeout))),
                            callback=lambda model, key=key: replies[key].append(model))
        t0 = time.time()
        active_done_at = None
        dead: dict = {}
        while self.get_num_standing_tasks():
            self.check_abort(f"during {task_name}")
            answered = {r.meta.get("client_name") for rs in replies.values() for r in rs}
            dead = self.dead_sites()
            if targets <= answered | set(dead):
                break  # every site has answered or its process is gone: nothing left to wait for
            now = time.time()
            if active_done_at is None and (targets & self.active) <= answered | set(dead):
                active_done_at = now
            if active_done_at is not None and now - active_done_at > 2 * (active_done_at - t0) + 10:
                break  # the active sites are done; probation sites had their chance
            if now - t0 > timeout + 5:
                break
            time.sleep(0.05)
        if self.get_num_standing_tasks():
            self.cancel_all_tasks()
        self.check_abort(f"during {task_name}")
        rows = {key: unpack(rs) for key, rs in replies.items()}
        answered = {r[0] for rs in rows.values() for r in rs}
        for s in sorted(targets - answered):
            if s in dead:
                self.recorder.error(r_, s, task_name, f"{s}: its process died (exit code {dead[s]}); left out of this "
                                    f"round and the rest of the run")
                self.error(f"site {s}: its process died (exit code {dead[s]}); the run goes on without it")
                continue
            why = "no answer within task_timeout" if time.time() - t0 >= timeout else \
                "no answer while the other sites finished (on probation since an earlier round)"
            self.recorder.error(r_, s, task_name, f"{s}: {why} ({time.time() - t0:.0f} s); left out of this round")
            self.warning(f"site {s} did not answer {task_name} in round {r_}; left out")
        self.active = (self.active - (targets - answered)) | answered
        return rows

