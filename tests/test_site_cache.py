"""A site's cache of decoded data (fedmed.site.cache): later runs skip decoding; a changed file or setting never
hits an old entry; each site has its own folder; it can be turned off and cleared."""

import json

import numpy as np
import pytest

from fedmed.cli.main import main
from fedmed.data.images import discover
from fedmed.data.datalists import write_site_datalists
from fedmed.data.partition import iid_partition
from fedmed.site.runner import SiteRunner


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("FEDMED_CACHE_DIR", str(d))
    return d


def federation(root):
    """Two sites of digits with training, validation and test splits (three cache entries per site)."""
    pool = discover("builtin:digits", max_per_class=6)
    write_site_datalists(pool, iid_partition(len(pool.labels), 2, 0), root, test_fraction=0.25, val_fraction=0.2,
                         seed=0)
    for s in ("site-1", "site-2"):
        assert all(json.loads((root / f"{s}.json").read_text())[k] for k in ("training", "validation", "test"))


def test_a_later_run_reads_the_cache_and_gets_the_same_data(tmp_path, cache_dir, monkeypatch):
    federation(tmp_path / "data")
    first = SiteRunner("site-1", tmp_path / "data")
    a = first.data(12, 1)
    assert first.cache.hits == 0 and first.cache.misses == 3
    second = SiteRunner("site-1", tmp_path / "data")  # a later run: a new process, the same files
    import fedmed.site.runner as R

    monkeypatch.setattr(R, "load_images", lambda *a, **k: pytest.fail("decoded again"))
    b = second.data(12, 1)
    assert second.cache.hits == 3
    for x, y in ((a.train, b.train), (a.val, b.val), (a.test, b.test)):
        assert np.array_equal(x[0].numpy(), y[0].numpy()) and np.array_equal(x[1].numpy(), y[1].numpy())
    assert second.notes == first.notes  # what was converted is still said
    assert sorted(d.name for d in cache_dir.iterdir()) == ["site-1"]  # the site's own folder only


def test_a_cold_and_a_warm_cache_train_to_the_same_weights(tmp_path, cache_dir):
    """#38 "the same seed does not give the same numbers": two identical BUSI FedAvg runs differed (49.36% vs 50.00%)
    because freshly decoded RGB images kept a channels-last layout (a stack of HWC->CHW views) while the cache handed
    back C-contiguous arrays, and a convolution sums in another order over the two layouts. Both now give the same
    layout, and a training step from either gives bit-identical weights."""
    import torch

    from fedmed.nn.models import build_model
    from fedmed.nn.train import train_local

    federation(tmp_path / "data")
    cold = SiteRunner("site-1", tmp_path / "data").data(16, 3)
    warm_runner = SiteRunner("site-1", tmp_path / "data")
    warm = warm_runner.data(16, 3)
    assert warm_runner.cache.hits == 3
    x_cold, x_warm = cold.train[0], warm.train[0]
    assert x_cold.stride() == x_warm.stride() and x_cold.is_contiguous()
    weights = []
    for x, y in (cold.train, warm.train):
        model = build_model("resnet9", 3, 10, width=8, seed=0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        train_local(model, x, y, epochs=1, batch_size=8, optimizer=opt, generator=torch.Generator().manual_seed(0))
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.equal(weights[0], weights[1])


def test_a_changed_file_or_setting_is_decoded_again(tmp_path, cache_dir):
    from PIL import Image

    federation(tmp_path / "data")
    before = SiteRunner("site-1", tmp_path / "data").data(12, 1).train[0][0].numpy()
    other_size = SiteRunner("site-1", tmp_path / "data")
    other_size.data(16, 1)
    assert other_size.cache.hits == 0
    doc = json.loads((tmp_path / "data" / "site-1.json").read_text())
    f = tmp_path / "data" / doc["training"][0]["image"]
    Image.fromarray(255 - np.asarray(Image.open(f))).save(f)  # the same name, another picture
    changed = SiteRunner("site-1", tmp_path / "data")
    after = changed.data(12, 1).train[0][0].numpy()
    assert changed.cache.hits == 2  # validation and test unchanged; training decoded again
    assert np.allclose(after, 1.0 - before, atol=0.02)  # the new picture, not the cached old one


def test_the_cache_can_be_turned_off_and_cleared(tmp_path, cache_dir, monkeypatch, capsys):
    federation(tmp_path / "data")
    SiteRunner("site-1", tmp_path / "data").data(12, 1)
    SiteRunner("site-2", tmp_path / "data").data(12, 1)
    assert main(["cache", "info"]) == 0 and "site-1: 3 entries" in capsys.readouterr().out
    assert main(["cache", "clear", "--site", "site-1"]) == 0
    assert "removed 3 cached entries" in capsys.readouterr().out
    assert not (cache_dir / "site-1").exists() and (cache_dir / "site-2").is_dir()
    monkeypatch.setenv("FEDMED_CACHE", "0")
    assert SiteRunner("site-1", tmp_path / "data").cache is None


def test_a_segmentation_case_is_cached(tmp_path, cache_dir):
    import nibabel as nib

    from fedmed.site.seg import SegSiteRunner

    rng = np.random.default_rng(0)
    for s in ("a", "b"):
        img = rng.normal(size=(12, 12, 10)).astype(np.float32) + 2
        lab = np.zeros((12, 12, 10), np.int16)
        lab[4:8, 4:8, 3:6] = 2
        nib.save(nib.Nifti1Image(img, np.eye(4)), tmp_path / f"{s}_flair.nii.gz")
        nib.save(nib.Nifti1Image(lab, np.eye(4)), tmp_path / f"{s}_label.nii.gz")
    entries = [{"image": [f"{s}_flair.nii.gz"], "label": f"{s}_label.nii.gz", "modalities": ["FLAIR"], "id": s,
                "subject": s} for s in ("a", "b")]
    (tmp_path / "site-1.json").write_text(json.dumps({"training": entries[:1], "validation": [], "test": entries[1:]}))
    cfg = {"task": "segmentation", "data": {"shape": [8, 8, 8], "roi": [8, 8, 8], "in_channels": 1}}
    first = SegSiteRunner("site-1", tmp_path)
    tr, te = first.cases(cfg)
    second = SegSiteRunner("site-1", tmp_path)
    tr2, te2 = second.cases(cfg)
    assert second.cache.hits == 2 and first.cache.hits == 0
    assert np.array_equal(tr[0]["image"], tr2[0]["image"]) and np.array_equal(te[0]["label"], te2[0]["label"])
    assert tr2[0]["meta"]["volume_mm3"] == tr[0]["meta"]["volume_mm3"] and tr2[0]["meta"]["id"] == "a"


@pytest.mark.parametrize("damage", ["zero_bytes", "truncated", "garbage"])
def test_a_damaged_entry_is_a_miss_and_is_rewritten(tmp_path, cache_dir, damage):
    federation(tmp_path / "data")
    good = SiteRunner("site-1", tmp_path / "data").data(12, 1)
    entries = sorted(cache_dir.rglob("*.npz"))
    assert len(entries) == 3
    for f in entries:  # a disk that filled up, a copy that was cut short, another program's file
        raw = f.read_bytes()
        f.write_bytes({"zero_bytes": b"", "truncated": raw[: len(raw) // 2], "garbage": b"PK\x03\x04" + raw[:40]}[damage])
    again = SiteRunner("site-1", tmp_path / "data")
    data = again.data(12, 1)  # no BadZipFile / EOFError: decoded again
    assert again.cache.hits == 0 and again.cache.misses == 3
    assert np.array_equal(data.train[0].numpy(), good.train[0].numpy())
    healed = SiteRunner("site-1", tmp_path / "data")
    healed.data(12, 1)
    assert healed.cache.hits == 3  # the entries were rewritten


def test_an_unwritable_cache_runs_uncached_and_says_so(tmp_path, monkeypatch):
    import os

    federation(tmp_path / "data")
    ro = tmp_path / "ro"
    ro.mkdir()
    monkeypatch.setenv("FEDMED_CACHE_DIR", str(ro))
    if os.geteuid() == 0:  # root writes anywhere: make the cache root a file, which no folder can be made in
        ro.rmdir()
        ro.write_text("not a folder")
    else:
        ro.chmod(0o500)
    r = SiteRunner("site-1", tmp_path / "data")
    data = r.data(12, 1)
    assert data.train[0].shape[0] > 0 and r.cache.unwritable
    assert any("its data cache cannot be written" in n and "decodes without one" in n for n in r.notes)


def test_the_cache_lives_in_the_sites_workspace_never_in_a_home_folder(tmp_path, monkeypatch):
    """Decoded patient images stay with the site: a startup kit's site caches in its kit's ``local/fedmed_cache/``, a
    site given only a datalist (no workspace) caches nothing, ``fedmed experiment`` caches in ``<out>/cache/`` (its
    later runs reuse it), ``"cache_dir": false`` turns it off — and nothing is written under the home folder of
    whoever started the site."""
    import yaml

    from fedmed.site.settings import resolve_site_settings

    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("FEDMED_CACHE_DIR", raising=False)
    federation(tmp_path / "data")
    kit = tmp_path / "kit"
    (kit / "local").mkdir(parents=True)
    (kit / "startup").mkdir()
    (kit / "local" / "fedmed_site.json").write_text(json.dumps({"datalist": str(tmp_path / "data" / "site-1.json")}))
    r = SiteRunner("site-1", resolve_site_settings("site-1", cwd=kit / "job-1", env={}))
    r.data(12, 1)
    assert r.cache.dir == kit / "local" / "fedmed_cache" / "site-1" and list(r.cache.dir.rglob("*.npz"))
    assert main(["cache", "info"]) == 0  # no folder named: says where a site's cache is, reads nothing
    (kit / "local" / "fedmed_site.json").write_text(json.dumps({"datalist": str(tmp_path / "data" / "site-1.json"),
                                                                "cache_dir": False}))
    assert SiteRunner("site-1", resolve_site_settings("site-1", cwd=kit, env={})).cache is None
    env = {"FEDMED_DATALIST": str(tmp_path / "data" / "site-2.json")}
    assert SiteRunner("site-2", resolve_site_settings("site-2", env=env)).cache is None
    cfg = {"name": "cached", "dataset": {"path": "builtin:digits", "image_size": 8, "channels": 1, "max_per_class": 8},
           "federation": {"sites": 2, "partition": "iid"}, "model": {"arch": "resnet9", "width": 4},
           "train": {"rounds": 1, "local_epochs": 1, "batch_size": 8}, "methods": [{"name": "FedAvg"}],
           "privacy": {"k_min": 2}, "references": []}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["experiment", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "out")]) == 0
    assert sorted(d.name for d in (tmp_path / "out" / "cache").iterdir()) == ["site-1", "site-2"]
    assert not list(home.rglob("*.npz")) and not (home / ".cache" / "fedmed").exists()
    assert "FEDMED_CACHE_DIR" not in __import__("os").environ  # the experiment's setting ends with it
