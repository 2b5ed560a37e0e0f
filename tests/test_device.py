"""fedmed.core.device: the device and precision plumbing, on the CPU (the GPU benchmark is benchmarks/bench_gpu.py)."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from fedmed.data.images import discover

from fedmed.data.datalists import write_site_datalists
from fedmed.core.device import DeviceError, autocast, resolve_device
from fedmed.data.partition import iid_partition
from fedmed.site.runner import SiteRunner, TaskError
from fedmed.site.settings import resolve_site_settings

NO_GPU = not torch.cuda.is_available()


@pytest.fixture
def site(tmp_path):
    pool = discover("builtin:digits", max_per_class=8, seed=0)
    write_site_datalists(pool, iid_partition(len(pool.labels), 1, 0), tmp_path, test_fraction=0.25, seed=0)
    cfg = {"seed": 0, "data": {"image_size": 16, "channels": 1, "n_classes": 10},
           "model": {"arch": "resnet9", "width": 4, "norm": "batch"}, "privacy": {"k_min": 2},
           "train": {"local_epochs": 1, "batch_size": 8, "optimizer": "adam", "lr": 1e-3, "device": "auto",
                     "precision": "fp32"}}
    return tmp_path, cfg


@pytest.mark.skipif(not NO_GPU, reason="checks the error of a machine without a GPU")
def test_cuda_without_a_gpu_is_one_line_naming_the_site_before_it_trains(site):
    root, cfg = site
    runner = SiteRunner("site-1", root)
    cuda = {**cfg, "train": {**cfg["train"], "device": "cuda"}}
    from fedmed.nn.models import model_from_config
    from fedmed.nn.train import get_params

    p = get_params(model_from_config(cfg["model"], 1, 10))
    with pytest.raises(DeviceError) as err:
        runner.handle("train", p, cuda, 0)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("site-1: train.device is cuda but this machine has no CUDA GPU")
    assert runner._model is None  # nothing was built, nothing trained
    with pytest.raises(DeviceError, match="site-2: train.device is cuda:1"):
        resolve_device("cuda:1", where="site-2")
    with pytest.raises(DeviceError, match="should be auto, cpu, cuda or cuda:N, got 'gpu'"):
        resolve_device("gpu")
    assert resolve_device("auto") == torch.device("cpu")


def test_a_sites_own_device_setting_wins_over_the_jobs(site, tmp_path):
    root, cfg = site
    (tmp_path / "kit" / "local").mkdir(parents=True)
    (tmp_path / "kit" / "local" / "fedmed_site.json").write_text(
        '{"datalist": "%s", "device": "cpu"}' % (root / "site-1.json"))
    settings = resolve_site_settings("site-1", cwd=tmp_path / "kit", env={})
    assert settings.device == "cpu"
    runner = SiteRunner("site-1", settings)
    cuda = {**cfg, "train": {**cfg["train"], "device": "cuda"}}
    from fedmed.nn.models import model_from_config
    from fedmed.nn.train import get_params

    _, metrics, meta, out = runner.handle("train", get_params(model_from_config(cfg["model"], 1, 10)), cuda, 0)
    assert next(runner._model.parameters()).device.type == "cpu" and np.isfinite(meta["train_loss"])
    (tmp_path / "kit" / "local" / "fedmed_site.json").write_text('{"datalist": "x.json", "device": "tpu"}')
    with pytest.raises(Exception, match="site-1: local/fedmed_site.json device should be auto, cpu, cuda or cuda:N"):
        resolve_site_settings("site-1", cwd=tmp_path / "kit", env={})
    assert resolve_site_settings("site-1", cwd=tmp_path, env={"FEDMED_DATALIST": str(root / "site-1.json"),
                                                            "FEDMED_DEVICE": "cpu"}).device == "cpu"


def _record_dtypes(model):
    seen = []
    for m in model.modules():
        if isinstance(m, (torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.Linear)):
            m.register_forward_hook(lambda mod, inp, out: seen.append(out.dtype))
    return seen


def test_bf16_autocast_reaches_training_and_inference_and_parameters_stay_fp32(site):
    root, cfg = site
    from fedmed.nn.models import model_from_config
    from fedmed.nn.train import get_params

    p = get_params(model_from_config(cfg["model"], 1, 10))
    results = {}
    for precision in ("fp32", "bf16"):
        runner = SiteRunner("site-1", root)
        c = {**cfg, "train": {**cfg["train"], "precision": precision}}
        runner.model(c)
        seen = _record_dtypes(runner._model)
        _, metrics, meta, out = runner.handle("train", p, c, 0)
        assert {str(d) for d in seen} == {"torch.bfloat16" if precision == "bf16" else "torch.float32"}
        assert all(v.dtype == np.float32 for v in out.values() if v.dtype.kind == "f")  # what leaves the site
        assert np.isfinite(meta["train_loss"]) and 0 <= metrics["accuracy"] <= 1
        results[precision] = out
    diff = max(float(np.abs(results["bf16"][k] - results["fp32"][k]).max()) for k in results["fp32"])
    assert 0 < diff < 0.5  # the same recipe at another precision: close, not identical


def test_3d_training_with_bf16_and_a_data_loader_worker(tmp_path):
    from fedmed.data.phantoms import write_phantom_subjects
    from fedmed.data.nifti import load_case
    from fedmed.nn.seg import seg_metrics, train_seg_local
    from fedmed.data.seg_federation import discover_subjects
    from fedmed.nn.models import seg_model_from_config

    root = write_phantom_subjects(tmp_path / "ph", [3, 4, 5], size=24)
    cases = [load_case(e, shape=(16, 16, 16)) for e in discover_subjects(root, {"FLAIR": "Flair*", "T1c": "T1c*"},
                                                                          "OTMultiClass*")]
    model = seg_model_from_config({"arch": "SegResNet", "args": {"init_filters": 8}}, 2)
    seen = _record_dtypes(model)
    out = train_seg_local(model, cases, roi=(16, 16, 16), patches=2, seed=0, precision="bf16", workers=1)
    assert np.isfinite(out["loss"]) and out["steps"] == 3 and "torch.bfloat16" in {str(d) for d in seen}
    m = seg_metrics(model, cases, roi=(16, 16, 16))
    assert set(m) >= {"dice_wt", "dice_mean"}


@pytest.mark.skipif(not NO_GPU, reason="checks the error of a machine without a GPU")
def test_a_simulator_job_asking_for_cuda_on_a_machine_without_one_stops_before_it_starts(tmp_path):
    from test_jobs import ROOT, digits_sim_command

    cmd = digits_sim_command(tmp_path, sites=2, rounds=1, workspace=tmp_path / "ws") + ["--set", "train.device=cuda"]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and not (tmp_path / "ws").exists()
    assert res.stderr.strip().splitlines()[-1] == (
        "jobs/run.py: error: site-1, site-2: train.device is cuda but this machine has no CUDA GPU "
        "(torch.cuda.is_available() is False); use auto or cpu (the simulator runs every site on this machine)")


def test_autocast_is_a_no_op_in_fp32_and_refuses_an_unknown_precision():
    with autocast(torch.device("cpu"), "fp32"):
        assert torch.ones(2, 2).matmul(torch.ones(2, 2)).dtype == torch.float32
    with pytest.raises(ValueError, match="train.precision should be one of"):
        autocast(torch.device("cpu"), "int8")


def test_the_gpu_benchmark_compares_the_same_training_and_says_when_there_is_no_gpu(tmp_path):
    from test_jobs import ROOT

    out = tmp_path / "r.json"
    temp = tmp_path / "temp"  # the process's temp folder: the benchmark's datalists leave nothing in it
    temp.mkdir()
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_gpu.py"), "--device", "cpu", "--arch",
                          "resnet9", "--image-size", "16", "--n", "32", "--pairs", "1", "--json", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "TMPDIR": str(temp)})
    assert res.returncode == 0, res.stderr[-2000:]
    assert not [p.name for p in temp.iterdir() if p.name.startswith("bench_gpu_")]
    assert "largest weight difference after one round: 0" in res.stdout and "give the same result" in res.stdout
    import json

    doc = json.loads(out.read_text())
    assert doc["a_images_per_s"] > 0 and doc["b_images_per_s"] > 0 and doc["device"].endswith("on CPU")
    # the tuned loop (data resident as uint8, flips on the device, no per-step read) trains what the site trains,
    # and fedmed's scoring of the images kept on the device gives the tuned pass's probabilities
    assert "tuned loop and fedmed site round give the same result" in res.stdout
    assert "largest probability difference: 0" in res.stdout and doc["inference"]["b_images_per_s"] > 0
    if NO_GPU:
        res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_gpu.py")], cwd=ROOT,
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 0 and "no CUDA GPU on this machine; nothing measured" in res.stdout


def test_the_gpu_benchmarks_3d_part_cuts_the_same_patches_as_its_tuned_loop(tmp_path):
    """bench_gpu.py --task seg3d on the CPU: fedmed's patches cut from volumes kept on the device train the tuned
    loop's weights bit for bit (the same draws), and the CPU-crop path of before is timed beside them."""
    from test_jobs import ROOT

    out = tmp_path / "r.json"
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_gpu.py"), "--task", "seg3d", "--device",
                          "cpu", "--volume", "20", "24", "20", "--roi", "16", "--cases", "2", "--pairs", "1",
                          "--workers", "1", "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "largest weight difference after one round: 0 " in res.stdout
    assert "tuned 3D loop and fedmed DeviceVolumes give the same result" in res.stdout
    import json

    doc = json.loads(out.read_text())
    assert doc["patches_per_round"] == 4 and doc["b_patches_per_s"] > 0 and doc["cpu_crops_patches_per_s"] > 0


def test_predict_runs_on_the_chosen_device_and_names_a_missing_one(tmp_path, capsys):
    from fedmed.cli.main import main
    from fedmed.nn.models import model_from_config
    from fedmed.nn.predict import save_model
    from fedmed.nn.train import get_params

    cfg = {"model": {"arch": "resnet9", "width": 4, "norm": "batch"}, "data": {"image_size": 16, "channels": 1,
                                                                             "n_classes": 2}, "classes": ["a", "b"]}
    f = save_model(tmp_path / "m.pt", get_params(model_from_config(cfg["model"], 1, 2)), cfg)
    from PIL import Image

    Image.fromarray(np.zeros((16, 16), np.uint8)).save(tmp_path / "x.png")
    assert main(["predict", str(f), str(tmp_path / "x.png"), "--device", "cpu"]) == 0
    if NO_GPU:
        assert main(["predict", str(f), str(tmp_path / "x.png"), "--device", "cuda"]) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert "fedmed predict: --device is cuda but this machine has no CUDA GPU" in err


def test_a_step_with_non_finite_gradients_is_skipped_not_taken():
    """PyTorch's CPU bf16 conv3d backward gave NaN weight gradients in some steps (SegResNet at 16^3 patches): one such
    step turned the whole model into NaN for the rest of the run. The step is skipped, and the caller told."""
    import torch

    from fedmed.core.device import backward_step

    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.1)
    assert backward_step((w * 2).sum(), opt) and torch.allclose(w, torch.full((3,), 0.8))
    assert not backward_step((w * torch.tensor([1.0, float("nan"), 1.0])).sum(), opt)
    assert torch.allclose(w, torch.full((3,), 0.8))  # unchanged


def test_train_deterministic_asks_cudnn_for_deterministic_algorithms(site, monkeypatch):
    """On a GPU, default fp32 cuDNN gave two runs of the same seed weights 30% apart in a batch-norm variance after one
    round (docs/lab/performance.md "On a GPU"); `train.deterministic` makes a site's process use cuDNN's deterministic
    algorithms (and no benchmark-mode autotuning), which gave bit-identical runs there."""
    root, cfg = site
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", False)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    SiteRunner("site-1", root).device(cfg)
    assert torch.backends.cudnn.deterministic is False  # the default leaves the process as it is
    SiteRunner("site-1", root).device({**cfg, "train": {**cfg["train"], "deterministic": True}})
    assert torch.backends.cudnn.deterministic is True and torch.backends.cudnn.benchmark is False


def test_the_fused_non_finite_check_skips_exactly_the_steps_the_per_tensor_check_skipped():
    """One fused found-inf check per (device, dtype) group instead of an isfinite/all pair per parameter tensor: the
    same answer as the per-tensor check on planted inf, -inf and NaN gradients (fp32 and bf16 mixed, huge finite
    values), and the gradients left exactly as they were."""
    import torch

    from fedmed.core.device import grads_finite

    rng = torch.Generator().manual_seed(0)
    for case in range(40):
        grads = [torch.randn(5, 7, generator=rng) * 1e30, torch.randn(3, generator=rng).to(torch.bfloat16),
                 torch.randn(2, 2, 2, generator=rng)]
        if case % 4:
            t = grads[case % 3]
            t.view(-1)[case % t.numel()] = [float("inf"), float("-inf"), float("nan")][case % 3]
        before = [g.clone() for g in grads]
        old = bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())
        assert grads_finite(grads) == old
        assert all(torch.equal(a, b) or (torch.isnan(a) == torch.isnan(b)).all() for a, b in zip(grads, before))
    assert grads_finite([])
