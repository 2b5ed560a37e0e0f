"""Running one job and waiting for it: in FLARE's simulator (a subprocess, its progress a line per round, a killed or
stopped run explained) or in this process; a run that does not finish raises :class:`RunError` with its record."""

from __future__ import annotations

import contextvars
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from fedmed.config import ExperimentConfig
from fedmed.core.errors import FedmedError
from fedmed.run.federation import with_classes
from fedmed.run.jobspec import BuildError, job_spec
from fedmed.site.served import SERVED_DIR


KILLED = (-9, 137, 247)  # SIGKILL as a return code, through a shell, and as the simulator reports it


IN_PROCESS = contextvars.ContextVar("fedmed_experiment_in_process", default=False)  # run_experiment(in_process=True)


class RunError(FedmedError, RuntimeError):
    """A run that did not finish: ``status`` (failed / stopped), ``reason``, and the record so far (``doc``)."""

    def __init__(self, status: str, reason: str, doc: dict | None = None):
        super().__init__(f"run {status}: {reason}")
        self.status, self.reason, self.doc = status, reason, doc or {}


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
    if IN_PROCESS.get():
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
                   sites: list[str] | None = None, follows=None) -> dict:
    """One method of a config (a file, with ``overrides``, or an :class:`ExperimentConfig`) for ``seed`` on the
    federation ``datalists``: its job built here (classes from the federation when the config names none), run by
    :func:`run_job`; ``follows``: a job that follows a finished run instead (``fedmed.run.followups``)."""
    from fedmed.config import load_config
    from fedmed.run.jobspec import select_method

    exp = config if isinstance(config, ExperimentConfig) else load_config(config, overrides)
    natural = exp.federation.partition == "natural" and exp.federation.site_names is None
    if ((exp.dataset.task == "classification" and not exp.dataset.classes) or natural) and \
            (Path(datalists) / "dataset.json").is_file():
        exp = with_classes(exp, Path(datalists))
    try:
        spec = job_spec(exp, select_method(exp, method, str(config)), seed, sites=sites or "config",
                        resume_from=stage_resume(resume_from, Path(work)), follows=follows)
    except BuildError as e:
        raise RunError("failed", f"the job could not be built: {e}") from None
    return run_and_release(spec, datalists, Path(work), n_sites, timeout, log=log)


def stage_resume(resume_from: Path | None, work: Path) -> Path | None:
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
