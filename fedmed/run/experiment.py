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

import contextlib
import hashlib
import json
import os
from pathlib import Path

import numpy as np

from fedmed.config import ExperimentConfig
from fedmed.core.errors import FedmedError
from fedmed.core.io import shown_path
from fedmed.core.resources import project_root
from fedmed.methods import clustering_workflows
from fedmed.report.record import missing_sentence
from fedmed.report.summary import read_results, rows_from_metrics, sweep_stats, sweep_table, write_outputs  # noqa: F401 (re-exported)
from fedmed.run.federation import check_classes, classes_override, prepare_federation, with_classes  # noqa: F401
from fedmed.run.fingerprint import run_fingerprint, run_fingerprints, same_run
from fedmed.run.followups import Onboarding, ServingPlan
from fedmed.run.jobs import IN_PROCESS, RunError, mlflow_ui_command, run_and_release, stage_resume, training_assignment
from fedmed.run.jobspec import BuildError, check_method_files, job_spec
from fedmed.run.records import add_clusters, add_pooled_val_auc, checkpoint_round, load_saved, log_done, pct

__all__ = ["ExperimentError", "PLAN_GLOBAL", "PLAN_METHOD", "REPO_ROOT", "check_classes", "classes_override",
           "prepare_federation", "run_dir", "run_experiment", "with_classes"]

REPO_ROOT = project_root()  # app_configs/: the clone's or the installed package's (fedmed.core.resources)
CLS_METRICS = ("accuracy", "macro_f1", "auc")


class ExperimentError(FedmedError, RuntimeError):
    """Some runs of an experiment did not finish; the message lists them with their reasons."""



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
    from fedmed.data.datalists import patients_of
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
    token = IN_PROCESS.set(bool(in_process))
    try:
        with output_lock(Path(out_dir)), _site_cache_in(Path(out_dir) / "cache"):
            return _run_experiment(config_path, out_dir, overrides=overrides, methods=methods, log=log, resume=resume,
                                   command=command)
    finally:
        IN_PROCESS.reset(token)


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
    exp = _trackers_kept_in(exp, out, log)
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
            head = f"[{k}/{total}] seed {seed} {m.name}"
            saved, resume_from = _saved_run(exp, m, seed, work, meta, resume, log, head)
            if saved is not None:  # finished earlier with the same settings
                rows.extend(saved["rows"])
                if saved.get("sites_missing"):
                    missing.append(f"seed {seed} {m.name}: {missing_sentence(saved['sites_missing'])}")
                    log(f"    {missing_sentence(saved['sites_missing'])}")
                continue
            log(f"{head} ({m.workflow}, {exp.train.rounds} rounds) ...")
            doc = _train(exp_s, m, seed, data_dir, work, meta, resume_from, fp, problems, log)
            if doc is None:
                continue
            new, clusters = _run_rows(exp, m, seed, doc, data_dir, meta)
            if meta.get("unseen_sites") and type(m).onboards:
                new += _unseen(exp_s, m, seed, data_dir, work, doc, meta, log)
            rows.extend(new)
            log_done(m, doc, new, exp.selection, log, work)
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


def _trackers_kept_in(exp, out: Path, log):
    """The experiment's MLflow store and W&B runs kept with its outputs, where the config names no place of its own."""
    if exp.tracking.mlflow and not exp.tracking.mlflow_uri:  # one store for the experiment's runs, kept with its outputs
        exp = exp.model_copy(update={"tracking": exp.tracking.model_copy(
            update={"mlflow_uri": (out / "mlruns").resolve().as_uri()})})
        log(f"MLflow: every run of this experiment in {out / 'mlruns'}; to view them: {mlflow_ui_command(out)}")
    if exp.tracking.wandb and not exp.tracking.wandb_dir:  # the experiment's W&B runs, kept with its outputs
        exp = exp.model_copy(update={"tracking": exp.tracking.model_copy(
            update={"wandb_dir": str((out / "wandb").resolve())})})
        log(f"W&B ({exp.tracking.wandb_mode}): every run of this experiment in {out / 'wandb'}"
            + (" (wandb sync DIR/offline-run-* to upload)" if exp.tracking.wandb_mode == "offline" else ""))
    return exp


def _train(exp_s, m, seed: int, data_dir: Path, work: Path, meta: dict, resume_from, fp: str, problems: list,
           log) -> dict | None:
    """One run of (``m``, ``seed``) (continued from ``resume_from`` when given): its record, or None when it did not
    finish — said in ``problems``, the log and its ``run.json``. A job that cannot be built stops the experiment."""
    try:
        staged = stage_resume(resume_from, work)
        return run_and_release(job_spec(exp_s, m, seed, resume_from=staged, files_checked=True), data_dir, work,
                               len(meta["sites"]), log=log)
    except BuildError as e:
        raise ExperimentError(f"seed {seed} {m.name}: the job could not be built: {e}") from None
    except RunError as e:
        work.mkdir(parents=True, exist_ok=True)
        (work / "run.json").write_text(json.dumps({"fingerprint": fp, "method": m.name, "seed": seed,
                                                   "status": e.status, "reason": e.reason, "rows": []}))
        problems.append(f"seed {seed} {m.name}: {e.status}: {e.reason}")
        log(f"    {e.status}: {e.reason}")
        return None


def _saved_run(exp, m, seed: int, work: Path, meta: dict, resume: bool, log, head: str):
    """Under ``--resume``, what an earlier run of (``m``, ``seed``) leaves: (its saved record when it finished with the
    same settings — brought up to today's fields —, else None; the server folder to continue from when it stopped
    with a checkpoint, else None). A run to do again has its old ``run.json`` removed."""
    seg = exp.dataset.task == "segmentation"
    saved = load_saved(work / "run.json")
    resume_from = None
    if resume and same_run(saved.get("fingerprint"), exp, m, seed):
        if saved.get("status") == "finished":
            if m.workflow in clustering_workflows() and not seg and "clusters" not in saved:
                add_clusters(saved, work, meta)  # a run recorded before K / ARI were rows' fields
                (work / "run.json").write_text(json.dumps(saved))
            if not seg and add_pooled_val_auc(saved, work):  # recorded before rows carried it
                (work / "run.json").write_text(json.dumps(saved))
            log(f"{head}: finished earlier with the same settings, reused")
            return saved, None
        if (work / "server" / "checkpoint" / "state.json").is_file():  # stopped, or failed (a killed server)
            resume_from = work / "server"
            log(f"{head}: {saved.get('status', 'stopped')} earlier; resuming from its checkpoint (round "
                f"{checkpoint_round(resume_from)})")
    elif resume and saved:
        log(f"{head}: earlier run made with other settings, running again")
    (work / "run.json").unlink(missing_ok=True)
    return None, resume_from


def _run_rows(exp, m, seed: int, doc: dict, data_dir: Path, meta: dict) -> tuple[list[dict], list | None]:
    """A finished run's rows (with its number of clusters, their ARI against the known groups and the cluster-majority
    reference for a clustered classifier) and its clusters (None for one model)."""
    from fedmed.algorithms.clustering import clusters_ari

    new = rows_from_metrics(m.name, seed, doc)
    if m.workflow not in clustering_workflows() or exp.dataset.task == "segmentation":
        return new, None
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
    return new, clusters


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
    saved = load_saved(work / "run.json")
    if resume and saved.get("fingerprint") == fp and saved.get("status") == "finished":
        log(f"seed {seed} serving plan: finished earlier with the same runs, reused")
        return saved["rows"]
    missing = [n for n in involved if load_saved(run_dir(out, seed, n) / "run.json").get("status") != "finished"]
    if missing:
        problems.append(f"seed {seed} serving plan: not run: {', '.join(missing)} did not finish at this seed")
        log(f"    seed {seed} serving plan: not run ({', '.join(missing)} did not finish)")
        return []
    plan = ServingPlan(run_dir(out, seed, sv.reference) / "server",
                       {candidate_name(n): run_dir(out, seed, n) / "server" for n in sv.candidates if n != "local"},
                       sv.finetune.model_dump() if sv.finetune is not None else None, "local" in sv.candidates,
                       pool=sv.pool, test=sv.test)
    log(f"seed {seed} serving plan: the global model of {sv.reference} against "
        f"{', '.join([c if c != 'local' else 'each site its own model' for c in sv.candidates] + (['fine-tuned at each site'] if sv.finetune else []))} ...")
    (work / "run.json").unlink(missing_ok=True)
    try:
        doc = run_and_release(job_spec(exp, by_name[sv.reference], seed, follows=plan, files_checked=True), data_dir,
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


def _references(exp, seed, data_dir, out, chosen, log, resume, seg) -> list[dict]:
    """Reference rows of one seed (reused under --resume when the config fingerprint matches). In-process
    (``--in-process``) they train at the sites' torch thread count (:data:`~fedmed.workflows.inprocess.SITE_THREADS`),
    as the jobs do: several in-process experiments on one machine then share its cores instead of each taking them
    all."""
    if not IN_PROCESS.get():
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
    saved = load_saved(work / "run.json")
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
            log(f"    FedAvg (IID): final test accuracy {pct(rr[-1].get('accuracy'))} (site mean)")
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
        if load_saved(d / "run.json").get("status") == "finished" and (d / "server" / "models" / "global.pt").is_file():
            return str((d / "server").resolve())
    return None


def _unseen(exp, m, seed, data_dir, work, doc, meta, log) -> list[dict]:
    from fedmed.algorithms.clustering import known_association, partition_ari  # scipy: only when a run needs it

    assign = training_assignment(doc, m, work / "server")
    groups = meta.get("groups")  # known only for ANDA federations
    ari = partition_ari(assign, groups) if groups and type(m).clustered else None
    known = known_association(groups, assign, meta["unseen_sites"]) if groups and type(m).clustered else {}
    test = Onboarding(str((work / "server").resolve()), known, references=True,
                      require_clusters=False,  # every cluster model scored as a reference; without clusters: global
                      min_cluster_images=getattr(m, "min_cluster_images", 0) or 0,
                      global_result=_fallback_run(exp, seed, work.parent.parent.parent) if type(m).clustered else None)
    tdoc = run_and_release(job_spec(exp, m, seed, sites=meta["unseen_sites"], follows=test), data_dir,
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
        f"{r['task']} accuracy {pct(r['summary']['mean'].get('accuracy'))}" for r in tdoc["rounds"]))
    return rows


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
