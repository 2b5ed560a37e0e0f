"""The one hand-off from a command to a job: a :class:`JobSpec` built in-process from the typed experiment config.

Everything a job is — the task config every site receives, the server workflow and its options (the method's own,
``fedmed.methods``), the sites, the quorum, the files the server needs, a user's code — is decided here, from the
validated config, in the caller's process, with every path resolved against the caller's folder. ``fedmed_flare.build``
wraps a spec in FLARE's ``FedJob`` (nothing is re-read or re-validated there); ``fedmed experiment`` writes each
run's spec to a file and starts the simulator on it (``fedmed_flare.run --spec``), so no config path or ``--set`` string
is parsed a second time. Every problem is a :class:`BuildError` of one line naming the key, file or site.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fedmed.core import jobfiles
from fedmed.run.followups import STAGED, FollowUp, release_staged, staging_dir
from fedmed.run.taskconfig import BuildError, build_task_config, min_clients

__all__ = ["BuildError", "JobSpec", "check_encoder", "find_checkpoint", "job_name", "job_spec", "run_spec_in_process",
           "select_method"]


@dataclass
class JobSpec:
    """A fedmed job, framework-neutral and JSON-serialisable (``to_file`` / ``from_file``)."""

    name: str
    method: str  # the method's name in the config
    task_config: dict  # what every task carries to the sites (fedmed.core.schema.TaskConfig)
    workflow: str  # the server workflow, module:Class (fedmed.workflows.server_workflow)
    workflow_options: dict
    rounds: int
    sites: list | None  # None: every connected site
    min_clients: int
    task_request_interval: float
    resume: bool = False
    server_files: list = field(default_factory=list)  # [source, folder under the server app's config/fedmed_files]
    user_code: list = field(default_factory=list)  # [source, folder under custom/]: a user's class or a plugin (BYOC)
    simulation: dict = field(default_factory=dict)  # for simulated sites that are the experimenter's own: k_min, weights
    tracking: dict = field(default_factory=dict)  # the server's receivers (fedmed.config.TrackingConfig); {}: TensorBoard

    def to_file(self, path, *, self_contained: bool = False) -> Path:
        """Write the spec as JSON. ``self_contained``: the files this process staged for the server (copies of
        models; :meth:`release` and the process's exit remove them) are copied to ``<name>_files/`` beside the spec
        and the spec names those, so that it still runs after this process has ended (``fedmed plan --spec``)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        doc = asdict(self)
        if self_contained:
            keep = path.parent / f"{path.stem}_files"
            for i, entry in enumerate(doc["server_files"]):
                if entry[0] in STAGED:
                    shutil.rmtree(keep / str(i), ignore_errors=True)  # this spec's own, written before
                    shutil.copytree(entry[0], keep / str(i))
                    entry[0] = str((keep / str(i)).resolve())
        path.write_text(json.dumps(doc, indent=1))
        return path

    def release(self) -> None:
        """Remove the folders this process staged the server's files in (copies of models a plan, an onboarding job
        or a method's server file starts from) once the job has run or been exported: a job carries its own copies.
        A file the user gave (``model.init_weights``, a checkpoint to resume from) is never touched."""
        for src, _ in self.server_files:
            release_staged(src)

    @classmethod
    def from_file(cls, path) -> "JobSpec":
        path = Path(path)
        if not path.is_file():
            raise BuildError(f"{path}: job spec not found")
        try:
            return cls(**json.loads(path.read_text()))
        except (ValueError, TypeError) as e:
            raise BuildError(f"{path}: not a fedmed job spec ({e})") from None


def job_name(exp, method, seed: int, suffix: str = "") -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in f"{exp.name}_{method.name}{suffix}_s{seed}").lower()


def select_method(exp, name: str, source: str = "the config"):
    """The one method ``name`` names, by the rules ``fedmed experiment --methods`` uses: its name exactly, else
    case-insensitively, else its workflow (``fmcl``) when one method has it."""
    rules = (lambda m: m.name == name, lambda m: m.name.lower() == name.lower(),
             lambda m: m.workflow.lower() == name.lower())
    for rule in rules:
        hits = [m for m in exp.methods if rule(m)]
        if len(hits) == 1:
            return hits[0]
        if len(hits) > 1:
            raise BuildError(f"method {name!r} matches {len(hits)} methods of {source} ({[m.name for m in hits]}); "
                             f"name one")
    raise BuildError(f"method {name!r} is not in {source} (it has {sorted(m.name for m in exp.methods)})")


def find_checkpoint(result) -> Path:
    """The ``checkpoint/`` folder of a run result (its ``fedmed/`` folder, a run folder of ``fedmed experiment``,
    or a downloaded FLARE job result)."""
    root = Path(result)
    if not root.exists():
        raise BuildError(f"--resume-from {result}: no such folder")
    hits = sorted(root.rglob("checkpoint/state.json"))
    if not hits:
        raise BuildError(f"--resume-from {result}: no checkpoint (checkpoint/state.json) in it; the run stopped "
                         f"before its first round completed, so there is nothing to resume")
    return hits[0].parent


def check_encoder(name: str, weights: str | None, *, in_channels: int = 1, image_size=None):
    """Catch a bad encoder before anything is sent: an unknown name, a missing or mismatched weights file
    (:func:`fedmed.methods.check_encoder`, as a :class:`BuildError`)."""
    from fedmed.methods import check_encoder as check

    try:
        check(name, weights, in_channels=in_channels, image_size=image_size)
    except ValueError as e:
        raise BuildError(str(e)) from None


def check_method_files(exp, method) -> None:
    """The files a method names exist and fit (its encoder, its init): checked before any run of an experiment
    (:meth:`fedmed.methods.Method.check_files`)."""
    try:
        method.check_files(exp)
    except ValueError as e:
        raise BuildError(str(e)) from None


def tracking_settings(exp) -> dict:
    """The job's tracking receivers (``exp.tracking``), checked here: a tracker that is not installed is one line."""
    import importlib.util

    t = exp.tracking
    out = t.model_dump()
    out["experiment"] = t.experiment or exp.name
    for key, module, extra in (("mlflow", "mlflow", "mlflow"), ("wandb", "wandb", "wandb")):
        if out[key] and importlib.util.find_spec(module) is None:
            raise BuildError(f"tracking.{key}: {module} is not installed here (pip install 'fedmed[{extra}]'), and the "
                             f"FLARE server needs it too")
    return out


def personal_key(cfg: dict, method) -> str:
    """The key under which a site keeps its personal model of a run (FedBN's batch-norm layers): a hash of the run's
    task config and method, so the same settings give the same key (a rerun replaces the site's file) and others
    another."""
    import hashlib

    blob = json.dumps([{k: v for k, v in cfg.items() if k != "personal_key"}, method.model_dump(mode="json")],
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def job_spec(exp, method, seed: int = 0, *, sites="config", name: str | None = None, resume_from=None,
             follows: FollowUp | None = None, files_checked: bool = False, task_config_ready=None) -> JobSpec:
    """The job of ``method`` of the experiment ``exp`` for ``seed``.

    Args:
        sites: ``"config"`` (``federation.site_names`` or site-1..N), ``"all"`` (every connected site), or a list.
        resume_from: a run result holding ``checkpoint/`` (see :func:`find_checkpoint`).
        follows: a job that follows a finished run of ``method`` instead of training it
            (``fedmed.run.followups``: :class:`~fedmed.run.followups.Onboarding` of new sites,
            the :class:`~fedmed.run.followups.ServingPlan`): its workflow, options and files over ``sites``.
        files_checked: the method's files were checked in this process already (``fedmed experiment`` checks every
            method's before its first run), so they are not loaded again here.
        task_config_ready: called with the task config as soon as it is built, before the network is checked (which
            imports torch, ~2 s): the job runner starts the simulator's site template there, so the two overlap.
    """
    from fedmed.methods import server_workflow_path

    names = exp.site_names() if sites == "config" else (None if sites == "all" else list(sites))
    if names is not None:
        from fedmed.core.validation import check_federation_site_names

        try:
            check_federation_site_names(names, what="--sites")
        except ValueError as e:
            raise BuildError(str(e)) from None
    cfg = build_task_config(exp, seed, method, names)
    if type(method).personal == "kept" and follows is None:  # FedBN: a site keeps its own layers
        cfg["personal_key"] = personal_key(cfg, method)
    if task_config_ready is not None:
        task_config_ready(cfg)
    user_code, server_files = [], []
    _network_files(exp, cfg, user_code, server_files)
    _plugin_files(exp, user_code)
    if not files_checked:
        check_method_files(exp, method)
    weights = method.site_weights
    for src, dest, filename in method.server_files():  # a file the server starts from: copied into the job
        init_dir = staging_dir("fedmed_init_")
        shutil.copy(src, init_dir / filename)
        server_files.append([str(init_dir), dest])
    fed = exp.federation
    common = dict(sites=names, min_clients=min_clients(fed.min_clients, names),
                  task_request_interval=fed.task_request_interval, user_code=user_code,
                  tracking=tracking_settings(exp),
                  simulation={"k_min": exp.privacy.k_min,
                              "weights": str(Path(weights).resolve()) if weights else None})
    if common["min_clients"] < fed.min_clients:
        import sys

        print(f"note: federation.min_clients={fed.min_clients} lowered to {common['min_clients']}: the job targets "
              f"{len(names)} named site(s) {names}", file=sys.stderr)
    if follows is not None:
        options = follows.prepare(exp, method, cfg, names, server_files)
        return JobSpec(name=name or job_name(exp, method, seed, follows.suffix), method=method.name, task_config=cfg,
                       workflow=follows.workflow, workflow_options=options, rounds=follows.rounds,
                       server_files=server_files, **common)
    if resume_from is not None:
        server_files.append([str(find_checkpoint(resume_from)), jobfiles.RESUME])
    return JobSpec(name=name or job_name(exp, method, seed), method=method.name, task_config=cfg, workflow=server_workflow_path(type(method)),
                   workflow_options=method.workflow_options(exp, seed), rounds=exp.train.rounds,
                   resume=resume_from is not None, server_files=server_files, **common)


def _network_files(exp, cfg: dict, user_code: list, server_files: list) -> None:
    """Check the configured network once (an unknown arch, a bad argument, an output of the wrong shape is one line
    here, before anything runs); ship ``model.init_weights`` to the server (which sends the initial model to every
    site) and a user's network class to the server and the sites (which makes the job custom code to FLARE)."""
    from fedmed.nn.models import USER_CODE_DIR, ArchError, check_arch, user_code_files

    m = cfg["model"]
    seg = cfg["task"] == "segmentation"
    if cfg["task"] in ("classification", "segmentation"):
        try:
            if seg and cfg["data"].get("spatial_dims") == 2:  # 2D lesion masks: one output
                check_arch(m, task="segmentation", in_channels=cfg["data"]["in_channels"], n_out=1,
                           size=(cfg["data"]["image_size"],) * 2)
            elif seg:
                check_arch(m, task="segmentation", in_channels=cfg["data"]["in_channels"], n_out=3,
                           size=tuple(cfg["data"]["roi"]))
            else:
                check_arch(m, task="classification", in_channels=cfg["data"]["channels"],
                           n_out=cfg["data"]["n_classes"], size=cfg["data"]["image_size"])
            code = user_code_files(m["arch"])
        except ArchError as e:
            raise BuildError(str(e)) from None
        for src, name in code:
            dest = f"{USER_CODE_DIR}/{name}" if Path(src).is_dir() else USER_CODE_DIR
            user_code.append([str(Path(src).resolve()), dest])
    if m["init_weights"] is not None:
        from fedmed.nn.encoders import EncoderError, check_weights_file

        try:  # the weights rule (a regular file, no link, a state dict of tensors) before anything is shipped
            src = check_weights_file(m["init_weights"], "model.init_weights", shown=str(m["init_weights"])).resolve()
        except EncoderError as e:
            raise BuildError(str(e)) from None
        server_files.append([str(src), jobfiles.MODEL_INIT])
        cfg["model"] = {**m, "init_weights": f"{jobfiles.MODEL_INIT}/{src.name}"}


def _plugin_files(exp, user_code: list) -> None:
    """A plugin method's source travels with the job, as a user's network class does (BYOC): the server and every
    site import it from there — a site only if its policy lists the module."""
    import importlib.util

    from fedmed.methods import plugin_module
    from fedmed.nn.models import USER_CODE_DIR

    for ref in exp.plugins:
        mod, path = plugin_module(str(ref), exp.base_dir)
        if path is None:
            spec = importlib.util.find_spec(mod.split(".")[0])
            if spec is None or spec.origin is None:
                raise BuildError(f"plugins: cannot find module {mod!r} to carry it in the job")
            origin = Path(spec.origin)
            src, dest = (origin.parent, f"{USER_CODE_DIR}/{mod.split('.')[0]}") if origin.name == "__init__.py" \
                else (origin, USER_CODE_DIR)
        else:
            src, dest = path, USER_CODE_DIR
        entry = [str(Path(src).resolve()), dest]
        if entry not in user_code:
            user_code.append(entry)


def run_spec_in_process(spec: JobSpec, datalists, out_dir, *, log=None, policy=None, on_round=None, site_dir=None):
    """Run a job spec's workflow in this process (``fedmed.workflows.InProcessFederation``: every site answers
    through the same reply loop as in FLARE) — the same job FLARE runs, without FLARE. The server's files are laid out
    as a job carries them. ``on_round``: called with each recorded round. Returns (status, federation)."""
    from fedmed.workflows import InProcessFederation, server_workflow

    out = Path(out_dir)
    files = out / "_job_files"
    for src, dest in spec.server_files:
        src = Path(src)
        target = files / dest
        if src.is_dir():
            shutil.copytree(src, target, dirs_exist_ok=True)
        else:
            target.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, target / src.name)
    kw = {"policy": policy} if policy is not None else {}
    if spec.simulation.get("weights"):
        kw["weights_dir"] = Path(spec.simulation["weights"]).parent
    fed = InProcessFederation(datalists, list(spec.sites), out, job_files=files if spec.server_files else None,
                              resume_from=files / jobfiles.RESUME if spec.resume else None, log=log,
                              on_round=on_round, site_dir=site_dir, **kw)
    workflow = server_workflow(spec.workflow)(spec.rounds, spec.task_config, **spec.workflow_options)
    return fed.run(workflow), fed
