import json

import numpy as np
import pytest

from fedmed.data import DataError, discover, load_datalist, load_images, write_site_datalists
from fedmed.partition import iid_partition
from fedmed.site import SiteRunner

from conftest import shared_path


def small_federation(tmp_path, n_sites=2):
    pool = discover("builtin:digits", max_per_class=6)
    parts = iid_partition(len(pool.labels), n_sites, 0)
    write_site_datalists(pool, parts, tmp_path, test_fraction=0.25, seed=0)
    return pool


def test_digits_datalists_roundtrip(tmp_path):
    pool = small_federation(tmp_path)
    meta = json.loads((tmp_path / "dataset.json").read_text())
    assert meta["n_classes"] == 10 and meta["sites"] == ["site-1", "site-2"]
    doc = load_datalist(tmp_path / "site-1.json")
    assert len(doc["training"]) + len(doc["validation"]) + len(doc["test"]) == 30 and len(doc["test"]) >= 1
    x, y = load_images(doc["training"], image_size=16, channels=1)
    assert x.shape == (len(doc["training"]), 1, 16, 16) and float(x.max()) <= 1.0
    assert len(pool.labels) == 60


def test_missing_and_corrupt_image_named(tmp_path):
    small_federation(tmp_path)
    doc = json.loads((tmp_path / "site-2.json").read_text())
    bad = tmp_path / "broken.png"
    bad.write_bytes(b"not a png at all")
    doc["training"][0]["image"] = str(bad)
    (tmp_path / "site-2.json").write_text(json.dumps(doc))
    with pytest.raises(DataError, match=r"site-2: cannot read image .*broken.png \(corrupt or not an image"):
        load_images(load_datalist(tmp_path / "site-2.json")["training"], image_size=8, channels=1, site="site-2")
    doc["training"][0]["image"] = str(tmp_path / "gone.png")
    (tmp_path / "site-2.json").write_text(json.dumps(doc))
    runner = SiteRunner("site-2", tmp_path)
    with pytest.raises(DataError, match=r"site-2: cannot read image .*gone.png \(file not found\)"):
        runner.data(8, 1)


def test_bad_datalist(tmp_path):
    (tmp_path / "s.json").write_text('{"training": [{"image": "a.png"}]}')
    with pytest.raises(DataError, match=r"s.json: training\[0\] should have 'image' and 'label'"):
        load_datalist(tmp_path / "s.json")
    with pytest.raises(DataError, match="datalist not found"):
        load_datalist(tmp_path / "none.json")


def test_discover_npz(tmp_path):
    z = tmp_path / "m.npz"
    np.savez(z, train_images=np.zeros((4, 28, 28), np.uint8), train_labels=np.array([[0], [1], [0], [1]]),
             test_images=np.zeros((2, 28, 28), np.uint8), test_labels=np.array([[1], [0]]))
    pool = discover(str(z))
    assert len(pool.items) == 6 and pool.n_classes == 2
    with pytest.raises(DataError, match="does not exist"):
        discover(str(tmp_path / "nothing"))


def test_discover_busi():
    root = shared_path("busi")
    pool = discover(str(root))
    assert pool.class_names == ["benign", "malignant", "normal"]
    assert np.bincount(pool.labels).tolist() == [437, 210, 133]


def test_discover_imagenette_splits_pooled():
    pool = discover(str(shared_path("imagenette_subset")))
    assert pool.n_classes == 10 and len(pool.items) == 700
