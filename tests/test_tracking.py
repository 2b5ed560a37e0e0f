"""Experiment tracking through FLARE's receivers (``tracking`` of an experiment config, ``fedmed_flare.tracking``):
an MLflow file store and TensorBoard event folders holding each site's and the server's per-round metrics, the run's
settings and its result; a tracker that is not installed is one line before any run; tracking never moves a result."""

import importlib.util
import json
import re
import sys
import time
from pathlib import Path

import pytest
import yaml

from fedmed.config import load_config

TINY = {"name": "tracked", "dataset": {"path": "builtin:digits", "image_size": 8, "channels": 1, "max_per_class": 8},
        "federation": {"sites": 3, "partition": "iid"}, "model": {"arch": "resnet9", "width": 4},
        "train": {"rounds": 2, "local_epochs": 1, "batch_size": 8}, "methods": [{"name": "FedAvg"}],
        "privacy": {"k_min": 2}, "references": [], "tracking": {"mlflow": True}}


@pytest.mark.slow
def test_a_run_tracked_in_mlflow_has_every_sites_and_the_servers_rounds_its_settings_and_result(tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason="MLflow is an optional extra (pip install 'fedmed[mlflow]')")
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from conftest import doc_commands
    from test_docs import _run, clone_like

    here = clone_like(tmp_path)  # docs/recipes.md's command, as written
    cmd = next(c for c in doc_commands("recipes.md") if c.startswith(".venv/bin/fedmed experiment "
                                                                  "app_configs/demo_digits.yaml --out results/tracked"))
    p = _run(cmd, here)
    assert p.returncode == 0, p.stderr[-3000:]
    out = here / "results" / "tracked"
    server = out / "runs" / "seed0" / "FedAvg" / "server"
    record = json.loads((server / "metrics.json").read_text())
    assert record["status"] == "finished"

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient((out / "mlruns").as_uri())  # fedmed experiment: one store for its runs
    exp = client.get_experiment_by_name("demo-digits")  # the config's name
    by_site = {}  # FLARE names a run "<site>-<job id>-<job name>-<run name>"; the simulator's server is simulator_server
    for r in client.search_runs([exp.experiment_id]):
        who = r.info.run_name.split("-")[0]
        by_site["server" if who == "simulator_server" else "-".join(r.info.run_name.split("-")[:2])] = r
    sites = record["sites"]
    assert sorted(by_site) == ["server", *sorted(sites)] and len(sites) == 4
    rounds = list(range(len(record["rounds"])))
    for s in sites:  # each site's per-round metrics, as the site sent them
        hist = client.get_metric_history(by_site[s].info.run_id, f"{s}/test/accuracy")
        steps = sorted(m.step for m in hist)
        assert steps == rounds
        sent = {r["round"]: r["sites"][s]["accuracy"] for r in record["rounds"] if s in r["sites"]}
        assert {m.step: m.value for m in hist} == pytest.approx(sent)
    run = by_site["server"]
    hist = client.get_metric_history(run.info.run_id, "test/accuracy_site_mean")
    assert {m.step: m.value for m in hist} == pytest.approx(
        {r["round"]: r["summary"]["mean"]["accuracy"] for r in record["rounds"]})
    params = run.data.params
    assert params["config.train.rounds"] == "2" and params["workflow"] == "FedAvg"
    assert run.data.tags["fedmed.status"] == "finished"
    result = json.loads(Path(client.download_artifacts(run.info.run_id, "result.json", str(tmp_path))).read_text())
    assert result["status"] == "finished" and result["final_round"] == 2
    assert str(tmp_path) not in json.dumps(params)  # no absolute path of the experimenter's in the shared store

    # TensorBoard (on by default): FLARE's receiver, a folder per site and one for the server, kept with the run
    for who, tag in (("site-2", "site-2/test/accuracy"), ("simulator_server", "test/accuracy_site_mean")):
        acc = EventAccumulator(str(server / "tb" / who))
        acc.Reload()
        assert [e.step for e in acc.Scalars(tag)] == rounds

    # #56: the MLflow command the run prints, and the one recipes.md shows, open this store in MLflow's UI
    printed = next(ln for ln in p.stdout.splitlines() if ln.startswith("MLflow: "))
    shown = printed.split("to view them: ", 1)[1]
    exe = Path(sys.prefix) / "bin" / "mlflow"  # this environment's mlflow by its path: the line runs in a new shell
    assert shown.startswith(f"MLFLOW_ALLOW_FILE_STORE=true {exe} ui --backend-store-uri file://"), printed
    documented = next(c for c in doc_commands("recipes.md") if c.startswith("MLFLOW_ALLOW_FILE_STORE=true .venv/bin/mlflow"))
    assert _ui_lists([shown, documented], here, len(sites) + 1) == [["demo-digits"], ["demo-digits"]]


def _ui_lists(cmds: list, cwd: Path, n_runs: int) -> list:
    """Run ``mlflow ui`` commands as written, side by side (each on a free port: ``--port`` appended; ``mlflow`` from
    this venv), and return the experiments each web server lists (the UI's own search call), checking that each has
    ``n_runs`` runs and that the UI's page itself is served."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
           "PATH": f"{Path(sys.prefix) / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    servers = []
    for cmd in cmds:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        servers.append((cmd, port, subprocess.Popen(["bash", "-c", f"{cmd} --port {port}"], cwd=cwd, env=env,
                                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                                    start_new_session=True)))

    def post(port, path, body):
        req = urllib.request.Request(f"http://127.0.0.1:{port}/ajax-api/2.0/mlflow/{path}", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        return json.loads(urllib.request.urlopen(req, timeout=10).read())

    out = []
    try:
        for cmd, port, ui in servers:
            deadline = time.time() + 120
            while True:
                assert ui.poll() is None, f"{cmd!r} exited: {ui.stderr.read()[-2000:]}"
                try:
                    page = urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5).read().decode()
                    break
                except OSError:
                    assert time.time() < deadline, f"MLflow's UI ({cmd!r}) did not answer within 120 s"
                    time.sleep(1)
            assert "<!doctype html>" in page.lower()  # the UI's page itself, not only the API
            found = [e for e in post(port, "experiments/search", {"max_results": 100})["experiments"]
                     if e["name"] != "Default"]
            for e in found:
                assert len(post(port, "runs/search", {"experiment_ids": [e["experiment_id"]]})["runs"]) == n_runs
            out.append([e["name"] for e in found])
        return out
    finally:
        for _, _, ui in servers:
            os.killpg(ui.pid, signal.SIGTERM)
        for _, _, ui in servers:
            ui.wait(30)


def _wandb_records(path: Path) -> list:
    """The records of an offline W&B run file (``run-<id>.wandb``), read as wandb writes it: a ``:W&B`` header
    (7 bytes), then LevelDB-log framing (32 KiB blocks; each chunk a CRC, a length, a type: full, first, middle,
    last) around ``wandb_internal_pb2.Record`` protobufs."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    b = path.read_bytes()
    assert b[:4] == b":W&B", b[:8]
    pos, block, chunks, out = 7, 32768, b"", []
    while pos + 7 <= len(b):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", b[pos:pos + 7])
        if n == 0 and kind == 0:  # the block's zero padding
            pos += left
            continue
        data, pos = b[pos + 7:pos + 7 + n], pos + 7 + n
        chunks = data if kind in (1, 2) else chunks + data
        if kind in (1, 4):
            r = pb.Record()
            r.ParseFromString(chunks)
            out.append(r)
    return out


@pytest.mark.slow
def test_a_run_tracked_in_wandb_offline_has_every_sites_and_the_servers_rounds_its_settings_and_result(tmp_path):
    pytest.importorskip("wandb", reason="W&B is an optional extra (pip install 'fedmed[wandb]')")
    from fedmed.cli.main import main

    p = tmp_path / "cfg.yaml"
    p.write_text(yaml.safe_dump({**TINY, "tracking": {"wandb": True, "tensorboard": False}}))
    assert main(["experiment", str(p), "--out", str(tmp_path / "out")]) == 0
    record = json.loads((tmp_path / "out" / "runs" / "seed0" / "FedAvg" / "metrics.json").read_text())
    runs = {}
    for f in sorted((tmp_path / "out" / "wandb").glob("wandb/offline-run-*/run-*.wandb")):  # fedmed experiment: <out>/wandb
        recs = _wandb_records(f)
        updates = [r.run for r in recs if r.WhichOneof("record_type") == "run"]
        log = f.parent / "logs" / "debug.log"  # a run that never reached run.finish() keeps only the file's header
        assert updates, (f"{f.name}: {f.stat().st_size} bytes, {len(recs)} records, no run record; its debug.log "
                         f"ends:\n" + "\n".join((log.read_text() if log.is_file() else "").splitlines()[-15:]))
        run = updates[-1]  # the last update of the run (tags)
        config = {i.key: json.loads(i.value_json) for r in recs if r.WhichOneof("record_type") in ("run", "config")
                  for i in (r.run.config.update if r.WhichOneof("record_type") == "run" else r.config.update)}
        history = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item} for r in recs
                   if r.WhichOneof("record_type") == "history"]
        who = run.display_name.split("-")[0]  # FLARE names a run "<site>-<job id>-<name>"
        runs["server" if who == "simulator_server" else "-".join(run.display_name.split("-")[:2])] = (
            run, config, history, f.parent)
    sites = record["sites"]
    assert sorted(runs) == ["server", *sorted(sites)]
    for s in sites:  # each site's per-round metrics, as the site sent them
        _, config, history, _ = runs[s]
        assert config["client"] == s and config["run_name"] == "tracked"
        got = {h["_step"]: h[f"{s}/test/accuracy"] for h in history}
        assert got == pytest.approx({r["round"]: r["sites"][s]["accuracy"] for r in record["rounds"] if s in r["sites"]})
    run, config, history, folder = runs["server"]
    assert {h["_step"]: h["test/accuracy_site_mean"] for h in history} == pytest.approx(
        {r["round"]: r["summary"]["mean"]["accuracy"] for r in record["rounds"]})
    assert config["config.train.rounds"] == "2" and config["workflow"] == "FedAvg"  # the run's settings: its config
    assert "fedmed.status=finished" in run.tags
    result = json.loads((folder / "files" / "result.json").read_text())
    assert result["status"] == "finished" and result["final_round"] == 2
    assert str(tmp_path) not in json.dumps(config)


def test_a_wandb_run_process_is_spawned_and_finishes_its_file_and_one_that_cannot_finish_is_named(tmp_path):
    """The receiver's W&B runs run in spawned processes (FLARE's forks the server's multi-threaded process); a run's
    records reach its offline file only at ``run.finish()``; ``finalize`` waits for every run together and names a
    run it had to stop."""
    pytest.importorskip("wandb", reason="W&B is an optional extra (pip install 'fedmed[wandb]')")
    import multiprocessing

    from nvflare.app_opt.tracking.wandb.wandb_receiver import WandBTask

    from fedmed_flare.wandb_receiver import WandBReceiver, run_queue

    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    for task, data, step in [("init", {"project": "p", "name": "site-1-run", "mode": "offline", "dir": str(tmp_path)},
                              0), ("log", {"site-1/test/accuracy": 0.5}, 0), ("log", {"site-1/test/accuracy": 0.75}, 1),
                             ("stop", {}, 0)]:
        q.put(WandBTask(task_owner="site-1", task_type=task, task_data=data, step=step))
    p = ctx.Process(target=run_queue, args=(q,))
    p.start()
    p.join(120)
    assert p.exitcode == 0
    (f,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    recs = _wandb_records(f)
    assert [r.run.display_name for r in recs if r.WhichOneof("record_type") == "run"][-1] == "site-1-run"
    history = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item} for r in recs
               if r.WhichOneof("record_type") == "history"]
    assert [(h["_step"], h["site-1/test/accuracy"]) for h in history] == [(0, 0.5), (1, 0.75)]  # the last step too

    r = WandBReceiver(wandb_args={"project": "p", "name": "n"}, process_timeout=2.0, wandb_dir=str(tmp_path))
    r.wandb_args["dir"] = str(tmp_path)
    stuck, done = ctx.Queue(), ctx.Queue()
    r.queues = {"site-2": stuck, "site-3": done}  # site-2's process never reads its queue, site-3's ends at once
    r.processes = {"site-2": ctx.Process(target=time.sleep, args=(60,)), "site-3": ctx.Process(target=run_queue,
                                                                                               args=(done,))}
    for proc in r.processes.values():
        proc.start()
    # site-3's run loop is up before finalize: a spawned process imports wandb and FLARE first, which on a loaded
    # 2-core machine outlasted the 2 s deadline (CI, stop 76). A task before any init is skipped by the loop;
    # qsize counts what was put and not yet taken (Linux)
    done.put(WandBTask(task_owner="site-3", task_type="log", task_data={"x": 0}, step=0))
    t_ready = time.monotonic()
    while done.qsize() and time.monotonic() - t_ready < 120:
        time.sleep(0.1)
    assert done.qsize() == 0, "site-3's W&B process never started reading its queue"
    errors = []
    r.log_error = lambda fl_ctx, msg: errors.append(msg)
    t0 = time.monotonic()
    r.finalize(None)
    assert time.monotonic() - t0 < 30
    r.processes["site-2"].join(10)
    assert not r.processes["site-2"].is_alive() and r.processes["site-3"].exitcode == 0
    assert len(errors) == 1 and "W&B run of site-2 did not finish" in errors[0] and "incomplete" in errors[0]


def test_a_tracker_that_is_not_installed_is_one_line_before_any_run(tmp_path, monkeypatch):
    from fedmed.run.jobspec import BuildError, tracking_settings

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find(name, *a))
    p = tmp_path / "cfg.yaml"
    p.write_text(yaml.safe_dump({**TINY, "tracking": {"wandb": True}}))
    exp = load_config(p)
    with pytest.raises(BuildError, match=r"^tracking.wandb: wandb is not installed here \(pip install 'fedmed\[wandb\]'\)"):
        tracking_settings(exp)  # what job_spec asks first of a job's tracking


def test_tracking_settings_never_change_what_a_run_is():
    from fedmed.run.fingerprint import run_fingerprint

    a = load_config({**TINY, "tracking": {}})
    b = load_config({**TINY, "tracking": {"mlflow": True, "tensorboard": False, "mlflow_uri": "http://tracking:5000"}})
    assert run_fingerprint(a, a.methods[0], 0) == run_fingerprint(b, b.methods[0], 0)
    with pytest.raises(Exception, match="tracking.wandb_mode"):
        load_config({**TINY, "tracking": {"wandb_mode": "sometimes"}})


def test_where_metrics_go_is_the_parties_choice_not_the_jobs(tmp_path):
    """A job's ``tracking.mlflow_uri`` (an MLflow server: here a loopback listener standing in for an outside host)
    at a server whose policy does not list it: fedmed's receiver contacts nothing and the run fails in one line naming
    the setting, in FLARE's simulator. W&B online, a folder of the job's choosing and FLARE's own receivers named by a
    job are refused the same way; the run's own folder is always allowed; a site sends its metrics to the trackers
    only where its own policy allows every destination the job names."""
    import subprocess
    import sys

    pytest.importorskip("mlflow", reason="MLflow is an optional extra (pip install 'fedmed[mlflow]')")
    from nvflare.app_opt.tracking.mlflow.mlflow_receiver import MLflowReceiver as FlareMLflow
    from nvflare.app_opt.tracking.wandb.wandb_receiver import WandBReceiver as FlareWandB
    from test_policy import Listener

    from fedmed.core.policy import SitePolicy
    from fedmed.run.experiment import REPO_ROOT, prepare_federation
    from fedmed.run.jobspec import job_spec
    from fedmed_flare.mlflow_receiver import MLflowReceiver
    from fedmed_flare.destinations import receiver_destinations, refused_receivers
    from fedmed_flare.wandb_receiver import WandBReceiver

    lis = Listener()
    try:
        cfg = {**TINY, "dataset": {**TINY["dataset"], "classes": [str(c) for c in range(10)]},
               "tracking": {"mlflow": True, "mlflow_uri": lis.url, "tensorboard": False}}
        exp = load_config(cfg)
        data = prepare_federation(exp, 0, tmp_path / "data")
        spec = job_spec(exp, exp.methods[0], 0).to_file(tmp_path / "spec.json")
        assert json.loads(spec.read_text())["task_config"]["tracking"] == [lis.url]  # what each site is told
        policy = SitePolicy(k_min=2).write(tmp_path / "fedmed_policy.json")  # a party's: tracking []
        r = subprocess.run([sys.executable, str(REPO_ROOT / "jobs" / "run.py"), "--spec", str(spec), "--env", "sim",
                            "--datalists", str(data), "--workspace", str(tmp_path / "ws"), "--site-policy",
                            str(policy)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
        res = json.loads(next(ln for ln in reversed(r.stdout.splitlines()) if ln.startswith("{") and '"status"' in ln))
        assert res["status"] == "failed", res
        assert ("the server does not send this job's metrics where it asks: tracking (mlflow_receiver): the job "
                "sends metrics to a 'http:' destination, which this party's policy does not allow") in res["reason"]
        assert "127.0.0.1" not in res["reason"]
        assert lis.requests == [], lis.requests  # nothing reached the stand-in
    finally:
        lis.close()
    # the destinations of every receiver a job may name, and the parties' decisions on them
    allowed = SitePolicy(tracking=("http://mlflow.hospital:5000",))
    assert receiver_destinations(MLflowReceiver()) == [] and receiver_destinations(FlareMLflow()) == []
    assert receiver_destinations(MLflowReceiver(tracking_uri="sqlite:////etc/x.db")) == ["sqlite:////etc/x.db"]
    assert receiver_destinations(FlareMLflow(artifact_location="/etc/art")) == ["file:/etc/art"]
    assert receiver_destinations(WandBReceiver({"project": "p", "name": "n"})) == []
    assert receiver_destinations(WandBReceiver({"project": "p", "name": "n"}, mode="online")) == ["wandb:online"]
    assert receiver_destinations(WandBReceiver({"project": "p"}, wandb_dir="/etc/w")) == ["file:/etc/w"]
    assert receiver_destinations(FlareWandB({"project": "p", "mode": "online"})) == ["wandb:online"]
    assert receiver_destinations(object()) is None
    jobs = {"mlflow_receiver": MLflowReceiver(tracking_uri="http://mlflow.hospital:5000"), "tb": object()}
    assert refused_receivers(allowed, jobs) is None and refused_receivers(SitePolicy(), jobs)
    assert refused_receivers(SitePolicy(), {"w": WandBReceiver({"project": "p"}, mode="online")}).startswith(
        "tracking (w): the job sends metrics to W&B's servers, which this party's policy does not allow")
    assert refused_receivers(SitePolicy(), {"m": MLflowReceiver(), "w": WandBReceiver({"project": "p"})}) is None
    assert SitePolicy.simulating(2).refused_tracking(["http://anything"]) is None  # fedmed experiment: the config's own
    f = tmp_path / "p.json"
    f.write_text(json.dumps({"tracking": ["http://mlflow.hospital:5000"]}))
    assert SitePolicy.from_file(f).tracking == ("http://mlflow.hospital:5000",)


def test_a_site_sends_its_metrics_to_the_trackers_only_where_its_policy_allows():
    """The job tells each site where its server sends metrics besides its own folder (``tracking`` of the task
    config); the site's executor sends its per-round metrics as FLARE analytics only where its own policy allows all
    — and under a policy of ``tracking: []`` never, whatever the job's list says (#87 B: a job that keeps its receiver
    and writes ``[]`` sent every site's metrics)."""
    from types import SimpleNamespace

    from nvflare.apis.fl_context import FLContext

    from fedmed.core.policy import SitePolicy
    from fedmed_flare.executor import SiteExecutor

    ex = SiteExecutor()
    ctx = FLContext()
    ex._runner = SimpleNamespace(policy=SitePolicy())
    assert not ex._may_track({}, ctx) and not ex._may_track({"tracking": []}, ctx)  # the job's word is not consent
    assert not ex._may_track({"tracking": ["http://mlflow.elsewhere:5000"]}, ctx)
    ex._runner = SimpleNamespace(policy=SitePolicy(tracking=("*",)))
    assert ex._may_track({}, ctx) and ex._may_track({"tracking": ["wandb:online"]}, ctx)
    ex._runner = SimpleNamespace(policy=SitePolicy.simulating(2))  # fedmed experiment's sites: the config's own
    assert ex._may_track({"tracking": []}, ctx)
    ex._runner = SimpleNamespace(policy=SitePolicy())
    assert not ex._may_track({"tracking": ["wandb:online"]}, ctx)
    ex._runner = SimpleNamespace(policy=SitePolicy(tracking=("http://mlflow.hospital:5000",)))
    assert ex._may_track({"tracking": ["http://mlflow.hospital:5000"]}, ctx)
    assert not ex._may_track({"tracking": ["http://mlflow.hospital:5000", "wandb:online"]}, ctx)


def test_the_printed_mlflow_command_says_what_to_install_where_only_the_tracking_client_is(tmp_path, monkeypatch):
    """With mlflow-skinny alone ``mlflow ui`` crashed (no alembic): the line now says to install the UI extra first."""
    import importlib.util

    from fedmed.run.jobs import mlflow_ui_command

    assert re.match(r"MLFLOW_ALLOW_FILE_STORE=true \S*mlflow ui --backend-store-uri file://", mlflow_ui_command(tmp_path))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "alembic" else real(n, *a))
    assert mlflow_ui_command(tmp_path).startswith("pip install 'fedmed[mlflow-ui]' (MLflow's UI server), then "
                                                  "MLFLOW_ALLOW_FILE_STORE=true ")
