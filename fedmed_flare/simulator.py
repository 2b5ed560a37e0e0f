"""NVFlare's simulator, with site worker ports taken outside the OS's ephemeral port range.

    python -m fedmed_flare.simulator JOB_FOLDER -w WORKSPACE -c site-a,site-b -t 2

FLARE 2.9's simulator gives each site worker a port from ``get_open_ports`` (bind to port 0, read it, close it)
and the worker binds it a moment later. Port 0 hands out *ephemeral* ports, the same range the OS uses for
outgoing connections — and ten site workers and the server open outgoing connections at exactly that moment.
When one of them takes the port first, the worker dies with ``OSError: [Errno 98] Address already in use``, the
simulator drops that site for the whole run, and the server waits for its tasks until they time out (seen in
``results/noshift_pneumonia``: a 10-site run hung in round 0). Here a worker's port is drawn from below the
ephemeral range (which outgoing connections never use), is checked free by binding it, and is never handed out
twice by this process.

Start-up: FLARE starts each site worker as a fresh interpreter (``python -m ...simulator_worker``), so every site
imports torch, NVFlare and fedmed again — ~3 s of CPU and ~250 MB of private memory per site, which on 2 cores
is most of a small run's wall time. Here the same worker module runs in a process forked from a template process
(Python's ``forkserver``) that imported those modules once: the worker code and its arguments, environment,
session and working directory are FLARE's; the imported libraries' pages are shared copy-on-write between the
sites. ``fedmed_flare.run`` starts that template before it builds the job and forks this simulator itself from it
(``ForkedWorker(..., simulator=True)``), so neither the simulator nor FLARE's server process, which FLARE forks from
it, imports NVFlare and torch again. ``FEDMED_SIM_FORK=0`` launches the simulator and its workers exactly as FLARE
does (``benchmarks/bench_memory.py --plain`` compares both); ``FEDMED_SIM_PRELOAD`` (comma-separated modules)
replaces the list the template imports.
Under load (a hundred sites on two cores) a new worker may take more than FLARE's 60 s to start listening: the
simulator here waits :data:`CONNECT_TIMEOUT_S` for it (:func:`patient_connection`).
Everything else is NVFlare's own ``simulator`` entry point, unchanged.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import threading
import types

_LOCK = threading.Lock()
_GIVEN: set[int] = set()
_RNG = random.SystemRandom()  # not experiment randomness: only which free port a worker listens on


def ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = (int(v) for v in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def open_ports(number: int) -> list[int]:
    """``number`` free TCP ports below the ephemeral range, none given out before by this process."""
    lo, _ = ephemeral_range()
    low = 10000
    if lo - low < 1000:  # an unusual ephemeral range: fall back to FLARE's own choice
        from nvflare.fuel.utils.network_utils import get_open_ports

        return get_open_ports(number)
    out: list[int] = []
    with _LOCK:
        for _ in range(100 * number):
            if len(out) == number:
                break
            p = _RNG.randrange(low, lo)
            if p in _GIVEN:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind(("localhost", p))
                except OSError:
                    continue
            _GIVEN.add(p)
            out.append(p)
    if len(out) < number:
        raise RuntimeError(f"no free port below {lo} for a simulator site worker")
    return out


WORKER_MODULE = "nvflare.private.fed.app.simulator.simulator_worker"
TEMPLATE_ENV = "FEDMED_SIM_TEMPLATE"  # {"pid", "fd", "address"} of a template started by fedmed_flare.run
PRELOAD = ["numpy", "torch", "torch._dynamo", "torch.optim", WORKER_MODULE, "nvflare.private.fed.app.simulator.simulator",
           "nvflare.private.fed.app.simulator.simulator_runner", "fedmed_flare.executor", "fedmed_flare.controller",
           "PIL.Image", "fedmed.site.runner", "fedmed.site.reply", "fedmed.nn.train",
           "fedmed.nn.models", "fedmed.algorithms.metrics", "fedmed.data.images",
           # what a site worker still imported after the fork (FLARE's driver scan imports every f3 driver, with
           # aiohttp, gRPC and protobuf: ~0.6 s of CPU per site; measured by diffing sys.modules in a worker)
           "nvflare.fuel.f3.drivers.aio_http_driver", "nvflare.fuel.f3.drivers.aio_grpc_driver",
           "nvflare.fuel.f3.drivers.grpc_driver", "nvflare.fuel.f3.drivers.aio_tcp_driver",
           "nvflare.fuel.f3.drivers.tcp_driver", "nvflare.fuel.f3.drivers.file_driver", "nvflare.fuel.f3.comm_config_utils",
           "nvflare.app_common.widgets.convert_to_fed_event",
           "nvflare.fuel.utils.fobs.decomposers.core_decomposers", "PIL.PngImagePlugin", "numpy.ma", "fedmed.core.memtrace"]


def preload_list(extra=()) -> list[str]:
    """What the site template imports before it forks the server and the sites: ``FEDMED_SIM_PRELOAD`` or
    :data:`PRELOAD`, then ``extra`` (the job's: MONAI where its network needs it)."""
    env = os.environ.get("FEDMED_SIM_PRELOAD")
    mods = [m for m in env.split(",") if m] if env is not None else list(PRELOAD)
    mods += [m for m in extra if m not in mods]
    return mods + ["fedmed_flare._fork_template"]  # last: gc.freeze() (fedmed_flare/_fork_template.py)


def capped_time(cap: float) -> types.ModuleType:
    """``time`` as a FLARE module sees it, with every ``sleep`` (all of them are polls) at most ``cap`` seconds."""
    import time

    shim = types.ModuleType("time")
    shim.__dict__.update({k: v for k, v in vars(time).items() if not k.startswith("__")})
    shim.sleep = lambda s: time.sleep(min(float(s), cap))
    return shim


LISTENER_WAIT_S = 0.1  # FLARE's connector manager sleeps 0.5 s after it starts a dynamic listener ("kludge ... race")


def short_listener_wait() -> None:
    """FLARE sleeps 0.5 s after starting each process's internal listener, in the server and in every site worker,
    so that nothing connects before the listener is up. Here :data:`LISTENER_WAIT_S`: a connection that still came
    too early fails and FLARE's connector retries it (``conn_manager.start_connector_task``), so the wait only
    trades a rare retry against 0.4 s on every start. That module's only sleep is this one."""
    from nvflare.fuel.f3.cellnet import connector_manager

    connector_manager.time = capped_time(LISTENER_WAIT_S)


RUNNER_POLL_S = 0.1  # simulator_runner polls at 1 s: server started?, first launch of a site, worker listening?
# FLARE's simulator gives up on a site after 60 s without reaching its new worker process, and leaves the worker
# waiting for that connection: the server then waits task_timeout for the site's answers. With 100 site processes
# busy on 2 cores (FMCL's encoders at the signature task), four workers took longer than that to start listening
# (a 100-site run, FLARE's "Failed to create connection to the child process ... timeout: 60.0").
CONNECT_TIMEOUT_S = 600.0


def patient_connection(runner_cls) -> None:
    """``SimulatorClientRunner._create_connection`` waits :data:`CONNECT_TIMEOUT_S` for a worker (FLARE: 60 s)."""
    original = runner_cls._create_connection
    if getattr(original, "_fedmed_patient", False):
        return

    def _create_connection(self, open_port, timeout=CONNECT_TIMEOUT_S):
        return original(self, open_port, timeout=max(float(timeout), CONNECT_TIMEOUT_S))

    _create_connection._fedmed_patient = True
    runner_cls._create_connection = _create_connection
WORKER_POLL_S = 0.05  # simulator_worker re-asks the server for a task every 0.5 s (a site idles ~0.25 s a round)


def _as_popen_child(env: dict) -> None:
    """In a process forked from the template: the new session and environment ``Popen(..., preexec_fn=os.setsid,
    env=ENV)`` would give it, ``PYTHONPATH``'s folders included — **after** everything installed (an app's
    ``custom/`` among them: a hand-edited job folder's ``scipy/`` must not shadow the installed one,
    :func:`fedmed.core.plugins.add_code_folder`'s rule); the working directory is the launching process's already
    (multiprocessing's spawn preparation sets it)."""
    from fedmed.core.plugins import add_code_folder

    os.setsid()
    os.environ.clear()
    os.environ.update(env)
    for p in [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]:
        add_code_folder(p)


def _run_worker(module: str, argv: list[str], env: dict) -> None:
    """In the forked child: what ``Popen(python -m simulator_worker ARGV, preexec_fn=os.setsid, env=ENV)`` does —
    the worker module's ``__main__`` block (parse its arguments, ``mpm.run(main)``), its polls capped at
    :data:`WORKER_POLL_S`."""
    import importlib

    _as_popen_child(env)
    sys.argv = [module] + list(argv)
    worker = importlib.import_module(module)
    worker.time = capped_time(WORKER_POLL_S)
    if module == WORKER_MODULE:
        short_listener_wait()
    from nvflare.fuel.f3.mpm import MainProcessMonitor as mpm

    args = worker.parse_arguments()
    mpm.run(main_func=worker.main, run_dir=args.workspace, args=args)


def _run_simulator(argv: list[str], env: dict) -> None:
    """In a process forked from the template by ``fedmed_flare.run``: what ``Popen([python, -m,
    fedmed_flare.simulator, *ARGV], preexec_fn=os.setsid, env=ENV)`` does, without importing NVFlare's simulator again — and without the ~2 s of CPU
    FLARE's server process (forked from this one) spends importing torch for the initial model and checkpoints."""
    import multiprocessing

    _as_popen_child(env)
    sys.argv = [os.path.abspath(__file__)] + list(argv)
    # FLARE's Manager and server process fork from this one, as in a fresh interpreter on Linux; multiprocessing
    # hands a forkserver child its parent's start method, and a forkserver-started server would re-import all and run
    # without this module's changes to FLARE (its sites then start as fresh interpreters)
    multiprocessing.set_start_method("fork", force=True)
    sys.exit(main(list(argv)))


class ForkedWorker:
    """The part of ``subprocess.Popen`` FLARE's simulator uses (pid, poll, wait, terminate, kill, returncode)."""

    _ctx = None
    _ctx_lock = threading.Lock()

    @classmethod
    def context(cls, extra=()):
        """The forkserver context; ``extra``: modules the template also preloads (when this call creates it)."""
        with cls._ctx_lock:
            if cls._ctx is None:
                import multiprocessing

                ctx = multiprocessing.get_context("forkserver")
                ctx.set_forkserver_preload(preload_list(extra))
                cls._ctx = ctx
            return cls._ctx

    _adopted: int | None = None  # pid of a template fedmed_flare.run started (not this process's child)

    @classmethod
    def early_start(cls, extra=()) -> tuple[dict, list[int]]:
        """In ``fedmed_flare.run``, before it imports NVFlare and builds the job: start the template there, so its imports
        (torch, NVFlare: ~4 s of CPU) overlap the job building and the simulator's start instead of following them.
        Returns the environment entry and the template's pipe end: a simulator forked from the template (what
        ``fedmed_flare.run`` does) gets that pipe end at the fork; one started otherwise must inherit the descriptor."""
        from multiprocessing import forkserver

        cls.context(extra)
        cls.warm()
        fs = forkserver._forkserver
        spec = {"pid": fs._forkserver_pid, "fd": fs._forkserver_alive_fd, "address": fs._forkserver_address}
        return {TEMPLATE_ENV: json.dumps(spec)}, [fs._forkserver_alive_fd]

    @classmethod
    def _adopt(cls) -> bool:
        """Use the template named by ``FEDMED_SIM_TEMPLATE`` (started by ``fedmed_flare.run``, our grandparent): its pid,
        the write end of its "alive" pipe (inherited) and its socket address. False when there is none or it is gone
        (then this process starts its own)."""
        from multiprocessing import forkserver, resource_tracker

        spec = os.environ.get(TEMPLATE_ENV)
        fs = forkserver._forkserver
        if cls._adopted is not None or not spec:
            return cls._adopted is not None and fs._forkserver_pid == cls._adopted
        try:
            d = json.loads(spec)
            os.kill(int(d["pid"]), 0)
            if fs.get_inherited_fds() is None:
                os.fstat(int(d["fd"]))
        except (ValueError, KeyError, TypeError, OSError):
            return False
        with fs._lock:
            if fs._forkserver_pid is not None:
                return False
            # forked by that template itself (fedmed_flare.run launches the simulator so): the template handed this process
            # its own copy of the pipe end at the fork, under another number
            forked = fs.get_inherited_fds() is not None and fs._forkserver_alive_fd is not None
            fd = fs._forkserver_alive_fd if forked else int(d["fd"])
            fs._forkserver_pid, fs._forkserver_alive_fd, fs._forkserver_address = int(d["pid"]), fd, d["address"]
            cls._adopted = int(d["pid"])
        own = fs.ensure_running

        def ensure_running():  # the stdlib's would waitpid() a process that is not our child
            if fs._forkserver_pid is not None and fs._forkserver_pid == cls._adopted:
                resource_tracker.ensure_running()
                try:
                    os.kill(cls._adopted, 0)
                    return
                except OSError:  # gone: forget it and start our own
                    with fs._lock:
                        os.close(fs._forkserver_alive_fd)
                        fs._forkserver_pid = fs._forkserver_alive_fd = fs._forkserver_address = None
            return own()

        fs.ensure_running = ensure_running
        return True

    @classmethod
    def warm(cls) -> None:
        """Start the template now (it imports while the server starts), not at the first site's launch — or adopt the
        one ``fedmed_flare.run`` started."""
        from multiprocessing import forkserver

        cls.context()
        if cls._adopt():
            return
        # Python 3.11's forkserver ignores the parent's sys.path (its main() takes sys_path and drops it) and skips a
        # preload module it cannot import without a word: put the folder holding fedmed_flare and fedmed (a clone's
        # root, or site-packages) on the template's path through its environment, for the template only
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        old = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join([here] + ([old] if old else []))
        try:
            forkserver.ensure_running()
        finally:
            if old is None:
                os.environ.pop("PYTHONPATH", None)
            else:
                os.environ["PYTHONPATH"] = old

    @classmethod
    def stop(cls, kill: bool = False) -> None:
        """Stop the template process (it would otherwise outlive the run); ``kill``: without letting it finish its
        imports first (a job that failed to build)."""
        if cls._ctx is not None:
            from multiprocessing import forkserver

            fs = forkserver._forkserver
            if cls._adopted is not None and fs._forkserver_pid == cls._adopted:
                with fs._lock:  # not ours to wait for: drop our end of its pipe; it ends when the runner drops its end
                    os.close(fs._forkserver_alive_fd)
                    fs._forkserver_pid = fs._forkserver_alive_fd = fs._forkserver_address = None
                cls._adopted = None
            else:
                if kill and fs._forkserver_pid is not None:
                    try:
                        os.kill(fs._forkserver_pid, 9)
                    except OSError:
                        pass
                try:
                    fs._stop()
                except Exception:  # already gone
                    pass
            cls._ctx = None  # a later run starts a new template (with the preload list of its time)

    def __init__(self, argv: list[str], env: dict, module: str = WORKER_MODULE, simulator: bool = False):
        """A site worker running ``module`` with ``argv``; ``simulator``: this file's simulator itself (``argv`` are
        its arguments), as ``fedmed_flare.run`` launches it."""
        self.args = argv
        self.warm()  # the template, started with its path (a no-op once it runs)
        target, args = (_run_simulator, (argv, env)) if simulator else (_run_worker, (module, argv, env))
        self._p = self.context().Process(target=target, args=args, daemon=False)
        self._p.start()
        self.pid = self._p.pid
        self.returncode = None

    def poll(self):
        if self.returncode is None and not self._p.is_alive():
            self.returncode = self._p.exitcode
        return self.returncode

    def wait(self, timeout=None):
        self._p.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def terminate(self):
        self._p.terminate()

    def kill(self):
        self._p.kill()


DEAD_SITES_ENV = "FEDMED_DEAD_SITES"  # folder where the simulator notes each site worker that died (one file a site)


def note_dead_site(site: str, returncode) -> None:
    """Write ``<FEDMED_DEAD_SITES>/<site>.json``: the workflow (fedmed_flare/controller.py) stops waiting for that site."""
    folder = os.environ.get(DEAD_SITES_ENV)
    if not folder or not site:
        return
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{site}.tmp")
    with open(tmp, "w") as fh:
        json.dump({"site": site, "returncode": returncode}, fh)
    os.replace(tmp, os.path.join(folder, f"{site}.json"))


class WatchedWorker:
    """A site worker's process (``Popen`` or :class:`ForkedWorker`) as FLARE's simulator sees it, which notes its site
    as dead (:func:`note_dead_site`) when the process ended by itself with a non-zero code — killed, crashed, out of
    memory. FLARE's simulator then ends that site's thread and never tells its server: a workflow would wait for the
    site's answer until ``task_timeout``. A worker FLARE stops itself (``terminate``: exit code -15, or ``kill``) is
    not noted; FLARE often calls ``terminate`` on a worker that has already died, before its exit code is known, so
    the code decides: -9 after a ``terminate`` was not FLARE's doing."""

    def __init__(self, proc, site: str):
        self._proc, self.site, self._terminated, self._killed, self._noted = proc, site, False, False, False
        self.pid, self.args = proc.pid, getattr(proc, "args", None)

    @property
    def returncode(self):
        return self._proc.returncode

    def _check(self, rc):
        import signal

        ours = self._killed or (self._terminated and rc == -signal.SIGTERM)
        if rc is not None and rc != 0 and not ours and not self._noted:
            self._noted = True
            note_dead_site(self.site, rc)
        return rc

    def poll(self):
        return self._check(self._proc.poll())

    def wait(self, timeout=None):
        return self._check(self._proc.wait(timeout))

    def terminate(self):
        self._terminated = True
        self._proc.terminate()

    def kill(self):
        self._killed = True
        self._proc.kill()


def _site_of(argv) -> str:
    argv = list(argv)
    return argv[argv.index("--client") + 1] if "--client" in argv[:-1] else ""


def _popen(args, *a, **kw):
    """FLARE's worker command is ``[python, -m, simulator_worker, ...]``: fork it from the template (unless
    ``FEDMED_SIM_FORK=0``) and watch it (:class:`WatchedWorker`); anything else is a plain Popen."""
    if isinstance(args, (list, tuple)) and len(args) > 2 and args[1] == "-m" and args[2] == WORKER_MODULE:
        if os.environ.get("FEDMED_SIM_FORK", "1") != "0":
            proc = ForkedWorker(list(args[3:]), dict(kw.get("env") or os.environ))
        else:
            proc = subprocess.Popen(args, *a, **kw)
        return WatchedWorker(proc, _site_of(args))
    return subprocess.Popen(args, *a, **kw)


def forking_subprocess() -> types.ModuleType:
    """``subprocess`` as FLARE's simulator runner sees it: Popen forks and watches site workers, the rest is
    unchanged."""
    shim = types.ModuleType("subprocess")
    shim.__dict__.update({k: v for k, v in vars(subprocess).items() if not k.startswith("__")})
    shim.Popen = _popen
    return shim


SHUTDOWN_GRACE_S = 0.2  # FLARE's simulator sleeps 3 s here before its clean-up, with the server already off
FED_EVENT_QUIET_S = 0.2  # FLARE's server waits until no fed event has arrived for 2 s, then 2 s more, to end a run
END_RUN_CHECK_S = 0.1  # ... checking every 0.5 s


def quick_end_run() -> None:
    """In the simulator's run process (where the server runs): end a run once the fed-event queue has been quiet for
    :data:`FED_EVENT_QUIET_S` instead of 2 s (checked every :data:`END_RUN_CHECK_S`), and let the event poster's
    END_RUN grace be :data:`FED_EVENT_QUIET_S` instead of 2 s. The server still waits while
    any received fed event (the sites' TensorBoard scalars) is unprocessed; every site has sent its last result,
    and the scalars it sent before it, by the time the workflow ends."""
    from nvflare.widgets import fed_event

    for cls in (fed_event.FedEventRunner, fed_event.ServerFedEventRunner):
        d = list(cls.__init__.__defaults__)  # topic, regular_interval, grace_period, queue_empty_period
        d[-2:] = [FED_EVENT_QUIET_S, FED_EVENT_QUIET_S]
        cls.__init__.__defaults__ = tuple(d)
    os.environ.setdefault("NVFLARE_END_RUN_READINESS_CHECK_INTERVAL", str(END_RUN_CHECK_S))


ENGINE_CHECK_S = 0.1  # FLARE's server checks every 3 s (check_engine_frequency) whether its run's engine stopped


def quick_engine_check() -> None:
    """In the simulator's run process: the server app notices its run ended within :data:`ENGINE_CHECK_S` instead of
    FLARE's 3 s (``FederatedServer.start_run`` sleeps ``check_engine_frequency`` between checks, so every run waited
    1.5 s on average, up to 3 s, after its last round: measured 2.75 s between "Server runner finished" and "Server
    app stopped"). Every sleep of that module is such a poll (registrations every 5 s, heartbeats 0.1 s)."""
    from nvflare.private.fed.server import fed_server

    fed_server.time = capped_time(ENGINE_CHECK_S)


def run_process(self, return_dict):
    """``SimulatorRunner.run_process`` with a shorter shutdown grace time (the rest as FLARE 2.9 has it)."""
    from nvflare.fuel.common.exit_codes import ProcessExitCode
    from nvflare.fuel.f3.mpm import MainProcessMonitor as mpm

    quick_end_run()
    short_listener_wait()
    quick_engine_check()
    try:
        run_status = mpm.run(main_func=self.simulator_run_main, run_dir=self.workspace,
                             shutdown_grace_time=SHUTDOWN_GRACE_S, cleanup_grace_time=6)
    except Exception as e:
        self.logger.error(f"Simulator main run with exception: {e}")
        run_status = ProcessExitCode.EXCEPTION
    return_dict["run_status"] = run_status


def main(argv=None) -> int:
    import argparse

    from nvflare.private.fed.app.simulator import simulator, simulator_runner

    simulator_runner.get_open_ports = open_ports  # worker ports off the ephemeral range
    simulator_runner.time = capped_time(RUNNER_POLL_S)
    simulator_runner.subprocess = forking_subprocess()  # workers forked from a preloaded template, and watched
    patient_connection(simulator_runner.SimulatorClientRunner)  # a busy machine's workers are slow to listen
    parser = argparse.ArgumentParser(description="NVFlare simulator (fedmed: site worker ports off the ephemeral range)")
    simulator.define_simulator_parser(parser)
    args = parser.parse_args(argv)
    # the workflow (in this process's run process) learns here of a site worker that died
    os.environ[DEAD_SITES_ENV] = os.path.join(os.path.abspath(args.workspace), "fedmed_dead_sites")
    if os.environ.get("FEDMED_SIM_FORK", "1") != "0":
        run_main = simulator_runner.SimulatorRunner.simulator_run_main

        def simulator_run_main(self):  # in the simulator's run process: start the template first, stop it last
            ForkedWorker.warm()
            try:
                return run_main(self)
            finally:
                ForkedWorker.stop()

        simulator_runner.SimulatorRunner.simulator_run_main = simulator_run_main
    simulator_runner.SimulatorRunner.run_process = run_process
    return simulator.run_simulator(args)


if __name__ == "__main__":
    sys.exit(main())
