"""``fedmed tune`` (#85; fedmed.run.tune): the recipe chosen on the federation's validation data by successive halving
within a budget of full runs, its Optuna study in SQLite (a tuning resumes), never a test image read, and the chosen
recipe a config ``fedmed experiment`` starts from."""

import json
from pathlib import Path

import pytest
import yaml

CONFIG = {"name": "tunetest", "dataset": {"path": "builtin:digits", "image_size": 8, "channels": 1, "max_per_class": 30},
          "federation": {"sites": 3, "partition": "iid", "val_fraction": 0.3},
          "model": {"arch": "resnet9", "width": 4},
          "train": {"rounds": 3, "local_epochs": 1, "batch_size": 16, "lr": 0.003}, "privacy": {"k_min": 2},
          "selection": "validation", "methods": [{"name": "FMCL", "workflow": "fmcl", "encoder": "random_cnn",
                                                  "n_clusters": 2}]}


@pytest.fixture
def config(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(CONFIG))
    return p


def test_a_tuning_reads_no_test_image_and_writes_a_config_experiment_starts_from(config, tmp_path):
    """Every test image of the federation is garbage (a site that read one would fail its task): the tuning still
    chooses, its trials' records hold validation scores only, and ``tuned.yaml`` — the config extended by the chosen
    recipe — loads and builds a job; tuning.md lists every trial with its validation evidence and the cost."""
    from fedmed.config import load_config
    from fedmed.run.experiment import prepare_federation
    from fedmed.run.jobspec import job_spec
    from fedmed.run.tune import tune

    exp = load_config(config)
    data = prepare_federation(exp, 0, tmp_path / "data")
    broken = 0
    for f in sorted(data.glob("site-*.json")):
        for e in json.loads(f.read_text())["test"]:
            (data / e["image"]).write_bytes(b"not an image")
            broken += 1
    assert broken
    got = tune(config, tmp_path / "t", 3, datalists=data, log=lambda *_: None)
    assert got["runs_spent"] <= 3 + 1e-9 and got["trials"] >= 2
    for rec in (tmp_path / "t" / "trials").glob("trial*/metrics.json"):
        for r in json.loads(rec.read_text())["rounds"]:
            for entry in r["sites"].values():
                assert "accuracy" not in entry and "val_accuracy" in entry  # validation only
    tuned = tmp_path / "t" / "tuned.yaml"
    doc = yaml.safe_load(tuned.read_text())
    assert doc["extends"] == "../c.yaml" and doc["train"]["local_epochs"] == got["best"]["train.local_epochs"]
    from fedmed.run.experiment import classes_override

    e = load_config(tuned, classes_override(data, exp))
    assert e.train.lr == pytest.approx(got["best"]["train.lr"]) and e.name == "tunetest"
    assert e.federation.val_fraction == 0.3  # the rest of the config as the user wrote it
    job_spec(e, e.methods[0], 0)
    table = (tmp_path / "t" / "tuning.md").read_text()
    assert "test data never read" in table and "full run(s) of the config's recipe (budget 3)" in table
    assert table.count("\n| ") == got["trials"] + 1  # a header and a row per trial
    # each trial's best validation score, a pruned trial's too (Optuna keeps its last as its value)
    import csv

    import optuna

    study = optuna.load_study(study_name="fedmed-tunetest", storage=f"sqlite:///{tmp_path / 't' / 'tuning.db'}")
    with (tmp_path / "t" / "tuning.csv").open() as fh:
        for row, t in zip(csv.DictReader(fh), study.trials):
            if t.intermediate_values:
                assert float(row["best_val_accuracy"]) == pytest.approx(max(t.intermediate_values.values()), abs=1e-4)


def test_a_tuning_resumes_from_its_sqlite_study_and_a_larger_budget_continues_it(config, tmp_path, capsys):
    """``fedmed tune`` twice into one folder: the second call keeps the first's trials (from ``tuning.db``) and adds
    trials only up to the larger budget; the same budget again adds none."""
    import sqlite3

    from fedmed.cli.main import main

    out = tmp_path / "t"
    assert main(["tune", str(config), "--budget", "2", "--out", str(out)]) == 0
    first = (out / "tuning.csv").read_text().splitlines()
    con = sqlite3.connect(out / "tuning.db")
    assert con.execute("select count(*) from trials").fetchone()[0] == len(first) - 1
    con.close()
    capsys.readouterr()
    assert main(["tune", str(config), "--budget", "2", "--out", str(out)]) == 0
    assert (out / "tuning.csv").read_text().splitlines() == first  # nothing left to spend: no new trial
    import re

    assert float(re.search(r"; (\d+\.\d+) spent before", capsys.readouterr().out).group(1)) > 1.5
    assert main(["tune", str(config), "--budget", "4", "--out", str(out)]) == 0
    again = (out / "tuning.csv").read_text().splitlines()
    assert again[:len(first)] == first and len(again) > len(first)
    assert main(["tune", str(config), "--budget", "0", "--out", str(out)]) == 2  # a bad budget is one line
    assert "--budget should be a positive number" in capsys.readouterr().err


def test_the_configs_own_recipe_is_the_first_trial(config, tmp_path):
    """The tuning starts from what the user wrote: trial 0 is the config's recipe (its epochs, learning rate, FedAvg, no
    server optimizer), so the chosen recipe's validation score is never below it."""
    import csv

    from fedmed.run.tune import tune

    got = tune(config, tmp_path / "t", 2, log=lambda *_: None)
    with (tmp_path / "t" / "tuning.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    first = rows[0]
    assert first["train.local_epochs"] == "1" and float(first["train.lr"]) == pytest.approx(0.003)
    assert first["method"] == "FedAvg" and first["train.server_opt.kind"] == "none"
    assert first["state"] == "complete"  # the first trial has no rung to fall behind
    assert got["value"] >= float(first["best_val_accuracy"]) - 1e-4


def test_a_trial_killed_with_its_process_is_run_again_with_its_recipe(config, tmp_path, monkeypatch):
    """A tuning stopped mid-trial (kill, lost machine) leaves a RUNNING trial whose heartbeat stops: the next ``fedmed
    tune`` fails it once the heartbeat is older than the grace period and runs its recipe again (here the config's
    own trial 0, which a kill must not lose), so the choice still weighs it."""
    import time

    import optuna

    from fedmed.config import load_config
    from fedmed.run import tune as tuning

    monkeypatch.setattr(tuning, "HEARTBEAT_S", 1)
    monkeypatch.setattr(tuning, "GRACE_S", 1)
    out = tmp_path / "t"
    out.mkdir()
    storage = optuna.storages.RDBStorage(f"sqlite:///{out / 'tuning.db'}", heartbeat_interval=1, grace_period=1)
    study = optuna.create_study(study_name="fedmed-tunetest", storage=storage, direction="maximize")
    exp = load_config(config)
    study.enqueue_trial(tuning.config_recipe(exp))
    killed = study.ask()
    tuning.space(killed, exp)
    killed.set_user_attr("epochs", 2)  # two rounds ran before the kill
    storage.record_heartbeat(killed._trial_id)
    time.sleep(2.5)
    got = tuning.tune(config, out, 2, log=lambda *_: None)
    trials = optuna.load_study(study_name="fedmed-tunetest", storage=f"sqlite:///{out / 'tuning.db'}").trials
    assert trials[0].state == optuna.trial.TrialState.FAIL
    again = [t for t in trials if t.system_attrs.get("failed_trial") == 0]
    assert len(again) == 1 and again[0].state == optuna.trial.TrialState.COMPLETE
    assert again[0].params == trials[0].params and again[0].user_attrs["epochs"] == 3  # its own rounds, run again
    assert got["value"] >= again[0].value


def test_a_natural_federation_tunes_with_the_sites_its_data_names(tmp_path):
    """A natural federation's sites are named by its sources (scannerA-1, ...), not site-1..N: every trial's job is
    built for the sites the written federation has (a tuning of one failed every trial at round 0 before)."""
    import csv

    import numpy as np
    from PIL import Image

    from fedmed.run.tune import tune

    rows, rng = [], np.random.default_rng(0)
    (tmp_path / "img").mkdir()
    for s in ("scannerA", "scannerB"):
        for p in range(16):
            name = f"{s}_{p}.png"
            Image.fromarray(rng.integers(0, 255, (8, 8), dtype=np.uint8)).save(tmp_path / "img" / name)
            rows.append({"image": f"img/{name}", "label": ["benign", "malignant"][p % 2], "site": s, "case": f"{s}{p}"})
    with (tmp_path / "index.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=["image", "label", "site", "case"])
        w.writeheader()
        w.writerows(rows)
    cfg = {"name": "natural", "dataset": {"sources": [{"path": str(tmp_path / "index.csv")}],
                                          "classes": ["benign", "malignant"], "image_size": 8},
           "federation": {"partition": "natural", "test_fraction": 0.25, "val_fraction": 0.3},
           "model": {"arch": "resnet9", "width": 4, "norm": "group"},
           "train": {"rounds": 2, "local_epochs": 1, "batch_size": 4, "lr": 0.003}, "privacy": {"k_min": 2},
           "selection": "validation", "seeds": [0]}
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(cfg))
    got = tune(p, tmp_path / "t", 1.5, log=lambda *_: None)
    assert got["trials"] >= 1
    with (tmp_path / "t" / "tuning.csv").open() as fh:
        assert list(csv.DictReader(fh))[0]["state"] == "complete"


def test_a_tuning_whose_trials_all_fail_stops_with_the_reason(config, tmp_path):
    """A broken federation is not a bad recipe: three failed trials in a row end the tuning with the last one's reason
    (not a hundred trials each failing at round 0)."""
    from fedmed.config import load_config
    from fedmed.run.experiment import prepare_federation
    from fedmed.run.tune import TuneError, tune

    data = prepare_federation(load_config(config), 0, tmp_path / "data")
    for f in data.glob("site-*.json"):
        f.unlink()
    with pytest.raises(TuneError, match="3 trials in a row failed .* the last: trial 2 failed: .*datalist"):
        tune(config, tmp_path / "t", 4, datalists=data, log=lambda *_: None)
