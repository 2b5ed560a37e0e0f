"""Models people can use: checkpoints that rebuild their network, predictions on images and NIfTI cases, and a
one-line error for a file that is not what it claims."""

import json

import nibabel as nib
import numpy as np
import pytest
import torch

from fedmed.cli.main import main
from fedmed.data.images import discover
from fedmed.data.datalists import write_site_datalists
from fedmed.nn.models import build_model
from fedmed.nn.predict import ModelFileError, load_model, predict_images, predict_volume, save_model
from fedmed.nn.train import get_params

CFG = {"task": "classification", "model": {"arch": "resnet9", "width": 8, "norm": "batch"},
       "data": {"image_size": 16, "channels": 1, "n_classes": 10}, "classes": [f"digit {c}" for c in range(10)]}


@pytest.fixture
def images(tmp_path):
    pool = discover("builtin:digits", max_per_class=2)
    write_site_datalists(pool, [np.arange(6)], tmp_path / "d", test_fraction=0.2)
    doc = json.loads((tmp_path / "d" / "site-1.json").read_text())
    return [str(tmp_path / "d" / e["image"]) for e in doc["training"][:3]]


def test_classification_checkpoint_round_trip(tmp_path, images):
    params = get_params(build_model("resnet9", 1, 10, width=8))
    path = save_model(tmp_path / "global.pt", params, CFG, sites=["site-1"])
    net, info = load_model(path)
    assert info["classes"][0] == "digit 0" and info["sites"] == ["site-1"]
    rows = predict_images(path, images)
    assert len(rows) == 3 and rows[0]["prediction"].startswith("digit")
    assert sum(rows[0]["probabilities"].values()) == pytest.approx(1.0, abs=1e-4)
    assert main(["predict", str(path), *images, "--out", str(tmp_path / "p.csv")]) == 0
    header = (tmp_path / "p.csv").read_text().splitlines()[0]
    assert header.startswith("image,prediction,digit 0,digit 1")  # the columns of the bundle's predictions.csv


def test_a_model_file_from_another_architecture_is_a_one_line_error(tmp_path, capsys):
    wide = get_params(build_model("resnet9", 1, 10, width=16))  # weights of a width-16 network ...
    path = save_model(tmp_path / "m.pt", wide, CFG)  # ... in a file that says width 8
    with pytest.raises(ModelFileError, match=r"m.pt: its weights do not fit a resnet9 \(width 8, batch norm\)"):
        load_model(path)
    assert main(["predict", str(path), "x.png"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "m.pt" in err and "do not fit" in err
    torch.save({"weights": 1}, tmp_path / "other.pt")
    with pytest.raises(ModelFileError, match="other.pt: not a fedmed model checkpoint"):
        load_model(tmp_path / "other.pt")


def test_segmentation_prediction_writes_a_label_map(tmp_path):
    from fedmed.data.phantoms import write_phantom_subjects
    from fedmed.nn.seg import seg_model

    root = write_phantom_subjects(tmp_path / "ph", [6], size=24)
    cfg = {"task": "segmentation", "model": {"channels": [4, 8, 16]},
           "data": {"shape": [16, 16, 16], "roi": [16, 16, 16], "in_channels": 2, "modalities": ["FLAIR", "T1c"]}}
    path = save_model(tmp_path / "seg.pt", get_params(seg_model(2, channels=(4, 8, 16))), cfg)
    case = root / "phantom_000"
    out = predict_volume(path, [case / "Flair_phantom.nii.gz", case / "T1c_phantom.nii.gz"], tmp_path / "pred.nii.gz",
                         mask=case / "brainmask.nii.gz")
    lab = np.asarray(nib.load(str(out)).dataobj)
    assert lab.shape == (24, 24, 24) and set(np.unique(lab)) <= {0, 1, 2, 4}
    with pytest.raises(ValueError, match="the model takes 2 modalities \\(FLAIR, T1c\\), got 1"):
        predict_volume(path, [case / "Flair_phantom.nii.gz"], tmp_path / "x.nii.gz")


def test_a_decompression_bomb_is_one_line_naming_the_file_in_predict_and_check_data(tmp_path, capsys):
    """A few hundred bytes whose header says 144 million pixels gave a traceback and named no file."""
    from test_bad_input import bomb_png

    bomb = tmp_path / "bomb.png"
    bomb_png(bomb, 12_000, 12_000)
    path = save_model(tmp_path / "global.pt", get_params(build_model("resnet9", 1, 10, width=8)), CFG)
    assert main(["predict", str(path), str(bomb)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "bomb.png" in err and "max_image_pixels=100000000" in err, err
    (tmp_path / "s.json").write_text(json.dumps({"training": [{"image": "bomb.png", "label": 0}], "validation": [],
                                                 "test": []}))
    assert main(["check-data", str(tmp_path / "s.json"), "--classes", "a", "b"]) == 1
    out = capsys.readouterr().out
    assert "PROBLEM: training: image bomb.png has 12000x12000 pixels, more than this site decodes" in out


def test_a_volume_larger_than_the_sites_limit_is_refused_before_it_is_decoded(tmp_path):
    """A 4 MB NIfTI whose header says 2048 x 2048 x 512 voxels would expand to 8 GB: the size comes from the header."""
    import gzip

    from fedmed.data.images import DataError
    from fedmed.data.nifti import load_volume

    hdr = nib.Nifti1Header()
    hdr.set_data_shape((2048, 2048, 512))
    hdr.set_data_dtype(np.float32)
    f = tmp_path / "huge.nii.gz"
    with gzip.open(f, "wb") as fh:  # the header, then far fewer bytes than it claims
        fh.write(hdr.binaryblock + b"\0" * 4 + b"\0" * 4_000_000)
    assert f.stat().st_size < 100_000
    with pytest.raises(DataError, match=r"huge.nii.gz has 2147483648 voxels, more than this site reads \(its "
                                        r"policy's max_volume_voxels=268435456\)"):
        load_volume(f, "site-1", "T1c image")
