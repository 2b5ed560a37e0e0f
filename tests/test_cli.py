import json

import numpy as np
import pytest

from fedmed.cli.main import main
from fedmed.core.io import write_distance_csv

KITS_EMD = np.array([[0, .92, 1.45, 2.46, 13.86], [.92, 0, 1.03, 2.37, 12.55], [1.45, 1.03, 0, 1.15, 11.03],
                     [2.46, 2.37, 1.15, 0, 4.89], [13.86, 12.55, 11.03, 4.89, 0]])


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cluster_farthest_split(tmp_path, capsys):
    f = tmp_path / "kits.csv"
    write_distance_csv(f, [f"client{i}" for i in range(1, 6)], KITS_EMD)
    code, out, _ = run(capsys, "cluster", str(f), "--method", "farthest-split")
    res = json.loads(out)
    assert code == 0 and res["most_distant"] == "client5"
    assert sorted(res["clusters"]) == [["client1", "client2", "client3"], ["client4", "client5"]]


@pytest.mark.parametrize("method, extra", [("agglomerative", ["--k", "2"]), ("auto-k", []), ("dbscan", [])])
def test_cluster_methods(tmp_path, capsys, method, extra):
    f = tmp_path / "d.csv"
    X = np.r_[np.zeros(4), np.ones(4) * 10] + np.arange(8) * 0.01
    write_distance_csv(f, [f"s{i}" for i in range(8)], np.abs(X[:, None] - X[None]))
    code, out, err = run(capsys, "cluster", str(f), "--method", method, *extra)
    assert code == 0, err
    assert sorted(json.loads(out)["clusters"]) == [["s0", "s1", "s2", "s3"], ["s4", "s5", "s6", "s7"]]


@pytest.mark.parametrize("D, msg", [
    (np.array([[0, 1], [2, 0]]), "symmetric"),
    (np.array([[0, -1], [-1, 0]]), "non-negative"),
    (np.array([[0, np.inf], [np.inf, 0]]), "finite"),
])
def test_cluster_bad_matrix(tmp_path, capsys, D, msg):
    f = tmp_path / "bad.csv"
    write_distance_csv(f, ["a", "b"], D)
    code, _, err = run(capsys, "cluster", str(f), "--method", "auto-k")
    assert code == 2 and msg in err


def test_cluster_ragged_csv(tmp_path, capsys):
    f = tmp_path / "bad.csv"
    f.write_text("site,a,b\na,0,1\nb,1\n")
    code, _, err = run(capsys, "cluster", str(f), "--method", "auto-k")
    assert code == 2 and "bad.csv:3: expected 3 cells" in err


def test_cluster_k_above_sites(tmp_path, capsys):
    f = tmp_path / "d.csv"
    write_distance_csv(f, ["a", "b", "c"], np.ones((3, 3)) - np.eye(3))
    code, _, err = run(capsys, "cluster", str(f), "--method", "agglomerative", "--k", "5")
    assert code == 2 and "n_clusters should be <= the number of sites (3)" in err


def test_distances_fmcl_roundtrip(tmp_path, capsys, rng):
    sig = tmp_path / "sigs"
    sig.mkdir()
    for i in range(4):
        np.savez(sig / f"site-{i}.npz", classes=np.array([0, 1 + i % 2]), means=rng.normal(size=(2, 8)),
                 counts=np.array([5.0, 3.0]))
    out = tmp_path / "D.csv"
    code, _, err = run(capsys, "distances", "fmcl", str(sig), "--out", str(out))
    assert code == 0, err
    code, res, _ = run(capsys, "cluster", str(out), "--method", "agglomerative", "--k", "2")
    assert code == 0 and len(json.loads(res)["clusters"]) == 2


def test_distances_dimension_mismatch(tmp_path, capsys):
    sig = tmp_path / "sigs"
    sig.mkdir()
    np.savez(sig / "a.npz", classes=np.array([0]), means=np.ones((1, 4)), counts=np.array([1.0]))
    np.savez(sig / "b.npz", classes=np.array([0]), means=np.ones((1, 5)), counts=np.array([1.0]))
    code, _, err = run(capsys, "distances", "fmcl", str(sig), "--out", str(tmp_path / "D.csv"))
    assert code == 2 and "one embedding dimension" in err and "'b': 5" in err


def test_partition_predi_json(capsys):
    code, out, _ = run(capsys, "partition", "predi", "--classes", "36", "--sites", "4", "--prevalence", "2.0",
                       "--disparity", "1.0", "--json")
    res = json.loads(out)
    M = np.array(res["assignment"])
    assert code == 0 and M.shape == (36, 4) and res["prevalence"] == 2.0 and abs(res["disparity"] - 1.0) <= 0.25


def test_partition_dirichlet(tmp_path, capsys):
    f = tmp_path / "y.txt"
    f.write_text("\n".join(str(i % 3) for i in range(90)))
    code, out, _ = run(capsys, "partition", "dirichlet", "--labels", str(f), "--sites", "5", "--alpha", "0.1", "--json")
    res = json.loads(out)
    assert code == 0 and sum(res["sizes"]) == 90


def test_inapplicable_flags_and_bad_site_names_are_one_line_errors(tmp_path, capsys):
    from fedmed.cli.main import main

    csv = tmp_path / "d.csv"
    csv.write_text("site,a,b,c\na,0,1,2\nb,1,0,3\nc,2,3,0\n")
    assert main(["cluster", str(csv), "--method", "auto-k", "--k", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "fedmed cluster: error: --k does not apply to --method auto-k (auto-k chooses K itself; --k-max bounds it)"
    assert main(["cluster", str(csv), "--method", "agglomerative", "--k", "2", "--scale", "2"]) == 2
    assert "--scale does not apply to --method agglomerative" in capsys.readouterr().err
    dup = tmp_path / "dup.csv"
    dup.write_text("site,a,a\na,0,1\na,1,0\n")
    assert main(["cluster", str(dup), "--method", "auto-k"]) == 2
    assert "site names should be unique, got duplicates ['a']" in capsys.readouterr().err


def test_data_flags_override_the_config_instead_of_being_ignored(tmp_path):
    import json

    from fedmed.cli.main import main

    cfg = tmp_path / "c.yaml"
    cfg.write_text("name: t\ndataset: {path: 'builtin:digits', max_per_class: 6}\nfederation: {sites: 4}\n")
    assert main(["data", "--config", str(cfg), "--sites", "2", "--out", str(tmp_path / "o")]) == 0
    assert json.loads((tmp_path / "o" / "dataset.json").read_text())["sites"] == ["site-1", "site-2"]


def test_every_flag_has_help_and_shows_its_default():
    import argparse

    from fedmed.cli.main import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for verb, p in sub.choices.items():
        assert isinstance(p.formatter_class, type) and issubclass(p.formatter_class, argparse.ArgumentDefaultsHelpFormatter), verb
        for action in p._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help, f"fedmed {verb} {action.option_strings or action.dest}: no help text"


def test_every_help_states_each_default_once_and_names_its_command(capsys):
    """``--help`` of every verb (and of the shipped job builder and runner) says an option's default once, never
    ``(default: None)``; ``fedmed job build --help`` is named as typed; ``fedmed --version`` answers."""
    import re
    import subprocess
    import sys

    from fedmed.cli.main import build_parser, main

    p = build_parser()
    verbs = next(a for a in p._actions if isinstance(a, __import__("argparse")._SubParsersAction)).choices
    texts = [p.format_help()] + [v.format_help() for v in verbs.values()]
    for action in ("build", "run"):
        r = subprocess.run([sys.executable, "-m", "fedmed", "job", action, "--help"], capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0 and r.stdout.startswith(f"usage: fedmed job {action} "), r.stdout[:200]
        texts.append(r.stdout)
    for text in texts:
        flat = " ".join(text.split())
        assert "(default: None)" not in flat
        for opt in re.split(r"\s(?=-{1,2}[a-z])", flat):
            added = re.search(r"\(default: [^()]*\)$", opt)  # what argparse appends
            assert not (added and "default" in opt[:added.start()]), opt  # ... to a help that said it already
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and re.match(r"fedmed \d+\.\d+", capsys.readouterr().out)


def test_the_demo_page_says_once_what_every_part_would_repeat(tmp_path):
    """#89: the demo report said "All of this is from one seed..." six times and the "Values in %..." paragraph three
    times: once each now, the later parts pointing back to the first."""
    from fedmed.cli.demo import DEMO_PARTS, demo_summary
    from fedmed.report.findings import ONE_SEED

    values = "Values in %, from 1 seed at each run's final round."
    parts = list(DEMO_PARTS)[:2]
    for p in parts:
        (tmp_path / p).mkdir()
        (tmp_path / p / "summary.md").write_text(f"## {p}\n\n### What this found\n\n- A finding of {p}.\n- {ONE_SEED}\n\n"
                                                 f"{values}\n\n| Method |\n|---|\n| FedAvg |\n")
    text = demo_summary(tmp_path, parts, "fedmed demo", "digits")
    assert text.count("All of this is from one seed") == 1 and text.count(values) == 1
    assert f"A finding of {parts[0]}" in text and f"A finding of {parts[1]}" in text
    assert "(Read as part 1's table.)" in text


def test_the_help_names_the_simulators_log_and_the_folder_plan_wants(capfd):
    """#89: ``job run --help`` named ``<workspace>/<job>.log`` (the log is ``simulator.log``) and ``plan --help`` did
    not say which folder ``--global`` wants."""
    import re

    from fedmed.cli.main import main

    for argv, want in ((["job", "run", "--help"], "<workspace>/simulator.log"),
                       (["plan", "--help"], "results/<name>/runs/seed0/FedAvg")):
        try:
            main(argv)
        except SystemExit:
            pass
        assert want in re.sub(r"\s+", " ", capfd.readouterr().out).replace("- ", "-"), argv
