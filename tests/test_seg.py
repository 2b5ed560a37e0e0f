"""Segmentation data checks, the assessment on a label-volume federation, and the U-Net trainer."""

import json

import nibabel as nib
import numpy as np
import pytest

from fedmed.assessment import assess, site_assessment
from fedmed.data import DataError
from fedmed.encoders import build_encoder
from fedmed.phantoms import write_phantom_subjects
from fedmed.seg import dice_scores, load_case, seg_metrics, seg_model, train_seg_local
from fedmed.seg_data import check_no_leakage, discover_subjects, write_seg_federation

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
    assert meta["test_subjects"] == ["phantom_000", "phantom_001", "phantom_002"]  # fold 0 of 4
    assert meta["site_samples"]["site-4"] == ["phantom_010", "phantom_011"]  # the largest lesions
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


def test_whole_subject_folds_rotate_the_common_test_set(phantoms, tmp_path):
    entries = discover_subjects(phantoms, MODS, "OTMultiClass*", "brainmask*", hemispheres=True)
    tests = []
    for seed in range(3):
        out = write_seg_federation(entries, 3, tmp_path / f"f{seed}", partition="label_volume", test_fraction=0.25,
                                   seed=seed)
        meta = json.loads((out / "dataset.json").read_text())
        docs = [json.loads((out / f"{s}.json").read_text()) for s in meta["sites"]]
        subj = [{e["subject"] for e in d["training"]} for d in docs]
        assert all(not (a & b) for i, a in enumerate(subj) for b in subj[i + 1:])  # every subject at one site
        assert all({e["subject"] for e in d["test"]} == set(meta["test_subjects"]) for d in docs)  # common test set
        assert all(len([e for e in d["training"] if e["subject"] == x]) == 2 for d in docs for x in
                   {e["subject"] for e in d["training"]})  # both hemispheres of a subject stay together
        tests.append(set(meta["test_subjects"]))
    assert all(not (a & b) for i, a in enumerate(tests) for b in tests[i + 1:])  # folds hold out different subjects


def test_subject_leakage_raises(phantoms, tmp_path):
    from fedmed.seg_site import SegSiteRunner

    entries = discover_subjects(phantoms, MODS, "OTMultiClass*", "brainmask*", hemispheres=True)
    left, right = entries[18], entries[19]  # the two hemispheres of phantom_009
    assert left["subject"] == right["subject"] == "phantom_009"
    with pytest.raises(DataError, match=r"subject\(s\) \['phantom_009'\] are in both the training and the test"):
        check_no_leakage([left], [right])
    (tmp_path / "site-1.json").write_text(json.dumps({"training": [left, entries[0]], "validation": [], "test": [right]}))
    cfg = {"task": "segmentation", "data": {"shape": [16, 16, 16], "roi": [16, 16, 16], "in_channels": 2}}
    with pytest.raises(DataError, match="site-1: subject.*phantom_009.*subject leakage"):
        SegSiteRunner("site-1", tmp_path).cases(cfg)


def test_recipe_learns_untrained_dice_far_below_trained(phantoms):
    """The default recipe (Dice + focal, Adam kept across calls, tumour-centred patches) learns on a tiny case; the
    untrained network's whole-tumour Dice is far below a short run's."""
    from fedmed.train import make_optimizer

    cases = [load_case(e, shape=(16, 16, 16)) for e in discover_subjects(phantoms, MODS, "OTMultiClass*")[6:]]
    model = seg_model(2, channels=(4, 8, 16), seed=0)
    before = seg_metrics(model, cases, roi=(16, 16, 16))
    opt = make_optimizer(model, {"optimizer": "adam", "lr": 3e-3})
    for s in range(12):
        train_seg_local(model, cases, optimizer=opt, roi=(16, 16, 16), patches=2, seed=s)
    after = seg_metrics(model, cases, roi=(16, 16, 16))
    assert after["dice_wt"] > before["dice_wt"] + 0.3 and after["dice_wt"] > 0.5
    assert after["n_tumour_cases"] == len(cases) and np.isfinite(after["hd95_wt"])


def test_tumour_free_case_is_scored_by_false_positives_not_dice(phantoms):
    free = load_case(entry(phantoms, 0), shape=(16, 16, 16))  # phantom_000: radius 0, no tumour
    assert free["label"].sum() == 0
    m = seg_metrics(seg_model(2, channels=(4, 8, 16)), [free], roi=(16, 16, 16))
    assert m["n_tumour_cases"] == 0 and m["n_tumour_free_cases"] == 1 and np.isnan(m["dice_wt"])
    assert m["fp_voxels"] >= 0


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


def test_largest_component_keeps_the_main_lesion_and_restricts_tc_et():
    from fedmed.seg import keep_largest_component

    m = np.zeros((3, 12, 12, 12), np.uint8)
    m[0, 2:7, 2:7, 2:7] = 1  # main lesion, 125 voxels
    m[0, 10:12, 10:12, 10:12] = 1  # a far-away false positive, 8 voxels
    m[1, 3:5, 3:5, 3:5] = 1
    m[1, 10, 10, 10] = 1  # TC inside the false positive
    m[2, 4, 4, 4] = 1
    out = keep_largest_component(m)
    assert out[0].sum() == 125 and out[0, 10:, 10:, 10:].sum() == 0
    assert out[1].sum() == 8 and out[1, 10, 10, 10] == 0 and out[2].sum() == 1
    assert keep_largest_component(out).tolist() == out.tolist()  # one component: unchanged
    assert keep_largest_component(np.zeros_like(m)).sum() == 0
