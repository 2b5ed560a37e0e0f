"""Tables and console lines never select a round on test data; reference rows and margins are right."""

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
    assert e["accuracy"] == "72.50 ± 2.50" and e["rounds"] == [3]


def test_validation_selection_uses_validation_never_test():
    rep = S.reported_rows(ROWS, "validation")
    assert {k: r["round"] for k, r in rep.items()} == {("FedAvg", 0): 2, ("FedAvg", 1): 2}
    e = S.summarize(ROWS, "validation")[0]
    assert e["accuracy"] == "62.50 ± 2.50"  # test accuracy *at the validation-selected round*
    assert "90" not in e["accuracy"] and "95" not in e["accuracy"]  # the test-best round 1 is never reported


def test_validation_selection_needs_a_validation_split():
    rows = [dict(r, val_accuracy=None) for r in ROWS]
    with pytest.raises(ValueError, match="needs validation metrics"):
        S.reported_rows(rows, "validation")


def test_table_and_console_line_use_the_same_round(tmp_path):
    from fedmed.run.experiment import _log_done

    lines = []
    doc = {"wall_seconds": 1.0, "errors": []}
    for selection, expect in (("final", "final round 3: test accuracy 70.00%"),
                              ("validation", "validation-selected round 2: test accuracy 60.00%")):
        lines.clear()
        _log_done(type("M", (), {"name": "FedAvg"})(), doc, [r for r in ROWS if r["seed"] == 0], selection, lines.append,
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
    assert summ[S.UNTRAINED]["dice_wt"] == "6.00 ± 1.00" and summ[S.UNTRAINED]["rounds"] == [0]
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
