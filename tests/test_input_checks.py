"""Every value a coordinator or a site accepts is checked where it enters (issue #87, the second probe): one rule per
kind of input — a weights file (:func:`fedmed.nn.encoders.check_weights_file`), a number (``fedmed.core.schema.
Strict``: finite, never a boolean), a size budget (the site policy's ``max_task_bytes``), a path in a datalist — used
by every route that takes it. Each test here failed on the code before #87."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fedmed.cli.main import main
from fedmed.config import ConfigError, load_config
from fedmed.data.images import DataError, discover
from fedmed.data.datalists import write_site_datalists
from fedmed.data.partition import iid_partition

ROOT = Path(__file__).resolve().parents[1]
CLASSES = [str(c) for c in range(10)]
TINY = {"name": "tiny", "dataset": {"path": "builtin:digits", "image_size": 8, "channels": 1, "max_per_class": 4,
                                    "classes": CLASSES},
        "federation": {"sites": 2, "partition": "iid"}, "model": {"arch": "resnet9", "width": 4},
        "train": {"rounds": 1, "local_epochs": 1, "batch_size": 8}, "methods": [{"name": "FedAvg"}],
        "privacy": {"k_min": 2}, "references": []}


@pytest.fixture
def federation(tmp_path):
    pool = discover("builtin:digits", max_per_class=4)
    root = tmp_path / "data"
    write_site_datalists(pool, iid_partition(len(pool.labels), 2, 0), root, test_fraction=0.25, seed=0)
    return root


# ------------------------------------------------------------------ A. a weights file, on every route that ships one
def test_init_weights_is_shipped_only_as_a_regular_state_dict_file(tmp_path):
    """``model.init_weights: /etc/hostname`` (any coordinator file) was packed into the server's job files, exit 0;
    a link, a folder and a file that is no state dict are now refused before anything is shipped."""
    from fedmed.run.jobspec import BuildError, job_spec

    exp = load_config(TINY)
    good = tmp_path / "w.pt"
    from fedmed.nn.models import model_from_config

    torch.save(model_from_config({"arch": "resnet9", "width": 4}, 1, 10).state_dict(), good)
    pickled = tmp_path / "obj.pt"
    torch.save({"w": torch.zeros(2), "code": Path("x")}, pickled)  # needs pickle: weights_only refuses it
    link = tmp_path / "link.pt"
    link.symlink_to(good)
    folder = tmp_path / "folder.pt"
    folder.mkdir()
    cases = [(Path("/etc/hostname"), "does not load as a state dict of tensors"),
             (pickled, "does not load as a state dict of tensors"), (link, "is a symbolic link"),
             (folder, "is not a regular file (a folder)")]
    for path, says in cases:
        with pytest.raises(BuildError, match="^model.init_weights: ") as e:
            job_spec(exp.model_copy(update={"model": exp.model.model_copy(update={"init_weights": str(path)})}),
                     exp.methods[0], 0)
        assert says in str(e.value), (path, str(e.value))
    spec = job_spec(exp.model_copy(update={"model": exp.model.model_copy(update={"init_weights": str(good)})}),
                    exp.methods[0], 0)
    assert [Path(s).name for s, _ in spec.server_files] == ["w.pt"]  # a state dict travels
    for empty in ("", "  "):  # an unset shell variable: refused, never "trains from random weights" silently
        with pytest.raises(ConfigError, match="model.init_weights= is empty"):
            load_config(TINY, [f"model.init_weights={empty}"])
        with pytest.raises(ConfigError, match="model.init_weights is empty"):
            load_config({**TINY, "model": {**TINY["model"], "init_weights": empty}})


def _bundle(root: Path, **extra) -> Path:
    (root / "configs").mkdir(parents=True)
    net = {"_target_": "monai.networks.nets.DenseNet121", "spatial_dims": 2, "in_channels": 1, "out_channels": 10}
    (root / "configs" / "inference.json").write_text(json.dumps({"network_def": net, **extra}))
    (root / "configs" / "metadata.json").write_text(json.dumps({"network_data_format": {
        "inputs": {"image": {"num_channels": 1}}, "outputs": {"pred": {"num_channels": 10}}}}))
    return root


def test_a_bundles_weights_and_preprocessing_are_never_dropped_silently(tmp_path):
    """A ``models/model.pt`` that is a folder, a FIFO or behind a broken ``models/`` link was ignored (the job
    trained from scratch); ``transforms: "@T"`` naming an expression dropped the bundle's preprocessing."""
    from fedmed.nn.bundle import BundleExportError
    from fedmed.nn.bundle_read import read_bundle

    b = _bundle(tmp_path / "folder")
    (b / "models" / "model.pt").mkdir(parents=True)
    with pytest.raises(BundleExportError, match="models/model.pt is not a regular file"):
        read_bundle(b)
    b = _bundle(tmp_path / "fifo")
    (b / "models").mkdir()
    os.mkfifo(b / "models" / "model.pt")
    with pytest.raises(BundleExportError, match="models/model.pt is not a regular file"):
        read_bundle(b)
    b = _bundle(tmp_path / "broken")
    (b / "models").symlink_to(tmp_path / "nowhere")
    with pytest.raises(BundleExportError, match="models/model.pt is a symbolic link"):
        read_bundle(b)
    b = _bundle(tmp_path / "expr", T="$monai.transforms.Compose([])",
                preprocessing={"_target_": "Compose", "transforms": "@T"})
    with pytest.raises(BundleExportError, match=r"preprocessing#transforms \(@T\) is a Python expression"):
        read_bundle(b)
    b = _bundle(tmp_path / "ref", T=[{"_target_": "ScaleIntensityd", "keys": "image"}],
                preprocessing={"_target_": "Compose", "transforms": "@T"})
    assert read_bundle(b)["preprocessing"] == [{"name": "ScaleIntensity", "args": {}}]  # a plain reference: read


# ------------------------------------------------------------------ B. a site's consent: tests/test_tracking.py
# ------------------------------------------------------------------ C. a size budget for the whole task
def test_a_task_is_refused_before_decoding_more_than_max_task_bytes(federation, tmp_path, capsys):
    """``validate`` at an allowed image size on a 100-image site grew 3.9 GB and died; ``check-data --image-size
    60000`` ignored the policy and hung. Both now stop before decoding, naming the setting."""
    from fedmed.core.policy import PolicyError, ReadLimits, SitePolicy
    from fedmed.site.runner import SiteRunner

    doc = json.loads((federation / "site-1.json").read_text())
    n = sum(len(doc[k]) for k in ("training", "validation", "test"))
    policy = SitePolicy(limits=ReadLimits(max_task_bytes=n * 64 * 64 * 4 - 1))
    runner = SiteRunner("site-1", federation)
    runner.settings.policy = policy
    runner.data(32, 1)  # within the budget
    with pytest.raises(PolicyError, match=r"site-1: its images at 64x64x1: .* more than this site holds for one task "
                                          r"\(max_task_bytes"):
        runner.data(64, 1)
    f = tmp_path / "fedmed_policy.json"
    policy.write(f)
    assert SitePolicy.from_file(f).limits.max_task_bytes == n * 64 * 64 * 4 - 1
    os.environ["FEDMED_SITE_POLICY"] = str(f)
    try:
        assert main(["check-data", str(federation / "site-1.json"), "--image-size", "64"]) == 1
    finally:
        del os.environ["FEDMED_SITE_POLICY"]
    assert "more than this site holds for one task (fedmed_policy.json: max_task_bytes" in capsys.readouterr().out
    assert main(["check-data", str(federation / "site-1.json"), "--image-size", "60000"]) == 1  # at once
    assert "data.image_size 60000 (1 channel(s)) is 3600000000 values per image" in capsys.readouterr().out


# ------------------------------------------------------------------ numbers: finite, in range, never a boolean
@pytest.mark.parametrize("value, says", [(".inf", "should be a finite number"), ("1e308", "less than or equal to 10"),
                                         ("true", "should be a number, got the boolean true"),
                                         ("-1", "greater than 0")])
def test_a_server_optimizer_number_is_finite_in_range_and_not_a_boolean(value, says):
    with pytest.raises(ConfigError, match=f"train.server_opt.lr: .*{says}"):
        load_config(TINY, ["train.server_opt.kind=adam", f"train.server_opt.lr={value}"])
    with pytest.raises(ConfigError, match="train.server_opt.tau: "):
        load_config(TINY, ["train.server_opt.kind=adam", "train.server_opt.tau=.inf"])
    with pytest.raises(ConfigError, match="train.rounds: should be a number, got the boolean true"):
        load_config(TINY, ["train.rounds=true"])
    load_config(TINY, ["train.server_opt.kind=adam", "train.server_opt.lr=0.1"])


def test_a_server_step_that_goes_non_finite_fails_the_run_naming_the_server_not_the_sites():
    from fedmed.core.schema import ServerOptConfig
    from fedmed.workflows.base import Workflow
    from fedmed.workflows.federation import RunFailed

    wf = Workflow(1, {"task": "classification"})
    wf._server_opt = ServerOptConfig.model_construct(kind="avgm", lr=1e308, beta1=0.9, beta2=0.99, tau=1e-3)
    base = {"w": np.ones(3, np.float32)}
    with pytest.raises(RunFailed, match=r"the server's optimizer step \(train.server_opt: avgm, lr 1e\+308.*nothing "
                                        r"was sent to the sites \(lower train.server_opt.lr\)"):
        wf.server_step(base, {"w": np.full(3, 1e30, np.float32)})


def test_a_task_config_error_is_one_line_per_key_without_pydantics_address():
    from fedmed.core.schema import TaskConfigError, task_config

    with pytest.raises(TaskConfigError) as e:
        task_config({"train": {"server_opt": {"lr": float("inf")}, "rounds": True}})
    msg = str(e.value)
    assert "train.server_opt.lr: Input should be a finite number" in msg and "train.rounds: should be a number" in msg
    assert "For further information" not in msg and "errors.pydantic.dev" not in msg and "\n" not in msg


# ------------------------------------------------------------------ check-data says what a site would meet
def test_check_data_refuses_degenerate_images_and_bad_options(tmp_path, capsys):
    Image.fromarray(np.zeros((20, 20), np.uint8)).save(tmp_path / "ok.png")
    Image.fromarray(np.zeros((1, 1), np.uint8)).save(tmp_path / "dot.png")
    Image.fromarray(np.zeros((1, 16000), np.uint8)).save(tmp_path / "strip.png")
    Image.fromarray(np.zeros((40, 2000), np.uint8)).save(tmp_path / "band.png")
    dl = tmp_path / "site.json"
    dl.write_text(json.dumps({"training": [{"image": f, "label": 0} for f in
                                           ("ok.png", "ok.png", "dot.png", "strip.png", "band.png")][1:]}))
    assert main(["check-data", str(dl)]) == 1
    out = capsys.readouterr().out
    assert "image dot.png is 1x1 pixels: too small to be an image" in out
    assert "image strip.png is 16000x1 pixels: too small" in out
    assert "image band.png is 2000x40 pixels, a 50:1 strip" in out and "ready to join" not in out
    for opt, says in ((["--image-size", "0"], "--image-size: should be at least 1, got 0"),
                      (["--image-size", "-5"], "--image-size: should be at least 1, got -5"),
                      (["--k-min", "-3"], "--k-min: should be at least 1, got -3"),
                      (["--channels", "2"], "--channels: invalid choice: 2")):
        with pytest.raises(SystemExit) as e:
            main(["check-data", str(dl), *opt])
        assert e.value.code == 2 and says in capsys.readouterr().err


# ------------------------------------------------------------------ crashes
def test_a_kit_whose_resources_json_is_not_an_object_is_one_line(tmp_path):
    kit = tmp_path / "site-1"
    (kit / "local").mkdir(parents=True)
    (kit / "local" / "resources.json").write_text("[1, 2]")
    r = subprocess.run([sys.executable, "-m", "fedmed_flare.kit", str(kit)], capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == (f"fedmed_flare.kit: error: {kit}: local/resources.json should be a JSON object "
                                f"(FLARE's resources), got a list")
    (kit / "local" / "resources.json").write_text(json.dumps({"allow_log_streaming": "false"}))
    r = subprocess.run([sys.executable, "-m", "fedmed_flare.kit", str(kit)], capture_output=True, text=True)
    assert r.returncode == 0 and 'allow_log_streaming false (was "false", which FLARE takes as on)' in r.stdout


def test_device_volumes_refuse_a_label_of_another_grid_naming_the_case():
    from fedmed.nn.resident import DeviceVolumes

    case = {"name": "case-7", "image": np.zeros((2, 8, 8, 8), np.float32), "label": np.zeros((3, 8, 8, 6), np.uint8)}
    with pytest.raises(ValueError, match=r"DeviceVolumes: case 0 \(case-7\): image \(2, 8, 8, 8\) and label "
                                         r"\(3, 8, 8, 6\)"):
        DeviceVolumes([case], "cpu", (4, 4, 4))


# ------------------------------------------------------------------ vague lines, each naming what and where
def test_a_null_or_non_path_image_entry_names_its_position(federation):
    from fedmed.data.datalists import load_datalist

    doc = json.loads((federation / "site-1.json").read_text())
    for bad, got in ((None, "null"), (7, "a int"), ("", "a str")):
        doc["training"][1]["image"] = bad
        (federation / "site-1.json").write_text(json.dumps(doc))
        with pytest.raises(DataError, match=r"training\[1\] 'image' should be a file") as e:
            load_datalist(federation / "site-1.json")
        assert e.value.public.endswith(f"training[1] 'image' should be a file (a path), got {got}")


def test_an_entry_outside_the_data_folder_says_so_with_its_position(federation, tmp_path):
    from fedmed.site.runner import SiteRunner

    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "passwd").write_text("root:x:0:0\n")
    doc = json.loads((federation / "site-1.json").read_text())
    doc["training"][2]["image"] = str(other / "passwd")
    (federation / "site-1.json").write_text(json.dumps(doc))
    with pytest.raises(DataError) as e:
        SiteRunner("site-1", federation).data(8, 1)
    assert str(e.value).startswith("site-1: training[2]: cannot read image passwd (outside the data folder) (corrupt")
    assert str(tmp_path) not in str(e.value)


def test_bundle_lines_name_the_key(tmp_path):
    from fedmed.nn.bundle import BundleExportError
    from fedmed.nn.bundle_read import check_bundle_fits, read_bundle

    b = _bundle(tmp_path / "meta")
    (b / "configs" / "metadata.json").write_text(json.dumps({"network_data_format": {
        "inputs": {"image": {"num_channels": "$1+1"}}, "outputs": {}}}))
    with pytest.raises(BundleExportError, match=r"network_data_format.inputs.image.num_channels should be a "
                                                r"positive whole number, got '\$1\+1'"):
        check_bundle_fits(read_bundle(b), task="classification", channels=1, size=[8, 8], n_out=10, where="model.bundle meta")
    real = _bundle(tmp_path / "real")
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "configs").symlink_to(tmp_path / "gone")
    with pytest.raises(BundleExportError, match="configs is a symbolic link"):
        read_bundle(linked)
    assert read_bundle(real)["arch"] == "DenseNet121"


def test_a_component_in_model_args_is_named_as_one(tmp_path):
    from fedmed.run.jobspec import BuildError

    with pytest.raises((ConfigError, BuildError), match=r"model.args.act: a component to build \(\{'_target_': 'torch.nn.ReLU'\}"):
        cfg = {**TINY, "model": {"arch": "DenseNet121", "args": {"act": {"_target_": "torch.nn.ReLU"}}}}
        exp = load_config(cfg)
        from fedmed.run.jobspec import job_spec

        job_spec(exp, exp.methods[0], 0)


def test_subject_leakage_names_the_two_splits_it_is_in():
    from fedmed.data.seg_federation import check_no_leakage

    doc = {"training": [{"subject": "a", "label": "a/l.nii"}], "validation": [{"subject": "b", "label": "b/l.nii"}],
           "test": [{"subject": "b", "label": "b/l.nii"}]}
    with pytest.raises(DataError, match=r"subject\(s\) \['b'\] are in both the validation and the test data"):
        check_no_leakage(doc, where="site-1")


def test_a_task_without_its_section_and_a_fedmae_refusal_name_what_they_are(federation):
    from fedmed.core.policy import PolicyError, SitePolicy
    from fedmed.core.schema import task_config
    from fedmed.site.mae import MAESiteRunner
    from fedmed.site.runner import SiteRunner
    from fedmed.site.tasks import TaskError

    cfg = {"task": "classification", "classes": CLASSES, "data": {"image_size": 8, "channels": 1, "n_classes": 10},
           "privacy": {"k_min": 2}}
    with pytest.raises(TaskError, match="site-1: task 'signature' needs the task config's 'signature' section"):
        SiteRunner("site-1", federation).run_task("signature", {}, cfg)
    r = MAESiteRunner("site-1", federation)
    r.settings.policy = SitePolicy(architectures=("resnet9",))
    with pytest.raises(PolicyError, match=r"^the network Fed-MAE pre-trains \(whatever model.arch says\) "
                                          r"'MaskedAutoEncoderViT' is not among"):
        r.check_policy("train", task_config({**cfg, "task": "mae", "model": {"arch": "resnet9"}}))


def test_cli_lines_are_prefixed_once_and_plan_options_are_checked_first(tmp_path, capsys):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps(TINY))
    assert main(["predict", str(tmp_path / "none.pt"), "x.png"]) == 2
    err = capsys.readouterr().err
    assert err.count("fedmed predict:") == 1, err
    # a bad option is said before the --global run is looked for (it does not exist here)
    rc = main(["plan", str(cfg), "--global", str(tmp_path / "nothing"), "--method", "NoSuch", "--data", str(tmp_path)])
    assert rc == 2 and "method 'NoSuch' is not in" in capsys.readouterr().err
    rc = main(["plan", str(cfg), "--global", str(tmp_path / "nothing"), "--finetune", "--finetune-epochs", "0",
               "--data", str(tmp_path)])
    assert rc == 2 and "--finetune-epochs should be at least 1" in capsys.readouterr().err
    # an unknown serving.reference: one line naming it, not the whole config
    with pytest.raises(ConfigError) as e:
        load_config({**TINY, "serving": {"reference": "NoSuch", "candidates": ["FedAvg"]}})
    assert "serving names unknown method(s)" in str(e.value) and "'dataset'" not in str(e.value)


# ------------------------------------------------------------------ latent: a job's custom/ never shadows
def test_a_forked_simulator_worker_puts_a_jobs_folders_after_the_installed_packages(tmp_path):
    custom = tmp_path / "custom"
    (custom / "scipy").mkdir(parents=True)
    (custom / "scipy" / "__init__.py").write_text("raise ImportError('the job folder shadowed scipy')\n")
    code = ("import os, sys\nfrom fedmed_flare.simulator import _as_popen_child\n"
            f"_as_popen_child({{**os.environ, 'PYTHONPATH': {str(custom)!r}}})\n"
            "import scipy\nprint(sys.path[-1], scipy.__file__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-500:]
    last, where = out.stdout.split()
    assert last == str(custom) and "site-packages" in where


def test_a_sites_reply_to_bad_task_options_is_one_line_per_key(federation):
    """A method's site options that do not validate (here the serving plan's) reach the server as one line naming
    the key, without pydantic's dump and web address."""
    from fedmed.site.reply import answer

    cfg = {"task": "classification", "classes": CLASSES, "data": {"image_size": 8, "channels": 1, "n_classes": 10},
           "privacy": {"k_min": 2}, "method_options": {"names": "global", "surprise": 1}}

    _, reply, log = answer("site-1", None, "serve_score", {}, cfg, 0, settings=federation)
    err = reply.meta["error"]
    assert err.startswith("site-1: ValidationError: ") and "surprise" in err and "names" in err, err
    assert "For further information" not in err and "\n" not in err
