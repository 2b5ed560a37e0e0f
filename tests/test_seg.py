"""Segmentation data checks, the assessment on a label-volume federation, and the U-Net trainer."""

import json
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from fedmed.algorithms.assessment import assess
from fedmed.data.images import DataError
from fedmed.data.nifti import load_case
from fedmed.data.phantoms import write_phantom_subjects
from fedmed.data.seg_federation import (
    check_no_leakage,
    discover_subjects,
    write_seg_federation,
)
from fedmed.nn.encoders import build_encoder
from fedmed.nn.seg import dice_scores, seg_metrics, seg_model, train_seg_local
from fedmed.site.seg_aggregates import site_assessment

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


def test_nan_voxels_name_the_case_not_training_diverged(phantoms, tmp_path):
    """NaN voxels in one modality used to surface rounds later as 'training diverged' with no case named."""
    e = entry(phantoms, 3)
    img = nib.load(e["image"][0])
    arr = np.asarray(img.dataobj, dtype=np.float32).copy()
    arr[3, 4, 5] = np.nan
    nib.save(nib.Nifti1Image(arr, img.affine), str(tmp_path / "Flair_nan.nii.gz"))
    e["image"][0] = str(tmp_path / "Flair_nan.nii.gz")
    with pytest.raises(DataError, match=r"site-4: case phantom_003: FLAIR image .*Flair_nan.nii.gz has 1 NaN or "
                                        r"infinite voxel"):
        load_case(e, site="site-4")


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
    from fedmed.site.seg import SegSiteRunner

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
    from fedmed.nn.train import make_optimizer

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


def test_training_patches_reach_the_network_as_plain_tensors_with_the_same_values(phantoms):
    """MONAI's transforms return ``MetaTensor``s; fed to the network they route every operation of a training step
    through metadata tracking (MONAI's fast-training guide turns it off). The batches are plain tensors holding the
    transform's values, and a model trains to the same parameters either way."""
    import torch
    from monai.data import MetaTensor

    from fedmed.nn import seg

    cases = [load_case(e, shape=(16, 16, 16)) for e in discover_subjects(phantoms, MODS, "OTMultiClass*")[9:12]]
    tf = seg._train_transforms((16, 16, 16), 0, 2, 0.5)
    x, y = next(seg._patch_batches(cases, [0], tf, 0, 0))
    assert type(x) is torch.Tensor and type(y) is torch.Tensor
    out = seg._train_transforms((16, 16, 16), 0, 2, 0.5)({"image": torch.from_numpy(cases[0]["image"]),
                                                          "label": torch.from_numpy(cases[0]["label"])})
    assert isinstance(out[0]["image"], MetaTensor)  # what the transforms give
    assert torch.equal(x, torch.stack([o["image"].as_tensor() for o in out]).float())

    def trained(plain):
        torch.manual_seed(0)
        model = seg_model(2, channels=(4, 8, 16))
        saved = seg._plain
        seg._plain = saved if plain else torch.as_tensor  # the MetaTensor as the transforms give it
        try:
            train_seg_local(model, cases, roi=(16, 16, 16), seed=3, epochs=2)
        finally:
            seg._plain = saved
        return [p.detach() for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(trained(True), trained(False)))


def test_assess_cli_skips_bad_site(phantoms, tmp_path, capsys):
    from fedmed.cli.main import main

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
    from fedmed.nn.seg import keep_largest_component

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


def _ball(shape, centre, r):
    g = np.indices(shape).astype(np.float64)
    return (np.sqrt(sum((g[i] - centre[i]) ** 2 for i in range(3))) <= r).astype(np.uint8)


def _case(label3, meta):
    return {"image": np.zeros((1, *label3.shape[1:]), np.float32), "label": label3, "meta": meta}


def test_a_subject_is_scored_once_not_per_hemisphere():
    """BraTS scores a patient: a hemisphere with a 3-voxel fragment of a lesion centred in the other one must not
    weigh as much as the lesion (the per-sample reading gives ~0.5 for a near-perfect segmentation)."""
    from fedmed.nn.seg import score_masks

    left = np.zeros((3, 10, 20, 20), np.uint8)
    left[:, 2:9, 5:15, 5:15] = 1
    right = np.zeros((3, 10, 20, 20), np.uint8)
    right[:, 0, 9, 9:12] = 1  # 3 voxels across the midline
    meta = {"subject": "p1", "spacing_mm": [1.0, 1.0, 1.0]}
    cases = [_case(left, {**meta, "region": "left", "origin_mm": [0.0, 0.0, 0.0]}),
             _case(right, {**meta, "region": "right", "origin_mm": [10.0, 0.0, 0.0]})]
    m = score_masks([left, np.zeros_like(right)], cases)
    assert m["n_tumour_cases"] == 1 and m["dice_wt"] > 0.99 and m["dice_mean"] > 0.99
    assert m["dice_wt_per_sample"] == pytest.approx(0.5)


def test_subject_scores_of_hemispheres_equal_the_whole_volume_and_monai():
    """Split into hemispheres (placed by origin_mm) or whole, a subject gets the same Dice and HD95, and the whole
    volume's HD95 is MONAI's; a lesion crossing the midline keeps its real surface (the cut is not an edge)."""
    import torch
    from monai.metrics import compute_hausdorff_distance

    from fedmed.nn.seg import score_masks

    shape, sp = (24, 20, 18), [1.5, 1.0, 2.0]
    gt = np.stack([_ball(shape, (11, 9, 8), 6), _ball(shape, (11, 9, 8), 4), _ball(shape, (12, 9, 8), 2)])
    pred = np.stack([_ball(shape, (13, 10, 8), 5), _ball(shape, (10, 9, 9), 4), np.zeros(shape, np.uint8)])
    whole = [_case(gt, {"subject": "s", "region": "whole", "spacing_mm": sp, "origin_mm": [0.0, 0.0, 0.0]})]
    halves = [_case(gt[:, :12], {"subject": "s", "region": "left", "spacing_mm": sp, "origin_mm": [0.0, 0.0, 0.0]}),
              _case(gt[:, 12:], {"subject": "s", "region": "right", "spacing_mm": sp, "origin_mm": [18.0, 0.0, 0.0]})]
    a = score_masks([pred], whole)
    b = score_masks([pred[:, :12], pred[:, 12:]], halves)
    for k in ("dice_wt", "dice_tc", "dice_et", "hd95_wt", "hd95_tc", "hd95_et"):
        assert a[k] == pytest.approx(b[k], abs=1e-9), k
    for j, r in enumerate(("wt", "tc")):
        ref = compute_hausdorff_distance(torch.from_numpy(pred[None, j:j + 1]).float(),
                                         torch.from_numpy(gt[None, j:j + 1]).float(), percentile=95, spacing=sp)
        assert a[f"hd95_{r}"] == pytest.approx(float(ref[0, 0]), rel=1e-5)
    assert a["dice_et"] == 0 and a["hd95_et"] == pytest.approx(np.linalg.norm(np.asarray(shape) * sp))
    assert a["n_tumour_cases"] == 1 and b["dice_wt_per_sample"] != pytest.approx(a["dice_wt"])


def test_loaded_hemispheres_are_placed_where_the_whole_case_is(phantoms):
    """load_case's origin_mm puts each hemisphere's voxels at their place in the original volume: a prediction
    scored on the two loaded halves gets the whole loaded case's Dice and HD95 (no resampling: shape = crop)."""
    from fedmed.nn.seg import score_masks

    ents = discover_subjects(phantoms, MODS, "OTMultiClass*", "brainmask*", hemispheres=True)
    left_e, right_e = ents[20], ents[21]  # phantom_010, radius 10: crosses the midline
    whole_e = {**left_e, "region": "whole", "id": "phantom_010"}
    brain = np.asarray(nib.load(whole_e["mask"]).dataobj) > 0
    idx = [np.flatnonzero(brain.any(axis=tuple(j for j in range(3) if j != i))) for i in range(3)]
    lo, hi = np.array([v.min() for v in idx]), np.array([v.max() + 1 for v in idx])
    mid = (lo[0] + hi[0]) // 2
    whole = load_case(whole_e, shape=tuple(hi - lo))
    left = load_case(left_e, shape=(mid - lo[0], *(hi - lo)[1:]))
    right = load_case(right_e, shape=(hi[0] - mid, *(hi - lo)[1:]))
    assert left["label"][0].sum() > 0 and right["label"][0].sum() > 0
    pred = np.roll(whole["label"], 3, axis=1)  # across the midline: pairs of surface points cross the cut
    a = score_masks([pred], [whole])
    b = score_masks([pred[:, :mid - lo[0]], pred[:, mid - lo[0]:]], [left, right])
    assert 0.2 < a["dice_wt"] < 0.95
    for k in ("dice_wt", "dice_tc", "dice_et", "hd95_wt", "hd95_tc", "hd95_et"):
        assert a[k] == pytest.approx(b[k], abs=1e-9), k


def test_a_dicom_series_is_a_segmentation_case_aligned_with_its_nifti_label(tmp_path):
    """A 3D DICOM series (six slices of pydicom's MR_small.dcm stacked along the normal, files in shuffled order) in a
    subject folder, with a NIfTI label map: slices sorted by position, spacing from the headers; a label stored in
    another orientation (flipped axes, as exporters write RAS vs DICOM's LPS) is aligned voxel for voxel, so the case
    is the same either way."""
    pydicom = pytest.importorskip("pydicom")
    import nibabel as nib
    from dicom_series import blob_masks, write_series

    from fedmed.data.nifti import load_case, load_volume

    series = tmp_path / "subject-1" / "MR"
    dss = write_series(series, 6)
    arr, aff = load_volume(series, "site-1", "MR image")
    assert arr.shape == (64, 64, 6)
    spacing = np.sqrt((aff[:3, :3] ** 2).sum(axis=0))
    ds = pydicom.dcmread(next(series.iterdir()))
    assert np.allclose(spacing, [*[float(v) for v in ds.PixelSpacing][::-1], 2.0])
    # sorted by position, not by file name: slice k holds the blob written for slice k
    assert np.array_equal(arr > 850, blob_masks(dss).transpose(2, 1, 0).astype(bool))
    lab = np.zeros(arr.shape, np.int16)
    lab[arr > 850] = 2  # "edema" where the blob is
    nib.save(nib.Nifti1Image(lab, aff), tmp_path / "same.nii.gz")
    flip = np.eye(4)
    flip[0, 0], flip[0, 3] = -1, arr.shape[0] - 1  # voxel i -> n-1-i: the same places, stored mirrored
    nib.save(nib.Nifti1Image(lab[::-1].copy(), aff @ flip), tmp_path / "flipped.nii.gz")
    nib.save(nib.Nifti1Image(np.ones(arr.shape, np.uint8), aff), tmp_path / "mask.nii.gz")  # no crop, no resize:
    entry = {"image": [str(series)], "modalities": ["MR"], "id": "subject-1", "mask": str(tmp_path / "mask.nii.gz")}
    a = load_case({**entry, "label": str(tmp_path / "same.nii.gz")}, shape=arr.shape)  # voxels compare one to one
    b = load_case({**entry, "label": str(tmp_path / "flipped.nii.gz")}, shape=arr.shape)
    assert a["label"].any() and np.array_equal(a["label"][:, ::-1], b["label"])  # mirrored storage, mirrored grid
    assert np.allclose(a["image"][:, ::-1], b["image"])  # ... and the image followed its label
    assert a["meta"]["volume_mm3"]["WT"] == pytest.approx(int((lab > 0).sum()) * float(abs(np.linalg.det(aff[:3, :3]))))


def test_a_dicom_seg_label_is_placed_on_its_series_as_the_same_nifti_label_would_be(tmp_path):
    """A DICOM-SEG (highdicom) of the series, segments only on slices 2 and 4 (the SEG holds those frames only):
    read with its segments as label values, placed by position on the image grid — the case equals the one read with
    the same labels as a NIfTI file."""
    pytest.importorskip("highdicom")
    import nibabel as nib
    from dicom_series import blob_masks, write_seg, write_series

    from fedmed.data.nifti import load_case, load_volume

    series = tmp_path / "subject-1" / "MR"
    dss = write_series(series, 6)
    labels = np.zeros((6, 64, 64), np.uint8)
    m = blob_masks(dss)
    labels[2], labels[4] = 2 * m[2], 4 * m[4]
    labels[4, :, :28] = np.where(m[4, :, :28] > 0, 1, 0)  # part of slice 4's blob is necrosis: two segments there
    write_seg(tmp_path / "subject-1" / "seg.dcm", dss, labels)
    arr, aff = load_volume(series, "site-1", "MR image")
    nib.save(nib.Nifti1Image(labels.transpose(2, 1, 0).astype(np.int16), aff), tmp_path / "same.nii.gz")
    nib.save(nib.Nifti1Image(np.ones(arr.shape, np.uint8), aff), tmp_path / "mask.nii.gz")
    entry = {"image": [str(series)], "modalities": ["MR"], "id": "subject-1", "mask": str(tmp_path / "mask.nii.gz")}
    a = load_case({**entry, "label": str(tmp_path / "subject-1" / "seg.dcm")}, shape=arr.shape)
    b = load_case({**entry, "label": str(tmp_path / "same.nii.gz")}, shape=arr.shape)
    assert np.array_equal(a["label"], b["label"]) and a["label"][0].sum() == int((labels > 0).sum())
    assert a["label"][2].sum() == int((labels == 4).sum()) > 0  # ET = label 4 = segment 4
    assert a["label"][:, :, :, [0, 1, 3, 5]].sum() == 0  # nothing on the slices without a frame
    assert a["meta"]["volume_mm3"] == pytest.approx(b["meta"]["volume_mm3"])


def _radial_series(tmp_path):
    import shutil

    pydicom = pytest.importorskip("pydicom")
    src = Path(pydicom.__file__).parent / "data" / "test_files" / "dicomdirtests" / "98892003" / "MR700"
    shutil.copytree(src, tmp_path / "radial")
    return tmp_path / "radial"


def _gap_series(tmp_path):
    from dicom_series import write_series

    write_series(tmp_path / "gap", 6, skip=3)
    return tmp_path / "gap"


def _double_series(tmp_path):
    import pydicom
    from dicom_series import write_series
    from pydicom.uid import generate_uid

    write_series(tmp_path / "double", 4)
    first = min((tmp_path / "double").iterdir())
    ds = pydicom.dcmread(first)
    ds.SOPInstanceUID = generate_uid()
    ds.file_meta.MediaStorageSOPInstanceUID = ds.SOPInstanceUID
    ds.save_as(tmp_path / "double" / "again.dcm")
    return tmp_path / "double"


@pytest.mark.parametrize("make, says", [
    (_radial_series, "its 7 slices have 7 different orientations (a radial or localizer series?)"),
    (_gap_series, "uneven slice positions: 2 mm apart but 4 mm after slice 3 of 5 (a slice missing?)"),
    (_double_series, "1 slice(s) at the same position (a doubled slice, or two acquisitions)"),
], ids=["radial", "missing-slice", "doubled-slice"])
def test_a_dicom_series_that_is_not_a_regular_volume_is_refused_in_one_line(tmp_path, make, says):
    """SimpleITK reads any series as a volume with the first slice's orientation: pydicom's own 7-slice sample is a
    radial series (each slice turned by another angle) and would have been read as a 16x16x7 volume."""
    from fedmed.data.images import DataError
    from fedmed.data.nifti import load_volume

    folder = make(tmp_path)
    with pytest.raises(DataError) as e:
        load_volume(folder, "site-1", "MR image")
    assert str(e.value) == f"site-1: the DICOM series in MR image folder {folder} is not a 3-D volume: {says}"


def test_a_dicom_seg_that_does_not_fit_its_series_is_refused_naming_it(tmp_path):
    pytest.importorskip("highdicom")
    from dicom_series import blob_masks, write_seg, write_series

    from fedmed.data.images import DataError
    from fedmed.data.nifti import load_case

    dss = write_series(tmp_path / "a", 4)
    other = write_series(tmp_path / "b", 4)  # another series: another frame of reference
    write_seg(tmp_path / "seg_b.dcm", other, 2 * blob_masks(other))
    write_seg(tmp_path / "fractional.dcm", dss, blob_masks(dss), fractional=True)
    entry = {"image": [str(tmp_path / "a")], "modalities": ["MR"], "id": "s"}
    with pytest.raises(DataError, match=r"^site-1: DICOM-SEG label .*seg_b.dcm is in another frame of reference than "
                                        r"its image series$"):
        load_case({**entry, "label": str(tmp_path / "seg_b.dcm")}, shape=(8, 8, 4), site="site-1")
    with pytest.raises(DataError, match=r"^site-1: DICOM-SEG label .*fractional.dcm is FRACTIONAL; a label map needs "
                                        r"BINARY or LABELMAP segments$"):
        load_case({**entry, "label": str(tmp_path / "fractional.dcm")}, shape=(8, 8, 4), site="site-1")


def test_ditto_keeps_a_personal_model_that_the_site_serves_and_trains_toward_the_global_one(phantoms, tmp_path):
    """Ditto (Li et al. 2021): a site's personal model lives in its runner's state between rounds (the task, not the
    runner, decides to serve it); training moves the global model and the personal one, which stays a different
    network from the global one."""
    import torch

    from fedmed.nn.train import get_params
    from fedmed.site.seg import SegSiteRunner, served_model

    entries = discover_subjects(phantoms, MODS, "OTMultiClass*", "brainmask*", hemispheres=False)
    (tmp_path / "site-1.json").write_text(json.dumps({"training": entries[1:7], "validation": [], "test": entries[7:9]}))
    cfg = {"task": "segmentation", "seed": 0, "data": {"shape": [16, 16, 16], "roi": [16, 16, 16], "in_channels": 2},
           "model": {"channels": [4, 8, 16]}, "train": {"local_epochs": 1, "lr": 1e-2},
           "privacy": {"k_min": 2}, "ditto_lambda": 0.1}
    runner = SegSiteRunner("site-1", tmp_path)
    g0 = get_params(runner.model(cfg))
    personal = served_model(runner, cfg)
    assert personal is not runner.model(cfg) and served_model(runner, cfg) is personal  # kept between tasks
    before = {k: v.clone() for k, v in personal.state_dict().items()}
    _, metrics, _, out = runner.handle("train", g0, cfg, 0)
    assert np.isfinite(metrics["train_loss"])
    assert any(not torch.equal(before[k], v) for k, v in served_model(runner, cfg).state_dict().items())
    assert any(not np.array_equal(out[k], g0[k]) for k in g0)  # the global update went back
    no_ditto = {**cfg, "ditto_lambda": None}
    assert served_model(runner, no_ditto) is runner.model(no_ditto)


def test_a_site_scores_its_validation_subjects_when_it_has_k_min_of_them(phantoms, tmp_path):
    """#38: 3D segmentation never scored the validation split (every round said "val dice_mean n/a" and
    `selection: validation` could not work). A site now sends its validation subjects' Dice beside the test one — and
    withholds it when it has fewer than k_min validation subjects (an aggregate of fewer would leave the site)."""
    from fedmed.nn.train import get_params
    from fedmed.site.seg import SegSiteRunner

    entries = discover_subjects(phantoms, MODS, "OTMultiClass*", "brainmask*", hemispheres=False)
    cfg = {"task": "segmentation", "seed": 0, "data": {"shape": [16, 16, 16], "roi": [16, 16, 16], "in_channels": 2},
           "model": {"channels": [4, 8, 16]}, "train": {"local_epochs": 1, "lr": 1e-2}, "privacy": {"k_min": 5}}
    for n_val, sent in ((5, True), (4, False)):  # a site's default policy floor: k_min 5
        d = tmp_path / f"v{n_val}"
        d.mkdir()
        (d / "site-1.json").write_text(json.dumps({"training": entries[:1], "validation": entries[1:1 + n_val],
                                                   "test": entries[6:11]}))
        runner = SegSiteRunner("site-1", d)
        _, metrics, _, _ = runner.handle("validate", get_params(runner.model(cfg)), cfg, 0)
        assert "dice_mean" in metrics
        assert ("val_dice_mean" in metrics) is sent, (n_val, sorted(metrics))
        if sent:
            assert 0.0 <= metrics["val_dice_mean"] <= 1.0


def test_the_3d_references_are_selected_on_validation_subjects(tmp_path):
    """`selection: validation` on a 3D federation: the centralized and each-site-alone rows carry the sites'
    validation Dice, and the reported round is the one best on it (the references stopped such a run before)."""
    import yaml

    from fedmed.config import load_config
    from fedmed.report.summary import reported_rows
    from fedmed.run.experiment import prepare_federation
    from fedmed.run.references import seg_reference_rows

    root = tmp_path / "ph"
    write_phantom_subjects(root, [0, 2, 3, 3, 4, 4, 5, 6, 6, 9, 10, 11, 3, 5, 8, 2, 3, 4, 5, 6, 7], size=24)
    raw = yaml.safe_load((Path(__file__).resolve().parents[1] / "app_configs" / "demo_seg_phantoms.yaml").read_text())
    raw["dataset"]["path"] = str(root)
    raw["federation"].update(sites=2, val_fraction=0.4)
    raw["train"].update(rounds=2, local_epochs=1)
    raw.update(selection="validation", methods=[{"name": "FedAvg", "workflow": "fedavg"}])
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    exp = load_config(tmp_path / "c.yaml")
    data = prepare_federation(exp, 0, tmp_path / "fed")
    sites = json.loads((data / "dataset.json").read_text())["sites"]
    rows = seg_reference_rows(exp, data, sites, 0, log=lambda *_: None)
    assert rows and all(isinstance(r.get("val_dice_mean"), float) for r in rows)
    central = [r for r in rows if r["method"] == "Centralized"]
    best = max(central, key=lambda r: (r["val_dice_mean"], -r["round"]))
    assert reported_rows(rows, "validation")[("Centralized", 0)]["round"] == best["round"]


@pytest.mark.parametrize("gb", [None, 0])
def test_a_gpu_sites_volumes_are_placed_once_or_said_not_to_fit_its_budget(phantoms, tmp_path, monkeypatch, gb):
    """The device path of a segmentation site (fedmed.nn.resident.DeviceVolumes), run on the CPU: the training
    volumes are placed once and reused the next round; over the site's device_data_gb the site says so in one line and
    cuts its patches as before."""
    from fedmed.nn.resident import DeviceVolumes
    from fedmed.nn.train import get_params
    from fedmed.site.runner import SiteRunner
    from fedmed.site.seg import SegSiteRunner

    monkeypatch.setattr(SiteRunner, "CPU_KEEPS_ITS_PATH", False)
    entries = discover_subjects(phantoms, MODS, "OTMultiClass*", "brainmask*", hemispheres=False)
    (tmp_path / "site-1.json").write_text(json.dumps({"training": entries[1:7], "validation": [], "test": entries[7:9]}))
    cfg = {"task": "segmentation", "seed": 0, "data": {"shape": [16, 16, 16], "roi": [16, 16, 16], "in_channels": 2},
           "model": {"channels": [4, 8, 16]}, "train": {"local_epochs": 1, "lr": 1e-2}, "privacy": {"k_min": 2}}
    runner = SegSiteRunner("site-1", tmp_path)
    runner.settings.device_data_gb = gb
    g0 = get_params(runner.model(cfg))
    replies = [runner.handle("train", g0, cfg, r) for r in range(2)]
    assert all(np.isfinite(r.metrics["train_loss"]) and r.meta["n_train"] == 6 for r in replies)
    tr, _ = runner.cases(cfg)
    placed = runner.volumes_on_device(tr, cfg)
    notes = [n for r in replies for n in r.meta.get("notes", []) if "device-data budget" in n]
    if gb is None:
        assert isinstance(placed, DeviceVolumes) and len(placed) == 6 and not notes
        assert runner.volumes_on_device(tr, cfg) is placed and runner._resident_bytes == placed.nbytes
    else:
        assert placed is tr and len(notes) == 1 and "patches are cut on the CPU" in notes[0]


def test_crop_indices_computed_once_per_case_give_the_same_patches_and_weights(phantoms, monkeypatch):
    """fedmed.nn.seg hands RandCropByPosNegLabeld each case's foreground/background indices, computed once, instead
    of letting it scan the whole label every call, and runs the transforms without MONAI's metadata tracking: the
    same crops, so the same trained weights bit for bit."""
    import torch

    from fedmed.nn import seg

    cases = [load_case(e, shape=(16, 16, 16)) for e in discover_subjects(phantoms, MODS, "OTMultiClass*")[6:12]]

    def trained():
        torch.manual_seed(0)
        model = seg_model(2, channels=(4, 8, 16))
        train_seg_local(model, cases, roi=(8, 8, 8), seed=5, epochs=3, patches=3, pos_fraction=0.67)
        return [p.detach().clone() for p in model.parameters()]

    calls = []
    real = seg._crop_indices
    monkeypatch.setattr(seg, "_crop_indices", lambda label: calls.append(id(label)) or real(label))
    cached = trained()
    assert len(calls) == 18 and len(seg._INDICES) >= 6  # asked per case and epoch, computed once per case
    monkeypatch.setattr(seg, "_crop_indices", lambda label: {})  # MONAI computes them on every call
    assert all(torch.equal(a, b) for a, b in zip(cached, trained()))
    # and MONAI's metadata tracking (off while fedmed cuts patches, seg._Untracked) changes no value either
    monkeypatch.setattr(seg, "_Untracked", lambda tf: tf)
    assert all(torch.equal(a, b) for a, b in zip(cached, trained()))
