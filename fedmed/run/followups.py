"""Jobs that follow a finished training run of a method — giving new sites a model (onboarding), choosing each site's
model (the serving plan) — under one contract, :class:`FollowUp`: its server workflow (``module:Class``), the options
that workflow is constructed with and the files it stages for the server, from the run it follows. ``job_spec(...,
follows=...)`` builds any of them the same way (it has no mode of its own for either); a follow-up job of a plugin's
is a subclass defined beside its workflow.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Optional

from fedmed.core import jobfiles
from fedmed.run.taskconfig import BuildError

__all__ = ["STAGED", "FollowUp", "Onboarding", "ServingPlan", "finished_run", "release_staged", "staging_dir"]

STAGED: dict[str, int] = {}  # folder -> the process that staged server files in it (release_staged, else at exit)


def staging_dir(prefix: str) -> Path:
    """A temporary folder for files the server's app will carry (they are copied into the job when it is exported
    or run); removed by :func:`release_staged` (``JobSpec.release``) or when this process exits, never left in the
    temp folder."""
    d = Path(tempfile.mkdtemp(prefix=prefix))
    STAGED[str(d)] = os.getpid()
    return d


def release_staged(folder: str | None = None) -> None:
    """Remove a folder this process staged (``folder``), or at the process's exit every one (a child forked from it
    that exits normally removes none of its parent's). A folder the user gave is never in the list."""
    for d, pid in list(STAGED.items()):
        if pid == os.getpid() and (folder is None or d == folder):
            shutil.rmtree(d, ignore_errors=True)
            del STAGED[d]


atexit.register(release_staged)


@dataclass
class FollowUp:
    """A job that follows a finished run of ``method`` over the named sites (see the module notes)."""

    workflow: ClassVar[str]  # the server workflow, module:Class
    suffix: ClassVar[str]  # the job's name: the training job's, with this suffix
    rounds: ClassVar[int] = 1  # the job's own rounds (its progress lines count them)

    def prepare(self, exp, method, cfg: dict, sites: Optional[list], server_files: list) -> dict:
        """Check what it follows; stage the server's files (``[folder, folder in the job]`` appended to
        ``server_files``); return its workflow's options. Every problem is one :class:`BuildError` line."""
        raise NotImplementedError


def finished_run(path, what: str) -> Path:
    """The run folder of a finished run in ``path`` (:func:`fedmed.workflows.onboard.find_result`) that saved models;
    a one-line :class:`BuildError` naming ``what`` otherwise."""
    from fedmed.workflows.onboard import OnboardingError, find_result

    try:
        folder = find_result(path)
    except OnboardingError as e:
        raise BuildError(f"{what}: {e}") from None
    doc = json.loads((folder / "metrics.json").read_text())
    if doc.get("status", "running") != "finished":
        why = f": {doc['reason']}" if doc.get("reason") else ""
        raise BuildError(f"{what}: {path}: the run did not finish (status {doc.get('status', 'running')}{why})")
    return folder


@dataclass
class Onboarding(FollowUp):
    """New sites given a model of the training run in ``training_result`` (``fedmed.workflows.onboard``):
    ``known_clusters`` (site -> the cluster it should join, for the record), ``references`` (score every cluster model
    too), ``require_clusters`` (a run that made no clusters is refused), ``labels`` (the new sites have labels),
    ``min_cluster_images`` (a cluster trained on fewer is not served), ``global_result`` (a FedAvg-family run whose
    global model a new site is served when its cluster cannot serve)."""

    workflow: ClassVar[str] = "fedmed.workflows.onboard:Onboard"
    suffix: ClassVar[str] = "_onboard"

    training_result: str | Path
    known_clusters: dict = field(default_factory=dict)
    references: bool = False
    require_clusters: bool = True
    labels: bool = True
    min_cluster_images: int = 0
    global_result: Optional[str | Path] = None

    def prepare(self, exp, method, cfg, sites, server_files) -> dict:
        from fedmed.methods import METHODS, server_workflow_path
        from fedmed.workflows.onboard import TRAINING_DIR, OnboardingError, check_training_result, training_files
        from fedmed.workflows.registry import server_workflow

        if not sites:
            raise BuildError("an onboarding job names its new sites (--sites)")
        cls = type(method)
        try:
            folder = check_training_result(
                self.training_result, method.workflow, server_workflow_path(cls), onboards=cls.onboards,
                clustered=cls.clustered, require_clusters=self.require_clusters,
                serving=tuple(w for w, c in METHODS.items() if c.clustered and c.onboards))
        except OnboardingError as e:
            raise BuildError(str(e)) from None
        if not self.labels and server_workflow(server_workflow_path(cls)).onboard_needs_labels:
            raise BuildError(f"method {method.name!r}: CFL sends a new site down its tree by the site's training "
                             f"updates, which need labels; --no-labels serves FMCL, PACFL, IFCA (pseudo-labels), "
                             f"FECFL, Flux, 004_")
        tmp = staging_dir("fedmed_training_")
        for f in training_files(folder):
            shutil.copy(f, tmp / f.name)
        if self.global_result:  # served instead of a cluster that cannot serve (Onboard.guard)
            from fedmed.workflows.onboard import FALLBACK_FILE

            ref = finished_run(self.global_result, "--global") / "models" / "global.pt"
            if not ref.is_file():
                raise BuildError(f"--global: {self.global_result}: the run saved no global model (models/global.pt)")
            (tmp / FALLBACK_FILE).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(ref, tmp / FALLBACK_FILE)
        server_files.append([str(tmp), TRAINING_DIR])
        return {"training": server_workflow_path(cls), "known_clusters": self.known_clusters or {},
                "references": bool(self.references), "labels": bool(self.labels),
                "min_cluster_images": int(self.min_cluster_images or 0)}


@dataclass
class ServingPlan(FollowUp):
    """Each site's model chosen on its own validation data (``fedmed.workflows.plan``): the global model of the
    finished run in ``reference`` (``method``'s run: its task config is the plan's) against the models of the runs in
    ``candidates`` (name -> run folder), the reference fine-tuned at each site (``finetune``: epochs, lr_scale) and
    each site's own model (``local``); ``alpha``, ``pool`` and ``test``: the plan's decision rule."""

    workflow: ClassVar[str] = "fedmed.workflows.plan:Plan"
    suffix: ClassVar[str] = "_plan"
    rounds: ClassVar[int] = 2

    reference: str | Path
    candidates: dict = field(default_factory=dict)
    finetune: Optional[dict] = None
    local: bool = False
    alpha: Optional[float] = None
    pool: bool = True
    test: Optional[str] = None

    def prepare(self, exp, method, cfg, sites, server_files) -> dict:
        from fedmed.workflows.plan import REFERENCE

        if not sites:
            raise BuildError("a serving plan's job names its sites (--sites, or the config's site names)")
        seg2d = cfg["task"] == "segmentation" and cfg["data"].get("spatial_dims") == 2
        if cfg["task"] != "classification" and not seg2d:
            raise BuildError(f"a serving plan scores classifiers and 2D lesion segmenters (this config's task: "
                             f"{cfg['task']}{', 3D' if cfg['task'] == 'segmentation' else ''})")
        if not self.candidates and not self.finetune and not self.local:
            raise BuildError("a serving plan needs a candidate (--candidate NAME=RUN), --finetune or --local")
        if self.local and cfg["task"] != "classification":
            raise BuildError("a serving plan's local candidate (each site's own model) is for classifiers")
        ref = finished_run(self.reference, "--global") / "models" / "global.pt"
        if not ref.is_file():
            raise BuildError(f"--global: {self.reference}: the run saved no global model (models/global.pt): the "
                             f"reference is a FedAvg-family run's")
        selected = ref.with_name("selected_global.pt")
        if exp.selection != "final" and selected.is_file():  # the model of the round the reference's row reports
            ref = selected
        tmp = staging_dir("fedmed_plan_")
        (tmp / REFERENCE).mkdir()
        shutil.copy(ref, tmp / REFERENCE / "global.pt")
        for cand, path in dict(self.candidates).items():
            self._stage_candidate(str(cand), path, ref, tmp)
        server_files.append([str(tmp), jobfiles.PLAN])
        return {"candidates": list(dict(self.candidates)), "finetune": self.finetune, "local": bool(self.local),
                "alpha": self.alpha, "pool": bool(self.pool), "test": self.test}

    @staticmethod
    def _stage_candidate(cand: str, path, ref: Path, tmp: Path) -> None:
        """A candidate run's models copied beside the reference, each checked to be the reference's network."""
        import torch

        from fedmed.workflows.plan import FINETUNED, REFERENCE, candidate_models, candidate_name_ok

        def arch(f: Path) -> dict:
            m = dict(torch.load(f, map_location="cpu", weights_only=True).get("model") or {})
            m.pop("init_weights", None)
            return m

        if not candidate_name_ok(cand):
            raise BuildError(f"--candidate {cand}: a candidate's name is a word other than {REFERENCE!r}, "
                             f"{FINETUNED!r} and 'local'")
        run = finished_run(path, f"--candidate {cand}")
        found = candidate_models(run / "models")
        ran = (json.loads((run / "metrics.json").read_text()).get("meta") or {}).get("config") or {}
        if (ran.get("train") or {}).get("local_norm") and not ran.get("personal_key"):
            raise BuildError(f"--candidate {cand}: {path}: a FedBN run made before its sites kept their own batch-norm "
                             f"layers: its personal models are gone; run it again")
        if not found:
            raise BuildError(f"--candidate {cand}: {path}: the run saved no model (models/cluster*.pt or global.pt)")
        for f, _ in found:
            if arch(f) != arch(ref):
                raise BuildError(f"--candidate {cand}: {f.name} is a {arch(f).get('arch')} network unlike the global "
                                 f"model's ({arch(ref).get('arch')}, the same arguments): a site scores both with one "
                                 f"network")
            (tmp / cand).mkdir(exist_ok=True)
            shutil.copy(f, tmp / cand / f.name)
