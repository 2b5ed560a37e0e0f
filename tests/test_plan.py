"""The serving plan's job (fedmed.workflows.plan, issue #57): each site is served the global model unless a candidate
beats it on the site's validation split beyond the noise — in-process and in FLARE's simulator alike, from the CLI and
as a stage of ``fedmed experiment``.

The federation: scikit-learn's handwritten digits, ANDA label shift into two groups of three sites (each group holds
other classes), so a cluster model of FMCL (K = 2) is far better at its group's sites than the global model of FedAvg.
The rule itself (the sign test, Bonferroni, pooling; its false-serving rate on planted null candidates) is tested in
test_serving.py.
"""

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from fedmed.run import followups
from fedmed.run.followups import Onboarding, ServingPlan

RAW = {"name": "plan", "dataset": {"path": "builtin:digits", "image_size": 8, "channels": 1, "max_per_class": 40},
       "federation": {"sites": 6, "partition": "anda", "anda_shift": "label", "anda_level": 6, "anda_groups": 2,
                      "unseen_sites": 2},
       "model": {"arch": "resnet9", "width": 4}, "train": {"rounds": 4, "local_epochs": 2, "batch_size": 16},
       "privacy": {"k_min": 2}, "references": [],
       "methods": [{"name": "FedAvg", "workflow": "fedavg"},
                   {"name": "FMCL", "workflow": "fmcl", "encoder": "random_cnn", "n_clusters": 2}]}
FINETUNE = {"epochs": 2, "lr_scale": 0.5}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """FedAvg's and FMCL's finished runs on the federation (in-process: the runs' folders are what matters here)."""
    from fedmed.config import load_config
    from fedmed.run.experiment import classes_override, prepare_federation
    from fedmed.run.jobspec import job_spec, run_spec_in_process

    tmp = tmp_path_factory.mktemp("plan")
    cfg = tmp / "c.yaml"
    cfg.write_text(yaml.safe_dump(RAW))
    exp = load_config(cfg)
    data = prepare_federation(exp, 0, tmp / "data")
    exp = load_config(cfg, classes_override(data, exp))
    for m in exp.methods:
        status, fed = run_spec_in_process(job_spec(exp, m, 0), data, tmp / m.name)
        assert status == "finished", fed.recorder.doc.get("reason")
    groups = json.loads((data / "dataset.json").read_text())["groups"]
    return {"exp": exp, "cfg": cfg, "data": data, "tmp": tmp, "groups": groups}


def _spec(runs, **plan):
    from fedmed.run.jobspec import job_spec

    return job_spec(runs["exp"], runs["exp"].methods[0], 0, follows=ServingPlan(
        runs["tmp"] / "FedAvg", candidates={"FMCL": runs["tmp"] / "FMCL"}, **plan))


def _by_task(doc: dict) -> dict:
    return {r["task"]: r["sites"] for r in doc["rounds"]}


def test_the_plan_job_in_process_and_in_flares_simulator_picks_the_same_models(runs, tmp_path):
    """The same spec run in this process and by FLARE's simulator: the same plan and the same served files; a site
    whose cluster model is better beyond the noise is served it, the others keep the global model; the served round
    scores each site with the model it was served (its validation accuracy is the one it was chosen on, the
    fine-tuned model made again at the site included) and the global round with the global model."""
    from fedmed.run.jobs import run_job
    from fedmed.run.jobspec import run_spec_in_process

    spec = _spec(runs, finetune=FINETUNE)
    status, fed = run_spec_in_process(spec, runs["data"], tmp_path / "ip")
    assert status == "finished", fed.recorder.doc.get("reason")
    doc = run_job(spec, runs["data"], tmp_path / "sim", 6, log=lambda *_: None)
    assert doc["status"] == "finished" and doc["meta"]["workflow"] == "Plan"
    ip, sim = (json.loads((d / "plan.json").read_text()) for d in (tmp_path / "ip", tmp_path / "sim" / "server"))
    assert ip == sim and sorted(ip) == [f"site-{k}" for k in range(1, 7)]
    served = {s: v["served"] for s, v in ip.items()}
    assert "FMCL" in served.values()  # the label shift makes a cluster model better somewhere
    assert set(served.values()) <= {"global", "FMCL", "finetuned"}
    for s, v in ip.items():
        assert set(v["evidence"]) == {"FMCL", "finetuned"}
        if v["served"] == "FMCL":
            assert "FMCL beats global" in v["reason"] and v["p"]["FMCL"] < v["threshold"] == pytest.approx(0.05 / 2)
            assert v["file"] in ("cluster0.pt", "cluster1.pt")
        elif v["served"] == "global":
            assert "global kept" in v["reason"] and v["file"] == "global.pt"
    # #86: every site keeps the model it is served in its own workspace (in-process: <out>/sites/<site>; the
    # simulator's site folders, kept under <work>/sites), the fine-tuned one too, which is never the server's
    from fedmed.nn.predict import load_model

    for v in ip.values():
        assert v["served_at"] and v["served_at"].startswith("served/") and v["served_at"].endswith("/model.pt")
    for sites in (tmp_path / "ip" / "sites", tmp_path / "sim" / "sites"):
        for s, v in ip.items():
            kept = sites / s / v["served_at"]
            _, ck = load_model(kept)  # what `fedmed predict` runs on at the site
            assert ck["classes"] == runs["exp"].dataset.classes
            if v["served"] != "finetuned":
                src = tmp_path / "ip" / "_job_files" / "plan" / ("global" if v["served"] == "global" else "FMCL") / v["file"]
                import torch

                shared = torch.load(src, weights_only=True)["state_dict"]
                assert all(torch.equal(shared[k], t) for k, t in ck["state_dict"].items())
            assert (kept.parent / "bundle" / "configs" / "metadata.json").is_file()  # its MONAI bundle beside it
    for server in (tmp_path / "ip", tmp_path / "sim" / "server"):
        assert not any(p.name == "model.pt" and "served" in p.parts for p in server.rglob("*.pt") if "sites" not in
                       p.relative_to(server).parts)  # no site's kept model in the server's folder
    for out in (tmp_path / "ip", tmp_path / "sim" / "server"):
        for s, v in ip.items():
            f = out / "models" / f"{s}.pt"
            if v["served"] == "finetuned":
                assert not f.exists()  # it stays at the site
                continue
            src = tmp_path / "ip" / "_job_files" / "plan" / ("global" if v["served"] == "global" else "FMCL") / v["file"]
            assert f.read_bytes() == src.read_bytes()
    for d in (fed.recorder.doc, doc):
        t = _by_task(d)
        assert list(t) == ["serve_score", "served", "global"]
        compared = 0
        for s, v in ip.items():  # serve_score sends an accuracy only over >= k_min right and wrong answers (#86)
            chosen, ref = t["serve_score"][s][f"val_accuracy/{v['served']}"], t["serve_score"][s]["val_accuracy/global"]
            sent = [x is not None and bool(np.isfinite(x)) for x in (chosen, ref)]  # a record keeps NaN as null
            assert not sent[0] or t["served"][s]["val_accuracy"] == pytest.approx(chosen)
            assert not sent[1] or t["global"][s]["val_accuracy"] == pytest.approx(ref)
            compared += sum(sent)
            assert np.isfinite(t["served"][s]["accuracy"])  # the test split: read after the choice only
            assert "accuracy" not in t["serve_score"][s]  # ... never while choosing
        assert compared > 0  # at least one site sent both (the rest had too few right or wrong answers)


def test_a_plan_without_candidates_keeps_the_global_model_of_an_equal_candidate(runs, tmp_path):
    """The global run offered as its own candidate: every pair of answers ties, so no site is served it."""
    from fedmed.run.jobspec import job_spec, run_spec_in_process

    spec = job_spec(runs["exp"], runs["exp"].methods[0], 0, follows=ServingPlan(
        runs["tmp"] / "FedAvg", candidates={"same": runs["tmp"] / "FedAvg"}))
    status, fed = run_spec_in_process(spec, runs["data"], tmp_path)
    assert status == "finished"
    plan = json.loads((tmp_path / "plan.json").read_text())
    for s, v in plan.items():
        same = v["evidence"]["same"]  # every item ties: 0 wins and 0 losses are counts below k_min, never sent
        assert v["served"] == "global" and "wins" not in same and same["sum_d"] == same["sum_d2"] == 0
        assert "judged on the pooled evidence of the 6 sites it serves" in v["reason"]  # one model for all: pooled


def test_fedmed_plan_runs_from_the_command_line_and_bad_input_is_one_line(runs, tmp_path, capsys):
    from fedmed.cli.main import main

    cfg, t = str(runs["cfg"]), runs["tmp"]
    # the README's command: FLARE's simulator by default
    assert main(["plan", cfg, "--global", str(t / "FedAvg"), "--candidate", f"FMCL={t / 'FMCL'}", "--data",
                 str(runs["data"]), "--out", str(tmp_path / "p")]) == 0
    out = capsys.readouterr().out
    assert "| site | served model | why |" in out and "| site-1 |" in out
    # its progress counts the plan's own rounds (score, served, global), not the training run's 4
    assert "round 1/2 served" in out and "round 2/2 global" in out and "/4 " not in out, out
    assert len(list((tmp_path / "p" / "server" / "models").glob("site-*.pt"))) == 6
    # #86: a plan folder gets its page; a candidate may be named as the config names its method
    assert main(["report", str(tmp_path / "p")]) == 0
    from fedmed.report.html import visible_text

    page = visible_text((tmp_path / "p" / "report.html").read_text())
    assert "Serving plan: p" in page and "site-1" in page and "FMCL (val)" in page and "Brier score" in page
    assert main(["plan", cfg, "--global", str(t / "FedAvg"), "--candidate", "fmcl", "--data", str(runs["data"]),
                 "--out", str(tmp_path / "byname"), "--in-process"]) == 0
    assert set(json.loads((tmp_path / "byname" / "plan.json").read_text())["site-1"]["evidence"]) == {"FMCL"}
    capsys.readouterr()
    # the spec for provisioned sites, running nothing
    assert main(["plan", cfg, "--global", str(t / "FedAvg"), "--finetune", "--spec", str(tmp_path / "s.json")]) == 0
    spec = json.loads((tmp_path / "s.json").read_text())
    assert spec["workflow"] == "fedmed.workflows.plan:Plan" and spec["workflow_options"]["finetune"] == {"epochs": 2, "lr_scale": 0.1}
    cases = [(["--candidate", f"FMCL={t / 'nowhere'}"], "--candidate FMCL:", "no such folder"),
             (["--candidate", "NoSuch"], "method 'NoSuch' is not in", ""),  # a method of the config, or NAME=RUN
             (["--candidate", f"global={t / 'FMCL'}"], "--candidate global: a candidate's name is a word", ""),
             ([], "a serving plan needs a candidate", "")]
    for extra, want, also in cases:
        assert main(["plan", cfg, "--global", str(t / "FedAvg"), "--data", str(runs["data"]), "--out",
                     str(tmp_path / "x"), "--in-process", *extra]) != 0
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and want in err[0] and also in err[0], err
    # the reference must be a run with a global model
    assert main(["plan", cfg, "--global", str(t / "FMCL"), "--candidate", f"A={t / 'FMCL'}", "--spec",
                 str(tmp_path / "y.json")]) != 0
    assert "the run saved no global model" in capsys.readouterr().err
    # a run that did not finish is refused
    unfinished = tmp_path / "unfinished"
    (unfinished / "models").mkdir(parents=True)
    doc = json.loads((t / "FMCL" / "metrics.json").read_text())
    (unfinished / "metrics.json").write_text(json.dumps({**doc, "status": "stopped", "reason": "killed"}))
    for f in (t / "FMCL" / "models").glob("*.pt"):
        (unfinished / "models" / f.name).write_bytes(f.read_bytes())
    assert main(["plan", cfg, "--global", str(t / "FedAvg"), "--candidate", f"B={unfinished}", "--spec",
                 str(tmp_path / "z.json")]) != 0
    assert "the run did not finish (status stopped: killed)" in capsys.readouterr().err


def test_the_models_a_plan_job_stages_leave_no_copy_in_the_temp_folder_and_a_written_spec_keeps_its_own(
        runs, tmp_path, capsys, monkeypatch):
    """A plan (an onboarding job, a method's server file) copies the models it starts from into a temporary folder
    for the job to carry; each job left one behind (268 MB in /tmp after a day's runs). A run removes its copies when
    it ends; ``fedmed plan --spec`` writes them beside the spec, which then runs after the process that wrote it has
    ended; a file the user gave is never removed."""
    import tempfile

    from fedmed.cli.main import main
    from fedmed.run import jobspec

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    cfg, t = str(runs["cfg"]), runs["tmp"]
    assert main(["plan", cfg, "--global", str(t / "FedAvg"), "--candidate", f"FMCL={t / 'FMCL'}", "--data",
                 str(runs["data"]), "--out", str(tmp_path / "p"), "--in-process"]) == 0, capsys.readouterr()
    assert list(tmp.glob("fedmed_*")) == []
    from fedmed.run import experiment

    def dies(spec, *a, **kw):  # fedmed experiment's runs (FLARE's simulator): a run that fails removes them too
        assert Path(spec.server_files[-1][0]).is_dir()
        raise experiment.RunError("failed", "killed")

    monkeypatch.setattr("fedmed.run.jobs.run_job", dies)
    with pytest.raises(experiment.RunError):
        experiment.run_and_release(_spec(runs), runs["data"], tmp_path / "sim")
    assert list(tmp.glob("fedmed_*")) == []
    assert main(["plan", cfg, "--global", str(t / "FedAvg"), "--candidate", f"FMCL={t / 'FMCL'}", "--spec",
                 str(tmp_path / "s.json")]) == 0
    followups.release_staged()  # what the process's exit does
    spec = jobspec.JobSpec.from_file(tmp_path / "s.json")
    (src, dest), = spec.server_files
    assert dest == "plan" and Path(src).parent == (tmp_path / "s_files").resolve()
    assert sorted(p.name for p in Path(src).rglob("*.pt")) == sorted(
        ["global.pt"] + [f.name for f in (t / "FMCL" / "models").glob("cluster*.pt")])
    assert (Path(src) / "global" / "global.pt").read_bytes() == (t / "FedAvg" / "models" / "global.pt").read_bytes()
    spec.release()  # a spec read from a file names no folder of this process's: nothing is removed
    assert Path(src).is_dir()
    built = _spec(runs)
    staged = Path(built.server_files[-1][0])
    assert staged.parent == tmp and staged.is_dir()
    import multiprocessing

    child = multiprocessing.get_context("fork").Process(target=followups.release_staged)  # a forked child's exit
    child.start()
    child.join(60)
    assert child.exitcode == 0 and staged.is_dir()  # ... removes none of its parent's folders
    mine = tmp_path / "init.pt"  # a file the user gave (model.init_weights, a checkpoint to resume from)
    mine.write_bytes(b"x")
    built.server_files.append([str(mine), "model_init"])
    built.release()
    assert not staged.exists() and mine.read_bytes() == b"x"


def test_fedmed_experiment_runs_the_plan_after_a_seeds_methods_and_reuses_it(runs, tmp_path, monkeypatch):
    """``serving:`` in the config: the plan's job follows the seed's methods, its row (each site scored with the model
    it is served) joins the tables as "Serving plan", and ``--resume`` reuses it. (The jobs run in-process here; the
    plan's FLARE path is the test above.)"""
    import fedmed.run.experiment as E
    from fedmed.run.jobspec import run_spec_in_process

    specs = []

    def run_job(spec, datalists, work, n_sites=0, *a, **k):
        specs.append(spec)
        status, fed = run_spec_in_process(spec, datalists, Path(work) / "server")
        assert status == "finished", fed.recorder.doc.get("reason")
        return fed.recorder.doc

    monkeypatch.setattr("fedmed.run.jobs.run_job", run_job)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({**RAW, "serving": {"reference": "FedAvg", "candidates": ["FMCL"],
                                                      "finetune": FINETUNE}}))
    rows = E.run_experiment(str(cfg), tmp_path / "out", log=lambda *_: None)
    assert [s.workflow for s in specs][-1] == "fedmed.workflows.plan:Plan"
    plan_rows = [r for r in rows if r["method"] in (E.PLAN_METHOD, E.PLAN_GLOBAL)]
    assert [(r["method"], r["task"]) for r in plan_rows] == [(E.PLAN_METHOD, "served"), (E.PLAN_GLOBAL, "global")]
    assert set(plan_rows[0]["sites"]) == {f"site-{k}" for k in range(1, 7)}
    assert (tmp_path / "out" / "runs" / "seed0" / "_serving_plan" / "server" / "plan.md").is_file()
    summary = (tmp_path / "out" / "summary.md").read_text()
    # #86: the top summary says which model each site should use, and calls no method "best" beside the plan
    plan0 = json.loads((tmp_path / "out" / "runs" / "seed0" / "_serving_plan" / "server" / "plan.json").read_text())
    top = summary.split("### What this found", 1)[1].split("\n\n", 2)[1]
    assert top.startswith("- Which model each site should use (the serving plan, chosen on each site's own "
                          "validation data): "), top
    for site, v in plan0.items():
        assert site in top.splitlines()[0]
    assert "served the sites best" not in top
    # its Round cells: no training round is selected for the plan's rows (they read "val-selected (1)", "(2)" before)
    assert f"| {E.PLAN_METHOD} | per site, on val. |" in summary
    assert f"| {E.PLAN_GLOBAL} | final (reference) |" in summary and "val-selected (2)" not in summary
    # the report: a site x candidate table of validation scores, the choice marked
    from fedmed.report.html import visible_text

    page = visible_text((tmp_path / "out" / "report.html").read_text())
    plan = json.loads((tmp_path / "out" / "runs" / "seed0" / "_serving_plan" / "server" / "plan.json").read_text())
    assert "Serving plan (seed 0)" in page and "FMCL (val)" in page and "finetuned (val)" in page
    assert page.count("✓") == len(plan) == 6
    n = len(specs)
    again = E.run_experiment(str(cfg), tmp_path / "out", log=lambda *_: None, resume=True)
    assert len(specs) == n and [r for r in again if r["method"] in (E.PLAN_METHOD, E.PLAN_GLOBAL)] == plan_rows


def test_serving_runs_beside_the_iid_reference_which_inherits_no_plan(tmp_path, monkeypatch):
    """#86: ``serving:`` with the IID reference crashed after the other references had run (the reference copied
    the ``serving:`` block and named methods it does not have); a reference never inherits it."""
    import fedmed.run.experiment as E
    from fedmed.run.jobspec import run_spec_in_process

    def run_job(spec, datalists, work, n_sites=0, *a, **k):
        status, fed = run_spec_in_process(spec, datalists, Path(work) / "server")
        assert status == "finished", fed.recorder.doc.get("reason")
        return fed.recorder.doc

    monkeypatch.setattr("fedmed.run.jobs.run_job", run_job)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({**RAW, "references": ["iid_fedavg"], "train": {**RAW["train"], "rounds": 1},
                                   "serving": {"reference": "FedAvg", "candidates": ["FMCL"]}}))
    rows = E.run_experiment(str(cfg), tmp_path / "out", log=lambda *_: None)
    methods = {r["method"] for r in rows}
    assert "FedAvg (IID federation)" in methods and E.PLAN_METHOD in methods, methods


def test_a_serving_section_names_methods_of_the_config():
    from fedmed.config import ConfigError, load_config

    with pytest.raises((ConfigError, ValueError), match=r"serving names unknown method\(s\) \['Flux'\]"):
        load_config({**RAW, "serving": {"reference": "FedAvg", "candidates": ["Flux"]}})
    with pytest.raises((ConfigError, ValueError), match="serving: name a candidate method or set finetune"):
        load_config({**RAW, "serving": {"reference": "FedAvg"}})
    # a model made at each site and gone with the run cannot be a candidate; FedBN's kept layers can
    for name, workflow in (("Ditto", "ditto"), ("FT", "finetune_local")):
        raw = {**RAW, "methods": [*RAW["methods"], {"name": name, "workflow": workflow}]}
        with pytest.raises((ConfigError, ValueError), match=rf"serving.candidates: \['{name}'\] serve a model made"):
            load_config({**raw, "serving": {"reference": "FedAvg", "candidates": [name]}})
    raw = {**RAW, "methods": [*RAW["methods"], {"name": "FedBN", "workflow": "fedbn"}]}
    assert load_config({**raw, "serving": {"reference": "FedAvg", "candidates": ["FedBN"]}}).serving.candidates == ["FedBN"]
    # a plan added to a finished experiment reuses its runs (--resume): it is not part of a run's fingerprint
    from fedmed.run.fingerprint import run_fingerprint

    plain, served = load_config(RAW), load_config({**RAW, "serving": {"reference": "FedAvg", "candidates": ["FMCL"]}})
    assert run_fingerprint(plain, plain.methods[1], 0) == run_fingerprint(served, served.methods[1], 0)
    # the paired test: the score test by default, the sign test on request, nothing else
    assert served.serving.test == "score"
    with pytest.raises((ConfigError, ValueError), match="test"):
        load_config({**RAW, "serving": {"reference": "FedAvg", "candidates": ["FMCL"], "test": "t-test"}})
    from fedmed.workflows.plan import Plan

    with pytest.raises(ValueError, match="plan: test should be one of"):
        Plan(2, {}, candidates=["FMCL"], test="t-test")
    # each site's own model (#85) is a candidate by the word 'local', not a method; no method may take its name
    own = load_config({**RAW, "serving": {"reference": "FedAvg", "candidates": ["local"]}})
    assert own.serving.candidates == ["local"]
    with pytest.raises(ValueError, match="other than 'global', 'finetuned' and 'local'"):
        Plan(2, {}, candidates=["local"])


def test_a_newcomer_is_served_its_assigned_cluster_model_where_its_validation_data_bear_it_out_and_keeps_the_gain(
        runs, tmp_path):
    """The newcomers of an onboarding run as the plan's sites: the candidate is the model onboarding assigned each
    (its ``models/<site>.pt``), judged on that site's own validation evidence (no pooling: no other plan site shares
    it); each newcomer is served it or the global model, and the served file is one of the two. Here a gain exists
    (each newcomer's own group's cluster model knows its classes): the plan serves it, and the newcomer keeps the gain
    on its test split, read after the choice (issue #57's "the newcomer keeps its gain"; over seeds: docs/lab/newcomers.md "A
    newcomer's gain where one exists")."""
    import torch

    from fedmed.run.jobspec import job_spec, run_spec_in_process

    exp, data = runs["exp"], runs["data"]
    unseen = json.loads((data / "dataset.json").read_text())["unseen_sites"]
    fmcl = exp.methods[1]
    status, _ = run_spec_in_process(job_spec(exp, fmcl, 0, sites=unseen, follows=Onboarding(training_result=runs["tmp"] / "FMCL")),
                                    data, tmp_path / "onboard")
    assert status == "finished"
    spec = job_spec(exp, exp.methods[0], 0, sites=unseen, follows=ServingPlan(
        runs["tmp"] / "FedAvg", candidates={"FMCL": tmp_path / "onboard"}))
    status, fed = run_spec_in_process(spec, data, tmp_path / "plan")
    assert status == "finished", fed.recorder.doc.get("reason")
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert sorted(plan) == sorted(unseen)
    for u, v in plan.items():
        assert v["served"] in ("global", "FMCL") and "pooled" not in v["reason"]
        served = (tmp_path / "plan" / "models" / f"{u}.pt").read_bytes()
        want = tmp_path / "onboard" / "models" / f"{u}.pt" if v["served"] == "FMCL" else \
            runs["tmp"] / "FedAvg" / "models" / "global.pt"
        assert served == want.read_bytes()
    # the gain exists: each newcomer was assigned the cluster its own group's sites trained ...
    groups = runs["groups"]
    for u in unseen:
        ck = torch.load(tmp_path / "onboard" / "models" / f"{u}.pt", map_location="cpu", weights_only=True)
        assert ck["sites"] and {groups[s] for s in ck["sites"]} == {groups[u]}, (u, ck["sites"])
    # ... its validation evidence bears it out, so it is served; and on the test split, read only after the choice,
    # the served model beats the global model at every newcomer (a plan that kept the global model fails here; a
    # newcomer assigned the other group's cluster fails the check above)
    doc = json.loads((tmp_path / "plan" / "metrics.json").read_text())
    acc = {r["task"]: r["sites"] for r in doc["rounds"] if r.get("task") in ("served", "global")}
    for u, v in plan.items():
        assert v["served"] == "FMCL" and v["p"]["FMCL"] < v["threshold"], (u, v["reason"])
        assert acc["served"][u]["accuracy"] > acc["global"][u]["accuracy"], (u, acc["served"][u], acc["global"][u])
    # benchmarks/newcomer_plan.py's table (docs/results.md) reads this plan: per new site the served model, the
    # evidence, and the served and global models' test accuracies as the plan's record has them
    import shutil
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from newcomer_plan import table

    shutil.copytree(tmp_path / "plan", tmp_path / "out" / "runs" / "seed0" / "_newcomer_plan" / "server")
    shutil.copytree(tmp_path / "onboard", tmp_path / "out" / "runs" / "seed0" / "FMCL" / "test_phase" / "server")
    text = table(tmp_path / "out", [0], ["FMCL"])
    onb = next(r["sites"] for r in json.loads((tmp_path / "onboard" / "metrics.json").read_text())["rounds"]
               if r.get("task") == "test_phase")
    pct = lambda x: "—" if x is None else f"{100 * x:.2f}"  # noqa: E731
    for u, v in plan.items():
        e = v["evidence"]["FMCL"]
        counts = f"{e['wins']} W / {e['losses']} L of {e['n']}" if e and "wins" in e else \
            f"{e['n']} items (counts below k_min not sent)" if e else ""
        ev = (f"FMCL: {counts}, mean Brier gain {e['sum_d'] / e['n']:+.3f}, p = {v['p']['FMCL']:.3f}" if e
              else "FMCL: none sent")  # a classifier's sites send their Brier-score sums too; the p the rule judged
        # then the test scores, read after the plan: accuracy and AUC of the served and the global model, and FMCL's
        # onboarding assignment on the site with the number of images it was scored on
        cells = ["0", u, v["served"], ev,
                 pct(acc["served"][u]["accuracy"]), pct(acc["global"][u]["accuracy"]),
                 pct(acc["served"][u].get("auc")), pct(acc["global"][u].get("auc")),
                 f"{pct(onb[u]['accuracy'])} ({onb[u]['n_test']})"]
        assert "| " + " | ".join(cells) + " |" in text, text
    assert f"Over {len(plan)} (seed, site) pairs" in text
    # the assignment is paired with the global model only on the same test images (FMCL assigns with the training
    # split's labels and is scored on the test split, as the plan's models are)
    same = [u for u in plan if onb[u]["n_test"] == acc["global"][u]["n_test"]]
    assert same
    d = [100 * (onb[u]["accuracy"] - acc["global"][u]["accuracy"]) for u in sorted(same)]
    assert f"FMCL's assignment on the same test images ({len(same)} pairs)" in text
    assert f"minus global {np.mean(d):+.2f} ± {np.std(d):.2f}" in text


def test_a_fedbn_candidate_is_each_sites_own_model_scored_and_served_there_and_never_leaves_it(runs, tmp_path,
                                                                                           monkeypatch):
    """FedBN as a candidate: each site keeps its own batch-norm layers after the run (in its cache folder, under the
    run's key, which global.pt names); the plan scores at each site the run's model with that site's own layers —
    FedBN's personal model: its validation accuracy is the one FedBN's last round gave that site — judges it on the
    site's evidence alone (not pooled), and a site served it is scored with it, while no file of it is written to
    models/. A site without its layers has no evidence for it and keeps the others."""
    import torch

    from fedmed.methods import FedBNMethod
    from fedmed.run.jobspec import job_spec, run_spec_in_process

    cache = tmp_path / "cache"
    monkeypatch.setenv("FEDMED_CACHE_DIR", str(cache))
    fedbn = FedBNMethod(name="FedBN", workflow="fedbn")
    status, fed = run_spec_in_process(job_spec(runs["exp"], fedbn, 0), runs["data"], tmp_path / "FedBN")
    assert status == "finished", fed.recorder.doc.get("reason")
    key = torch.load(tmp_path / "FedBN" / "models" / "global.pt", weights_only=True)["personal_key"]
    kept = sorted(p.parent.parent.name for p in cache.glob(f"*/personal/{key}.pt"))
    assert kept == [f"site-{k}" for k in range(1, 7)]
    last = _by_task(fed.recorder.doc)["validate"]  # FedBN's own final scores: each site with its own layers
    glob_params = {k: v.numpy() for k, v in torch.load(tmp_path / "FedBN" / "models" / "global.pt",
                                                        weights_only=True)["state_dict"].items()}
    own = torch.load(cache / "site-1" / "personal" / f"{key}.pt", weights_only=True)
    assert any(not np.allclose(glob_params[k], v.numpy()) for k, v in own.items())  # not the averaged layers

    (cache / "site-6" / "personal" / f"{key}.pt").unlink()  # site-6 lost its layers (a cleared cache)
    spec = job_spec(runs["exp"], runs["exp"].methods[0], 0,
                    follows=ServingPlan(
        runs["tmp"] / "FedAvg", candidates={"FedBN": tmp_path / "FedBN"}))
    status, plan_fed = run_spec_in_process(spec, runs["data"], tmp_path / "plan")
    assert status == "finished", plan_fed.recorder.doc.get("reason")
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    t = _by_task(plan_fed.recorder.doc)
    for s in [f"site-{k}" for k in range(1, 6)]:  # an accuracy is sent over >= k_min right and wrong answers only
        got = t["serve_score"][s]["val_accuracy/FedBN"]
        assert np.isnan(got) or got == pytest.approx(last[s]["val_accuracy"])
        assert "pooled" not in plan[s]["reason"]
    assert plan["site-6"]["evidence"]["FedBN"] is None and plan["site-6"]["served"] == "global"
    assert "val_accuracy/FedBN" not in t["serve_score"]["site-6"]
    served = [s for s, v in plan.items() if v["served"] == "FedBN"]
    assert served, plan  # the label shift: a site's own layers beat the global model somewhere
    for s in served:
        assert plan[s]["file"] is None and not (tmp_path / "plan" / "models" / f"{s}.pt").exists()
        assert t["served"][s]["val_accuracy"] == pytest.approx(last[s]["val_accuracy"])
        assert t["served"][s]["accuracy"] == pytest.approx(last[s]["accuracy"])  # FedBN's own test score there
    # FLARE's simulator: its sites find their layers in the same cache folder and the plan is the same
    from fedmed.run.jobs import run_job

    doc = run_job(spec, runs["data"], tmp_path / "sim", 6, log=lambda *_: None)
    assert doc["status"] == "finished"
    assert json.loads((tmp_path / "sim" / "server" / "plan.json").read_text()) == plan


def test_a_fedbn_run_whose_sites_kept_no_layers_is_refused_as_a_candidate(runs, tmp_path):
    """A FedBN run recorded before its sites kept their own layers (no personal_key in its task config): its
    global.pt is not what FedBN served, so the plan refuses it in one line instead of scoring the averaged layers."""
    import shutil

    from fedmed.run.jobspec import BuildError, job_spec

    old = tmp_path / "old"
    shutil.copytree(runs["tmp"] / "FedAvg", old)
    doc = json.loads((old / "metrics.json").read_text())
    doc["meta"]["config"]["train"]["local_norm"] = True
    (old / "metrics.json").write_text(json.dumps(doc))
    with pytest.raises(BuildError, match="--candidate FedBN: .*a FedBN run made before its sites kept their own"):
        job_spec(runs["exp"], runs["exp"].methods[0], 0,
                 follows=ServingPlan(
        runs["tmp"] / "FedAvg", candidates={"FedBN": old}))


def test_newcomer_plan_plans_the_experiments_own_seeds_unless_told(tmp_path):
    """benchmarks/newcomer_plan.py without --seeds plans the seeds the experiment ran (its config's, after the same
    --set overrides), not a fixed list: an experiment of seeds 11-13 has no seed 0 to plan."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from newcomer_plan import plan_seeds

    cfg = tmp_path / "onboard.yaml"
    cfg.write_text(yaml.safe_dump({**RAW, "seeds": [11, 12, 13]}))
    assert plan_seeds(cfg, [], None) == [11, 12, 13]
    assert plan_seeds(cfg, ["seeds=[4]"], None) == [4]
    assert plan_seeds(cfg, [], [2, 3]) == [2, 3]


def test_a_local_candidate_is_each_sites_own_model_made_and_kept_at_the_site(runs, tmp_path):
    """#85 item 4: ``local`` — each site's own model, trained on its data alone from the run's starting model — is
    scored like any candidate; a site served it makes it again in the served round (the same model: its validation
    accuracy is the one it was chosen on) and keeps it in its own workspace; it is never in the server's folder and no
    reply carries its weights."""
    from fedmed.run.jobspec import job_spec, run_spec_in_process

    spec = job_spec(runs["exp"], runs["exp"].methods[0], 0, follows=ServingPlan(
        runs["tmp"] / "FedAvg", local=True))
    assert spec.workflow_options["local"] is True and spec.workflow_options["candidates"] == []
    status, fed = run_spec_in_process(spec, runs["data"], tmp_path)
    assert status == "finished", fed.recorder.doc.get("reason")
    plan = json.loads((tmp_path / "plan.json").read_text())
    t = _by_task(fed.recorder.doc)
    served_local = [s for s, v in plan.items() if v["served"] == "local"]
    assert served_local, {s: v["reason"] for s, v in plan.items()}  # label-shifted sites: their own data pays
    for s, v in plan.items():
        assert set(v["evidence"]) == {"local"}
        if v["served"] == "local":
            assert v["file"] is None and not (tmp_path / "models" / f"{s}.pt").exists()
            assert (tmp_path / "sites" / s / v["served_at"]).is_file()  # kept at the site
            chosen = t["serve_score"][s]["val_accuracy/local"]
            if chosen is not None and np.isfinite(chosen):
                assert t["served"][s]["val_accuracy"] == pytest.approx(chosen)  # the same model, made again
    assert not any("served" in p.parts for p in tmp_path.rglob("*.pt") if "sites" not in p.relative_to(tmp_path).parts)


def test_a_job_that_follows_a_run_is_one_contract_whatever_it_is(runs):
    """The serving plan and onboarding are FollowUp objects (#88), not modes of job_spec: a follow-up job of one's own
    — here a made-up one — is built by the same call, its workflow, options, rounds, name and staged files its own,
    with no edit of fedmed; and the built-in two name their workflows the same way."""
    from dataclasses import dataclass
    from typing import ClassVar

    from fedmed.run.followups import FollowUp
    from fedmed.run.jobspec import job_spec

    @dataclass
    class Recount(FollowUp):
        workflow: ClassVar[str] = "my_study:Recount"
        suffix: ClassVar[str] = "_recount"
        rounds: ClassVar[int] = 3
        every: int = 1

        def prepare(self, exp, method, cfg, sites, server_files):
            server_files.append([str(runs["tmp"] / "FedAvg"), "recount"])
            return {"sites": list(sites), "every": self.every, "task": cfg["task"]}

    exp = runs["exp"]
    spec = job_spec(exp, exp.methods[0], 0, sites=["site-1", "site-2"], follows=Recount(every=2))
    assert (spec.workflow, spec.rounds, spec.workflow_options) == (
        "my_study:Recount", 3, {"sites": ["site-1", "site-2"], "every": 2, "task": "classification"})
    assert "_recount" in spec.name and [str(runs["tmp"] / "FedAvg"), "recount"] in spec.server_files
    plan = job_spec(exp, exp.methods[0], 0, follows=ServingPlan(runs["tmp"] / "FedAvg", local=True))
    new = job_spec(exp, exp.methods[1], 0, sites=["site-7"], follows=Onboarding(runs["tmp"] / "FMCL"))
    assert (plan.workflow, plan.rounds, new.workflow, new.rounds) == (
        "fedmed.workflows.plan:Plan", 2, "fedmed.workflows.onboard:Onboard", 1)
    from fedmed.workflows.registry import server_workflow

    assert server_workflow(plan.workflow).__name__ == "Plan" and server_workflow(new.workflow).__name__ == "Onboard"
