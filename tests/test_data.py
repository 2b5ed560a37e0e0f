import json

import numpy as np
import pytest

from fedmed.data.images import DataError, discover, load_images

from fedmed.data.datalists import load_datalist, write_site_datalists
from fedmed.data.partition import iid_partition
from fedmed.site.runner import SiteRunner

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
    with pytest.raises(DataError, match=r"site-2: entries\[0\]: cannot read image .*broken.png \(corrupt or not an image"):
        load_images(load_datalist(tmp_path / "site-2.json")["training"], image_size=8, channels=1, site="site-2")
    doc["training"][0]["image"] = str(tmp_path / "gone.png")
    (tmp_path / "site-2.json").write_text(json.dumps(doc))
    runner = SiteRunner("site-2", tmp_path)
    with pytest.raises(DataError, match=r"site-2: training\[0\]: cannot read image .*gone.png \(file not found\)"):
        runner.data(8, 1)


def test_bad_datalist(tmp_path):
    (tmp_path / "s.json").write_text('{"training": [{"image": "a.png"}]}')
    with pytest.raises(DataError, match=r"s.json: training\[0\] should have 'image' and 'label'"):
        load_datalist(tmp_path / "s.json")
    with pytest.raises(DataError, match="datalist not found"):
        load_datalist(tmp_path / "none.json")


def test_discover_npz(tmp_path):
    z = tmp_path / "m.npz"
    imgs = np.arange(6, dtype=np.uint8)[:, None, None] * np.ones((1, 28, 28), np.uint8)  # six different images
    np.savez(z, train_images=imgs[:4], train_labels=np.array([[0], [1], [0], [1]]),
             test_images=imgs[4:], test_labels=np.array([[1], [0]]))
    pool = discover(str(z))
    assert len(pool.items) == 6 and pool.n_classes == 2
    with pytest.raises(DataError, match="does not exist"):
        discover(str(tmp_path / "nothing"))


def test_discover_busi():
    root = shared_path("busi")
    pool = discover(str(root))
    assert pool.class_names == ["benign", "malignant", "normal"]
    assert np.bincount(pool.labels).tolist() == [437, 209, 133]  # 210 malignant files, one an exact copy of another


def test_discover_imagenette_splits_pooled():
    pool = discover(str(shared_path("imagenette_subset")))
    assert pool.n_classes == 10 and len(pool.items) == 700


def _png16(path, arr):
    from PIL import Image

    Image.fromarray(np.asarray(arr, dtype=np.uint16)).save(path)


def test_a_16_bit_image_keeps_its_dynamic_range_and_the_site_says_so(tmp_path):
    """A full-range 16-bit PNG: PIL's convert("L") clipped 99.6% of its pixels to 255. Scaled by its own range, its
    ramp stays a ramp, and the site's first reply says what it converted (once)."""
    from PIL import Image

    ramp = np.tile(np.linspace(0, 65535, 64), (64, 1)).round()
    f = tmp_path / "ramp16.png"
    _png16(f, ramp)
    with Image.open(f) as im:
        assert im.mode.startswith("I")  # really a 16-bit file
    done: set = set()
    x, _ = load_images([{"image": str(f), "label": 0}], image_size=64, channels=1, conversions=done)
    v = x[0, 0].numpy()
    assert (v >= 0.999).mean() < 0.05 and abs(float(v.mean()) - 0.5) < 0.02
    assert np.allclose(v[0], np.linspace(0, 1, 64), atol=1e-3)
    assert any("16-bit" in d and "own range" in d for d in done)
    # a 12-bit image in a 16-bit file (a CT / X-ray export): the same rule, no clipping either
    _png16(tmp_path / "twelve.png", np.tile(np.linspace(0, 4095, 32), (32, 1)))
    x12, _ = load_images([{"image": str(tmp_path / "twelve.png"), "label": 0}], image_size=32, channels=3)
    assert x12.shape == (1, 3, 32, 32) and float(x12.max()) == pytest.approx(1.0) and float(x12.min()) == 0.0
    # an 8-bit image is read exactly as before: / 255, nothing said but the resize
    Image.fromarray((ramp / 257).astype(np.uint8)).save(tmp_path / "ramp8.png")
    done8: set = set()
    x8, _ = load_images([{"image": str(tmp_path / "ramp8.png"), "label": 0}], image_size=64, channels=1,
                        conversions=done8)
    assert np.allclose(x8[0, 0].numpy(), (ramp / 257).astype(np.uint8) / 255.0) and not done8

    doc = {"training": [{"image": str(f), "label": 0}] * 3, "validation": [],
           "test": [{"image": str(tmp_path / "twelve.png"), "label": 0}]}  # another image: one in two splits is a leak
    (tmp_path / "site-1.json").write_text(json.dumps(doc))
    runner = SiteRunner("site-1", tmp_path)
    cfg = {"seed": 0, "data": {"image_size": 32, "channels": 1, "n_classes": 2}, "privacy": {"k_min": 1},
           "model": {"arch": "resnet9", "width": 4, "norm": "group"}}
    from fedmed.nn.models import model_from_config
    from fedmed.nn.train import get_params

    p = get_params(model_from_config(cfg["model"], 1, 2))
    _, _, first, _ = runner.handle("validate", p, cfg)
    _, _, second, _ = runner.handle("validate", p, cfg)
    said = [n for n in first.get("notes", []) if "converted on loading" in n]
    assert len(said) == 1 and "16-bit" in said[0] and "resized to 32x32" in said[0]
    assert not second.get("notes")


def test_colour_alpha_and_multi_frame_images_are_handled_on_purpose(tmp_path):
    from PIL import Image

    rgba = np.zeros((8, 8, 4), np.uint8)
    rgba[..., 0], rgba[..., 3] = 200, 10
    Image.fromarray(rgba, mode="RGBA").save(tmp_path / "a.png")
    done: set = set()
    x, _ = load_images([{"image": str(tmp_path / "a.png"), "label": 0}], image_size=8, channels=1, conversions=done)
    assert done == {"colour to grayscale (ITU-R 601-2 luma), alpha dropped"}
    assert float(x.max()) == pytest.approx(round(200 * 299 / 1000) / 255, abs=1 / 255)
    frames = [Image.fromarray(np.full((8, 8), v, np.uint8)) for v in (0, 255)]
    frames[0].save(tmp_path / "stack.tif", save_all=True, append_images=frames[1:])
    with pytest.raises(DataError, match=r"site-9: entries\[0\]: image .*stack.tif has 2 frames; one image per file"):
        load_images([{"image": str(tmp_path / "stack.tif"), "label": 0}], image_size=8, channels=1, site="site-9")


def test_an_image_in_two_splits_is_a_leak_named_without_absolute_paths(tmp_path):
    """The same image listed in training and test — by path, or as an identical copy under another name — is
    refused at the site's first task, naming the image relative to the data root and the splits."""
    import shutil

    small_federation(tmp_path)
    doc = json.loads((tmp_path / "site-1.json").read_text())
    clean = json.loads(json.dumps(doc))
    doc["test"].append(dict(doc["training"][0]))
    (tmp_path / "site-1.json").write_text(json.dumps(doc))
    with pytest.raises(DataError) as e:
        SiteRunner("site-1", tmp_path).data(8, 1)
    msg = str(e.value)
    assert f"the same image in training and test: {doc['training'][0]['image']}" in msg and str(tmp_path) not in msg

    copy = tmp_path / "images" / "copy_of_first.png"
    shutil.copy(tmp_path / clean["training"][1]["image"], copy)
    clean["validation"].append({"image": "images/copy_of_first.png", "label": clean["training"][1]["label"]})
    (tmp_path / "site-1.json").write_text(json.dumps(clean))
    with pytest.raises(DataError, match=r"the same image in training and validation: .* and images/copy_of_first.png "
                                        r"\(identical files\)"):
        load_datalist(tmp_path / "site-1.json")


def test_two_hemispheres_of_one_volume_are_two_samples(tmp_path):
    img = tmp_path / "flair.nii.gz"
    img.write_bytes(b"volume")
    lab = tmp_path / "label.nii.gz"
    lab.write_bytes(b"labels")
    e = {"image": [str(img)], "label": str(lab)}
    (tmp_path / "s.json").write_text(json.dumps({"training": [{**e, "region": "left"}], "test": [{**e, "region": "right"}]}))
    assert load_datalist(tmp_path / "s.json", task="segmentation")["test"][0]["region"] == "right"
    (tmp_path / "s.json").write_text(json.dumps({"training": [{**e, "region": "left"}], "test": [{**e, "region": "left"}]}))
    with pytest.raises(DataError, match="the same image in training and test: flair.nii.gz"):
        load_datalist(tmp_path / "s.json", task="segmentation")


# ------------------------------------------------------------------ DICOM (pydicom's own small sample files)

def _dicom_samples():
    pydicom = pytest.importorskip("pydicom")
    from pathlib import Path

    return pydicom, Path(pydicom.__file__).parent / "data" / "test_files"


def test_a_dicom_class_folder_dataset_trains_like_png(tmp_path, capsys):
    """2D DICOM files in class folders (pydicom's CT_small and MR_small, each saved under several instance
    numbers): `fedmed data` writes datalists, a site loads them; what was converted is said once, without any
    header value (the files carry a patient name)."""
    pydicom, src = _dicom_samples()
    from fedmed.cli.main import main

    for cls, name in (("ct", "CT_small.dcm"), ("mr", "MR_small.dcm")):
        (tmp_path / "data" / cls).mkdir(parents=True)
        for k in range(6):
            ds = pydicom.dcmread(src / name)
            ds.InstanceNumber = k + 1
            ds.PixelData = (ds.pixel_array.astype(ds.pixel_array.dtype) + k).tobytes()  # six different images
            ds.save_as(tmp_path / "data" / cls / f"img{k}.dcm")
    patient = str(pydicom.dcmread(src / "CT_small.dcm").PatientName)
    assert patient
    assert main(["data", "--dataset", str(tmp_path / "data"), "--sites", "2", "--out", str(tmp_path / "dl")]) == 0
    runner = SiteRunner("site-1", tmp_path / "dl")
    s = runner.data(16, 1)
    assert s.train[0].shape[1:] == (1, 16, 16) and float(s.train[0].max()) <= 1.0
    note = " ".join(runner.notes)
    assert "DICOM" in note and "CT Hounsfield units mapped from [-1024.0, 3071.0]" in note
    assert patient not in note and patient not in capsys.readouterr().out


def test_dicom_rescale_and_monochrome1_are_applied(tmp_path):
    pydicom, src = _dicom_samples()
    from fedmed.data.images import decode_image

    base, _ = decode_image(src / "CT_small.dcm", image_size=32, channels=1)
    ds = pydicom.dcmread(src / "CT_small.dcm")
    ds.RescaleSlope = 2  # twice the Hounsfield units: a different picture on CT's fixed range
    ds.save_as(tmp_path / "slope.dcm")
    assert not np.allclose(decode_image(tmp_path / "slope.dcm", image_size=32, channels=1)[0], base)
    ds = pydicom.dcmread(src / "CT_small.dcm")  # the same units stored another way: the same picture
    ds.PixelData = (ds.pixel_array.astype(np.int32) + 24).astype(ds.pixel_array.dtype).tobytes()
    ds.RescaleIntercept = float(ds.RescaleIntercept) - 24
    ds.save_as(tmp_path / "shifted.dcm")
    assert np.allclose(decode_image(tmp_path / "shifted.dcm", image_size=32, channels=1)[0], base, atol=1e-6)

    mr, _ = decode_image(src / "MR_small.dcm", image_size=32, channels=1)
    ds = pydicom.dcmread(src / "MR_small.dcm")
    ds.PhotometricInterpretation = "MONOCHROME1"  # 0 is white
    ds.save_as(tmp_path / "mono1.dcm")
    inv, done = decode_image(tmp_path / "mono1.dcm", image_size=32, channels=1)
    assert np.allclose(inv, 1.0 - mr, atol=1e-5) and "DICOM MONOCHROME1 inverted" in done


def test_a_multi_frame_dicom_is_refused_with_one_line(tmp_path):
    _, src = _dicom_samples()
    f = src / "SC_rgb_rle_2frame.dcm"
    with pytest.raises(DataError, match=r"site-1: entries\[0\]: image .*SC_rgb_rle_2frame.dcm is a multi-frame DICOM \(2 frames\)"):
        load_images([{"image": str(f), "label": 0}], image_size=8, channels=1, site="site-1")


def test_exact_duplicate_images_are_dropped_from_a_pool_with_a_note(tmp_path, capsys):
    """A dataset holding the same picture twice (PneumoniaMNIST has 8 such copies): the copies would land in
    different splits of a federation, which a site then refuses as a leak; the pool keeps the first and says so."""
    from PIL import Image

    for c in ("a", "b"):
        (tmp_path / "ds" / c).mkdir(parents=True)
        for k in range(3):
            Image.fromarray(np.full((8, 8), 40 * k + (c == "b") * 7, np.uint8)).save(tmp_path / "ds" / c / f"{k}.png")
    import shutil

    shutil.copy(tmp_path / "ds" / "a" / "1.png", tmp_path / "ds" / "b" / "copy.png")
    pool = discover(str(tmp_path / "ds"))
    assert len(pool.items) == 6 and "1 exact duplicate image(s) dropped" in capsys.readouterr().out
    assert not any(str(i).endswith("copy.png") for i in pool.items)
