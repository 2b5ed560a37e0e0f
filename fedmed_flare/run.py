"""Build a method's job and run it with NVFlare 2.9's recipe environments.

    # simulator (SimEnv): one long-lived process per site; sites read FEDMED_DATALIST_DIR/<site>.json and run the
    # default site policy, a policy file (--site-policy FILE), or the experimenter's own (--site-policy simulation)
    python -m fedmed_flare.run --config CONFIG --method NAME --env sim --datalists DIR --workspace WS [--seed 0]
    # a provisioned federation (ProdEnv): submit with the admin's startup kit, wait, download the result
    python -m fedmed_flare.run --config CONFIG --method NAME --env prod --startup-kit ADMIN_KIT --result-dir DIR
    # a new site after training: the onboarding job (--onboard TRAINING_RESULT --sites NEW_SITE), any env

(POC mode: ``poc/run_poc.py``, which also writes each POC site's data setting.) Prints one JSON line
``{"status": ..., "reason": ..., "result": FOLDER}`` last; the exit code is 0 only when the run
finished (its ``metrics.json`` says ``finished``), 1 when it stopped or failed (the reason is printed),
2 for bad input, 3 when the simulator died without a record. ``jobs/run.py`` in a clone and ``fedmed job run`` are
this module's entry points.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

from fedmed_flare.build import BuildError, JobSpec, job_from_spec, job_spec, select_method
from fedmed.run.followups import Onboarding


def recipe_of(job):
    """Wrap a built FedJob as an NVFlare 2.9 Recipe, so it runs in SimEnv / PocEnv / ProdEnv."""
    from nvflare.recipe.spec import Recipe

    class FedmedRecipe(Recipe):
        pass

    return FedmedRecipe(job)


def find_record(root: Path) -> Path | None:
    hits = sorted(Path(root).rglob("fedmed/metrics.json"))
    return hits[0].parent if hits else None


def mark_record(record_dir: Path | None, status: str, reason: str) -> bool:
    """Write ``status`` and ``reason`` into a record the server left at ``running`` (its process was stopped or died
    before it could); the current attempt too. True when the record was changed."""
    if record_dir is None or not (record_dir / "metrics.json").is_file():
        return False
    f = record_dir / "metrics.json"
    try:
        doc = json.loads(f.read_text())
    except (OSError, ValueError):
        return False
    if doc.get("status", "running") != "running":
        return False
    doc["status"], doc["reason"] = status, reason
    if doc.get("attempts"):
        doc["attempts"][-1].update(status=status, reason=reason)
    tmp = f.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(f)
    return True


def outcome(record_dir: Path | None) -> dict:
    if record_dir is None:
        return {"status": "failed", "reason": "the job wrote no fedmed/metrics.json (it never started its workflow; "
                "see the server log)", "result": None}
    mark_record(record_dir, "failed", "the server process ended while the run was still going (killed or crashed)")
    doc = json.loads((record_dir / "metrics.json").read_text())
    res = {"status": doc.get("status", "failed"), "reason": doc.get("reason", ""), "result": str(record_dir)}
    if doc.get("sites_missing"):
        res["sites_missing"] = doc["sites_missing"]
    return res


def wait_forwarding_signals(proc, grace: float = 10.0, on_stop=None) -> int:
    """Wait for the simulator (its own session, as FLARE starts it); on SIGTERM / SIGINT stop its whole process
    group (SIGTERM, SIGKILL after ``grace`` s) instead of leaving it running without us, call ``on_stop(signal
    name)`` (which marks the run's record ``stopped``), then exit 143 / 130."""
    import signal

    def stop(signum, frame):
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue
        if on_stop is not None:
            on_stop(signal.Signals(signum).name)
        raise SystemExit(128 + signum)

    import subprocess

    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return proc.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)


# FLARE 2.9 sends a result's numpy arrays by reference: the server's message callback (a pool of 64 threads,
# nvflare.fuel.f3.streaming.stream_utils.CALLBACK_THREAD_POOL_SIZE) downloads them from the site while holding its
# thread. When more than ~64 sites upload at once every callback thread waits on a download that needs one of them:
# a 100-site simulator run stalled in its 4th round with 64 threads in download_object and no progress (py-spy).
# Above this many sites the arrays travel inside the message (FLARE's own switch: a zero download chunk size).
INLINE_ARRAYS_ABOVE = 32
INLINE_ARRAYS_ENV = "NVFLARE_NP_DOWNLOAD_CHUNK_SIZE"


def inline_arrays_env(n_sites: int) -> dict:
    """The environment that keeps a federation of ``n_sites`` clear of FLARE's callback-pool stall (see above);
    empty for small federations (FLARE's download path, which keeps one copy of a large model for every receiver)."""
    return {INLINE_ARRAYS_ENV: "0"} if n_sites > INLINE_ARRAYS_ABOVE else {}


def simulation_policy(spec: JobSpec, workspace: Path) -> Path:
    """The policy of simulated sites that are the experimenter's own (``--site-policy simulation``, what ``fedmed
    experiment`` runs): the config's ``k_min`` is the floor, the config's modules may run, its encoder weights come
    from a folder of links beside the workspace. Written to ``<workspace>/site_policy.json``."""
    from fedmed.core.policy import SitePolicy

    folder = workspace / "site_weights"
    weights = spec.simulation.get("weights")
    if weights:
        folder.mkdir(parents=True, exist_ok=True)
        link = folder / Path(weights).name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(Path(weights).resolve())
    policy = SitePolicy.simulating(spec.simulation["k_min"], weights_dir=folder if weights else None,
                                   allow_per_image=os.environ.get("FEDMED_ALLOW_PER_IMAGE") == "1")
    return policy.write(workspace / "site_policy.json")


def prog() -> str:
    """The runner as its user started it: ``fedmed job run`` (which says so), else ``jobs/run.py``."""
    return os.environ.get("FEDMED_PROG") or "jobs/run.py"


def sim_env(sites: list[str], workspace: Path, template=None):
    """NVFlare's ``SimEnv`` (one long-lived process per site: ``num_threads = len(sites)``), launching the simulator
    through :mod:`fedmed_flare.simulator` — FLARE's own simulator with site worker ports off the ephemeral range."""
    import subprocess
    import tempfile

    from nvflare.recipe import SimEnv

    class FedmedSimEnv(SimEnv):
        def deploy(self, job):
            workspace_dir = os.path.join(self.workspace_root, job.name)
            from fedmed_flare.kit import allow_fedmed

            (Path(workspace_dir) / "local").mkdir(parents=True, exist_ok=True)
            allow_fedmed(workspace_dir)  # the simulated sites allow fedmed's adapters, as a hospital's kit does
            job.clients = list(self.clients)
            with tempfile.TemporaryDirectory() as root:
                job.export_job(root)
                cmd = [sys.executable, "-m", "fedmed_flare.simulator", os.path.join(root, job.name),
                       "-w", workspace_dir, "-c", ",".join(self.clients), "-n", str(len(self.clients)),
                       "-t", str(self.num_threads)]
                env = {**inline_arrays_env(len(self.clients)), **os.environ}  # a user's own setting wins
                if template is None:
                    proc = subprocess.Popen(cmd, preexec_fn=os.setsid, env=env)
                else:  # forked from the site template started early (fedmed_flare.simulator), which it hands to FLARE
                    from fedmed_flare.simulator import ForkedWorker

                    env.update(template[0])
                    proc = ForkedWorker(cmd[3:], env, simulator=True)
                rc = wait_forwarding_signals(proc, on_stop=lambda sig: mark_record(
                    find_record(Path(workspace_dir) / "server"), "stopped",
                    f"{prog()} received {sig} and stopped the simulator; a --resume continues from the last "
                    f"checkpoint"))
            self.last_run_failed = rc not in (None, 0)
            if self.last_run_failed:
                raise RuntimeError(f"Simulation failed with return code {rc}; logs under {workspace_dir}")
            return job.name

    return FedmedSimEnv(clients=sites, num_threads=len(sites), workspace_root=str(workspace))


class Quiet:
    """FLARE's own output into ``<workspace>/simulator.log``: file descriptors 1 and 2 point there (the simulator's
    processes, forked from a template started first, inherit them) while this process's ``sys.stdout`` and
    ``sys.stderr`` stay on the terminal; :meth:`follow` prints a line per round of the run's record instead."""

    def __init__(self, workspace: Path):
        import threading

        self._made = not workspace.exists()
        workspace.mkdir(parents=True, exist_ok=True)
        self.workspace = workspace
        self.log = workspace.resolve() / "simulator.log"
        self._stop = threading.Event()
        self._thread = None
        sys.stdout.flush()
        sys.stderr.flush()
        self._saved = os.dup(1), os.dup(2)
        self._streams = sys.stdout, sys.stderr
        sys.stdout = os.fdopen(os.dup(self._saved[0]), "w", buffering=1)
        sys.stderr = os.fdopen(os.dup(self._saved[1]), "w", buffering=1)
        fd = os.open(self.log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)

    def follow(self, record_root: Path, rounds: int) -> None:
        """Print a line per round of the record under ``record_root`` until :meth:`close`."""
        import threading

        from fedmed.run.jobs import progress_lines

        t0, out = time.time(), sys.stdout

        def show(seen):
            hits = sorted(Path(record_root).glob("*/fedmed/metrics.json"))
            try:
                doc = json.loads(hits[0].read_text()) if hits else None
            except (OSError, ValueError):
                return seen
            return progress_lines(doc, rounds, t0, seen, lambda ln: print(ln, file=out, flush=True)) if doc else seen

        def loop():
            seen = 0
            while not self._stop.wait(1.0):
                seen = show(seen)
            show(seen)

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()

    def close(self, discard: bool = False) -> None:
        """Back to the terminal; ``discard``: nothing ran (a job that did not build): the log goes, and the
        workspace folder if this made it."""
        if discard:
            self.log.unlink(missing_ok=True)
            if self._made and self.workspace.is_dir() and not any(self.workspace.iterdir()):
                self.workspace.rmdir()
        if self._saved is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        for f in (sys.stdout, sys.stderr):
            f.flush()
        os.dup2(self._saved[0], 1)
        os.dup2(self._saved[1], 2)
        for fd in self._saved:
            os.close(fd)
        sys.stdout.close()
        sys.stderr.close()
        sys.stdout, sys.stderr = self._streams
        self._saved = None


def run_sim(job, sites: list[str], datalists: str | None, workspace: Path, template=None, *,
            quiet: Quiet | None = None, rounds: int = 0) -> dict:
    """Run ``job`` in FLARE's simulator over ``sites``; with ``quiet`` FLARE's lines go to its log and a line per
    round is printed instead."""
    if datalists:
        os.environ["FEDMED_DATALIST_DIR"] = str(Path(datalists).resolve())
    workspace = workspace.resolve()
    if (workspace / job.name).exists():
        shutil.rmtree(workspace / job.name)
    workspace.mkdir(parents=True, exist_ok=True)
    env = sim_env(sites, workspace, template)
    err = None
    if quiet is not None:
        print(f"simulator: {len(sites)} site(s); FLARE's log: {quiet.log} (--verbose prints it)", flush=True)
        quiet.follow(workspace / job.name / "server", rounds)
    try:
        recipe_of(job).run(env)
    except RuntimeError as e:  # the simulator process returned non-zero
        err = str(e)
    if quiet is not None:
        quiet.close()
    res = outcome(find_record(workspace / job.name / "server"))
    if err and res["status"] == "finished":
        dead = sorted(f.stem for f in (workspace / job.name / "fedmed_dead_sites").glob("*.json"))
        if dead and set(dead) <= set(res.get("sites_missing") or {}):
            # FLARE's server exits non-zero at shutdown when a site died while uploading its update (it cannot decode
            # the stream); the workflow had already left that site out and finished every round without it
            res["notes"] = [f"the simulator exited non-zero after the run finished ({err.split(';')[0]}): its server "
                            f"could not decode the last upload of {', '.join(dead)}, whose process died"]
        else:
            res.update(status="failed", reason=f"the simulator failed after the run finished: {err}")
    return res


def admin_name(startup_kit: str) -> str:
    """The admin user of a startup kit (its ``startup/fed_admin.json``)."""
    f = Path(startup_kit) / "startup" / "fed_admin.json"
    if not f.is_file():
        raise BuildError(f"--startup-kit {startup_kit}: not an admin startup kit (no startup/fed_admin.json)")
    return json.loads(f.read_text())["admin"]["username"]


def deploy_refusals(startup_kit: str, job_id: str) -> list[str]:
    """What FLARE's deployment said for each party that did not take the job (its job meta's ``job_deploy_detail``,
    e.g. ``hospital-a: BYOC not permitted`` from a site that runs no custom code)."""
    from nvflare.fuel.flare_api.flare_api import new_secure_session

    try:
        sess = new_secure_session(admin_name(startup_kit), startup_kit, timeout=10.0)
    except Exception:
        return []
    try:
        detail = (sess.get_job_meta(job_id) or {}).get("job_deploy_detail") or []
    except Exception:
        detail = []
    finally:
        sess.close()
    return [" ".join(str(d).split()) for d in detail if not str(d).endswith(": OK")]


def server_address(startup_kit: str) -> str:
    """``host:port`` of the server's admin service, as the admin's startup kit names it."""
    try:
        a = json.loads((Path(startup_kit) / "startup" / "fed_admin.json").read_text())["admin"]
        return f"{a['host']}:{a['port']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "the server named in its startup/fed_admin.json"


def run_prod(job, startup_kit: str, result_dir: Path, timeout: float) -> dict:
    from nvflare.recipe import ProdEnv

    try:
        run = recipe_of(job).run(ProdEnv(startup_kit_location=startup_kit, username=admin_name(startup_kit)))
    except RuntimeError as e:  # FLARE's ProdEnv: "Failed to submit job via Flare API: cannot connect ..."
        cause = str(e).split(": ", 1)[-1].splitlines()[0] if str(e) else type(e).__name__
        return {"status": "failed", "result": None,
                "reason": f"the job was not submitted: {cause} (server {server_address(startup_kit)}, admin kit "
                          f"{Path(startup_kit).name}); is the server started and reachable from here?"}
    print(f"submitted job {run.get_job_id()}", flush=True)
    downloaded = run.get_result(timeout=timeout)
    status = run.get_status()
    if downloaded is None:
        return {"status": "failed", "reason": f"no result within {timeout} s (FLARE status {status})", "result": None}
    target = result_dir / run.get_job_id()
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(downloaded, target)
    record = find_record(target)
    res = outcome(record)
    refused = deploy_refusals(startup_kit, run.get_job_id()) if record is None else []
    if refused:
        res["reason"] = f"FLARE did not deploy the job: {'; '.join(refused)}"
    res["flare_status"] = status
    return res


def main(argv=None) -> int:
    from fedmed.config import ConfigError, load_config

    from fedmed.core.helpformat import HELP

    ap = argparse.ArgumentParser(prog=os.environ.get("FEDMED_PROG") or None, description=__doc__.splitlines()[0],
                                 formatter_class=HELP)
    ap.add_argument("--config", help="experiment config")
    ap.add_argument("--method", help="name of one of the config's methods")
    ap.add_argument("--spec", help="instead of --config/--method/--set/--seed/--sites/--resume-from/--onboard: a job "
                    "spec built in-process by fedmed (fedmed.run.jobspec; what fedmed experiment hands over)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the run")
    ap.add_argument("--set", action="append", default=[], help="config override key.path=value (repeatable)")
    ap.add_argument("--env", choices=["sim", "prod"], default="sim", help="where the job runs")
    ap.add_argument("--datalists", help="sim: folder of the sites' <site>.json datalists")
    ap.add_argument("--workspace", default="workspace", help="sim: simulator workspace root")
    ap.add_argument("--site-policy", help="sim: the simulated sites' policy: a fedmed_policy.json file, "
                    "'simulation' (the experimenter's own sites: the config's k_min, modules and weights; what fedmed "
                    "experiment runs) or 'default' (a site without a policy file: k_min floor 5); default: "
                    "FEDMED_SITE_POLICY, else 'simulation'")
    ap.add_argument("--verbose", action="store_true", help="sim: print FLARE's own log lines (by default they go to "
                    "<workspace>/simulator.log and this prints a line per round)")
    ap.add_argument("--jobs-dir", help="also export the job folder here")
    ap.add_argument("--startup-kit", help="prod: the admin's startup kit folder")
    ap.add_argument("--result-dir", default="results/prod", help="prod: where the downloaded result goes")
    ap.add_argument("--timeout", type=float, default=24 * 3600, help="prod: seconds to wait for the job")
    ap.add_argument("--sites", nargs="+", help="the sites the job runs on (default: the config's)")
    ap.add_argument("--resume-from", help="result of an earlier run of this method: continue from its checkpoint")
    ap.add_argument("--onboard", metavar="TRAINING_RESULT", help="run the onboarding job: the sites (--sites) are each "
                    "given the cluster model of this finished run of the method that fits them")
    ap.add_argument("--known-clusters", default="", help="--onboard: JSON {site: cluster of its true group}")
    ap.add_argument("--references", action="store_true", help="--onboard: also score every cluster model")
    ap.add_argument("--no-labels", action="store_true", help="--onboard: the new sites have no labels (FMCL, PACFL, "
                    "IFCA assign by the served models' predicted classes)")
    ap.add_argument("--unseen", action="store_true", help="--onboard: the unseen-site test phase of fedmed experiment "
                    "(a method without clusters serves its global model)")
    ap.add_argument("--global", dest="global_result", metavar="RUN", help="--onboard: a finished FedAvg-family run "
                    "whose global model a new site is served when its cluster was trained on no site or too few images")
    ap.add_argument("--min-cluster-images", type=int, default=0, help="--onboard: a cluster model trained on fewer "
                    "images never serves a new site (default 0: any trained cluster)")
    a = ap.parse_args(argv)
    a.template = None  # the simulator's site template, started by _main once it knows the job's network
    a.quiet = Quiet(Path(a.workspace)) if a.env == "sim" and not a.verbose else None  # before the template forks
    rc = 2
    try:
        rc = _main(a)
        return rc
    finally:
        if a.template is not None:  # after the simulator ended the template ends too; a job that failed to build
            from fedmed_flare.simulator import ForkedWorker

            ForkedWorker.stop(kill=rc == 2)  # does not wait for the template's imports
        if a.quiet is not None:
            a.quiet.close(discard=rc == 2)


def start_template(a, task_config: dict) -> None:
    """The simulator's site template, started as soon as the job's task config is known: it imports torch and NVFlare
    (~4 s of CPU) while this process builds the job, and MONAI too (~9 s) when the job's network needs it — once,
    instead of in the server and every site after the fork."""
    if a.env != "sim" or a.template is not None or os.environ.get("FEDMED_SIM_FORK", "1") == "0":
        return
    from fedmed.nn.needs import uses_monai  # no torch import here: the template imports it
    from fedmed_flare.simulator import ForkedWorker

    a.template = ForkedWorker.early_start(["monai.networks.nets"] if uses_monai(task_config) else [])


def _spec_of(a) -> JobSpec:
    """The job the command names: a written spec (``--spec``, the whole job), or one built from ``--config`` and
    ``--method`` (an onboarding job with ``--onboard``; the site template started as soon as its task config is)."""
    from fedmed.config import load_config

    if a.spec:
        if a.config or a.method or a.set or a.onboard or a.resume_from or a.sites:
            raise BuildError("--spec is the whole job: it goes without --config, --method, --set, --sites, "
                             "--resume-from and --onboard")
        spec = JobSpec.from_file(a.spec)
    else:
        if not (a.config and a.method):
            raise BuildError("give --config and --method (or --spec)")
        exp = load_config(a.config, a.set)
        method = select_method(exp, a.method, a.config)
        onboard = None
        if a.onboard:
            if not a.sites:
                raise BuildError("--onboard needs --sites: the new sites to onboard")
            onboard = Onboarding(a.onboard, json.loads(a.known_clusters) if a.known_clusters else {},
                                 references=a.references, require_clusters=not a.unseen, labels=not a.no_labels,
                                 min_cluster_images=a.min_cluster_images, global_result=a.global_result)
        spec = job_spec(exp, method, a.seed, sites=a.sites or "config", resume_from=a.resume_from,
                        follows=onboard, task_config_ready=lambda cfg: start_template(a, cfg))
    return spec


def _main(a) -> int:
    from fedmed.config import ConfigError

    try:
        spec = _spec_of(a)
        sites = spec.sites
        start_template(a, spec.task_config)
        job = job_from_spec(spec)
        if a.jobs_dir:
            from fedmed_flare.build import export

            export(job, a.jobs_dir)
        device = os.environ.get("FEDMED_DEVICE") or spec.task_config["train"]["device"]
        if a.env == "sim" and str(device).strip() not in ("auto", "cpu"):  # the simulator runs every site on this
            # machine: a device it lacks fails here, not at round 0 (auto and cpu run anywhere; asking torch about
            # CUDA imports it, ~3 s that the site template would otherwise overlap)
            from fedmed.core.device import DeviceError, resolve_device

            try:
                resolve_device(device, where=", ".join(sites))
            except DeviceError as e:
                raise BuildError(f"{e} (the simulator runs every site on this machine)") from None
        if a.site_policy and a.env != "sim":
            raise BuildError("--site-policy is for the simulator; a real site keeps its own local/fedmed_policy.json")
        if a.env == "sim" and not os.environ.get("FEDMED_CACHE_DIR"):  # the simulated sites' cache: in the workspace
            os.environ["FEDMED_CACHE_DIR"] = str((Path(a.workspace) / "fedmed_cache").resolve())
        if a.env == "sim" and a.site_policy is None and not os.environ.get("FEDMED_SITE_POLICY"):
            a.site_policy = "simulation"  # the same sites as fedmed experiment runs for the same config
        if a.site_policy == "default":
            os.environ.pop("FEDMED_SITE_POLICY", None)
        elif a.site_policy == "simulation":
            Path(a.workspace).mkdir(parents=True, exist_ok=True)
            os.environ["FEDMED_SITE_POLICY"] = str(simulation_policy(spec, Path(a.workspace).resolve()))
        elif a.site_policy:
            from fedmed.core.policy import PolicyError, SitePolicy

            try:
                SitePolicy.from_file(a.site_policy)
            except PolicyError as e:
                raise BuildError(f"--site-policy: {e}") from None
            os.environ["FEDMED_SITE_POLICY"] = str(Path(a.site_policy).resolve())
        if a.env == "prod" and not a.startup_kit:
            raise BuildError("--env prod needs --startup-kit (the admin's startup kit folder)")
        if a.env == "prod":
            admin_name(a.startup_kit)
    except (BuildError, ConfigError, ValueError) as e:
        print(f"{prog()}: error: {e}", file=sys.stderr)
        return 2
    t0 = time.time()
    if a.env == "sim":
        res = run_sim(job, sites, a.datalists, Path(a.workspace), a.template, quiet=a.quiet,
                      rounds=int(spec.rounds))
    else:
        res = run_prod(job, a.startup_kit, Path(a.result_dir), a.timeout)
    res["seconds"] = round(time.time() - t0, 1)
    if res["status"] != "finished" or res.get("sites_missing"):
        print(f"run {res['status']}: {res['reason']}", file=sys.stderr)
    record = Path(res["result"]) / "metrics.json" if res.get("result") else None
    if record is not None and record.is_file():  # an onboarding job: what each new site was given, said here
        from fedmed.workflows.onboard import assignment_lines

        for line in assignment_lines(json.loads(record.read_text())):
            print(f"onboarded {line}", file=sys.stderr)
    print(json.dumps(res))
    if res["result"] is None and a.env == "sim":
        return 3
    return 0 if res["status"] == "finished" else 1


if __name__ == "__main__":
    sys.exit(main())
