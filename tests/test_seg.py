"""Segmentation data checks, the assessment on a label-volume federation, and the U-Net trainer."""

import json

import nibabel as nib
import numpy as np
import pytest

from fedmed.assessment import assess, site_assessment
from fedmed.data import DataError
from fedmed.encoders import build_encoder
from fedmed.phantoms import write_phantom_subjects
from fedmed.seg import dice_scores, load_case, seg_model, train_seg_local
from fedmed.seg_data import discover_subjects, write_seg_federation

MODS = {"FLAIR": "Flair*.nii*", "T1c": "T1c*.nii*"}


@pytest.fixture(scope="module")
def phantoms(tmp_path_factory):
    root = tmp_path_factory.mktemp("phantoms")
    # 12 subjects; the largest lesions end up together at the last site
    write_phantom_subjects(root, [0, 2, 2, 3, 3, 3, 4, 4, 4, 9, 10, 11], size=24)
    return root


def entry(root, k=0):
    return discover_subjects(root, MODS, "OTMultiClass*", "brainmask*")[k]


def test_load_case_regions_and_metadata(phantoms):
    c = load_case(entry(phantoms, 11), shape=(16, 16, 16))
    assert c["image"].shape == (2, 16, 16, 16) and c["label"].shape == (3, 16, 16, 16)
    vol = c["meta"]["volume_mm3"]
    assert vol["WT"] >= vol["TC"] >= vol["ET"] > 0  # nested BraTS regions
    lab = np.asarray(nib.load(str(phantoms / "phantom_011" / "OTMultiClass.nii.gz")).dataobj)
    assert vol["WT"] == pytest.approx((lab > 0).sum() * 1.5 ** 3)  # mm^3 from the header's voxel size


class TestBadCases:
    def test_shape_mismatch(self, phantoms, tmp_path):
        e = entry(phantoms)
        nib.save(nib.Nifti1Image(np.zeros((10, 10, 10), np.uint8), np.eye(4)), str(tmp_path / "lab.nii.gz"))
        e["label"] = str(tmp_path / "lab.nii.gz")
        with pytest.raises(DataError, match=r"site-x: image .*Flair_phantom.nii.gz has shape \(24, 24, 24\) but label .*lab.nii.gz has \(10, 10, 10\)"):
            load_case(e, site="site-x")

    def test_unexpected_labels(self, phantoms, tmp_path):
        e = entry(phantoms)
        bad = np.zeros((24, 24, 24), np.uint8)
        bad[0, 0, 0] = 7
        nib.save(nib.Nifti1Image(bad, np.eye(4)), str(tmp_path / "lab7.nii.gz"))
        e["label"] = str(tmp_path / "lab7.nii.gz")
        with pytest.raises(DataError, match=r"label .*lab7.nii.gz has unexpected labels \[7\]"):
            load_case(e)

    def test_missing_modality_and_non_nifti(self, phantoms, tmp_path):
        e = entry(phantoms)
        e["image"][1] = str(tmp_path / "absent_T1c.nii.gz")
        with pytest.raises(DataError, match=r"T1c image file .*absent_T1c.nii.gz not found"):
            load_case(e)
        (tmp_path / "scan.png").write_bytes(b"png")
        e["image"][1] = str(tmp_path / "scan.png")
        with pytest.raises(DataError, match=r"scan.png is not a NIfTI file"):
            load_case(e)
        with pytest.raises(DataError, match="has no T2 image"):
            discover_subjects(phantoms, {"T2": "T2*.nii*"}, "OTMultiClass*")


def test_assessment_names_the_known_most_distant_site(phantoms, tmp_path):
    entries = discover_subjects(phantoms, MODS, "OTMultiClass*", "brainmask*")
    out = write_seg_federation(entries, 4, tmp_path / "fed", partition="label_volume")
    meta = json.loads((out / "dataset.json").read_text())
    assert meta["site_samples"]["site-4"] == ["phantom_009", "phantom_010", "phantom_011"]
    enc = build_encoder("medicalnet_resnet18")
    sites = {}
    for s in meta["sites"]:
        doc = json.loads((out / f"{s}.json").read_text())
        cases = [load_case(e, shape=(16, 16, 16), site=s) for e in doc["training"] + doc["validation"]]
        sites[s] = site_assessment(cases, enc)
    rep = assess(sites)
    assert rep["emd"]["most_distant"] == "site-4"
    assert rep["emd"]["max_label"] in ("WT", "TC", "ET")
    assert "site-4" in rep["emd"]["clusters"][1]
    # histograms vs per-value metadata: same verdict
    per_value = {s: {k: v for k, v in d.items()} for s, d in sites.items()}
    assert assess(per_value)["emd"]["most_distant"] == "site-4"


def test_unet_trains_and_scores(phantoms):
    cases = [load_case(e, shape=(16, 16, 16)) for e in discover_subjects(phantoms, MODS, "OTMultiClass*")[9:]]
    model = seg_model(2, channels=(4, 8, 16))
    first = train_seg_local(model, cases, roi=(16, 16, 16), seed=0)["loss"]
    for s in range(1, 6):
        last = train_seg_local(model, cases, roi=(16, 16, 16), seed=s)["loss"]
    assert last < first
    d = dice_scores(model, cases, roi=(16, 16, 16))
    assert set(d) == {"dice_wt", "dice_tc", "dice_et", "dice_mean"} and 0 <= d["dice_mean"] <= 1


def test_assess_cli_skips_bad_site(phantoms, tmp_path, capsys):
    from fedmed.cli import main

    entries = discover_subjects(phantoms, MODS, "OTMultiClass*", "brainmask*")
    out = write_seg_federation(entries, 4, tmp_path / "fed", partition="label_volume")
    bad = json.loads((out / "site-2.json").read_text())
    bad["training"][0]["label"] = str(tmp_path / "nope.nii.gz")
    (out / "site-2.json").write_text(json.dumps(bad))
    code = main(["assess", *[str(out / f"site-{k}.json") for k in range(1, 5)], "--out", str(tmp_path / "rep"),
                 "--shape", "16", "16", "16"])
    assert code == 0
    rep = json.loads((tmp_path / "rep" / "assessment.json").read_text())
    assert rep["sites"] == ["site-1", "site-3", "site-4"] and rep["emd"]["most_distant"] == "site-4"
    assert (tmp_path / "rep" / "heatmap_emd.png").is_file() and (tmp_path / "rep" / "report.md").is_file()
