"""jobs/: what a built job tells FLARE, and fedmed's simulator launcher (jobs/simulator.py)."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedmed_flare import simulator as sim  # noqa: E402


def _exp(**fed):
    from fedmed.config import load_config

    return load_config({"name": "t", "dataset": {"path": "builtin:digits", "image_size": 8, "channels": 1,
                                                 "classes": [str(c) for c in range(10)]},
                        "federation": {"sites": 2, **fed}, "methods": [{"name": "FedAvg", "workflow": "fedavg"}]})


def test_job_sets_the_task_request_interval_where_flare_reads_it(tmp_path):
    """FLARE 2.9 reads ``server.task_request_interval`` (server_json_config.py); a top-level key is silently ignored
    and sites then wait 2 s between asking for tasks."""
    from fedmed_flare.build import build_job

    exp = _exp(task_request_interval=0.3)
    job = build_job(exp, exp.methods[0], 0)
    job.export_job(str(tmp_path))
    cfg = json.loads(next(tmp_path.rglob("config_fed_server.json")).read_text())
    assert cfg["server"]["task_request_interval"] == 0.3
    assert "task_request_interval" not in cfg

    from nvflare.private.fed.server.server_json_config import ServerJsonConfigurator

    assert "server.task_request_interval" in Path(
        sys.modules[ServerJsonConfigurator.__module__].__file__).read_text()  # the path FLARE reads


def test_worker_ports_are_free_distinct_and_below_the_ephemeral_range():
    lo, hi = sim.ephemeral_range()
    ports = sim.open_ports(8) + sim.open_ports(8)
    assert len(set(ports)) == 16 and all(p < lo for p in ports)
    with socket.socket() as s:  # bindable
        s.bind(("localhost", ports[0]))


def test_fork_template_popen_shim_passes_other_commands_through():
    shim = sim.forking_subprocess()
    assert shim.TimeoutExpired is subprocess.TimeoutExpired and shim.PIPE == subprocess.PIPE
    p = shim.Popen([sys.executable, "-c", "print(1)"], stdout=subprocess.PIPE)
    assert isinstance(p, subprocess.Popen) and p.communicate()[0].strip() == b"1"


def test_forked_worker_runs_the_module_with_the_env_and_reports_exit_codes(tmp_path, monkeypatch):
    """ForkedWorker is Popen for FLARE: environment, PYTHONPATH, argv, new session, exit status, wait timeout."""
    (tmp_path / "fake_worker.py").write_text(
        "import argparse, os, sys\n"
        "def parse_arguments():\n"
        "    ap = argparse.ArgumentParser(); ap.add_argument('--workspace'); ap.add_argument('--rc', type=int)\n"
        "    return ap.parse_args()\n"
        "def main(args):\n"
        "    open(os.environ['OUT'], 'w').write(f'{args.workspace} {os.getsid(0) == os.getpid()}')\n"
        "    if args.rc == 9:\n"
        "        import time; time.sleep(60)\n"
        "    sys.exit(args.rc)\n")
    monkeypatch.setenv("FEDMED_SIM_PRELOAD", "")
    out = tmp_path / "out.txt"
    env = {"OUT": str(out), "PYTHONPATH": str(tmp_path)}
    try:
        w = sim.ForkedWorker(["--workspace", str(tmp_path), "--rc", "3"], env, module="fake_worker")
        assert w.wait(timeout=60) == 3 and w.poll() == 3 and w.pid > 0
        assert out.read_text() == f"{tmp_path} True"
        slow = sim.ForkedWorker(["--workspace", str(tmp_path), "--rc", "9"], env, module="fake_worker")
        with pytest.raises(subprocess.TimeoutExpired):
            slow.wait(timeout=0.5)
        slow.terminate()
        assert slow.wait(timeout=30) == -15
    finally:
        sim.ForkedWorker.stop()


def probe_in_forked_worker(tmp_path, expr: str, preload=()) -> str:
    """``expr`` (Python, over ``gc`` and ``sys``) as a site worker forked from the template sees it: the template
    started with ``preload`` added to its list (as the runner starts it for a job), stopped afterwards."""
    (tmp_path / "probe_worker.py").write_text(
        "import gc, os, sys\n"
        "def parse_arguments():\n"
        "    import argparse; ap = argparse.ArgumentParser(); ap.add_argument('--workspace'); return ap.parse_args()\n"
        "def main(args):\n"
        f"    open(os.environ['OUT'], 'w').write(str({expr}))\n")
    out = tmp_path / "out.txt"
    try:
        sim.ForkedWorker.early_start(list(preload))
        w = sim.ForkedWorker(["--workspace", str(tmp_path)], {"OUT": str(out), "PYTHONPATH": str(tmp_path)},
                             module="probe_worker")
        assert w.wait(timeout=60) == 0
        return out.read_text()
    finally:
        sim.ForkedWorker.stop()


def test_template_imports_its_preload_from_any_working_directory(tmp_path, monkeypatch):
    """Python 3.11's forkserver drops the parent's sys.path: the template must still import
    fedmed_flare._fork_template (so a forked site's objects start in gc's permanent generation) and the preload
    modules, wherever the simulator runs."""
    monkeypatch.setenv("FEDMED_SIM_PRELOAD", "fedmed.core.memtrace")
    monkeypatch.chdir(tmp_path)  # neither the repository nor jobs/ is the working directory
    got = probe_in_forked_worker(tmp_path, "(gc.get_freeze_count() > 0, 'fedmed_flare._fork_template' in sys.modules, "
                                           "'fedmed.core.memtrace' in sys.modules)")
    assert got == "(True, True, True)"


def test_a_jobs_own_preload_is_imported_by_the_template_and_monai_only_where_its_network_needs_it(tmp_path,
                                                                                                   monkeypatch):
    """The job runner starts the template once it knows the job's task config: MONAI (~9 s to import on two cores) is
    preloaded there once for a job whose sites import it (a segmentation job: 32.7 s -> 21.8 s for one round of
    demo_seg_phantoms), instead of in the server and every site after the fork — and not for ResNet-9 jobs."""
    from fedmed.nn.models import PRETRAINED_ARCHS
    from fedmed.nn.needs import MONAI_FREE_ARCHS, uses_monai

    assert set(MONAI_FREE_ARCHS) == {"resnet9", *PRETRAINED_ARCHS}
    code = "import sys, fedmed.nn.needs, fedmed_flare.run; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          cwd=ROOT).stdout.strip() == "False"  # the runner asks before the template imports torch
    assert not uses_monai({"task": "classification", "model": {"arch": "resnet9"}})
    assert not uses_monai({"task": "classification", "model": {"arch": "efficientnet_lite0"}})
    assert not uses_monai({"task": "classification", "model": {"arch": "my_nets:Net"}})
    for cfg in ({"task": "segmentation", "model": {"arch": "unet"}}, {"task": "mae"},
                {"task": "classification", "model": {"arch": "DenseNet121"}},
                {"task": "classification", "model": {"arch": "resnet18"}},
                {"task": "classification", "model": {"arch": "resnet9", "preprocessing": [
                    {"name": "ScaleIntensity", "args": {}}]}}):
        assert uses_monai(cfg), cfg
    monkeypatch.setenv("FEDMED_SIM_PRELOAD", "fedmed.core.memtrace")
    probe = "'colorsys' in sys.modules"  # a module nothing else here imports
    assert probe_in_forked_worker(tmp_path, probe, preload=["colorsys"]) == "True"
    assert probe_in_forked_worker(tmp_path, probe) == "False"
    assert sim.preload_list(["colorsys"])[-2:] == ["colorsys", "fedmed_flare._fork_template"]


def test_the_runner_starts_the_template_before_the_network_check_imports_torch(tmp_path):
    """``jobs/run.py --config`` checked the job's network (which imports torch, ~2 s) before it started the site
    template, so the template's own imports began ~1.7 s into the run; it now starts as soon as the task config is
    built (`fedmed.run.jobspec.job_spec`'s ``task_config_ready``): one round of demo_digits, 9.3 s -> 8.3 s (three
    interleaved pairs). The probe records, in order, the template's start (was torch imported by then?) and the
    network check, and stops before the simulator would run."""
    probe = ("import sys, json\n"
             "import fedmed_flare.simulator as sim, fedmed_flare.run as run, fedmed.run.jobspec as jobspec\n"
             "seen = []\n"
             "def start(extra=()):\n"
             "    seen.append(['template', 'torch' in sys.modules]); return 'started'\n"
             "sim.ForkedWorker.early_start = staticmethod(start)\n"
             "sim.ForkedWorker.stop = staticmethod(lambda kill=False: None)\n"
             "check = jobspec._network_files\n"
             "def network(*a):\n"
             "    check(*a); seen.append(['network checked', 'torch' in sys.modules])\n"
             "jobspec._network_files = network\n"
             "def stop(*a, **k):\n"
             "    print(json.dumps(seen)); sys.exit(0)\n"
             "run.run_sim = stop\n"
             "run.main(sys.argv[1:])\n")
    p = subprocess.run([sys.executable, "-c", probe, "--config", str(ROOT / "app_configs" / "demo_digits.yaml"),
                        "--method", "FedAvg", "--env", "sim", "--workspace", str(tmp_path / "ws"), "--datalists",
                        str(tmp_path)], capture_output=True, text=True, cwd=ROOT, timeout=120,
                       env={**os.environ, "FEDMED_SIM_FORK": "1"})
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(p.stdout.strip().splitlines()[-1]) == [["template", False], ["network checked", True]]


def digits_sim_command(tmp_path, *, sites: int, rounds: int, workspace) -> list[str]:
    """``jobs/run.py --env sim`` for FedAvg on an IID federation of the bundled digits (written under tmp_path)."""
    import yaml

    from fedmed.config import load_config
    from fedmed.run.experiment import classes_override, prepare_federation

    raw = {"name": "simjob", "dataset": {"path": "builtin:digits", "image_size": 8, "channels": 1, "max_per_class": 12},
           "federation": {"sites": sites, "partition": "iid"}, "model": {"arch": "resnet9", "width": 4},
           "train": {"rounds": rounds, "local_epochs": 1, "batch_size": 16}, "privacy": {"k_min": 2},
           "methods": [{"name": "FedAvg", "workflow": "fedavg"}]}
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    exp = load_config(cfg)
    data = prepare_federation(exp, 0, tmp_path / "data")
    return [sys.executable, str(ROOT / "jobs" / "run.py"), "--config", str(cfg), "--method", "FedAvg", "--env", "sim",
            "--datalists", str(data), "--workspace", str(workspace),
            *[x for o in classes_override(data, exp) for x in ("--set", o)]]


@pytest.mark.slow
def test_forked_and_plain_site_processes_train_the_same_model(tmp_path):
    """The simulator with sites forked from the template and with FLARE's own process start end with the same
    global model, bit for bit (and the template process does not outlive the run)."""
    import os
    from datetime import datetime

    import torch

    import psutil

    models, trees = {}, {}
    before = orphan_templates()
    for mode in ("1", "0"):
        cmd = digits_sim_command(tmp_path, sites=3, rounds=2, workspace=tmp_path / f"ws{mode}")
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                             env={**os.environ, "FEDMED_SIM_FORK": mode})
        tree, root = {}, psutil.Process(p.pid)
        while p.poll() is None:  # every process of the run: pid -> command line (a forked one keeps its parent's)
            try:
                kids = root.children(recursive=True)
            except psutil.Error:
                kids = []
            for c in kids:
                try:
                    line = " ".join(c.cmdline())
                except psutil.Error:
                    continue
                if line:  # the latest: a process seen between fork and exec still shows its parent's command
                    tree[c.pid] = line
            time.sleep(0.05)
        trees[mode] = tree
        res = json.loads(p.stdout.read().strip().splitlines()[-1])
        assert res["status"] == "finished", res
        models[mode] = torch.load(Path(res["result"]) / "models" / "global.pt", weights_only=True)["state_dict"]
        # the server app stops once its run ended, not at FLARE's next 3 s engine check (it waited 2.75 s here)
        log = next((tmp_path / f"ws{mode}").glob("*/server/log.txt")).read_text().splitlines()
        at = {k: datetime.strptime(next(ln for ln in log if k in ln)[:23], "%Y-%m-%d %H:%M:%S,%f")
              for k in ("Server runner finished", "Server app stopped")}
        assert (at["Server app stopped"] - at["Server runner finished"]).total_seconds() < 1.0, at
    # forked: no process of the run but the template (and multiprocessing's resource tracker) is a fresh interpreter —
    # the simulator, FLARE's server process and every site are forks of the one template; plain: FLARE's own start
    fresh = {c for c in trees["1"].values() if "resource_tracker" not in c}
    assert len(fresh) == 1 and "multiprocessing.forkserver" in fresh.pop(), trees["1"]
    assert len(trees["1"]) >= 1 + 1 + 2 + 3, trees["1"]  # tracker, template, simulator + its server, 3 sites
    assert sum("simulator_worker" in c for c in trees["0"].values()) == 3, trees["0"]
    assert set(models["1"]) == set(models["0"])
    assert all(np.array_equal(models["1"][k].numpy(), models["0"][k].numpy()) for k in models["1"])
    assert not orphan_templates() - before  # a template whose run ended would be re-parented to init


def orphan_templates() -> set:
    out = subprocess.run(["pgrep", "-f", "multiprocessing.forkserver"], capture_output=True, text=True).stdout.split()
    orphans = set()
    for pid in out:
        try:
            if Path(f"/proc/{pid}/stat").read_text().split(") ")[1].split()[1] == "1":
                orphans.add(pid)
        except OSError:
            pass
    return orphans


@pytest.mark.slow
def test_stopping_the_job_stops_its_simulator(tmp_path):
    """SIGTERM to jobs/run.py (what fedmed experiment sends on a timeout or interrupt) stops the simulator, which
    runs in its own session, and the site processes with it: nothing of the run is left behind."""
    import os
    import signal
    import time

    ws = tmp_path / "ws"
    cmd = digits_sim_command(tmp_path, sites=2, rounds=200, workspace=ws)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not list(ws.glob("*/server/simulate_job/fedmed/metrics.json")) and time.time() < deadline:
        time.sleep(1)

    def ours():
        out = []
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:  # the simulator names the workspace; a forked site worker runs in its folder
                    if str(ws) in Path(f"/proc/{pid}/cmdline").read_text(errors="ignore") or \
                            os.readlink(f"/proc/{pid}/cwd").startswith(str(ws)):
                        out.append(pid)
                except OSError:
                    pass
        return out

    assert ours(), "the run did not start"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143
    deadline = time.time() + 90
    while ours() and time.time() < deadline:
        time.sleep(2)
    assert not ours()


def test_job_aimed_at_fewer_sites_than_min_clients_has_one_quorum(tmp_path, capsys):
    """FLARE's job meta and fedmed's controller agree on the quorum: a resumed job aimed only at the surviving
    site must not be scheduled with min_clients=1 and then fail in the controller with min_clients=2."""
    from fedmed_flare.build import build_job

    exp = _exp(min_clients=2, site_names=["hospital-a", "hospital-b"])
    job = build_job(exp, exp.methods[0], 0, sites=["hospital-a"])
    assert "lowered to 1" in capsys.readouterr().err
    job.export_job(str(tmp_path))
    meta = json.loads(next(tmp_path.rglob("meta.json")).read_text())
    server = json.loads(next(tmp_path.rglob("config_fed_server.json")).read_text())
    ctrl = next(w for w in server["workflows"] if w["id"] == "controller")
    assert meta["min_clients"] == 1 and ctrl["args"]["task_config"]["federation"]["min_clients"] == 1
    build_job(exp, exp.methods[0], 0)  # both sites: the configured quorum
    assert "lowered" not in capsys.readouterr().err


def test_simulator_ends_a_run_after_a_short_quiet_period_not_flares_two_seconds():
    """In the simulator's run process the server's fed-event runner waits FED_EVENT_QUIET_S (not 2 s) for late events
    before and at END_RUN, and checks readiness every END_RUN_CHECK_S; unprocessed events still hold the run open."""
    code = ("import sys; from fedmed_flare import simulator as sim; sim.quick_end_run()\n"
            "from nvflare.widgets.fed_event import ServerFedEventRunner\n"
            "from nvflare.fuel.utils.app_config_utils import get_positive_float_var\n"
            "r = ServerFedEventRunner()\n"
            "print(r.queue_empty_period, r.grace_period, get_positive_float_var('end_run_readiness_check_interval', 0.5))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.split() == [str(sim.FED_EVENT_QUIET_S), str(sim.FED_EVENT_QUIET_S), str(sim.END_RUN_CHECK_S)]
    assert sim.FED_EVENT_QUIET_S < 2.0


def test_simulator_adopts_the_template_jobs_run_started_and_workers_keep_the_launchers_cwd(tmp_path):
    """jobs/run.py starts the site template before it builds the job and hands it to the simulator (environment +
    inherited pipe end): the simulator's workers are then forked by that template (their parent), run in the
    launching process's working directory (as Popen's children would), and the template ends with the run."""
    (tmp_path / "probe_worker.py").write_text(
        "import os\n"
        "def parse_arguments():\n"
        "    import argparse; ap = argparse.ArgumentParser(); ap.add_argument('--workspace'); return ap.parse_args()\n"
        "def main(args):\n"
        "    open(os.environ['OUT'], 'w').write(f'{os.getppid()} {os.getcwd()}')\n")
    (tmp_path / "wd").mkdir()
    child = (f"import os, sys, json; from fedmed_flare import simulator as sim\n"
             f"os.chdir({str(tmp_path / 'wd')!r})\n"
             f"w = sim.ForkedWorker(['--workspace', 'x'], {{'OUT': {str(tmp_path / 'out.txt')!r}, "
             f"'PYTHONPATH': {str(tmp_path)!r}}}, module='probe_worker')\n"
             "assert w.wait(timeout=60) == 0\n"
             "print(sim.ForkedWorker._adopted)\n"
             "sim.ForkedWorker.stop()\n")
    parent = ("import os, sys, subprocess; from fedmed_flare import simulator as sim\n"
              "env, fds = sim.ForkedWorker.early_start()\n"
              f"out = subprocess.run([sys.executable, '-c', {child!r}], env={{**os.environ, **env}}, pass_fds=fds, "
              "capture_output=True, text=True)\n"
              "from multiprocessing import forkserver\n"
              "pid = forkserver._forkserver._forkserver_pid\n"
              "sim.ForkedWorker.stop()\n"
              "gone = True\n"
              "try:\n"
              "    os.kill(pid, 0); gone = False\n"
              "except ProcessLookupError:\n"
              "    pass\n"
              "print(out.returncode, out.stdout.strip(), pid, gone, out.stderr[-500:])\n")
    env = {k: v for k, v in os.environ.items() if k != "FEDMED_SIM_PRELOAD"}
    env["FEDMED_SIM_PRELOAD"] = "json"
    res = subprocess.run([sys.executable, "-c", parent], cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
    rc, adopted, pid, gone = res.stdout.split()[:4]
    assert rc == "0" and adopted == pid and gone == "True", res.stdout + res.stderr
    ppid, cwd = (tmp_path / "out.txt").read_text().split(" ", 1)
    assert ppid == pid and cwd == str(tmp_path / "wd")


def test_a_simulator_forked_by_the_template_forks_its_site_workers_from_that_template_too(tmp_path):
    """jobs/run.py forks the simulator itself from the site template (so neither the simulator nor FLARE's server,
    forked from it, imports NVFlare and torch again): that process has the template's pipe end under another number
    than jobs/run.py's, and must still adopt the template for its site workers rather than start a second one."""
    (tmp_path / "inner_worker.py").write_text(
        "import os\n"
        "def parse_arguments():\n"
        "    import argparse; ap = argparse.ArgumentParser(); ap.add_argument('--workspace'); return ap.parse_args()\n"
        "def main(args):\n"
        "    open(os.environ['OUT'], 'w').write(str(os.getppid()))\n")
    (tmp_path / "outer_worker.py").write_text(
        "import os, sys\n"
        "def parse_arguments():\n"
        "    import argparse; ap = argparse.ArgumentParser(); ap.add_argument('--workspace'); return ap.parse_args()\n"
        "def main(args):\n"
        f"    from fedmed_flare import simulator as sim\n"
        f"    w = sim.ForkedWorker(['--workspace', 'x'], {{'OUT': {str(tmp_path / 'inner.txt')!r}, "
        f"'PYTHONPATH': {str(tmp_path)!r}}}, module='inner_worker')\n"
        "    rc = w.wait(timeout=60)\n"
        f"    open({str(tmp_path / 'outer.txt')!r}, 'w').write(f'{{rc}} {{sim.ForkedWorker._adopted}} {{os.getppid()}}')\n"
        "    sim.ForkedWorker.stop()\n")
    parent = ("import os, sys; from fedmed_flare import simulator as sim\n"
              "env, fds = sim.ForkedWorker.early_start()\n"
              f"w = sim.ForkedWorker(['--workspace', 'y'], {{**os.environ, **env, 'PYTHONPATH': {str(tmp_path)!r}}}, "
              "module='outer_worker')\n"
              "rc = w.wait(timeout=90)\n"
              "from multiprocessing import forkserver\n"
              "print(rc, forkserver._forkserver._forkserver_pid)\n"
              "sim.ForkedWorker.stop()\n")
    env = {**{k: v for k, v in os.environ.items() if k != "FEDMED_SIM_PRELOAD"}, "FEDMED_SIM_PRELOAD": "json"}
    res = subprocess.run([sys.executable, "-c", parent], cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
    rc, template = res.stdout.split()[:2]
    assert rc == "0", res.stdout + res.stderr
    inner_rc, adopted, outer_parent = (tmp_path / "outer.txt").read_text().split()
    assert outer_parent == template and inner_rc == "0" and adopted == template
    assert (tmp_path / "inner.txt").read_text() == template  # not a second template started by the outer process


def test_a_job_that_fails_to_build_leaves_no_site_template_behind():
    """jobs/run.py starts the site template before it builds the job; on bad input it stops it (without waiting for
    its imports) and answers with exit code 2."""
    import psutil

    t0 = time.time()
    p = subprocess.run([sys.executable, str(ROOT / "jobs" / "run.py"), "--config",
                        str(ROOT / "app_configs" / "demo_digits.yaml"), "--method", "Nope", "--env", "sim"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "method 'Nope' is not in" in p.stderr
    left = [q for q in psutil.process_iter(["cmdline", "create_time"])
            if q.info["create_time"] >= t0 - 1 and "multiprocessing.forkserver" in " ".join(q.info["cmdline"] or [])]
    assert not left


def test_flares_task_monitor_checks_at_the_controllers_period_not_its_default():
    """FLARE 2.9 hands a controller's task_check_period to an attribute its WFCommServer never reads (the monitor
    sleeps ``_task_check_period``, 0.2 s): fedmed's controllers set the one the monitor reads, so a finished round is
    seen within TASK_CHECK_PERIOD_S."""
    code = ("import sys; sys.path.insert(0, '.')\n"
            "from nvflare.apis.impl.wf_comm_server import WFCommServer\n"
            "from fedmed_flare.controller import TASK_CHECK_PERIOD_S\n"
            "from fedmed_flare.controller import WorkflowController as FedAvgController\n"
            "w = WFCommServer()\n"
            "FedAvgController(num_rounds=1, task_config={}).set_communicator(w)\n"
            "print(w._task_check_period, TASK_CHECK_PERIOD_S)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    monitor, ours = map(float, out.split())
    assert monitor == ours < 0.2


def _site_worker_pids(ws: Path, site: str) -> list[int]:
    """Processes of ``site``'s simulator worker: a forked worker runs in the site's folder of the workspace, a plain
    one names the site on its command line."""
    import psutil

    out = []
    for q in psutil.process_iter(["pid", "cmdline", "cwd"]):
        cwd, cmd = q.info.get("cwd") or "", " ".join(q.info.get("cmdline") or [])
        if (cwd.startswith(str(ws)) and Path(cwd).name == site) or (str(ws) in cmd and f"--client {site}" in cmd):
            out.append(q.info["pid"])
    return out


@pytest.mark.slow
def test_a_killed_simulated_site_is_left_out_at_once_and_the_run_finishes_without_it(tmp_path):
    """kill -9 of one simulated site's process used to leave the run waiting the whole task_timeout with no progress
    line (FLARE's simulator only ends that site's thread). Now the workflow stops waiting for it at once, records
    that its process died, sends it nothing more, finishes with the others and says which site is missing — and
    the model names only the sites that trained it."""
    import signal

    import torch

    ws = tmp_path / "ws"
    cmd = digits_sim_command(tmp_path, sites=3, rounds=40, workspace=ws) + ["--set", "federation.task_timeout=900"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    record = None
    while time.time() < deadline and proc.poll() is None:
        hits = list(ws.glob("*/server/simulate_job/fedmed/metrics.json"))
        if hits:
            try:
                doc = json.loads(hits[0].read_text())
            except ValueError:
                doc = {}
            if len(doc.get("rounds", [])) >= 2:
                record = hits[0]
                break
        time.sleep(0.2)
    assert record is not None, "the run did not reach round 2"
    pids = _site_worker_pids(ws, "site-2")
    assert pids, "site-2's worker process not found"
    t_kill = time.time()
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    out, err = proc.communicate(timeout=600)
    took = time.time() - t_kill
    assert proc.returncode == 0, err[-2000:]
    assert took < 120, f"the run waited {took:.0f} s after the kill (task_timeout 900 s)"
    res = json.loads(out.strip().splitlines()[-1])
    doc = json.loads((Path(res["result"]) / "metrics.json").read_text())
    assert doc["status"] == "finished" and res["status"] == "finished"
    assert set(doc["sites_missing"]) == {"site-2"} and "process died (exit code -9)" in doc["sites_missing"]["site-2"]["reason"]
    assert "site-2 sat out round(s)" in doc["reason"] and "site-2 sat out round(s)" in err
    last = doc["rounds"][-1]
    assert last["task"] == "validate" and sorted(last["sites"]) == ["site-1", "site-3"]
    rounds = doc["sites_missing"]["site-2"]["rounds"]  # from the round it died in to the end: it never came back
    assert rounds == list(range(rounds[0], 41)) and rounds[0] >= 2
    assert all("left out of this round and the rest of the run" in e["error"] for e in doc["errors"])
    model = torch.load(Path(res["result"]) / "models" / "global.pt", weights_only=True)
    assert model["sites"] == ["site-1", "site-2", "site-3"]  # site-2 trained rounds 0-1 before it died
    assert model["sites"] == sorted({s for r in doc["rounds"] for s, e in r["sites"].items() if e.get("n_train")})


@pytest.mark.slow
def test_sigterm_to_the_launcher_leaves_a_record_that_says_stopped(tmp_path):
    """SIGTERM to jobs/run.py stopped the simulator but left metrics.json at 'running'. (The run also accepts
    k_min = 1: its record states the consent.)"""
    import signal

    ws = tmp_path / "ws"
    consent = ["--set", "privacy.k_min=1", "--set", "privacy.accept_k_min_below_2=true"]
    proc = subprocess.Popen(digits_sim_command(tmp_path, sites=2, rounds=200, workspace=ws) + consent, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    hits = []
    while time.time() < deadline:
        hits = list(ws.glob("*/server/simulate_job/fedmed/metrics.json"))
        if hits and json.loads(hits[0].read_text() or "{}").get("rounds"):
            break
        time.sleep(0.5)
    assert hits, "the run did not start"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=90) == 143
    doc = json.loads(hits[0].read_text())
    assert doc["status"] == "stopped" and "SIGTERM" in doc["reason"]
    assert doc["attempts"][-1]["status"] == "stopped"
    assert doc["privacy_consent"].startswith("WARNING privacy.k_min=1 < 2")


def test_a_site_named_twice_is_a_one_line_error(tmp_path):
    cmd = digits_sim_command(tmp_path, sites=3, rounds=1, workspace=tmp_path / "ws")
    res = subprocess.run(cmd + ["--sites", "site-1", "site-1", "site-3"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1] == \
        "jobs/run.py: error: --sites names site-1 more than once; name each site once"


def test_a_record_left_running_by_a_crashed_server_is_marked_failed_on_disk(tmp_path):
    """The JSON line of jobs/run.py said 'failed' for a record the server left at 'running', but the record itself
    kept saying 'running'; now both say failed, with the reason (and a finished record is never touched)."""
    from fedmed_flare.run import mark_record, outcome

    rec = tmp_path / "fedmed"
    rec.mkdir()
    (rec / "metrics.json").write_text(json.dumps({"status": "running", "reason": "", "rounds": [],
                                                  "attempts": [{"attempt": 1, "status": "running"}]}))
    res = outcome(rec)
    doc = json.loads((rec / "metrics.json").read_text())
    assert res["status"] == doc["status"] == "failed" and "ended while the run was still going" in doc["reason"]
    assert doc["attempts"][-1]["status"] == "failed"
    assert not mark_record(rec, "stopped", "later")  # only a running record is changed
    assert json.loads((rec / "metrics.json").read_text())["status"] == "failed"


def test_a_large_federation_sends_its_arrays_inside_the_message():
    """Above INLINE_ARRAYS_ABOVE sites the simulator sets FLARE's own switch (a zero numpy download chunk size): FLARE's
    numpy decomposer then encodes an array in the message even where a cell could serve it by reference — the path on
    which a 100-site run stalled (64 callback threads each waiting on a download). Small federations keep FLARE's
    default; a user's own setting wins. (A fresh process per case: FLARE reads its config variables once.)"""
    from fedmed_flare.run import INLINE_ARRAYS_ABOVE, INLINE_ARRAYS_ENV, inline_arrays_env

    assert inline_arrays_env(INLINE_ARRAYS_ABOVE) == {} and inline_arrays_env(100) == {INLINE_ARRAYS_ENV: "0"}
    probe = ("import numpy as np\n"
             "from nvflare.app_common.decomposers.numpy_decomposers import NumpyArrayDecomposer\n"
             "from nvflare.fuel.utils import fobs\n"
             "from nvflare.fuel.utils.fobs.datum import DatumManager\n"
             "m = DatumManager(fobs_ctx={fobs.FOBSContextKey.CELL: object()})\n"
             "print(NumpyArrayDecomposer().decompose(np.arange(5.0), m)['type'])\n")

    def encoding(extra: dict) -> str:
        env = {k: v for k, v in os.environ.items() if k != INLINE_ARRAYS_ENV}
        out = subprocess.run([sys.executable, "-c", probe], env={**env, **extra}, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout.strip().splitlines()[-1]

    assert encoding({}) == "ref"  # FLARE's default: by reference, downloaded by the receiver
    assert encoding(inline_arrays_env(100)) == "native"


def test_the_simulator_waits_for_a_slow_worker_longer_than_flares_minute(monkeypatch):
    """FLARE's simulator abandons a site whose new worker is not listening after 60 s (and the server then waits
    task_timeout for it): a 100-site FMCL run lost four sites so. jobs/simulator.py's runner waits CONNECT_TIMEOUT_S,
    whatever FLARE passes, and patching twice does not stack."""
    import inspect

    from nvflare.private.fed.app.simulator import simulator_runner

    seen = []

    class Runner:
        def _create_connection(self, open_port, timeout=60.0):
            seen.append((open_port, timeout))
            return "conn"

    sim.patient_connection(Runner)
    sim.patient_connection(Runner)
    assert Runner()._create_connection(1234, timeout=60.0) == "conn" and Runner()._create_connection(5) == "conn"
    assert seen == [(1234, sim.CONNECT_TIMEOUT_S), (5, sim.CONNECT_TIMEOUT_S)] and sim.CONNECT_TIMEOUT_S >= 600
    # the real class has the method and the keyword this relies on
    assert "timeout" in inspect.signature(simulator_runner.SimulatorClientRunner._create_connection).parameters


@pytest.mark.parametrize("name", ["site one", "site-1\nsite-2", "site-2\n", "../site-1", "hospital/a", "Ünal"])
def test_a_site_name_flare_cannot_take_is_refused_when_the_job_is_built(tmp_path, name):
    """A name with a space, a newline or a path passed the build and failed when the site never registered."""
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"name": "n", "dataset": {"path": "builtin:digits", "image_size": 8,
                                                            "classes": ["a", "b"]}}))
    res = subprocess.run([sys.executable, str(ROOT / "jobs" / "build.py"), "--config", str(cfg), "--method", "FedAvg",
                          "--out", str(tmp_path / "jobs"), "--sites", "site-0", name], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 2 and not (tmp_path / "jobs").exists()
    assert f"--sites: {name!r} is not a site name FLARE accepts" in res.stderr, res.stderr


def test_fedmeds_site_name_rule_is_flares():
    from nvflare.apis.utils.format_check import name_check

    from fedmed.core.validation import SITE_NAME

    for name in ("hospital-a", "site_1", "UMC-Utrecht", "a b", "a.b", "x/y", "", "Ünal", "a\nb"):
        flare_ok = not name_check(name, "client")[0] if name else False
        assert bool(SITE_NAME.fullmatch(name)) == flare_ok, name
    assert not SITE_NAME.fullmatch("a\n")  # FLARE's re.match(...$) lets a trailing newline through; fedmed does not


@pytest.mark.slow
def test_a_prod_run_whose_server_is_unreachable_is_one_line_naming_the_server(tmp_path):
    """``--env prod`` with the server down ended in a 60-line traceback naming no host; now one line naming it."""
    import yaml

    project = {"api_version": 3, "name": "p", "description": "unreachable server",
               "participants": [{"name": "localhost", "type": "server", "org": "n", "fed_learn_port": 1,
                                 "admin_port": 9},  # nothing listens on the discard port
                                {"name": "hospital-a", "type": "client", "org": "a"},
                                {"name": "admin@x.org", "type": "admin", "org": "n", "role": "project_admin"}],
               "builders": [{"path": "nvflare.lighter.impl.workspace.WorkspaceBuilder"},
                            {"path": "nvflare.lighter.impl.static_file.StaticFileBuilder",
                             "args": {"config_folder": "config"}},
                            {"path": "nvflare.lighter.impl.cert.CertBuilder"},
                            {"path": "nvflare.lighter.impl.signature.SignatureBuilder"}]}
    (tmp_path / "project.yml").write_text(yaml.safe_dump(project))
    subprocess.run([str(Path(sys.executable).parent / "nvflare"), "provision", "-p", "project.yml", "-w", "ws",
                    "--force"], cwd=tmp_path, check=True, capture_output=True, timeout=120)
    kit = next((tmp_path / "ws").rglob("admin@x.org"))
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump({"name": "p", "dataset": {"path": "builtin:digits",
                                                                                "classes": ["a", "b"]},
                                                       "federation": {"sites": 1, "site_names": ["hospital-a"]}}))
    p = subprocess.run([sys.executable, str(ROOT / "jobs" / "run.py"), "--config", "cfg.yaml", "--method", "FedAvg",
                        "--env", "prod", "--startup-kit", str(kit)], cwd=tmp_path, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 1, p.stderr[-2000:]
    assert "Traceback" not in p.stderr + p.stdout
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["status"] == "failed" and "the job was not submitted" in res["reason"]
    assert "server localhost:9" in res["reason"]
