"""The server workflows (fedmed.workflows) on both federations: FLARE's simulator and the in-process one."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def _fmcl_federation(tmp_path, rounds=2):
    from fedmed.config import load_config
    from fedmed.run.experiment import classes_override, prepare_federation

    raw = {"name": "wf", "dataset": {"path": "builtin:digits", "image_size": 8, "channels": 1, "max_per_class": 16},
           "federation": {"sites": 4, "partition": "dirichlet", "alpha": 0.1},
           "model": {"arch": "resnet9", "width": 4},
           "train": {"rounds": rounds, "local_epochs": 1, "batch_size": 16}, "privacy": {"k_min": 2},
           "methods": [{"name": "FMCL", "workflow": "fmcl", "encoder": "random_cnn", "n_clusters": 2}]}
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    exp = load_config(cfg)
    data = prepare_federation(exp, 0, tmp_path / "data")
    overrides = classes_override(data, exp)
    return cfg, load_config(cfg, overrides), data, overrides


def _models(folder: Path) -> dict:
    import torch

    return {p.name: {k: v.numpy() for k, v in torch.load(p, weights_only=True)["state_dict"].items()}
            for p in sorted(folder.glob("*.pt"))}


@pytest.mark.slow
def test_a_clustered_workflow_gives_the_same_models_in_process_and_in_flares_simulator(tmp_path):
    """FMCL (signatures, clustering, FedAvg per cluster) run through the in-process federation and through FLARE's
    simulator: the same clusters and the same final models, bit for bit (the same workflow code; the same site reply
    loop)."""
    import subprocess

    from fedmed.run.taskconfig import build_task_config
    from fedmed.workflows import InProcessFederation, server_workflow
    from fedmed.methods import server_workflow_path

    def workflow_args(exp, m, seed, cfg=None):
        return server_workflow_path(type(m)), m.workflow_options(exp, seed)

    cfg_path, exp, data, overrides = _fmcl_federation(tmp_path)
    method = exp.methods[0]
    sites = exp.site_names()
    ws = tmp_path / "ws"
    p = subprocess.run([sys.executable, str(ROOT / "jobs" / "run.py"), "--config", str(cfg_path), "--method", "FMCL",
                        "--env", "sim", "--datalists", str(data), "--workspace", str(ws),
                        "--site-policy", "simulation",  # the sites' policy the in-process federation applies too
                        *[x for o in overrides for x in ("--set", o)]],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    sim = next(ws.glob("*/server/simulate_job/fedmed"))

    task_cfg = build_task_config(exp, 0, method, sites)
    name, args = workflow_args(exp, method, 0, task_cfg)
    fed = InProcessFederation(data, sites, tmp_path / "inproc", log=None)
    status = fed.run(server_workflow(name)(exp.train.rounds, task_cfg, **args))
    assert status == "finished"

    sim_doc = json.loads((sim / "metrics.json").read_text())
    ours = fed.recorder.doc
    assert ours["clustering"]["clusters"] == sim_doc["clustering"]["clusters"]
    assert len(ours["clustering"]["clusters"]) == 2
    a, b = _models(sim / "models"), _models(tmp_path / "inproc" / "models")
    assert sorted(a) == sorted(b) == ["cluster0.pt", "cluster1.pt", "selected_cluster0.pt", "selected_cluster1.pt"]
    for f in a:
        assert a[f].keys() == b[f].keys()
        for k in a[f]:
            assert np.array_equal(a[f][k], b[f][k]), (f, k)
    # and the rounds each site reported agree too
    for r_sim, r_ours in zip(sim_doc["rounds"], ours["rounds"]):
        assert r_sim["sites"].keys() == r_ours["sites"].keys()
        for s in r_sim["sites"]:
            assert r_sim["sites"][s]["accuracy"] == r_ours["sites"][s]["accuracy"]


def test_every_task_a_method_sends_is_served_by_its_sites_runner_and_no_other(tmp_path):
    """The registry's site tasks of each method are exactly what its site runner serves for them; a segmentation or
    Fed-MAE site refuses a classification-only task by name instead of inheriting it."""
    from fedmed.site.mae import MAESiteRunner
    from fedmed.methods import METHODS
    from fedmed.site.runner import SiteRunner, TaskError
    from fedmed.site.seg import SegSiteRunner
    from fedmed.site.tasks import PLUGIN_TASKS

    runner_of = {"classification": SiteRunner, "segmentation": SegSiteRunner}
    for name, entry in METHODS.items():
        for served in entry.serves:
            cls = MAESiteRunner if name == "fedmae" else runner_of[served]
            assert set(entry.site_tasks) <= set(cls.TASKS) | set(PLUGIN_TASKS[cls.KIND]), (name, served)
    assert set(SegSiteRunner.TASKS) == {"assess", "train", "validate"}
    assert set(MAESiteRunner.TASKS) == {"train", "validate"}
    (tmp_path / "site-1.json").write_text(json.dumps({"training": [], "validation": [], "test": []}))
    with pytest.raises(TaskError, match="unknown task 'signature'.*SegSiteRunner serves assess, train, validate"):
        SegSiteRunner("site-1", tmp_path).run_task("signature", {}, {})


@pytest.mark.slow
def test_a_workflow_adds_to_its_tasks_but_never_changes_its_config(tmp_path):
    """Fine-tuning with PreP-WFL (001_ Alg. 2) sends its class weights with every training task after the statistics
    round; the config it was given stays as it was (read-only), and the record keeps the given one."""
    import copy

    from fedmed.config import load_config
    from fedmed.run.experiment import classes_override, prepare_federation
    from fedmed.run.taskconfig import build_task_config
    from fedmed.workflows import InProcessFederation, server_workflow
    from fedmed.methods import server_workflow_path

    def workflow_args(exp, m, seed, cfg=None):
        return server_workflow_path(type(m)), m.workflow_options(exp, seed)

    raw = {"name": "ft", "dataset": {"path": "builtin:digits", "image_size": 32, "channels": 1, "max_per_class": 12},
           "federation": {"sites": 2, "partition": "iid"}, "model": {"arch": "vit_small"},
           "train": {"rounds": 1, "local_epochs": 1, "batch_size": 16}, "privacy": {"k_min": 2},
           "methods": [{"name": "PreP", "workflow": "finetune", "init": "random", "prep_wfl": True}]}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    exp = load_config(tmp_path / "c.yaml")
    data = prepare_federation(exp, 0, tmp_path / "data")
    exp = load_config(tmp_path / "c.yaml", classes_override(data, exp))
    method, sites = exp.methods[0], exp.site_names()
    cfg = build_task_config(exp, 0, method, sites)
    given = copy.deepcopy(cfg)
    sent = []

    class Watching(InProcessFederation):
        def send_groups(self, task_name, groups):
            sent.extend((task_name, msg.config) for msg, _ in groups.values())
            return super().send_groups(task_name, groups)

    name, args = workflow_args(exp, method, 0, cfg)
    wf = server_workflow(name)(exp.train.rounds, cfg, **args)
    fed = Watching(data, sites, tmp_path / "run", log=None)
    assert fed.run(wf) == "finished"
    weights = fed.recorder.doc["prep_wfl"]["weights"]
    assert [t for t, _ in sent] == ["class_set", "train", "validate"]
    assert "class_weights" not in sent[0][1] and all(c["class_weights"] == weights for _, c in sent[1:])
    assert cfg == given and dict(wf.cfg) == given and fed.recorder.doc["meta"]["config"] == given
    with pytest.raises(TypeError):
        wf.cfg["class_weights"] = weights


def test_cluster_models_start_from_the_fedavg_warm_up(tmp_path):
    """``fedavg_warmup`` W: rounds 0..W-1 are FedAvg of the whole federation, and every cluster model starts round W
    from that model — so in round W each site is served exactly what plain FedAvg serves it in round W (from scratch,
    a cluster model serves the untrained network instead)."""
    from fedmed.run.taskconfig import build_task_config
    from fedmed.workflows import InProcessFederation, server_workflow
    from fedmed.methods import server_workflow_path

    def workflow_args(exp, m, seed, cfg=None):
        return server_workflow_path(type(m)), m.workflow_options(exp, seed)

    _, exp, data, _ = _fmcl_federation(tmp_path, rounds=3)
    method, sites = exp.methods[0], exp.site_names()
    cfg = build_task_config(exp, 0, method, sites)
    name, args = workflow_args(exp, method, 0, cfg)

    def served(workflow, out):
        fed = InProcessFederation(data, sites, tmp_path / out, log=None)
        assert fed.run(workflow) == "finished"
        return fed.recorder.doc

    fedavg = served(server_workflow("fedmed.workflows.fedavg:FedAvg")(3, cfg), "fedavg")
    warm = served(server_workflow(name)(3, cfg, **{**args, "fedavg_warmup": 2}), "warm")
    cold = served(server_workflow(name)(3, cfg, **args), "cold")
    assert [r["task"] for r in warm["rounds"]] == ["train", "train", "train", "validate"]
    assert all(v.get("cluster") is None for r in warm["rounds"][:2] for v in r["sites"].values())
    assert {v["cluster"] for v in warm["rounds"][2]["sites"].values()} == {0, 1}
    for s in sites:
        assert warm["rounds"][2]["sites"][s]["accuracy"] == fedavg["rounds"][2]["sites"][s]["accuracy"]
    assert any(cold["rounds"][2]["sites"][s]["accuracy"] != fedavg["rounds"][2]["sites"][s]["accuracy"] for s in sites)
    with pytest.raises(ValueError, match="fedavg_warmup=3 should be at least 0 and below train.rounds=3"):
        server_workflow(name)(3, cfg, **{**args, "fedavg_warmup": 3})
    # and a config asking for it is refused when it loads, naming the method
    from fedmed.config import ConfigError, load_config

    raw = yaml.safe_load((tmp_path / "c.yaml").read_text())
    raw["methods"][0]["fedavg_warmup"] = 3
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match="method 'FMCL': fedavg_warmup=3 should be below train.rounds=3"):
        load_config(tmp_path / "bad.yaml")
