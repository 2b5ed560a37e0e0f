"""A final classifier as a MONAI bundle (fedmed.nn.bundle): written beside every final model of a run, runnable with
``python -m monai.bundle run`` without fedmed, giving the same prediction as ``fedmed predict``."""

import csv
import re
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

pytest.importorskip("fire", reason="python -m monai.bundle needs fire (pip install 'fedmed[bundle]')")


def _run_bundle_cases(bundle: Path, dataset_dir: Path, out: Path, tmp_path: Path):
    """``python -m monai.bundle run`` in a fresh process that cannot import fedmed (a package of that name that refuses
    to load comes first on its path), from another working folder."""
    block = tmp_path / "no_fedmed" / "fedmed"
    block.mkdir(parents=True, exist_ok=True)
    (block / "__init__.py").write_text("raise ImportError('the bundle imported fedmed')\n")
    env = {**os.environ, "PYTHONPATH": str(block.parent)}
    p = subprocess.run([sys.executable, "-m", "monai.bundle", "run", "--config_file",
                        str(bundle / "configs" / "inference.json"), "--meta_file", str(bundle / "configs" / "metadata.json"),
                        "--bundle_root", str(bundle), "--dataset_dir", str(dataset_dir), "--output_dir", str(out)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]


def _run_bundle(bundle: Path, images: list, out: Path, tmp_path: Path):
    """The bundle run on copies of ``images`` in a folder of their own; its predictions.csv by file name."""
    data = tmp_path / "bundle_inputs"
    data.mkdir(exist_ok=True)
    for f in images:
        (data / Path(f).name).write_bytes(Path(f).read_bytes())
    _run_bundle_cases(bundle, data, out, tmp_path)
    with (out / "predictions.csv").open() as fh:
        return {Path(r["image"]).name: r for r in csv.DictReader(fh)}


def _fedavg_run(tmp_path: Path, raw: dict):
    """A config's FedAvg run in this process (its models under ``tmp_path/run/models``): (config, datalists, task
    config)."""
    from fedmed.config import load_config
    from fedmed.methods import server_workflow_path
    from fedmed.run.experiment import classes_override, prepare_federation
    from fedmed.run.taskconfig import build_task_config
    from fedmed.workflows import InProcessFederation, server_workflow

    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    exp = load_config(tmp_path / "c.yaml")
    data = prepare_federation(exp, 0, tmp_path / "data")
    exp = load_config(tmp_path / "c.yaml", classes_override(data, exp))
    m = exp.methods[0]
    cfg = build_task_config(exp, 0, m, exp.site_names())
    fed = InProcessFederation(data, exp.site_names(), tmp_path / "run", log=None)
    assert fed.run(server_workflow(server_workflow_path(type(m)))(exp.train.rounds, cfg, **m.workflow_options(exp, 0))) \
        == "finished"
    return exp, data, cfg


def test_a_finished_runs_bundle_runs_without_fedmed_and_predicts_as_fedmed_predict(tmp_path):
    from fedmed.nn.predict import predict_images

    raw = {"name": "bundled", "dataset": {"path": "builtin:digits", "image_size": 8, "channels": 1, "max_per_class": 12},
           "federation": {"sites": 2, "partition": "iid"}, "model": {"arch": "resnet9", "width": 4},
           "train": {"rounds": 2, "local_epochs": 1, "batch_size": 8}, "privacy": {"k_min": 2}}
    exp, data, cfg = _fedavg_run(tmp_path, raw)
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

    model = {"arch": "DenseNet121", "args": {"init_features": 8, "growth_rate": 4, "block_config": [2, 2]},
             "preprocessing": [{"name": "ScaleIntensityRangePercentiles",
                                "args": {"lower": 5, "upper": 95, "b_min": -1.0, "b_max": 1.0, "clip": True}}]}
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
    # the sites' preprocessing (a bundle's, model.preprocessing) in place of fedmed's own [-1, 1] scaling
    assert inference["preprocessing"]["transforms"][-1] == {
        "_target_": "ScaleIntensityRangePercentilesd", "keys": "image", "lower": 5, "upper": 95, "b_min": -1.0,
        "b_max": 1.0, "clip": True}
    assert not any(t["_target_"] == "NormalizeIntensityd" for t in inference["preprocessing"]["transforms"])
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
    # fedmed predict's CSV and the bundle's predictions.csv: the same columns (the class names)
    assert main(["predict", str(ck), *images, "--out", str(tmp_path / "fedmed.csv")]) == 0
    with open(tmp_path / "fedmed.csv") as a, open(tmp_path / "out" / "predictions.csv") as b:
        assert next(csv.reader(a)) == next(csv.reader(b)) == ["image", "prediction", "benign", "malignant"]
    for w in predict_images(ck, images):
        g = got[Path(w["image"]).name]
        assert g["prediction"] == w["prediction"]
        assert float(g["malignant"]) == pytest.approx(w["probabilities"]["malignant"], abs=2e-6)


def test_a_model_that_is_no_classifier_or_3d_segmenter_is_one_line_saying_so(tmp_path, capsys):
    """A Fed-MAE encoder checkpoint is not a model a bundle serves: one line, no bundle folder."""
    from fedmed.nn.bundle import BundleExportError, export_bundle
    from fedmed.nn.mae import mae_model
    from fedmed.nn.predict import save_model

    net = mae_model(1)
    cfg = {"task": "mae", "model": {"arch": "vit_small"}, "data": {"channels": 1, "image_size": 32}}
    ck = save_model(tmp_path / "global.pt", {k: v.numpy() for k, v in net.state_dict().items()}, cfg)
    with pytest.raises(BundleExportError, match=r"^global.pt: a mae model; the bundle export writes classifiers and "
                                                r"3D segmentation models$"):
        export_bundle(ck)
    assert not (tmp_path / "global_bundle").exists()
    from fedmed.cli.main import main

    assert main(["bundle", str(ck)]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "a mae model" in err[0]


def test_job_text_never_becomes_a_live_expression_in_the_exported_bundle(tmp_path):
    """A job's class names, site names and model arguments go into the exported bundle's configs, which
    ``monai.bundle run`` parses as code: a string MONAI would evaluate, follow or expand is refused before anything is
    written (a class named ``$...`` would run where the hospital runs the bundle)."""
    from fedmed.nn.bundle import BundleExportError, export_bundle
    from fedmed.nn.models import model_from_config
    from fedmed.nn.predict import save_model

    marker = tmp_path / "MARKER"
    run = f"$__import__('pathlib').Path({str(marker)!r}).touch() or 'benign'"
    model = {"arch": "resnet9", "width": 4}
    params = {k: v.numpy() for k, v in model_from_config(model, 1, 2, seed=0).state_dict().items()}
    cases = [({"classes": [run, "malignant"]}, {}, "classes[0]"),
             ({"classes": ["benign", "@network_def"]}, {}, "classes[1]"),
             ({"classes": ["benign", "malignant"]}, {"sites": ["%/etc/passwd", "b"]}, "sites[0]"),
             ({"classes": ["benign", "malignant"]}, {"workflow": "$os.system('x')"}, "workflow")]
    for i, (extra, kw, at) in enumerate(cases):
        cfg = {"task": "classification", "model": model, "data": {"channels": 1, "n_classes": 2, "image_size": 8},
               **extra}
        ck = save_model(tmp_path / f"m{i}.pt", params, cfg, **kw)
        with pytest.raises(BundleExportError, match=re.escape(f"m{i}.pt: {at} = ") + ".* would be a live expression"):
            export_bundle(ck)
        assert not (tmp_path / f"m{i}_bundle").exists()
    assert not marker.exists()


# ------------------------------------------------------------------------------------------------ a bundle brought in
def _bundle(root: Path, *, in_channels=1, classes=2, size=16, loss="CrossEntropyLoss", weights_seed=0, extra=()):
    """A small 2D classification bundle as MONAI's tools read it: a DenseNet121 network_def whose channels are
    references, metadata.json, a train.json with its loss, and models/model.pt."""
    import torch
    from monai.bundle import ConfigParser
    from monai.networks.nets import DenseNet121

    (root / "configs").mkdir(parents=True)
    (root / "models").mkdir()
    net_def = {"_target_": "monai.networks.nets.DenseNet121", "spatial_dims": 2, "in_channels": "@num_channels",
               "out_channels": "@num_classes", "init_features": 8, "growth_rate": 4, "block_config": [2, 2]}
    # its preprocessing as such bundles have it: loading and channels (fedmed's reading does these) and a per-image
    # z-score (the sites apply it); ``extra``: more steps
    pre = [{"_target_": "LoadImaged", "keys": "@image_key"}, {"_target_": "EnsureChannelFirstd", "keys": "@image_key"},
           {"_target_": "NormalizeIntensityd", "keys": "@image_key", "channel_wise": True}] + list(extra)
    inference = {"imports": ["$import torch"], "bundle_root": ".", "num_channels": in_channels, "num_classes": classes,
                 "image_key": "image", "network_def": net_def, "network": "$@network_def.to('cpu')",
                 "preprocessing": {"_target_": "Compose", "transforms": pre}}
    (root / "configs" / "inference.json").write_text(json.dumps(inference))
    (root / "configs" / "train.json").write_text(json.dumps({"loss": {"_target_": f"torch.nn.{loss}"}}))
    meta = {"version": "0.1.0", "name": "small classifier", "network_data_format": {
        "inputs": {"image": {"type": "image", "num_channels": in_channels, "spatial_shape": [size, size]}},
        "outputs": {"pred": {"type": "probabilities", "format": "classes", "num_channels": classes}}}}
    (root / "configs" / "metadata.json").write_text(json.dumps(meta))
    parser = ConfigParser()
    parser.read_config(str(root / "configs" / "inference.json"))
    torch.manual_seed(weights_seed)
    net = parser.get_parsed_content("network_def")
    assert isinstance(net, DenseNet121)
    torch.save(net.state_dict(), root / "models" / "model.pt")
    return root


def _cfg(tmp_path, bundle, **dataset):
    raw = {"name": "from-bundle", "dataset": {"path": "builtin:digits", "image_size": 16, "channels": 1,
                                              "max_per_class": 20, "classes": [str(i) for i in range(10)], **dataset},
           "federation": {"sites": 3, "partition": "iid"}, "model": {"bundle": str(bundle)},
           "train": {"rounds": 6, "local_epochs": 4, "batch_size": 8, "lr": 0.003}, "privacy": {"k_min": 2},
           "methods": [{"name": "FedAvg"}, {"name": "FMCL", "workflow": "fmcl", "encoder": "random_cnn",
                                             "n_clusters": 2}], "references": []}
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(raw))
    return p


def test_a_bundle_whose_inputs_or_outputs_do_not_fit_is_one_line_when_the_config_is_read(tmp_path):
    from fedmed.config import ConfigError, load_config

    cases = [(dict(in_channels=3, classes=10), "its input has 3 channel(s) (metadata.json), the federation's images 1"),
             (dict(classes=5), "its output has 5 channel(s) (metadata.json), the federation 10 classes"),
             (dict(classes=10, size=32), "its input is 32x32 (metadata.json), the federation trains at 16x16"),
             (dict(classes=10, loss="MSELoss"), "its loss MSELoss is not one fedmed trains a classifier with")]
    for i, (kw, msg) in enumerate(cases):
        b = _bundle(tmp_path / f"b{i}", **kw)
        with pytest.raises(ConfigError, match=re.escape(f"model.bundle b{i}: {msg}")):
            load_config(_cfg(tmp_path, b))
    steps = [({"_target_": "RandFlipd", "keys": "image", "prob": 0.5},
              "its preprocessing step RandFlipd (inference.json) is not one fedmed's sites apply"),
             ({"_target_": "ScaleIntensityRanged", "keys": "image", "a_min": 0, "a_max": 255, "b_min": 0, "b_max": 1},
              "its preprocessing ScaleIntensityRange {'a_min': 0, 'a_max': 255, 'b_min': 0, 'b_max': 1} is in the "
              "image file's intensity units")]
    for i, (step, msg) in enumerate(steps):
        b = _bundle(tmp_path / f"p{i}", classes=10, extra=[step])
        with pytest.raises(ConfigError, match=re.escape(f"model.bundle p{i}: {msg}")):
            load_config(_cfg(tmp_path, b))
    raw = yaml.safe_load(_cfg(tmp_path, _bundle(tmp_path / "ok", classes=10)).read_text())
    raw["model"]["arch"] = "resnet9"  # a shipped config names its network; --set model.bundle=... came on top
    with pytest.raises(ConfigError, match=re.escape("model.bundle: the bundle names the network, its weights and its "
                                                    "preprocessing; drop model.arch from the config (on the command "
                                                    "line: --set model.arch=null)")):
        load_config(raw)
    assert load_config(raw, ["model.arch=null"]).model.arch != "resnet9"  # the advice, followed, works


def _edit(bundle: Path, file: str, f):
    p = bundle / "configs" / file
    d = json.loads(p.read_text())
    f(d)
    p.write_text(json.dumps(d))


def test_a_bundle_is_read_as_data_no_expression_macro_or_reference_to_one_runs(tmp_path):
    """A bundle is code to MONAI (``$`` expressions, ``%`` macros, ``@`` references to expressions) and data to
    fedmed: whatever fedmed reads of it — network_def arguments, the items they reference, preprocessing arguments and
    keys in inference.json and train.json#validate#preprocessing — is refused in one line naming the key, and nothing
    runs (a marker file proves it)."""
    from fedmed.config import ConfigError, load_config

    marker = tmp_path / "MARKER"
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"key": 7}))
    run = f"$__import__('pathlib').Path({str(marker)!r}).touch() or 8"
    net = lambda k, v: lambda d: d["network_def"].__setitem__(k, v)  # noqa: E731
    cases = [
        ("inference.json", net("init_features", run), "network_def#init_features is a Python expression"),
        ("inference.json", net("init_features", f"%{secret}#key"), "network_def#init_features is a macro"),
        ("inference.json", net("init_features", f"$open({str(secret)!r}).read()"),
         "network_def#init_features is a Python expression"),
        # a reference to an expression: the referenced item runs in MONAI's parser
        ("inference.json", lambda d: d.update(num_channels=run),
         "network_def#in_channels (@num_channels) is a Python expression"),
        ("inference.json", lambda d: d["network_def"].__setitem__("block_config", [2, run]),
         "network_def#block_config#1 is a Python expression"),
        ("inference.json", lambda d: d["preprocessing"]["transforms"][2].__setitem__("channel_wise", run),
         "preprocessing#transforms#2#channel_wise is a Python expression"),
        ("inference.json", lambda d: d["preprocessing"]["transforms"][2].__setitem__("keys", run),
         "preprocessing#transforms#2#keys is a Python expression"),
        ("inference.json", lambda d: d.update(image_key=run),
         "preprocessing#transforms#2#keys (@image_key) is a Python expression"),
        ("inference.json", lambda d: d.update(network_def=f"%{secret}#net"), "network_def is a macro"),
    ]
    for i, (file, edit, msg) in enumerate(cases):
        b = _bundle(tmp_path / f"x{i}", classes=10)
        _edit(b, file, edit)
        with pytest.raises(ConfigError, match=re.escape(f"model.bundle x{i} ({file}): {msg}")):
            load_config(_cfg(tmp_path, b))
    # train.json's validate#preprocessing (read when inference.json has no preprocessing)
    b = _bundle(tmp_path / "t", classes=10)
    inf = json.loads((b / "configs" / "inference.json").read_text())
    pre = inf.pop("preprocessing")
    pre["transforms"][2]["channel_wise"] = run
    (b / "configs" / "inference.json").write_text(json.dumps(inf))
    _edit(b, "train.json", lambda d: d.update(image_key="image", validate={"preprocessing": pre}))
    with pytest.raises(ConfigError, match=re.escape("model.bundle t (train.json): validate#preprocessing#transforms#2"
                                                    "#channel_wise is a Python expression")):
        load_config(_cfg(tmp_path, b))
    assert not marker.exists(), "a bundle's expression ran"
    # the plain form still reads: references to plain values resolved
    cfg = load_config(_cfg(tmp_path, _bundle(tmp_path / "plain", classes=10)))
    assert cfg.model.args["in_channels"] == 1 and cfg.model.args["out_channels"] == 10
    assert cfg.model.preprocessing == [{"name": "NormalizeIntensity", "args": {"channel_wise": True}}]


def test_a_bundles_files_are_regular_files_inside_it_and_model_pt_is_a_state_dict(tmp_path):
    """A ``models/model.pt`` (or a config) that is a symbolic link would ship any file of the coordinator's machine
    into the job; a model.pt that is no state dict (a pickle, a text file) is refused before anything is shipped."""
    import pickle

    from fedmed.config import ConfigError, load_config

    outside = tmp_path / "private.txt"
    outside.write_text("patient list")
    b = _bundle(tmp_path / "link", classes=10)
    (b / "models" / "model.pt").unlink()
    (b / "models" / "model.pt").symlink_to(outside)
    with pytest.raises(ConfigError, match=re.escape("model.bundle link: models/model.pt is a symbolic link; a "
                                                    "bundle's files must be regular files inside its folder")):
        load_config(_cfg(tmp_path, b))
    b = _bundle(tmp_path / "clink", classes=10)
    real = tmp_path / "elsewhere.json"
    (b / "configs" / "inference.json").rename(real)
    (b / "configs" / "inference.json").symlink_to(real)
    with pytest.raises(ConfigError, match=re.escape("model.bundle clink: configs/inference.json is a symbolic link")):
        load_config(_cfg(tmp_path, b))
    marker = tmp_path / "PICKLED"

    class Boom:
        def __reduce__(self):
            return (Path.touch, (marker,))

    for name, write in (("pickle", lambda f: f.write_bytes(pickle.dumps({"w": Boom()}))),
                        ("text", lambda f: f.write_text("not weights")),
                        ("empty", lambda f: __import__("torch").save({}, f))):
        b = _bundle(tmp_path / name, classes=10)
        write(b / "models" / "model.pt")
        with pytest.raises(ConfigError, match=re.escape(f"model.bundle {name}: models/model.pt ")):
            load_config(_cfg(tmp_path, b))
    assert not marker.exists()


@pytest.mark.slow
def test_a_bundle_is_the_sites_model_in_fedavg_and_fmcl_in_the_simulator(tmp_path):
    """The bundle's DenseNet121 (its references resolved) and its weights are what every site trains: FedAvg and FMCL
    learn the digits in FLARE's simulator, starting from the bundle's model.pt (round 0 scores it at every site)."""
    import torch

    from fedmed.cli.main import main
    from fedmed.config import load_config
    from fedmed.nn.predict import load_model

    b = _bundle(tmp_path / "bundle", classes=10)
    cfg = _cfg(tmp_path, b)
    exp = load_config(cfg)
    assert exp.model.arch == "DenseNet121" and exp.model.args["in_channels"] == 1 and exp.model.args["out_channels"] == 10
    assert exp.model.init_weights == str(b / "models" / "model.pt")
    assert main(["experiment", str(cfg), "--out", str(tmp_path / "out")]) == 0
    for method in ("FedAvg", "FMCL"):
        doc = json.loads((tmp_path / "out" / "runs" / "seed0" / method / "metrics.json").read_text())
        assert doc["status"] == "finished"
        acc = [r["summary"]["pooled"]["accuracy"] for r in doc["rounds"]]
        assert acc[-1] > max(0.3, acc[0] + 0.1), acc  # learns (chance 0.1) from the bundle's start
        models = sorted((tmp_path / "out" / "runs" / "seed0" / method / "server" / "models").glob("*.pt"))
        net, ck = load_model(models[0])
        assert type(net).__name__ == "DenseNet121" and ck["model"]["arch"] == "DenseNet121"
        assert ck["model"]["preprocessing"] == [{"name": "NormalizeIntensity", "args": {"channel_wise": True}}]
    # round 0 scores the model every site was sent before training: the bundle's network with its model.pt, on each
    # image as fedmed reads it ([0, 1]) put through the bundle's own z-score step, as MONAI builds it from the bundle
    from monai.bundle import ConfigParser

    from fedmed.data.images import load_images

    parser = ConfigParser()
    parser.read_config(str(b / "configs" / "inference.json"))
    start = parser.get_parsed_content("network_def").eval()
    start.load_state_dict(torch.load(b / "models" / "model.pt", weights_only=True))
    zscore = parser.get_parsed_content("preprocessing#transforms#2")
    assert type(zscore).__name__ == "NormalizeIntensityd"
    data = tmp_path / "out" / "data" / "seed0"
    doc = json.loads((tmp_path / "out" / "runs" / "seed0" / "FedAvg" / "metrics.json").read_text())
    from fedmed.algorithms.metrics import site_metrics

    unscaled = []
    for site, entry in doc["rounds"][0]["sites"].items():
        test = json.loads((data / f"{site}.json").read_text())["test"]
        x, y = load_images([{**e, "image": str(data / e["image"])} for e in test], image_size=16, channels=1)
        with torch.no_grad():
            z = torch.stack([torch.as_tensor(zscore({"image": xi})["image"]) for xi in x])
            prob = torch.softmax(start(z), 1).numpy()
            unscaled.append(site_metrics(y.numpy(), torch.softmax(start((x - 0.5) / 0.5), 1).numpy(), 10)["auc"])
        assert entry["accuracy"] == pytest.approx(float((prob.argmax(1) == y.numpy()).mean()))
        assert entry["auc"] == pytest.approx(site_metrics(y.numpy(), prob, 10)["auc"])
    # without the bundle's step (fedmed's own scaling alone) the start scores otherwise
    assert unscaled != pytest.approx([doc["rounds"][0]["sites"][s]["auc"] for s in doc["rounds"][0]["sites"]])


def _seg_bundle(root: Path, *, in_channels=2, roi=16, loss="DiceLoss", channels=(8, 16, 32)):
    import torch
    from monai.bundle import ConfigParser

    (root / "configs").mkdir(parents=True)
    (root / "models").mkdir()
    net_def = {"_target_": "UNet", "spatial_dims": 3, "in_channels": in_channels, "out_channels": 3,
               "channels": list(channels), "strides": [2] * (len(channels) - 1), "num_res_units": 1}
    # validation preprocessing as MONAI's brain-tumour bundles have it: loading, channels, orientation, spacing
    # (fedmed's reading does these) and a z-score over the brain of each modality (the sites apply it)
    keys = ["image", "label"]
    pre = [{"_target_": "LoadImaged", "keys": keys}, {"_target_": "EnsureChannelFirstd", "keys": keys},
           {"_target_": "Orientationd", "keys": keys, "axcodes": "RAS"},
           {"_target_": "Spacingd", "keys": keys, "pixdim": [1.0, 1.0, 1.0], "mode": ["bilinear", "nearest"]},
           {"_target_": "NormalizeIntensityd", "keys": "image", "nonzero": True, "channel_wise": True}]
    (root / "configs" / "train.json").write_text(json.dumps({"network_def": net_def,
                                                             "loss": {"_target_": f"monai.losses.{loss}"},
                                                             "validate": {"preprocessing": {
                                                                 "_target_": "Compose", "transforms": pre}}}))
    meta = {"version": "0.1.0", "name": "small brain-tumour segmenter", "network_data_format": {
        "inputs": {"image": {"type": "image", "num_channels": in_channels, "spatial_shape": [roi] * 3}},
        "outputs": {"pred": {"type": "image", "format": "segmentation", "num_channels": 3}}}}
    (root / "configs" / "metadata.json").write_text(json.dumps(meta))
    parser = ConfigParser()
    parser.read_config(str(root / "configs" / "train.json"))
    torch.manual_seed(0)
    torch.save(parser.get_parsed_content("network_def").state_dict(), root / "models" / "model.pt")
    return root


def test_a_3d_segmentation_bundles_loss_becomes_train_seg_loss_and_a_bundle_for_other_modalities_is_one_line(tmp_path):
    """A 3D U-Net bundle (train.json's network_def and DiceLoss): the sites' network is MONAI's UNet and their loss the
    bundle's, also when the config sets other train.seg settings; a config's own loss wins; a bundle for another number
    of modalities is one line. (Training it: the BraTS simulator test below.)"""
    from fedmed.config import ConfigError, load_config
    from fedmed.data.phantoms import write_phantom_subjects

    root = tmp_path / "phantoms"
    write_phantom_subjects(root, [2, 3, 3, 4], size=16)
    raw = {"name": "seg-bundle", "dataset": {"path": str(root), "task": "segmentation",
                                             "modalities": {"FLAIR": "Flair*", "T1c": "T1c*"},
                                             "label_pattern": "OTMultiClass*", "mask_pattern": "brainmask*",
                                             "shape": [16, 16, 16], "roi": [16, 16, 16]},
           "federation": {"sites": 2, "partition": "iid", "test_fraction": 0.25},
           "model": {"bundle": str(_seg_bundle(tmp_path / "bundle"))},
           "train": {"rounds": 1, "seg": {"patches_per_volume": 2}}, "privacy": {"k_min": 1, "accept_k_min_below_2": True},
           "methods": [{"name": "FedAvg"}], "references": []}
    exp = load_config(raw)
    assert exp.model.arch == "UNet" and exp.model.args["channels"] == [8, 16, 32]
    assert exp.model.preprocessing == [{"name": "NormalizeIntensity", "args": {"nonzero": True, "channel_wise": True}}]
    assert exp.train.seg.loss == "dice" and exp.train.seg.patches_per_volume == 2  # the bundle's DiceLoss
    assert load_config({**raw, "train": {"seg": {"loss": "dice_focal"}}}).train.seg.loss == "dice_focal"
    # a site applies the bundle's z-score to each whole case it reads (not to patches); the assessment sees the raw case
    from fedmed.methods import FedAvgMethod
    from fedmed.run.experiment import prepare_federation
    from fedmed.run.taskconfig import build_task_config
    from fedmed.site.seg import SegSiteRunner

    data = prepare_federation(exp, 0, tmp_path / "data")
    cfg = build_task_config(exp, 0, FedAvgMethod(name="FedAvg"), exp.site_names())
    assert cfg["model"]["preprocessing"] == exp.model.preprocessing
    runner = SegSiteRunner("site-1", data)
    (tr, _), (raw_tr, _) = runner.cases(cfg), runner.cases(cfg, raw=True)
    assert len(tr) == len(raw_tr) and not np.allclose(tr[0]["image"], raw_tr[0]["image"])
    for ch_raw, ch in zip(raw_tr[0]["image"], tr[0]["image"]):
        nz = ch_raw != 0
        assert np.allclose(ch[nz], (ch_raw[nz] - ch_raw[nz].mean()) / ch_raw[nz].std(), atol=1e-4)
        assert np.all(ch[~nz] == 0)
    with pytest.raises(ConfigError, match=re.escape("model.bundle b4: its input has 4 channel(s) (metadata.json), the "
                                                    "federation's images 2")):
        load_config({**raw, "model": {"bundle": str(_seg_bundle(tmp_path / "b4", in_channels=4))}})

BRATS = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "brats2013"


@pytest.mark.slow
@pytest.mark.skipif(not BRATS.is_dir(), reason="BraTS-2013 subjects not in ../shared/data (see its README)")
def test_a_3d_segmentation_bundle_trains_in_the_simulator_and_its_exported_bundle_segments_as_fedmed_predict(tmp_path):
    """A 3D U-Net bundle (train.json's network_def and DiceLoss) federated over the six real BraTS-2013 subjects in
    FLARE's simulator: FedAvg and the 004_ two-cluster workflow train MONAI's UNet from the bundle's model.pt with its
    loss, and the Dice rises. Each final model is written back as a bundle whose ``python -m monai.bundle run``, without
    fedmed, writes the same label map as ``fedmed predict`` for a test subject, voxel for voxel."""
    import nibabel as nib

    from fedmed.cli.main import main
    from fedmed.config import load_config
    from fedmed.nn.predict import predict_volume

    bundle = _seg_bundle(tmp_path / "bundle", roi=16, channels=[4, 8, 16])
    raw = {"name": "seg-bundle-brats", "dataset": {"path": str(BRATS), "task": "segmentation",
                                                   "modalities": {"FLAIR": "Flair*.nii*", "T1c": "T1c*.nii*"},
                                                   "label_pattern": "OTMultiClass*.nii*",
                                                   "mask_pattern": "brainmask*.nii*", "hemispheres": True,
                                                   "shape": [16, 40, 32], "roi": [16, 16, 16]},
           "federation": {"sites": 4, "partition": "label_volume", "volume_region": "WT", "test_fraction": 0.34,
                          "val_fraction": 0.0},
           "model": {"bundle": str(bundle)},
           "train": {"rounds": 4, "local_epochs": 10, "optimizer": "adam", "lr": 0.01,
                     "seg": {"patches_per_volume": 4, "pos_fraction": 0.5}},
           "privacy": {"k_min": 1, "accept_k_min_below_2": True}, "references": [], "seeds": [0],
           "methods": [{"name": "FedAvg"}, {"name": "2-cluster", "workflow": "seg_clusters"}]}
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    exp = load_config(cfg)
    assert exp.model.arch == "UNet" and exp.train.seg.loss == "dice"
    assert main(["experiment", str(cfg), "--out", str(tmp_path / "out")]) == 0
    runs = tmp_path / "out" / "runs" / "seed0"
    for method in ("FedAvg", "2_cluster"):  # a run's folder: its method's name, made safe for a path
        doc = json.loads((runs / method / "metrics.json").read_text())
        assert doc["status"] == "finished"
        dice = [r["summary"]["mean"]["dice_mean"] for r in doc["rounds"] if "dice_mean" in r["summary"]["mean"]]
        assert dice[-1] > max(2 * dice[0], dice[0] + 0.05), (method, dice)  # measured 2.9% -> 10.3% (FedAvg)
    models = runs / "2_cluster" / "server" / "models"
    assert sorted(p.name for p in models.glob("cluster*_bundle")) == ["cluster0_bundle", "cluster1_bundle"]
    models = runs / "FedAvg" / "server" / "models"
    b = models / "global_bundle"
    meta = json.loads((b / "configs" / "metadata.json").read_text())
    assert meta["network_data_format"]["inputs"]["image"]["channel_def"] == {"0": "FLAIR", "1": "T1c"}
    assert meta["network_data_format"]["outputs"]["pred"]["num_channels"] == 3
    inference = json.loads((b / "configs" / "inference.json").read_text())
    assert inference["network_def"]["_target_"] == "monai.networks.nets.UNet"
    assert inference["inferer"] == {"_target_": "SlidingWindowInferer", "roi_size": [16, 16, 16], "sw_batch_size": 4,
                                    "overlap": 0.25}
    # the bundle's z-score, which the sites applied, after fedmed's reading of the case
    assert inference["preprocessing"]["transforms"][1:] == [
        {"_target_": "NormalizeIntensityd", "keys": "image", "nonzero": True, "channel_wise": True}]
    case = sorted((BRATS / "brats2015TrainingData" / "test").iterdir())[0]
    files = [str(next(case.glob(p))) for p in ("Flair*.nii*", "T1c*.nii*")]
    want = predict_volume(models / "global.pt", files, tmp_path / "predict.nii.gz",
                          mask=str(next(case.glob("brainmask*.nii*"))))
    out = tmp_path / "bundle_out"
    _run_bundle_cases(b, case, out, tmp_path)
    got = out / f"{case.name}_seg.nii.gz"
    a, g = nib.load(str(want)), nib.load(str(got))
    assert np.array_equal(np.asarray(a.dataobj), np.asarray(g.dataobj))
    assert np.allclose(a.affine, g.affine)
    assert set(np.unique(np.asarray(g.dataobj)).tolist()) <= {0, 1, 2, 4} and np.asarray(g.dataobj).any()


def test_a_2d_lesion_segmentation_bundle_learns_with_fedavg_and_the_two_clusters(tmp_path):
    """A 2D U-Net bundle (MONAI's UNet, DiceLoss, a min-max intensity step) over three ultrasound-like sources, in
    process: FedAvg and the 004_ two-cluster workflow train the bundle's network from its weights, with its loss and
    its preprocessing at the sites, and the lesion Dice rises well above the bundle's start."""
    import torch
    from monai.bundle import ConfigParser

    from fedmed.config import load_config
    from fedmed.run.experiment import prepare_federation, with_classes
    from fedmed.run.jobspec import job_spec, run_spec_in_process
    from test_seg2d import _index

    root = tmp_path / "bundle"
    (root / "configs").mkdir(parents=True)
    (root / "models").mkdir()
    net_def = {"_target_": "monai.networks.nets.UNet", "spatial_dims": 2, "in_channels": 1, "out_channels": 1,
               "channels": [8, 16, 32], "strides": [2, 2], "num_res_units": 1}
    pre = [{"_target_": "LoadImaged", "keys": ["image", "label"]},
           {"_target_": "EnsureChannelFirstd", "keys": ["image", "label"]},
           {"_target_": "ScaleIntensityd", "keys": "image", "minv": 0.0, "maxv": 1.0}]
    (root / "configs" / "inference.json").write_text(json.dumps(
        {"network_def": net_def, "preprocessing": {"_target_": "Compose", "transforms": pre}}))
    (root / "configs" / "train.json").write_text(json.dumps({"loss": {"_target_": "DiceLoss", "sigmoid": True}}))
    (root / "configs" / "metadata.json").write_text(json.dumps({"version": "0.1.0", "network_data_format": {
        "inputs": {"image": {"type": "image", "num_channels": 1, "spatial_shape": [32, 32]}},
        "outputs": {"pred": {"type": "image", "format": "segmentation", "num_channels": 1}}}}))
    parser = ConfigParser()
    parser.read_config(str(root / "configs" / "inference.json"))
    torch.manual_seed(0)
    torch.save(parser.get_parsed_content("network_def").state_dict(), root / "models" / "model.pt")
    raw = {"name": "seg2d-bundle", "dataset": {"task": "segmentation", "image_size": 32, "channels": 1,
                                               "sources": [{"path": str(_index(tmp_path)), "mask_column": "mask"}]},
           "federation": {"partition": "natural", "test_fraction": 0.25, "val_fraction": 0.2},
           "model": {"bundle": str(root)},
           "train": {"rounds": 5, "local_epochs": 4, "batch_size": 4, "lr": 0.01, "weight_decay": 0.0},
           "privacy": {"k_min": 2}, "seeds": [0],
           "methods": [{"name": "FedAvg", "workflow": "fedavg"}, {"name": "2-cluster", "workflow": "seg_clusters"}]}
    exp = load_config(raw)
    assert exp.model.arch == "UNet" and exp.train.seg.loss == "dice"
    assert exp.model.preprocessing == [{"name": "ScaleIntensity", "args": {"minv": 0.0, "maxv": 1.0}}]
    data = prepare_federation(exp, 0, tmp_path / "fed")
    exp = with_classes(exp, data)
    for m in exp.methods:
        status, fed = run_spec_in_process(job_spec(exp, m, 0), data, tmp_path / m.name)
        assert status == "finished", m.name
        dice = [r["summary"]["mean"]["dice_mean"] for r in fed.recorder.doc["rounds"]
                if "dice_mean" in r["summary"]["mean"]]
        assert dice[-1] > 0.5 and dice[-1] > dice[0] + 0.3, (m.name, dice)


def test_the_minimal_bundle_privacy_md_shows_is_read_and_an_expression_in_it_is_refused(tmp_path):
    """docs/privacy.md's minimal ``configs/inference.json``, as written: fedmed reads its network (the reference
    resolved) and preprocessing, and never evaluates its ``$`` items; the same file with an expression where fedmed
    reads is refused naming the key."""
    from fedmed.nn.bundle import BundleExportError
    from fedmed.nn.bundle_read import read_bundle
    from conftest import doc_json

    inference = doc_json("privacy.md", "`configs/inference.json`:")
    root = tmp_path / "minimal"
    (root / "configs").mkdir(parents=True)
    (root / "configs" / "inference.json").write_text(json.dumps(inference))
    (root / "configs" / "metadata.json").write_text(json.dumps({"name": "minimal", "network_data_format": {}}))
    b = read_bundle(root)
    assert b["arch"] == "DenseNet121" and b["args"]["out_channels"] == 2 and b["init_weights"] is None
    assert b["preprocessing"] == [{"name": "NormalizeIntensity", "args": {"channel_wise": True}}]
    inference["num_classes"] = "$__import__('os').getpid() % 2 + 2"
    (root / "configs" / "inference.json").write_text(json.dumps(inference))
    with pytest.raises(BundleExportError, match=re.escape("model.bundle minimal (inference.json): network_def#"
                                                          "out_channels (@num_classes) is a Python expression")):
        read_bundle(root)


def test_a_bundle_comes_into_every_shipped_classification_config_with_one_documented_option(tmp_path):
    """Each shipped classification config names its own network; `--set model.bundle=DIR --set model.arch=null`
    (docs/recipes.md) replaces it with the bundle's — the config's other settings kept."""
    from fedmed.config import ConfigError, load_config

    root = Path(__file__).resolve().parents[1]
    text = (root / "docs" / "recipes.md").read_text()
    assert "--set model.bundle=DIR --set model.arch=null" in text
    done = 0
    for cfg in sorted((root / "app_configs").glob("*.yaml")):
        try:
            exp = load_config(cfg)
        except ConfigError as e:  # a config whose data is not here (skipped below) or that needs a weights file
            if "does not exist" in str(e) or "not found" in str(e):
                continue
            raise
        if exp.dataset.task != "classification":
            continue
        d = exp.dataset
        b = _bundle(tmp_path / cfg.stem, in_channels=d.channels, classes=len(d.classes or [0, 1]), size=d.image_size)
        try:  # a config that names its network is refused with the way out; one that leaves it default is not
            load_config(cfg, [f"model.bundle={b}"])
        except ConfigError as e:
            assert "--set model.arch=null" in str(e) or "Flux describes" in str(e), str(e)
        if any(m.workflow == "flux" for m in exp.methods):  # Flux reads fedmed's own networks' latents: said so
            with pytest.raises(ConfigError, match="Flux describes a site by the latents of fedmed's networks"):
                load_config(cfg, [f"model.bundle={b}", "model.arch=null"])
            done += 1
            continue
        got = load_config(cfg, [f"model.bundle={b}", "model.arch=null"])
        assert got.model.arch == "DenseNet121" and got.model.init_weights and got.train == exp.train, cfg.name
        assert got.federation == exp.federation and [m.name for m in got.methods] == [m.name for m in exp.methods]
        done += 1
    assert done >= 10


def test_exporting_a_bundle_of_fedmeds_own_network_does_not_import_monai(tmp_path):
    """Every run ends by exporting its models as bundles; for fedmed's own networks (TorchScript) that needs nothing of
    MONAI, whose import took ~9 s of every run's end (a 1-round simulator job: 19 s, 10 s of it that import). The
    metadata still names the installed MONAI version, read from the package's metadata."""
    import subprocess
    import sys
    from importlib.metadata import version

    import torch

    from fedmed.nn.models import build_model

    ck = tmp_path / "global.pt"
    torch.save({"format": "fedmed-model-1", "task": "classification", "state_dict": build_model("resnet9", 1, 3,
               width=4).state_dict(), "model": {"arch": "resnet9", "width": 4},
               "data": {"image_size": 8, "channels": 1, "n_classes": 3}, "classes": ["a", "b", "c"], "seed": 0,
               "cluster": None, "sites": ["site-1"], "workflow": "FedAvg", "rounds": 1}, ck)
    code = ("import sys, json; from fedmed.nn.bundle import export_bundle; b = export_bundle(sys.argv[1]); "
            "print(json.dumps(['monai' in sys.modules, str(b)]))")
    p = subprocess.run([sys.executable, "-c", code, str(ck)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    imported, bundle = json.loads(p.stdout.splitlines()[-1])
    assert imported is False
    meta = json.loads((Path(bundle) / "configs" / "metadata.json").read_text())
    assert meta["monai_version"] == version("monai") and meta["fedmed"]["network_def"] == "torchscript"


def test_fedmeds_resnet18_is_bundled_as_torchscript_not_as_monais_resnet18(tmp_path):
    """fedmed's ResNet-18 wraps MONAI's (its weights are ``net.*``): the export named it by its arch alone — found in
    monai.networks.nets — as ``monai.networks.nets.resnet18`` loading model.pt, whose keys that network does not have.
    Only MONAI's own classes are named; fedmed's networks go as TorchScript, which computes the network's outputs."""
    import torch

    from fedmed.nn.bundle import export_bundle
    from fedmed.nn.models import build_model

    net = build_model("resnet18", 1, 3).eval()
    assert next(iter(net.state_dict())).startswith("net.")
    ck = tmp_path / "global.pt"
    torch.save({"format": "fedmed-model-1", "task": "classification", "state_dict": net.state_dict(),
                "model": {"arch": "resnet18"}, "data": {"image_size": 16, "channels": 1, "n_classes": 3},
                "classes": ["a", "b", "c"], "seed": 0, "cluster": None, "sites": ["site-1"], "workflow": "FedAvg",
                "rounds": 1}, ck)
    bundle = export_bundle(ck)
    inference = json.loads((bundle / "configs" / "inference.json").read_text())
    assert isinstance(inference["network_def"], str) and "model.ts" in inference["network_def"]
    x = torch.rand(2, 1, 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(torch.jit.load(str(bundle / "models" / "model.ts"))(x), net(x), atol=1e-5)


def test_a_binary_models_validation_threshold_travels_to_predict_and_the_bundle(tmp_path):
    """#85 "decide, not only rank": a binary FedAvg's final model carries the decision threshold chosen on its sites'
    pooled validation images (the same threshold recomputed here from those images), and ``fedmed predict`` and the
    exported MONAI bundle both decide by it (a threshold that moves some predictions off the argmax moves both)."""
    from PIL import Image

    from fedmed.algorithms.metrics import decide, decision_threshold, site_metrics
    from fedmed.core.schema import task_config
    from fedmed.nn.bundle import export_bundle
    from fedmed.nn.predict import load_model, predict_images, save_model
    from fedmed.nn.train import predict_proba
    from fedmed.site.runner import SiteRunner

    rng = np.random.default_rng(0)
    for c, level in (("benign", 0.35), ("malignant", 0.5)):
        (tmp_path / "imgs" / c).mkdir(parents=True)
        for i in range(40):
            img = np.clip(level + 0.2 * rng.standard_normal((8, 8)), 0, 1)
            Image.fromarray((img * 255).astype(np.uint8)).save(tmp_path / "imgs" / c / f"{c}{i}.png")
    raw = {"name": "binary", "dataset": {"path": str(tmp_path / "imgs"), "image_size": 8, "channels": 1},
           "federation": {"sites": 2, "partition": "iid", "val_fraction": 0.3}, "model": {"arch": "resnet9", "width": 4},
           "train": {"rounds": 2, "local_epochs": 1, "batch_size": 8}, "privacy": {"k_min": 2}}
    exp, data, cfg = _fedavg_run(tmp_path, raw)
    models = tmp_path / "run" / "models"
    net, ck = load_model(models / "global.pt")
    hist = 0
    for s in exp.site_names():
        x, y = SiteRunner(s, data).splits(task_config(cfg)).val
        hist = hist + site_metrics(y.numpy(), predict_proba(net, x), 2, k_min=2)["score_hist"]
    assert ck["decision"] == decision_threshold(hist)
    # a threshold that moves predictions off the argmax: fedmed predict and the bundle both follow it
    test = [str(data / e["image"]) for s in exp.site_names() for e in json.loads((data / f"{s}.json").read_text())["test"]]
    prob = np.asarray([[p[c] for c in exp.dataset.classes] for p in (r["probabilities"] for r in predict_images(
        models / "global.pt", test))])
    t = float(np.median(prob[:, 1]))
    moved = decide(prob, t)
    assert (moved != prob.argmax(1)).any()
    state = {k: v.numpy() for k, v in net.state_dict().items()}
    save_model(tmp_path / "moved.pt", state, cfg, workflow="FedAvg", rounds=2, decision={"threshold": t})
    export_bundle(tmp_path / "moved.pt", tmp_path / "moved_bundle")
    got = _run_bundle(tmp_path / "moved_bundle", test, tmp_path / "bundle_out", tmp_path)
    want = predict_images(tmp_path / "moved.pt", test)
    names = exp.dataset.classes
    assert [w["prediction"] for w in want] == [names[c] for c in moved]
    assert [got[Path(f).name]["prediction"] for f in test] == [names[c] for c in moved]


def test_a_bundle_fedmed_exported_is_refused_with_the_settings_that_start_from_its_weights(tmp_path):
    """fedmed's own networks travel in its bundles as TorchScript, which no MONAI ``network_def`` names: bringing such
    a bundle back (``model.bundle``) failed on "network_def is a Python expression". It is refused in one line whose
    ``--set`` options, applied as written, train from the bundle's weights: the same network, the same tensors."""
    import shlex

    import torch
    import yaml

    from fedmed.config import ConfigError, load_config
    from fedmed.nn.bundle import export_bundle
    from fedmed.nn.models import build_model

    net = build_model("resnet9", 1, 10, width=4, norm="group")
    ck = tmp_path / "global.pt"
    torch.save({"format": "fedmed-model-1", "task": "classification", "state_dict": net.state_dict(),
                "model": {"arch": "resnet9", "width": 4, "norm": "group"},
                "data": {"image_size": 8, "channels": 1, "n_classes": 10}, "classes": [str(i) for i in range(10)],
                "seed": 0, "cluster": None, "sites": ["site-1"], "workflow": "FedAvg", "rounds": 1}, ck)
    bundle = export_bundle(ck)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"name": "back", "dataset": {"path": "builtin:digits", "image_size": 8, "channels": 1},
                                   "model": {"bundle": str(bundle)}, "methods": [{"name": "FedAvg",
                                                                                    "workflow": "fedavg"}]}))
    with pytest.raises(ConfigError, match="a bundle fedmed exported") as e:
        load_config(cfg)
    line = str(e.value)
    assert "Python expression" not in line
    words = shlex.split(line[line.index("--set model.bundle=null"):])
    sets = [words[i + 1] for i, w in enumerate(words) if w == "--set"]
    exp = load_config(cfg, sets)
    assert (exp.model.arch, exp.model.width, exp.model.norm) == ("resnet9", 4, "group")
    back = build_model("resnet9", 1, 10, width=4, norm="group")
    back.load_state_dict(torch.load(exp.model.init_weights, weights_only=True))
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), net.state_dict().values()))
