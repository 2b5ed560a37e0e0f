"""The bad-input table: one malformed site in a three-site FedAvg federation per row. Each row asserts the line the
user sees (recorded in the run's ``errors`` and the reason, naming the site and the file or entry, no absolute path)
and that the other two sites' training goes on to the end; a federation where no site can train fails with the
reasons. Runs through the same reply loop as the FLARE client (``InProcessFederation``); the FLARE paths are in
test_jobs_e2e.py and test_deployment.py."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from fedmed.data.images import discover, write_site_datalists
from fedmed.data.partition import iid_partition

CLASSES = [str(c) for c in range(10)]


def _dl(root: Path, site: str = "site-2") -> dict:
    return json.loads((root / f"{site}.json").read_text())


def _write(root: Path, doc, site: str = "site-2") -> None:
    (root / f"{site}.json").write_text(doc if isinstance(doc, str) else json.dumps(doc))


def label_outside_classes(root):
    d = _dl(root)
    d["training"][0]["label"] = 12
    _write(root, d)


def nan_label(root):
    d = _dl(root)
    d["training"][0]["label"] = float("nan")
    _write(root, json.dumps(d))  # Python writes NaN, as a careless export does


def string_label(root):
    d = _dl(root)
    d["training"][0]["label"] = "benign"
    _write(root, d)


def empty_training(root):
    d = _dl(root)
    d["training"] = []
    _write(root, d)


def misspelled_split(root):
    d = _dl(root)
    d["tset"] = d.pop("test")
    _write(root, d)


def missing_image(root):
    d = _dl(root)
    d["training"][0]["image"] = "images/site-2/not_there.png"
    _write(root, d)


def corrupt_image(root):
    d = _dl(root)
    (root / "images" / "broken.png").write_bytes(b"\x89PNG truncated")
    d["training"][0]["image"] = "images/broken.png"
    _write(root, d)


def image_in_two_splits(root):
    d = _dl(root)
    d["test"].append(dict(d["training"][0]))
    _write(root, d)


def identical_copy_in_validation(root):
    d = _dl(root)
    shutil.copy(root / d["training"][1]["image"], root / "images" / "renamed.png")
    d["validation"].append({"image": "images/renamed.png", "label": d["training"][1]["label"]})
    _write(root, d)


def entry_without_label(root):
    d = _dl(root)
    del d["training"][0]["label"]
    _write(root, d)


def not_json(root):
    _write(root, '{"training": [')


def no_datalist(root):
    (root / "site-2.json").unlink()


def fewer_training_images_than_k_min(root):
    d = _dl(root)
    d["training"] = d["training"][:2]  # the job's k_min is 3
    _write(root, d)


def nan_pixels(root):
    from PIL import Image

    d = _dl(root)
    a = np.zeros((8, 8), np.float32)
    a[2, 2] = np.nan
    Image.fromarray(a, mode="F").save(root / "images" / "nan.tif")
    d["training"][0]["image"] = "images/nan.tif"
    _write(root, d)


def multi_frame_dicom(root):
    pydicom = pytest.importorskip("pydicom")
    d = _dl(root)
    shutil.copy(Path(pydicom.__file__).parent / "data" / "test_files" / "SC_rgb_rle_2frame.dcm",
                root / "images" / "cine.dcm")
    d["training"][0]["image"] = "images/cine.dcm"
    _write(root, d)


def dicom_without_pixels(root):
    pydicom = pytest.importorskip("pydicom")
    d = _dl(root)
    ds = pydicom.dcmread(Path(pydicom.__file__).parent / "data" / "test_files" / "CT_small.dcm")
    del ds.PixelData
    ds.save_as(root / "images" / "report.dcm")
    d["training"][0]["image"] = "images/report.dcm"
    _write(root, d)


def multi_frame_tiff(root):
    from PIL import Image

    d = _dl(root)
    frames = [Image.fromarray(np.full((8, 8), v, np.uint8)) for v in (0, 128)]
    frames[0].save(root / "images" / "stack.tif", save_all=True, append_images=frames[1:])
    d["training"][0]["image"] = "images/stack.tif"
    _write(root, d)


# (how site-2's data is broken, what the user reads — each substring must be in site-2's recorded error)
TABLE = [
    (label_outside_classes, ["site-2: datalist site-2.json training has label(s) [12] outside the job's global label "
                             "space 0..9"]),
    (nan_label, ["site-2.json: training[0] label should be a non-negative integer, got nan"]),
    (string_label, ["site-2.json: training[0] label should be a non-negative integer, got 'benign'"]),
    (empty_training, ["site-2: datalist site-2.json has no training images"]),
    (misspelled_split, ["site-2.json: unknown split(s) ['tset']"]),
    (missing_image, ["site-2: cannot read image images/site-2/not_there.png (file not found)"]),
    (corrupt_image, ["site-2: cannot read image images/broken.png (corrupt or not an image"]),
    (image_in_two_splits, ["site-2.json: the same image in training and test: images/site-2/"]),
    (identical_copy_in_validation, ["the same image in training and validation:", "images/renamed.png (identical files)"]),
    (entry_without_label, ["site-2.json: training[0] should have 'image' and 'label'"]),
    (not_json, ["site-2.json: not valid JSON"]),
    (no_datalist, ["site-2", "datalist"]),
    (fewer_training_images_than_k_min, ["site-2: sits out training: fewer training images than k_min=3"]),
    (nan_pixels, ["site-2: image images/nan.tif has NaN or infinite pixel values"]),
    (multi_frame_dicom, ["site-2: image images/cine.dcm is a multi-frame DICOM (2 frames)"]),
    (dicom_without_pixels, ["site-2: image images/report.dcm is a DICOM file without pixel data"]),
    (multi_frame_tiff, ["site-2: image images/stack.tif has 2 frames; one image per file is expected"]),
]


def test_the_table_has_at_least_fifteen_kinds():
    assert len(TABLE) >= 15 and len({f.__name__ for f, _ in TABLE}) == len(TABLE)


@pytest.fixture
def federation(tmp_path):
    pool = discover("builtin:digits", max_per_class=6)
    root = tmp_path / "data"
    write_site_datalists(pool, iid_partition(len(pool.labels), 3, 0), root, test_fraction=0.25, seed=0)
    return root


def run_fedavg(root: Path, out: Path):
    from fedmed.workflows import InProcessFederation
    from fedmed.workflows.fedavg import FedAvg

    sites = ["site-1", "site-2", "site-3"]
    cfg = {"task": "classification", "seed": 0, "classes": CLASSES,
           "data": {"image_size": 8, "channels": 1, "n_classes": 10},
           "model": {"arch": "resnet9", "width": 4, "norm": "group"},
           "train": {"local_epochs": 1, "batch_size": 8}, "privacy": {"k_min": 3},
           "federation": {"sites": sites, "min_clients": 2}}
    fed = InProcessFederation(root, sites, out, log=None)
    status = fed.run(FedAvg(2, cfg))
    return status, fed.recorder.doc


@pytest.mark.parametrize("breaks, says", TABLE, ids=[f.__name__ for f, _ in TABLE])
def test_one_bad_site_is_named_and_the_others_train_on(federation, tmp_path, breaks, says):
    breaks(federation)
    status, doc = run_fedavg(federation, tmp_path / "run")
    assert status == "finished", doc.get("reason")
    errors = [e["error"] for e in doc["errors"] if e["site"] == "site-2"]
    assert errors, doc["errors"]
    for s in says:
        assert s in errors[0], (s, errors[0])
    assert "\n" not in errors[0] and str(federation) not in errors[0]  # one line, no absolute path
    assert "site-2" in doc["reason"]  # the run's status names the site that sat out, and why
    trained = [r for r in doc["rounds"] if r["task"] == "train"]
    assert len(trained) == 2 and all(sorted(r["sites"]) == ["site-1", "site-3"] for r in trained)
    assert doc["rounds"][-1]["task"] == "validate" and (tmp_path / "run" / "models" / "global.pt").is_file()


def test_a_federation_where_no_site_can_train_fails_with_the_reasons(federation, tmp_path):
    for site in ("site-1", "site-2", "site-3"):
        d = _dl(federation, site)
        d["training"] = []
        _write(federation, d, site)
    status, doc = run_fedavg(federation, tmp_path / "run")
    assert status == "failed"
    assert "fewer than min_clients=2" in doc["reason"] and "has no training images" in doc["reason"]
    assert not (tmp_path / "run" / "models").exists()
