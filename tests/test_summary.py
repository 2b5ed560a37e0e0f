"""Tables and console lines never select a round on test data; reference rows and margins are right."""

import json
from pathlib import Path

import numpy as np
import pytest

from fedmed.report import summary as S


def run_rows(method, seed, tests, vals, kind="method"):
    """One run whose served model scores ``tests[r]`` on test and ``vals[r]`` on validation in round r."""
    return [{"method": method, "kind": kind, "seed": seed, "round": r, "task": "train" if r < len(tests) - 1 else "validate",
             "accuracy": t, "macro_f1": t, "auc": t, "pooled_accuracy": t, "pooled_macro_f1": t, "pooled_auc": t,
             "val_accuracy": v, "sites": {}} for r, (t, v) in enumerate(zip(tests, vals))]


# test accuracy peaks in round 1, validation in round 2, the final round is 3
ROWS = run_rows("FedAvg", 0, tests=[0.5, 0.9, 0.6, 0.7], vals=[0.5, 0.6, 0.8, 0.7]) + \
    run_rows("FedAvg", 1, tests=[0.5, 0.95, 0.65, 0.75], vals=[0.5, 0.6, 0.85, 0.7])


def test_final_selection_reports_the_last_round():
    rep = S.reported_rows(ROWS, "final")
    assert {k: r["round"] for k, r in rep.items()} == {("FedAvg", 0): 3, ("FedAvg", 1): 3}
    e = S.summarize(ROWS, "final")[0]
    assert e["accuracy"] == "72.50 ± 2.50" and e["rounds"] == [3, 3]  # one per seed (#89: it was a sorted set)
    assert S._round_label(e, "final") == "final (3)"  # one number where every seed agrees


def test_validation_selection_uses_validation_never_test():
    rep = S.reported_rows(ROWS, "validation")
    assert {k: r["round"] for k, r in rep.items()} == {("FedAvg", 0): 2, ("FedAvg", 1): 2}
    e = S.summarize(ROWS, "validation")[0]
    assert e["accuracy"] == "62.50 ± 2.50"  # test accuracy *at the validation-selected round*
    assert "90" not in e["accuracy"] and "95" not in e["accuracy"]  # the test-best round 1 is never reported


def test_validation_auc_selection_reads_pooled_validation_auc_never_accuracy_or_test(tmp_path):
    """selection 'validation_auc': the round with the best pooled validation AUC (the earliest on a tie), where the
    accuracy rule and the test numbers would each pick another round."""
    auc = {0: [0.5, 0.7, 0.6, 0.9, 0.9], 1: [0.5, 0.95, 0.8, 0.7, 0.6]}
    rows = [dict(r, pooled_val_auc=auc[r["seed"]][r["round"]])
            for r in run_rows("FedAvg", 0, tests=[0.5, 0.9, 0.6, 0.7, 0.8], vals=[0.5, 0.6, 0.8, 0.7, 0.6])
            + run_rows("FedAvg", 1, tests=[0.5, 0.6, 0.65, 0.75, 0.99], vals=[0.5, 0.6, 0.85, 0.7, 0.5])]
    assert {k: r["round"] for k, r in S.reported_rows(rows, "validation_auc").items()} == {("FedAvg", 0): 3,
                                                                                           ("FedAvg", 1): 1}
    assert {k: r["round"] for k, r in S.reported_rows(rows, "validation").items()} == {("FedAvg", 0): 2,
                                                                                       ("FedAvg", 1): 2}
    e = S.summarize(rows, "validation_auc")[0]
    assert e["accuracy"] == "65.00 ± 5.00" and e["rounds"] == [3, 1]  # seed 0's round, then seed 1's
    assert S._round_label(e, "validation_auc") == "val-AUC-selected (3, 1)"
    text = S.write_outputs([r for r in rows if r["seed"] == 0], tmp_path, title="t", command="c",
                           selection="validation_auc")
    assert "best AUC on the sites' validation images pooled" in text and "val-AUC-selected (3)" in text
    with pytest.raises(ValueError, match="needs validation metrics"):  # no validation split at all
        S.reported_rows([dict(r, pooled_val_auc=None, val_accuracy=None) for r in rows], "validation_auc")
    # rows saved before the pooled validation AUC was kept: the error says how to write it back, not "no split"
    with pytest.raises(ValueError, match="saved without .* --resume` writes it back") as e:
        S.reported_rows([dict(r, pooled_val_auc=None) for r in rows], "validation_auc")
    assert "val_fraction" not in str(e.value)
    with pytest.raises(ValueError, match="validation_auc.*classifiers"):
        S.reported_rows([dict(r, dice_mean=0.5, val_dice_mean=0.5) for r in rows], "validation_auc")
    with pytest.raises(ValueError, match="selection should be one of"):
        S.reported_rows(rows, "auc")


def test_rows_from_a_run_record_carry_the_pooled_validation_auc():
    doc = {"rounds": [{"round": 0, "task": "validate", "summary": {"mean": {"accuracy": 0.7, "val_accuracy": 0.6},
                                                                     "std": {}, "pooled": {"auc": 0.8},
                                                                     "pooled_val": {"accuracy": 0.65, "auc": 0.77}}}]}
    row = S.rows_from_metrics("FedAvg", 0, doc)[0]
    assert row["pooled_val_auc"] == 0.77 and row["pooled_val_accuracy"] == 0.65


def test_validation_selection_needs_a_validation_split():
    rows = [dict(r, val_accuracy=None) for r in ROWS]
    with pytest.raises(ValueError, match="needs validation metrics"):
        S.reported_rows(rows, "validation")


def test_table_and_console_line_use_the_same_round(tmp_path):
    from fedmed.run.records import log_done

    lines = []
    doc = {"wall_seconds": 1.0, "errors": []}
    for selection, expect in (("final", "final round 3: test accuracy 70.00%"),
                              ("validation", "validation-selected round 2: test accuracy 60.00%")):
        lines.clear()
        log_done(type("M", (), {"name": "FedAvg"})(), doc, [r for r in ROWS if r["seed"] == 0], selection, lines.append,
                  tmp_path)
        assert expect in lines[0]
        text = S.write_outputs([r for r in ROWS if r["seed"] == 0], tmp_path / selection, title="t", command="c",
                               selection=selection)
        row = next(ln for ln in text.splitlines() if ln.startswith("| FedAvg"))
        assert expect.split("accuracy ")[1].rstrip("%") in row  # same number, same unit (%)


def test_cluster_majority_margin_is_paired_over_seeds():
    rows = run_rows("FMCL", 0, [0.5, 0.80], [0.5, 0.8]) + run_rows("FMCL", 1, [0.5, 0.82], [0.5, 0.8])
    rows += [{"method": "FMCL: cluster-majority", "kind": "reference", "seed": s, "round": None, "accuracy": a,
              "sites": {}} for s, a in ((0, 0.78), (1, 0.70))]
    summ = S.summarize(rows)
    assert [e["kind"] for e in summ] == ["method", "reference"]  # references after the methods
    table = S.classification_table(summ, "final")
    line = next(ln for ln in table.splitlines() if ln.startswith("| FMCL |"))
    assert line.rstrip(" |").endswith("+7.00 ± 5.00")  # (2 and 12 points): mean 7, std 5 — not within the spread


def test_one_seed_prints_no_spread():
    assert S.fmt([0.5]) == "50.00" and S.fmt([0.5, 0.7]) == "60.00 ± 10.00" and S.fmt([np.nan]) == "n/a"


def test_table_states_the_clusters_found_per_seed_and_their_ari():
    """The no-shift table must say which K each clustering method found (issue: 'K found')."""
    rows = []
    for seed, k, ari in ((0, 1, 1.0), (1, 2, 0.5)):
        rows += [{"method": "FedAvg", "kind": "method", "seed": seed, "round": 3, "accuracy": 0.9},
                 {"method": "FMCL", "kind": "method", "seed": seed, "round": 3, "accuracy": 0.9, "n_clusters": k,
                  "ari": ari}]
    table = S.classification_table(S.summarize(rows), "final")
    head, _, fedavg, fmcl = table.splitlines()[:4]
    assert "K (per seed)" in head and "ARI vs true groups" in head
    assert "| 1, 2 | 0.75 ± 0.25 |" in fmcl  # ARI on its own 0-1 scale
    assert fedavg.startswith("| FedAvg | final (3) |  |  |")
    plain = S.classification_table(S.summarize([r for r in rows if r["method"] == "FedAvg"]), "final")
    assert "K (per seed)" not in plain


def test_a_segmentation_table_has_the_untrained_networks_row():
    """The untrained row is the centralized reference before its first round, not a method's round 0 or final
    round; it is listed with the references."""
    def seg(method, seed, dices, kind="method"):
        return [{"method": method, "kind": kind, "seed": seed, "round": r, "task": "train", "dice_wt": d,
                 "dice_tc": d, "dice_et": d, "dice_mean": d, "sites": {}} for r, d in enumerate(dices)]

    rows = (seg("FedAvg", 0, [0.03, 0.5, 0.7]) + seg("FedAvg", 1, [0.04, 0.6, 0.8])
            + seg("Centralized", 0, [0.05, 0.6, 0.75], "reference") + seg("Centralized", 1, [0.07, 0.7, 0.85], "reference"))
    summ = {e["method"]: e for e in S.summarize(rows, "final")}
    assert summ[S.UNTRAINED]["dice_wt"] == "6.00 ± 1.00" and summ[S.UNTRAINED]["rounds"] == [0, 0]
    assert summ[S.UNTRAINED]["kind"] == "reference" and summ["Centralized"]["dice_wt"] == "80.00 ± 5.00"
    assert [e["method"] for e in S.summarize(rows, "final")][-1] == S.UNTRAINED
    assert S.UNTRAINED not in {e["method"] for e in S.summarize(ROWS, "final")}  # classification: no such row


def test_a_3d_table_says_when_every_site_is_served_one_model():
    """#38: the demo's per-site Dice columns were four copies of one number (FedAvg serves one model, scored on the
    common test subjects); they now say '=' there, and keep each site's own value where the models differ."""
    def seg(method, per_site, kind="method"):
        return {"method": method, "kind": kind, "seed": 0, "round": 1, "task": "train", "dice_wt": 0.5,
                "dice_tc": 0.5, "dice_et": 0.5, "dice_mean": 0.5, "hd95_wt": 3.0, "fp_voxels": 0.0,
                "sites": {s: {"dice_mean": v} for s, v in per_site.items()}}

    rows = [seg("FedAvg", {"site-1": 0.5, "site-2": 0.5}), seg("Each site alone", {"site-1": 0.7, "site-2": 0.2},
                                                                 "reference")]
    table = S.seg_table(S.summarize(rows, "final"), "final")
    fedavg = next(ln for ln in table.splitlines() if ln.startswith("| FedAvg"))
    alone = next(ln for ln in table.splitlines() if ln.startswith("| Each site alone"))
    assert fedavg.endswith("| = | = |"), fedavg
    assert alone.endswith("| 70.00 | 20.00 |"), alone


def test_learning_curves_without_a_validation_split_warn_nothing_and_say_so(tmp_path, monkeypatch):
    """A run with no validation scores drew an empty first panel and asked it for a legend: matplotlib warned "No
    artists with labels found to put in legend" and the panel was a blank frame. The legend goes on the first panel
    with curves, and an empty panel says "no scores"."""
    import warnings

    from fedmed.report import plots

    seen = {}

    def keep(fig, path):
        seen["panels"] = [([t.get_text() for t in ax.texts], ax.get_legend() is not None) for ax in fig.axes]
        return saved(fig, path)

    saved = plots._save
    monkeypatch.setattr(plots, "_save", keep)
    rows = [{"method": m, "seed": s, "round": r, "accuracy": 0.5 + 0.1 * r, "train_loss": 1.0 / (r + 1)}
            for m in ("FedAvg", "FMCL") for s in (0, 1) for r in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        S.plot_curves(rows, tmp_path / "c.png", "t")
    assert (tmp_path / "c.png").stat().st_size > 0
    assert seen["panels"] == [(["no scores"], False), ([], True), ([], False)], seen


def test_every_table_flags_a_run_in_which_sites_sat_out():
    """#56: a run that finished without a site said so only in a note under the tables; now each table's method cell
    carries the flag, per seed, whether the site sat out every round or some."""
    from fedmed.report.summary import classification_table, rows_from_metrics, sat_out, summarize, sweep_table

    def doc(missing):
        m = {"accuracy": 0.5, "macro_f1": 0.5, "auc": 0.5}
        return {"rounds": [{"round": r, "summary": {"n_sites": 2, "mean": m, "std": m, "pooled": m}} for r in range(4)],
                "errors": [], "sites_missing": missing}

    assert sat_out(doc({})) == ""
    assert sat_out(doc({"site-3": {"rounds": [0, 1, 2, 3], "tasks": ["train"], "reason": "x"},
                        "site-2": {"rounds": [2], "tasks": ["train"], "reason": "y"}})) == \
        "site-2 (1 of 4 rounds); site-3 (all 4 rounds)"
    rows = rows_from_metrics("FedAvg", 0, doc({"site-3": {"rounds": [0, 1, 2, 3], "tasks": ["train"], "reason": "x"}}))
    rows += rows_from_metrics("FedAvg", 1, doc({}))
    rows += rows_from_metrics("FedProx", 0, doc({})) + rows_from_metrics("FedProx", 1, doc({}))
    table = classification_table(summarize(rows), "final")
    assert "| FedAvg ⚠ sat out: seed 0: site-3 (all 4 rounds) |" in table
    assert "| FedProx |" in table and table.count("⚠") == 1
    assert "FedAvg ⚠ sat out: seed 0: site-3 (all 4 rounds)" in sweep_table([("case", [], rows)])


def _doc(acc):
    m = {"accuracy": acc, "macro_f1": acc, "auc": acc}
    return {"rounds": [{"round": 1, "summary": {"n_sites": 2, "mean": m, "std": m, "pooled": m}, "sites": {}}],
            "errors": []}


def test_the_first_section_says_what_the_table_found_with_its_uncertainty():
    """#56: the report stated no finding. Now, in plain words: the best method and its margin over FedAvg with the
    seed spread judged, the centralized ceiling, the floor, and a one-seed run said to have no spread."""
    from fedmed.report.findings import findings
    from fedmed.report.summary import rows_from_metrics, summarize

    rows = []
    for seed, (a, b, c) in enumerate([(0.80, 0.78, 0.90), (0.70, 0.74, 0.91), (0.84, 0.79, 0.89)]):
        rows += rows_from_metrics("FMCL", seed, _doc(a)) + rows_from_metrics("FedAvg", seed, _doc(b))
        rows += rows_from_metrics("Centralized", seed, _doc(c), kind="reference")
        rows += rows_from_metrics("Majority class", seed, _doc(0.3), kind="reference")
    said = findings(summarize(rows))
    assert said[0] == ("Of the 2 federated methods, **FMCL** served the sites best: 78.0% (± 5.9 over 3 seeds) "
                       "accuracy (mean over sites).")
    assert said[1].startswith("It beat FedAvg (77.0% (± 2.2 over 3 seeds)) by 1.0 point; within the spread over 3 "
                              "seeds")
    assert "reached 90.0% (± 0.8 over 3 seeds): the ceiling. FMCL is 12.0 points below it (larger than its spread" \
        in said[2]
    assert said[3] == "The floor: a constant answer (always the most common class) scores 30.0% (± 0.0 over 3 seeds)."
    assert not any("one seed" in s for s in said)
    one = findings(summarize([r for r in rows if r["seed"] == 0]))
    assert one[1] == "It beat FedAvg (78.0%) by 2.0 points." and "from one seed" in one[-1]
    # the alone reference says what it trained: a model per site, or per source on a natural federation
    for name, who in (("Each site alone", "Each site training only on its own data reached 60.0%"),
                      ("Each source alone", "Each source training only on its own sites' data (a model per source) "
                                            "reached 60.0%")):
        ref = rows_from_metrics(name, 0, _doc(0.6), kind="reference")
        said = findings(summarize([r for r in rows if r["seed"] == 0] + ref))
        assert any(s.startswith(who + " on average, 20.0 points below FMCL") for s in said), said


def test_the_produced_by_line_reruns_exactly_this_run(tmp_path, monkeypatch):
    """#56: the "Produced by" line dropped --methods and --out, so rerunning it ran something else. Run as written (the
    fedmed CLI), it now builds the same jobs into the same folder."""
    import re
    import shlex

    import yaml

    from fedmed.cli.main import main
    from fedmed.run import experiment as E

    calls = []

    def run_job(spec, datalists, work, *a, **k):
        calls.append((spec.method, spec.task_config["seed"], json.dumps(spec.task_config, sort_keys=True), str(work)))
        work.mkdir(parents=True, exist_ok=True)
        return _doc(0.5)

    monkeypatch.setattr("fedmed.run.jobs.run_job", run_job)
    monkeypatch.chdir(tmp_path)
    Path("c.yaml").write_text(yaml.safe_dump({
        "name": "t", "dataset": {"path": "builtin:digits", "image_size": 8, "max_per_class": 6},
        "federation": {"sites": 2}, "methods": [{"name": "FedAvg"}, {"name": "FMCL (Auto-K)", "workflow": "fmcl"},
                                                {"name": "FedProx", "workflow": "fedprox"}],
        "seeds": [0], "references": []}))
    main(["experiment", "c.yaml", "--out", "my out", "--methods", "FMCL (Auto-K)", "FedProx", "--set",
          "train.rounds=1"])
    first = list(calls)
    cmd = re.search(r"Produced by: `([^`]+)`", (tmp_path / "my out" / "summary.md").read_text()).group(1)
    assert cmd == "fedmed experiment c.yaml --out 'my out' --methods 'FMCL (Auto-K)' FedProx --set train.rounds=1"
    calls.clear()
    main(shlex.split(cmd)[1:])
    assert calls == first and len(first) == 2


def test_a_segmentation_figure_that_shows_a_failure_says_so():
    """#56: the demo's figure showed a phantom with an empty ground truth whose prediction filled the brain,
    unexplained. Each case now carries its verdict, and a failure is named as one."""
    from fedmed.report.html import case_verdict

    truth, pred = np.zeros((4, 4, 4), bool), np.zeros((4, 4, 4), bool)
    assert case_verdict(truth, pred) == {"failure": False, "short": "no tumour, none predicted",
                                         "text": "no tumour, none predicted"}
    pred[:2] = True
    v = case_verdict(truth, pred)
    assert v["failure"] and v["text"] == ("a failure — the case has no tumour, yet the model marks 32 voxels as "
                                          "tumour (a false positive)")
    truth[:1] = True  # 16 true voxels, 32 predicted, 16 shared: Dice 2*16/48
    assert case_verdict(truth, pred) == {"failure": False, "short": "Dice 67%", "text": "Dice 67%"}
    assert case_verdict(truth, np.zeros_like(pred))["text"] == "a failure — the model misses the tumour entirely"
    # #89: a model marking most of the brain on a case: said as such (the demo's summary gave only a mean Dice)
    big = np.ones((4, 4, 4), bool)
    v = case_verdict(truth, big)
    assert v["failure"] and v["text"] == "a failure — the model marks 4.0× the tumour's volume as tumour (Dice 40%)"


def test_the_report_has_a_glossary_for_its_abbreviations_and_folds_a_repeated_policy_table(tmp_path):
    from fedmed.report.glossary import GLOSSARY, terms_in
    from fedmed.report.html import visible_text, write_report

    assert terms_in("FMCL beat FedAvg by 3 pp; ARI 1.00 (004_ App. C, Eq. 1); k_min 5") == [
        "004_", "App. C", "Eq.", "ARI", "FedAvg", "FMCL", "k_min", "pp"]
    assert terms_in("FedAvgM, /x/ARI.png, site_WT") == []  # a longer word, a path, a name: not the term
    (tmp_path / "summary.md").write_text("## t\n\nProduced by: `fedmed experiment c.yaml`\n\n| Method | HD95 |\n|---|---|\n"
                                         "| FedAvg | 1 |\n")
    pol = {"site-1": {"source": "default", "k_min": 5}, "site-2": {"source": "default", "k_min": 5}}
    for m in ("FedAvg", "FedProx", "FMCL"):
        run = tmp_path / "runs" / "seed0" / m
        run.mkdir(parents=True)
        (run / "metrics.json").write_text(json.dumps({"status": "finished", "rounds": [], "site_policies": pol}))
        (run / "run.json").write_text(json.dumps({"method": m}))
    page = write_report(tmp_path).read_text()
    assert page.count("What each site allowed and spent") == 1
    text = visible_text(page)
    assert text.count("Each site's policy and spending: the same as for FMCL (seed 0).") == 2
    glossary = text[text.index("Glossary"):]
    for term in ("HD95", "FedAvg", "FedProx", "FMCL", "k_min"):
        assert f" {term} " in glossary and GLOSSARY[term] in glossary, term


def test_the_report_says_before_training_whether_each_cluster_has_enough_to_train_on(tmp_path):
    """#57: the report says whether the sites differ, how sure, and whether their clusters would be large enough to
    train — each cluster's training images (what its sites reported with their signatures) against the method's
    min_cluster_images; a record without the counts (an older run) shows no such line."""
    from fedmed.report.html import visible_text, write_report

    (tmp_path / "summary.md").write_text("## t\n\nProduced by: `fedmed experiment c.yaml`\n")
    clustering = {"rule": "n_clusters=2", "clusters": [["site-1", "site-2"], ["site-3"]], "cluster_images": [310, 52],
                  "min_cluster_images": 0}
    for m, c in (("FMCL", clustering), ("PACFL", {k: v for k, v in clustering.items() if k != "cluster_images"})):
        run = tmp_path / "runs" / "seed0" / m
        run.mkdir(parents=True)
        (run / "metrics.json").write_text(json.dumps({"status": "finished", "rounds": [], "clustering": c, "differ": {
            "answer": "the 3 sites differ (split-half permutation test, p = 0.001 < alpha 0.05)"}}))
        (run / "run.json").write_text(json.dumps({"method": m}))
    text = visible_text(write_report(tmp_path).read_text())
    assert text.count("do the sites differ? the 3 sites differ (split-half permutation test, p = 0.001") == 2
    assert text.count("Training images per cluster: cluster 0: 310 images at 2 sites, cluster 1: 52 images at 1 site. "
                      "No size floor is set") == 1
    assert "the smallest, cluster 1 (52 images), trains its model on those alone" in text


def test_the_plain_words_count_only_trained_methods_and_say_ties_floors_and_trivial_groupings():
    """#89's report items: "Of the 4 federated methods" when 2 trained (a serving plan's rows counted), "tied ... by
    0.0 points", a method exactly at the constant answer left unsaid, and "exactly the true groups (ARI 1.00)" when
    every site is its own group and its own cluster."""
    from fedmed.report.findings import findings

    three = {"site-1": {}, "site-2": {}, "site-3": {}}
    rows = ([dict(r, n_clusters=3, ari=1.0, sites=three) for r in run_rows("FMCL", 0, tests=[0.5, 0.6], vals=[0.5, 0.6])]
            + run_rows("FedAvg", 0, tests=[0.5, 0.6], vals=[0.5, 0.6])
            + [dict(r, task="served") for r in run_rows("Serving plan", 0, tests=[0.9], vals=[0.9])]
            + [{"method": "Majority class", "kind": "reference", "seed": 0, "round": None, "accuracy": 0.6,
                "macro_f1": 0.3, "auc": 0.5, "sites": {}}])
    text = " ".join(findings(S.summarize(rows, "final")))
    assert "Of the 2 federated methods" in text, text
    assert "scored the same as FedAvg" in text and "by 0.0 points" not in text, text
    assert "⚠ FedAvg scores exactly the floor: it answers the most common class everywhere" in text, text
    assert "every site its own cluster" in text and "exactly the true groups" not in text, text


def test_the_top_summary_says_whether_the_sites_differ_and_that_a_random_signature_is_blind():
    """#89: "do the sites differ?" sat 4,100 px down the report, and "no evidence that the sites differ" from a random
    encoder's signature read as a finding about the sites."""
    from fedmed.report.findings import differ_sentence, findings_section

    random_enc = ["random_cnn [random init (seed=0), no pretrained weights; 0.10M params]"]
    tests = {"FMCL": [{"seed": 0, "p": 0.4, "alpha": 0.05, "encoder": random_enc},
                      {"seed": 1, "p": 0.2, "alpha": 0.05, "encoder": random_enc}]}
    said = differ_sentence(tests)
    assert said.startswith("Do the sites differ? FMCL's split-half test on its signatures: no evidence that the sites "
                           "differ (p = 0.4, 0.2 over 2 seeds"), said
    assert "random weights" in said and "does not mean the sites are alike" in said
    trained = differ_sentence({"FMCL": [{"seed": 0, "p": 0.001, "alpha": 0.05, "encoder": ["efficientnet_lite0 "
                                                                                         "[weights: release.pth]"]}]})
    assert "the sites differ (p = 0.001" in trained and "random weights" not in trained
    section = findings_section(S.summarize(ROWS, "final"), differ=tests)
    assert section.splitlines()[2].startswith("- Do the sites differ?")  # the first finding


def test_learning_curves_keep_equal_methods_visible_on_one_round_axis(tmp_path, monkeypatch):
    """#89: FedAvg's line hid under FMCL's when equal, the train-loss axis ran in fractional rounds and one round
    short of the score axes, and the title promised a band over seeds with one seed."""
    import matplotlib.figure

    saved = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: saved.append(fig))
    rows = [dict(r, train_loss=1.0 / (1 + r["round"])) for r in
            run_rows("FedAvg", 0, tests=[0.5, 0.6, 0.7], vals=[0.5, 0.6, 0.7])
            + run_rows("FMCL", 0, tests=[0.5, 0.6, 0.7], vals=[0.5, 0.6, 0.7])]
    S.plot_curves(rows, tmp_path / "curves.png", "t")
    fig = saved[0]
    axes = fig.axes
    styles = {(ln.get_label(), ln.get_linestyle(), ln.get_marker()) for ln in axes[0].lines}
    assert len(styles) == 2 and len({s[1:] for s in styles}) == 2  # two methods, two looks
    assert [t.get_text() for t in axes[0].get_legend().get_texts()] == ["FedAvg", "FMCL"]
    assert all(ax.get_xlim() == axes[0].get_xlim() for ax in axes)  # one round axis
    ticks = axes[2].get_xticks()
    assert all(float(t).is_integer() for t in ticks)
    assert "one seed: no band" in fig._suptitle.get_text()


def test_the_demo_page_puts_each_parts_learning_curves_under_its_own_table(tmp_path):
    """#89: the demo's learning curves were gathered below every part's table, detached from their parts."""
    import re

    from fedmed.report.html import write_report

    png = tmp_path / "c.png"
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plt.figure(figsize=(1, 1)).savefig(png)
    text = "# fedmed demo\n\nProduced by: `fedmed demo`\n\n"
    for p in ("classification", "flux"):
        (tmp_path / p).mkdir()
        (tmp_path / p / "summary.md").write_text(f"## {p}\n\n| Method |\n|---|\n| FedAvg |\n")
        (tmp_path / p / "curves.png").write_bytes(png.read_bytes())
        text += f"## part {p}\n\n| Method |\n|---|\n| {p}-row |\n\n<!-- fedmed-part: {p} -->\n\n"
    (tmp_path / "summary.md").write_text(text)
    page = write_report(tmp_path).read_text()
    order = [m.group(0) for m in re.finditer(r"classification-row|classification: learning curves|flux-row|"
                                            r"flux: learning curves", page)]
    order = [o for i, o in enumerate(order) if i == 0 or o != order[i - 1]]  # a figure's alt text and its caption
    assert order == ["classification-row", "classification: learning curves", "flux-row", "flux: learning curves"]
    assert page.count("flux: learning curves") == 2  # one figure, not a second copy below every table


def test_a_column_with_nothing_to_say_is_left_out():
    """#89: an empty "vs cluster-majority" column (no clustered method) and a "WT per hemisphere" column equal to WT in
    every row (no subject split into hemispheres) are dropped; each stays where it says something."""
    plain = S.summarize(ROWS, "final")
    assert "vs cluster-majority" not in S.classification_table(plain, "final")
    clustered = ROWS + [{"method": "FedAvg: cluster-majority", "kind": "reference", "seed": s, "round": None,
                         "accuracy": 0.4, "macro_f1": 0.4, "auc": 0.5, "sites": {}} for s in (0, 1)]
    table = S.classification_table(S.summarize(clustered, "final"), "final")
    assert "vs cluster-majority (pp) |" in table and table.splitlines()[2].endswith("| +32.50 ± 2.50 |")

    def seg(method, per_sample):
        return [{"method": method, "kind": "method", "seed": 0, "round": 1, "task": "train", "dice_wt": 0.7,
                 "dice_tc": 0.5, "dice_et": 0.4, "dice_mean": 0.53, "dice_wt_per_sample": per_sample, "sites": {}}]

    assert "WT per hemisphere" not in S.seg_table(S.summarize(seg("FedAvg", 0.7), "final"), "final")
    assert "WT per hemisphere" in S.seg_table(S.summarize(seg("FedAvg", 0.6), "final"), "final")
