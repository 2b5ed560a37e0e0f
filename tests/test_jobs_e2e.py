"""Real NVFlare runs: the simulator on tiny federations, and one BUSI job folder — built from the config alone,
for sites with hospital names — in the simulator and in POC mode (submitted through the admin API)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fedmed.config import load_config
from fedmed.run.experiment import REPO_ROOT, classes_override, prepare_federation
from fedmed.run.jobs import RunError, run_config_job

from conftest import shared_path

pytestmark = pytest.mark.slow

TINY = {
    "name": "e2e",
    "dataset": {"path": "builtin:digits", "image_size": 8, "channels": 1, "max_per_class": 8},
    "federation": {"sites": 3, "partition": "iid"},
    "model": {"arch": "resnet9", "width": 4},
    "train": {"rounds": 2, "local_epochs": 1, "batch_size": 8},
    "methods": [{"name": "FedAvg", "workflow": "fedavg"}],
    "privacy": {"k_min": 2},
}


def write_cfg(tmp_path, cfg) -> Path:
    p = tmp_path / "cfg.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def test_simulator_fedavg_one_bad_site_does_not_stop_the_federation(tmp_path):
    cfg_path = write_cfg(tmp_path, TINY)
    exp = load_config(cfg_path)
    data = prepare_federation(exp, 0, tmp_path / "data")
    bad_list = data / "site-3.json"
    doc = json.loads(bad_list.read_text())
    corrupt = tmp_path / "corrupt.png"
    corrupt.write_bytes(b"\x89PNG truncated")
    doc["training"][0]["image"] = str(corrupt)
    bad_list.write_text(json.dumps(doc))

    res = run_config_job(str(cfg_path), classes_override(data, exp), "FedAvg", 0, data, tmp_path / "run", 3, timeout=600,
                  log=lambda *a: None)
    assert res["status"] == "finished"
    rounds = res["rounds"]
    assert [r["round"] for r in rounds] == [0, 1, 2] and rounds[-1]["task"] == "validate"
    for r in rounds:  # the two healthy sites are scored every round
        assert sorted(r["sites"]) == ["site-1", "site-2"]
        assert 0.0 <= r["summary"]["mean"]["accuracy"] <= 1.0
    errors = res["errors"]
    assert errors and all(e["site"] == "site-3" for e in errors)
    assert "site-3: training[0]: cannot read the image (corrupt or not an image" in errors[0]["error"]
    assert "corrupt.png" not in json.dumps(errors)  # the file is named in site-3's own log only
    assert str(tmp_path) not in json.dumps(errors)  # no absolute path leaves the site
    assert (tmp_path / "run" / "workspace").exists() is False  # only the server output and logs are kept
    assert (tmp_path / "run" / "server" / "models" / "global.pt").is_file()


@pytest.mark.data
def test_busi_job_for_named_sites_runs_in_simulator_and_poc(tmp_path):
    """A job built from the config alone (no datalists on the coordinator) for sites named like hospitals."""
    busi = shared_path("busi")
    sites = ["hospital-a", "hospital-b"]
    cfg = dict(TINY, name="busi_e2e", dataset={"path": str(busi), "image_size": 24, "channels": 1, "max_per_class": 12,
                                               "classes": ["benign", "malignant", "normal"]},
               federation={"sites": 2, "site_names": sites, "partition": "dirichlet", "alpha": 0.5})
    cfg_path = write_cfg(tmp_path, cfg)
    data = prepare_federation(load_config(cfg_path), 0, tmp_path / "data")
    assert sorted(p.stem for p in data.glob("hospital-*.json")) == sites
    jobs = tmp_path / "jobs"
    out = subprocess.run([sys.executable, str(REPO_ROOT / "jobs" / "build.py"), "--config", str(cfg_path),
                          "--out", str(jobs), "--method", "FedAvg"],
                         capture_output=True, text=True, check=True, cwd=REPO_ROOT)
    job = Path(out.stdout.strip().splitlines()[-1])
    meta = json.loads((job / "meta.json").read_text())
    assert sorted(s for t in meta["deploy_map"].values() for s in t if s != "server") == sites
    assert str(tmp_path) not in "".join(p.read_text() for p in job.rglob("*.json"))  # no data path in the job

    sim = subprocess.run([sys.executable, str(REPO_ROOT / "jobs" / "run.py"), "--config", str(cfg_path), "--method",
                          "FedAvg", "--env", "sim", "--datalists", str(data), "--workspace", str(tmp_path / "sim")],
                         capture_output=True, text=True, timeout=600, cwd=REPO_ROOT)
    assert sim.returncode == 0, sim.stdout[-3000:] + sim.stderr[-2000:]
    res = json.loads(sim.stdout.strip().splitlines()[-1])
    doc = json.loads((Path(res["result"]) / "metrics.json").read_text())
    assert doc["status"] == "finished" and len(doc["rounds"]) == 3 and sorted(doc["rounds"][-1]["sites"]) == sites
    # the finished run's model on BUSI images, as a clinician would apply it
    from fedmed.cli.main import main

    model = Path(res["result"]).parent / "models" / "global.pt"
    if not model.is_file():
        model = next(Path(res["result"]).parent.rglob("models/global.pt"))
    imgs = sorted(p for p in busi.rglob("malignant/*.png") if "_mask" not in p.name)[:2]
    assert main(["predict", str(model), *map(str, imgs), "--out", str(tmp_path / "pred.csv")]) == 0
    lines = (tmp_path / "pred.csv").read_text().splitlines()
    assert lines[0].startswith("image,prediction,benign") and len(lines) == 1 + len(imgs)
    assert all(row.split(",")[1] in ("benign", "malignant", "normal") for row in lines[1:])

    poc = subprocess.run([sys.executable, str(REPO_ROOT / "poc" / "run_poc.py"), str(job), "--datalists", str(data),
                          "--workspace", str(tmp_path / "poc"), "--result-dir", str(tmp_path / "poc_result")],
                         capture_output=True, text=True, timeout=900, cwd=REPO_ROOT)
    assert poc.returncode == 0, poc.stdout[-3000:] + poc.stderr[-3000:]
    result = json.loads(poc.stdout[poc.stdout.rindex("{\n"):])
    assert result["flare_status"] == "FINISHED:COMPLETED" and result["status"] == "finished"
    poc_doc = json.loads(next(Path(result["result"]).rglob("fedmed/metrics.json")).read_text())
    assert len(poc_doc["rounds"]) == 3 and not poc_doc["errors"] and sorted(poc_doc["sites"]) == sites


def test_fmcl_job_clusters_once_and_survives_edge_sites(tmp_path):
    import numpy as np

    from fedmed.data.images import discover

    from fedmed.data.datalists import write_site_datalists

    cfg = dict(TINY, methods=[{"name": "FMCL", "workflow": "fmcl", "encoder": "random_cnn"}],
               federation={"sites": 4, "partition": "iid"}, privacy={"k_min": 3})
    cfg_path = write_cfg(tmp_path, cfg)
    pool = discover("builtin:digits", max_per_class=8)
    y = pool.labels
    parts = [np.flatnonzero(y == 0),                 # a site holding a single class
             np.flatnonzero(y == 1)[:1],             # a site with one image: below k_min, it may send nothing
             np.flatnonzero(np.isin(y, [0, 1, 2])),  # a site whose datalist will name a corrupt image
             np.flatnonzero(np.isin(y, [0, 2, 3]))]
    data = tmp_path / "data"
    write_site_datalists(pool, parts, data, test_fraction=0.25, seed=0)
    doc = json.loads((data / "site-3.json").read_text())
    (tmp_path / "corrupt.png").write_bytes(b"\x89PNG nope")
    doc["training"][1]["image"] = str(tmp_path / "corrupt.png")
    (data / "site-3.json").write_text(json.dumps(doc))

    res = run_config_job(str(cfg_path), [f"dataset.classes={json.dumps(pool.class_names)}"], "FMCL", 0, data,
                  tmp_path / "run", 4, timeout=600, log=lambda *a: None)
    log = res["task_log"]
    assert log[0]["task"] == "signature" and log[0]["sites"] == ["site-1", "site-2", "site-3", "site-4"]
    assert sum(1 for t in log if t["task"] == "signature") == 1  # clustering happens once
    assert {t["task"] for t in log[1:]} == {"train", "validate"}
    clustered = sorted(s for c in res["clustering"]["clusters"] for s in c)
    assert clustered == ["site-1", "site-4"]  # site-3 sent no signature (corrupt image), site-2 nothing (k_min)
    assert any(e["site"] == "site-3" and "training[1]: cannot read the image (corrupt" in e["error"]
               for e in res["errors"])
    assert any(e["site"] == "site-2" and "k_min=3" in e["error"] for e in res["errors"])
    assert res["rounds"][-1]["task"] == "validate" and "site-1" in res["rounds"][-1]["sites"]
    assert (tmp_path / "run" / "server" / "distances.csv").is_file()
    assert res["status"] == "finished"


def test_all_sites_failing_is_a_failed_run(tmp_path):
    """Nothing trained: the run fails with the reason, saves no final model, and fedmed experiment exits non-zero."""
    from fedmed.cli.main import main

    cfg_path = write_cfg(tmp_path, dict(TINY, references=[]))
    exp = load_config(cfg_path)
    data = prepare_federation(exp, 0, tmp_path / "data")
    for s in ("site-1", "site-2", "site-3"):
        doc = json.loads((data / f"{s}.json").read_text())
        for e in doc["training"]:
            e["image"] = str(tmp_path / "missing.png")
        (data / f"{s}.json").write_text(json.dumps(doc))
    with pytest.raises(RunError) as err:
        run_config_job(str(cfg_path), classes_override(data, exp), "FedAvg", 0, data, tmp_path / "run", 3, timeout=600,
                log=lambda *a: None)
    assert err.value.status == "failed" and "fewer than min_clients=1" in err.value.reason
    assert err.value.doc["status"] == "failed" and not list((tmp_path / "run").rglob("global.pt"))
    json.loads((tmp_path / "run" / "server" / "metrics.json").read_text())  # strict JSON (no bare NaN)
    assert "NaN" not in (tmp_path / "run" / "server" / "metrics.json").read_text()
    # the same federation through `fedmed experiment`: exit status 1 and the reason on stderr
    import fedmed.run.experiment as E

    orig = E.prepare_federation
    E.prepare_federation = lambda exp_, seed, out, **kw: data
    try:
        import contextlib
        import io

        err_text = io.StringIO()
        with contextlib.redirect_stderr(err_text):
            rc = main(["experiment", str(cfg_path), "--out", str(tmp_path / "exp")])
    finally:
        E.prepare_federation = orig
    assert rc == 1 and "did not finish" in err_text.getvalue() and "failed" in err_text.getvalue()


def test_seg_fedavg_w_job_assesses_then_down_weights(tmp_path):
    from fedmed.data.phantoms import write_phantom_subjects

    root = write_phantom_subjects(tmp_path / "phantoms", [0, 2, 2, 3, 3, 3, 4, 4, 4, 9, 10, 11], size=24)
    cfg = {"name": "seg_e2e",
           "dataset": {"path": str(root), "task": "segmentation", "modalities": {"FLAIR": "Flair*", "T1c": "T1c*"},
                       "label_pattern": "OTMultiClass*", "mask_pattern": "brainmask*", "shape": [16, 16, 16],
                       "roi": [16, 16, 16]},
           "federation": {"sites": 4, "partition": "label_volume", "test_fraction": 0.34},
           "model": {"channels": [4, 8, 16]},
           "train": {"rounds": 2, "local_epochs": 1},
           "privacy": {"k_min": 2},
           "methods": [{"name": "FedAvg_w", "workflow": "fedavg_w", "omega": 0.3}]}
    cfg_path = write_cfg(tmp_path, cfg)
    data = prepare_federation(load_config(cfg_path), 0, tmp_path / "data")
    doc = json.loads((data / "site-2.json").read_text())
    doc["training"][0]["label"] = str(tmp_path / "missing_label.nii.gz")  # this site cannot load its data
    (data / "site-2.json").write_text(json.dumps(doc))

    res = run_config_job(str(cfg_path), [], "FedAvg_w", 0, data, tmp_path / "run", 4, timeout=900, log=lambda *a: None)
    assert res["assessment"]["emd"]["most_distant"] == "site-4"
    assert res["down_weighted"] == {"site": "site-4", "omega": 0.3, "source": "assessment (emd)"}
    assert [t["task"] for t in res["task_log"]][:2] == ["assess", "train"]
    err = next(e["error"] for e in res["errors"] if e["site"] == "site-2")
    assert "site-2: training[0]: its label file not found" in err and "missing_label" not in err, err  # no path
    final = res["rounds"][-1]
    assert final["task"] == "validate" and sorted(final["sites"]) == ["site-1", "site-3", "site-4"]
    assert "dice_mean" in final["summary"]["mean"]
    assert (tmp_path / "run" / "server" / "assessment" / "report.md").is_file()


@pytest.mark.parametrize("method", [{"name": "Flux", "workflow": "flux"},
                                    {"name": "IFCA", "workflow": "ifca", "n_clusters": 2}])
def test_flux_unseen_site_goes_to_its_groups_cluster(tmp_path, method):
    from fedmed.run.experiment import run_experiment

    cfg = {"name": "flux_e2e",
           "dataset": {"path": "builtin:digits", "image_size": 12, "channels": 3, "max_per_class": 60},
           "federation": {"sites": 6, "unseen_sites": 2, "partition": "anda", "anda_shift": "feature",
                          "anda_level": 5, "anda_groups": 2},
           "model": {"arch": "resnet9", "width": 4},
           "train": {"rounds": 3, "local_epochs": 1, "batch_size": 16},
           "privacy": {"k_min": 2},
           "references": [],
           "methods": [method]}
    cfg_path = write_cfg(tmp_path, cfg)
    rows = run_experiment(str(cfg_path), tmp_path / "out", log=lambda *a: None)
    run = tmp_path / "out" / "runs" / "seed0" / method["name"]
    train = json.loads((run / "metrics.json").read_text())
    test = json.loads((run / "test_phase" / "metrics.json").read_text())
    meta = json.loads((tmp_path / "out" / "data" / "seed0" / "dataset.json").read_text())
    phases = {r["phase"] for r in rows if r.get("phase")}
    # the assigned model, the true group's, and every cluster model as a reference (IFCA: also its ensemble)
    n_models = len(list((run / "server" / "models").glob("cluster*.pt")))
    assert phases == {"test phase", "known assoc.", "oracle", *(f"cluster model {c}" for c in range(n_models))} | (
        {"ensemble"} if method["workflow"] == "ifca" else set())
    assert sorted(p.name for p in (run / "test_phase" / "server" / "models").glob("*.pt")) == [f"{u}.pt" for u in meta["unseen_sites"]]
    assert sorted(test["rounds"][0]["sites"]) == meta["unseen_sites"]
    if method["workflow"] == "flux":
        assign = train["assignment"]
        groups = meta["groups"]
        # the two colour/rotation groups are found exactly
        assert all((assign[a] == assign[b]) == (groups[a] == groups[b]) for a in assign for b in assign)
        got = test["assignment"]["test_phase"]
        for u in meta["unseen_sites"]:
            same_group = {assign[s] for s in assign if groups[s] == groups[u]}
            assert got[u] in same_group  # the unseen site joins its group's cluster
        assert train["clustering"]["descriptor_to_model_ratio"] < 1e-2
    assert "summary.md" in {p.name for p in (tmp_path / "out").iterdir()}
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "| Assigned model acc | Known assoc. acc | Oracle: best cluster model acc |" in summary
    oracle = [r["accuracy"] for r in rows if r.get("phase") == "oracle"]
    each = [r["accuracy"] for r in rows if str(r.get("phase", "")).startswith("cluster model")]
    assert oracle and oracle[0] >= max(each) - 1e-9  # per site the best of the cluster models
    if method["workflow"] == "flux":  # fedmed experiment --in-process: the same jobs without FLARE, the same rows
        lines = []
        again = run_experiment(str(cfg_path), tmp_path / "out_ip", log=lines.append, in_process=True)
        assert not list((tmp_path / "out_ip" / "runs" / "seed0" / "Flux").glob("simulator.log"))  # no simulator ran
        assert any("round 2/3 train" in ln for ln in lines)  # a line per round, as from the simulator

        def key(rr):
            return [(r["method"], r["round"], r.get("phase"), r.get("accuracy"), r.get("auc")) for r in rr]

        assert key(again) == key(rows)
        assert json.loads((tmp_path / "out_ip" / "runs" / "seed0" / "Flux" / "metrics.json").read_text())[
            "assignment"] == train["assignment"]


def test_a_site_that_sat_out_every_round_is_named_in_the_status_and_not_in_the_model(tmp_path):
    """One missing image made site-3 sit out every round, yet the run said {"status": "finished", "reason": ""}
    and models/global.pt listed all three sites. Now: finished, with the missing site and why in the reason, the
    record's sites_missing and jobs/run.py's console; the model names the two sites that trained it."""
    import torch

    cfg_path = write_cfg(tmp_path, TINY)
    exp = load_config(cfg_path)
    data = prepare_federation(exp, 0, tmp_path / "data")
    doc = json.loads((data / "site-3.json").read_text())
    doc["training"][0]["image"] = "images/site-3/gone.png"
    (data / "site-3.json").write_text(json.dumps(doc))
    cmd = [sys.executable, str(REPO_ROOT / "jobs" / "run.py"), "--config", str(cfg_path), "--method", "FedAvg",
           "--env", "sim", "--datalists", str(data), "--workspace", str(tmp_path / "ws"),
           *[x for o in classes_override(data, exp) for x in ("--set", o)]]
    res = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    said = "site-3 sat out round(s) 0-2 (site-3: training[0]: cannot read the image (file not found))"
    assert out["status"] == "finished" and said in out["reason"]
    assert set(out["sites_missing"]) == {"site-3"} and out["sites_missing"]["site-3"]["rounds"] == [0, 1, 2]
    assert said in res.stderr  # the console
    assert "Traceback (most recent call last)" not in res.stdout + res.stderr
    # #56: quiet by default — FLARE's ~70 lines go to the workspace's simulator.log, a line per round is printed —
    # and the simulated sites run fedmed experiment's policy (the config's k_min 2, not the default floor 5)
    printed = res.stdout.strip().splitlines()
    assert len(printed) <= 6 and printed[0].startswith("simulator: 3 site(s); FLARE's log:"), printed
    assert [ln.split(":")[0].strip() for ln in printed[1:-1]] == ["round 0/2 train", "round 1/2 train",
                                                                  "round 2/2 validate"], printed
    flare_log = (tmp_path / "ws" / "simulator.log").read_text()
    assert "Sending task train to" in flare_log and "applies k_min=5" not in flare_log
    # #56: the site's own log has its error as one line (its file named relative to its data root), no traceback
    log = next((tmp_path / "ws").rglob("site-3/log.txt")).read_text()
    errors = [ln for ln in log.splitlines() if "[fedmed] site-3:" in ln]
    assert errors and all(ln.endswith("[fedmed] site-3: training[0]: cannot read image images/site-3/gone.png (file not found)")
                          for ln in errors), errors
    assert "Traceback (most recent call last)" not in log
    record = json.loads((Path(out["result"]) / "metrics.json").read_text())
    assert record["status"] == "finished" and said in record["reason"]
    model = torch.load(Path(out["result"]) / "models" / "global.pt", weights_only=True)
    assert model["sites"] == ["site-1", "site-2"]


@pytest.mark.data
def test_fmcl_on_busi_with_the_usfm_encoder_and_its_preprocessing(tmp_path):
    """FMCL's signatures from USFM (its ViT-B/16 as released; random weights here) at 224 px with ImageNet
    normalisation, end to end in the simulator: every site sends a signature, the server clusters, clusters train."""
    busi = shared_path("busi")
    cfg = dict(TINY, name="busi_usfm", dataset={"path": str(busi), "image_size": 24, "channels": 1, "max_per_class": 9,
                                                "classes": ["benign", "malignant", "normal"]},
               federation={"sites": 3, "partition": "dirichlet", "alpha": 0.3},
               methods=[{"name": "FMCL", "workflow": "fmcl", "encoder": "usfm", "n_clusters": 2}],
               train={"rounds": 1, "local_epochs": 1, "batch_size": 8}, privacy={"k_min": 2})
    cfg_path = write_cfg(tmp_path, cfg)
    exp = load_config(cfg_path)
    data = prepare_federation(exp, 0, tmp_path / "data")
    res = run_config_job(str(cfg_path), classes_override(data, exp), "FMCL", 0, data, tmp_path / "run", 3, timeout=900,
                  log=lambda *a: None)
    assert res["status"] == "finished" and not res["errors"], res.get("errors")
    clustering = res["clustering"]
    assert sorted(s for c in clustering["clusters"] for s in c) == ["site-1", "site-2", "site-3"]
    (enc,) = clustering["encoder"]
    assert enc.startswith("usfm [random init (seed=0)") and "input ImageNet mean/std" in enc
    assert res["rounds"][-1]["task"] == "validate"


def test_no_name_of_a_sites_data_reaches_the_flare_servers_files(tmp_path):
    """The probe's four leaks at four sites of one simulated federation — a patient-named folder, an entry with extra
    fields, a label value, a Windows path: the server's record, reports and FLARE's own server log hold none of them;
    each site's log names its file or value."""
    from test_policy import SECRETS, break_with_names

    cfg_path = write_cfg(tmp_path, dict(TINY, federation={"sites": 5, "partition": "iid", "min_clients": 1}))
    exp = load_config(cfg_path)
    data = prepare_federation(exp, 0, tmp_path / "data")
    for site, kind in zip(("site-2", "site-3", "site-4", "site-5"),
                          ("patient_folder", "entry_with_extra_fields", "label_value", "windows_path")):
        break_with_names(data, site, kind)
    ws = tmp_path / "ws"
    sim = subprocess.run([sys.executable, str(REPO_ROOT / "jobs" / "run.py"), "--config", str(cfg_path), "--method",
                          "FedAvg", "--env", "sim", "--datalists", str(data), "--workspace", str(ws), "--set",
                          'dataset.classes=["0","1","2","3","4","5","6","7","8","9"]', "--site-policy", "simulation"],
                         capture_output=True, text=True, timeout=600, cwd=REPO_ROOT)
    res = json.loads(sim.stdout.strip().splitlines()[-1])
    assert res["status"] == "finished", sim.stdout[-3000:] + sim.stderr[-2000:]
    doc = json.loads((Path(res["result"]) / "metrics.json").read_text())
    assert sorted({e["site"] for e in doc["errors"]}) == ["site-2", "site-3", "site-4", "site-5"]
    server = next(ws.glob("*/server"))
    written = "".join(f.read_text(errors="replace") for f in server.rglob("*") if f.is_file() and f.suffix in
                      (".json", ".txt", ".log", ".md", ".html", ".csv"))
    assert "training[0]" in written and not [s for s in SECRETS if s in written]
    sites = "".join(f.read_text(errors="replace") for f in ws.rglob("site-*/**/log.txt"))
    assert "Doe" in sites  # each site's own log has the names


def test_fedmed_experiment_and_job_run_take_relative_paths_from_any_folder(tmp_path):
    """`fedmed experiment cfg.yaml` failed outside the repository ("cfg.yaml: config file not found") and `fedmed job
    run` outside it built a job without its site script; both run from the caller's folder with relative paths."""
    elsewhere = tmp_path / "study"
    elsewhere.mkdir()
    (elsewhere / "cfg.yaml").write_text(yaml.safe_dump(dict(TINY, train={**TINY["train"], "rounds": 1},
                                                            references=[], seeds=[0])))
    fedmed = str(Path(sys.executable).parent / "fedmed")
    p = subprocess.run([fedmed, "experiment", "cfg.yaml", "--out", "out"], cwd=elsewhere, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert (elsewhere / "out" / "results.csv").is_file() and (elsewhere / "out" / "runs").is_dir()
    p = subprocess.run([fedmed, "data", "--config", "cfg.yaml", "--out", "dl"], cwd=elsewhere, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    p = subprocess.run([fedmed, "job", "run", "--config", "cfg.yaml", "--method", "FedAvg", "--env", "sim",
                        "--datalists", "dl", "--workspace", "ws", "--site-policy", "simulation", "--set",
                        'dataset.classes=["0","1","2","3","4","5","6","7","8","9"]'], cwd=elsewhere,
                       capture_output=True, text=True, timeout=600)
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert p.returncode == 0 and res["status"] == "finished", p.stdout[-2000:] + p.stderr[-2000:]
    assert Path(res["result"]).is_relative_to(elsewhere / "ws")


def test_poc_start_timeout_error_carries_each_participants_console_log(tmp_path):
    """When POC sites do not connect in time, run_poc's error ends with every participant's console log tail."""
    sys.path.insert(0, str(REPO_ROOT / "poc"))
    try:
        import run_poc
    finally:
        sys.path.remove(str(REPO_ROOT / "poc"))
    for name, text in (("server", "listening\n"), ("hospital-a", "\n".join(f"line {i}" for i in range(40)))):
        d = tmp_path / "example_project" / "prod_00" / name
        d.mkdir(parents=True)
        (d / "poc_console.log").write_text(text)
    tails = run_poc.console_tails(tmp_path, lines=5)
    assert "--- hospital-a/poc_console.log ---\nline 35\n" in tails and "line 34" not in tails
    assert "--- server/poc_console.log ---\nlistening" in tails
    assert run_poc.console_tails(tmp_path / "none") == "(no POC console logs)"
