"""A new site gets the cluster model that fits it (fedmed.workflows.onboard), in every workflow that ends with clusters.

Each clustered method trains in-process on a small real federation with known groups (scikit-learn's handwritten
digits, ANDA label shift: two groups holding different classes; BraTS-2013 for 004_), two held-out sites (one per
group) are onboarded from the finished run's result folder — what an onboarding job carries — and each must be
assigned the cluster of its own group. The FLARE paths (simulator, provisioned sites) are in test_jobs_e2e.py and
test_deployment.py.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from fedmed.run.followups import Onboarding

ROOT = Path(__file__).resolve().parents[1]
BRATS = ROOT.parent / "shared" / "data" / "brats2013"

METHODS = [{"name": "FMCL", "workflow": "fmcl", "encoder": "random_cnn", "n_clusters": 2},
           {"name": "PACFL", "workflow": "pacfl", "encoder": "random_cnn", "n_clusters": 2},
           {"name": "FECFL", "workflow": "fecfl", "encoder": "random_cnn", "n_clusters": 2},
           {"name": "IFCA", "workflow": "ifca", "n_clusters": 2},
           # split whenever a cluster has more than two sites (the criterion is tested in test_clustered.py)
           {"name": "CFL", "workflow": "cfl", "cfl_eps1": 1e9, "cfl_eps2": 1e-6, "warmup_rounds": 2},
           # Flux-prior (K given): on 6 small sites Flux's adaptive DBSCAN finds one cluster, which onboarding would
           # trivially get right
           {"name": "Flux", "workflow": "flux", "n_clusters": 2},
           {"name": "FedAvg", "workflow": "fedavg"}]


@pytest.fixture(scope="module")
def federation(tmp_path_factory):
    from fedmed.config import load_config
    from fedmed.run.experiment import classes_override, prepare_federation

    tmp = tmp_path_factory.mktemp("onboard")
    raw = {"name": "onboard", "dataset": {"path": "builtin:digits", "image_size": 8, "channels": 1, "max_per_class": 40},
           "federation": {"sites": 6, "partition": "anda", "anda_shift": "label", "anda_level": 6, "anda_groups": 2,
                          "unseen_sites": 2},
           "model": {"arch": "resnet9", "width": 4}, "train": {"rounds": 4, "local_epochs": 2, "batch_size": 16},
           "privacy": {"k_min": 2}, "methods": METHODS}
    cfg = tmp / "c.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    exp = load_config(cfg)
    data = prepare_federation(exp, 0, tmp / "data")
    over = classes_override(data, exp)
    meta = json.loads((data / "dataset.json").read_text())
    assert sorted(meta["unseen_sites"]) == ["unseen-1", "unseen-2"]
    assert {meta["groups"][u] for u in meta["unseen_sites"]} == {0, 1}  # one new site per group
    return {"cfg": cfg, "exp": load_config(cfg, over), "over": over, "data": data, "meta": meta, "tmp": tmp}


def train(fed, method_name: str, out: Path, sites=None):
    from fedmed.run.taskconfig import build_task_config
    from fedmed.workflows import InProcessFederation, server_workflow
    from fedmed.methods import server_workflow_path

    def workflow_args(exp, m, seed, cfg=None):
        return server_workflow_path(type(m)), m.workflow_options(exp, seed)

    exp = fed["exp"]
    m = next(m for m in exp.methods if m.name == method_name)
    sites = sites or exp.site_names()
    cfg = build_task_config(exp, 0, m, sites)
    name, args = workflow_args(exp, m, 0, cfg)
    f = InProcessFederation(fed["data"], sites, out, log=None)
    assert f.run(server_workflow(name)(exp.train.rounds, cfg, **args)) == "finished"
    return m


def onboard(exp, data, m, result: Path, new_sites, out: Path, **kw):
    """The onboarding job's server side, in this process: the training result checked and carried as a job carries it."""
    from fedmed.run.taskconfig import build_task_config
    from fedmed.methods import server_workflow_path
    from fedmed.workflows import InProcessFederation
    from fedmed.workflows.onboard import TRAINING_DIR, Onboard, check_training_result, training_files

    training = server_workflow_path(type(m))
    folder = check_training_result(result, m.workflow, training, onboards=type(m).onboards,
                                   clustered=type(m).clustered, require_clusters=kw.pop("require_clusters", True))
    app = out.parent / (out.name + "_app")
    (app / TRAINING_DIR).mkdir(parents=True)
    for f in training_files(folder):
        shutil.copy(f, app / TRAINING_DIR / f.name)
    f = InProcessFederation(data, new_sites, out, job_files=app, log=None)
    status = f.run(Onboard(1, build_task_config(exp, 0, m, new_sites), training=training, **kw))
    return status, f.recorder.doc


@pytest.mark.parametrize("name", [m["name"] for m in METHODS if m["workflow"] != "fedavg"])
def test_a_held_out_site_is_assigned_its_groups_cluster(federation, name, tmp_path):
    from fedmed.nn.predict import load_model

    m = train(federation, name, tmp_path / "train")
    groups, unseen = federation["meta"]["groups"], federation["meta"]["unseen_sites"]
    st = json.loads((tmp_path / "train" / "onboarding.json").read_text())
    clusters = {int(c): s for c, s in st["clusters"].items() if s}
    assert len(clusters) >= 2  # the method did cluster (else any assignment would be right)
    for members in clusters.values():  # ... by group: every cluster is one group's
        assert len({groups[s] for s in members}) == 1, st["clusters"]
    status, doc = onboard(federation["exp"], federation["data"], m, tmp_path / "train", unseen, tmp_path / "onboard",
                          references=True)
    assert status == "finished", doc.get("reason")
    assign = doc["assignment"]["test_phase"]
    assert sorted(assign) == unseen
    for u, c in assign.items():
        assert {groups[s] for s in clusters[c]} == {groups[u]}, (u, c, st["clusters"])
    # scored with the assigned model and, as references, with every cluster model
    tasks = [r["task"] for r in doc["rounds"]]
    assert tasks[0] == "test_phase" and {f"cluster{c}" for c in clusters} <= set(tasks)
    for u in unseen:
        assert np.isfinite(doc["rounds"][0]["sites"][u]["accuracy"])
        saved = load_model(tmp_path / "onboard" / "models" / f"{u}.pt")  # what `fedmed predict --model` loads
        assert saved is not None
    label_free = m.workflow in ("fecfl", "flux")  # FMCL's prototypes and PACFL's subspaces are per class
    assert doc["assignment"]["label_free"] is label_free
    assert doc["assignment"]["evaluated_on"] == ("all data" if label_free else "test split")


def test_label_using_onboarding_is_scored_on_the_test_split_label_free_on_all_data(federation, tmp_path):
    """The reading (docs/readings.md, "Onboarding"): FMCL's prototypes use the new site's training labels, so its
    model is scored on the test split only; FECFL (label-free) on all the site's data, as Flux's test phase. The
    number of images each was scored on pins it: it fails under the other reading."""
    unseen = federation["meta"]["unseen_sites"]
    n = {}
    for name in ("FMCL", "FECFL"):
        m = train(federation, name, tmp_path / name)
        _, doc = onboard(federation["exp"], federation["data"], m, tmp_path / name, unseen, tmp_path / f"{name}_ob")
        n[name] = {u: doc["rounds"][0]["sites"][u]["n_test"] for u in unseen}
    for u in unseen:
        dl = json.loads((federation["data"] / f"{u}.json").read_text())
        assert n["FMCL"][u] == len(dl["test"])
        assert n["FECFL"][u] == len(dl["training"]) + len(dl["validation"]) + len(dl["test"])


def test_linkage_decides_between_a_near_member_and_a_near_cluster():
    """Average linkage (FMCL's default) compares mean distances; single linkage the nearest member."""
    from fedmed.workflows.onboard import assign_by_linkage

    row = {"a1": 0.1, "a2": 0.9, "a3": 0.9, "b1": 0.3, "b2": 0.3}
    clusters = {0: ["a1", "a2", "a3"], 1: ["b1", "b2"]}
    assert assign_by_linkage(row, clusters, "average")[0] == 1
    assert assign_by_linkage(row, clusters, "single")[0] == 0
    assert assign_by_linkage(row, clusters, "complete")[0] == 1


# ------------------------------------------------------------------ bad input: one line naming it

def _finished_fmcl(federation, tmp_path):
    train(federation, "FMCL", tmp_path / "train")
    return tmp_path / "train"


def build(federation, *args):
    return subprocess.run([sys.executable, str(ROOT / "jobs" / "build.py"), "--config", str(federation["cfg"]),
                           *[x for o in federation["over"] for x in ("--set", o)], *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_onboarding_bad_input_is_one_line_naming_it(federation, tmp_path):
    result = _finished_fmcl(federation, tmp_path)
    # a run that did not finish
    unfinished = tmp_path / "unfinished"
    shutil.copytree(result, unfinished)
    doc = json.loads((unfinished / "metrics.json").read_text())
    doc.update(status="failed", reason="round 2 (train): 1 site(s) answered, fewer than min_clients=2")
    (unfinished / "metrics.json").write_text(json.dumps(doc))
    p = build(federation, "--method", "FMCL", "--out", str(tmp_path / "jobs"), "--onboard", str(unfinished),
              "--sites", "unseen-1")
    assert p.returncode == 2
    assert p.stderr.strip().count("\n") == 0
    assert "unfinished: the training run did not finish (status failed: round 2" in p.stderr
    # a method with no clusters
    p = build(federation, "--method", "FedAvg", "--out", str(tmp_path / "jobs"), "--onboard", str(result),
              "--sites", "unseen-1")
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0
    assert "workflow 'fedavg' ends with one model and no clusters" in p.stderr
    # a run of another method
    p = build(federation, "--method", "PACFL", "--out", str(tmp_path / "jobs"), "--onboard", str(result),
              "--sites", "unseen-1")
    assert p.returncode == 2 and "a run of fmcl, not of workflow 'pacfl'" in p.stderr  # the same server workflow
    # no new site named
    p = build(federation, "--method", "FMCL", "--out", str(tmp_path / "jobs"), "--onboard", str(result))
    assert p.returncode == 2 and "--onboard needs --sites" in p.stderr
    # and a good one builds
    p = build(federation, "--method", "FMCL", "--out", str(tmp_path / "jobs"), "--onboard", str(result),
              "--sites", "unseen-1", "unseen-2")
    assert p.returncode == 0, p.stderr
    job = Path(p.stdout.strip().splitlines()[-1])
    # the finished run's models travel to the server as data (its app's config/ folder): the job carries no code
    assert list(job.rglob("config/fedmed_files/training/onboarding.json"))
    assert list(job.rglob("config/fedmed_files/training/cluster0.pt")) and not list(job.rglob("custom"))


def test_a_new_site_with_a_class_the_run_never_saw_is_one_line_naming_it(federation, tmp_path):
    result = _finished_fmcl(federation, tmp_path)
    data = tmp_path / "data"
    shutil.copytree(federation["data"], data)
    dl = json.loads((data / "unseen-1.json").read_text())
    for e in dl["training"][:3]:
        e["label"] = 11  # a class id the run's label space (digits 0-9) does not have
    (data / "unseen-1.json").write_text(json.dumps(dl))
    m = next(m for m in federation["exp"].methods if m.name == "FMCL")
    status, doc = onboard(federation["exp"], data, m, result, ["unseen-1"], tmp_path / "ob")
    assert status == "failed"
    err = next(e["error"] for e in doc["errors"] if e["site"] == "unseen-1")
    assert "\n" not in err and "unseen-1: training[0]: a label outside the job's global label space 0..9" in err, err
    assert "[11]" not in err  # the label value stays in the site's log
    assert "unseen-1" in doc["reason"]
    # with another new site that is fine, the onboarding goes on for it
    status, doc = onboard(federation["exp"], data, m, result, ["unseen-1", "unseen-2"], tmp_path / "ob2")
    assert status == "finished" and sorted(doc["assignment"]["test_phase"]) == ["unseen-2"]


def test_unseen_sites_for_every_partition(tmp_path):
    """``federation.unseen_sites`` holds sites out of training for Dirichlet and PreDi federations too (groups unknown)."""
    from fedmed.config import load_config
    from fedmed.run.experiment import prepare_federation

    for part, extra in (("dirichlet", {"alpha": 0.3}), ("predi", {"predi_prevalence": 2.0}), ("iid", {})):
        raw = {"name": "u", "dataset": {"path": "builtin:digits", "image_size": 8, "channels": 1, "max_per_class": 20},
               "federation": {"sites": 4, "partition": part, "unseen_sites": 2, **extra},
               "methods": [{"name": "FMCL", "workflow": "fmcl", "encoder": "random_cnn"}]}
        (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
        data = prepare_federation(load_config(tmp_path / "c.yaml"), 0, tmp_path / part)
        meta = json.loads((data / "dataset.json").read_text())
        assert meta["sites"] == ["site-1", "site-2", "site-3", "site-4"], part
        assert meta["unseen_sites"] == ["unseen-1", "unseen-2"], part
        for u in meta["unseen_sites"]:
            assert json.loads((data / f"{u}.json").read_text())["training"], (part, u)


@pytest.mark.skipif(not BRATS.is_dir(), reason="BraTS-2013 subjects not in ../shared/data (see its README)")
@pytest.mark.parametrize("distance", ["emd", "euc"])
def test_004_a_held_out_site_is_assigned_its_groups_cluster(tmp_path, distance):
    """``004_`` two clusters on BraTS-2013: group A holds the subjects as released, group B the same kind of subjects
    with every MR intensity doubled (another scanner's scaling — a synthetic shift of real images, as ANDA's). Every
    training site holds the same three subjects, so only the intensities tell the groups apart; the new sites hold the
    other three. Alg. 1 on D_EMD splits A from B; each new site, compared by its image intensities only (label-free),
    joins its group's cluster and scores that cluster's U-Net. D_EUC (the embedding centroids): that branch of the
    onboarding had never run — it named numpy without importing it; it assigns each new site a cluster and scores
    its U-Net, but its group is not asserted: MedicalNet z-scores each volume (its ``volume > 0`` statistics), so a
    pure intensity scaling is invisible to the embeddings by design."""
    import nibabel as nib

    from fedmed.config import load_config
    from fedmed.data.seg_federation import discover_subjects

    mods = {"FLAIR": "Flair*.nii*", "T1c": "T1c*.nii*"}
    entries = discover_subjects(BRATS, mods, "OTMultiClass*.nii*", "brainmask*.nii*")
    assert len(entries) == 6

    def shifted(e):
        out = dict(e, image=[], id=e["id"] + "_x2")
        for f in e["image"]:
            img = nib.load(f)
            dst = tmp_path / "x2" / e["subject"] / Path(f).name
            dst.parent.mkdir(parents=True, exist_ok=True)
            nib.save(nib.Nifti1Image(np.asarray(img.dataobj, dtype=np.float32) * 2.0, img.affine), dst)
            out["image"].append(str(dst))
        return out

    first, rest = entries[:3], entries[3:]
    first_x2, rest_x2 = [shifted(e) for e in first], [shifted(e) for e in rest]
    sites = {"a-1": first, "a-2": first, "b-1": first_x2, "b-2": first_x2, "new-a": rest, "new-b": rest_x2}
    data = tmp_path / "data"
    data.mkdir()
    for s, cases in sites.items():
        (data / f"{s}.json").write_text(json.dumps({"training": cases[:2], "validation": [], "test": cases[2:]}))
    raw = {"name": "onboard-004", "dataset": {"path": str(BRATS), "task": "segmentation", "modalities": mods,
                                              "label_pattern": "OTMultiClass*.nii*", "mask_pattern": "brainmask*.nii*",
                                              "shape": [16, 16, 16], "roi": [16, 16, 16]},
           "federation": {"sites": 4, "site_names": ["a-1", "a-2", "b-1", "b-2"], "min_clients": 2},
           "model": {"channels": [4, 8]}, "train": {"rounds": 1, "local_epochs": 1, "optimizer": "adam", "lr": 0.01},
           "privacy": {"k_min": 2},
           "methods": [{"name": "Clusters", "workflow": "seg_clusters", "distance": distance}]}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    fed = {"exp": load_config(tmp_path / "c.yaml"), "data": data}
    m = train(fed, "Clusters", tmp_path / "train")
    st = json.loads((tmp_path / "train" / "onboarding.json").read_text())
    clusters = {int(c): sorted(s) for c, s in st["clusters"].items()}
    if distance == "emd":
        assert sorted(clusters.values()) == [["a-1", "a-2"], ["b-1", "b-2"]]
    assert len(clusters) == 2 and sorted(s for c in clusters.values() for s in c) == ["a-1", "a-2", "b-1", "b-2"]
    status, doc = onboard(fed["exp"], data, m, tmp_path / "train", ["new-a", "new-b"], tmp_path / "onboard",
                          references=True)
    assert status == "finished", doc.get("reason")
    assign = doc["assignment"]["test_phase"]
    assert sorted(assign) == ["new-a", "new-b"] and set(assign.values()) <= set(clusters)
    if distance == "emd":
        assert clusters[assign["new-a"]] == ["a-1", "a-2"] and clusters[assign["new-b"]] == ["b-1", "b-2"]
    assert doc["assignment"]["label_free"] is True
    assert all(np.isfinite(doc["rounds"][0]["sites"][s]["dice_mean"]) for s in assign)
    assert (tmp_path / "onboard" / "models" / "new-a.pt").is_file()


@pytest.mark.parametrize("name", ["FMCL", "PACFL", "IFCA"])
def test_a_new_site_without_labels_is_assigned_by_the_served_models_predictions(federation, tmp_path, name):
    """``labels=False``: no label of the new site is read — its datalist's labels, all set to one class and then to
    another, give the same assignment — FMCL/PACFL compare its signature under each cluster model's predicted
    classes with that cluster's members, IFCA takes the most confident model. How often this finds the site's group
    depends on how good the cluster models are (docs/readings.md, "Onboarding"): here PACFL's subspaces do (2/2),
    FMCL's prototypes and IFCA's confidence under models of ~30% accuracy do not reliably (1/2 each)."""
    m = train(federation, name, tmp_path / "train")
    groups, unseen = federation["meta"]["groups"], federation["meta"]["unseen_sites"]
    st = json.loads((tmp_path / "train" / "onboarding.json").read_text())
    clusters = {int(c): s for c, s in st["clusters"].items() if s}
    got = []
    for fake in (0, 5):
        data = tmp_path / f"data{fake}"
        shutil.copytree(federation["data"], data)
        for u in unseen:  # what the new sites "know": nothing
            dl = json.loads((data / f"{u}.json").read_text())
            for split in ("training", "validation", "test"):
                for e in dl[split]:
                    e["label"] = fake
            (data / f"{u}.json").write_text(json.dumps(dl))
        status, doc = onboard(federation["exp"], data, m, tmp_path / "train", unseen, tmp_path / f"onboard{fake}",
                              labels=False)
        assert status == "finished", doc.get("reason")
        assert doc["assignment"]["pseudo_labels"] is True and doc["assignment"]["label_free"] is True
        got.append(doc["assignment"]["test_phase"])
    assert got[0] == got[1] and sorted(got[0]) == unseen
    if name == "PACFL":
        for u, c in got[0].items():
            assert {groups[s] for s in clusters[c]} == {groups[u]}, (u, c, st["clusters"])


def test_cfl_cannot_onboard_a_site_without_labels():
    from fedmed.workflows.onboard import Onboard

    with pytest.raises(ValueError, match="CFL sends a new site down its tree by the site's training updates"):
        Onboard(1, {}, training="fedmed.methods.cfl:CFL", labels=False)


def test_an_onboarding_without_labels_records_the_epsilon_of_every_signature_it_sent(federation, tmp_path):
    """Onboarding without labels sends one FMCL signature per cluster model (K releases at epsilon each); it used to
    record no epsilon at all. The record composes them per new site; a site whose ceiling is below K * epsilon sends
    the signatures that fit and sits out the rest."""
    from dataclasses import replace

    from fedmed.core.policy import SitePolicy

    m = train(federation, "FMCL", tmp_path / "train")
    eps = 0.5
    exp = federation["exp"].model_copy(update={"privacy": federation["exp"].privacy.model_copy(
        update={"dp_epsilon": eps})})
    unseen = federation["meta"]["unseen_sites"]
    status, doc = onboard(exp, federation["data"], m, tmp_path / "train", unseen, tmp_path / "ob", labels=False)
    assert status == "finished", doc.get("reason")
    k = len([c for c, s in json.loads((tmp_path / "train" / "onboarding.json").read_text())["clusters"].items() if s])
    for u in unseen:
        assert doc["epsilon_spent"][u] == {"epsilon": pytest.approx(k * eps), "releases": k}
    # a ceiling below K * epsilon: the release that would exceed it is refused at the site, naming the setting
    from fedmed.run.taskconfig import build_task_config
    from fedmed.site.runner import SiteRunner
    from fedmed.site.settings import settings_for_dir

    runner = SiteRunner(unseen[0], settings_for_dir(unseen[0], federation["data"],
                                                    replace(SitePolicy.simulating(2), max_epsilon=eps * 1.5)))
    cfg = {**build_task_config(exp, 0, m, unseen), "signature": {"kind": "fmcl", "encoder": "random_cnn"}}
    runner.handle("signature", {}, cfg)
    with pytest.raises(Exception, match="above its ceiling"):
        runner.handle("signature", {}, cfg)


def test_flux_with_the_papers_literal_dbscan_runs_to_the_end(federation, tmp_path):
    """``k1_silhouette: null`` (the paper's DBSCAN without fedmed's K = 1 test, as the config documents) passed the
    config and then failed at the server: the task config's FluxTask took only a float."""
    from fedmed.config import load_config
    from fedmed.run.taskconfig import build_task_config
    from fedmed.workflows import InProcessFederation, server_workflow
    from fedmed.methods import server_workflow_path

    def workflow_args(exp, m, seed, cfg=None):
        return server_workflow_path(type(m)), m.workflow_options(exp, seed)

    raw = yaml.safe_load(federation["cfg"].read_text())
    raw["methods"] = [{"name": "Flux-DBSCAN", "workflow": "flux", "k1_silhouette": None}]
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    exp = load_config(tmp_path / "c.yaml", federation["over"])
    m = exp.methods[0]
    cfg = build_task_config(exp, 0, m, exp.site_names())
    name, args = workflow_args(exp, m, 0, cfg)
    assert args["k1_silhouette"] is None
    f = InProcessFederation(federation["data"], exp.site_names(), tmp_path / "run", log=None)
    assert f.run(server_workflow(name)(2, cfg, **args)) == "finished", f.recorder.doc["reason"]
    assert "K = 1" not in f.recorder.doc["clustering"]["rule"] and "silhouette" not in f.recorder.doc["clustering"]["rule"]


def test_onboarding_takes_a_run_folder_of_fedmed_experiment_and_a_method_as_experiment_names_it(tmp_path):
    """``--onboard`` refused the run folder its help names (fedmed experiment's ``runs/seed0/FMCL``: a metrics.json
    copy beside ``server/``, which holds the models) and ``--method fmcl`` that ``experiment --methods`` takes."""
    from fedmed.config import load_config
    from fedmed.run.jobspec import BuildError, select_method
    from fedmed.workflows.onboard import find_result

    run = tmp_path / "runs" / "seed0" / "FMCL"
    (run / "server" / "models").mkdir(parents=True)
    for f in (run / "metrics.json", run / "server" / "metrics.json"):
        f.write_text('{"status": "finished"}')
    assert find_result(run) == run / "server"
    assert find_result(run / "server") == run / "server"
    exp = load_config({"name": "x", "dataset": {"path": "builtin:digits"},
                       "methods": [{"name": "FMCL (Auto-K)", "workflow": "fmcl"}, {"name": "FedAvg"},
                                   {"name": "PACFL", "workflow": "pacfl"}, {"name": "PACFL-2", "workflow": "pacfl"}]})
    assert select_method(exp, "fmcl").name == select_method(exp, "FMCL (Auto-K)").name == "FMCL (Auto-K)"
    assert select_method(exp, "fedavg").name == "FedAvg" and select_method(exp, "pacfl").name == "PACFL"
    two = load_config({"name": "x", "dataset": {"path": "builtin:digits"},
                       "methods": [{"name": "P1", "workflow": "pacfl"}, {"name": "P2", "workflow": "pacfl"}]})
    with pytest.raises(BuildError, match=r"matches 2 methods of the config \(\['P1', 'P2'\]\); name one"):
        select_method(two, "pacfl")


def test_a_new_site_is_never_served_a_cluster_trained_on_too_few_images_or_none(federation, tmp_path):
    """Onboarding's guard (#57, the Toshiba case): each cluster model records the sites and training images it was
    trained on; a new site assigned a cluster under ``min_cluster_images`` — or one no site trained — is served the
    global model of the FedAvg run the job carries, and the record says why; without a global model it is left
    unassigned, naming the reason."""
    import torch

    from fedmed.run.jobspec import job_spec, run_spec_in_process

    exp, data, unseen = federation["exp"], federation["data"], federation["meta"]["unseen_sites"]
    m = train(federation, "FMCL", tmp_path / "train")
    train(federation, "FedAvg", tmp_path / "fedavg")
    doc = json.loads((tmp_path / "train" / "metrics.json").read_text())
    last = {}
    for r in doc["rounds"]:
        for s, e in r["sites"].items():
            if e.get("n_train") is not None:
                last[s] = e["n_train"]
    sizes = {}
    for f in sorted((tmp_path / "train" / "models").glob("cluster*.pt")):
        ck = torch.load(f, weights_only=True)
        assert ck["sites"] and ck["train_images"] == sum(last[s] for s in ck["sites"]) > 0
        sizes[int(f.stem[len("cluster"):])] = ck["train_images"]

    def run(out, **extra):
        spec = job_spec(exp, m, 0, sites=unseen, follows=Onboarding(training_result=tmp_path / "train", **extra))
        return run_spec_in_process(spec, data, out)

    # under the threshold every newcomer gets the global model, with the reason; at it, its cluster's
    big = max(sizes.values())
    status, fed = run(tmp_path / "ob", min_cluster_images=big + 1, global_result=tmp_path / "fedavg")
    assert status == "finished", fed.recorder.doc.get("reason")
    a = fed.recorder.doc["assignment"]
    _, plain = run(tmp_path / "plain", min_cluster_images=min(sizes.values()), global_result=tmp_path / "fedavg")
    assigned = plain.recorder.doc["assignment"]["test_phase"]
    assert set(assigned.values()) == set(sizes) and "guarded" not in plain.recorder.doc["assignment"]
    for u, c in assigned.items():
        assert a["test_phase"][u] == -1
        assert a["guarded"][u] == (f"cluster {c} was trained on {sizes[c]} images (< min_cluster_images={big + 1}): "
                                   f"the global model is served")
        served = (tmp_path / "ob" / "models" / f"{u}.pt").read_bytes()
        assert served == (tmp_path / "fedavg" / "models" / "global.pt").read_bytes()
    assert set(fed.recorder.doc["rounds"][0]["sites"]) == set(unseen)  # every newcomer scored with what it is served
    small = min(sizes, key=sizes.get)
    # no global model to fall back on: that newcomer is left unassigned, with the reason
    status, fed = run(tmp_path / "ob2", min_cluster_images=big + 1)
    assert status == "failed" and "no new site could be assigned" in fed.recorder.doc["reason"]
    errors = [e["error"] for e in fed.recorder.doc["errors"]]
    assert any("not assigned: cluster" in e and "carries no global model" in e for e in errors), errors
    # a cluster no site trained (its model names no site) never serves
    untrained = tmp_path / "untrained"
    shutil.copytree(tmp_path / "train", untrained)
    f = untrained / "models" / f"cluster{small}.pt"
    ck = torch.load(f, weights_only=True)
    torch.save({**ck, "sites": []}, f)
    spec = job_spec(exp, m, 0, sites=unseen, follows=Onboarding(training_result=untrained, global_result=tmp_path / "fedavg"))
    status, fed = run_spec_in_process(spec, data, tmp_path / "ob4")
    g = fed.recorder.doc["assignment"]["guarded"]
    assert status == "finished" and list(g.values()) == [f"cluster {small} was trained on no site: the global model is "
                                                         f"served"]


def test_the_onboarding_console_names_the_cluster_and_the_model_each_new_site_was_given():
    """#86: the onboarding job's console said nothing of the assignment (only metrics.json did); ``fedmed_flare.run``
    prints these lines after an onboarding run (tests/test_deployment.py checks them on provisioned sites)."""
    from fedmed.workflows.onboard import FALLBACK, assignment_lines

    doc = {"assignment": {"test_phase": {"h-d": 1, "h-e": FALLBACK}, "mode": "linkage",
                          "guarded": {"h-e": "its cluster trained on 12 images"}}}
    assert assignment_lines(doc) == ["h-d: cluster 1's model (linkage); its model: models/h-d.pt",
                                     "h-e: the global model (its cluster trained on 12 images); its model: "
                                     "models/h-e.pt"]
    assert assignment_lines({"rounds": []}) == []  # not an onboarding run: nothing to say
