"""A site's data kept on its device (fedmed.nn.resident, issue #54), checked on the CPU: the device path trains on
the same batches and ends with the same weights as the CPU path for a seed; a non-finite step is skipped on the
device exactly where the host check skipped it; a split over the site's budget falls back and says so."""

import json

import numpy as np
import pytest
import torch

from fedmed.core.device import backward_step, backward_step_on_device
from fedmed.data.images import discover
from fedmed.data.datalists import write_site_datalists
from fedmed.nn.models import ResNet9
from fedmed.nn.resident import DeviceImages, augment_on_device, epoch_draws, exact_uint8
from fedmed.nn.train import augment_batch, get_params, predict_proba, train_local
from fedmed.site.runner import SiteRunner


def _images(n=23, size=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (n, 1, size, size), generator=g).float() / 255
    return x, torch.randint(0, 3, (n,), generator=g)


def test_8bit_images_are_kept_as_uint8_codes_that_give_back_exactly_the_same_floats():
    x, _ = _images()
    u8 = exact_uint8(x)
    assert u8.dtype == torch.uint8 and torch.equal(u8.float() / 255, x)
    d = DeviceImages(x, "cpu")
    assert d.uint8 and d.nbytes == x.numel() and torch.equal(d.take(), x)
    assert torch.equal(d.take(torch.tensor([4, 0, 4])), x[[4, 0, 4]])
    assert exact_uint8(x + 1e-3) is None  # not 8-bit: kept as float32, unchanged
    f = DeviceImages(x + 1e-3, "cpu")
    assert not f.uint8 and torch.equal(f.take(), x + 1e-3)


@pytest.mark.parametrize("mode", ["none", "flip", "flip_crop"])
def test_the_epochs_draws_and_device_augmentation_are_the_cpu_paths_batches(mode):
    """epoch_draws takes the generator's numbers in augment_batch's order; augment_on_device makes the same images."""
    x, _ = _images(n=21)
    g_old, g_new = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    order = torch.randperm(21, generator=g_old)
    old = [augment_batch(x[order[s:s + 4]], mode, g_old) for s in range(0, 21, 4) if 21 - s >= 2]
    draws = epoch_draws(21, 4, mode, g_new)
    assert torch.equal(draws.order, order)
    new = []
    for s in range(0, 21, 4):
        if s in draws.starts:
            idx, flips, crop = draws.batch(s, 4)
            new.append(augment_on_device(x[idx], flips, crop))
    assert len(new) == len(old) == 5  # the trailing batch of one is skipped by both
    assert all(torch.equal(a, b) for a, b in zip(old, new))
    assert torch.equal(torch.rand(3, generator=g_old), torch.rand(3, generator=g_new))  # the same numbers consumed


@pytest.mark.parametrize("optimizer,augment,mu", [("adam", "flip", None), ("sgd", "flip_crop", 0.1),
                                                  ("adam", "none", None)])
def test_training_from_device_data_ends_with_the_cpu_paths_weights_bit_for_bit(optimizer, augment, mu):
    x, y = _images(n=25, size=16)

    def run(data):
        torch.manual_seed(0)
        m = ResNet9(1, 3, width=4)
        opt = (torch.optim.Adam(m.parameters(), lr=1e-3) if optimizer == "adam"
               else torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9))
        out = train_local(m, data, y, epochs=2, batch_size=8, optimizer=opt, generator=torch.Generator().manual_seed(3),
                          augment=augment, mu=mu, lr_at=(lambda f: 1e-3 * (1 - f)) if optimizer == "adam" else None)
        return get_params(m), out

    pa, oa = run(x)
    pb, ob = run(DeviceImages(x, "cpu"))
    assert oa == ob  # the same mean loss (summed in float64 either way), steps and skipped steps
    assert all(np.array_equal(pa[k], pb[k]) for k in pa)


def _plant_inf(model, steps_to_spoil):
    """A gradient hook that makes one gradient inf at the given step numbers."""
    count = {"n": 0}

    def hook(g):
        count["n"] += 1
        return g.clone().fill_(float("inf")) if count["n"] in steps_to_spoil else g

    next(model.parameters()).register_hook(hook)


def test_a_fused_optimizer_skips_a_non_finite_step_on_the_device_exactly_where_the_host_check_skipped_it():
    x, y = _images(n=40, size=16)
    spoiled = {2, 5}
    flags = {}

    def run(step_fn):
        torch.manual_seed(0)
        m = ResNet9(1, 3, width=4)
        _plant_inf(m, spoiled)
        opt = torch.optim.Adam(m.parameters(), lr=1e-3, fused=True)
        fl = []
        for s in range(0, 40, 5):
            loss = torch.nn.functional.cross_entropy(m(x[s:s + 5]), y[s:s + 5])
            fl.append(float(step_fn(loss, opt)))
        return m, opt, fl

    ma, oa, flags["host"] = run(lambda loss, opt: not backward_step(loss, opt))
    mb, ob, flags["device"] = run(backward_step_on_device)
    assert flags["host"] == flags["device"] == [float(i + 1 in spoiled) for i in range(8)]
    pa, pb = get_params(ma), get_params(mb)
    assert all(np.array_equal(pa[k], pb[k]) and np.isfinite(pa[k]).all() for k in pa)
    sa, sb = oa.state_dict()["state"], ob.state_dict()["state"]
    assert all(float(sa[i]["step"]) == float(sb[i]["step"]) == 6 for i in sa)  # the skipped steps not counted


def test_a_non_fused_optimizer_or_a_gradient_scaler_goes_through_the_host_check():
    m = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    loss = m(torch.ones(1, 3)).sum() * float("inf")
    before = get_params(m)
    assert float(backward_step_on_device(loss, opt)) == 1.0
    after = get_params(m)
    assert all(np.array_equal(before[k], after[k]) for k in before)


@pytest.fixture
def site(tmp_path):
    pool = discover("builtin:digits", seed=0)
    idx = np.arange(90)
    write_site_datalists(pool.subset(idx), [np.arange(90)], tmp_path, test_fraction=0.2, val_fraction=0.2, seed=0)
    return tmp_path


def _cfg():
    return {"seed": 0, "data": {"image_size": 16, "channels": 1, "n_classes": 10}, "privacy": {"k_min": 1},
            "model": {"arch": "resnet9", "width": 4},
            "train": {"local_epochs": 1, "batch_size": 8, "optimizer": "adam", "lr": 1e-3, "augment": "flip_crop"}}


def _round(site, monkeypatch, device_path, gb=None):
    from fedmed.nn.models import model_from_config

    monkeypatch.setattr(SiteRunner, "CPU_KEEPS_ITS_PATH", not device_path)
    runner = SiteRunner("site-1", site)
    runner.settings.device_data_gb = gb
    theta = get_params(model_from_config(_cfg()["model"], 1, 10, seed=0))
    replies = [runner.handle("train", theta, _cfg(), r) for r in range(2)]
    return runner, replies


def test_a_site_round_through_its_device_data_replies_what_the_cpu_path_replies(site, monkeypatch):
    """The whole site round (scoring, then training with the kept optimizer, two rounds) through DeviceImages."""
    _, old = _round(site, monkeypatch, False)
    runner, new = _round(site, monkeypatch, True)
    for a, b in zip(old, new):
        assert a.metrics == b.metrics
        assert all(np.array_equal(a.params[k], b.params[k]) for k in a.params)
    resident = [d for _, d in runner._resident.values()]
    assert len(resident) == 3 and all(d.resident and d.uint8 for d in resident)  # train, val, test placed once
    assert runner._resident_bytes == sum(d.nbytes for d in resident)


def test_a_split_over_the_sites_budget_stays_on_the_host_says_so_once_and_trains_the_same(site, monkeypatch):
    _, old = _round(site, monkeypatch, False)
    runner, new = _round(site, monkeypatch, True, gb=0)
    assert all(not d.resident for _, d in runner._resident.values())
    notes = [n for r in new for n in r.meta.get("notes", []) if "device-data budget" in n]
    assert len(notes) == 3 and all(n.startswith("site-1: its images do not fit") for n in notes)
    assert all(np.array_equal(old[-1].params[k], new[-1].params[k]) for k in old[-1].params)


def test_the_device_data_budget_is_a_site_setting(tmp_path):
    from fedmed.site.settings import SiteConfigError, resolve_site_settings

    (tmp_path / "a.json").write_text(json.dumps({"training": [], "validation": [], "test": []}))
    f = tmp_path / "fedmed_site.json"
    f.write_text(json.dumps({"datalist": "a.json", "device_data_gb": 1.5}))
    assert resolve_site_settings("site-1", env={"FEDMED_SITE_CONFIG": str(f)}).device_data_gb == 1.5
    f.write_text(json.dumps({"datalist": "a.json", "device_data_gb": -1}))
    with pytest.raises(SiteConfigError, match="site-1: .*device_data_gb should be a number of GiB >= 0"):
        resolve_site_settings("site-1", env={"FEDMED_SITE_CONFIG": str(f)})


def test_scoring_from_device_data_gives_the_same_probabilities():
    x, _ = _images(n=30, size=16)
    torch.manual_seed(0)
    m = ResNet9(1, 3, width=4)
    assert np.array_equal(predict_proba(m, x), predict_proba(m, DeviceImages(x, "cpu")))


def _volume(shape=(20, 24, 18), seed=0):
    """A two-channel volume with a small tumour blob (three label channels nested as WT ⊇ TC ⊇ ET)."""
    rng = np.random.default_rng(seed)
    img = rng.normal(size=(2, *shape)).astype(np.float32)
    lab = np.zeros((3, *shape), np.uint8)
    lab[0, 5:9, 6:10, 4:7] = 1
    lab[1, 6:8, 7:9, 5:6] = 1
    return {"image": img, "label": lab, "meta": {"subject": "s"}}


def test_3d_patches_cut_on_the_device_have_the_requested_size_and_foreground_share():
    from fedmed.nn.resident import DeviceVolumes

    case = _volume()
    vols = DeviceVolumes([case], "cpu", roi=(8, 8, 8))
    rng = np.random.default_rng(0)
    drawn = [vols.centre(0, rng, 0.67) for _ in range(2000)]
    fg = np.asarray(case["label"]).any(0)
    assert all(fg[c] == pos for c, pos in drawn)  # a foreground draw is centred on tumour, a background one is not
    share = np.mean([pos for _, pos in drawn])
    assert abs(share - 0.67) < 0.04  # binomial sd ~0.011
    x, y = vols.patches(0, 5, 0.67, np.random.default_rng(1))
    assert x.shape == (5, 2, 8, 8, 8) and y.shape == (5, 3, 8, 8, 8) and y.dtype == torch.float32
    # each patch is a crop of the volume, flipped on some axes, its intensity scaled and shifted
    rng, img = np.random.default_rng(1), torch.from_numpy(case["image"])
    for k in range(5):
        c, _ = vols.centre(0, rng, 0.67)
        start = [min(max(ci - 4, 0), d - 8) for ci, d in zip(c, (20, 24, 18))]
        crop = img[:, start[0]:start[0] + 8, start[1]:start[1] + 8, start[2]:start[2] + 8]
        flips = [ax + 1 for ax in range(3) if rng.random() < 0.5]
        crop = torch.flip(crop, flips) if flips else crop
        scale, shift = 1 + rng.uniform(-0.1, 0.1), rng.uniform(-0.1, 0.1)
        assert torch.allclose(x[k], crop * scale + shift)
    # all foreground or none: the other set is used; a volume smaller than the patch is padded to it
    small = DeviceVolumes([_volume(shape=(6, 24, 18))], "cpu", roi=(8, 8, 8))
    xs, _ = small.patches(0, 3, 1.0, np.random.default_rng(2))
    assert xs.shape == (3, 2, 8, 8, 8)
    empty = {**case, "label": np.zeros_like(case["label"])}
    assert not any(DeviceVolumes([empty], "cpu", (8, 8, 8)).centre(0, np.random.default_rng(3), 1.0)[1]
                   for _ in range(20))


def test_3d_training_from_device_volumes_steps_once_per_case_and_epoch():
    from fedmed.nn.resident import DeviceVolumes
    from fedmed.nn.seg import seg_model, train_seg_local

    cases = [_volume(seed=i) for i in range(3)]
    model = seg_model(2, channels=(4, 8), seed=0)
    before = get_params(model)
    out = train_seg_local(model, DeviceVolumes(cases, "cpu", (8, 8, 8)), epochs=2, roi=(8, 8, 8), patches=2,
                          pos_fraction=0.5, seed=0, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2,
                                                                                fused=True))
    assert out["steps"] == 6 and out["skipped"] == 0 and np.isfinite(out["loss"])
    after = get_params(model)
    assert any(not np.array_equal(before[k], after[k]) for k in before)
