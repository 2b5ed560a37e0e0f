"""Models people can use: checkpoints that rebuild their network, predictions on images and NIfTI cases, and a
one-line error for a file that is not what it claims."""

import json

import nibabel as nib
import numpy as np
import pytest
import torch

from fedmed.cli.main import main
from fedmed.data.images import discover, write_site_datalists
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
    assert (tmp_path / "p.csv").read_text().splitlines()[0].startswith("image,prediction,p_digit 0")


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
