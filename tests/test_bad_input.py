"""The bad-input table: one malformed site in a three-site FedAvg federation per row. Each row asserts the line the
user sees (recorded in the run's ``errors`` and the reason, naming the site and the file or entry, no absolute path)
and that the other two sites' training goes on to the end; a federation where no site can train fails with the
reasons. Runs through the same reply loop as the FLARE client (``InProcessFederation``); the FLARE paths are in
test_jobs_e2e.py and test_deployment.py."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from fedmed.data.images import discover

from fedmed.data.datalists import write_site_datalists
from fedmed.data.partition import iid_partition

CLASSES = [str(c) for c in range(10)]


def _dl(root: Path, site: str = "site-2") -> dict:
    return json.loads((root / f"{site}.json").read_text())


def _write(root: Path, doc, site: str = "site-2") -> None:
    (root / f"{site}.json").write_text(doc if isinstance(doc, str) else json.dumps(doc))


def label_outside_classes(root):
    d = _dl(root)
    d["training"][0]["label"] = 12
    _write(root, d)


def nan_label(root):
    d = _dl(root)
    d["training"][0]["label"] = float("nan")
    _write(root, json.dumps(d))  # Python writes NaN, as a careless export does


def string_label(root):
    d = _dl(root)
    d["training"][0]["label"] = "benign"
    _write(root, d)


def empty_training(root):
    d = _dl(root)
    d["training"] = []
    _write(root, d)


def misspelled_split(root):
    d = _dl(root)
    d["tset"] = d.pop("test")
    _write(root, d)


def missing_image(root):
    d = _dl(root)
    d["training"][0]["image"] = "images/site-2/not_there.png"
    _write(root, d)


def corrupt_image(root):
    d = _dl(root)
    (root / "images" / "broken.png").write_bytes(b"\x89PNG truncated")
    d["training"][0]["image"] = "images/broken.png"
    _write(root, d)


def image_in_two_splits(root):
    d = _dl(root)
    d["test"].append(dict(d["training"][0]))
    _write(root, d)


def identical_copy_in_validation(root):
    d = _dl(root)
    shutil.copy(root / d["training"][1]["image"], root / "images" / "renamed.png")
    d["validation"].append({"image": "images/renamed.png", "label": d["training"][1]["label"]})
    _write(root, d)


def entry_without_label(root):
    d = _dl(root)
    del d["training"][0]["label"]
    _write(root, d)


def not_json(root):
    _write(root, '{"training": [')


def no_datalist(root):
    (root / "site-2.json").unlink()


def fewer_training_images_than_k_min(root):
    d = _dl(root)
    d["training"] = d["training"][:2]  # the job's k_min is 3
    _write(root, d)


def nan_pixels(root):
    from PIL import Image

    d = _dl(root)
    a = np.zeros((8, 8), np.float32)
    a[2, 2] = np.nan
    Image.fromarray(a, mode="F").save(root / "images" / "nan.tif")
    d["training"][0]["image"] = "images/nan.tif"
    _write(root, d)


def multi_frame_dicom(root):
    pydicom = pytest.importorskip("pydicom")
    d = _dl(root)
    shutil.copy(Path(pydicom.__file__).parent / "data" / "test_files" / "SC_rgb_rle_2frame.dcm",
                root / "images" / "cine.dcm")
    d["training"][0]["image"] = "images/cine.dcm"
    _write(root, d)


def dicom_without_pixels(root):
    pydicom = pytest.importorskip("pydicom")
    d = _dl(root)
    ds = pydicom.dcmread(Path(pydicom.__file__).parent / "data" / "test_files" / "CT_small.dcm")
    del ds.PixelData
    ds.save_as(root / "images" / "report.dcm")
    d["training"][0]["image"] = "images/report.dcm"
    _write(root, d)


def multi_frame_tiff(root):
    from PIL import Image

    d = _dl(root)
    frames = [Image.fromarray(np.full((8, 8), v, np.uint8)) for v in (0, 128)]
    frames[0].save(root / "images" / "stack.tif", save_all=True, append_images=frames[1:])
    d["training"][0]["image"] = "images/stack.tif"
    _write(root, d)


def fifo_image(root):
    import os

    d = _dl(root)
    os.mkfifo(root / "images" / "pipe.png")  # a reader of a FIFO waits for a writer that never comes
    d["training"][0]["image"] = "images/pipe.png"
    _write(root, d)


def device_image(root):
    d = _dl(root)
    d["training"][0]["image"] = "/dev/zero"  # reads without end
    _write(root, d)


def png_chunk(kind: bytes, data: bytes) -> bytes:
    import struct
    import zlib

    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def bomb_png(path: Path, width: int, height: int) -> None:
    """A few hundred bytes whose header says width x height 8-bit pixels (a decompression bomb: decoding it would
    allocate width * height bytes)."""
    import struct
    import zlib

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", zlib.compress(b"\0" * 64))
                     + png_chunk(b"IEND", b""))


def decompression_bomb(root):
    d = _dl(root)
    bomb_png(root / "images" / "bomb.png", 12_000, 12_000)  # 144 million pixels > the default 100 million
    d["training"][0]["image"] = "images/bomb.png"
    _write(root, d)


def dicom_with_text_rescale_slope(root):
    pydicom = pytest.importorskip("pydicom")
    d = _dl(root)
    ds = pydicom.dcmread(Path(pydicom.__file__).parent / "data" / "test_files" / "CT_small.dcm")
    ds["RescaleSlope"].VR = "LO"  # an export that wrote text where a number belongs
    ds.RescaleSlope = "one"
    ds.save_as(root / "images" / "textslope.dcm")
    d["training"][0]["image"] = "images/textslope.dcm"
    _write(root, d)


# (how site-2's data is broken, what the server reads — each substring must be in site-2's recorded error —, and
# what only the site's own log may name: its files, folders, label values and datalist keys)
TABLE = [
    (label_outside_classes, ["site-2: training[0]: a label outside the job's global label space 0..9"], ["[12]"]),
    (nan_label, ["site-2: its datalist: training[0] label should be a non-negative integer class id"], ["got nan"]),
    (string_label, ["site-2: its datalist: training[0] label is a name that is not one of the job's classes"],
     ["'benign'"]),
    (empty_training, ["site-2: its datalist has no training images"], ["site-2.json"]),
    (misspelled_split, ["site-2: its datalist: 1 list(s) that are not splits"], ["tset"]),
    (missing_image, ["site-2: training[0]: cannot read the image (file not found)"], ["not_there.png"]),
    (corrupt_image, ["site-2: training[0]: cannot read the image (corrupt or not an image"], ["broken.png"]),
    (image_in_two_splits, ["site-2: its datalist: the same image in training[0] and test["], ["images/site-2/"]),
    (identical_copy_in_validation, ["the same image in training[1] and validation[", "(identical files)"],
     ["renamed.png"]),
    (entry_without_label, ["site-2: its datalist: training[0] should have 'image' and 'label'"], ["got {"]),
    (not_json, ["site-2: its datalist: not valid JSON (JSONDecodeError at line 1"], ["site-2.json"]),
    (no_datalist, ["site-2", "datalist"], []),
    (fewer_training_images_than_k_min, ["site-2: sits out training: fewer training images than k_min=3"], []),
    (nan_pixels, ["site-2: training[0]: the image has NaN or infinite pixel values"], ["nan.tif"]),
    (multi_frame_dicom, ["site-2: training[0]: the image is a multi-frame DICOM (2 frames)"], ["cine.dcm"]),
    (dicom_without_pixels, ["site-2: training[0]: the image is a DICOM file without pixel data"], ["report.dcm"]),
    (multi_frame_tiff, ["site-2: training[0]: the image has 2 frames; one image per file is expected"], ["stack.tif"]),
    (fifo_image, ["site-2: training[0]: the image is a FIFO, not a regular file"], ["pipe.png"]),
    (device_image, ["site-2: training[0]: the image is a device, not a regular file"], ["image zero"]),
    (decompression_bomb, ["site-2: training[0]: the image has 12000x12000 pixels, more than this site decodes (its "
                          "policy's max_image_pixels=100000000)"], ["bomb.png"]),
    (dicom_with_text_rescale_slope, ["site-2: training[0]: the image has a malformed DICOM header (rescale slope"],
     ["textslope.dcm"]),
]


def test_the_table_has_at_least_fifteen_kinds():
    assert len(TABLE) >= 15 and len({f.__name__ for f, _, _ in TABLE}) == len(TABLE)


@pytest.fixture
def federation(tmp_path):
    pool = discover("builtin:digits", max_per_class=6)
    root = tmp_path / "data"
    write_site_datalists(pool, iid_partition(len(pool.labels), 3, 0), root, test_fraction=0.25, seed=0)
    return root


def run_fedavg(root: Path, out: Path):
    from fedmed.workflows import InProcessFederation
    from fedmed.workflows.fedavg import FedAvg

    sites = ["site-1", "site-2", "site-3"]
    cfg = {"task": "classification", "seed": 0, "classes": CLASSES,
           "data": {"image_size": 8, "channels": 1, "n_classes": 10},
           "model": {"arch": "resnet9", "width": 4, "norm": "group"},
           "train": {"local_epochs": 1, "batch_size": 8}, "privacy": {"k_min": 3},
           "federation": {"sites": sites, "min_clients": 2}}
    fed = InProcessFederation(root, sites, out, log=None)
    status = fed.run(FedAvg(2, cfg))
    return status, fed.recorder.doc


@pytest.mark.parametrize("breaks, says, private", TABLE, ids=[f.__name__ for f, _, _ in TABLE])
def test_one_bad_site_is_named_and_the_others_train_on(federation, tmp_path, capfd, breaks, says, private):
    breaks(federation)
    status, doc = run_fedavg(federation, tmp_path / "run")
    assert status == "finished", doc.get("reason")
    errors = [e["error"] for e in doc["errors"] if e["site"] == "site-2"]
    assert errors, doc["errors"]
    for s in says:
        assert s in errors[0], (s, errors[0])
    assert "\n" not in errors[0] and str(federation) not in errors[0]  # one line, no absolute path
    site_log = capfd.readouterr().err
    written = "".join(f.read_text(errors="replace") for f in (tmp_path / "run").rglob("*") if f.is_file()
                      and f.suffix in (".json", ".html", ".md", ".csv", ".txt"))
    for name in private:  # the file, the value, the key: in the site's own log, never in what the server writes
        assert name in site_log, (name, site_log[-2000:])
        assert name not in written and name not in doc["reason"], name
    assert "site-2" in doc["reason"]  # the run's status names the site that sat out, and why
    trained = [r for r in doc["rounds"] if r["task"] == "train"]
    assert len(trained) == 2 and all(sorted(r["sites"]) == ["site-1", "site-3"] for r in trained)
    assert doc["rounds"][-1]["task"] == "validate" and (tmp_path / "run" / "models" / "global.pt").is_file()


def test_a_federation_where_no_site_can_train_fails_with_the_reasons(federation, tmp_path):
    for site in ("site-1", "site-2", "site-3"):
        d = _dl(federation, site)
        d["training"] = []
        _write(federation, d, site)
    status, doc = run_fedavg(federation, tmp_path / "run")
    assert status == "failed"
    assert "fewer than min_clients=2" in doc["reason"] and "has no training images" in doc["reason"]
    assert not (tmp_path / "run" / "models").exists()


def test_a_site_whose_update_is_not_finite_sits_out_that_round(federation, tmp_path, monkeypatch):
    """One site's NaN update used to fail the whole run (the average turned NaN); that site sits out the round with its
    reason, as a site that failed its task does, and the model stays finite."""
    import fedmed.site.tasks as T

    real = T.CLASSIFICATION["train"]

    def diverging(runner, params, cfg, round_=0):
        out = real(runner, params, cfg, round_)
        if runner.site == "site-2" and round_ == 1:  # diverges in its second round
            out = out._replace(params={k: np.full_like(np.asarray(v), np.nan) for k, v in out.params.items()})
        return out

    monkeypatch.setitem(T.CLASSIFICATION, "train", diverging)
    status, doc = run_fedavg(federation, tmp_path / "run")
    assert status == "finished", doc["reason"]
    (err,) = [e for e in doc["errors"] if e["site"] == "site-2"]
    assert err["round"] == 1 and "its update has NaN or infinite values" in err["error"]
    assert sorted(doc["rounds"][1]["sites"]) == ["site-1", "site-3"] and "site-2" in doc["rounds"][0]["sites"]
    assert "site-2 sat out round(s) 1" in doc["reason"]
    import torch

    final = torch.load(tmp_path / "run" / "models" / "global.pt", weights_only=True)["state_dict"]
    assert all(torch.isfinite(v).all() for v in final.values() if v.is_floating_point())


# ------------------------------------------------------------------------------------------------ the probe's findings
BOMB = """name: bomb
a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
dataset: {path: "builtin:digits", classes: *h}
"""


def test_a_yaml_alias_bomb_is_one_short_line_in_little_memory(tmp_path):
    """A few hundred bytes of nested YAML aliases expand to 387 million values as soon as anything prints the config:
    refused in one line before anything reads it (it printed a 254 MB error at 0.8 GB)."""
    import subprocess
    import sys

    (tmp_path / "bomb.yaml").write_text(BOMB)
    assert len(BOMB) < 500
    code = ("import re, sys; from fedmed.cli.main import main; rc = main(['experiment', sys.argv[1], '--out', "
            "sys.argv[2]]); print('RSS', re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1)); "
            "sys.exit(rc)")  # VmHWM: this process's own peak (ru_maxrss keeps the forking worker's)
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "bomb.yaml"), str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and len(err[0]) < 300 and "expands to more than 100000 values" in err[0], err[:3]
    assert int(r.stdout.split("RSS")[-1]) < 400_000  # KiB


def test_a_model_file_whose_class_names_do_not_match_its_outputs_is_one_line(tmp_path):
    """``fedmed predict`` on a checkpoint of 2 outputs naming 1 class dropped a probability silently."""
    from fedmed.cli.main import main
    from fedmed.nn.models import model_from_config
    from fedmed.nn.predict import save_model

    model = {"arch": "resnet9", "width": 4}
    params = {k: v.numpy() for k, v in model_from_config(model, 1, 2, seed=0).state_dict().items()}
    ck = save_model(tmp_path / "m.pt", params, {"task": "classification", "model": model, "classes": ["benign"],
                                                 "data": {"channels": 1, "n_classes": 2, "image_size": 8}})
    from PIL import Image

    Image.fromarray(np.zeros((8, 8), np.uint8)).save(tmp_path / "x.png")
    assert main(["predict", str(ck), str(tmp_path / "x.png")]) == 2


@pytest.mark.parametrize("kind,says", [("folder", "is a folder, not a regular file"), ("fifo", "is a FIFO, not a regular file"),
                                       ("loop", "is a symbolic link that loops"),
                                       ("dangling", "is a symbolic link that leads nowhere"), ("absent", "not found")])
def test_a_datalist_that_is_no_regular_file_says_what_it_is(tmp_path, kind, says):
    import os

    from fedmed.data.images import DataError

    from fedmed.data.datalists import load_datalist
    from fedmed.site.settings import SiteConfigError, resolve_site_settings

    f = tmp_path / "site-1.json"
    {"folder": lambda: f.mkdir(), "fifo": lambda: os.mkfifo(f), "loop": lambda: f.symlink_to(f),
     "dangling": lambda: f.symlink_to(tmp_path / "nowhere"), "absent": lambda: None}[kind]()
    with pytest.raises(DataError) as e:
        load_datalist(f, name="site-1: datalist")
    assert str(e.value) == f"site-1: datalist: datalist {says}" and e.value.public == f"datalist: {says}"
    with pytest.raises(SiteConfigError, match="the datalist named by FEDMED_DATALIST " +
                       ("does not exist" if kind == "absent" else says)):
        resolve_site_settings("site-1", env={"FEDMED_DATALIST": str(f)})


def test_3d_check_data_says_what_is_wrong_with_each_volume(tmp_path):
    """``fedmed check-data`` on a segmentation datalist: a text file, a truncated NIfTI, a 4-D volume and a missing
    file each get their own reason (they all read "missing or not a readable NIfTI")."""
    import gzip

    import nibabel as nib

    from fedmed.site.check import check_datalist

    good = tmp_path / "ok.nii.gz"
    nib.save(nib.Nifti1Image(np.ones((4, 4, 4), np.float32), np.eye(4)), good)
    (tmp_path / "text.nii.gz").write_text("not a volume")
    (tmp_path / "cut.nii.gz").write_bytes(gzip.compress(gzip.decompress(good.read_bytes())[:400]))  # voxels cut
    nib.save(nib.Nifti1Image(np.ones((4, 4, 4, 2), np.float32), np.eye(4)), tmp_path / "four.nii.gz")
    (tmp_path / "notnifti.png").write_bytes(b"x")
    entries = [{"image": [str(tmp_path / n)], "label": str(good)} for n in
               ("text.nii.gz", "cut.nii.gz", "four.nii.gz", "gone.nii.gz", "notnifti.png")]
    (tmp_path / "dl.json").write_text(json.dumps({"training": entries, "validation": [], "test": []}))
    rep = check_datalist(tmp_path / "dl.json", task="segmentation")
    got = "\n".join(rep["problems"])
    assert "text.nii.gz: image file cannot be read: not a readable NIfTI" in got, got
    assert "cut.nii.gz: image file's voxels cannot be read: damaged or truncated" in got, got
    assert "four.nii.gz: image file should be a 3-D volume, got 4" in got, got
    assert "gone.nii.gz: image file not found" in got and "notnifti.png: image file is not a NIfTI file" in got, got
    assert str(tmp_path) not in got


def test_a_bundle_that_does_not_read_is_one_line_never_a_traceback(tmp_path, capsys):
    from fedmed.cli.main import main

    b = tmp_path / "b"
    (b / "configs").mkdir(parents=True)
    (b / "configs" / "inference.json").write_text(json.dumps({"network_def": {
        "_target_": "monai.networks.nets.DenseNet121", "spatial_dims": 2, "in_channels": 1, "out_channels": 10}}))
    for meta in ({"network_data_format": ["not", "a", "mapping"]}, ["a", "list"], "{not json"):
        (b / "configs" / "metadata.json").write_text(meta if isinstance(meta, str) else json.dumps(meta))
        cfg = tmp_path / "c.yaml"
        cfg.write_text(f"name: x\ndataset: {{path: 'builtin:digits', classes: {CLASSES}}}\nmodel: {{bundle: '{b}'}}\n")
        assert main(["experiment", str(cfg), "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "model.bundle b" in err[0] and "Traceback" not in err[0], err
