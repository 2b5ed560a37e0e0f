"""``fedmed check-data``: a site checks its data before it joins (fedmed.site.check)."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fedmed.cli.main import main
from fedmed.data.images import discover
from fedmed.data.datalists import write_site_datalists
from fedmed.data.partition import iid_partition
from fedmed.site.check import check_datalist

CLASSES = [str(c) for c in range(10)]


def federation(tmp_path):
    pool = discover("builtin:digits", max_per_class=8)
    write_site_datalists(pool, iid_partition(len(pool.labels), 2, 0), tmp_path, test_fraction=0.25, seed=0)
    return json.loads((tmp_path / "site-1.json").read_text())


def test_a_clean_datalist_is_ready_with_counts_per_class_and_split(tmp_path, capsys):
    doc = federation(tmp_path)
    assert main(["check-data", str(tmp_path / "site-1.json"), "--classes", *CLASSES, "--k-min", "1"]) == 0
    out = capsys.readouterr().out
    assert "ready to join" in out and f"training: {len(doc['training'])} image(s)" in out
    rep = check_datalist(tmp_path / "site-1.json", classes=CLASSES)
    assert sum(rep["counts"]["test"].values()) == len(doc["test"]) and not rep["problems"]


def test_every_problem_is_listed_not_only_the_first(tmp_path, capsys):
    doc = federation(tmp_path)
    doc["training"][0]["image"] = "images/gone.png"
    (tmp_path / "images" / "broken.png").write_bytes(b"not a png")
    doc["training"][1]["image"] = "images/broken.png"
    doc["training"][2]["label"] = 12
    # a near-duplicate: a training image, re-saved a little brighter, in the test split
    src = tmp_path / doc["training"][3]["image"]
    a = np.asarray(Image.open(src), dtype=np.float32)
    Image.fromarray(np.clip(a * 0.9 + 12, 0, 255).astype(np.uint8)).save(tmp_path / "images" / "brighter.png")
    doc["test"].append({"image": "images/brighter.png", "label": doc["training"][3]["label"]})
    (tmp_path / "site-1.json").write_text(json.dumps(doc))
    rep_file = tmp_path / "report.json"
    assert main(["check-data", str(tmp_path / "site-1.json"), "--classes", *CLASSES, "--k-min", "2",
                 "--json", str(rep_file)]) == 1
    out = capsys.readouterr().out
    assert "PROBLEM: training: cannot read image images/gone.png (file not found)" in out
    assert "PROBLEM: training: cannot read image images/broken.png" in out
    assert "has label 12, outside the job's classes 0..9" in out
    assert "not ready: 3 problem(s)" in out
    assert str(tmp_path) not in out  # the report names files relative to the data root
    rep = json.loads(rep_file.read_text())
    assert "class(es)" in " ".join(rep["warnings"])  # classes below k_min = 2 in an 8-per-class, 2-site split


def test_near_duplicates_across_splits_are_listed_and_the_site_says_how_many(tmp_path, capsys):
    from fedmed.site.runner import SiteRunner

    doc = federation(tmp_path)
    src = tmp_path / doc["training"][3]["image"]
    a = np.asarray(Image.open(src), dtype=np.float32)
    Image.fromarray(np.clip(a * 0.9 + 12, 0, 255).astype(np.uint8)).save(tmp_path / "images" / "brighter.png")
    doc["test"].append({"image": "images/brighter.png", "label": doc["training"][3]["label"]})
    (tmp_path / "site-1.json").write_text(json.dumps(doc))
    assert main(["check-data", str(tmp_path / "site-1.json"), "--classes", *CLASSES]) == 0  # a warning, not a problem
    out = capsys.readouterr().out
    assert f"near-duplicate: training {doc['training'][3]['image']} ~ test images/brighter.png" in out
    runner = SiteRunner("site-1", tmp_path)
    runner.data(8, 1)
    assert any("1 validation/test image(s) nearly identical to training images" in n for n in runner.notes)
    # a command's next job (or reference) reloads the site's data: the server hears it again, the console once (#89)
    said = capsys.readouterr().out.count("nearly identical to training images")
    again = SiteRunner("site-1", tmp_path)
    again.data(8, 1)
    assert any("nearly identical" in n for n in again.notes)
    assert said <= 1 and "nearly identical" not in capsys.readouterr().out
    # an unrelated image is not one: the clean federation has none
    shutil.copy(tmp_path / "site-2.json", tmp_path / "site-3.json")
    assert check_datalist(tmp_path / "site-3.json", classes=CLASSES)["near_duplicates"] == []


def test_segmentation_image_and_label_shapes_must_agree(tmp_path, capsys):
    import nibabel as nib

    for name, shape in (("flair.nii.gz", (8, 8, 8)), ("label.nii.gz", (8, 8, 6))):
        nib.save(nib.Nifti1Image(np.zeros(shape, np.float32), np.eye(4)), tmp_path / name)
    (tmp_path / "s.json").write_text(json.dumps({"training": [{"image": ["flair.nii.gz"], "label": "label.nii.gz"}]}))
    assert main(["check-data", str(tmp_path / "s.json"), "--task", "segmentation"]) == 1
    out = capsys.readouterr().out
    assert "image and label shapes differ (flair.nii.gz (8, 8, 8), label.nii.gz (8, 8, 6))" in out


def test_check_data_reads_dicom_series_with_dicom_seg_labels_and_names_a_broken_series(tmp_path, capsys):
    """A segmentation site of DICOM: a series with its DICOM-SEG label is ready; a series with a missing slice and a
    radial series (pydicom's MR700) are problems naming the folder and why, with no absolute path."""
    pytest.importorskip("highdicom")
    from dicom_series import blob_masks, write_seg, write_series
    from pydicom.data import get_testdata_file

    dss = write_series(tmp_path / "p1" / "MR", 5)
    write_seg(tmp_path / "p1" / "seg.dcm", dss, 2 * blob_masks(dss))
    write_series(tmp_path / "p2" / "MR", 5, skip=2)
    write_seg(tmp_path / "p2" / "seg.dcm", dss, 2 * blob_masks(dss))
    radial = Path(get_testdata_file("MR_small.dcm")).parent / "dicomdirtests" / "98892003" / "MR700"
    shutil.copytree(radial, tmp_path / "p3" / "MR")
    shutil.copy(tmp_path / "p1" / "seg.dcm", tmp_path / "p3" / "seg.dcm")
    entry = lambda p: {"image": [f"{p}/MR"], "label": f"{p}/seg.dcm"}
    (tmp_path / "ok.json").write_text(json.dumps({"training": [entry("p1")]}))
    assert main(["check-data", str(tmp_path / "ok.json"), "--task", "segmentation"]) == 0
    assert "ready to join" in capsys.readouterr().out
    (tmp_path / "bad.json").write_text(json.dumps({"training": [entry("p1"), entry("p2")], "test": [entry("p3")]}))
    assert main(["check-data", str(tmp_path / "bad.json"), "--task", "segmentation"]) == 1
    out = capsys.readouterr().out
    assert ("PROBLEM: training: p2/MR: DICOM series is not a 3-D volume: uneven slice positions: 2 mm apart but 4 mm "
            "after slice 2 of 4 (a slice missing?)") in out
    assert "PROBLEM: test: p3/MR: DICOM series is not a 3-D volume: its 7 slices have 7 different orientations" in out
    assert str(tmp_path) not in out and "not ready: 2 problem(s)" in out


def test_a_sites_settings_file_is_checked_as_the_site_reads_it(tmp_path, capsys):
    """``fedmed check-data local/fedmed_site.json``: the datalist it names, relative to its data_root (elsewhere
    than the datalist), and the site's k_min floor — not the datalist alone with k_min 1."""
    data = tmp_path / "data"
    doc = federation(data)
    kit = tmp_path / "kit"
    (kit / "local").mkdir(parents=True)
    (kit / "lists").mkdir()
    (kit / "lists" / "mine.json").write_text(json.dumps(doc))  # image paths relative to the data root, not to it
    (kit / "local" / "fedmed_site.json").write_text(json.dumps({"datalist": "../lists/mine.json",
                                                               "data_root": str(data), "k_min": 40}))
    assert main(["check-data", str(kit / "local" / "fedmed_site.json"), "--classes", *CLASSES]) == 1
    out = capsys.readouterr().out
    assert "the site's floor k_min=40 applies" in out
    assert "fewer than k_min=40" in out and "cannot read" not in out  # images found under data_root
    assert main(["check-data", str(kit / "lists" / "mine.json"), "--classes", *CLASSES]) == 1  # the datalist alone:
    assert "cannot read image" in capsys.readouterr().out  # its images are not beside it


def test_labels_written_as_class_names_are_read_with_the_jobs_classes(tmp_path, capsys):
    """Labels written as class names were refused even with --classes (and at the site, with the job's classes)."""
    from fedmed.site.runner import SiteRunner

    doc = federation(tmp_path)
    for split in ("training", "validation", "test"):
        for e in doc[split]:
            e["label"] = CLASSES[e["label"]]
    (tmp_path / "site-1.json").write_text(json.dumps(doc))
    assert main(["check-data", str(tmp_path / "site-1.json"), "--classes", *CLASSES, "--k-min", "1"]) == 0
    assert "ready to join" in capsys.readouterr().out
    assert main(["check-data", str(tmp_path / "site-1.json"), "--k-min", "1"]) == 1  # no classes: names unknown
    assert "label should be a non-negative integer (or a class name" in capsys.readouterr().out
    r = SiteRunner("site-1", tmp_path)
    s = r.splits({"data": {"image_size": 8, "channels": 1, "n_classes": 10}, "classes": CLASSES})
    assert int(s.train[1].max()) <= 9 and s.train[1].shape[0] == len(doc["training"])
    doc["training"][0]["label"] = "eleven"
    (tmp_path / "site-1.json").write_text(json.dumps(doc))
    with pytest.raises(Exception, match="is not one of the job's classes"):
        SiteRunner("site-1", tmp_path).splits({"data": {"image_size": 8, "channels": 1, "n_classes": 10},
                                               "classes": CLASSES})
