"""A provisioned federation on loopback, run as a hospital IT team runs it (docs/deployment.md):

``nvflare provision`` writes startup kits with certificates for a server, three hospitals and an admin; every kit's
``class_allow_list`` allows fedmed's adapters and live log streaming is off (``python -m fedmed_flare.kit``); hospital-a allows no custom code
(``"byoc": "none"`` for every role in its ``local/authorization.json``) — fedmed's jobs carry none, so it runs them,
and it refuses a job that carries a user's network; the server and two hospitals are started with their kits'
``startup/start.sh`` (hospital-c never starts); each hospital's data setting and policy sit in its kit's
``local/fedmed_site.json`` and ``local/fedmed_policy.json``; jobs built from the config alone are
submitted with the admin's startup kit (``jobs/run.py --env prod``: FLARE API submit, wait, download) and their
results checked. Faults: a site's job process killed mid-round (FLARE ends the job; the run stops cleanly and a
resumed job finishes without that site), a site suspended mid-round (left out after the task timeout, back when
resumed), every site failing (a failed run with its reason). Everything started is stopped at the end.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import yaml

from fedmed.config import load_config
from fedmed.run.experiment import REPO_ROOT, prepare_federation

from conftest import doc_commands, doc_json

pytestmark = [pytest.mark.slow, pytest.mark.deploy]

SITES = ["hospital-a", "hospital-b", "hospital-c"]
ADMIN = "it-admin@hospital-network.org"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def project_yml(fl_port: int, admin_port: int) -> dict:
    participants = [{"name": "localhost", "type": "server", "org": "network", "fed_learn_port": fl_port,
                     "admin_port": admin_port}]
    participants += [{"name": s, "type": "client", "org": s.replace("-", "_")} for s in SITES]
    participants += [{"name": ADMIN, "type": "admin", "org": "network", "role": "project_admin"}]
    return {"api_version": 3, "name": "fedmed_deploy_test", "description": "fedmed provisioning test",
            "participants": participants,
            "builders": [{"path": "nvflare.lighter.impl.workspace.WorkspaceBuilder"},
                         {"path": "nvflare.lighter.impl.static_file.StaticFileBuilder", "args": {"config_folder": "config"}},
                         {"path": "nvflare.lighter.impl.cert.CertBuilder"},
                         {"path": "nvflare.lighter.impl.signature.SignatureBuilder"}]}


class Deployment:
    def __init__(self, root: Path):
        self.root = root
        self.env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}", HOME=str(root / "home"))
        (root / "home").mkdir(parents=True, exist_ok=True)
        self.kits: dict[str, Path] = {}
        self.procs: list[subprocess.Popen] = []

    def provision_command(self):
        """docs/deployment.md §2's command, as written, in the folder holding project.yml."""
        cmd = next(c for c in doc_commands("deployment.md") if c.startswith(".venv/bin/nvflare provision"))
        if not (self.root / ".venv").exists():  # the clone the page runs it in: this environment as its .venv
            (self.root / ".venv").symlink_to(Path(sys.prefix))
        subprocess.run(["bash", "-c", cmd], cwd=self.root, env=self.env, check=True, capture_output=True, timeout=120)

    def provision(self):
        (self.root / "project.yml").write_text(yaml.safe_dump(project_yml(free_port(), free_port())))
        self.provision_command()
        prod = next((self.root / "provision").rglob("prod_00"))
        self.kits = {p.name: p for p in prod.iterdir() if (p / "startup").is_dir()}
        assert {"localhost", ADMIN, *SITES} <= set(self.kits)
        assert (self.kits["hospital-a"] / "startup" / "client.crt").is_file()  # certificates

    def add_site(self, name: str) -> Path:
        """A hospital joins after training: added to project.yml and provisioned again in the same workspace, which
        keeps the project's root CA (its state), so the new kit's certificate is trusted by the running server."""
        doc = yaml.safe_load((self.root / "project.yml").read_text())
        doc["participants"].insert(-1, {"name": name, "type": "client", "org": name.replace("-", "_")})
        (self.root / "project.yml").write_text(yaml.safe_dump(doc))
        self.provision_command()  # §10: the same command, in the same workspace
        prod = sorted((self.root / "provision").rglob("prod_*"))[-1]
        self.kits[name] = prod / name
        assert (self.kits[name] / "startup" / "client.crt").is_file()
        return self.kits[name]

    def allow_fedmed(self, prod: Path):
        """docs/deployment.md §4: every kit's class_allow_list allows fedmed's adapters — the command as written, run
        in the provisioning folder (``provision/<project>`` is this workspace's)."""
        cmd = next(c for c in doc_commands("deployment.md") if "fedmed_flare.kit" in c)
        cmd = cmd.replace(".venv/bin/python", sys.executable).replace("provision/<project>/prod_00", str(prod))
        subprocess.run(["bash", "-c", cmd], cwd=self.root, env=self.env, check=True, capture_output=True, timeout=120)

    def no_custom_code(self, name: str):
        """docs/deployment.md §4: a site that runs no job carrying code — its authorization.json as the page gives it."""
        authz = doc_json("deployment.md", "local/authorization.json")
        (self.kits[name] / "local" / "authorization.json").write_text(json.dumps(authz, indent=1))

    def start(self, name: str):
        """docs/deployment.md §5: the kit's startup/start.sh, the page's line as written (its placeholders: this
        project's folder and the party's name). start.sh starts sub_start.sh in the background, in the session
        started here, which stop() ends as a whole."""
        lines = [c for c in doc_commands("deployment.md") if c.endswith("/startup/start.sh") or "/startup/start.sh " in c]
        line = next(c for c in lines if ("# the server" in c) == (name == "localhost"))
        kit = self.kits[name]
        cmd = (line.replace("provision/<project>/prod_00", str(kit.parent))
               .replace("fl.coordinator.example.org", name).replace("hospital-a", name))
        p = subprocess.Popen(["bash", "-c", cmd], cwd=self.root, env=self.env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
        self.procs.append(p)

    def session(self):
        from nvflare.fuel.flare_api.flare_api import new_secure_session

        return new_secure_session(ADMIN, str(self.kits[ADMIN]), timeout=10.0)

    def wait_connected(self, sites, timeout=120):
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                sess = self.session()
                try:
                    names = {getattr(c, "name", c) for c in (sess.get_connected_client_list() or [])}
                finally:
                    sess.close()
                if set(sites) <= names:
                    return
            except Exception:
                pass
            time.sleep(2)
        raise TimeoutError(f"sites {sites} did not connect")

    def job_pid(self, site: str) -> int:
        out = subprocess.run(["ps", "-ewwo", "pid,args"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if "worker_process" in line and f"-c {site}" in line and str(self.kits[site]) in line:
                return int(line.split()[0])
        raise LookupError(f"no job process of {site}; processes:\n" + "\n".join(
            line[:300] for line in out.splitlines() if "nvflare" in line))

    def server_record(self) -> dict:
        hits = sorted(self.kits["localhost"].glob("*/fedmed/metrics.json"), key=lambda p: p.stat().st_mtime)
        return json.loads(hits[-1].read_text()) if hits else {}

    def stop(self):
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        subprocess.run(["pkill", "-9", "-f", str(self.root / "provision")], check=False)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    root = tmp_path_factory.mktemp("deploy")
    d = Deployment(root)
    try:
        d.provision()
        d.allow_fedmed(d.kits["localhost"].parent)
        d.no_custom_code("hospital-a")
        d.start("localhost")
        time.sleep(5)
        d.start("hospital-a")
        d.start("hospital-b")
        d.wait_connected(["hospital-a", "hospital-b"])
        yield d
    finally:
        d.stop()


def write_config(path: Path, **over) -> Path:
    cfg = {"name": "deploy", "dataset": {"path": "builtin:digits", "image_size": 8, "channels": 1, "max_per_class": 12,
                                         "classes": [str(c) for c in range(10)]},
           "federation": {"sites": 3, "site_names": SITES, "partition": "iid", "min_clients": 2, "task_timeout": 60,
                          "startup_timeout": 3},  # hospital-c never starts: each job naming it waits this long
           "model": {"arch": "resnet9", "width": 4}, "train": {"rounds": 3, "local_epochs": 1, "batch_size": 8},
           "privacy": {"k_min": 2}, "methods": [{"name": "FedAvg", "workflow": "fedavg"},
                                                {"name": "FMCL", "workflow": "fmcl", "encoder": "random_cnn"}]}
    for k, v in over.items():
        cfg[k] = {**cfg[k], **v} if isinstance(v, dict) else v
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def site_data(deployment, tmp_path_factory):
    """Each running hospital's own data setting, in its kit's local/ folder."""
    root = tmp_path_factory.mktemp("data")
    cfg = write_config(root / "cfg.yaml")
    data = prepare_federation(load_config(cfg), 0, root / "federation")
    for s in ("hospital-a", "hospital-b"):
        (deployment.kits[s] / "local" / "fedmed_site.json").write_text(json.dumps({"datalist": str(data / f"{s}.json")}))
        (deployment.kits[s] / "local" / "fedmed_policy.json").write_text(json.dumps({"k_min": 2}))  # the site's floor
    return data


def submit(deployment, cfg: Path, method: str, result_dir: Path, *extra, background=False, env=None):
    cmd = [sys.executable, str(REPO_ROOT / "jobs" / "run.py"), "--config", str(cfg), "--method", method, "--env", "prod",
           "--startup-kit", str(deployment.kits[ADMIN]), "--result-dir", str(result_dir), "--timeout", "600", *extra]
    if background:
        return subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env)
    return subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900, env=env)


def outcome(text: str) -> dict:
    return json.loads(next(ln for ln in reversed(text.splitlines()) if ln.startswith("{") and '"status"' in ln))


def record(res: dict) -> dict:
    return json.loads((Path(res["result"]) / "metrics.json").read_text())


FMCL_TWO = [{"name": "FMCL", "workflow": "fmcl", "encoder": "random_cnn", "n_clusters": 2}]


@pytest.fixture(scope="module")
def fmcl_run(deployment, site_data, tmp_path_factory):
    """One FMCL training job (two clusters), named for the three hospitals, its job folder exported: what the
    clustering, no-custom-code and new-hospital tests each read (one job instead of three)."""
    tmp = tmp_path_factory.mktemp("fmcl")
    cfg = write_config(tmp / "cfg.yaml", methods=FMCL_TWO)
    p = submit(deployment, cfg, "FMCL", tmp / "result", "--jobs-dir", str(tmp / "jobs"))
    return SimpleNamespace(p=p, cfg=cfg, jobs=tmp / "jobs")


def test_clustering_job_on_provisioned_sites(deployment, fmcl_run):
    """An FMCL job named for three hospitals; hospital-c never started: given up on after the start-up timeout."""
    p = fmcl_run.p
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = outcome(p.stdout)
    assert res["status"] == "finished" and res["flare_status"] == "FINISHED:COMPLETED"
    doc = record(res)
    assert doc["sites"] == ["hospital-a", "hospital-b"]
    assert any(e["site"] == "hospital-c" and "never registered" in e["error"] for e in doc["errors"])
    assert sorted(s for c in doc["clustering"]["clusters"] for s in c) == ["hospital-a", "hospital-b"]
    assert (Path(res["result"]) / "distance_heatmap.png").is_file() and list(Path(res["result"]).glob("models/*.pt"))
    job_id = next(ln.split()[-1] for ln in p.stdout.splitlines() if ln.startswith("submitted job "))
    no_site_log_reached_the_server(deployment, job_id)


def no_site_log_reached_the_server(deployment, job_id: str):
    """docs/deployment.md §4: the kit command turned FLARE's live log streaming off in every kit, so no site's log
    reached the server (FLARE's JobLogReceiver says "Saved live log ... from <site>" for each log it stores; with
    streaming on, as a provisioned kit ships, every job's site logs arrive there)."""
    for site in ("hospital-a", "hospital-b"):
        res = json.loads((deployment.kits[site] / "local" / "resources.json").read_text())
        assert res["allow_log_streaming"] is False
    server_logs = [p for p in deployment.kits["localhost"].rglob("*.txt") if "log" in p.name]
    assert server_logs
    for p in server_logs:
        text = p.read_text(errors="replace")
        assert "Saved live log" not in text and "Live log stream from" not in text, p
    server = json.loads((deployment.kits["localhost"] / "local" / "resources.json").read_text())
    store = next(c["args"]["uri_root"] for c in server["components"] if c.get("id") == "job_manager")
    stored = [f.name for f in (Path(store) / job_id).rglob("*")] if (Path(store) / job_id).is_dir() else []
    assert not [n for n in stored if "LOG_" in n or n.startswith("log")], stored  # JobLogReceiver's data types


def test_a_site_that_runs_no_custom_code_runs_fedavg_and_fmcl_to_the_end(deployment, site_data, fmcl_run, tmp_path):
    """hospital-a gives no role the right to run custom code: fedmed's jobs carry none (the components are installed
    with fedmed and named by class path), so both workflows finish with hospital-a in every round (FMCL: the shared
    training job)."""
    authz = json.loads((deployment.kits["hospital-a"] / "local" / "authorization.json").read_text())
    assert all(r["byoc"] == "none" for r in authz["permissions"].values())
    cfg = write_config(tmp_path / "cfg.yaml")
    fedavg = submit(deployment, cfg, "FedAvg", tmp_path / "FedAvg", "--jobs-dir", str(tmp_path / "jobs"))
    for method, p, jobs in (("FedAvg", fedavg, tmp_path / "jobs"), ("FMCL", fmcl_run.p, fmcl_run.jobs)):
        res = outcome(p.stdout)
        assert res["status"] == "finished" and res["flare_status"] == "FINISHED:COMPLETED", p.stdout[-3000:]
        doc = record(res)
        assert all("hospital-a" in r["sites"] for r in doc["rounds"]), method
        assert doc["site_policies"]["hospital-a"]["k_min"] == 2  # the effective policy, in the record
        assert not list(jobs.rglob("custom"))  # no code in the jobs
        config = next(jobs.rglob("config_fed_client.json")).read_text()
        assert "fedmed_flare.executor.SiteExecutor" in config


USER_NET = """from torch import nn


class Net(nn.Module):
    def __init__(self, in_channels=1, num_classes=10):
        super().__init__()
        self.fc = nn.Linear(in_channels * 64, num_classes)

    def forward(self, x):
        return self.fc(x.flatten(1))
"""


def test_a_site_that_runs_no_custom_code_refuses_a_job_carrying_a_users_network(deployment, site_data, tmp_path):
    code = tmp_path / "code"
    (code / "hospital_nets").mkdir(parents=True)
    (code / "hospital_nets" / "__init__.py").write_text(USER_NET)
    cfg = write_config(tmp_path / "cfg.yaml", model={"arch": "hospital_nets:Net"}, train={"rounds": 1})
    p = submit(deployment, cfg, "FedAvg", tmp_path / "result", "--sites", "hospital-a", "--jobs-dir",
               str(tmp_path / "jobs"), env={**deployment.env, "PYTHONPATH": str(code)})
    assert list((tmp_path / "jobs").rglob("custom/fedmed_user_code/hospital_nets/__init__.py"))  # the job is BYOC
    res = outcome(p.stdout)
    assert p.returncode == 1 and res["status"] == "failed", p.stdout[-3000:]
    assert "hospital-a" in res["reason"] and "BYOC not permitted" in res["reason"], res["reason"]
    assert "\n" not in res["reason"]


def test_killed_site_job_process_stops_cleanly_and_resumes_without_it(deployment, site_data, tmp_path):
    cfg = write_config(tmp_path / "cfg.yaml", train={"rounds": 10})
    proc = submit(deployment, cfg, "FedAvg", tmp_path / "first", background=True)
    deadline = time.time() + 300
    while len(deployment.server_record().get("rounds", [])) < 3 and time.time() < deadline:
        time.sleep(0.5)
    os.kill(deployment.job_pid("hospital-b"), signal.SIGKILL)
    out, _ = proc.communicate(timeout=600)
    first = outcome(out)
    assert first["status"] == "stopped" and proc.returncode == 1, out[-3000:]
    doc = record(first)
    done = [r["round"] for r in doc["rounds"]]
    assert done == list(range(len(done))) and len(done) >= 3  # every completed round kept, in order
    assert all(r["sites"] for r in doc["rounds"])  # nothing recorded empty
    assert not list(Path(first["result"]).glob("models/*.pt"))  # no model called final

    p = submit(deployment, cfg, "FedAvg", tmp_path / "second", "--resume-from", str(Path(first["result"]).parent),
               "--sites", "hospital-a")
    second = outcome(p.stdout)
    assert second["status"] == "finished", p.stdout[-3000:]
    doc2 = record(second)
    rounds = [(r["round"], r["attempt"]) for r in doc2["rounds"]]
    ck = doc["checkpoint_round"]
    assert [r for r, _ in rounds] == list(range(11))  # rounds 0..R once each
    assert {a for r, a in rounds if r <= ck} == {1} and {a for r, a in rounds if r > ck} == {2}
    assert [a["status"] for a in doc2["attempts"]] == ["stopped", "finished"]
    assert all(sorted(r["sites"]) == ["hospital-a"] for r in doc2["rounds"] if r["attempt"] == 2)
    assert (Path(second["result"]) / "models" / "global.pt").is_file()


def test_suspended_site_is_left_out_after_the_task_timeout_and_rejoins(deployment, site_data, tmp_path):
    # quorum 1: hospital-c never started, so with hospital-b suspended one site answers (with the default
    # quorum of 2 such a round fails the run, which is right and is what the killed-site test exercises)
    cfg = write_config(tmp_path / "cfg.yaml", train={"rounds": 8},
                       federation={"task_timeout": 10, "min_clients": 1})
    proc = submit(deployment, cfg, "FedAvg", tmp_path / "result", background=True)
    deadline = time.time() + 300
    while len(deployment.server_record().get("rounds", [])) < 2 and time.time() < deadline:
        time.sleep(0.5)
    pid = deployment.job_pid("hospital-b")
    os.kill(pid, signal.SIGSTOP)
    t_stop = time.time()
    while not any(e["site"] == "hospital-b" for e in deployment.server_record().get("errors", [])):
        assert time.time() - t_stop < 60, "the round waited past the task timeout"
        time.sleep(0.5)
    os.kill(pid, signal.SIGCONT)
    out, _ = proc.communicate(timeout=600)
    res = outcome(out)
    assert res["status"] == "finished", out[-3000:]
    doc = record(res)
    missed = [e for e in doc["errors"] if e["site"] == "hospital-b"]
    assert missed and all("task_timeout" in e["error"] or "probation" in e["error"] for e in missed)
    assert all(sorted(r["sites"]) == ["hospital-a"] for r in doc["rounds"] if r["round"] in {e["round"] for e in missed})
    assert "hospital-b" in doc["rounds"][-1]["sites"]  # back after SIGCONT


def test_every_site_failing_is_a_failed_run(deployment, site_data, tmp_path):
    """Classes in the config that do not match the sites' labels: every site fails its task; the run fails with
    the reason, FLARE's status shows the failure too, and no final model is saved."""
    cfg = write_config(tmp_path / "cfg.yaml", dataset={"classes": ["0", "1"]})
    p = submit(deployment, cfg, "FedAvg", tmp_path / "result")
    res = outcome(p.stdout)
    assert p.returncode == 1 and res["status"] == "failed" and "fewer than min_clients=2" in res["reason"]
    assert res["flare_status"] != "FINISHED:COMPLETED"
    assert not list(Path(res["result"]).glob("models/*.pt"))
    # every site's error log has the full message now: none of it reached the server (FLARE streams error_log.txt)
    job_id = next(ln.split()[-1] for ln in p.stdout.splitlines() if ln.startswith("submitted job "))
    assert any(p.stat().st_size for p in deployment.kits["hospital-a"].glob(f"{job_id}/error_log.txt"))
    no_site_log_reached_the_server(deployment, job_id)


def test_a_hospital_added_after_training_gets_its_cluster_model(deployment, site_data, fmcl_run, tmp_path):
    """docs/deployment.md, "A hospital joins after training": FMCL trains on hospital-a and -b (the shared training
    job); hospital-d is added to project.yml, provisioned (same root CA) and started with its own data; the onboarding
    job, submitted with the admin's kit, assigns it a cluster and writes the model it uses with `fedmed predict`."""
    cfg, p = fmcl_run.cfg, fmcl_run.p
    trained = outcome(p.stdout)
    assert trained["status"] == "finished", p.stdout[-3000:] + p.stderr[-3000:]
    clusters = record(trained)["clustering"]["clusters"]

    kit = deployment.add_site("hospital-d")
    deployment.allow_fedmed(kit.parent)
    (kit / "local" / "fedmed_site.json").write_text(json.dumps({"datalist": str(site_data / "hospital-c.json")}))
    (kit / "local" / "fedmed_policy.json").write_text(json.dumps({"k_min": 2}))
    deployment.start("hospital-d")
    deployment.wait_connected(["hospital-d"])
    p = submit(deployment, cfg, "FMCL", tmp_path / "onboard", "--onboard", trained["result"], "--sites", "hospital-d")
    res = outcome(p.stdout)
    assert p.returncode == 0 and res["status"] == "finished", p.stdout[-3000:] + p.stderr[-3000:]
    doc = record(res)
    c = doc["assignment"]["test_phase"]["hospital-d"]
    assert 0 <= c < len(clusters) and doc["sites"] == ["hospital-d"]
    # #86: the console says which cluster and model the new site was given (not only metrics.json)
    assert f"onboarded hospital-d: cluster {c}'s model (" in p.stderr and "its model: models/hospital-d.pt" in p.stderr
    assert np.isfinite(doc["rounds"][0]["sites"]["hospital-d"]["accuracy"])
    model = Path(res["result"]) / "models" / "hospital-d.pt"
    image = json.loads((site_data / "hospital-c.json").read_text())["test"][0]["image"]
    image = image if Path(image).is_absolute() else str(site_data / image)
    out = subprocess.run([str(Path(sys.executable).parent / "fedmed"), "predict", str(model), image],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout)[0]["prediction"] in [str(k) for k in range(10)]
