"""A final classifier as a MONAI bundle (fedmed.nn.bundle): written beside every final model of a run, runnable with
``python -m monai.bundle run`` without fedmed, giving the same prediction as ``fedmed predict``."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

pytest.importorskip("fire", reason="python -m monai.bundle needs fire (pip install 'fedmed[bundle]')")


def _run_bundle(bundle: Path, images: list, out: Path, tmp_path: Path):
    """``python -m monai.bundle run`` in a fresh process that cannot import fedmed (a package of that name that refuses
    to load comes first on its path), from another working folder."""
    block = tmp_path / "no_fedmed" / "fedmed"
    block.mkdir(parents=True, exist_ok=True)
    (block / "__init__.py").write_text("raise ImportError('the bundle imported fedmed')\n")
    data = tmp_path / "bundle_inputs"
    data.mkdir(exist_ok=True)
    for f in images:
        (data / Path(f).name).write_bytes(Path(f).read_bytes())
    env = {**os.environ, "PYTHONPATH": str(block.parent)}
    p = subprocess.run([sys.executable, "-m", "monai.bundle", "run", "--config_file",
                        str(bundle / "configs" / "inference.json"), "--meta_file", str(bundle / "configs" / "metadata.json"),
                        "--bundle_root", str(bundle), "--dataset_dir", str(data), "--output_dir", str(out)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    with (out / "predictions.csv").open() as fh:
        return {Path(r["image"]).name: r for r in csv.DictReader(fh)}


def test_a_finished_runs_bundle_runs_without_fedmed_and_predicts_as_fedmed_predict(tmp_path):
    from fedmed.config import load_config
    from fedmed.methods import server_workflow_path
    from fedmed.nn.predict import predict_images
    from fedmed.run.experiment import classes_override, prepare_federation
    from fedmed.run.taskconfig import fedmed_config
    from fedmed.workflows import InProcessFederation, server_workflow

    raw = {"name": "bundled", "dataset": {"path": "builtin:digits", "image_size": 8, "channels": 1, "max_per_class": 12},
           "federation": {"sites": 2, "partition": "iid"}, "model": {"arch": "resnet9", "width": 4},
           "train": {"rounds": 2, "local_epochs": 1, "batch_size": 8}, "privacy": {"k_min": 2}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    exp = load_config(tmp_path / "c.yaml")
    data = prepare_federation(exp, 0, tmp_path / "data")
    exp = load_config(tmp_path / "c.yaml", classes_override(data, exp))
    m = exp.methods[0]
    cfg = fedmed_config(exp, 0, m, exp.site_names())
    fed = InProcessFederation(data, exp.site_names(), tmp_path / "run", log=None)
    assert fed.run(server_workflow(server_workflow_path(type(m)))(exp.train.rounds, cfg, **m.workflow_options(exp, 0))) \
        == "finished"
    models = tmp_path / "run" / "models"
    bundle = models / "global_bundle"
    meta = json.loads((bundle / "configs" / "metadata.json").read_text())
    classes = exp.dataset.classes
    assert meta["network_data_format"]["inputs"]["image"]["num_channels"] == 1
    assert meta["network_data_format"]["inputs"]["image"]["spatial_shape"] == [8, 8]
    assert meta["network_data_format"]["outputs"]["pred"]["channel_def"] == {str(i): c for i, c in enumerate(classes)}
    assert meta["fedmed"]["sites"] == sorted(exp.site_names()) and meta["fedmed"]["workflow"] == "FedAvg"
    assert meta["fedmed"]["network_def"] == "torchscript" and (bundle / "models" / "model.ts").is_file()
    assert (bundle / "models" / "model.pt").is_file()

    test = [str(data / e["image"]) for e in json.loads((data / "site-1.json").read_text())["test"]][:4]
    got = _run_bundle(bundle, test, tmp_path / "bundle_out", tmp_path)
    want = predict_images(models / "global.pt", test)
    assert len(got) == len(want) == len(test)
    for w in want:
        g = got[Path(w["image"]).name]
        assert g["prediction"] == w["prediction"]
        assert [float(g[c]) for c in classes] == pytest.approx([w["probabilities"][c] for c in classes], abs=2e-6)


def test_a_monai_networks_bundle_names_the_network_and_loads_model_pt(tmp_path):
    """A network of monai.networks.nets is the bundle's network_def itself (editable, MONAI's form), with model.pt."""
    import torch
    from PIL import Image

    from fedmed.nn.bundle import export_bundle
    from fedmed.nn.models import model_from_config
    from fedmed.nn.predict import predict_images, save_model

    model = {"arch": "DenseNet121", "args": {"init_features": 8, "growth_rate": 4, "block_config": [2, 2]}}
    net = model_from_config(model, 3, 2, seed=0, modules=("*",))
    cfg = {"task": "classification", "model": model, "classes": ["benign", "malignant"],
           "data": {"channels": 3, "n_classes": 2, "image_size": 32}}
    ck = save_model(tmp_path / "cluster1.pt", {k: v.numpy() for k, v in net.state_dict().items()}, cfg, cluster=1,
                    sites=["hospital-b", "hospital-a"], workflow="FMCL", rounds=3)
    from fedmed.cli.main import main

    assert main(["bundle", str(ck)]) == 0  # fedmed bundle MODEL: beside the checkpoint
    bundle = tmp_path / "cluster1_bundle"
    inference = json.loads((bundle / "configs" / "inference.json").read_text())
    assert inference["network_def"]["_target_"] == "monai.networks.nets.DenseNet121"
    assert inference["network_def"]["in_channels"] == 3 and inference["network_def"]["out_channels"] == 2
    meta = json.loads((bundle / "configs" / "metadata.json").read_text())
    assert meta["fedmed"]["cluster"] == 1 and meta["fedmed"]["sites"] == ["hospital-a", "hospital-b"]
    rng = np.random.default_rng(0)
    images = []
    for i, mode in enumerate(("L", "RGB", "I;16")):  # grayscale, colour and a 16-bit image, each read as in training
        a = rng.integers(0, 255 if mode != "I;16" else 60000, (40, 50) + ((3,) if mode == "RGB" else ()))
        f = tmp_path / f"img{i}.png"
        Image.fromarray(a.astype(np.uint8 if mode != "I;16" else np.uint16)).save(f)
        images.append(str(f))
    got = _run_bundle(bundle, images, tmp_path / "out", tmp_path)
    for w in predict_images(ck, images):
        g = got[Path(w["image"]).name]
        assert g["prediction"] == w["prediction"]
        assert float(g["malignant"]) == pytest.approx(w["probabilities"]["malignant"], abs=2e-6)


def test_a_3d_segmentation_model_is_one_line_saying_it_is_not_exported_yet(tmp_path, capsys):
    from fedmed.nn.bundle import BundleExportError, export_bundle
    from fedmed.nn.models import seg_model_from_config
    from fedmed.nn.predict import save_model

    model = {"arch": "unet", "channels": [4, 8]}
    net = seg_model_from_config(model, 2, seed=0)
    cfg = {"task": "segmentation", "model": model, "data": {"in_channels": 2, "shape": [16, 16, 16], "roi": [16, 16, 16]}}
    ck = save_model(tmp_path / "global.pt", {k: v.numpy() for k, v in net.state_dict().items()}, cfg)
    with pytest.raises(BundleExportError, match=r"^global.pt: a segmentation model; the bundle export writes "
                                                r"classifiers only"):
        export_bundle(ck)
    assert not (tmp_path / "global_bundle").exists()
    from fedmed.cli.main import main

    assert main(["bundle", str(ck)]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "a segmentation model" in err[0]
