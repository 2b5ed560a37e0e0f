"""Shared plumbing of fedmed's NVFlare server workflows (one controller per module beside this one).

Every controller's ``workflow()`` reads like its paper's algorithm box; this base gives all of them
the same behaviour at a hospital:

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
import sys
import time
from pathlib import Path

import numpy as np
from nvflare.app_common.abstract.fl_model import FLModel
from nvflare.app_common.workflows.model_controller import ModelController

from fedmed import memtrace
from fedmed.compat import serialize_ast_parse
from fedmed.models import USER_CODE_DIR
from fedmed.reporting import Recorder

serialize_ast_parse()  # the server decodes several sites' arrays at once (np.load -> ast.parse): fedmed/compat.py

RESUME_DIR = "fedmed_resume"  # inside the server app's custom folder of a resumed job
DEAD_SITES_ENV = "FEDMED_DEAD_SITES"  # set by jobs/simulator.py: a folder where it notes the sites whose worker died


class RunStopped(Exception):
    """FLARE ended the job (abort signal); the run stops where it is."""


class RunFailed(Exception):
    """The run cannot go on (e.g. fewer than min_clients sites answered); the message says why."""


def unpack(results) -> list:
    """FLModel results -> (site, metrics, meta, params) tuples, sorted by site."""
    out = [(r.meta.get("client_name", "?"), dict(r.metrics or {}), dict(r.meta or {}), r.params) for r in results]
    return sorted(out, key=lambda t: t[0])


def initial_params(cfg: dict, app_custom=None) -> dict:
    """The model every site starts from (the seeded network, or ``model.init_weights``, which the job carries in the
    server app's custom folder ``app_custom``)."""
    from fedmed.train import get_params

    m, d = cfg["model"], cfg["data"]
    if cfg.get("task") == "mae":
        from fedmed.ssl import mae_model

        return get_params(mae_model(d["channels"], mask_ratio=cfg["mae"].get("mask_ratio", 0.75), seed=cfg.get("seed", 0)))
    if cfg.get("task") == "segmentation":
        from fedmed.models import seg_model_from_config

        return get_params(seg_model_from_config(m, d["in_channels"], seed=cfg.get("seed", 0), init_root=app_custom))
    from fedmed.models import model_from_config

    return get_params(model_from_config(m, d["channels"], d["n_classes"], seed=cfg.get("seed", 0), init_root=app_custom))


TASK_CHECK_PERIOD_S = 0.05  # how often FLARE's task monitor looks for finished tasks (its default: 0.2 s)


class FedMedController(ModelController):
    """Config, recording, fault handling, checkpoints; subclasses implement :meth:`workflow`."""

    stable_cluster_ids = True  # a cluster id names the same model in every round (CFL renumbers when it splits)

    def set_communicator(self, communicator):
        """FLARE 2.9's ``Controller.set_communicator`` hands the controller's ``task_check_period`` to
        ``communicator.task_check_period``, but ``WFCommServer``'s monitor sleeps ``_task_check_period`` (set only by
        its constructor, 0.2 s): a finished round waited up to 0.2 s (0.1 s on average) before the workflow saw it.
        Set the attribute the monitor reads."""
        super().set_communicator(communicator)
        if hasattr(communicator, "_task_check_period"):
            communicator._task_check_period = self._task_check_period

    def __init__(self, num_rounds: int, fedmed_config: dict, resume: bool = False, **kwargs):
        super().__init__(persistor_id="", ignore_result_error=True, task_check_period=TASK_CHECK_PERIOD_S, **kwargs)
        # attribute names equal the constructor arguments: FedJob exports them from the instance
        self.num_rounds = int(num_rounds)
        self.fedmed_config = dict(fedmed_config)
        self.resume = bool(resume)
        self.recorder = None
        self.sites: list = []
        self.active: set = set()
        self.resumed: dict = {}
        self.state: dict = {}

    # ------------------------------------------------------------------ configuration
    @property
    def cfg(self) -> dict:
        return self.fedmed_config

    @property
    def fed(self) -> dict:
        return self.cfg.get("federation", {})

    @property
    def min_clients(self) -> int:
        return int(self.fed.get("min_clients", 1))

    def task(self, params: dict, round_: int, **extra) -> FLModel:
        return FLModel(params=params, current_round=round_, total_rounds=self.num_rounds,
                       meta={"fedmed": {**self.cfg, **extra}})

    # ------------------------------------------------------------------ the run
    @property
    def app_custom(self) -> Path:
        """This job's custom folder at the server (what the job carries: init weights, a user's network code)."""
        return Path(self.get_app_dir()) / "custom"

    def run(self):
        user_code = str(self.app_custom / USER_CODE_DIR)
        if user_code not in sys.path:  # a user's network class travels in the job (fedmed.models)
            sys.path.insert(0, user_code)
        self.start_recording()
        try:
            self.restore()
            self.sites = self.wait_for_sites()
            self.active = set(self.sites)
            self.workflow()
        except RunStopped as e:
            self.recorder.finish("stopped", str(e))
            self.error(f"fedmed run stopped: {e}")
        except RunFailed as e:
            self.recorder.finish("failed", str(e))
            self.error(f"fedmed run failed: {e}")
            self.panic(f"fedmed run failed: {e}")
        except Exception as e:
            self.recorder.finish("failed", f"{type(e).__name__}: {e}")
            raise  # control_flow logs it and panics
        else:
            self.recorder.finish("finished")
        finally:
            self.recorder.close()

    def workflow(self):
        raise NotImplementedError

    def start_recording(self):
        memtrace.start()
        self.recorder = Recorder(Path(self.get_run_dir()) / "fedmed", meta={"config": self.cfg,
                                                                             "workflow": type(self).__name__})
        from fedmed.privacy import k_min_consent_note

        consent = k_min_consent_note(self.cfg.get("privacy", {}))
        if consent:  # stated in the run's record and the server's log
            self.recorder.note("privacy_consent", consent)
            self.warning(consent)

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
        expected = list(self.fed.get("sites") or [])
        deadline = time.time() + float(self.fed.get("startup_timeout", 300))
        present = self.connected()
        while expected and any(s not in present for s in expected) and time.time() < deadline:
            self.check_abort("while waiting for sites")
            time.sleep(0.5)
            present = self.connected()
        sites = [s for s in present if not expected or s in expected]
        for s in sorted(set(expected) - set(present)):
            self.recorder.error(-1, s, "startup", f"{s}: never registered within startup_timeout "
                                f"{self.fed.get('startup_timeout', 300)} s; the run goes on without it")
            self.error(f"site {s} never registered; going on without it")
        if len(sites) < self.min_clients:
            raise RunFailed(f"{len(sites)} site(s) registered {sites}, fewer than min_clients={self.min_clients}")
        self.recorder.doc["sites"] = sites
        return sites

    # ------------------------------------------------------------------ exchanges
    def dead_sites(self) -> dict:
        """``{site: exit code}`` of the sites whose process died (noted by the simulator, ``jobs/simulator.py``;
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

    def send(self, task_name: str, data: FLModel, targets=None) -> list:
        """One task to ``targets`` (default: the run's sites); the (site, metrics, meta, params) rows."""
        return self.send_groups(task_name, {None: (data, list(targets) if targets is not None else self.sites)})[None]

    def send_groups(self, task_name: str, groups: dict) -> dict:
        """Send one task to several groups of sites at once (``{key: (FLModel, sites)}``), each group with
        its own model; wait as the module notes say; ``{key: [rows]}``. Sites that did not answer are
        recorded as errors of this round and put on probation."""
        replies = {key: [] for key in groups}
        timeout = float(self.fed.get("task_timeout", 1800))
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
            self.recorder.doc.setdefault("task_log", []).append(
                {"task": task_name, "round": data.current_round, "sites": sites, "cluster": key})
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

    def record_rows(self, round_, rows, task) -> list:
        """Record ``(site, metrics, meta, params)`` rows; log each failed site by name; enforce the quorum.
        Returns the rows of the sites that succeeded."""
        ok = set(self.recorder.record(round_, [(s, m, meta) for s, m, meta, _ in rows], task=task))
        for s, _, meta, _ in rows:
            if meta.get("error"):
                self.error(f"site {s} failed {task} in round {round_}: {meta['error']}")
            for note in meta.get("notes", []) or []:
                self.warning(f"site {s}: {note}")
        self.log_round(round_, task, ok)
        if len(ok) < self.min_clients:
            errs = [e["error"] for e in self.recorder.doc["errors"] if e["round"] == round_]
            raise RunFailed(f"round {round_} ({task}): {len(ok)} site(s) answered, fewer than min_clients="
                            f"{self.min_clients}" + (f"; errors: {errs[:3]}" if errs else ""))
        return [r for r in rows if r[0] in ok]

    def log_round(self, round_, task, ok):
        """One line per round in the server log (the console of `fedmed experiment` shows the same)."""
        last = self.recorder.doc["rounds"][-1]
        s = last["summary"]
        loss = s["mean"].get("train_loss")
        acc = s["mean"].get("accuracy", s["mean"].get("dice_mean"))
        self.info(f"[fedmed] round {round_}/{self.num_rounds} {task}: {len(ok)} site(s) answered"
                  + (f", mean train loss {loss:.4f}" if loss is not None and np.isfinite(loss) else "")
                  + (f", served-model test score {acc:.4f}" if acc is not None and np.isfinite(acc) else ""))

    # ------------------------------------------------------------------ checkpoint / resume
    def checkpoint(self, next_round: int, models: dict, **state):
        """Save what the run needs to continue at ``next_round``: ``models`` (name -> params) and ``state``."""
        out = Path(self.get_run_dir()) / "fedmed" / "checkpoint"
        out.mkdir(parents=True, exist_ok=True)
        arrays = {f"{name}/{k}": np.asarray(v) for name, p in models.items() for k, v in p.items()}
        np.savez(out / "models.tmp.npz", **arrays)
        (out / "models.tmp.npz").replace(out / "models.npz")
        from fedmed.io import json_default

        doc = {"workflow": type(self).__name__, "next_round": int(next_round), "state": state,
               "record": self.recorder.doc, "models": sorted(models)}
        (out / "state.tmp.json").write_text(json.dumps(doc, default=json_default, allow_nan=True))
        (out / "state.tmp.json").replace(out / "state.json")
        self.recorder.doc["checkpoint_round"] = int(next_round) - 1
        memtrace.trim()  # freed message buffers back to the system once per round
        memtrace.checkpoint("server", int(next_round) - 1)  # no-op unless benchmarks/bench_memory.py --trace

    def restore(self):
        """Load the checkpoint a resumed job carries (``resume=True``): ``self.resumed`` holds
        ``next_round``, ``models`` and ``state``; the record continues with a new attempt."""
        if not self.resume:
            self.recorder.begin_attempt(0)
            return
        src = Path(self.get_app_dir()) / "custom" / RESUME_DIR
        if not (src / "state.json").is_file():
            raise RunFailed(f"resume requested but the job carries no checkpoint ({RESUME_DIR}/state.json)")
        doc = json.loads((src / "state.json").read_text())
        if doc.get("workflow") != type(self).__name__:
            raise RunFailed(f"the checkpoint is from workflow {doc.get('workflow')}, not {type(self).__name__}")
        z = np.load(src / "models.npz")
        models: dict = {}
        for key in z.files:
            name, param = key.split("/", 1)
            models.setdefault(name, {})[param] = z[key]
        self.resumed = {"next_round": int(doc["next_round"]), "models": models, "state": doc.get("state", {})}
        self.recorder.resume_from(doc["record"], int(doc["next_round"]))
        self.info(f"resuming from round {doc['next_round']} (checkpoint of an earlier attempt)")

    def start_round(self) -> int:
        return int(self.resumed.get("next_round", 0))

    def resumed_models(self) -> dict:
        return self.resumed.get("models", {})

    # ------------------------------------------------------------------ final models
    def trained_sites(self, sites, cluster=None) -> list:
        """Of ``sites``, those that sent at least one training update (``n_train`` in a recorded round; for a cluster
        model, an update to that cluster): a site that sat out every round did not train the model."""
        if not self.stable_cluster_ids:
            cluster = None
        done = set()
        for r in self.recorder.doc["rounds"]:
            for s, entry in r["sites"].items():
                if entry.get("n_train") is not None and (cluster is None or entry.get("cluster") in (cluster, None)):
                    done.add(s)
        return [s for s in sites if s in done]

    def save_final(self, params: dict, name: str = "global", *, sites=None, cluster=None):
        """The trained model, as a PyTorch checkpoint (``fedmed.predict.save_model``: ``state_dict``, what rebuilds the
        network, what it serves). Only called when the run finished."""
        from fedmed.predict import save_model

        if sites is not None:  # only the sites whose updates went into it
            sites = self.trained_sites(sites, cluster)
        out = Path(self.get_run_dir()) / "fedmed" / "models"
        out.mkdir(parents=True, exist_ok=True)
        save_model(out / f"{name}.pt", params, self.cfg, cluster=cluster, sites=sites, workflow=type(self).__name__,
                   rounds=self.num_rounds)
        if self.cfg.get("task") == "mae":  # the encoder the registry loads as "fedmae_vit" (a plain state dict)
            import torch

            from fedmed.ssl import encoder_state

            torch.save({k: torch.as_tensor(np.asarray(v)) for k, v in encoder_state(params).items()},
                       out / "encoder.pt")
