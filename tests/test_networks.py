"""Any MONAI network by name, or the user's own class, trained by FedAvg in FLARE's simulator on small real data
(fedmed.nn.models); bad arch / arguments / weights are one line before anything runs."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from fedmed.config import load_config
from fedmed.run.experiment import REPO_ROOT, classes_override, prepare_federation
from fedmed.run.jobs import run_config_job

from conftest import shared_path

PNEUMONIA = {"name": "net_e2e", "federation": {"sites": 2, "partition": "iid"},
             "train": {"rounds": 4, "local_epochs": 2, "batch_size": 16, "optimizer": "adam", "lr": 1e-3},
             "methods": [{"name": "FedAvg", "workflow": "fedavg"}], "privacy": {"k_min": 3}}


def write_cfg(tmp_path, cfg) -> Path:
    p = tmp_path / "cfg.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def _pneumonia(tmp_path, model, **train):
    data = shared_path("pneumoniamnist", "pneumoniamnist.npz")
    cfg = dict(PNEUMONIA, dataset={"path": str(data), "image_size": 32, "channels": 1, "max_per_class": 80},
               model=model, train={**PNEUMONIA["train"], **train})
    cfg_path = write_cfg(tmp_path, cfg)
    exp = load_config(cfg_path)
    fed = prepare_federation(exp, 0, tmp_path / "data")
    return cfg_path, exp, fed


def _learned(doc, key="accuracy"):
    first, last = doc["rounds"][0]["summary"]["mean"][key], doc["rounds"][-1]["summary"]["mean"][key]
    return first, last


@pytest.mark.slow
@pytest.mark.data
def test_fedavg_trains_monai_densenet121_on_pneumoniamnist(tmp_path):
    cfg_path, exp, fed = _pneumonia(tmp_path, {"arch": "DenseNet121"})
    doc = run_config_job(str(cfg_path), classes_override(fed, exp), "FedAvg", 0, fed, tmp_path / "run", 2, timeout=900,
                  log=lambda *a: None)
    first, last = _learned(doc)
    assert doc["status"] == "finished" and last >= 0.7 and last >= first + 0.15, (first, last)  # measured 0.47 -> 0.78
    ck = torch.load(tmp_path / "run" / "server" / "models" / "global.pt", weights_only=True)
    assert ck["model"]["arch"] == "DenseNet121" and any(k.startswith("features.denseblock4") for k in ck["state_dict"])
    from fedmed.nn.predict import load_model

    net, info = load_model(tmp_path / "run" / "server" / "models" / "global.pt")
    assert type(net).__name__ == "DenseNet121"


USER_NET = '''
import torch
from torch import nn


class TinyNet(nn.Module):
    """A hospital's own classifier: a small CNN."""

    def __init__(self, in_channels=1, num_classes=2, width=8):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(in_channels, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                  nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                  nn.Flatten())
        self.head = nn.Linear(2 * width, num_classes)

    def forward(self, x):
        return self.head(self.body(x))
'''


@pytest.mark.slow
@pytest.mark.data
def test_fedavg_trains_a_user_class_from_a_file_outside_fedmed_carried_in_the_job(tmp_path, monkeypatch):
    code = tmp_path / "hospital_code"
    (code / "hospital_nets").mkdir(parents=True)
    (code / "hospital_nets" / "__init__.py").write_text("")
    (code / "hospital_nets" / "small.py").write_text(USER_NET)
    monkeypatch.syspath_prepend(str(code))
    monkeypatch.setenv("PYTHONPATH", str(code))
    init = tmp_path / "init.pt"  # model.init_weights: a local file, wrapped and with DataParallel prefixes
    sys.path.insert(0, str(code))
    from hospital_nets.small import TinyNet

    torch.manual_seed(5)
    torch.save({"state_dict": {f"module.{k}": v for k, v in TinyNet(1, 2, width=12).state_dict().items()}}, init)
    cfg_path, exp, fed = _pneumonia(tmp_path, {"arch": "hospital_nets.small:TinyNet", "args": {"width": 12},
                                              "init_weights": str(init)}, local_epochs=6, lr=3e-3, rounds=6)
    doc = run_config_job(str(cfg_path), classes_override(fed, exp), "FedAvg", 0, fed, tmp_path / "run", 2, timeout=900,
                  log=lambda *a: None)
    first, last = _learned(doc)
    assert doc["status"] == "finished" and last >= first + 0.15 and last >= 0.65, (first, last)  # measured 0.47 -> 0.72 (6 rounds:
    # the federation lost a duplicate image in #28 and with it the split 4 rounds reached 0.72 on; 4 rounds: 0.59)
    job = tmp_path / "run" / "job"
    carried = sorted(p.relative_to(job) for p in job.rglob("fedmed_user_code/hospital_nets/small.py"))
    assert len(carried) == 3 and any("server" in str(p) for p in carried)  # the two sites' apps and the server's
    assert list(job.rglob("config/fedmed_files/model_init/init.pt"))  # data for the server, not code
    # the served model of round 0 is the init file's network, not a fresh seed's
    from fedmed.nn.models import model_from_config

    started = model_from_config({"arch": "hospital_nets.small:TinyNet", "args": {"width": 12},
                                 "init_weights": str(init)}, 1, 2, modules=["hospital_nets"])
    fresh = model_from_config({"arch": "hospital_nets.small:TinyNet", "args": {"width": 12}}, 1, 2,
                              modules=["hospital_nets"])
    sd = torch.load(init, weights_only=True)["state_dict"]
    assert torch.equal(started.head.weight, sd["module.head.weight"])
    assert not torch.equal(fresh.head.weight, sd["module.head.weight"])


@pytest.mark.slow
@pytest.mark.data
def test_fedavg_trains_monai_segresnet_on_brats(tmp_path):
    brats = shared_path("brats2013")
    cfg = {"name": "segresnet_e2e",
           "dataset": {"path": str(brats), "task": "segmentation", "modalities": {"FLAIR": "Flair*.nii*", "T1c": "T1c*.nii*"},
                       "label_pattern": "OTMultiClass*.nii*", "mask_pattern": "brainmask*.nii*", "shape": [24, 32, 32],
                       "roi": [24, 32, 32]},
           "federation": {"sites": 2, "partition": "label_volume", "test_fraction": 0.34, "val_fraction": 0.0},
           "model": {"arch": "SegResNet", "args": {"init_filters": 8}},
           "train": {"rounds": 4, "local_epochs": 8, "optimizer": "adam", "lr": 3e-3, "weight_decay": 1e-5,
                     "seg": {"patches_per_volume": 2, "pos_fraction": 0.7}},
           "privacy": {"k_min": 1, "accept_k_min_below_2": True}, "references": [],
           "methods": [{"name": "FedAvg", "workflow": "fedavg"}]}
    cfg_path = write_cfg(tmp_path, cfg)
    fed = prepare_federation(load_config(cfg_path), 0, tmp_path / "data")
    doc = run_config_job(str(cfg_path), [], "FedAvg", 0, fed, tmp_path / "run", 2, timeout=1200, log=lambda *a: None)
    first, last = _learned(doc, "dice_wt")
    assert doc["status"] == "finished" and last >= first + 0.3 and last >= 0.45, (first, last)  # measured 0.08 -> 0.66
    ck = torch.load(tmp_path / "run" / "server" / "models" / "global.pt", weights_only=True)
    assert ck["model"]["arch"] == "SegResNet"


@pytest.mark.parametrize("model, msg", [
    ({"arch": "DenseNet12"}, "model.arch 'DenseNet12' is not fedmed's .* did you mean 'DenseNet121'"),
    ({"arch": "DenseNet121", "args": {"dropout": 0.1}}, r"model.arch DenseNet121 with model.args \{'dropout': 0.1\}: "
                                                        r"TypeError"),
    ({"arch": "EfficientNetBN", "args": {"model_name": "efficientnet-b9"}}, "model.arch EfficientNetBN with model.args"),
    ({"arch": "DenseNet121", "args": {"pretrained": True}}, "nothing is downloaded here"),
    ({"arch": "no_such_pkg.mod:Net"}, "cannot import module 'no_such_pkg.mod'"),
    ({"arch": "UNet", "args": {"channels": [4, 8], "strides": [2]}}, r"output shape \(2, 2, 32, 32\) .* expected \(2, 2\)"),
])
def test_a_bad_network_is_one_line_before_anything_runs(tmp_path, model, msg):
    cfg = {"name": "bad", "dataset": {"path": "builtin:digits", "image_size": 32, "classes": ["a", "b"]},
           "model": model}
    cfg_path = write_cfg(tmp_path, cfg)
    res = subprocess.run([sys.executable, str(REPO_ROOT / "jobs" / "build.py"), "--config", str(cfg_path), "--method",
                          "FedAvg", "--out", str(tmp_path / "jobs")], capture_output=True, text=True, cwd=REPO_ROOT,
                         timeout=300)
    assert res.returncode != 0 and not (tmp_path / "jobs").exists()
    last = res.stderr.strip().splitlines()[-1]
    import re

    assert re.search(msg, last), last


def test_init_weights_of_another_network_is_one_line(tmp_path):
    from fedmed.nn.models import ArchError, model_from_config

    f = tmp_path / "w.pt"
    torch.save({"model": {"conv.weight": torch.zeros(3)}}, f)
    with pytest.raises(ArchError, match=r"model.init_weights: w.pt does not fit the network: \d+ missing"):
        model_from_config({"arch": "resnet9", "width": 4, "init_weights": str(f)}, 1, 2)
    with pytest.raises(Exception, match="model.init_weights: file .*gone.pt not found"):
        load_config({"name": "x", "dataset": {"path": "builtin:digits"}, "model": {"init_weights": str(tmp_path / "gone.pt")}})


@pytest.mark.slow
@pytest.mark.data
def test_the_full_size_2d_recipe_runs_shrunk(tmp_path):
    """app_configs/busi_224.yaml as docs/recipes.md runs it (DenseNet121 from an init file, FMCL on USFM features,
    bf16), shrunk to CPU size: fewer images, 32 px, one round, its FMCL method only (whose cluster model is the
    recipe's DenseNet121 trained from the init file in bf16, as FedAvg's global model is; a second simulator job
    for FedAvg added nothing but time)."""
    shared_path("busi")
    from monai.networks.nets import DenseNet121

    init = tmp_path / "densenet121_3class.pt"
    torch.manual_seed(1)
    torch.save(DenseNet121(spatial_dims=2, in_channels=3, out_channels=3).state_dict(), init)
    cmd = [sys.executable, "-m", "fedmed", "experiment", str(REPO_ROOT / "app_configs" / "busi_224.yaml"), "--out",
           str(tmp_path / "out"), "--methods", "FMCL_USFM", "--set", f"model.init_weights={init}",
           "--set", "dataset.image_size=32", "--set", "dataset.max_per_class=12", "--set", "federation.sites=2",
           "--set", "train.rounds=1", "--set", "train.local_epochs=1", "--set", "seeds=[0]", "--set", "references=[]",
           "--set", "privacy.k_min=2", "--set", "methods.FMCL_USFM.n_clusters=1"]
    res = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=1500)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "FMCL_USFM" in summary and "FedAvg" not in summary
    run = json.loads((tmp_path / "out" / "runs" / "seed0" / "FMCL_USFM" / "server" / "metrics.json").read_text())
    assert run["clustering"]["encoder"][0].startswith("usfm [random init")


@pytest.mark.slow
@pytest.mark.data
def test_the_full_size_3d_recipe_runs_shrunk(tmp_path):
    """app_configs/brats_1mm.yaml (SegResNet, sliding-window inference, bf16, a data-loader worker) shrunk to CPU size:
    16 x 20 x 16 volumes (two overlapping 16^3 windows along the second axis). PyTorch's CPU bf16 ``conv3d`` takes
    ~24 s a step on 32^3 patches (0.5 s in fp32), ~2.6 s on 16^3."""
    shared_path("brats2013")
    cmd = [sys.executable, "-m", "fedmed", "experiment", str(REPO_ROOT / "app_configs" / "brats_1mm.yaml"), "--out",
           str(tmp_path / "out"), "--methods", "FedAvg", "--set", "dataset.shape=[16,20,16]",
           "--set", "dataset.roi=[16,16,16]", "--set", "train.rounds=1", "--set", "train.local_epochs=1",
           "--set", "train.workers=1", "--set", "seeds=[0]", "--set", "references=[]"]
    res = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=1500)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert "FedAvg" in (tmp_path / "out" / "summary.md").read_text()


def test_the_server_starts_the_model_only_from_the_jobs_own_files(tmp_path):
    """``model.init_weights`` at the server (``config_fed_server.json``) may name only a file the job carries: an
    absolute path, a ``..`` out of ``fedmed_files`` or a symbolic link is refused with one line that reads the same
    whether such a file exists or not (no existence oracle), and the job's own file still starts the model."""
    from fedmed.nn.models import ArchError, model_from_config

    files = tmp_path / "config" / "fedmed_files"
    (files / "model_init").mkdir(parents=True)
    torch.manual_seed(3)
    want = model_from_config({"arch": "resnet9", "width": 4}, 1, 2, seed=7).state_dict()
    torch.save(want, files / "model_init" / "w.pt")
    outside = tmp_path / "server_secret.pt"
    torch.save(want, outside)
    (files / "model_init" / "link.pt").symlink_to(outside)
    base = {"arch": "resnet9", "width": 4}
    got = model_from_config({**base, "init_weights": "model_init/w.pt"}, 1, 2, seed=0, init_root=files).state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    refusals = set()
    for path in (str(outside), str(tmp_path / "absent.pt"), "../../server_secret.pt", "../../absent.pt",
                 "model_init/link.pt", "model_init/absent.pt", "/etc/passwd"):
        with pytest.raises(ArchError, match=r"is not a file this job carries \(the server starts the model only from "
                                            r"the job's own files, fedmed_files/\)") as e:
            model_from_config({**base, "init_weights": path}, 1, 2, seed=0, init_root=files)
        refusals.add(str(e.value).replace(Path(path).name, "NAME"))
        assert str(tmp_path) not in str(e.value)
    assert len(refusals) == 1, refusals  # present or absent: the same line
