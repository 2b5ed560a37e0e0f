"""``fedmed experiment``: run the methods of a config over seeds as NVFlare simulator jobs.

For each seed the federation is built (seeded partition -> per-site datalists with training,
validation and test splits), then every method's job is built from the config and run in NVFlare's
simulator (``python -m fedmed_flare.run --env sim``, a subprocess: fedmed itself never imports nvflare). While a job
runs, a line per round is printed (sites answered, mean train loss, validation and test score,
elapsed, ETA). Outputs in ``OUT``:

* ``results.csv`` — one row per (method, seed, round), and the reference rows;
* ``summary.md`` / ``summary.csv`` — mean ± std over seeds at the reported round (``selection``:
  final, or validation-selected — never test-selected) with reference rows (``fedmed.run.references``);
* ``curves.png`` — validation / test / train-loss curves (band: ± std over seeds);
* ``runs/seed<S>/<method>/`` — each job's server output (``server/``: metrics.json, reports, models,
  checkpoint), ``run.json`` (fingerprint, status, rows) and the simulator log.

``in_process=True`` (``fedmed experiment --in-process``) runs each job in this process instead
(:func:`fedmed.run.jobspec.run_spec_in_process`: the same workflow and site tasks without FLARE, the sites one after
another — the same rows to the digit, ``tests/test_jobs_e2e.py``), for a machine where the simulator's process per
site costs more than the sites' own work, such as a GPU machine (docs/readings.md "Transfer learning federated").

``resume=True`` reuses a finished run whose fingerprint matches, continues a stopped one from its
checkpoint, and reruns a failed one. A run that does not finish is reported with its reason and
makes the experiment fail (non-zero exit) after the other runs.
"""

from __future__ import annotations

from fedmed.core.errors import FedmedError

import contextlib
import contextvars
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from fedmed.config import ExperimentConfig
from fedmed.core.resources import project_root
from fedmed.methods import clustering_workflows
from fedmed.run.jobspec import BuildError, check_method_files, job_spec
from fedmed.core.io import shown_path
from fedmed.report.record import missing_sentence
from fedmed.report.summary import read_results, rows_from_metrics, sweep_stats, sweep_table, write_outputs  # noqa: F401 (re-exported)
from fedmed.site.tasks import SERVED_DIR

__all__ = ["ExperimentError", "PLAN_GLOBAL", "PLAN_METHOD", "REPO_ROOT", "RunError", "check_classes", "classes_override", "prepare_federation", "run_config_job", "run_dir", "run_experiment", "with_classes",
           "run_and_release", "run_fingerprint", "run_job", "run_job_in_process"]

REPO_ROOT = project_root()  # app_configs/: the clone's or the installed package's (fedmed.core.resources)
CLS_METRICS = ("accuracy", "macro_f1", "auc")
_IN_PROCESS = contextvars.ContextVar("fedmed_experiment_in_process", default=False)  # run_experiment(in_process=True)
KILLED = (-9, 137, 247)  # SIGKILL as a return code, through a shell, and as the simulator reports it


class RunError(FedmedError, RuntimeError):
    """A run that did not finish: ``status`` (failed / stopped), ``reason``, and the record so far (``doc``)."""

    def __init__(self, status: str, reason: str, doc: dict | None = None):
        super().__init__(f"run {status}: {reason}")
        self.status, self.reason, self.doc = status, reason, doc or {}


class ExperimentError(FedmedError, RuntimeError):
    """Some runs of an experiment did not finish; the message lists them with their reasons."""


# --------------------------------------------------------------------------------------------- federations

def check_classes(exp, found: list[str]) -> None:
    """The classes a config names (``dataset.classes``: a job is built from the config alone) are the dataset's."""
    if exp.dataset.classes and list(exp.dataset.classes) != list(found):
        raise ValueError(f"dataset.classes {list(exp.dataset.classes)} differ from the classes found in "
                         f"{exp.dataset.describe()} {list(found)}")


def prepare_federation(exp: ExperimentConfig, seed: int, out_dir, *, partition: str | None = None) -> Path:
    """Partition the dataset for ``seed`` and write the site datalists into ``out_dir`` (``partition``
    overrides the config's, e.g. ``"iid"`` for the IID reference)."""
    from fedmed.data import partition as P
    from fedmed.data.images import check_readable, discover, write_site_datalists

    exp.check_data_paths()
    fed = exp.federation
    part = partition or fed.partition
    out = Path(out_dir)
    if out.exists():
        shutil.rmtree(out)
    seg2d = exp.dataset.task == "segmentation" and bool(exp.dataset.sources)  # 2D lesion masks from an index
    if exp.dataset.task == "segmentation" and not seg2d:
        from fedmed.data.seg_federation import discover_subjects, write_seg_federation

        d = exp.dataset
        entries = discover_subjects(d.path, d.modalities, d.label_pattern, d.mask_pattern, d.hemispheres)
        return write_seg_federation(entries, fed.sites, out, partition=part if part in ("iid", "label_volume")
                                    else "label_volume", region=fed.volume_region, test_fraction=fed.test_fraction,
                                    val_fraction=fed.val_fraction, seed=seed, site_names=exp.site_names())
    if exp.dataset.sources:
        from fedmed.data.sources import read_sources

        pool = read_sources(exp.dataset.sources, exp.dataset.classes)
        if exp.dataset.max_per_class:
            raise ValueError("dataset.max_per_class would cut patients apart in a multi-source dataset; leave it out")
    else:
        pool = discover(exp.dataset.path, max_per_class=exp.dataset.max_per_class, seed=seed)
    check_readable(pool)  # nothing unreadable goes into a datalist
    if seg2d:
        missing = [pool.items[i] for i, m in enumerate(pool.masks or [None] * len(pool.items)) if not m]
        if missing:
            raise ValueError(f"dataset.sources: {len(missing)} image(s) have no mask in a segmentation dataset, e.g. "
                             f"{missing[0]}")
        from fedmed.data.images import ImagePool

        check_readable(ImagePool(list(pool.masks), pool.labels, pool.class_names, pool.source + " (masks)"))
    check_classes(exp, pool.class_names)
    rng = np.random.default_rng(seed)
    transforms = None
    extra: dict = {"partition": part, "seed": seed}
    if part == "natural":
        names, parts, source_of, unseen = P.natural_partition(pool.sites, pool.groups, rng,
                                                              split=fed.split_sources, holdout=fed.holdout_sources,
                                                              holdout_sites=fed.holdout_sites)
        extra.update(groups=source_of, unseen_sites=unseen, patient_wise=True,
                     sources={s: int(np.sum(np.asarray(pool.sites) == s)) for s in dict.fromkeys(pool.sites)})
        write_site_datalists(pool, parts, out, test_fraction=fed.test_fraction, val_fraction=fed.val_fraction,
                             seed=seed, extra=extra, site_names=names, segmentation=seg2d)
        meta_path = out / "dataset.json"
        meta = json.loads(meta_path.read_text())
        meta["sites"] = [n for n in names if n not in unseen]
        meta_path.write_text(json.dumps(meta, indent=1))
        return out
    if fed.holdout_sources and pool.sites is not None:  # e.g. the IID reference of a natural federation: held-out
        held = set(fed.holdout_sources)                   # sources stay out, it trains what the methods train on
        pool = pool.subset(np.asarray([i for i, x in enumerate(pool.sites) if x not in held], dtype=np.int64))
    units = None
    if pool.groups is not None:  # any partition of a multi-source pool deals patients, not images
        first, members = P.group_units(pool.groups)
        units = (pool, members)
        pool = pool.subset(first)
        extra["patient_wise"] = True
    common = None
    if fed.common_test_fraction > 0:  # one stratified test set every site scores; the rest is partitioned
        common = np.sort(np.concatenate([rng.permutation(np.flatnonzero(pool.labels == c))[
            :int(round(fed.common_test_fraction * int((pool.labels == c).sum())))] for c in range(pool.n_classes)]))
        rest = np.setdiff1d(np.arange(len(pool.labels)), common)
        full, pool = pool, pool.subset(rest)
        common_items = full.subset(common)
        extra["common_test"] = int(common.size)
    n_all = fed.sites + fed.unseen_sites  # held-out sites are dealt like the others, then kept out of training
    if part == "iid":
        parts = P.iid_partition(len(pool.labels), n_all, rng)
    elif part == "dirichlet":
        parts = P.dirichlet_label_partition(pool.labels, n_all, fed.alpha, rng,
                                            mode={"hsu": "per-site", "per_client": "per-client"}[fed.dirichlet_scheme])
    elif part == "quantity":
        parts = P.quantity_partition(len(pool.labels), n_all, fed.alpha, rng)
    elif part == "predi":
        try:
            res = P.predi(pool.n_classes, n_all, fed.predi_prevalence, fed.predi_disparity, rng)
            parts = P.predi_partition(pool.labels, res.assignment, rng, samples_per_cell=fed.predi_samples_per_cell)
        except ValueError as e:
            raise ValueError(f"federation.predi_prevalence={fed.predi_prevalence}, predi_disparity={fed.predi_disparity}, "
                             f"predi_samples_per_cell={fed.predi_samples_per_cell} with {n_all} sites and "
                             f"{pool.n_classes} classes cannot be met: {e}") from None
        extra.update(prevalence=res.prevalence, disparity=res.disparity)
    elif part == "anda":
        sites = P.anda_federation(pool.labels, n_all, fed.anda_shift, rng,
                                  level=fed.anda_level, n_groups=fed.anda_groups)
        parts = [s.indices for s in sites]
        transforms = [(lambda img, lab, s=s: P.apply_anda_transform(img, lab, s, colour=fed.anda_colour)) for s in sites]
        extra.update(shift=fed.anda_shift, level=fed.anda_level)
    else:
        raise ValueError(f"federation.partition {part!r} is for segmentation datasets")
    names = exp.site_names()
    if part == "anda":
        names = names + [f"unseen-{j + 1}" for j in range(fed.unseen_sites)]
        groups = [s.group for s in sites]
        # held-out sites: one per group in turn, taken from the end of the site list
        unseen: list[int] = []
        order = list(range(len(names)))[::-1]
        g = 0
        while len(unseen) < fed.unseen_sites:
            pick = next((k for k in order if groups[k] == g % fed.anda_groups and k not in unseen), None)
            if pick is not None:
                unseen.append(pick)
            g += 1
        trained = [k for k in range(len(names)) if k not in unseen]
        final = [None] * len(names)
        for j, k in enumerate(trained):
            final[k] = exp.site_names()[j]
        for j, k in enumerate(unseen):
            final[k] = f"unseen-{j + 1}"
        names = final
        extra.update(groups=dict(zip(names, groups)), unseen_sites=[f"unseen-{j + 1}" for j in range(len(unseen))])
    elif fed.unseen_sites:  # no known groups: the last sites dealt are held out
        names = names + [f"unseen-{j + 1}" for j in range(fed.unseen_sites)]
        extra.update(unseen_sites=names[fed.sites:])
    if units is not None:  # patients back to their images
        pool, members = units
        parts = P.expand_units(parts, members)
    if common is not None:  # the common test images join the pool's end so the datalists can refer to them
        from fedmed.data.images import ImagePool

        pool = ImagePool(pool.items + common_items.items, np.concatenate([pool.labels, common_items.labels]),
                         pool.class_names, pool.source)
        common = np.arange(len(pool.labels) - len(common_items.labels), len(pool.labels))
    write_site_datalists(pool, parts, out, test_fraction=fed.test_fraction, val_fraction=fed.val_fraction, seed=seed,
                         transforms=transforms, extra=extra, site_names=names, common_test=common, segmentation=seg2d)
    meta_path = out / "dataset.json"
    meta = json.loads(meta_path.read_text())
    meta["sites"] = [n for n in names if not n.startswith("unseen-")]
    meta_path.write_text(json.dumps(meta, indent=1))
    return out


# --------------------------------------------------------------------------------------------- one run

def progress_lines(doc: dict, total: int, t0: float, seen: int, log) -> int:
    """``log`` a line for each round of a run's record (``metrics.json``) after the first ``seen``: sites, train loss,
    validation and test score, elapsed time and ETA; returns how many rounds are now shown."""
    rounds = doc.get("rounds", [])
    for r in rounds[seen:]:
        s = r["summary"]
        mean = s.get("mean", {})
        done = r["round"] + 1
        elapsed = time.time() - t0
        eta = elapsed / max(done, 1) * max(total + 1 - done, 0)
        key = "dice_mean" if "dice_mean" in mean else "accuracy"

        def pct(k):
            v = mean.get(k)
            return f"{100 * v:.1f}%" if isinstance(v, (int, float)) else "n/a"

        loss = mean.get("train_loss")
        log(f"    round {r['round']}/{total} {r['task']}: {s.get('n_sites', 0)} site(s)"
            + (f", train loss {loss:.4f}" if isinstance(loss, (int, float)) else "")
            + f", val {key} {pct('val_' + key)}, test {key} {pct(key)}, {elapsed:.0f} s elapsed"
            + (f", ETA {eta:.0f} s" if r["task"] == "train" else ""))
    return len(rounds)


def _explain_exit(rc: int, tail: str, n_sites: int) -> str:
    if rc in KILLED or "return code -9" in tail or "return code 137" in tail or "return code 247" in tail:
        return (f"killed by the system (SIGKILL), most likely out of memory: a simulator site process holds about "
                f"0.3-0.6 GiB, so {n_sites} sites need about {0.6 * n_sites + 1:.0f} GiB (see `dmesg`); run fewer "
                f"sites or fewer runs at once")
    return f"the simulator exited with code {rc}"


def _stop(proc, grace: float = 30.0) -> None:
    """SIGTERM the job runner (it stops its simulator's process group), SIGKILL after ``grace`` seconds."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_job(spec, datalists: Path, work: Path, n_sites: int = 0, timeout: int = 24 * 3600, *, log=print) -> dict:
    """Run one job (:class:`fedmed.run.jobspec.JobSpec`, built in this process from the typed config) in NVFlare's
    simulator: the spec is written to ``work/job_spec.json`` and the job runner (``fedmed_flare.run --spec``) starts
    the simulator on it
    (fedmed itself never imports nvflare); nothing of the config is read again.

    Keeps the server's ``fedmed/`` output (metrics.json, reports, plots, tb/, models/, checkpoint/) under
    ``work/server``, prints a line per round, and returns the ``metrics.json`` document.

    Inside :func:`run_experiment` with ``in_process=True`` the job runs in this process instead
    (:func:`run_job_in_process`), with the same outputs.

    Raises:
        RunError: the run stopped or failed (the reason names the sites / the cause; a stopped run's
            checkpoint stays in ``work/server`` for ``--resume``).
    """
    if _IN_PROCESS.get():
        return run_job_in_process(spec, datalists, work, log=log)
    work.mkdir(parents=True, exist_ok=True)
    ws = work / "workspace"
    if ws.exists():
        shutil.rmtree(ws)
    spec_file = spec.to_file(work / "job_spec.json")
    cmd = [sys.executable, "-m", "fedmed_flare.run", "--spec", str(spec_file), "--env", "sim",
           "--datalists", str(Path(datalists).resolve()), "--workspace", str(ws), "--jobs-dir", str(work / "job"),
           "--site-policy", "simulation", "--verbose"]  # FLARE's lines into simulator.log, for the reasons it gives
    total = spec.rounds  # the job's own (a plan's 2, an onboarding job's 1), not the config's training rounds
    t0 = time.time()
    seen = 0
    log_path = work / "simulator.log"
    with log_path.open("w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT)  # every path in the spec is absolute
        try:
            while proc.poll() is None:
                try:
                    proc.wait(timeout=1.0)  # returns as soon as the job ends
                except subprocess.TimeoutExpired:
                    pass
                if time.time() - t0 > timeout:
                    _stop(proc)
                    raise RunError("failed", f"no end after {timeout} s; stopped (see {log_path})")
                hits = list(ws.glob("*/server/simulate_job/fedmed/metrics.json"))
                if hits:
                    try:
                        doc = json.loads(hits[0].read_text())
                    except (OSError, ValueError):
                        continue
                    seen = progress_lines(doc, total, t0, seen, log)
        except BaseException:  # interrupted or killed: do not leave the job (and its simulator) running
            _stop(proc)
            raise
    text = log_path.read_text()
    last = next((ln for ln in reversed(text.splitlines()) if ln.startswith("{") and '"status"' in ln), None)
    if proc.returncode == 2:
        raise RunError("failed", "the job could not be built: " + (text.strip().splitlines() or ["?"])[-1])
    if last is None:
        raise RunError("failed", _explain_exit(proc.returncode, text[-3000:], n_sites) + f" (log: {log_path})")
    res = json.loads(last)
    keep = work / "server"
    if res.get("result"):
        if keep.exists():
            shutil.rmtree(keep)
        shutil.copytree(res["result"], keep)
        shutil.copy(keep / "metrics.json", work / "metrics.json")
    for served in ws.glob(f"*/*/{SERVED_DIR}"):  # what the simulated sites keep (a serving plan's served models)
        if served.parent.name != "server":
            shutil.copytree(served, work / "sites" / served.parent.name / SERVED_DIR, dirs_exist_ok=True)
    shutil.rmtree(ws, ignore_errors=True)  # workspaces are large; the server output, the log and the sites' served
    # models are kept
    doc = json.loads((keep / "metrics.json").read_text()) if (keep / "metrics.json").is_file() else {}
    doc["wall_seconds"] = time.time() - t0
    if res["status"] != "finished":
        reason = res["reason"]
        if "return code" in reason and any(f"return code {c}" in reason for c in KILLED):
            reason = _explain_exit(-9, reason, n_sites) + f" ({reason})"
        raise RunError(res["status"], reason, doc)
    return doc


def run_and_release(spec, *args, **kwargs) -> dict:
    """:func:`run_job` for a spec built for this one run: the folders it staged the server's files in (copies of
    models) are removed after it, whatever the run's end (:meth:`fedmed.run.jobspec.JobSpec.release`)."""
    try:
        return run_job(spec, *args, **kwargs)
    finally:
        spec.release()


def run_job_in_process(spec, datalists: Path, work: Path, *, log=print) -> dict:
    """:func:`run_job`'s contract (the server's ``fedmed/`` output in ``work/server``, ``work/metrics.json``, a line
    per round, :class:`RunError` when the run stopped or failed) with the job run in this process by
    :func:`fedmed.run.jobspec.run_spec_in_process`: fedmed's workflow and every site's task through the same reply
    loop, without FLARE, one site after another. An error that ends the run is a failed run, as in the simulator."""
    from fedmed.run.jobspec import run_spec_in_process

    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    keep = work / "server"
    if keep.exists():  # a resumed run continues from its staged copy (spec.resume), not from this folder
        shutil.rmtree(keep)
    t0 = time.time()
    rounds: list = []  # the record's rounds as they are recorded

    def on_round(entry):
        rounds.append(entry)
        progress_lines({"rounds": rounds}, spec.rounds, t0, len(rounds) - 1, log)

    try:
        status, fed = run_spec_in_process(spec, datalists, keep, on_round=on_round, site_dir=work / "sites")
    except Exception as e:  # noqa: BLE001 — the run failed; the experiment goes on with its other runs
        if os.environ.get("FEDMED_DEBUG") == "1":
            import traceback

            traceback.print_exc()
        line = f"{type(e).__name__}: {e}".splitlines()[0]
        raise RunError("failed", f"{line} (in-process run; FEDMED_DEBUG=1 for the traceback)",
                       {"rounds": rounds}) from e
    metrics = keep / "metrics.json"
    if metrics.is_file():  # the record as the simulator's run leaves it beside the server's folder
        shutil.copy(metrics, work / "metrics.json")
    doc = json.loads(metrics.read_text()) if metrics.is_file() else fed.recorder.doc
    doc["wall_seconds"] = time.time() - t0
    if status != "finished":
        raise RunError(status, doc.get("reason") or status, doc)
    return doc


def run_config_job(config, overrides: list[str], method: str, seed: int, datalists: Path, work: Path,
                   n_sites: int = 0, timeout: int = 24 * 3600, *, log=print, resume_from: Path | None = None,
                   sites: list[str] | None = None, onboard: dict | None = None) -> dict:
    """One method of a config (a file, with ``overrides``, or an :class:`ExperimentConfig`) for ``seed`` on the
    federation ``datalists``: its job built here (classes from the federation when the config names none), run by
    :func:`run_job`."""
    from fedmed.config import load_config
    from fedmed.run.jobspec import select_method

    exp = config if isinstance(config, ExperimentConfig) else load_config(config, overrides)
    natural = exp.federation.partition == "natural" and exp.federation.site_names is None
    if ((exp.dataset.task == "classification" and not exp.dataset.classes) or natural) and \
            (Path(datalists) / "dataset.json").is_file():
        exp = with_classes(exp, Path(datalists))
    try:
        spec = job_spec(exp, select_method(exp, method, str(config)), seed, sites=sites or "config",
                        resume_from=_stage_resume(resume_from, Path(work)), onboard=onboard)
    except BuildError as e:
        raise RunError("failed", f"the job could not be built: {e}") from None
    return run_and_release(spec, datalists, Path(work), n_sites, timeout, log=log)


def _stage_resume(resume_from: Path | None, work: Path) -> Path | None:
    """A copy of the checkpointed server output a resumed run continues from (``work/server`` is replaced by the
    run)."""
    if resume_from is None:
        return None
    staged = work / "resume_from"
    if staged.exists():
        shutil.rmtree(staged)
    shutil.copytree(resume_from, staged)
    return staged


def training_assignment(doc: dict, method, folder: Path | None = None) -> dict:
    """site -> cluster after training: what the run kept for onboarding (``onboarding.json``), else what the method
    reads from its record (:meth:`fedmed.methods.Method.training_assignment`)."""
    f = Path(folder) / "onboarding.json" if folder is not None else None
    if f is not None and f.is_file():
        return {s: int(c) for c, members in json.loads(f.read_text())["clusters"].items() for s in members}
    return type(method).training_assignment(doc)




def mlflow_ui_command(out) -> str:
    """The command that opens an experiment's MLflow store in MLflow's UI, as it runs in a shell (MLflow 3 opens a
    file store only with ``MLFLOW_ALLOW_FILE_STORE=true``); with only ``mlflow-skinny`` installed (no UI server), what
    to install first."""
    import importlib.util
    import shutil
    import sys

    exe = shutil.which("mlflow", path=str(Path(sys.executable).parent)) or "mlflow"  # this environment's: a new shell
    cmd = f"MLFLOW_ALLOW_FILE_STORE=true {exe} ui --backend-store-uri {(Path(out) / 'mlruns').resolve().as_uri()}"
    if importlib.util.find_spec("alembic") is None:  # mlflow-skinny: the tracking client without MLflow's server
        cmd = f"pip install 'fedmed[mlflow-ui]' (MLflow's UI server), then {cmd}"
    return cmd


# config settings added after runs were made, as (section, key, default): left out of a run's fingerprint at their
# default, so that --resume still reuses the runs made before the setting existed (which trained as its default does)
ADDED_AT_DEFAULT = (("train", "lr_schedule", "constant"), ("train", "norm_recalibrate", False))


def run_fingerprint(exp, method, seed: int, paths: str | None = None) -> str:
    """What determines one (seed, method) run: the resolved config (less the other methods, the seed list,
    the sweep block, the serving plan and the reporting and tracking choices; :func:`fingerprinted_config`), the
    method's settings and the seed. ``--resume`` reuses a run only when this matches. The files under
    ``dataset.path`` are not hashed: a dataset replaced in place needs a run without ``--resume``. ``paths``: the
    config's file paths as given (None), or each written ``absolute`` or ``relative`` to the working folder
    (:func:`same_run`)."""
    import hashlib

    blob = json.dumps({"config": fingerprinted_config(exp, paths),
                       "method": method.model_dump(mode="json") if method is not None else None,
                       "seed": seed}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def fingerprinted_config(exp, paths: str | None = None) -> dict:
    """The part of ``exp`` a run's fingerprint hashes; a setting of :data:`ADDED_AT_DEFAULT` at its default is left
    out. ``paths``: ``absolute`` or ``relative`` rewrites the data and weights paths so, from the working folder."""
    import os

    from fedmed.run.taskconfig import model_exclude

    skip = {k: True for k in ("methods", "seeds", "sweep", "name", "selection", "references", "tracking", "serving")}
    cfg = exp.model_dump(mode="json", exclude={**skip, "model": model_exclude(exp.model)})  # a bundle: its arch, weights
    for section, key, default in ADDED_AT_DEFAULT:
        if cfg.get(section, {}).get(key, default) == default:
            cfg.get(section, {}).pop(key, None)
    for s in (cfg.get("dataset") or {}).get("sources") or []:  # added later (#89): at its default, out of the hash
        if not s.get("drop_sites"):
            s.pop("drop_sites", None)
    if paths is not None:
        def rewrite(box: dict, key: str) -> None:
            v = box.get(key)
            if isinstance(v, str) and v and not v.startswith("builtin:"):
                full = os.path.abspath(os.path.expanduser(v))
                box[key] = full if paths == "absolute" else os.path.relpath(full)

        d = cfg.get("dataset") or {}
        rewrite(d, "path")
        for s in d.get("sources") or []:
            rewrite(s, "path")
        for key in ("init_weights", "bundle"):
            rewrite(cfg.get("model") or {}, key)
    return cfg


def run_fingerprints(exp, method, seed: int) -> set:
    """The fingerprints a saved run of this (seed, method) may carry: the config as given, or with its data and
    weights paths written the other way (absolute, or relative to the working folder) — the same files, named from
    here. A weights file named ``.venv/...`` once and ``/work/.../.venv/...`` the next time is not a new run."""
    return {run_fingerprint(exp, method, seed, p) for p in (None, "absolute", "relative")}


def same_run(saved_fingerprint, exp, method, seed: int) -> bool:
    """A saved run's fingerprint is this (seed, method)'s (:func:`run_fingerprints`)."""
    return bool(saved_fingerprint) and saved_fingerprint in run_fingerprints(exp, method, seed)


# --------------------------------------------------------------------------------------------- experiment

def _network(m) -> str:
    """The classifier as the Setup line names it: ResNet-9's width and norm are its own settings, not another
    network's (a MONAI network's arguments, a bundle, a weights file are named instead)."""
    from fedmed.core.io import shown_path

    text = f"{m.arch} width {m.width} ({m.norm} norm)" if m.arch == "resnet9" else m.arch
    if m.arch != "resnet9" and m.args:
        text += " (" + ", ".join(f"{k}={v}" for k, v in sorted(m.args.items())) + ")"
    if m.bundle:
        text += f", from the bundle {shown_path(m.bundle)}"
    if m.init_weights:
        text += f", started from {shown_path(m.init_weights)}"
    return text


def _setup(exp, data_dir: Path) -> list[str]:
    from fedmed.algorithms.serving import MIN_PATIENTS
    from fedmed.data.images import patients_of
    from fedmed.core.io import shown_path

    meta = json.loads((data_dir / "dataset.json").read_text())
    f, t, m = exp.federation, exp.train, exp.model
    n_test, n_all, n_val, few = [], 0, 0, []
    val_patients = {}
    for s in meta["sites"]:
        doc = json.loads((data_dir / f"{s}.json").read_text())
        n_test.append(len(doc.get("test", [])))
        n_val += len(doc.get("validation", []))
        n_all += sum(len(doc.get(k, [])) for k in ("training", "validation", "test"))
        val = doc.get("validation", [])
        units = {str(e.get("patient", e.get("subject", i))) for i, e in enumerate(val)}  # no id: an image a patient
        val_patients[s] = len(units)
        if val and patients_of(val) is not None and len(units) < MIN_PATIENTS:  # the plan's own rule (#86)
            few.append(s)
    part = f.partition + (f" (alpha {f.alpha}, {f.dirichlet_scheme})" if f.partition == "dirichlet" else "") + \
        (f" ({f.anda_shift}, level {f.anda_level}, {f.anda_groups} groups)" if f.partition == "anda" else "")
    d = exp.dataset
    data = (shown_path(d.path, data_dir.parents[1]) if d.path is not None else " + ".join(
        shown_path(x.path, data_dir.parents[1]) + (f" ({x.site})" if x.site else "") for x in d.sources))
    out = [f"data {data}", f"{len(meta['sites'])} sites, {part}",
           f"asked test {f.test_fraction:.0%} / validation {f.val_fraction:.0%} of each site, dealt "
           + (f"test {sum(n_test) / n_all:.0%} / validation {n_val / n_all:.0%} of {n_all} samples ("
              if n_all else "(") + f"{sum(n_test)} test samples, median {int(np.median(n_test)) if n_test else 0} "
           f"per site; validation from {int(np.median(list(val_patients.values()))) if val_patients else 0} "
           f"patients per site in the median)"]
    if few:
        out.append(f"**{len(few)} of {len(val_patients)} sites validate on fewer than {MIN_PATIENTS} patients "
                   f"({', '.join(few[:4])}{', ...' if len(few) > 4 else ''}): their validation choices rest on a "
                   f"handful of people, and the serving plan decides nothing there**")
    if exp.dataset.task == "classification":
        out.append(f"{exp.dataset.image_size}x{exp.dataset.image_size}x{exp.dataset.channels}, {_network(m)}")
    so = t.server_opt
    server = "" if so.kind == "none" else (  # FedOpt at the server: not FedAvg's plain average (#89)
        f", server {dict(avgm='FedAvgM', adam='FedAdam', yogi='FedYogi')[so.kind]} (lr {so.lr}, beta1 {so.beta1}"
        + ("" if so.kind == "avgm" else f", beta2 {so.beta2}, tau {so.tau}") + ")")
    out += [f"{t.rounds} rounds x {t.local_epochs} local epochs, {t.optimizer} lr {t.lr}, batch {t.batch_size}, "
            f"augment {t.augment}{server}", f"seeds {exp.seeds}", f"k_min {exp.privacy.k_min}, DP "
            + (f"epsilon {exp.privacy.dp_epsilon}" if exp.privacy.dp_epsilon else "off")]
    from fedmed.algorithms.privacy import k_min_consent_note

    consent = k_min_consent_note(exp.privacy)
    if consent:
        out.append(f"**{consent}**")
    return out


def with_classes(exp, data_dir: Path):
    """The config with ``dataset.classes`` from a written federation (a job is built from the config alone), and for a
    natural federation its sites (their names and count come from the data)."""
    seg2d = exp.dataset.task == "segmentation" and bool(exp.dataset.sources)
    if exp.dataset.task != "classification" and not seg2d:
        return exp
    meta = json.loads((Path(data_dir) / "dataset.json").read_text())
    update = {} if seg2d else {"dataset": exp.dataset.model_copy(update={"classes": list(meta["class_names"])})}
    if exp.federation.partition == "natural" and exp.federation.site_names is None:
        update["federation"] = exp.federation.model_copy(update={"site_names": list(meta["sites"]),
                                                                 "sites": len(meta["sites"])})
    out = exp.model_copy(update=update)
    out._base_dir, out._path_origins = exp.base_dir, exp._path_origins
    return out


def classes_override(data_dir: Path, exp) -> list[str]:
    """``dataset.classes=[...]`` from a written federation, as a ``--set`` override."""
    if exp.dataset.task != "classification":
        return []
    names = json.loads((data_dir / "dataset.json").read_text())["class_names"]
    return [f"dataset.classes={json.dumps(names)}"]


def _load_saved(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def select_methods(available, wanted, config_path) -> list:
    """The config's methods named by ``wanted`` (all when empty), in config order. A token matches a method's
    name exactly, else case-insensitively, else its workflow (``FMCL`` selects ``FMCL (Auto-K)``; ``fmcl`` every
    FMCL variant)."""
    if not wanted:
        return list(available)
    picked: set[int] = set()
    unknown = []
    for token in wanted:
        for rule in (lambda m: m.name == token, lambda m: m.name.lower() == token.lower(),
                     lambda m: m.workflow.lower() == token.lower()):
            hits = {i for i, m in enumerate(available) if rule(m)}
            if hits:
                picked |= hits
                break
        else:
            unknown.append(token)
    if unknown:
        raise ValueError(f"unknown method(s) {unknown} in {config_path}; its methods are "
                         f"{[m.name for m in available]} (a workflow name such as 'fmcl' also selects)")
    return [m for i, m in enumerate(available) if i in picked]


class OutputBusy(FedmedError, RuntimeError):
    """Another fedmed process is writing the same output folder."""


@contextlib.contextmanager
def output_lock(out: Path):
    """Hold ``OUT/.fedmed.lock`` (an exclusive ``flock``) while this process writes ``OUT``: two experiments writing
    one folder would overwrite each other's rows. The lock goes with the process (a killed run leaves none behind)."""
    import fcntl
    import os

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    f = open(out / ".fedmed.lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        who = f.read().strip() or "another process"
        f.close()
        raise OutputBusy(f"{out}: another fedmed run is writing this folder ({who}); wait for it to end or give "
                         f"another --out") from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()}")
    f.flush()
    try:
        yield
    finally:
        f.close()


def run_experiment(config_path: str, out_dir, *, overrides: list[str] | None = None, methods: list[str] | None = None,
                   log=print, resume: bool = False, command: str | None = None, in_process: bool = False) -> list[dict]:
    """Run every (seed, method) of the config and the reference rows; returns the result rows and writes the
    outputs (see the module notes). One run at a time writes ``out_dir`` (:func:`output_lock`). ``in_process``: each
    job runs in this process (:func:`run_job_in_process`) instead of FLARE's simulator.

    Raises:
        ExperimentError: after all runs, when some did not finish (each named with its reason).
        OutputBusy: another run is writing ``out_dir``.
    """
    token = _IN_PROCESS.set(bool(in_process))
    try:
        with output_lock(Path(out_dir)), _site_cache_in(Path(out_dir) / "cache"):
            return _run_experiment(config_path, out_dir, overrides=overrides, methods=methods, log=log, resume=resume,
                                   command=command)
    finally:
        _IN_PROCESS.reset(token)


@contextlib.contextmanager
def _site_cache_in(folder: Path):
    """The simulated sites' decoded-data cache in the experiment's own folder (``<out>/cache/``: its later runs,
    methods and seeds reuse it), unless ``FEDMED_CACHE_DIR`` names another; never a home folder
    (``fedmed.site.cache``)."""
    if os.environ.get("FEDMED_CACHE_DIR"):
        yield
        return
    os.environ["FEDMED_CACHE_DIR"] = str(folder.resolve())
    try:
        yield
    finally:
        os.environ.pop("FEDMED_CACHE_DIR", None)


def _run_experiment(config_path, out_dir, *, overrides, methods, log, resume, command) -> list[dict]:
    from fedmed.algorithms.clustering import clusters_ari
    from fedmed.config import load_config

    overrides = list(overrides or [])
    exp = load_config(config_path, overrides)
    chosen = select_methods(exp.methods, methods, config_path)
    for m in chosen:  # a missing or mismatched weights file: now, not after the methods before it have trained
        try:
            check_method_files(exp, m)
        except BuildError as e:
            raise ExperimentError(f"method {m.name!r}: {e}") from None
    out = Path(out_dir)
    if exp.tracking.mlflow and not exp.tracking.mlflow_uri:  # one store for the experiment's runs, kept with its outputs
        exp = exp.model_copy(update={"tracking": exp.tracking.model_copy(
            update={"mlflow_uri": (out / "mlruns").resolve().as_uri()})})
        log(f"MLflow: every run of this experiment in {out / 'mlruns'}; to view them: {mlflow_ui_command(out)}")
    if exp.tracking.wandb and not exp.tracking.wandb_dir:  # the experiment's W&B runs, kept with its outputs
        exp = exp.model_copy(update={"tracking": exp.tracking.model_copy(
            update={"wandb_dir": str((out / "wandb").resolve())})})
        log(f"W&B ({exp.tracking.wandb_mode}): every run of this experiment in {out / 'wandb'}"
            + (" (wandb sync DIR/offline-run-* to upload)" if exp.tracking.wandb_mode == "offline" else ""))
    command = command or _command(config_path, overrides, out_dir, methods)
    rows: list[dict] = []
    problems: list[str] = []
    missing: list[str] = []  # finished runs in which a site sat out: said on the console and in the report
    total = len(exp.seeds) * len(chosen)
    k = 0
    setup: list[str] = []
    seg = exp.dataset.task == "segmentation"
    from fedmed.algorithms.privacy import k_min_consent_note

    consent = k_min_consent_note(exp.privacy)
    if consent:
        log(consent)
    for seed in exp.seeds:
        data_dir = prepare_federation(exp, seed, out / "data" / f"seed{seed}")
        meta = json.loads((data_dir / "dataset.json").read_text())
        log(f"[seed {seed}] federation: {len(meta['sites'])} sites, {exp.federation.partition} partition -> {data_dir}")
        setup = setup or _setup(exp, data_dir)
        exp_s = with_classes(exp, data_dir)
        rows.extend(_references(exp_s, seed, data_dir, out, chosen, log, resume, seg))
        for m in chosen:
            k += 1
            work = run_dir(out, seed, m.name)
            fp = run_fingerprint(exp, m, seed)
            saved = _load_saved(work / "run.json")
            resume_from = None
            if resume and same_run(saved.get("fingerprint"), exp, m, seed):
                if saved.get("status") == "finished":
                    if m.workflow in clustering_workflows() and not seg and "clusters" not in saved:
                        _add_clusters(saved, work, meta)  # a run recorded before K / ARI were rows' fields
                        (work / "run.json").write_text(json.dumps(saved))
                    if not seg and _add_pooled_val_auc(saved, work):  # recorded before rows carried it
                        (work / "run.json").write_text(json.dumps(saved))
                    rows.extend(saved["rows"])
                    log(f"[{k}/{total}] seed {seed} {m.name}: finished earlier with the same settings, reused")
                    if saved.get("sites_missing"):
                        missing.append(f"seed {seed} {m.name}: {missing_sentence(saved['sites_missing'])}")
                        log(f"    {missing_sentence(saved['sites_missing'])}")
                    continue
                if (work / "server" / "checkpoint" / "state.json").is_file():  # stopped, or failed (a killed server)
                    resume_from = work / "server"
                    log(f"[{k}/{total}] seed {seed} {m.name}: {saved.get('status', 'stopped')} earlier; resuming "
                        f"from its checkpoint (round {_checkpoint_round(resume_from)})")
            elif resume and saved:
                log(f"[{k}/{total}] seed {seed} {m.name}: earlier run made with other settings, running again")
            (work / "run.json").unlink(missing_ok=True)
            log(f"[{k}/{total}] seed {seed} {m.name} ({m.workflow}, {exp.train.rounds} rounds) ...")
            try:
                staged = _stage_resume(resume_from, work)
                doc = run_and_release(job_spec(exp_s, m, seed, resume_from=staged, files_checked=True), data_dir,
                                      work, len(meta["sites"]), log=log)
            except BuildError as e:
                raise ExperimentError(f"seed {seed} {m.name}: the job could not be built: {e}") from None
            except RunError as e:
                work.mkdir(parents=True, exist_ok=True)
                (work / "run.json").write_text(json.dumps({"fingerprint": fp, "method": m.name, "seed": seed,
                                                           "status": e.status, "reason": e.reason, "rows": []}))
                problems.append(f"seed {seed} {m.name}: {e.status}: {e.reason}")
                log(f"    {e.status}: {e.reason}")
                continue
            new = rows_from_metrics(m.name, seed, doc)
            clusters = None
            if m.workflow in clustering_workflows() and not seg:
                from fedmed.run.references import cluster_majority_rows, run_clusters

                clusters = run_clusters(doc)
                for r in new:
                    if r.get("phase"):
                        continue
                    r["n_clusters"] = len(clusters)
                    if meta.get("groups"):
                        r["ari"] = clusters_ari(clusters, meta["groups"])
                if "cluster_majority" in exp.references:
                    new += cluster_majority_rows(m.name, data_dir, clusters, len(meta["class_names"]), seed)
            if meta.get("unseen_sites") and type(m).onboards:
                new += _unseen(exp_s, m, seed, data_dir, work, doc, meta, log)
            rows.extend(new)
            _log_done(m, doc, new, exp.selection, log, work)
            if doc.get("sites_missing"):
                missing.append(f"seed {seed} {m.name}: {missing_sentence(doc['sites_missing'])}")
                log(f"    {missing_sentence(doc['sites_missing'])}")
            (work / "run.json").write_text(json.dumps({"fingerprint": fp, "method": m.name, "seed": seed,
                                                       "status": "finished", "rows": new, "clusters": clusters,
                                                       "sites_missing": doc.get("sites_missing") or {}}))
            if [r for r in rows if not r.get("phase")]:
                write_outputs(rows, out, title=exp.name, command=command, selection=exp.selection, setup=setup,
                              notes=missing)
        if exp.serving is not None:
            rows.extend(_serving_plan(exp_s, seed, data_dir, out, meta, log, resume, problems,
                                      [m.name for m in chosen]))
    if [r for r in rows if not r.get("phase")]:  # once more, so that a fully reused experiment has its outputs
        write_outputs(rows, out, title=exp.name, command=command, selection=exp.selection, setup=setup,
                      notes=missing + [f"did not finish: {p}" for p in problems])
        from fedmed.report.html import write_report

        log(f"report: {write_report(out, command=command)}")
    if problems:
        raise ExperimentError(f"{len(problems)} run(s) did not finish:\n  " + "\n  ".join(problems))
    return rows


PLAN_METHOD = "Serving plan"  # the plan's row in the tables: each site scored with the model it is served
PLAN_GLOBAL = "Serving plan: global model"  # beside it, each site scored with the plan's reference (its final model)


def run_dir(out: Path, seed: int, name: str) -> Path:
    """A run's folder in an experiment's output (the serving plan's: ``_serving_plan``)."""
    name = "_serving_plan" if name in (PLAN_METHOD, PLAN_GLOBAL) else name
    return out / "runs" / f"seed{seed}" / run_folder(name)


def candidate_name(method: str) -> str:
    """A method's name as a serving plan's candidate (a word: ``FMCL (Auto-K)`` -> ``FMCL__Auto-K_``)."""
    return "".join(c if c.isalnum() or c in "_-." else "_" for c in method)


def run_folder(name: str) -> str:
    """The folder name of a method's run (``FMCL (Auto-K)`` -> ``FMCL__Auto_K_``): a word, also a plan candidate's."""
    return "".join(c if c.isalnum() else "_" for c in name)


def _serving_plan(exp, seed, data_dir, out, meta, log, resume, problems, chosen) -> list[dict]:
    """The serving plan of ``exp.serving`` over the seed's finished runs (``fedmed.workflows.plan``): one row, each
    site scored with the model it is served (round 1 of the plan's record), and the plan's table in its folder. Not
    run when ``--methods`` left out a method it names (``chosen``)."""
    from fedmed.report.summary import rows_from_metrics

    sv = exp.serving
    by_name = {m.name: m for m in exp.methods}
    involved = [sv.reference, *(c for c in sv.candidates if c != "local")]
    if not set(involved) <= set(chosen):
        log(f"seed {seed} serving plan: not run (--methods left out {sorted(set(involved) - set(chosen))})")
        return []
    work = run_dir(out, seed, PLAN_METHOD)
    fp = hashlib.sha256(json.dumps([sv.model_dump(), [run_fingerprint(exp, by_name[n], seed) for n in involved]],
                                   sort_keys=True, default=str).encode()).hexdigest()[:16]
    saved = _load_saved(work / "run.json")
    if resume and saved.get("fingerprint") == fp and saved.get("status") == "finished":
        log(f"seed {seed} serving plan: finished earlier with the same runs, reused")
        return saved["rows"]
    missing = [n for n in involved if _load_saved(run_dir(out, seed, n) / "run.json").get("status") != "finished"]
    if missing:
        problems.append(f"seed {seed} serving plan: not run: {', '.join(missing)} did not finish at this seed")
        log(f"    seed {seed} serving plan: not run ({', '.join(missing)} did not finish)")
        return []
    plan = {"global": run_dir(out, seed, sv.reference) / "server",
            "candidates": {candidate_name(n): run_dir(out, seed, n) / "server" for n in sv.candidates if n != "local"},
            "finetune": sv.finetune.model_dump() if sv.finetune is not None else None, "pool": sv.pool,
            "test": sv.test, "local": "local" in sv.candidates}
    log(f"seed {seed} serving plan: the global model of {sv.reference} against "
        f"{', '.join([c if c != 'local' else 'each site its own model' for c in sv.candidates] + (['fine-tuned at each site'] if sv.finetune else []))} ...")
    (work / "run.json").unlink(missing_ok=True)
    try:
        doc = run_and_release(job_spec(exp, by_name[sv.reference], seed, plan=plan, files_checked=True), data_dir,
                              work, len(meta["sites"]), log=log)
    except BuildError as e:
        raise ExperimentError(f"seed {seed} serving plan: the job could not be built: {e}") from None
    except RunError as e:
        problems.append(f"seed {seed} serving plan: {e.status}: {e.reason}")
        log(f"    {e.status}: {e.reason}")
        return []
    new = [r for r in rows_from_metrics(PLAN_METHOD, seed, doc) if r["task"] == "served"] + \
        [{**r, "method": PLAN_GLOBAL} for r in rows_from_metrics(PLAN_METHOD, seed, doc) if r["task"] == "global"]
    served = doc.get("plan", {}).get("sites", {})
    counts = {}
    for v in served.values():
        counts[v["served"]] = counts.get(v["served"], 0) + 1
    log(f"    served: " + ", ".join(f"{k} at {n} site(s)" for k, n in sorted(counts.items()))
        + f" (table: {work / 'server' / 'plan.md'})")
    work.mkdir(parents=True, exist_ok=True)
    (work / "run.json").write_text(json.dumps({"fingerprint": fp, "method": PLAN_METHOD, "seed": seed,
                                               "status": "finished", "rows": new,
                                               "names": {candidate_name(n): n for n in sv.candidates}}))
    return new


def _run_record(work: Path) -> dict | None:
    hits = [f for f in (work / "server" / "metrics.json", work / "metrics.json") if f.is_file()]
    hits = hits or sorted(work.rglob("fedmed/metrics.json"))
    return json.loads(hits[0].read_text()) if hits else None


def _add_pooled_val_auc(saved: dict, work: Path) -> bool:
    """A finished classifier run saved before its rows carried the pooled validation AUC (``selection:
    validation_auc``): each round's row gets it from the run's own record. True where rows changed."""
    todo = [r for r in saved["rows"] if r.get("kind") != "reference" and not r.get("phase")
            and "pooled_val_auc" not in r]
    doc = _run_record(work) if todo else None
    if not doc:
        return False
    auc = {r["round"]: (r.get("summary", {}).get("pooled_val") or {}).get("auc") for r in doc.get("rounds", [])}
    for r in todo:
        if auc.get(r["round"]) is not None:
            r["pooled_val_auc"] = auc[r["round"]]
    return True


def _add_clusters(saved: dict, work: Path, meta: dict) -> None:
    from fedmed.algorithms.clustering import clusters_ari  # scipy: only when a run needs it

    from fedmed.run.references import run_clusters

    doc = _run_record(work)
    if doc is None:
        return
    clusters = run_clusters(doc)
    saved["clusters"] = clusters
    for r in saved["rows"]:
        if r.get("kind") == "reference" or r.get("phase"):
            continue
        r["n_clusters"] = len(clusters)
        if meta.get("groups"):
            r["ari"] = clusters_ari(clusters, meta["groups"])


def clustering_agreement(parts: list[tuple[str, list, Path]]) -> str:
    """Markdown: per sweep case and clustering method, the clusters found per seed and the ARI against the
    clustering the same method found for the same seed in the first case it runs in (e.g. without DP).
    Empty when no case has recorded clusters."""
    from fedmed.algorithms.clustering import clusters_ari  # scipy: only when a run needs it

    found: dict = {}  # method -> case -> seed -> clusters
    for name, _, d in parts:
        for f in sorted(Path(d).glob("runs/seed*/*/run.json")):
            doc = _load_saved(f)
            if doc.get("status") == "finished" and doc.get("clusters"):
                found.setdefault(doc["method"], {}).setdefault(name, {})[int(doc["seed"])] = doc["clusters"]
    lines = []
    for method, cases in found.items():
        first = next(n for n, _, _ in parts if n in cases)
        base = cases[first]
        for name, _, _ in parts:
            if name not in cases:
                continue
            seeds = sorted(cases[name])
            ks = ", ".join(str(len(cases[name][s])) for s in seeds)
            aris = [clusters_ari(cases[name][s], {x: k for k, c in enumerate(base[s]) for x in c})
                    for s in seeds if s in base]
            cell = f"{np.mean(aris):.2f} ± {np.std(aris):.2f}" if aris else "n/a"
            lines.append(f"| {name} | {method} | {ks} | {first} | {cell} |")
    if not lines:
        return ""
    return ("| Case | Method | K (per seed) | Compared with | ARI vs that case's clustering (same seed) |\n"
            "|---|---|---|---|---|\n" + "\n".join(lines) + "\n")




def _references(exp, seed, data_dir, out, chosen, log, resume, seg) -> list[dict]:
    """Reference rows of one seed (reused under --resume when the config fingerprint matches). In-process
    (``--in-process``) they train at the sites' torch thread count (:data:`~fedmed.workflows.inprocess.SITE_THREADS`),
    as the jobs do: several in-process experiments on one machine then share its cores instead of each taking them
    all."""
    if not _IN_PROCESS.get():
        rows = _reference_rows(exp, seed, data_dir, out, chosen, log, resume, seg)
    else:
        from fedmed.workflows.inprocess import SITE_THREADS, torch_threads

        with torch_threads(SITE_THREADS):
            rows = _reference_rows(exp, seed, data_dir, out, chosen, log, resume, seg)
    if not seg and "majority" not in exp.references:  # the constant answer is always beside a classifier (#89):
        from fedmed.run.references import majority_rows  # counts, no training; a served model below it is said

        meta = json.loads((Path(data_dir) / "dataset.json").read_text())
        rows = rows + majority_rows(data_dir, meta["sites"], len(meta["class_names"]), seed)
    return rows


def _reference_rows(exp, seed, data_dir, out, chosen, log, resume, seg) -> list[dict]:
    from fedmed.run.references import alone_rows, centralized_rows, majority_rows

    wanted = [r for r in exp.references if r != "cluster_majority"]
    if not wanted:
        return []
    work = out / "runs" / f"seed{seed}" / "_references"
    work.mkdir(parents=True, exist_ok=True)
    fp = run_fingerprint(exp, None, seed) + ":" + ",".join(wanted)
    saved = _load_saved(work / "run.json")
    same = {f + ":" + ",".join(wanted) for f in run_fingerprints(exp, None, seed)}
    if resume and saved.get("fingerprint") in same and saved.get("status") == "finished":
        log(f"[seed {seed}] references: reused")
        return saved["rows"]
    meta = json.loads((data_dir / "dataset.json").read_text())
    if seg and exp.dataset.sources:  # 2D lesion segmentation
        from fedmed.run.references import seg2d_reference_rows

        rows = seg2d_reference_rows(exp, data_dir, meta["sites"], seed, meta.get("groups"), log=log) \
            if "centralized" in wanted else []
        (work / "run.json").write_text(json.dumps({"fingerprint": fp, "status": "finished", "rows": rows}))
        return rows
    if seg:
        from fedmed.run.references import seg_reference_rows

        rows = seg_reference_rows(exp, data_dir, meta["sites"], seed, log=log) if "centralized" in wanted else []
        (work / "run.json").write_text(json.dumps({"fingerprint": fp, "status": "finished", "rows": rows}))
        return rows
    sites, n_classes = meta["sites"], len(meta["class_names"])
    rows: list[dict] = []
    if "majority" in wanted:
        rows += majority_rows(data_dir, sites, n_classes, seed)
    exp_c = exp.model_copy(update={"dataset": exp.dataset.model_copy(update={"classes": meta["class_names"]})})
    if "centralized" in wanted:
        rows += centralized_rows(exp_c, data_dir, sites, seed, log=log)
    if "alone" in wanted:
        sources = meta.get("groups") if meta.get("partition") == "natural" else None
        rows += alone_rows(exp_c, data_dir, sites, seed, sources, log=log)
    if "iid_fedavg" in wanted and exp.federation.partition != "iid":
        # the same training sites, IID (held-out sites stay out: the reference trains what the methods train on)
        exp_iid = exp.model_copy(update={"federation": exp.federation.model_copy(update={"unseen_sites": 0})})
        iid_dir = prepare_federation(exp_iid, seed, out / "data" / f"seed{seed}_iid", partition="iid")
        from fedmed.config import ExperimentConfig
        from fedmed.methods import FedAvgMethod

        iid = FedAvgMethod(name="FedAvg (IID)")
        exp_ref = ExperimentConfig.model_validate({
            **exp.model_dump(exclude={"methods", "sweep", "plugins", "serving"}),  # a reference serves no plan
            "federation": {**exp.federation.model_dump(), "partition": "iid", "unseen_sites": 0, "split_sources": {},
                           "holdout_sources": [], "holdout_sites": {}}, "methods": [iid.model_dump()]})
        log(f"[seed {seed}] reference: FedAvg on an IID federation ...")
        try:
            doc = run_and_release(job_spec(exp_ref, exp_ref.methods[0], seed), iid_dir, work / "iid_fedavg", len(sites),
                                  log=log)
            rr = rows_from_metrics("FedAvg (IID federation)", seed, doc, kind="reference")
            rows += rr
            log(f"    FedAvg (IID): final test accuracy {_pct(rr[-1].get('accuracy'))} (site mean)")
        except RunError as e:
            log(f"    IID FedAvg reference {e.status}: {e.reason}")
    (work / "run.json").write_text(json.dumps({"fingerprint": fp, "status": "finished", "rows": rows}))
    return rows


def _fallback_run(exp, seed: int, out: Path) -> str | None:
    """The global model a new site is served when its cluster cannot serve it (``Onboard.guard``): the serving plan's
    reference run at ``seed``, else the first finished run of a method without clusters that saved one."""
    order = ([exp.serving.reference] if exp.serving is not None else []) + \
        [m.name for m in exp.methods if not type(m).clustered]
    for name in order:
        d = run_dir(out, seed, name)
        if _load_saved(d / "run.json").get("status") == "finished" and (d / "server" / "models" / "global.pt").is_file():
            return str((d / "server").resolve())
    return None


def _unseen(exp, m, seed, data_dir, work, doc, meta, log) -> list[dict]:
    from fedmed.algorithms.clustering import known_association, partition_ari  # scipy: only when a run needs it

    assign = training_assignment(doc, m, work / "server")
    groups = meta.get("groups")  # known only for ANDA federations
    ari = partition_ari(assign, groups) if groups and type(m).clustered else None
    known = known_association(groups, assign, meta["unseen_sites"]) if groups and type(m).clustered else {}
    test = {"training_result": str((work / "server").resolve()), "known_clusters": known, "references": True,
            "require_clusters": False,  # every cluster model scored as a reference; a method without clusters: global
            "min_cluster_images": getattr(m, "min_cluster_images", 0) or 0,
            "global_result": _fallback_run(exp, seed, work.parent.parent.parent) if type(m).clustered else None}
    tdoc = run_and_release(job_spec(exp, m, seed, sites=meta["unseen_sites"], onboard=test), data_dir,
                           work / "test_phase", len(meta["unseen_sites"]), log=lambda *_: None)
    rows = []
    for r in tdoc["rounds"]:
        phase = {"test_phase": "test phase", "known_association": "known assoc.", "ensemble": "ensemble"}.get(
            r["task"], r["task"].replace("cluster", "cluster model "))
        rows.append({"method": m.name, "kind": "method", "seed": seed, "round": doc["rounds"][-1]["round"], "phase": phase,
                     "ari": ari, **{k: r["summary"]["mean"].get(k) for k in CLS_METRICS},
                     **{f"pooled_{k}": (r["summary"].get("pooled") or {}).get(k) for k in CLS_METRICS}})
    refs = [r for r in tdoc["rounds"] if r["task"].startswith("cluster")]
    if refs:  # per unseen site its best cluster model (an oracle reference: known only with the site's test labels)
        best = {s: max(r["sites"][s]["accuracy"] for r in refs if r["sites"].get(s, {}).get("accuracy") is not None)
                for s in refs[0]["sites"] if any(r["sites"].get(s, {}).get("accuracy") is not None for r in refs)}
        if best:
            rows.append({"method": m.name, "kind": "method", "seed": seed, "round": doc["rounds"][-1]["round"],
                         "phase": "oracle", "ari": ari, "accuracy": float(np.mean(list(best.values())))})
    log((f"    clustering ARI vs true groups {ari:.2f}; " if ari is not None else "    ") + "unseen sites: " + ", ".join(
        f"{r['task']} accuracy {_pct(r['summary']['mean'].get('accuracy'))}" for r in tdoc["rounds"]))
    return rows


def _checkpoint_round(server: Path):
    try:
        return json.loads((server / "checkpoint" / "state.json").read_text())["next_round"]
    except (OSError, ValueError, KeyError):
        return "?"


def _pct(v) -> str:
    """A score for the console: a percentage, or "withheld" when no site could send it (every test split below
    k_min) or it is undefined."""
    import math

    return f"{100 * v:.2f}%" if isinstance(v, (int, float)) and math.isfinite(v) else "withheld"


def _log_done(m, doc, new, selection, log, work):
    from fedmed.report.summary import reported_rows

    runs = [r for r in new if not r.get("phase") and r.get("kind") == "method"]
    errs = len(doc.get("errors", []))
    if not runs:  # an assessment-only job
        a = doc.get("assessment", {})
        log(f"    done in {doc.get('wall_seconds', 0):.0f} s: " + "; ".join(
            f"{k.upper()} most distant {v.get('most_distant')}, clusters {v.get('clusters')}"
            for k, v in a.items() if isinstance(v, dict) and "most_distant" in v)
            + f" (report: {work / 'server' / 'assessment'})")
        return
    row = next(iter(reported_rows(runs, selection).values()))
    key = "dice_mean" if row.get("dice_mean") is not None else "accuracy"
    label = {"final": "final", "validation": "validation-selected"}.get(selection, "validation-AUC-selected")
    log(f"    done in {doc.get('wall_seconds', 0):.0f} s: {label} round {row['round']}: test {key} "
        f"{_pct(row.get(key))} (site mean)" + (f", pooled {_pct(row['pooled_accuracy'])}"
                                               if row.get("pooled_accuracy") is not None else "")
        + (f"; {errs} site error(s), see metrics.json" if errs else ""))
    for key, st in sorted((doc.get("stop") or {}).items()):  # why and when it stopped (#85)
        log(f"    {key}: {st.get('why')}")


def _command(config_path, overrides, out_dir=None, methods=None) -> str:
    """The command that reruns exactly this experiment (its output folder, its methods, its overrides), quoted for a
    shell; ``--resume`` is left out (it reuses runs, it does not change them)."""
    import shlex

    import os

    words = ["fedmed", "experiment", str(config_path)]
    if out_dir is not None:  # the experimenter's own output folder, named so that the line runs (never ".../name")
        shown = shown_path(out_dir)
        words += ["--out", shown if not shown.startswith(".../") else os.path.relpath(Path(out_dir).resolve())]
    if methods:
        words += ["--methods", *methods]
    for o in overrides or []:
        words += ["--set", o]
    return " ".join(shlex.quote(w) for w in words)
