"""Train to convergence (#85; fedmed.workflows.stopping): ``train.rounds`` a ceiling, ``train.stop`` ending a run when
the sites' validation score stops improving — in FedAvg, per cluster, in the references — with why and when recorded,
and the model of the round the selection rule reports kept (the serving plan's reference, #86)."""

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from fedmed.run.followups import ServingPlan

RAW = {"name": "stop", "dataset": {"path": "builtin:digits", "image_size": 8, "channels": 1, "max_per_class": 30},
       "federation": {"sites": 3, "partition": "iid", "val_fraction": 0.3}, "model": {"arch": "resnet9", "width": 4},
       "train": {"rounds": 8, "local_epochs": 1, "batch_size": 16, "lr": 1e-7, "norm_stats": "frozen",
                 "stop": {"patience": 2}},
       "privacy": {"k_min": 2}, "references": [], "selection": "validation",
       "methods": [{"name": "FedAvg", "workflow": "fedavg"}]}


def _federation(tmp_path, **changes):
    from fedmed.config import load_config
    from fedmed.run.experiment import classes_override, prepare_federation

    raw = json.loads(json.dumps(RAW))
    for k, v in changes.items():
        raw[k] = {**raw[k], **v} if isinstance(v, dict) else v
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    exp = load_config(tmp_path / "c.yaml")
    data = prepare_federation(exp, 0, tmp_path / "data")
    return load_config(tmp_path / "c.yaml", classes_override(data, exp)), data


def _state(path: Path) -> dict:
    import torch

    return {k: v.numpy() for k, v in torch.load(path, weights_only=True)["state_dict"].items()}


def test_the_stop_rule_stops_at_the_round_it_names_and_selects_the_best_round():
    """Keras' rule counted in rounds: stop after round r when no round of the last ``patience`` beat the last
    improvement by more than ``min_delta``; the selected round is the highest score, the earliest of equals."""
    from fedmed.workflows.stopping import STILL_IMPROVING, Stopper

    st = Stopper("val_accuracy", patience=2, min_delta=0.01)
    scores = [0.5, 0.6, 0.6, 0.605, 0.59, 0.62]
    halts = [st.observe(r, v, {"w": np.full(2, r, dtype=np.float32)}) for r, v in enumerate(scores)]
    assert halts[:4] == [False, False, False, True]  # 0.605 is no improvement on 0.6 at min_delta 0.01
    assert st.selected == 5 and st.params["w"][0] == 5  # observing goes on; the best is the 0.62 round
    eq = Stopper("val_accuracy")
    for r, v in enumerate([0.5, 0.7, 0.7, float("nan")]):
        assert not eq.observe(r, v)  # patience None: never stops
    assert eq.selected == 1 and STILL_IMPROVING not in eq.why(3)
    up = Stopper("val_accuracy")
    for r in range(3):
        up.observe(r, r / 10)
    assert STILL_IMPROVING in up.why(2)
    resumed = Stopper.from_config(type("T", (), {"stop": type("S", (), {"metric": "auto", "patience": 2,
                                                                         "min_delta": 0.0})})(), st.state())
    assert (resumed.selected, resumed.improved, resumed.best) == (st.selected, st.improved, st.best)


def test_fedavg_stops_when_validation_stops_improving_records_why_and_keeps_the_selected_rounds_model(tmp_path):
    """A FedAvg that cannot learn (a learning rate of 1e-7, batch-norm statistics frozen): its validation accuracy never rises, so it stops after
    round 2 at patience 2 (one more average, scored in the final round 3), records why, and keeps the model of the
    selected round (0, the starting model) beside the final one."""
    from fedmed.run.jobspec import job_spec, run_spec_in_process
    from fedmed.workflows.base import initial_params

    exp, data = _federation(tmp_path)
    spec = job_spec(exp, exp.methods[0], 0)
    assert spec.task_config["train"]["stop"] == {"patience": 2, "min_delta": 0.0, "metric": "val_accuracy"}
    status, fed = run_spec_in_process(spec, data, tmp_path / "run")
    assert status == "finished"
    doc = fed.recorder.doc
    assert [(r["round"], r["task"]) for r in doc["rounds"]] == [(0, "train"), (1, "train"), (2, "train"),
                                                                  (3, "validate")]
    vals = [r["summary"]["mean"]["val_accuracy"] for r in doc["rounds"]]
    assert max(vals) == vals[0]  # nothing learnt: the rule's premise
    st = doc["stop"]["global"]
    assert st["stopped_at"] == 2 and st["selected_round"] == 0 and st["last_round"] == 3
    assert st["why"].startswith("stopped after round 2: no round in the last 2 raised the validation score")
    models = tmp_path / "run" / "models"
    sel, final = _state(models / "selected_global.pt"), _state(models / "global.pt")
    start = initial_params(spec.task_config)
    assert all(np.array_equal(sel[k], np.asarray(start[k])) for k in sel)
    assert any(not np.array_equal(sel[k], final[k]) for k in sel)  # the final model moved (by a little)
    import torch

    assert torch.load(models / "global.pt", weights_only=True)["rounds"] == 3


def test_each_cluster_stops_on_its_own_and_its_sites_are_scored_every_round(tmp_path, monkeypatch):
    """Per cluster: a cluster whose validation score stops rising stops training (its sites score its model every
    later round), while the other trains on to the ceiling and says it was still improving."""
    from fedmed.workflows.base import Workflow
    from fedmed.workflows.stopping import STILL_IMPROVING
    from fedmed.run.jobspec import job_spec, run_spec_in_process

    calls: dict = {}

    def scripted(self, rows, metric):  # cluster 0's score rises every round, cluster 1's never
        c = next(iter({r.meta.get("cluster") for r in rows}), None)
        calls[c] = calls.get(c, -1) + 1
        return 0.1 * calls[c] if c == 0 else 0.5

    monkeypatch.setattr(Workflow, "round_score", scripted)
    exp, data = _federation(tmp_path, federation={"sites": 4, "partition": "iid", "val_fraction": 0.3},
                            train={"rounds": 5, "lr": 1e-3, "stop": {"patience": 1}},
                            methods=[{"name": "FMCL", "workflow": "fmcl", "encoder": "random_cnn", "n_clusters": 2}])
    status, fed = run_spec_in_process(job_spec(exp, exp.methods[0], 0), data, tmp_path / "run")
    assert status == "finished", fed.recorder.doc.get("reason")
    doc = fed.recorder.doc
    trained = [r for r in doc["rounds"] if r["task"] in ("train", "validate")]
    members = {c: sorted(s for s, e in trained[0]["sites"].items() if e["cluster"] == c) for c in (0, 1)}
    assert all(members.values())
    for r in trained:
        assert sorted(r["sites"]) == sorted(members[0] + members[1])  # every site scored every round
        for s in members[1]:  # cluster 1 trained rounds 0 and 1 (stopped after round 1), then only scored
            assert ("n_train" in r["sites"][s]) == (r["round"] <= 1 and r["task"] == "train")
        for s in members[0]:
            assert ("n_train" in r["sites"][s]) == (r["task"] == "train")
    st = doc["stop"]
    assert st["cluster1"]["stopped_at"] == 1 and st["cluster0"]["stopped_at"] is None
    assert STILL_IMPROVING in st["cluster0"]["why"] and st["cluster0"]["last_round"] == 5


def test_the_references_stop_by_the_same_rule(tmp_path):
    """The centralized and each-site-alone references under the same ``train.stop``: a model that learns nothing stops
    after block 2, one more block is scored (as a federated run's final round), and the rows end there."""
    from fedmed.run.references import alone_rows, centralized_rows

    exp, data = _federation(tmp_path)
    sites = exp.site_names()
    cen = centralized_rows(exp, data, sites, 0, log=lambda *_: None)
    assert [r["round"] for r in cen] == [0, 1, 2, 3]
    alone = alone_rows(exp, data, sites, 0, log=lambda *_: None)
    assert [r["round"] for r in alone] == [0, 1, 2, 3] and all(len(r["sites"]) == len(sites) for r in alone)
    off = exp.model_copy(update={"train": exp.train.model_copy(update={"stop": exp.train.stop.model_copy(
        update={"patience": None}), "rounds": 4})})
    assert [r["round"] for r in centralized_rows(off, data, sites, 0, log=lambda *_: None)] == [0, 1, 2, 3, 4]


def test_a_summary_says_which_runs_were_still_improving_when_the_rounds_ran_out():
    from fedmed.report.summary import still_improving

    def rows(method, vals):
        return [{"method": method, "seed": 0, "round": r, "task": "train", "kind": "method", "val_accuracy": v}
                for r, v in enumerate(vals)]

    line = still_improving(rows("FedAvg", [0.5, 0.6, 0.7]) + rows("FMCL", [0.5, 0.8, 0.7]))
    assert line.startswith("Still improving when the rounds ran out: FedAvg (seed 0)") and "FMCL" not in line
    assert still_improving(rows("FMCL", [0.5, 0.8, 0.7])) == ""


def test_the_plans_reference_is_the_model_the_reference_row_reports(tmp_path):
    """#86: under ``selection: validation`` the plan's reference is FedAvg's selected round's model (not its final
    one), so the plan's reference row equals the reported FedAvg row at every site."""
    from fedmed.report.summary import reported_rows
    from fedmed.run.jobspec import job_spec, run_spec_in_process

    exp, data = _federation(tmp_path)
    status, fed = run_spec_in_process(job_spec(exp, exp.methods[0], 0), data, tmp_path / "FedAvg")
    assert status == "finished"
    run = fed.recorder.doc
    spec = job_spec(exp, exp.methods[0], 0, follows=ServingPlan(
        tmp_path / "FedAvg", candidates={"same": tmp_path / "FedAvg"}))
    status, pfed = run_spec_in_process(spec, data, tmp_path / "plan")
    assert status == "finished", pfed.recorder.doc.get("reason")
    carried = _state(tmp_path / "plan" / "_job_files" / "plan" / "global" / "global.pt")
    selected = _state(tmp_path / "FedAvg" / "models" / "selected_global.pt")
    assert all(np.array_equal(carried[k], selected[k]) for k in carried)
    rows = [{"method": "FedAvg", "seed": 0, "round": r["round"], "task": r["task"], "kind": "method",
             "val_accuracy": r["summary"]["mean"]["val_accuracy"]} for r in run["rounds"]]
    chosen = reported_rows(rows, "validation")[("FedAvg", 0)]["round"]
    assert chosen == run["stop"]["global"]["selected_round"]
    reported = next(r for r in run["rounds"] if r["round"] == chosen)["sites"]
    ref = next(r for r in pfed.recorder.doc["rounds"] if r["task"] == "global")["sites"]
    for s in reported:
        for m in ("accuracy", "val_accuracy", "auc"):
            assert ref[s].get(m) == reported[s].get(m), (s, m)


def test_the_recipes_page_stop_block_is_a_valid_config(tmp_path):
    """docs/recipes.md "A federation of your own": its YAML block, added to a config, loads and builds a job whose
    task config carries the rule with the selection's score."""
    import re

    from fedmed.run.jobspec import job_spec

    text = (Path(__file__).resolve().parents[1] / "docs" / "recipes.md").read_text()
    part = text.split("## A federation of your own", 1)[1]
    block = yaml.safe_load(re.search(r"```yaml\n(.*?)```", part, flags=re.S).group(1))
    exp, _ = _federation(tmp_path, **block)
    stop = job_spec(exp, exp.methods[0], 0).task_config["train"]["stop"]
    assert stop == {"patience": 5, "min_delta": 0.0, "metric": "val_accuracy"} and exp.train.rounds == 60


def test_a_summary_flags_a_method_deciding_worse_than_the_constant_answer():
    from fedmed.report.summary import below_constant

    rows = [{"method": "FedAvg", "seed": 0, "round": 3, "task": "validate", "kind": "method", "accuracy": 0.66},
            {"method": "FMCL", "seed": 0, "round": 3, "task": "validate", "kind": "method", "accuracy": 0.80},
            {"method": "Majority class", "seed": 0, "round": None, "task": "reference", "kind": "reference",
             "accuracy": 0.747}]
    line = below_constant(rows)
    assert line.startswith("Below the constant answer (74.70%, the majority class): FedAvg (66.00%)")
    assert "FMCL" not in line and below_constant(rows[1:]) == ""


@pytest.mark.parametrize("method", [{"name": "IFCA", "workflow": "ifca", "n_clusters": 2},
                                    {"name": "CFL", "workflow": "cfl"},
                                    {"name": "Flux", "workflow": "flux", "n_clusters": 2}])
def test_ifca_and_cfl_stop_by_the_same_rule_and_recalibrate_in_their_own_loops(tmp_path, monkeypatch, method):
    """#85 (the rule in every clustered workflow) and #88 item 4 (a workflow's own loop cannot skip the cross-cutting
    steps): IFCA's and CFL's loops stop when the federation's validation score stops rising — after round 2 at
    patience 2 for a model that learns nothing, one more round scored — record why, and re-estimate batch-norm
    statistics (``train.norm_recalibrate``) as FedAvg's loop does."""
    from fedmed.run.jobspec import job_spec, run_spec_in_process
    from fedmed.workflows.base import Workflow

    asked = []
    real = Workflow.gather

    def counted(self, task_name, message, what, **kw):
        got = real(self, task_name, message, what, **kw)
        if task_name == "norm_stats" and got:  # the sites sent their statistics and the server re-estimated
            asked.append(kw.get("round_"))
        return got

    monkeypatch.setattr(Workflow, "gather", counted)
    exp, data = _federation(tmp_path, methods=[method], train={"norm_recalibrate": True, "norm_stats": "train"})
    status, fed = run_spec_in_process(job_spec(exp, exp.methods[0], 0), data, tmp_path / "run")
    assert status == "finished", fed.recorder.doc.get("reason")
    doc = fed.recorder.doc
    r0 = (doc.get("clustering") or {}).get("start_round", 0) if method["workflow"] == "flux" else 0  # Flux: once
    # clustered (its warm-up runs to its own Eq. 14); the rule's first round sets the best, two more without a rise
    assert [(r["round"], r["task"]) for r in doc["rounds"] if r["task"] in ("train", "validate")] == [
        *[(k, "train") for k in range(r0 + 3)], (r0 + 3, "validate")]
    st = doc["stop"]["global"]
    assert st["stopped_at"] == r0 + 2 and st["why"].startswith(f"stopped after round {r0 + 2}")
    assert asked and set(asked) <= set(range(1, r0 + 4)) and r0 + 1 in asked  # the trained rounds re-estimated
