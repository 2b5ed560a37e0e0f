import json

import numpy as np
import pytest

from conftest import own_site, signature_section
import torch

from fedmed.algorithms.clustered import cfl_split, choose_clusters
from fedmed.algorithms.signatures import signature_distances
from fedmed.data.images import DataError, discover
from fedmed.data.datalists import write_site_datalists
from fedmed.site.runner import SiteRunner

CFG = {"seed": 0, "data": {"image_size": 8, "channels": 1, "n_classes": 10},
       "model": {"arch": "resnet9", "width": 4}, "train": {},
       "privacy": {"k_min": 1, "accept_k_min_below_2": True}}  # the papers' form: every class is sent


@pytest.fixture
def sites(tmp_path):
    pool = discover("builtin:digits", max_per_class=5)
    y = pool.labels
    parts = [np.flatnonzero(y == 0)[:4],  # single class
             np.flatnonzero(y == 2)[-1:],  # one image (it stays in training; no test split)
             np.flatnonzero(np.isin(y, [2, 3, 4]))]
    write_site_datalists(pool, parts, tmp_path, test_fraction=0.25, seed=0)
    return tmp_path


@pytest.mark.parametrize("kind", ["fmcl", "pacfl", "fecfl"])
def test_signature_task_edge_sites(sites, kind):
    sigs = {}
    for s in ("site-1", "site-2", "site-3"):
        cfg = dict(CFG, signature=signature_section(kind, "random_cnn"))
        _, metrics, meta, params = own_site(s, sites).handle("signature", {}, cfg)
        assert params == {} and "random init" in meta["encoder"]
        assert not any(k in meta for k in ("images", "labels"))
        sigs[s] = meta
    if kind == "fmcl":
        assert sigs["site-2"]["counts"].tolist() == [1.0]
    names, D = signature_distances(kind, sigs)
    assert names == ["site-1", "site-2", "site-3"] and D.shape == (3, 3) and np.isfinite(D).all()


def test_small_classes_are_withheld_and_clustering_still_runs(sites, capsys):
    """k_min: a class with fewer samples than k_min never leaves the site; the log says which and why."""
    pool = discover("builtin:digits", max_per_class=6)
    idx = np.r_[np.flatnonzero(pool.labels == 2)[:6], np.flatnonzero(pool.labels == 6)[:1]]
    entries = [{"image": str((sites / "images" / f"x{i}.png")), "label": int(pool.labels[i])} for i in idx]
    from PIL import Image

    (sites / "images").mkdir(exist_ok=True)
    for i, e in zip(idx, entries):
        Image.fromarray(pool.items[i]).save(e["image"])
    (sites / "site-4.json").write_text(json.dumps({"training": entries, "validation": [], "test": []}))
    cfg = dict(CFG, privacy={"k_min": 5}, signature={"kind": "fmcl", "encoder": "random_cnn", "seed": 0})
    _, _, m4, _ = own_site("site-4", sites).handle("signature", {}, cfg)
    assert m4["classes"].tolist() == [2] and m4["counts"].tolist() == [6.0] and m4["withheld_classes"] == [6]
    assert "class(es) [6] withheld" in capsys.readouterr().out  # the site's log says which and why
    with pytest.raises(ValueError, match="site-2: every class has fewer than k_min=5"):
        own_site("site-2", sites).handle("signature", {}, cfg)  # one image: nothing may leave
    _, _, m3, _ = own_site("site-3", sites).handle("signature", {}, dict(cfg, privacy={"k_min": 2}))
    names, D = signature_distances("fmcl", {"site-3": m3, "site-4": m4})
    assert D.shape == (2, 2) and np.isfinite(D).all() and D[0, 1] > 0  # class 6 is absent at site-4; class 2 shared


def test_signature_task_corrupt_image(sites):
    doc = json.loads((sites / "site-3.json").read_text())
    (sites / "bad.png").write_bytes(b"nope")
    doc["training"][0]["image"] = str(sites / "bad.png")
    (sites / "site-3.json").write_text(json.dumps(doc))
    with pytest.raises(DataError, match=r"site-3: training\[0\]: cannot read image .*bad.png") as err:
        own_site("site-3", sites).handle("signature", {}, dict(CFG, signature={"kind": "fmcl", "encoder": "random_cnn"}))
    assert err.value.public == "site-3: training[0]: cannot read the image (corrupt or not an image: " \
                               "UnidentifiedImageError)"  # what leaves the site: the position, not the file


def test_choose_clusters_rules():
    X = np.r_[np.zeros(3), np.ones(3) * 5, np.ones(3) * 10] + np.arange(9) * 0.01
    D = np.abs(X[:, None] - X[None])
    names = [f"s{i}" for i in range(9)]
    auto = choose_clusters(D, names)
    assert auto["k"] == 3 and "auto-K" in auto["rule"] and auto["silhouette"]
    fixed = choose_clusters(D, names, n_clusters=2)
    assert fixed["k"] == 2 and fixed["rule"] == "fixed K=2"
    assert choose_clusters(D[:1, :1], names[:1])["clusters"] == [["s0"]]


def test_cfl_split_criterion():
    rng = np.random.default_rng(0)
    g = rng.normal(size=50)
    # two groups pulling in opposite directions: mean update ~ 0, individual updates large
    ups = [{"w": g + 0.05 * rng.normal(size=50)} for _ in range(3)] + [{"w": -g + 0.05 * rng.normal(size=50)} for _ in range(3)]
    out = cfl_split(ups, [1] * 6, eps1=0.5, eps2=1.0)
    assert out["split"] and out["labels"] in ([0, 0, 0, 1, 1, 1], [1, 1, 1, 0, 0, 0])
    same = [{"w": g + 0.05 * rng.normal(size=50)} for _ in range(6)]
    assert not cfl_split(same, [1] * 6, eps1=0.5, eps2=1.0)["split"]


def test_each_signature_kind_has_one_payload_type_and_one_wire_format():
    """A site's signature (typed) -> its reply's arrays -> the lists FLARE carries -> the server's typed signature:
    the same values; a reply missing an array, or with arrays of the wrong shape, names the site before any
    distance is computed."""
    from fedmed.algorithms.fmcl import ClassSignature
    from fedmed.algorithms.privacy import signature_payload
    from fedmed.algorithms.signatures import signature_from_wire, signature_kind
    from fedmed.methods import METHODS  # noqa: F401  (each method's module registers its kind)
    from fedmed.site.reply import to_meta

    rng = np.random.default_rng(0)
    feats, y = rng.normal(size=(30, 6)), np.repeat([0, 1, 2], 10)
    for kind, options in (("fmcl", {}), ("pacfl", {"n_basis": 2}), ("fecfl", {})):  # each kind's own options
        meta = signature_payload(kind, feats, y, k_min=2, privacy={}, site="site-1", **options)
        assert set(signature_kind(kind).fields) <= set(meta)
        sig = signature_from_wire(kind, to_meta(meta), "site-1")
        assert isinstance(sig, signature_kind(kind).payload)
        for f in signature_kind(kind).fields:
            assert np.array_equal(np.asarray(getattr(sig, f)), np.asarray(meta[f]))
    assert isinstance(signature_from_wire("fmcl", to_meta(signature_payload("fmcl", feats, y, k_min=2, privacy={})),
                                          "s"), ClassSignature)
    with pytest.raises(ValueError, match=r"site-3: its fmcl signature lacks \['counts'\]"):
        signature_distances("fmcl", {"site-2": {"classes": [0], "means": [[1.0, 0.0]], "counts": [3]},
                                     "site-3": {"classes": [0], "means": [[1.0, 0.0]]}})
    with pytest.raises(ValueError, match="site-2: signature arrays disagree on the number of classes"):
        signature_distances("fmcl", {"site-2": {"classes": [0, 1], "means": [[1.0, 0.0]], "counts": [3, 4]},
                                     "site-3": {"classes": [0], "means": [[1.0, 0.0]], "counts": [3]}})
    with pytest.raises(ValueError, match=r"site-9: a FECFL signature should be one mean embedding \(d,\)"):
        signature_distances("fecfl", {"site-9": {"mean": [[1.0, 2.0]]}, "site-8": {"mean": [1.0, 2.0]}})


def _fmcl_run(tmp_path, partition: dict, k1_rule: str, name: str, seed: int = 0, **method):
    import yaml

    from fedmed.config import load_config
    from fedmed.run.experiment import classes_override, prepare_federation
    from fedmed.run.jobspec import job_spec, run_spec_in_process

    raw = {"name": "k1", "dataset": {"path": "builtin:digits", "image_size": 8, "channels": 1, "max_per_class": 40},
           "federation": {"sites": 6, **partition}, "model": {"arch": "resnet9", "width": 4},
           "train": {"rounds": 1, "local_epochs": 1, "batch_size": 16}, "privacy": {"k_min": 2},
           "methods": [{"name": "FMCL", "workflow": "fmcl", "encoder": "random_cnn", "k1_rule": k1_rule, **method}]}
    cfg = tmp_path / f"{name}.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    exp = load_config(cfg)
    data = prepare_federation(exp, seed, tmp_path / f"{name}_data")
    exp = load_config(cfg, classes_override(data, exp))
    status, fed = run_spec_in_process(job_spec(exp, exp.methods[0], seed), data, tmp_path / name)
    assert status == "finished", fed.recorder.doc.get("reason")
    return fed.recorder.doc, tmp_path / name


def test_the_differ_rule_lets_the_split_half_test_decide_k_equals_one(tmp_path):
    """#85: under ``k1_rule: differ`` auto-K's K = 1 decision is the calibrated split-half test's: sites that differ
    (a label-shifted federation) get FMCL's silhouette pick with no K = 1 gate — the K of Algorithm 5 on the run's own
    distances, even where the silhouette gate would keep one cluster — and IID sites get one cluster whatever the
    silhouette says; ``silhouette`` keeps the paper's gate alone."""
    from fedmed.core.io import read_distance_csv

    shifted = {"partition": "anda", "anda_shift": "label", "anda_level": 6, "anda_groups": 2}
    # a silhouette gate no split passes (0.99): the differ rule splits where the test says the sites differ
    doc, run = _fmcl_run(tmp_path, shifted, "differ", "shifted", k1_silhouette=0.99)
    assert doc["differ"]["p"] < 0.05 and "differ rule: the sites differ" in doc["clustering"]["rule"]
    names, D = read_distance_csv(run / "distances.csv")
    literal = choose_clusters(D, names, k1_silhouette=None)
    assert doc["clustering"]["clusters"] == literal["clusters"] and len(literal["clusters"]) > 1
    doc_s, _ = _fmcl_run(tmp_path, shifted, "silhouette", "shifted_sil", k1_silhouette=0.99)
    assert "differ rule" not in doc_s["clustering"]["rule"] and len(doc_s["clustering"]["clusters"]) == 1
    doc_iid, _ = _fmcl_run(tmp_path, {"partition": "iid"}, "differ", "iid", seed=1)  # (a test at alpha 0.05 calls
    # 1 in 20 IID federations different: seed 0's is one of them, p = 0.013)
    assert doc_iid["differ"]["p"] >= 0.05 and len(doc_iid["clustering"]["clusters"]) == 1
    assert "do not differ" in doc_iid["clustering"]["rule"]
