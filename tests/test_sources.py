"""Multi-source datasets (fedmed.data.sources) and natural federations (federation.partition: natural): a site per
source, splits by patient, sources held out as unseen sites, and a bad index named in one line."""

import csv
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fedmed.config import ConfigError, load_config
from fedmed.data.images import DataError
from fedmed.run.experiment import prepare_federation

# source -> (patients, images per patient)
SOURCES = {"scannerA": (12, 2), "scannerB": (8, 1), "scannerC": (5, 3)}


def _index(tmp_path, rows=None, header=("image", "mask", "label", "site", "case", "birads")):
    """A small hospital-style index: PNGs of a shade per source, two or three views per patient at some sources."""
    img = tmp_path / "img"
    img.mkdir(exist_ok=True)
    if rows is None:
        rows, rng = [], np.random.default_rng(0)
        for s, (n_pat, views) in SOURCES.items():
            for p in range(n_pat):
                lab = p % 2
                for v in range(views):
                    name = f"{s}_{p}_{v}.png"
                    Image.fromarray(rng.integers(0, 255, (12, 12), dtype=np.uint8)).save(img / name)
                    rows.append({"image": f"img/{name}", "mask": "", "label": ["benign", "malignant"][lab],
                                 "site": s, "case": f"{s[-1]}{p}", "birads": "3"})
    f = tmp_path / "index.csv"
    with f.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(header), extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    return f


def _config(tmp_path, index, **federation):
    cfg = {"name": "natural", "dataset": {"sources": [{"path": str(index)}], "classes": ["benign", "malignant"],
                                          "image_size": 8},
           "federation": {"partition": "natural", "test_fraction": 0.25, "val_fraction": 0.2, **federation},
           "seeds": [0]}
    p = tmp_path / "cfg.json"
    p.write_text(json.dumps(cfg))
    return load_config(p)


def _patient_of(index):
    with index.open() as fh:
        return {r["image"].split("/")[-1]: (r["site"], r["case"]) for r in csv.DictReader(fh)}


def _written(out):
    meta = json.loads((out / "dataset.json").read_text())
    names = meta["sites"] + meta.get("unseen_sites", [])
    return meta, {s: json.loads((out / f"{s}.json").read_text()) for s in names}


def test_a_natural_federation_has_a_site_per_source_and_splits_by_patient(tmp_path):
    index = _index(tmp_path)
    exp = _config(tmp_path, index, split_sources={"scannerA": 2})
    meta, docs = _written(prepare_federation(exp, 0, tmp_path / "fed"))
    assert meta["sites"] == ["scannerA-1", "scannerA-2", "scannerB", "scannerC"]
    assert meta["groups"] == {"scannerA-1": "scannerA", "scannerA-2": "scannerA", "scannerB": "scannerB",
                              "scannerC": "scannerC"}
    patient = _patient_of(index)
    where: dict = {}
    for site, doc in docs.items():
        for split in ("training", "validation", "test"):
            for e in doc[split]:
                src, pid = patient[e["image"].split("/")[-1]]
                assert src == meta["groups"][site]  # every image at the site of its own source
                where.setdefault((src, pid), set()).add((site, split))
        assert doc["test"] and doc["training"]
    assert all(len(v) == 1 for v in where.values()), [k for k, v in where.items() if len(v) > 1]  # no patient split
    assert len(where) == sum(n for n, _ in SOURCES.values())  # every patient placed
    sizes = [sum(len(docs[s][k]) for k in ("training", "validation", "test")) for s in ("scannerA-1", "scannerA-2")]
    assert sizes == [12, 12]  # the split source dealt by patient into sites of equal image counts


def test_held_out_sources_are_unseen_sites_and_stay_out_of_every_training_federation(tmp_path):
    index = _index(tmp_path)
    exp = _config(tmp_path, index, holdout_sources=["scannerC"])
    meta, docs = _written(prepare_federation(exp, 0, tmp_path / "fed"))
    assert meta["sites"] == ["scannerA", "scannerB"] and meta["unseen_sites"] == ["unseen-scannerC"]
    assert sum(len(docs["unseen-scannerC"][k]) for k in ("training", "validation", "test")) == 15
    # the IID reference deals the training sources only (it trains what the methods train on)
    from fedmed.run.experiment import with_classes

    exp_s = with_classes(exp, tmp_path / "fed")
    assert exp_s.federation.site_names == ["scannerA", "scannerB"] and exp_s.federation.sites == 2
    iid = prepare_federation(exp_s, 0, tmp_path / "iid", partition="iid")
    _, idocs = _written(iid)
    files = {e["image"].split("/")[-1] for d in idocs.values() for k in ("training", "validation", "test")
             for e in d[k]}
    assert len(files) == 24 + 8 and not any(f.startswith("scannerC") for f in files)


def test_the_existing_partitions_work_on_a_multi_source_dataset_and_deal_patients(tmp_path):
    index = _index(tmp_path)
    for part in ("iid", "dirichlet"):
        exp = _config(tmp_path, index, partition=part, sites=3, alpha=1.0)
        meta, docs = _written(prepare_federation(exp, 1, tmp_path / part))
        assert meta["patient_wise"] and len(docs) == 3
        patient = _patient_of(index)
        where: dict = {}
        for site, doc in docs.items():
            for split in ("training", "validation", "test"):
                for e in doc[split]:
                    where.setdefault(patient[e["image"].split("/")[-1]], set()).add((site, split))
        assert all(len(v) == 1 for v in where.values())
        assert len(where) == 25


@pytest.mark.parametrize("case,expected", [
    ("missing_column", "no patient column (looked for ['patient', 'case']"),
    ("outside", "label 'normal' is not one of the classes ['benign', 'malignant']"),
    ("two_sites", "patient 'P1' appears at two sites ('scannerA' row 2, 'scannerB' row 3)"),
    ("int_outside", "label 2 is outside the classes"),
])
def test_a_bad_index_is_one_line_naming_the_file(tmp_path, case, expected):
    Image.fromarray(np.zeros((8, 8), np.uint8)).save(tmp_path / "a.png")
    rows = [{"image": "a.png", "label": "benign", "site": "scannerA", "case": "P1"},
            {"image": "a.png", "label": "malignant", "site": "scannerA", "case": "P2"}]
    header = ("image", "label", "site", "case")
    if case == "missing_column":
        header = ("image", "label", "site")
    elif case == "outside":
        rows[1]["label"] = "normal"
    elif case == "two_sites":
        rows[1].update(site="scannerB", case="P1")
    else:
        rows[1]["label"] = "2"
    index = _index(tmp_path, rows, header)
    exp = _config(tmp_path, index)
    with pytest.raises(DataError) as e:
        prepare_federation(exp, 0, tmp_path / "fed")
    msg = str(e.value)
    assert expected in msg and str(index) in msg and "\n" not in msg


def test_a_source_left_out_by_label_is_said_and_other_labels_are_errors(tmp_path, capsys):
    from fedmed.data.sources import read_folder_source

    rng = np.random.default_rng(0)
    for c in ("benign", "malignant", "normal"):
        (tmp_path / "busi" / c).mkdir(parents=True)
        for i in range(3):
            Image.fromarray(rng.integers(0, 255, (8, 8), dtype=np.uint8)).save(tmp_path / "busi" / c / f"{c}{i}.png")
    pool = read_folder_source(tmp_path / "busi", "busi", classes=["benign", "malignant"], ignore_labels=["normal"])
    assert len(pool.items) == 6 and set(pool.sites) == {"busi"} and len(set(pool.groups)) == 6
    assert "3 image(s) with an ignored label ['normal'] left out" in capsys.readouterr().out
    with pytest.raises(DataError, match=r"class folder\(s\) \['normal'\] are not among the classes"):
        read_folder_source(tmp_path / "busi", "busi", classes=["benign", "malignant"])


def test_held_out_sites_of_a_split_source_leave_its_other_sites_training(tmp_path):
    """holdout_sites: a newcomer from a source the federation already knows — of scannerA's 3 sites the last is held
    out (unseen-scannerA-1), the other two train, so the newcomer's own source has a cluster to be compared with."""
    index = _index(tmp_path)
    exp = _config(tmp_path, index, split_sources={"scannerA": 3}, holdout_sites={"scannerA": 1})
    meta, docs = _written(prepare_federation(exp, 0, tmp_path / "fed"))
    assert meta["sites"] == ["scannerA-1", "scannerA-2", "scannerB", "scannerC"]
    assert meta["unseen_sites"] == ["unseen-scannerA-1"] and meta["groups"]["unseen-scannerA-1"] == "scannerA"
    patient = _patient_of(index)
    pids = {site: {patient[e["image"].split("/")[-1]][1] for k in ("training", "validation", "test") for e in doc[k]}
            for site, doc in docs.items()}
    assert not pids["unseen-scannerA-1"] & (pids["scannerA-1"] | pids["scannerA-2"])  # its patients only there
    assert sum(len(v) for k, v in pids.items() if k.startswith(("scannerA", "unseen-scannerA"))) == 12
    with pytest.raises(ValueError, match=r"holdout_sites: 'scannerA' can hold out 1 to n - 1 of the n sites it is "
                                         r"split into \(federation.split_sources: 3\), not 3"):
        prepare_federation(_config(tmp_path, index, split_sources={"scannerA": 3}, holdout_sites={"scannerA": 3}), 0,
                           tmp_path / "bad")
    with pytest.raises(ConfigError, match="the IID reference cannot leave out part of a source"):
        p = tmp_path / "c2.json"
        p.write_text(json.dumps({"name": "x", "dataset": {"sources": [{"path": str(index)}]},
                                 "federation": {"partition": "natural", "split_sources": {"scannerA": 2},
                                                "holdout_sites": {"scannerA": 1}}, "references": ["iid_fedavg"]}))
        load_config(p)
    assert "iid_fedavg" not in exp.references and "centralized" in exp.references  # the default set, without it


def test_natural_settings_are_checked_when_the_config_is_read(tmp_path):
    index = _index(tmp_path)
    with pytest.raises(ConfigError, match="natural makes a site per source: it needs dataset.sources"):
        p = tmp_path / "c.json"
        p.write_text(json.dumps({"name": "x", "dataset": {"path": str(tmp_path)}, "federation": {"partition": "natural"}}))
        load_config(p)
    with pytest.raises(ConfigError, match="give dataset.path or dataset.sources"):
        p.write_text(json.dumps({"name": "x", "dataset": {"path": str(tmp_path), "sources": [{"path": str(index)}]}}))
        load_config(p)
    exp = _config(tmp_path, index, split_sources={"scannerZ": 2})
    with pytest.raises(ValueError, match=r"source\(s\) \['scannerZ'\] are not in the data; its sources are "
                                         r"\['scannerA', 'scannerB', 'scannerC'\]"):
        prepare_federation(exp, 0, tmp_path / "fed")


@pytest.mark.data
def test_the_breast_ultrasound_federation_of_five_sources_is_split_by_patient():
    """app_configs/breast_us_natural.yaml on the real data: BUS-BRA's four scanners and BUSI, 17 sites, no case in two
    splits (two views of one lesion share BUS-BRA's `case`)."""
    from conftest import ROOT, shared_path

    shared_path("bus_bra", "index.csv")
    shared_path("busi")
    import os
    import tempfile

    cwd = os.getcwd()
    os.chdir(ROOT)  # the config's paths are relative to the repository, as its command runs
    try:
        exp = load_config("app_configs/breast_us_natural.yaml")
        with tempfile.TemporaryDirectory() as d:
            meta, docs = _written(prepare_federation(exp, 0, f"{d}/fed"))
    finally:
        os.chdir(cwd)
    assert len(meta["sites"]) == 17 and set(meta["groups"].values()) == {"geLogiq7", "geLogiq5", "toshibaAplio300",
                                                                          "uSystems", "busi"}
    assert meta["sources"] == {"geLogiq7": 902, "geLogiq5": 809, "uSystems": 25, "toshibaAplio300": 139, "busi": 646}
    case = {}
    with open(shared_path("bus_bra", "index.csv")) as fh:
        for r in csv.DictReader(fh):
            case[r["image"].split("/")[-1]] = r["case"]
    where: dict = {}
    for site, doc in docs.items():
        for split in ("training", "validation", "test"):
            for e in doc[split]:
                name = e["image"].split("/")[-1]
                where.setdefault(case.get(name, name), set()).add((site, split))
    assert all(len(v) == 1 for v in where.values())


def _opposed_index(tmp_path):
    """Two scanners whose bright images mean opposite classes: one model for both cannot fit either; a model per
    scanner can. scannerA has 16 patients (split into two sites), scannerB 16."""
    img = tmp_path / "img"
    img.mkdir(exist_ok=True)
    rows, rng = [], np.random.default_rng(0)
    for s, flip in (("scannerA", 0), ("scannerB", 1)):
        for p in range(16):
            bright = p % 2
            lab = bright ^ flip
            name = f"{s}_{p}.png"
            level = 210 if bright else 40
            Image.fromarray(np.clip(level + rng.normal(0, 8, (8, 8)), 0, 255).astype(np.uint8)).save(img / name)
            rows.append({"image": f"img/{name}", "label": ["benign", "malignant"][lab], "site": s, "case": f"{s}{p}"})
    f = tmp_path / "index.csv"
    with f.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=["image", "label", "site", "case"])
        w.writeheader()
        w.writerows(rows)
    return f


def _opposed_config(index, test_fraction: float, rounds: int, **extra) -> dict:
    """A natural federation of :func:`_opposed_index` (scannerA in two sites), a small group-norm ResNet-9."""
    return {"name": "alone", "dataset": {"sources": [{"path": str(index)}], "classes": ["benign", "malignant"],
                                         "image_size": 8},
            "federation": {"partition": "natural", "split_sources": {"scannerA": 2}, "test_fraction": test_fraction,
                           "val_fraction": 0.0},
            "model": {"arch": "resnet9", "width": 4, "norm": "group"},
            "train": {"rounds": rounds, "local_epochs": 5, "batch_size": 4, "optimizer": "adam", "lr": 0.01},
            "seeds": [0], **extra}


def test_each_source_alone_trains_a_model_per_source_and_scores_each_site_with_its_own(tmp_path):
    """references: [alone] on a natural federation: one model per source (scannerA's two sites pooled), each site scored
    with its source's model. Where the sources mean opposite things by the same image, each source alone fits every
    site and the centralized model cannot; under another partition the reference is each site alone."""
    from fedmed.run.references import alone_rows, centralized_rows
    from fedmed.run.experiment import with_classes

    index = _opposed_index(tmp_path)
    cfg = _opposed_config(index, test_fraction=0.25, rounds=4, references=["alone", "centralized"])
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    exp = load_config(tmp_path / "cfg.json")
    fed = prepare_federation(exp, 0, tmp_path / "fed")
    exp = with_classes(exp, fed)
    meta = json.loads((fed / "dataset.json").read_text())
    logs: list[str] = []
    alone = alone_rows(exp, fed, meta["sites"], 0, meta["groups"], log=logs.append)
    central = centralized_rows(exp, fed, meta["sites"], 0, log=lambda *_: None)
    assert [r["round"] for r in alone] == list(range(5)) and {r["method"] for r in alone} == {"Each source alone"}
    assert alone[-1]["n_sites"] == 3 and "scannerA" in logs[-1] and "scannerB" in logs[-1]
    # a progress line as each source's model is trained (the reference is a whole federated budget per source)
    trained = [ln for ln in logs if " trained (" in ln]
    assert len(trained) == 2 and "scannerA trained (1/2, 2 site(s)" in trained[0] and \
        "scannerB trained (2/2, 1 site(s)" in trained[1]
    # and one per block of epochs within each (#89: a reference is never silent): 4 blocks of 5 epochs, 2 sources
    assert len([ln for ln in logs if " epochs " in ln and " of 20 in " in ln]) == 8 and len(logs) == 11
    assert alone[-1]["pooled_accuracy"] == 1.0, alone[-1]
    assert central[-1]["pooled_accuracy"] <= 0.75, central[-1]  # one model for opposed sources
    # each site's record as the site would send it (class rows below k_min withheld), for the per-source table
    docs = {s: json.loads((fed / f"{s}.json").read_text()) for s in meta["sites"]}
    for s, rec in alone[-1]["sites"].items():
        assert np.sum(rec["confusion"]) + rec["withheld"] == len(docs[s]["test"])
        assert all(sum(r) == 0 or sum(r) >= exp.privacy.k_min for r in rec["confusion"])
    work = tmp_path / "out" / "runs" / "seed0" / "_references"
    work.mkdir(parents=True)
    iid = [dict(r, method="FedAvg (IID federation)") for r in alone]  # a reference that also keeps site records
    (work / "run.json").write_text(json.dumps({"rows": alone + iid}))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from natural_per_source import reference_round

    assert reference_round(tmp_path / "out", "Each source alone", 0, 4) == {"sites": alone[-1]["sites"]}
    assert reference_round(tmp_path / "out", "FedAvg (IID federation)", 0, 4) is None  # its sites mix the sources
    # the paired cell of --paired: differences over the seeds both rows have, bold beyond the spread only
    from natural_per_source import paired_cell

    assert paired_cell({0: 0.80, 1: 0.70, 2: 0.75}, {0: 0.70, 1: 0.69, 2: 0.70}) == "**+5.3 ± 3.7**"
    assert paired_cell({0: 0.80, 1: 0.60}, {0: 0.70, 1: 0.70, 2: 0.10}) == "+0.0 ± 10.0"  # seed 2: only one row has it
    assert paired_cell({0: 0.9}, {0: 0.7}) == "+20.0 ± 0.0" and paired_cell({1: 0.9}, {0: 0.7}) == "n/a"
    # the reporting rule read back from the summary.md each rule writes
    from natural_per_source import summary_selection

    from fedmed.report.summary import SELECTIONS, write_outputs

    for selection in SELECTIONS:
        text = write_outputs([dict(r, method="M", kind="method", pooled_val_auc=0.5, val_accuracy=0.5) for r in alone],
                             tmp_path / f"sum_{selection}", title="t", command="c", selection=selection)
        assert summary_selection(text) == selection
    per_site = alone_rows(exp, fed, meta["sites"], 0, None, log=lambda *_: None)
    assert {r["method"] for r in per_site} == {"Each site alone"}


def test_the_alone_reference_is_for_classification(tmp_path):
    p = tmp_path / "cfg.json"
    p.write_text(json.dumps({"name": "x", "dataset": {"path": str(tmp_path), "task": "segmentation"},
                             "references": ["alone"]}))
    with pytest.raises(ConfigError, match="'alone' is a classification reference"):
        load_config(p)


def test_the_reference_benchmark_makes_each_source_alone_on_an_experiments_splits_and_prints_it_per_source(
        tmp_path, monkeypatch, capsys):
    """benchmarks/central_reference.py --alone: each source alone on a finished experiment's splits (data/seed<N>),
    the rows fedmed.run.references.alone_rows gives there, stored under alone_reference/<R>x<E>/ and read back without
    training again, and printed per source as benchmarks/natural_per_source.py reads a method: on opposed scanners a
    model per source fits both (100 % balanced accuracy), which the centralized model cannot."""
    import importlib.util

    from fedmed.run.experiment import with_classes
    from fedmed.run.references import alone_rows

    index = _opposed_index(tmp_path)
    cfg = _opposed_config(index, test_fraction=0.5, rounds=2,
                          privacy={"k_min": 1, "accept_k_min_below_2": True})
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    exp = load_config(tmp_path / "cfg.json")
    run = tmp_path / "run"
    fed = prepare_federation(exp, 0, run / "data" / "seed0")
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "central_reference.py"
    spec = importlib.util.spec_from_file_location("central_reference", path)
    cr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cr)
    assert cr.main([str(run), "--config", str(tmp_path / "cfg.json"), "--selection", "final", "--alone"]) == 0
    printed = capsys.readouterr().out
    stored = run / "alone_reference" / "2x5" / "seed0.json"
    rows = json.loads(stored.read_text())
    meta = json.loads((fed / "dataset.json").read_text())
    want = alone_rows(with_classes(exp, fed), fed, meta["sites"], 0, meta["groups"], log=lambda *_: None)
    assert [r["method"] for r in rows] == ["Each source alone"] * 3 and [r["round"] for r in rows] == [0, 1, 2]
    assert [r["pooled_accuracy"] for r in rows] == pytest.approx([r["pooled_accuracy"] for r in want], abs=1e-12)
    assert rows[-1]["sites"] == json.loads(json.dumps(want[-1]["sites"]))
    assert not (run / "central_reference").exists()
    table = [line for line in printed.splitlines() if line.startswith("| Each source alone |")]
    assert len(table) == 1, printed
    # #89: the printed command names its --config (it ran on another config than the default), and the reference is
    # never silent: a progress line per block of epochs of each source's model
    assert f"benchmarks/central_reference.py {run} --config {tmp_path / 'cfg.json'} --seeds 0" in printed, printed
    assert "each source alone reference, scannerA: epochs 6-10 of 10 in " in printed, printed
    assert "scannerA: bal. acc | scannerA: AUC | scannerB: bal. acc | scannerB: AUC" in printed
    assert table[0].split(" | ")[1] == "100.0 ± 0.0" and table[0].split(" | ")[3] == "100.0 ± 0.0", table[0]
    import fedmed.run.references as R

    monkeypatch.setattr(R, "alone_rows", lambda *a, **k: pytest.fail("trained again"))
    assert cr.seed_rows(run, 0, tmp_path / "cfg.json", [], alone=True) == rows


def test_a_source_whose_site_withheld_a_class_row_has_no_balanced_accuracy():
    """natural_per_source.source_metrics: a source's balanced accuracy comes from its sites' pooled confusion matrices
    and is left out when one of them withheld a class row below k_min (it would be read off the rows that were sent);
    its AUC is the mean of its sites' AUCs."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from natural_per_source import source_metrics

    groups = {"a-1": "a", "a-2": "a", "b-1": "b"}
    recs = {"a-1": {"confusion": [[3, 1], [0, 4]], "auc": 0.9, "withheld": 0},
            "a-2": {"confusion": [[2, 0], [2, 2]], "auc": 0.7, "withheld": 0},
            "b-1": {"confusion": [[5, 0], [0, 0]], "auc": None, "withheld": 2}}
    got = source_metrics(recs, groups)
    assert got["a"]["bacc"] == pytest.approx((5 / 6 + 6 / 8) / 2) and got["a"]["auc"] == pytest.approx(0.8)
    assert got["b"] == {}


def test_a_source_is_dropped_in_the_config_by_its_site(tmp_path, capsys):
    """#89: leaving a source out took a filtered copy of the index by hand. ``drop_sites`` leaves a site's rows unread,
    says so, refuses a site the index does not have, and at its default leaves a run's fingerprint as it was."""
    from fedmed.config import ConfigError
    from fedmed.data.images import DataError
    from fedmed.run.fingerprint import fingerprinted_config

    index = _index(tmp_path)
    exp = _config(tmp_path, index)
    cfg = json.loads((tmp_path / "cfg.json").read_text())
    cfg["dataset"]["sources"][0]["drop_sites"] = ["scannerB"]
    p = tmp_path / "drop.json"
    p.write_text(json.dumps(cfg))
    out = prepare_federation(load_config(p), 0, tmp_path / "out")
    meta, _ = _written(out)
    assert set(meta["sites"]) == {"scannerA", "scannerC"}
    assert "site(s) dropped by drop_sites: scannerB (8 row(s))" in capsys.readouterr().out
    cfg["dataset"]["sources"][0]["drop_sites"] = ["scannerZ"]
    p.write_text(json.dumps(cfg))
    with pytest.raises((DataError, ConfigError, ValueError), match="drop_sites names \\['scannerZ'\\]"):
        prepare_federation(load_config(p), 0, tmp_path / "out2")
    assert "drop_sites" in json.dumps(exp.model_dump(mode="json"))
    assert "drop_sites" not in json.dumps(fingerprinted_config(exp))  # at its default: runs made before it are reused
