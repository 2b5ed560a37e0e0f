"""Experiment bookkeeping: run fingerprints, --resume, committed sweep cases and the combined sweep table.

The NVFlare simulator is replaced by a recorder (``fake_job``) that returns a metrics document in the
format the server writes; the simulator path itself is covered by tests/test_jobs_e2e.py.
"""
import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from fedmed.run import experiment as E
from fedmed.cli.main import main
from fedmed.config import ConfigError, load_config

BASE = {
    "name": "tiny",
    "dataset": {"path": "builtin:digits", "image_size": 8, "max_per_class": 6},
    "federation": {"sites": 3, "partition": "iid"},
    "train": {"rounds": 2},
    "methods": [{"name": "FedAvg", "workflow": "fedavg"}, {"name": "Prox", "workflow": "fedprox", "fedprox_mu": 0.01}],
    "seeds": [0, 1],
    "references": [],  # reference rows are tested in tests/test_references.py
}


def metrics_doc(acc: float) -> dict:
    rounds = [{"round": r, "summary": {"n_sites": 3, "mean": {"accuracy": acc + r / 10, "macro_f1": acc, "auc": acc},
                                       "std": {"accuracy": 0.0, "macro_f1": 0.0, "auc": 0.0},
                                       "pooled": {"accuracy": acc, "macro_f1": acc, "auc": acc}}}
              for r in (1, 2)]
    return {"rounds": rounds, "errors": [], "wall_seconds": 1.0}


@pytest.fixture
def fake_job(monkeypatch):
    calls = []

    def run_job(spec, datalists, work, n_sites=0, *a, **k):
        seed = spec.task_config["seed"]
        calls.append((spec.method, seed, spec))
        work.mkdir(parents=True, exist_ok=True)
        return metrics_doc(0.5 + 0.1 * seed)

    monkeypatch.setattr("fedmed.run.jobs.run_job", run_job)
    return calls


def write_cfg(tmp_path, **extra):
    p = tmp_path / "cfg.yaml"
    p.write_text(yaml.safe_dump({**BASE, **extra}))
    return p


def test_fingerprint_tracks_what_determines_a_run():
    exp = load_config(BASE)
    fed, prox = exp.methods
    fp = E.run_fingerprint(exp, fed, 0)
    assert fp == E.run_fingerprint(load_config(BASE), load_config(BASE).methods[0], 0)
    assert fp != E.run_fingerprint(exp, fed, 1)  # seed
    assert fp != E.run_fingerprint(exp, prox, 0)  # method
    assert fp != E.run_fingerprint(load_config(BASE, ["train.lr=0.5"]), fed, 0)  # a hyperparameter
    other = load_config(BASE, ["methods.Prox.fedprox_mu=0.5", "seeds=[0,1,2]"])
    assert fp == E.run_fingerprint(other, other.methods[0], 0)  # another method / the seed list: same run


def test_resume_reuses_only_identical_runs(tmp_path, fake_job):
    cfg = write_cfg(tmp_path)
    rows = E.run_experiment(str(cfg), tmp_path / "out", log=lambda *_: None)
    assert len(fake_job) == 4 and len([r for r in rows if r["kind"] != "reference"]) == 8  # and the constant answer
    saved = json.loads((tmp_path / "out/runs/seed1/Prox/run.json").read_text())
    assert saved["method"] == "Prox" and saved["seed"] == 1 and len(saved["rows"]) == 2

    again = E.run_experiment(str(cfg), tmp_path / "out", log=lambda *_: None, resume=True)
    assert len(fake_job) == 4  # nothing ran again
    assert [(r["method"], r["seed"], r["round"], r["accuracy"]) for r in again] == \
        [(r["method"], r["seed"], r["round"], r["accuracy"]) for r in rows]

    # a changed method setting reruns that method only; without --resume everything reruns
    E.run_experiment(str(cfg), tmp_path / "out", overrides=["methods.Prox.fedprox_mu=0.1"], log=lambda *_: None,
                     resume=True)
    assert [c[0] for c in fake_job[4:]] == ["Prox", "Prox"]
    E.run_experiment(str(cfg), tmp_path / "out", log=lambda *_: None)
    assert len(fake_job) == 10


def test_resume_reuses_a_run_whose_weights_file_was_named_the_other_way(tmp_path, fake_job, monkeypatch):
    """The same weights file named relative to the working folder once and absolute the next time is the same run
    (a rerun would have deleted the first one's record); another file is not."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "w").mkdir()
    import torch

    for i, name in enumerate(("a.pt", "b.pt")):  # the jobs are faked: only the job builder's weights check reads them
        torch.save({"w": torch.full((2,), float(i))}, tmp_path / "w" / name)
    cfg = write_cfg(tmp_path, seeds=[0])
    E.run_experiment(str(cfg), tmp_path / "out", methods=["FedAvg"], overrides=["model.init_weights=w/a.pt"],
                     log=lambda *_: None)
    assert len(fake_job) == 1
    E.run_experiment(str(cfg), tmp_path / "out", methods=["FedAvg"], log=lambda *_: None, resume=True,
                     overrides=[f"model.init_weights={tmp_path / 'w' / 'a.pt'}"])
    assert len(fake_job) == 1  # reused
    E.run_experiment(str(cfg), tmp_path / "out", methods=["FedAvg"], log=lambda *_: None, resume=True,
                     overrides=["model.init_weights=w/b.pt"])
    assert len(fake_job) == 2  # another file: run again
    a = load_config(BASE, ["model.init_weights=w/a.pt"])
    assert E.run_fingerprint(a, a.methods[0], 0) != E.run_fingerprint(a, a.methods[0], 0, "absolute")


def test_resume_ignores_a_damaged_run_file(tmp_path, fake_job):
    cfg = write_cfg(tmp_path, seeds=[0])
    E.run_experiment(str(cfg), tmp_path / "out", methods=["FedAvg"], log=lambda *_: None)
    (tmp_path / "out/runs/seed0/FedAvg/run.json").write_text("{not json")
    E.run_experiment(str(cfg), tmp_path / "out", methods=["FedAvg"], log=lambda *_: None, resume=True)
    assert len(fake_job) == 2


def test_sweep_runs_the_config_cases_and_writes_one_table(tmp_path, fake_job, capsys):
    cases = [{"name": "lr-small", "set": ["train.lr=0.001"]},
             {"name": "prox-only", "set": ["methods.Prox.fedprox_mu=0.1"], "methods": ["Prox"]}]
    cfg = write_cfg(tmp_path, sweep=cases)
    out = tmp_path / "sweep"
    assert main(["sweep", str(cfg), "--out", str(out), "--cases", "prox-only"]) == 0
    assert {c[0] for c in fake_job} == {"Prox"} and all(c[2].task_config["train"]["fedprox_mu"] == 0.1 for c in fake_job)
    text = (out / "summary.md").read_text()
    assert "Not run yet: lr-small" in text and "| prox-only | Prox | 2 |" in text

    assert main(["sweep", str(cfg), "--out", str(out), "--resume"]) == 0
    assert len(fake_job) == 2 + 4  # prox-only reused, lr-small ran both methods x 2 seeds
    text = (out / "summary.md").read_text()
    assert "Not run yet" not in text
    assert "| lr-small | FedAvg | 2 | n/a | 75.00 ± 5.00 |" in text  # best round 2: 0.5+0.2 and 0.6+0.2
    assert "### lr-small (`--set train.lr=0.001`)" in text
    assert (out / "summary.png").is_file() is False  # no unseen-site phases in this config: no plot

    (out / "summary.md").unlink()
    assert main(["sweep", str(cfg), "--out", str(out), "--report-only"]) == 0
    assert len(fake_job) == 6 and (out / "summary.md").read_text() == text


def test_a_sweep_case_on_another_dataset_with_the_base_classes_fails_before_any_case_runs(tmp_path, fake_job, capsys):
    """dp_cost.yaml's Flux cases moved to PneumoniaMNIST but kept busi_fmcl.yaml's classes: the sweep ran its FMCL
    cases for 20 minutes, then failed. Every case is checked before the first runs."""
    from PIL import Image

    digits = [str(i) for i in range(10)]
    other = tmp_path / "two"
    for c in ("cat", "dog"):
        (other / c).mkdir(parents=True)
        for i in range(3):
            Image.fromarray(np.full((8, 8), 40 * i, np.uint8)).save(other / c / f"{i}.png")
    cfg = write_cfg(tmp_path, dataset={**BASE["dataset"], "classes": digits},
                    sweep=[{"name": "digits", "set": []}, {"name": "pets", "set": [f"dataset.path={other}"]}])
    assert main(["sweep", str(cfg), "--out", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err
    assert "sweep case 'pets': dataset.classes" in err and "['cat', 'dog']" in err and "nothing was run" in err
    assert fake_job == []
    # the same case with its own classes runs, and so does the sweep
    cfg = write_cfg(tmp_path, dataset={**BASE["dataset"], "classes": digits},
                    sweep=[{"name": "digits", "set": []},
                           {"name": "pets", "set": [f"dataset.path={other}", "dataset.classes=null"]}])
    assert main(["sweep", str(cfg), "--out", str(tmp_path / "s2"), "--cases", "digits"]) == 0
    assert len(fake_job) == 4


def test_every_shipped_sweep_case_names_its_datasets_classes(monkeypatch):
    """The check above, on every committed config with sweep cases whose data is here (each case's dataset
    discovered). It found dp_cost.yaml's Flux cases."""
    from argparse import Namespace

    from fedmed.cli.assess import _check_cases

    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)  # shipped configs name ../shared/data/... from the repository root
    if not (root.parent / "shared" / "data").is_dir():
        pytest.skip("../shared/data is absent (the shared data sets)")
    checked = 0
    for f in sorted((root / "app_configs").glob("*.yaml")):
        cases = [(c.name, list(c.set), c.methods) for c in load_config(f).sweep]
        paths = [load_config(f, s).dataset.path for _, s, _ in cases]
        if cases and all(p is None or p.startswith("builtin:") or Path(p).exists() for p in paths):
            _check_cases(Namespace(config=str(f), set=[], cases=None, report_only=False), cases)
            checked += 1
    assert checked >= 3, checked


def test_sweep_rejects_unknown_cases(tmp_path, capsys):
    cfg = write_cfg(tmp_path, sweep=[{"name": "a", "set": []}])
    assert main(["sweep", str(cfg), "--cases", "b"]) == 2
    assert "unknown case(s) ['b']" in capsys.readouterr().err


@pytest.mark.parametrize("case, msg", [
    ({"name": "x", "methods": ["Nope"]}, "sweep case 'x' names unknown method(s) ['Nope']"),
    ({"name": "bad name/", "set": []}, "sweep.0.name"),
])
def test_sweep_case_validation(case, msg):
    with pytest.raises(ConfigError, match=r"(?s)" + msg.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        load_config({**BASE, "sweep": [case]})


def test_duplicate_case_names_rejected():
    with pytest.raises(ConfigError, match="duplicates"):
        load_config({**BASE, "sweep": [{"name": "a"}, {"name": "a"}]})


def test_overrides_address_list_items_by_name_or_index():
    exp = load_config(BASE, ["methods.Prox.fedprox_mu=0.3", "methods.0.name=Avg"])
    assert [m.name for m in exp.methods] == ["Avg", "Prox"] and exp.methods[1].fedprox_mu == 0.3
    with pytest.raises(ConfigError, match=r"methods\.Ditto\.omega.*no list item 'Ditto'"):
        load_config(BASE, ["methods.Ditto.omega=0.5"])
    with pytest.raises(ConfigError, match="no list item '7'"):
        load_config(BASE, ["methods.7.omega=0.5"])


def test_read_results_roundtrip_and_table(tmp_path):
    rows = [{"method": "Flux", "seed": s, "round": 3, "accuracy": a, "macro_f1": a, "auc": float("nan"),
             "pooled_accuracy": a, "pooled_macro_f1": a, "pooled_auc": a, "n_sites": 4, "n_failed": 0}
            for s, a in ((0, 0.8), (1, 0.9))]
    rows += [{"method": "Flux", "seed": s, "round": 3, "phase": ph, "accuracy": a, "macro_f1": a, "ari": ari}
             for s, ari in ((0, 1.0), (1, 0.5)) for ph, a in (("known assoc.", 0.9), ("test phase", 0.7 + 0.1 * s))]
    E.write_outputs(rows, tmp_path, title="t", command="c")
    back = E.read_results(tmp_path / "results.csv")
    assert len(back) == len(rows) and back[0]["seed"] == 0 and np.isnan(back[0]["auc"])
    assert "phase" not in back[0] and back[2]["phase"] == "known assoc."
    table = E.sweep_table([("feature-5", [], back)])
    assert "| feature-5 | Flux | 2 | 0.75 ± 0.25 | 85.00 ± 5.00 | 90.00 ± 0.00 | 75.00 ± 5.00 |" in table


def test_sweep_stats_and_plot(tmp_path):
    from fedmed.report.plots import plot_sweep

    rows = [{"method": m, "seed": s, "round": 3, "phase": ph, "accuracy": a + 0.1 * s, "ari": ari}
            for m, ari in (("Flux", 1.0), ("FedAvg", 0.0)) for s in (0, 1)
            for ph, a in (("known assoc.", 0.9), ("test phase", 0.6))]
    stats = E.sweep_stats([("a", [], rows), ("b", [], [r for r in rows if r["method"] == "Flux"])])
    assert stats["unseen sites: test phase accuracy"]["a"]["FedAvg"] == pytest.approx((0.65, 0.05))
    assert stats["clustering ARI vs true groups"]["b"] == {"Flux": (1.0, 0.0)}
    png = plot_sweep(stats, tmp_path / "s.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="nothing to plot"):
        plot_sweep({}, tmp_path / "t.png")


def test_clustering_agreement_compares_each_case_with_the_methods_first_case(tmp_path):
    """The DP table's ARI: each case's clusters against the same method and seed in its first case (no DP)."""
    import json

    from fedmed.run.records import clustering_agreement

    def put(case, method, seed, clusters):
        d = tmp_path / case / "runs" / f"seed{seed}" / method.replace(" ", "_")
        d.mkdir(parents=True)
        (d / "run.json").write_text(json.dumps({"method": method, "seed": seed, "status": "finished",
                                                "clusters": clusters}))

    a, b = [["s1", "s2"], ["s3", "s4"]], [["s1", "s3"], ["s2", "s4"]]
    for seed in (0, 1):
        put("eps-inf", "FMCL", seed, a)
        put("eps-1", "FMCL", seed, a if seed == 0 else b)
        put("eps-0.1", "FMCL", seed, [["s1", "s2", "s3", "s4"]])
    parts = [(n, [], tmp_path / n) for n in ("eps-inf", "eps-1", "eps-0.1")]
    lines = clustering_agreement(parts).splitlines()[2:]
    assert lines[0] == "| eps-inf | FMCL | 2, 2 | eps-inf | 1.00 ± 0.00 |"
    assert lines[1].startswith("| eps-1 | FMCL | 2, 2 | eps-inf | ")
    ari_b = float(lines[1].split("|")[5].split("±")[0])
    assert ari_b == pytest.approx((1.0 + (-0.5)) / 2)  # seed 1: a vs b is ARI -0.5
    assert lines[2] == "| eps-0.1 | FMCL | 1, 1 | eps-inf | 0.00 ± 0.00 |"
    assert clustering_agreement([("x", [], tmp_path / "missing")]) == ""


def test_methods_are_selected_by_name_case_or_workflow():
    from types import SimpleNamespace as M

    from fedmed.run.experiment import select_methods

    ms = [M(name="FedAvg", workflow="fedavg"), M(name="FMCL (Auto-K)", workflow="fmcl"),
          M(name="FMCL (K=2)", workflow="fmcl"), M(name="Flux", workflow="flux")]
    assert [m.name for m in select_methods(ms, None, "c.yaml")] == [m.name for m in ms]
    assert [m.name for m in select_methods(ms, ["FMCL (K=2)"], "c.yaml")] == ["FMCL (K=2)"]
    assert [m.name for m in select_methods(ms, ["flux", "fedavg"], "c.yaml")] == ["FedAvg", "Flux"]  # config order
    assert [m.name for m in select_methods(ms, ["FMCL"], "c.yaml")] == ["FMCL (Auto-K)", "FMCL (K=2)"]
    with pytest.raises(ValueError, match=r"unknown method\(s\) \['Nope'\] in c.yaml; its methods are"):
        select_methods(ms, ["FedAvg", "Nope"], "c.yaml")


def test_a_finished_run_with_a_missing_site_says_so_on_the_console_and_in_the_report(tmp_path, monkeypatch):
    """'finished' with a site that sat out every round used to read like a clean run: the console line, summary.md
    and a reused run (--resume) all name the site, its rounds and the reason."""
    from fedmed.report.record import Recorder

    def run_job(spec, datalists, work, n_sites=0, *a, **k):
        work.mkdir(parents=True, exist_ok=True)
        rec = Recorder(work / "rec", tensorboard=False)
        rec.begin_attempt(0)
        for r in (0, 1):
            rec.error(r, "site-3", "train", "site-3: cannot read image a.png (file not found)")
            rec.record(r, [(s, {"accuracy": 0.5}, {"n_train": 4}) for s in ("site-1", "site-2")])
        rec.finish("finished")
        return rec.doc

    monkeypatch.setattr("fedmed.run.jobs.run_job", run_job)
    cfg = write_cfg(tmp_path, seeds=[0])
    lines = []
    E.run_experiment(str(cfg), tmp_path / "out", methods=["FedAvg"], log=lines.append)
    said = "site-3 sat out round(s) 0-1 (site-3: cannot read image a.png (file not found))"
    assert any(said in ln for ln in lines), lines
    assert said in (tmp_path / "out" / "summary.md").read_text()
    # #56: every table flags it — the results table's method cell, results.csv's rows, the report's table
    table = [ln for ln in (tmp_path / "out" / "summary.md").read_text().splitlines() if ln.startswith("| FedAvg")]
    assert table and all("⚠ sat out: site-3 (all 2 rounds)" in ln for ln in table), table
    from fedmed.report.summary import read_results

    rows = read_results(tmp_path / "out" / "results.csv")
    assert {r.get("sat_out") for r in rows if r["method"] == "FedAvg"} == {"site-3 (all 2 rounds)"}
    assert "⚠ sat out: site-3 (all 2 rounds)" in (tmp_path / "out" / "report.html").read_text()
    lines.clear()
    E.run_experiment(str(cfg), tmp_path / "out", methods=["FedAvg"], log=lines.append, resume=True)
    assert any("reused" in ln for ln in lines) and any(said in ln for ln in lines)
    assert said in (tmp_path / "out" / "summary.md").read_text()


def test_a_consented_k_min_below_2_is_said_on_the_console_and_in_the_setup(tmp_path, fake_job):
    cfg = write_cfg(tmp_path, seeds=[0], privacy={"k_min": 1, "accept_k_min_below_2": True})
    lines = []
    E.run_experiment(str(cfg), tmp_path / "out", methods=["FedAvg"], log=lines.append)
    assert any(ln.startswith("WARNING privacy.k_min=1 < 2") for ln in lines)
    assert "WARNING privacy.k_min=1 < 2" in (tmp_path / "out" / "summary.md").read_text()


def test_fedmed_data_refuses_files_it_cannot_read(tmp_path, capsys):
    from PIL import Image

    root = tmp_path / "ds"
    for c in ("a", "b"):
        (root / c).mkdir(parents=True)
        for i in range(3):
            Image.fromarray(np.full((8, 8), 40 * i, np.uint8)).save(root / c / f"{i}.png")
    (root / "b" / "1.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    rc = main(["data", "--dataset", str(root), "--out", str(tmp_path / "dl"), "--sites", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and "1 image file(s)" in err and "1.png (corrupt or not an image" in err
    assert not (tmp_path / "dl" / "site-1.json").exists()


def test_the_iid_reference_of_a_sweep_case_is_a_valid_job_on_the_training_sites(tmp_path, monkeypatch):
    """The IID FedAvg reference of a sweep case: its job config must load as jobs/run.py loads it (the sweep's cases
    named methods the reference's config no longer has: every sweep config's IID reference failed), and its
    federation holds the training sites only — held-out sites do not thin it."""
    calls = []

    def run_job(spec, datalists, work, n_sites=0, *a, **k):
        calls.append((spec.method, spec, sorted(p.stem for p in datalists.glob("*.json") if p.stem != "dataset"),
                      datalists))
        (work / "server" / "models").mkdir(parents=True, exist_ok=True)  # what a finished run leaves (the unseen-site
        (work / "server" / "metrics.json").write_text('{"status": "finished"}')  # step's job is built from it)
        (work / "server" / "models" / "global.pt").write_bytes(b"")
        doc = metrics_doc(0.5)
        for r in doc["rounds"]:  # what the unseen-site step reads of a run
            r.update(task="validate", sites={"site-1": {"accuracy": 0.5}})
        return doc

    monkeypatch.setattr("fedmed.run.jobs.run_job", run_job)
    cfg = write_cfg(tmp_path, references=["iid_fedavg"], seeds=[0],
                    federation={"sites": 3, "partition": "dirichlet", "alpha": 0.5, "unseen_sites": 1},
                    sweep=[{"name": "a", "set": ["federation.alpha=0.3"], "methods": ["Prox"]}])
    assert main(["sweep", str(cfg), "--out", str(tmp_path / "sweep")]) == 0
    ref = [c for c in calls if c[0] == "FedAvg (IID)"]
    assert ref, [c[0] for c in calls]
    _, spec, sites, datalists = ref[0]
    assert json.loads((datalists / "dataset.json").read_text())["partition"] == "iid"
    assert sites == ["site-1", "site-2", "site-3"] and spec.sites == sites  # the training sites, not the held-out one


def test_every_test_split_below_k_min_is_a_table_that_says_withheld(tmp_path, monkeypatch):
    """Every site's test split below k_min: the sites send no score (NaN, n_test 0). The experiment used to crash after
    its runs formatting None; the console and the table say "withheld"."""
    from fedmed.algorithms.metrics import site_metrics
    from fedmed.report.record import Recorder

    def run_job(spec, datalists, work, n_sites=0, *a, **k):
        work.mkdir(parents=True, exist_ok=True)
        rec = Recorder(work / "rec", tensorboard=False)
        rec.begin_attempt(0)
        for r, task in ((0, "train"), (1, "validate")):
            res = site_metrics(np.array([0, 1]), np.array([[0.9, 0.1], [0.2, 0.8]]), 2, k_min=5)  # 2 < k_min
            rec.record(r, [(s, {m: res[m] for m in ("accuracy", "macro_f1", "auc")},
                            {"n_test": res["n_test"], "confusion": res["confusion"], "score_hist": res["score_hist"],
                             "withheld": res["withheld"], **({"n_train": 9} if task == "train" else {})})
                           for s in ("site-1", "site-2")], task=task)
        rec.finish("finished")
        return rec.doc

    monkeypatch.setattr("fedmed.run.jobs.run_job", run_job)
    lines = []
    E.run_experiment(str(write_cfg(tmp_path, seeds=[0])), tmp_path / "out", methods=["FedAvg"], log=lines.append)
    assert any("test accuracy withheld (site mean)" in ln for ln in lines), lines
    table = (tmp_path / "out" / "summary.md").read_text()
    row = next(ln for ln in table.splitlines() if ln.startswith("| FedAvg |"))
    assert row.count("withheld") >= 6 and "n/a" not in row, row


def test_one_output_folder_is_written_by_one_run_at_a_time(tmp_path, fake_job, capsys):
    """Two experiments writing one --out lost one's rows silently; the second is refused in one line."""
    out = tmp_path / "out"
    cfg = write_cfg(tmp_path, seeds=[0])
    with E.output_lock(out):
        assert main(["experiment", str(cfg), "--out", str(out), "--methods", "FedAvg"]) == 2
        assert "another fedmed run is writing this folder (pid " in capsys.readouterr().err
        assert not (out / "results.csv").exists() and fake_job == []
    assert main(["experiment", str(cfg), "--out", str(out), "--methods", "FedAvg"]) == 0  # the folder is free again
    assert len(fake_job) == 1


def test_resume_continues_a_run_whose_server_was_killed_from_its_checkpoint(tmp_path, monkeypatch):
    """A killed server leaves a run 'failed' with a checkpoint of its last completed round: --resume continues from it
    (it used to redo every round)."""
    calls = []

    def run_job(spec, datalists, work, n_sites=0, *a, **k):
        calls.append(Path(spec.server_files[-1][0]) if spec.resume else None)
        work.mkdir(parents=True, exist_ok=True)
        if len(calls) == 1:
            (work / "server" / "checkpoint").mkdir(parents=True)
            (work / "server" / "checkpoint" / "state.json").write_text(json.dumps({"next_round": 2}))
            raise E.RunError("failed", "the server process ended while the run was still going (killed or crashed)")
        return metrics_doc(0.6)

    monkeypatch.setattr("fedmed.run.jobs.run_job", run_job)
    cfg = write_cfg(tmp_path, seeds=[0])
    with pytest.raises(E.ExperimentError):
        E.run_experiment(str(cfg), tmp_path / "out", methods=["FedAvg"], log=lambda *a: None)
    lines = []
    E.run_experiment(str(cfg), tmp_path / "out", methods=["FedAvg"], log=lines.append, resume=True)
    # the job resumes from (a copy of) the failed run's checkpoint
    assert calls[0] is None and calls[1] == tmp_path / "out" / "runs" / "seed0" / "FedAvg" / "resume_from" / "checkpoint"
    assert any("failed earlier; resuming from its checkpoint (round 2)" in ln for ln in lines), lines


def test_a_missing_weights_file_is_named_before_any_method_trains(tmp_path, fake_job):
    """An encoder weights file that is not there was found only when its method's job was built — after every
    method before it had trained (hours on a full-size recipe); now before the first run."""
    cfg = write_cfg(tmp_path, methods=[{"name": "FedAvg", "workflow": "fedavg"},
                                       {"name": "F", "workflow": "fmcl", "encoder": "random_cnn",
                                        "encoder_weights": str(tmp_path / "missing.pth")}])
    with pytest.raises(E.ExperimentError, match=r"method 'F': encoder random_cnn: weights file .*missing.pth not found"):
        E.run_experiment(str(cfg), tmp_path / "out", log=lambda *a: None)
    assert fake_job == [] and not (tmp_path / "out" / "data").exists()


def test_a_reports_setup_line_never_shows_an_absolute_data_path(tmp_path, monkeypatch):
    """#38: the demo's combined report said "Setup: data /tmp/.../phantoms" — a hospital's folder names in a report.
    A data path is shown as given when relative, relative to the working or output folder, else as .../name."""
    import json

    from fedmed.config import load_config
    from fedmed.core.io import shown_path
    from fedmed.run.experiment import _setup

    monkeypatch.chdir(tmp_path)
    assert shown_path("../shared/data/busi") == "../shared/data/busi"
    assert shown_path(str(tmp_path / "data" / "x")) == "data/x"
    assert shown_path("/srv/hospital/patients_2024") == ".../patients_2024"
    assert shown_path(str(tmp_path / "out" / "phantoms"), tmp_path / "out") == "out/phantoms"  # cwd first
    cfg = tmp_path / "c.yaml"
    cfg.write_text("name: x\ndataset: {path: /srv/hospital/patients_2024, image_size: 8, channels: 1}\n"
                   "federation: {sites: 2}\nmethods: [{name: FedAvg, workflow: fedavg}]\n")
    exp = load_config(cfg)
    d = tmp_path / "o" / "data" / "seed0"
    d.mkdir(parents=True)
    (d / "dataset.json").write_text(json.dumps({"sites": []}))
    line = "; ".join(_setup(exp, d))
    assert "/srv" not in line and "data .../patients_2024" in line, line


def test_the_setup_line_names_resnet9s_width_and_no_other_networks(tmp_path):
    """The Setup line said "width 16 (batch norm)" — ResNet-9's settings — for any network (a DenseNet121 too)."""
    import json

    from fedmed.config import load_config
    from fedmed.run.experiment import _setup

    d = tmp_path / "o" / "data" / "seed0"
    d.mkdir(parents=True)
    (d / "dataset.json").write_text(json.dumps({"sites": []}))
    lines = {}
    for arch, model in (("resnet9", "{width: 8, norm: group}"),
                        ("DenseNet121", "{arch: DenseNet121, args: {spatial_dims: 2, dropout_prob: 0.1}}")):
        cfg = tmp_path / f"{arch}.yaml"
        cfg.write_text(f"name: x\ndataset: {{path: data, image_size: 8, channels: 1}}\nfederation: {{sites: 2}}\n"
                       f"model: {model}\nmethods: [{{name: FedAvg, workflow: fedavg}}]\n")
        lines[arch] = "; ".join(_setup(load_config(cfg), d))
    assert "8x8x1, resnet9 width 8 (group norm)" in lines["resnet9"], lines["resnet9"]
    assert "8x8x1, DenseNet121 (dropout_prob=0.1, spatial_dims=2)" in lines["DenseNet121"], lines["DenseNet121"]
    assert "width" not in lines["DenseNet121"] and "norm" not in lines["DenseNet121"]


def test_a_methods_files_are_checked_once_per_experiment_not_again_for_each_job(tmp_path, monkeypatch):
    """#55: check_method_files (which loads an encoder's weights file) ran before the runs and again in every job
    built for them; now once per method, before any run — `fedmed job build` still checks in its own builder."""
    from fedmed.run import jobspec

    calls = []

    def counted(exp, method):
        calls.append(method.name)

    monkeypatch.setattr(jobspec, "check_method_files", counted)
    monkeypatch.setattr(E, "check_method_files", counted)
    monkeypatch.setattr("fedmed.run.jobs.run_job", lambda spec, datalists, work, *a, **k: (work.mkdir(parents=True, exist_ok=True),
                                                                              metrics_doc(0.5))[1])
    E.run_experiment(str(write_cfg(tmp_path)), tmp_path / "out", log=lambda *a: None)
    assert calls == ["FedAvg", "Prox"]  # two methods x two seeds: four jobs, two checks
    jobspec.job_spec(load_config({**BASE, "dataset": {**BASE["dataset"], "classes": list("0123456789")}}),
                     load_config(BASE).methods[0], 0)
    assert calls == ["FedAvg", "Prox", "FedAvg"]


def test_in_process_runs_the_jobs_here_resumes_them_and_reports_a_failure(tmp_path, monkeypatch, capsys):
    """``fedmed experiment --in-process``: every job runs in this process (no simulator, no job folder), with the
    simulator's outputs (a line per round, metrics.json, the server's models, run.json); --resume reuses a finished
    one; an error inside a run is that run's failure, named in the experiment's error, not a crash of the others."""
    cfg = write_cfg(tmp_path, seeds=[0])
    out = tmp_path / "out"
    assert main(["experiment", str(cfg), "--out", str(out), "--methods", "FedAvg", "--in-process"]) == 0
    printed = capsys.readouterr().out
    run = out / "runs" / "seed0" / "FedAvg"
    assert not (run / "simulator.log").exists() and not (run / "job").exists()
    doc = json.loads((run / "metrics.json").read_text())
    assert doc["status"] == "finished" and [r["round"] for r in doc["rounds"]] == [0, 1, 2]
    assert (run / "server" / "models" / "global.pt").is_file()
    assert "round 1/2 train: 3 site(s)" in printed and "| FedAvg |" in printed
    assert json.loads((run / "run.json").read_text())["status"] == "finished"

    lines = []
    E.run_experiment(str(cfg), out, methods=["FedAvg"], log=lines.append, resume=True, in_process=True)
    assert any("seed 0 FedAvg: finished earlier with the same settings, reused" in ln for ln in lines), lines

    from fedmed.workflows.fedavg import FedAvg

    def broken(self, *a, **k):
        raise RuntimeError("a planted server error")

    monkeypatch.setattr(FedAvg, "aggregate", broken)
    monkeypatch.setenv("FEDMED_DEBUG", "1")
    capsys.readouterr()
    with pytest.raises(E.ExperimentError) as e:
        E.run_experiment(str(cfg), tmp_path / "out2", methods=["FedAvg"], log=lambda *a: None, in_process=True)
    assert "seed 0 FedAvg: failed: RuntimeError: a planted server error (in-process run; FEDMED_DEBUG=1 for the " \
        "traceback)" in str(e.value)
    assert "Traceback" in capsys.readouterr().err  # as the message says, with FEDMED_DEBUG=1
    assert json.loads((tmp_path / "out2" / "runs" / "seed0" / "FedAvg" / "run.json").read_text())["status"] == "failed"
    assert E.IN_PROCESS.get() is False  # the next experiment in this process runs its jobs in the simulator again


def test_in_process_references_train_at_the_sites_thread_count_and_give_the_rest_back(tmp_path, monkeypatch,
                                                                                       fake_job):
    """``--in-process``: the reference rows (a whole federated budget on pooled data) train at the in-process sites'
    torch thread count, as the jobs do, so several in-process experiments share a machine's cores instead of each
    taking them all; the experiment's own count is given back after. Through the simulator they keep the
    process's count (nothing else computes in it meanwhile)."""
    import torch

    from fedmed.run import references as R
    from fedmed.workflows.inprocess import SITE_THREADS

    seen = []

    def central(exp, data_dir, sites, seed, log=print):
        seen.append(torch.get_num_threads())
        return []

    monkeypatch.setattr(R, "centralized_rows", central)
    monkeypatch.setattr("fedmed.run.jobs.run_job_in_process", lambda spec, datalists, work, **k: (
        work.mkdir(parents=True, exist_ok=True), metrics_doc(0.5))[1])
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        cfg = write_cfg(tmp_path, seeds=[0], references=["centralized"])
        E.run_experiment(str(cfg), tmp_path / "a", methods=["FedAvg"], log=lambda *a: None, in_process=True)
        assert seen == [SITE_THREADS] and torch.get_num_threads() == 2
        E.run_experiment(str(cfg), tmp_path / "b", methods=["FedAvg"], log=lambda *a: None)  # the simulator's path
        assert seen == [SITE_THREADS, 2] and SITE_THREADS == 1
    finally:
        torch.set_num_threads(before)


def test_the_setup_line_states_the_realised_split_and_the_patients_behind_validation(tmp_path):
    """A patient-wise split can deal far from the asked fractions (a user's brain-MRI federation: asked 20% / 15%,
    dealt 27% / 24%, most sites validating on one patient, no warning). The Setup line states what was dealt, the
    patients behind the validation splits, and says which sites validate on fewer than MIN_PATIENTS."""
    import json

    from fedmed.config import load_config
    from fedmed.run.experiment import _setup

    d = tmp_path / "o" / "data" / "seed0"
    d.mkdir(parents=True)
    (d / "dataset.json").write_text(json.dumps({"sites": ["a", "b"]}))
    img = {"image": "x.png", "label": 0}
    # a: 6 training, 4 validation images of 1 patient, 2 test; b: 6 training, 4 validation of 4 patients (no ids), 2 test
    (d / "a.json").write_text(json.dumps({"training": [img] * 6, "validation": [{**img, "patient": "p1"}] * 4,
                                          "test": [img] * 2}))
    (d / "b.json").write_text(json.dumps({"training": [img] * 6, "validation": [img] * 4, "test": [img] * 2}))
    cfg = tmp_path / "c.yaml"
    cfg.write_text("name: x\ndataset: {path: data, image_size: 8, channels: 1}\n"
                   "federation: {sites: 2, test_fraction: 0.2, val_fraction: 0.15}\n"
                   "methods: [{name: FedAvg, workflow: fedavg}]\n")
    line = "; ".join(_setup(load_config(cfg), d))
    assert "asked test 20% / validation 15% of each site, dealt test 17% / validation 33% of 24 samples" in line, line
    assert "**1 of 2 sites validate on fewer than 5 patients (a)" in line, line


def test_the_setup_line_names_the_servers_optimizer(tmp_path):
    """A FedOpt run's Setup line read as FedAvg's (#89): the server's optimizer is named where it is not the plain
    average."""
    import json

    from fedmed.config import load_config
    from fedmed.run.experiment import _setup

    d = tmp_path / "o" / "data" / "seed0"
    d.mkdir(parents=True)
    (d / "dataset.json").write_text(json.dumps({"sites": []}))
    cfg = tmp_path / "c.yaml"
    cfg.write_text("name: x\ndataset: {path: data, image_size: 8, channels: 1}\nfederation: {sites: 2}\n"
                   "methods: [{name: FedAvg, workflow: fedavg}]\n")
    assert "server Fed" not in "; ".join(_setup(load_config(cfg), d))
    line = "; ".join(_setup(load_config(cfg, ["train.server_opt.kind=avgm", "train.server_opt.beta1=0.6"]), d))
    assert "server FedAvgM (lr 1.0, beta1 0.6)" in line, line


def test_the_constant_answer_is_beside_a_classifier_even_without_references(tmp_path, monkeypatch):
    """#89: the shipped transfer config has ``references: []``, so a served accuracy below the constant answer went
    unremarked. The majority-class row (counts, no training) is always beside a classifier, and the summary says
    which methods fall below it."""
    def run_job(spec, datalists, work, *a, **k):
        work.mkdir(parents=True, exist_ok=True)
        return metrics_doc(-0.15)  # 5% at the final round

    monkeypatch.setattr("fedmed.run.jobs.run_job", run_job)
    rows = E.run_experiment(str(write_cfg(tmp_path)), tmp_path / "out", log=lambda *_: None)
    assert sorted(r["seed"] for r in rows if r["method"] == "Majority class") == [0, 1]
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "| Majority class (reference) |" in summary
    assert "Below the constant answer" in summary and "FedAvg (5.00%)" in summary, summary


def test_the_produced_by_line_runs_for_an_output_folder_outside_the_working_folder(tmp_path, monkeypatch):
    """#89: "Produced by" printed a literal ``.../out`` for an output folder outside the clone; the line must run."""
    import os
    import shlex

    here = tmp_path / "clone"
    here.mkdir()
    monkeypatch.chdir(here)
    elsewhere = tmp_path / "elsewhere" / "out"
    cmd = E._command("app_configs/demo_digits.yaml", ["train.rounds=1"], elsewhere)
    words = shlex.split(cmd)
    assert "..." not in cmd
    out = words[words.index("--out") + 1]
    assert Path(os.path.normpath(here / out)) == elsewhere.resolve()
    assert E._command("c.yaml", [], here / "out").endswith("--out out")  # inside the working folder: as before
