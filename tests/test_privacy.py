"""The payload audit (docs/privacy.md): every site task of every workflow, run on small real data, replies only with
documented aggregate fields, and no reply value equals — or is closer than a tolerance to — any single sample's
image, embedding, latent or per-image value. A negative control shows the audit catches a per-sample reply."""

import json
import math
import re

import numpy as np
import pytest
import torch

from fedmed.data.images import discover

from fedmed.data.datalists import write_site_datalists
from fedmed.nn.models import build_model
from fedmed.data.partition import iid_partition
from fedmed.site.runner import SiteRunner
from fedmed.nn.train import get_params, latents, set_params

from conftest import own_site, shared_path, flux_section, mae_section, signature_section

# what each task may send besides model parameters (the reply's meta) — docs/privacy.md
EVAL = {"n_test", "confusion", "score_hist", "withheld", "val_n_test", "val_confusion", "val_score_hist", "val_withheld"}
FIELDS = {
    "train": EVAL | {"n_train", "train_loss", "steps"},
    "validate": EVAL,
    "finetune_local": EVAL | {"n_train", "train_loss", "steps"},  # the site's own model: its scores only
    "validate_ensemble": EVAL,
    "serve_score": {"serving", "reference", "finetune_train_loss", "not_scored"},  # per candidate: n, the sums of
    # the per-image Brier-score differences and their squares (>= k_min items) and wins / losses where none is
    # below k_min; not_scored: fedmed's own reason a candidate was not scored (no count, no name)
    # halves / halves_n: two means of >= k_min images each and their sizes ("do the sites differ?")
    "signature/fmcl": {"classes", "means", "counts", "withheld_classes", "notes", "dp", "encoder", "n_train", "halves",
                       "halves_n"},
    "signature/pacfl": {"basis", "classes", "withheld_classes", "notes", "dp", "encoder", "n_train", "halves",
                        "halves_n"},
    "signature/fecfl": {"mean", "withheld_classes", "notes", "dp", "encoder", "n_train", "halves", "halves_n"},
    "latent_bounds": {"lo", "hi", "notes"},
    "descriptor": {"full", "label_free", "n_samples", "warnings", "dp"},
    "ifca": EVAL | {"cluster", "losses", "n_train", "train_loss", "steps"},
    "assess": {"n_cases", "dp", "embedding_centroid", "encoder", "notes"},
    "class_set": {"classes", "notes"},
    "norm_stats": {"n_train", "n_batches"},  # the parameters: per batch-norm layer a per-channel mean and variance
    "mae/train": {"n_train", "train_loss", "steps"},
    "mae/validate": {"n_test"},
}


def _rows(a) -> np.ndarray:
    a = np.asarray(a, dtype=np.float64)
    return a.reshape(1, -1) if a.ndim == 1 else a.reshape(-1, a.shape[-1]) if a.ndim >= 2 else a.reshape(1, 1)


def closest(reply_vectors, samples) -> float:
    """Smallest relative distance ||r - s|| / ||s|| between any reply vector and any sample of the same length;
    for unit vectors (subspace bases) also 1 - |cos|."""
    best = math.inf
    for r in _rows(reply_vectors):
        for S in samples:
            S = _rows(S)
            if S.shape[1] != r.size:
                continue
            d = np.linalg.norm(S - r, axis=1) / np.maximum(np.linalg.norm(S, axis=1), 1e-12)
            cos = np.abs(S @ r) / np.maximum(np.linalg.norm(S, axis=1) * np.linalg.norm(r), 1e-12)
            best = min(best, float(d.min()), float((1 - cos).min()))
    return best


ABS_PATH = re.compile(r"(?:^|[\s'\"(\[=:,])/(?:[\w.+-]+/)+")


COUNTS = re.compile(r"\{\s*\d+\s*:\s*\d+|counts?\s*\{")  # "sample counts {1: 1, 2: 1}"


def _strings(v):
    if isinstance(v, str):
        yield v
    elif isinstance(v, dict):
        for x in v.values():
            yield from _strings(x)
    elif isinstance(v, (list, tuple)):
        for x in v:
            yield from _strings(x)


def audit(task: str, meta: dict, samples: list, *, k_min: int, tol: float = 1e-3) -> list[str]:
    """Problems of one reply: undocumented fields, values that are single samples, rows below k_min, text that
    names an absolute path (a site's folders never leave it)."""
    problems = []
    for key, value in meta.items():
        if any(ABS_PATH.search(t) for t in _strings(value)):
            problems.append(f"{task}: {key} carries an absolute path")
        if key in ("notes", "warnings", "error") and any(COUNTS.search(t) for t in _strings(value)):
            problems.append(f"{task}: {key} carries per-class counts")
    # "notes": lines for the server's log (what the site withheld or converted), on any reply (docs/privacy.md);
    # "site_policy": the site's effective policy (its own settings, no data), on a run's first reply
    extra = set(meta) - FIELDS[task] - {"task", "round", "cluster", "error", "notes", "site_policy"}
    if extra:
        problems.append(f"{task}: undocumented fields {sorted(extra)}")
    for key, value in meta.items():
        if key in ("notes", "warnings", "dp", "encoder", "classes", "withheld_classes", "task", "site_policy") \
                or isinstance(value, str):
            continue
        arr = np.asarray(value, dtype=np.float64) if not isinstance(value, dict) else None
        if arr is None or arr.size < 2:
            continue
        if key in ("confusion", "val_confusion"):
            sums = arr.sum(axis=1)
            if ((sums > 0) & (sums < k_min)).any():
                problems.append(f"{task}: {key} has a row of fewer than k_min={k_min} samples")
            continue
        if key in ("score_hist", "val_score_hist", "losses", "counts"):
            continue  # counts over >= k_min samples (checked through the confusion rows) / aggregate losses
        rows = arr.T if key == "basis" else arr
        if closest(rows, samples) < tol:
            problems.append(f"{task}: {key} is (close to) a single sample's data")
        if key in ("lo", "hi"):  # element-wise: a coordinate that is exactly one sample's value
            for S in samples:
                S = _rows(S)
                if S.shape[1] == arr.size and (np.abs(S - arr[None]).min(axis=0) < 1e-9 * (1 + np.abs(arr))).mean() > 0.5:
                    problems.append(f"{task}: {key} holds single samples' coordinates")
    return problems


@pytest.fixture(scope="module", params=["digits", "busi"])
def site(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "busi":
        pool = discover(str(shared_path("busi")), max_per_class=15, seed=0)
        size, ch = 16, 1
    else:
        pool = discover("builtin:digits", max_per_class=10, seed=0)
        size, ch = 8, 1
    write_site_datalists(pool, iid_partition(len(pool.labels), 2, 0), root, test_fraction=0.25, val_fraction=0.15)
    cfg = {"seed": 0, "data": {"image_size": size, "channels": ch, "n_classes": pool.n_classes},
           "model": {"arch": "resnet9", "width": 4, "norm": "group"},
           "train": {"local_epochs": 1, "batch_size": 8, "optimizer": "adam", "lr": 1e-3, "augment": "flip"},
           "privacy": {"k_min": 5}}
    return own_site("site-1", root), cfg  # the job's k_min=5 applies (a site's own floor: test_policy.py)


def _samples(runner, cfg, params=None, encoder=None):
    """The site's own per-sample data at the task's resolution: images, and embeddings / latents when given."""
    from fedmed.nn.encoders import build_encoder, extract_features

    s = runner.splits(cfg)
    x = torch.cat([s.train[0], s.val[0], s.test[0]])
    out = [x.reshape(len(x), -1).numpy()]
    if encoder:
        out.append(extract_features(build_encoder(encoder, in_channels=cfg["data"]["channels"]), x))
    if params is not None:
        m = runner.model(cfg)
        set_params(m, params)
        out.append(latents(m, x))
    return out


def params_of(cfg):
    d = cfg["data"]
    return get_params(build_model("resnet9", d["channels"], d["n_classes"], width=4, norm="group"))


def test_training_and_evaluation_replies(site):
    runner, cfg = site
    p = params_of(cfg)
    samples = _samples(runner, cfg, p)
    for task in ("train", "validate", "finetune_local"):  # finetune_local: the site's own model, only its scores
        _, metrics, meta, out = runner.handle(task, p, cfg, 0)
        assert not audit(task, meta, samples, k_min=5)
        assert task == "train" or out == {}
        assert all(isinstance(v, float) for v in metrics.values())
    packed = {f"m{k}/{n}": v for k in range(2) for n, v in p.items()}
    for task, extra in (("ifca", {"method_options": {"k": 2, "train": True}}), ("validate_ensemble", {"method_options": {"weights": [1, 1]}})):
        _, _, meta, _ = runner.handle(task, packed, {**cfg, **extra}, 0)
        assert not audit(task, meta, samples, k_min=5), task
    opts = {"names": ["global", "cluster"], "finetune": {"epochs": 1, "lr_scale": 0.1}}
    _, metrics, meta, out = runner.handle("serve_score", packed, {**cfg, "method_options": opts}, 0)
    assert not audit("serve_score", meta, samples, k_min=5) and out == {}
    n_val = runner.splits(cfg).val[0].shape[0]
    for name, counts in meta["serving"].items():  # per candidate two sums over the whole validation split and the
        # counts where none is below k_min (#86), or nothing (under k_min items; a candidate not scored, with why)
        if n_val < 5 or counts is None:
            assert counts is None and (n_val < 5 or name in meta["not_scored"])
            continue
        assert {"n", "sum_d", "sum_d2"} <= set(counts) <= {"n", "wins", "losses", "sum_d", "sum_d2"}
        assert counts["n"] == n_val and ("wins" not in counts or min(counts["wins"], counts["losses"],
                                                                    n_val - counts["wins"] - counts["losses"]) >= 5)
        assert all(isinstance(counts[k], float) for k in ("sum_d", "sum_d2"))
        assert counts["sum_d2"] >= counts["sum_d"] ** 2 / n_val - 1e-9  # a sum of squares over n_val items


def test_batch_norm_statistics_replies(site):
    """train.norm_recalibrate's task: per batch-norm layer of the served model, the per-channel mean and variance
    over the site's training images (a cumulative average over its batches) as the parameters, and its counts;
    nothing under DP; a site below k_min sits out."""
    from fedmed.site.tasks import TaskError

    runner, cfg = site
    bcfg = {**cfg, "model": {**cfg["model"], "norm": "batch"}}
    d = cfg["data"]
    p = get_params(build_model("resnet9", d["channels"], d["n_classes"], width=4, norm="batch"))
    _, metrics, meta, out = runner.handle("norm_stats", p, bcfg, 0)
    assert not audit("norm_stats", meta, _samples(runner, bcfg), k_min=5)
    n = runner.splits(bcfg).train[0].shape[0]
    assert {k: v for k, v in meta.items() if k not in ("site_policy", "notes")} == \
        {"n_train": n, "n_batches": math.ceil(n / 8)} and metrics == {"n_batches": float(meta["n_batches"])}
    assert out and set(out) == {k for k in p if k.endswith(("running_mean", "running_var"))}
    assert all(np.asarray(v).ndim == 1 for v in out.values())  # one value per channel, never per image
    with pytest.raises(TaskError, match="not sent under differential privacy"):
        runner.handle("norm_stats", p, {**bcfg, "privacy": {"k_min": 5, "dp_epsilon": 1.0}}, 0)
    with pytest.raises(TaskError, match="sits out batch-norm statistics: fewer training images than k_min"):
        runner.handle("norm_stats", p, {**bcfg, "privacy": {"k_min": n + 1}}, 0)


def test_prep_and_fedmae_replies(site):
    """PreP-WFL's statistics round sends class ids only (of classes with >= k_min images); Fed-MAE sends the model
    and aggregate losses."""
    from fedmed.site.mae import MAESiteRunner

    runner, cfg = site
    _, metrics, meta, params = runner.handle("class_set", {}, cfg)
    assert params == {} and not audit("class_set", meta, [], k_min=5)
    y = runner.splits(cfg).train[1].numpy()
    assert meta["classes"] == sorted(int(c) for c in np.unique(y) if (y == c).sum() >= 5)
    assert set(metrics) == {"n_classes_held"}
    mcfg = {**cfg, "task": "mae", "data": {**cfg["data"], "image_size": 32}, "method_options": mae_section(1)}
    mae = MAESiteRunner("site-1", runner.settings)
    samples = _samples(mae, mcfg)
    p = get_params(mae.model(mcfg))
    for task in ("train", "validate"):
        _, metrics, meta, out = mae.handle(task, p, mcfg, 0)
        assert not audit(f"mae/{task}", meta, samples, k_min=5), task
        assert all(isinstance(v, float) and np.isfinite(v) for v in metrics.values())
        assert set(out) in (set(), set(p))


@pytest.mark.parametrize("kind,encoder", [("fmcl", "random_cnn"), ("pacfl", "pixels"), ("pacfl", "random_cnn"),
                                          ("fecfl", "random_cnn")])
def test_signature_replies(site, kind, encoder):
    runner, cfg = site
    samples = _samples(runner, cfg, encoder=encoder if encoder != "pixels" else None)
    _, _, meta, _ = runner.handle("signature", {}, {**cfg, "signature": signature_section(kind, encoder, halves=True)})
    assert not audit(f"signature/{kind}", meta, samples, k_min=5), meta.get("notes")
    # the split-half means: two aggregates of >= k_min images, never on raw pixels
    assert ("halves" in meta) is (encoder != "pixels")
    if encoder != "pixels":
        assert min(meta["halves_n"]) >= 5 and sum(meta["halves_n"]) == meta["n_train"]


def test_flux_replies(site):
    runner, cfg = site
    p = params_of(cfg)
    samples = _samples(runner, cfg, p)
    _, _, b, _ = runner.handle("latent_bounds", p, {**cfg, "method_options": flux_section()})
    assert not audit("latent_bounds", b, samples, k_min=5)
    flux = flux_section(lo=np.asarray(b["lo"]).tolist(), hi=np.asarray(b["hi"]).tolist(), n_components=5)
    from fedmed.algorithms.flux import shared_pca

    proj = shared_pca(np.asarray(flux["lo"]), np.asarray(flux["hi"]), n_components=5).project(samples[-1])
    for label_free in (False, True):
        _, _, d, _ = runner.handle("descriptor", p, {**cfg, "method_options": {**flux, "label_free": label_free}})
        assert not audit("descriptor", d, samples + [proj], k_min=5)


def test_signature_with_a_weights_file_names_no_folder(site, tmp_path):
    """An encoder loaded from a file of the site's weights folder is described by file name and hash, not by its
    path."""
    from fedmed.core.policy import weights_ref
    from fedmed.nn.encoders import build_encoder

    runner, cfg = site
    f = tmp_path / "deep" / "folder" / "enc.pt"
    f.parent.mkdir(parents=True)
    torch.save(build_encoder("random_cnn", seed=3, in_channels=cfg["data"]["channels"]).module.state_dict(), f)
    runner = own_site("site-1", runner.settings.datalist.parent, k_min=5, weights_dir=f.parent)
    _, _, meta, _ = runner.handle("signature", {}, {**cfg, "encoder_weights": weights_ref(f),
                                                 "signature": {"kind": "fmcl", "encoder": "random_cnn"}})
    assert "enc.pt (sha256 " in meta["encoder"]
    assert not audit("signature/fmcl", meta, [], k_min=5)
    assert audit("signature/fmcl", {**meta, "encoder": f"weights {f}"}, [], k_min=5)  # negative control


def test_the_audit_catches_a_per_sample_reply(site):
    """Negative control: with k_min = 1 a one-image class's FMCL 'mean' is that image's embedding, and S1's exact
    minimum/maximum are single samples' values — the audit must flag it."""
    from fedmed.nn.encoders import build_encoder, extract_features
    from fedmed.algorithms.privacy import private_bounds, signature_payload

    runner, cfg = site
    s = runner.splits(cfg)
    feats = extract_features(build_encoder("random_cnn"), s.train[0])
    y = s.train[1].numpy().copy()
    y[0] = 99  # a class holding exactly one image
    meta = signature_payload("fmcl", feats, y, k_min=1, privacy={})
    assert audit("signature/fmcl", meta, [feats], k_min=1)
    meta5 = signature_payload("fmcl", feats, y, k_min=5, privacy={})
    assert 99 in meta5["withheld_classes"] and not audit("signature/fmcl", meta5, [feats], k_min=5)
    z = latents(runner.model(cfg), s.train[0])
    lo, hi, _ = private_bounds(z, k_min=1, privacy={})  # the paper's exact min / max
    assert audit("latent_bounds", {"lo": lo, "hi": hi}, [z], k_min=1)
    lo, hi, _ = private_bounds(z, k_min=5, privacy={})
    assert not audit("latent_bounds", {"lo": lo, "hi": hi}, [z], k_min=5)


def test_segmentation_replies(tmp_path):
    from fedmed.data.phantoms import write_phantom_subjects
    from fedmed.data.nifti import load_case
    from fedmed.nn.seg import seg_model
    from fedmed.data.seg_federation import discover_subjects, write_seg_federation
    from fedmed.site.seg import SegSiteRunner

    root = write_phantom_subjects(tmp_path / "ph", [2, 3, 4, 5, 6, 7, 8, 9], size=24)
    entries = discover_subjects(root, {"FLAIR": "Flair*", "T1c": "T1c*"}, "OTMultiClass*", "brainmask*")
    out = write_seg_federation(entries, 2, tmp_path / "fed", test_fraction=0.25)
    cfg = {"task": "segmentation", "seed": 0, "data": {"shape": [16, 16, 16], "roi": [16, 16, 16], "in_channels": 2},
           "model": {"channels": [4, 8, 16]}, "privacy": {"k_min": 3},
           "train": {"local_epochs": 1, "optimizer": "adam", "lr": 1e-3, "seg": {"patches_per_volume": 1}},
           "method_options": {"per_value": True}}  # the job asks for per-image values; the site does not allow them
    runner = own_site("site-1", out, k_min=3, cls=SegSiteRunner)
    doc = json.loads((out / "site-1.json").read_text())
    cases = [load_case(e, shape=(16, 16, 16)) for e in doc["training"]]
    from fedmed.nn.encoders import build_encoder
    from fedmed.nn.encoders import site_embeddings

    per_case = [np.stack([c["image"].ravel() for c in cases]),
                site_embeddings(cases, build_encoder("medicalnet_resnet18"))]
    _, _, meta, _ = runner.handle("assess", {}, cfg)
    assert "per-image metadata requested by the job but not allowed" in meta["notes"][0]
    hist = {k: v for k, v in meta.items() if k.startswith(("intensity__", "label__", "edges__"))}
    assert hist and all(not k.startswith("intensity__") or len(np.asarray(v)) > len(cases) for k, v in hist.items())
    rest = {k: v for k, v in meta.items() if k not in hist}
    assert not audit("assess", rest, per_case, k_min=3)
    p = get_params(seg_model(2, channels=(4, 8, 16)))
    _, metrics, meta, _ = runner.handle("train", p, cfg, 0)
    assert set(meta) <= {"n_test", "n_train", "train_loss"}


# ------------------------------------------------------------------------------------------------- names and paths

HOSPITAL_FOLDERS = ["PACS export/Doe John MRN12345", "Müller, Jörg (MRN 1,2)", "O'Brien \"Pat\" (MRN 77)",
                    "scans, 2024/Ünal Ayşe"]


@pytest.mark.parametrize("folder", HOSPITAL_FOLDERS)
def test_scrub_removes_a_whole_absolute_path_whatever_it_holds(folder):
    """An absolute path leaves a message whole — spaces, parentheses, commas, quotes and non-ASCII included: outside
    the site's roots only the file's name stays, under its data root the path relative to it."""
    from fedmed.site.settings import scrub

    path = f"/mnt/{folder}/T1c.nii.gz"
    secrets = [w for w in re.split(r"[\s/(),'\"]+", folder) if len(w) >= 3]
    for msg in (f"site-2: T1c image file {path} not found",
                f"[Errno 2] No such file or directory: {path!r}",
                f"cannot read \"{path}\": bad header; see {path}.",
                f"{path}: shape (1, 2) (expected 3/4)\nnext line stays"):
        out = scrub(msg, ["/data/site root"])
        assert not [w for w in secrets if w in out], (msg, out)
        assert "/mnt" not in out and "next line stays" in out or "T1c" in out
    # greedy on purpose: a later "/" on the same line takes the text before it along (never a folder name)
    assert scrub(f"{path}: shape (1, 2) (expected 3/4)\nnext line stays", []) == "4)\nnext line stays"
    assert scrub(f"{path} x\nnext line stays", []) == "T1c.nii.gz x\nnext line stays"
    root = f"/srv/{folder}"
    assert scrub(f"cannot read image {root}/sub dir/a b.png (corrupt)", [root]) == \
        "cannot read image sub dir/a b.png (corrupt)"
    assert scrub(f"see ~/{folder}/x.png, then", []) == "see x.png, then"
    assert scrub("ratio 1/3 and a/b/c.png stay", []) == "ratio 1/3 and a/b/c.png stay"  # relative: kept


def test_a_sites_error_reply_names_no_folder_outside_its_data_root(tmp_path):
    """The probe's case end to end: a datalist naming an image under a folder with a patient's name and record number
    — the error a site sends (what the server's log and metrics.json receive) keeps none of it."""
    from fedmed.site import reply as client

    root = tmp_path / "site data (MRI), ünïcode"
    root.mkdir()
    outside = tmp_path / "PACS export" / "Doe John MRN12345"
    outside.mkdir(parents=True)
    doc = {"training": [{"image": str(outside / "T1c.png"), "label": 0}], "validation": [], "test": []}
    (root / "site-2.json").write_text(json.dumps(doc))
    runner = SiteRunner("site-2", root)
    cfg = {"seed": 0, "data": {"image_size": 8, "channels": 1, "n_classes": 2}, "privacy": {"k_min": 1},
           "model": {"arch": "resnet9", "width": 4}, "train": {"local_epochs": 1, "batch_size": 2}}
    with pytest.raises(Exception) as err:
        runner.splits(cfg)
    msg = client.scrubbed("site-2", runner, err.value)
    assert msg == "site-2: training[0]: cannot read the image (file not found)"  # the position, no name
    assert "T1c.png" in client.local_message("site-2", runner, err.value)  # the site's own log names the file
    doc["training"][0]["image"] = "sub folder/T1c.png"  # under the data root
    (root / "site-2.json").write_text(json.dumps(doc))
    runner = SiteRunner("site-2", root)
    with pytest.raises(Exception) as err:
        runner.splits(cfg)
    assert client.scrubbed("site-2", runner, err.value) == "site-2: training[0]: cannot read the image (file not found)"
    assert "sub folder/T1c.png" in client.local_message("site-2", runner, err.value)
    from fedmed.site.settings import redact_strings

    reply = redact_strings({"notes": [f"wrote {outside}/x.png"], "dp": {"why": f"see {root}/a b.txt"}},
                           runner.private_tokens)
    assert reply["notes"] == ["wrote <path>"] and reply["dp"]["why"].startswith("see <path>")
    assert not [w for w in ("site data", "MRI", "ünïcode", "PACS", "Doe", "MRN") if w in json.dumps(reply)]


# ------------------------------------------------------------------------------------------------- k_min on every reply

def _tiny_site(tmp_path, n_train, *, k_min=5, n_test=6):
    pool = discover("builtin:digits", max_per_class=10, seed=0)
    idx = np.arange(n_train + n_test)
    write_site_datalists(pool.subset(idx), [idx], tmp_path, test_fraction=n_test / (n_train + n_test), seed=0)
    cfg = {"seed": 0, "data": {"image_size": 8, "channels": 1, "n_classes": pool.n_classes},
           "model": {"arch": "resnet9", "width": 4, "norm": "group"},
           "train": {"local_epochs": 1, "batch_size": 8, "optimizer": "adam", "lr": 1e-3, "augment": "flip"},
           "privacy": {"k_min": k_min}}
    return own_site("site-1", tmp_path), cfg  # the job's k_min applies (the site's floor: test_policy.py)


def test_a_site_below_k_min_sends_no_update_and_no_loss(tmp_path):
    """A one-image site used to send the update trained on that image and its train_loss (n_train 1). It sits out
    every training task with its reason; with the job's k_min met it trains."""
    from fedmed.site.runner import TaskError

    runner, cfg = _tiny_site(tmp_path, 1)
    assert runner.splits(cfg).train[0].shape[0] == 1
    p = params_of(cfg)
    for task, extra in (("train", {}), ("ifca", {"method_options": {"k": 2, "train": True}}),
                        ("ifca", {"method_options": {"k": 2, "train": False}})):
        params = p if task == "train" else {f"m{k}/{n}": v for k in range(2) for n, v in p.items()}
        with pytest.raises(TaskError, match=r"site-1: sits out .*fewer training images than k_min=5"):
            runner.handle(task, params, {**cfg, **extra}, 0)
    ok = dict(cfg, privacy={"k_min": 1, "accept_k_min_below_2": True})  # consented: the paper's form
    _, metrics, meta, out = runner.handle("train", p, ok, 0)
    assert meta["n_train"] == 1 and set(out) == set(p)
    site_k, _ = _tiny_site(tmp_path / "big", 6)
    _, _, meta, out = site_k.handle("train", p, cfg, 0)
    assert meta["n_train"] == 6 and set(out) == set(p)


def test_fedmae_and_segmentation_sites_below_k_min_sit_out(tmp_path):
    from fedmed.site.runner import TaskError
    from fedmed.site.mae import MAESiteRunner

    runner, cfg = _tiny_site(tmp_path, 2, n_test=3)
    mcfg = {**cfg, "task": "mae", "data": {**cfg["data"], "image_size": 32}, "method_options": mae_section(1)}
    mae = MAESiteRunner("site-1", runner.settings)
    p = get_params(mae.model(mcfg))
    with pytest.raises(TaskError, match="sits out training: fewer training images than k_min=5"):
        mae.handle("train", p, mcfg, 0)
    _, metrics, _, _ = mae.handle("validate", p, mcfg, 0)
    assert metrics == {}  # 3 test images, 0 validation images: no loss over fewer than k_min images

    from fedmed.data.phantoms import write_phantom_subjects
    from fedmed.nn.seg import seg_model
    from fedmed.data.seg_federation import discover_subjects, write_seg_federation
    from fedmed.site.seg import SegSiteRunner

    root = write_phantom_subjects(tmp_path / "ph", [2, 3, 4, 5], size=24)
    entries = discover_subjects(root, {"FLAIR": "Flair*", "T1c": "T1c*"}, "OTMultiClass*", "brainmask*")
    out = write_seg_federation(entries, 2, tmp_path / "fed", test_fraction=0.25)
    scfg = {"task": "segmentation", "seed": 0, "data": {"shape": [16, 16, 16], "roi": [16, 16, 16], "in_channels": 2},
            "model": {"channels": [4, 8, 16]}, "privacy": {"k_min": 3},
            "train": {"local_epochs": 1, "optimizer": "adam", "lr": 1e-3, "seg": {"patches_per_volume": 1}}}
    seg = own_site("site-1", out, cls=SegSiteRunner)  # 3 training subjects over 2 sites, 1 test subject
    sp = get_params(seg_model(2, channels=(4, 8, 16)))
    with pytest.raises(TaskError, match="sits out training: fewer training subjects than k_min=3"):
        seg.handle("train", sp, scfg, 0)
    _, metrics, meta, _ = seg.handle("validate", sp, scfg, 0)  # one test subject < k_min: no scores leave
    assert metrics == {} and meta["n_test"] == 0


def test_withheld_classes_are_named_without_their_counts(tmp_path):
    """The server's log received 'sample counts {1: 1, 2: 1}': counts below k_min are statistics of fewer than k_min
    samples. The note names the classes and the rule only."""
    from fedmed.algorithms.privacy import signature_payload

    feats = np.random.default_rng(0).normal(size=(12, 4))
    y = np.array([0] * 10 + [1, 2])
    meta = signature_payload("fmcl", feats, y, k_min=5, privacy={}, site="site-3")
    assert meta["withheld_classes"] == [1, 2]
    (note,) = meta["notes"]
    assert "[1, 2]" in note and "k_min=5" in note and "count" not in note and ": 1" not in note
    assert "1}" not in note


def test_a_consented_k_min_below_2_is_stated_in_the_setup_the_console_and_the_record(tmp_path):
    from fedmed.algorithms.privacy import k_min_consent_note

    assert k_min_consent_note({"k_min": 2}) is None
    note = k_min_consent_note({"k_min": 1, "accept_k_min_below_2": True})
    assert "WARNING" in note and "k_min=1" in note and "single" in note


# ------------------------------------------------------------------------------------------------ ids of every form
PLANTED_IDS = ["4711", "12", "7", "Wa", "Wang", "Grace", "Ali", "Doe", "Brown", "Doe_Jane_MRN12345"]


@pytest.mark.parametrize("planted", PLANTED_IDS)
def test_no_id_of_a_3d_site_leaves_it_whatever_its_length_or_spelling(tmp_path, planted):
    """A 3D site's errors name positions and kinds in fedmed's own words: a subject or case id — numeric, one or two
    characters, a common word of fedmed's own source, a patient name — never leaves, and a job that lists the id as
    one of its classes gets nothing back for it (no membership oracle)."""
    from fedmed.site.reply import answer
    from fedmed.site.settings import settings_for_dir

    root = tmp_path / "data"
    root.mkdir()
    lab = str(root / f"{planted}_seg.nii.gz")
    cases = {
        # the same subject in training and test: subject leakage
        "leak": {"training": [{"image": [str(root / f"{planted}_t1.nii.gz")], "label": lab, "subject": planted}],
                 "validation": [],
                 "test": [{"image": [str(root / f"{planted}_t1b.nii.gz")], "label": lab, "subject": planted}]},
        # a case that lists no image files, and one whose files are missing
        "empty": {"training": [{"image": [], "label": lab, "id": planted, "subject": "s1"}], "validation": [],
                  "test": [{"image": [str(root / "x.nii.gz")], "label": str(root / "y.nii.gz"), "subject": "s2"}]},
        "missing": {"training": [{"image": [str(root / planted / "t1.nii.gz")], "label": lab, "id": planted,
                                  "subject": planted}], "validation": [],
                    "test": [{"image": [str(root / "x.nii.gz")], "label": str(root / "y.nii.gz"), "subject": "s2"}]},
    }
    cfg = {"task": "segmentation", "seed": 0, "classes": [planted, "tumour"], "model": {"arch": "unet",
           "channels": [4, 8]}, "privacy": {"k_min": 1}, "data": {"in_channels": 1, "shape": [8, 8, 8],
                                                                     "roi": [8, 8, 8]}}
    for kind, doc in cases.items():
        (root / "site-1.json").write_text(json.dumps(doc))
        _, (_, metrics, meta, _), local = answer("site-1", None, "train", {}, cfg, 0,
                                            settings=settings_for_dir("site-1", root))
        err = meta["error"]
        assert metrics == {"failed": 1.0} and err.startswith("site-1: "), err
        assert not re.search(rf"(?<![A-Za-z0-9]){re.escape(planted)}(?![A-Za-z0-9])", err.replace("site-1", "")), \
            (kind, err)
        assert planted in local  # the site's own log names it
    assert "subject leakage" in err or "not found" in err


def test_redaction_never_touches_fedmeds_own_text(tmp_path):
    """What leaves a site is fedmed's own text plus positions and kinds: its refusal lines name the setting that
    refused (``local/fedmed_policy.json``, ``['random_cnn']``), its encoder description keeps its formula, a URL is
    redacted whole (never ``https:<path>``); a path or a name of the site's data is still replaced."""
    from fedmed.site.settings import redact

    own = ["site-1: PolicyError: encoder 'vit_tiny' is not among the encoders this site runs (encoders of this site's "
           "policy (default; local/fedmed_policy.json sets it): ['random_cnn'])",
           "random_cnn: seeded random CNN (seed 0), input (x - 0.5) / 0.25, 128-d features",
           "the cache is in local/fedmed_cache; models/model.pt and configs/inference.json are the bundle's"]
    for text in own:
        assert redact(text, {"Doe_Jane_MRN12345"}) == text
    assert redact("weights from https://example.org/w.pt refused") == "weights from <path> refused"
    assert redact("site-1: cannot read 'Doe_Jane_MRN12345/scan.png' (Doe_Jane_MRN12345)", {"Doe_Jane_MRN12345"}) == \
        "site-1: cannot read <path> (<name>)"
    from fedmed.nn.encoders import build_encoder

    desc = build_encoder("random_cnn", seed=0).description
    assert redact(desc) == desc and "<path>" not in desc
