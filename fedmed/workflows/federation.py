"""The :class:`Federation` a workflow runs against, and what every implementation shares.

A workflow (``fedmed.workflows``) reads like its paper's algorithm box and talks to its sites only through this
small surface:

* ``sites`` (the sites of this run), ``message(params, round, config)`` and ``send`` / ``send_groups`` (one task to
  sites, or to several groups of sites each with its own model; the replies come back as ``(site, metrics, meta,
  params)`` rows sorted by site);
* ``record_rows`` (one round into the run's record, with the quorum enforced), ``recorder`` (notes, errors);
* ``checkpoint`` / ``resumed`` (continue a stopped run), ``save_final`` (a trained model), ``out_dir`` (the run's
  ``fedmed/`` folder) and ``job_files`` (what the job carries: init weights, a training run's models);
* ``info`` / ``warning`` / ``error`` (the run's log).

Two implementations: ``fedmed_flare/controller.py`` on NVFlare (simulator, POC, provisioned sites: timeouts,
probation, dead sites) and :class:`fedmed.workflows.inprocess.InProcessFederation` (every site's
:class:`~fedmed.site.runner.SiteRunner` in this process: benchmarks, references, fast tests). The shared parts — the run
driver with its honest status, recording, checkpoint and resume, final models — live here, so both record, stop
and save the same way.
"""

from __future__ import annotations

from fedmed.core.errors import FedmedError

import json
from pathlib import Path

import numpy as np

from fedmed.core import jobfiles, memtrace
from fedmed.report.record import Recorder

__all__ = ["RESUME_DIR", "Federation", "RunFailed", "RunStopped", "flat_params", "run_result"]

RESUME_DIR = jobfiles.RESUME  # inside the folder of what a resumed job carries (:attr:`Federation.job_files`)


def flat_params(doc: dict, prefix: str = "") -> dict:
    """``{"config.train.lr": "0.001", ...}``: a nested settings document as flat string parameters (MLflow's form)."""
    out = {}
    for k, v in doc.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flat_params(v, key + "."))
        else:
            out[key] = json.dumps(v, sort_keys=True) if isinstance(v, (list, dict)) else str(v)
    return out


def run_result(doc: dict) -> dict:
    """A run's result for a tracker: its status and reason, the rounds it ran and its final round's summary."""
    last = doc["rounds"][-1] if doc.get("rounds") else {}
    return {"status": doc.get("status"), "reason": doc.get("reason", ""), "rounds": len(doc.get("rounds", [])),
            "final_round": last.get("round"), "final_summary": last.get("summary")}


class RunStopped(FedmedError):
    """The federation ended the run (FLARE's abort signal); the run stops where it is."""


class RunFailed(FedmedError):
    """The run cannot go on (e.g. fewer than min_clients sites answered); the message says why."""


class Federation:
    """What a workflow needs from its sites and its server; subclasses implement :meth:`message`,
    :meth:`send_groups`, :meth:`wait_for_sites`, :meth:`log`, ``out_dir`` and ``job_files``."""

    workflow = None  # the Workflow being run (set by :meth:`run`)
    tensorboard = True  # the record's TensorBoard scalars beside metrics.json
    recorder: Recorder | None = None

    # ------------------------------------------------------------------ what an implementation provides
    @property
    def out_dir(self) -> Path:
        """The run's ``fedmed/`` folder (record, checkpoint, models, plots)."""
        raise NotImplementedError

    @property
    def job_files(self) -> Path | None:
        """The folder holding the data the job carries to the server (``fedmed.core.jobfiles``: ``model.init_weights``,
        a resume checkpoint, a training run's models) — never code."""
        raise NotImplementedError

    @property
    def policy(self):
        """The server's :class:`~fedmed.core.policy.SitePolicy`: which user modules it may import to build the model
        (``fedmed_policy.json`` in the server's kit, as at a site)."""
        raise NotImplementedError

    @property
    def user_code(self) -> Path | None:
        """The folder of a user's network class when the job carries one (a BYOC job); ``None`` otherwise."""
        return None

    def message(self, params: dict, round_: int, config: dict):
        """The task message carrying ``params`` and the task ``config`` for round ``round_``."""
        raise NotImplementedError

    def send_groups(self, task_name: str, groups: dict) -> dict:
        """Send one task to several groups of sites at once (``{key: (message, sites)}``), each group with its own
        message; ``{key: [(site, metrics, meta, params), ...]}``. A site that did not answer is recorded as an error of
        the round."""
        raise NotImplementedError

    def wait_for_sites(self) -> list:
        """The sites this run uses (recorded as ``sites``); raises :class:`RunFailed` below ``min_clients``."""
        raise NotImplementedError

    def log(self, level: str, msg: str) -> None:
        raise NotImplementedError

    def check_abort(self, where: str = "") -> None:
        """Raise :class:`RunStopped` when the federation ended the run."""

    def failed(self, reason: str) -> None:
        """The run failed (after the record says so): FLARE panics so its job status shows it too."""

    # ------------------------------------------------------------------ shared
    def info(self, msg: str) -> None:
        self.log("info", msg)

    def warning(self, msg: str) -> None:
        self.log("warning", msg)

    def error(self, msg: str) -> None:
        self.log("error", msg)

    @property
    def cfg(self) -> dict:
        """The run's task config (a copy: the workflow's is read-only)."""
        return dict(self.workflow.cfg)

    @property
    def min_clients(self) -> int:
        return self.workflow.task_cfg.federation.min_clients  # the config validated once per run (#88)

    def send(self, task_name: str, data, targets=None) -> list:
        """One task to ``targets`` (default: the run's sites); the (site, metrics, meta, params) rows."""
        return self.send_groups(task_name, {None: (data, list(targets) if targets is not None else self.sites)})[None]

    def run(self, workflow) -> str:
        """Run ``workflow`` to its end; the record says ``finished``, ``stopped`` or ``failed`` with the reason, which
        is also returned (``"finished"``) or raised further (an unexpected error)."""
        self.workflow = workflow
        workflow.fed = self
        if self.user_code is not None and Path(self.user_code).is_dir():
            from fedmed.core.plugins import add_code_folder

            add_code_folder(self.user_code)  # importable; whether it is imported is the server policy's call
        self.start_recording()
        try:
            self.preflight()
            self.restore()
            self.sites = self.wait_for_sites()
            self.active = set(self.sites)
            workflow.run()
        except RunStopped as e:
            self.recorder.finish("stopped", str(e))
            self.error(f"fedmed run stopped: {e}")
            return "stopped"
        except RunFailed as e:
            self.recorder.finish("failed", str(e))
            self.error(f"fedmed run failed: {e}")
            self.failed(f"fedmed run failed: {e}")
            return "failed"
        except Exception as e:
            self.recorder.finish("failed", f"{type(e).__name__}: {e}")
            raise
        else:
            self.recorder.finish("finished")
            return "finished"
        finally:
            self.track_run(result=run_result(self.recorder.doc))
            self.recorder.close()

    def preflight(self) -> None:
        """What this federation checks before the run starts (raise :class:`RunFailed` with the reason: the record
        says ``failed``); nothing in-process."""

    def start_recording(self):
        memtrace.start()
        self.recorder = Recorder(self.out_dir, tensorboard=self.tensorboard, sink=self.track_round,
                                 meta={"config": self.cfg, "workflow": self.workflow.record_name})
        # the run's settings as the trackers keep them: not where the trackers are (the destinations the job names,
        # which may hold the coordinator's folders)
        settings = {k: v for k, v in dict(self.cfg).items() if k != "tracking"}
        self.track_run(params=flat_params({"config": settings, "workflow": self.workflow.record_name}))
        from fedmed.algorithms.privacy import k_min_consent_note

        consent = k_min_consent_note(self.workflow.task_cfg.privacy.model_dump())
        if consent:  # stated in the run's record and the server's log
            self.recorder.note("privacy_consent", consent)
            self.warning(consent)

    # ------------------------------------------------------------------ tracking (FLARE's receivers; none in-process)
    def track_round(self, scalars: dict, round_: int) -> None:
        """A recorded round's server-side metrics (``{tag: value}``) for the experiment trackers, where there are any."""

    def track_run(self, params: dict | None = None, result: dict | None = None) -> None:
        """The run's settings (flat ``{name: value}``) at its start and its result (``metrics.json``'s status, reason and
        final summary) at its end, for the experiment trackers that keep them."""

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
        s = self.recorder.doc["rounds"][-1]["summary"]
        loss = s["mean"].get("train_loss")
        acc = s["mean"].get("accuracy", s["mean"].get("dice_mean"))
        self.info(f"[fedmed] round {round_}/{self.workflow.num_rounds} {task}: {len(ok)} site(s) answered"
                  + (f", mean train loss {loss:.4f}" if loss is not None and np.isfinite(loss) else "")
                  + (f", served-model test score {acc:.4f}" if acc is not None and np.isfinite(acc) else ""))

    # ------------------------------------------------------------------ checkpoint / resume
    resumed: dict = {}

    def checkpoint(self, next_round: int, models: dict, **state):
        """Save what the run needs to continue at ``next_round``: ``models`` (name -> params) and ``state``."""
        out = self.out_dir / "checkpoint"
        out.mkdir(parents=True, exist_ok=True)
        arrays = {f"{name}/{k}": np.asarray(v) for name, p in models.items() for k, v in p.items()}
        np.savez(out / "models.tmp.npz", **arrays)
        (out / "models.tmp.npz").replace(out / "models.npz")
        from fedmed.core.io import json_default

        doc = {"workflow": self.workflow.record_name, "next_round": int(next_round), "state": state,
               "record": self.recorder.doc, "models": sorted(models)}
        (out / "state.tmp.json").write_text(json.dumps(doc, default=json_default, allow_nan=True))
        (out / "state.tmp.json").replace(out / "state.json")
        self.recorder.checkpointed(int(next_round) - 1)
        memtrace.trim()  # freed message buffers back to the system once per round
        memtrace.checkpoint("server", int(next_round) - 1)  # no-op unless benchmarks/bench_memory.py --trace

    def resume_dir(self) -> Path | None:
        """Where a resumed run's checkpoint is (``None``: start from round 0)."""
        return None

    def restore(self):
        """Load the checkpoint of a resumed run: ``self.resumed`` holds ``next_round``, ``models`` and ``state``; the
        record continues with a new attempt."""
        src = self.resume_dir()
        self.resumed = {}
        if src is None:
            self.recorder.begin_attempt(0)
            return
        if not (Path(src) / "state.json").is_file():
            raise RunFailed(f"resume requested but the job carries no checkpoint ({RESUME_DIR}/state.json)")
        doc = json.loads((Path(src) / "state.json").read_text())
        if doc.get("workflow") not in (self.workflow.record_name, *self.workflow.earlier_record_names):
            raise RunFailed(f"the checkpoint is from workflow {doc.get('workflow')}, not {self.workflow.record_name}")
        z = np.load(Path(src) / "models.npz")
        models: dict = {}
        for key in z.files:
            name, param = key.split("/", 1)
            models.setdefault(name, {})[param] = z[key]
        self.resumed = {"next_round": int(doc["next_round"]), "models": models, "state": doc.get("state", {})}
        self.recorder.resume_from(doc["record"], int(doc["next_round"]))
        self.info(f"resuming from round {doc['next_round']} (checkpoint of an earlier attempt)")

    # ------------------------------------------------------------------ final models
    def trained_sites(self, sites, cluster=None) -> list:
        """Of ``sites``, those that sent at least one training update (``n_train`` in a recorded round; for a cluster
        model, an update to that cluster): a site that sat out every round did not train the model."""
        if not self.workflow.stable_cluster_ids:
            cluster = None
        done = set()
        for r in self.recorder.doc["rounds"]:
            for s, entry in r["sites"].items():
                if entry.get("n_train") is not None and (cluster is None or entry.get("cluster") in (cluster, None)):
                    done.add(s)
        return [s for s in sites if s in done]

    def training_images(self, sites) -> int:
        """The training images of ``sites``: each one's last recorded ``n_train`` (what a cluster model was trained
        on; a count every training reply already carries)."""
        last = {}
        for r in self.recorder.doc["rounds"]:
            for s, entry in r["sites"].items():
                if entry.get("n_train") is not None:
                    last[s] = int(entry["n_train"])
        return int(sum(last.get(s, 0) for s in sites))

    def save_final(self, params: dict, name: str = "global", *, sites=None, cluster=None, rounds=None,
                   bundle: bool = True, decision: dict | None = None):
        """The trained model, as a PyTorch checkpoint (``fedmed.nn.predict.save_model``: ``state_dict``, what rebuilds the
        network, what it serves). Only called when the run finished."""
        from fedmed.nn.predict import save_model

        images = None
        if sites is not None:  # only the sites whose updates went into it
            sites = self.trained_sites(sites, cluster)
            images = self.training_images(sites)
        out = self.out_dir / "models"
        out.mkdir(parents=True, exist_ok=True)
        save_model(out / f"{name}.pt", params, self.cfg, cluster=cluster, sites=sites,
                   workflow=self.workflow.record_name, rounds=self.workflow.num_rounds if rounds is None else rounds,
                   train_images=images, decision=decision)
        tc = self.workflow.task_cfg
        if bundle and (tc.task == "classification" or (tc.task == "segmentation" and tc.data.spatial_dims == 3)):
            # the same model as a MONAI bundle (fedmed.nn.bundle; no 2D lesion one yet)
            from fedmed.nn.bundle import export_bundle

            try:
                export_bundle(out / f"{name}.pt", out / f"{name}_bundle", policy=self.policy)
            except Exception as e:  # a bundle never fails a finished run: the checkpoint is there
                self.warning(f"[fedmed] models/{name}_bundle not written: {type(e).__name__}: {e}")
        if self.workflow.task_cfg.task == "mae" and name == "global":  # the encoder the registry loads as "fedmae_vit" (a plain state dict)
            import torch

            from fedmed.nn.mae import encoder_state

            torch.save({k: torch.as_tensor(np.asarray(v)) for k, v in encoder_state(params).items()},
                       out / "encoder.pt")
