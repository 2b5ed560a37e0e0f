"""Flux and IFCA site tasks without the FL runtime (plain dicts in, aggregates out)."""

import json

import numpy as np
import pytest

from fedmed.data.images import DataError, discover, write_site_datalists
from fedmed.nn.models import build_model
from fedmed.site.runner import SiteRunner
from fedmed.nn.train import get_params

from conftest import flux_section

CFG = {"seed": 0, "data": {"image_size": 8, "channels": 1, "n_classes": 10}, "model": {"arch": "resnet9", "width": 4},
       "train": {"local_epochs": 1, "batch_size": 8, "lr": 0.01, "momentum": 0.9},
       "privacy": {"k_min": 1, "accept_k_min_below_2": True}}


@pytest.fixture
def site_dir(tmp_path):
    pool = discover("builtin:digits", max_per_class=4)
    write_site_datalists(pool, [np.arange(len(pool.labels))], tmp_path, test_fraction=0.25, seed=0)
    return tmp_path


def params():
    return get_params(build_model("resnet9", 1, 10, width=4))


def test_bounds_then_descriptor(site_dir):
    r = SiteRunner("site-1", site_dir)
    _, _, b, _ = r.handle("latent_bounds", params(), dict(CFG, flux=flux_section()))
    assert b["lo"].shape == b["hi"].shape == (32,) and (b["hi"] >= b["lo"]).all()
    flux = flux_section(lo=b["lo"].tolist(), hi=b["hi"].tolist(), n_components=5)
    _, m, d, _ = r.handle("descriptor", params(), dict(CFG, flux=flux))
    assert d["full"].shape == (2 * 11 * 5,) and d["label_free"].shape == (10,)
    np.testing.assert_array_equal(d["full"][:10], d["label_free"])
    _, _, lf, _ = r.handle("descriptor", params(), dict(CFG, flux={**flux, "label_free": True}))
    assert "full" not in lf and lf["label_free"].shape == (10,)


def test_nan_latents_are_a_clear_error(site_dir):
    p = params()
    key = [k for k in p if k.endswith("running_var")][-1]  # poison the last feature block (before fc)
    p[key] = np.full_like(p[key], np.nan)
    flux = flux_section(lo=[0.0] * 32, hi=[1.0] * 32, n_components=5)
    with pytest.raises(ValueError, match="site-1: latents contain NaN or inf"):
        SiteRunner("site-1", site_dir).handle("descriptor", p, dict(CFG, flux=flux))


def test_unseen_site_without_images(tmp_path):
    (tmp_path / "unseen-1.json").write_text(json.dumps({"training": [], "validation": [], "test": []}))
    with pytest.raises(DataError, match="unseen-1: datalist .*unseen-1.json has no training images"):
        SiteRunner("unseen-1", tmp_path).handle("descriptor", params(), dict(CFG, flux=flux_section(lo=[0.0] * 32, hi=[1.0] * 32)))


def test_ifca_picks_lowest_loss_model(site_dir):
    good, bad = params(), params()
    bad = {k: (v * 0 + 5.0 if k == "fc.bias" else v) for k, v in bad.items()}
    bad["fc.bias"] = np.where(np.arange(10) == 3, 50.0, 0.0).astype(np.float32)  # always predicts class 3: high loss
    packed = {**{f"m0/{k}": v for k, v in bad.items()}, **{f"m1/{k}": v for k, v in good.items()}}
    _, metrics, meta, out = SiteRunner("site-1", site_dir).handle("ifca", packed, dict(CFG, ifca={"k": 2, "train": True}))
    assert meta["cluster"] == 1 and meta["losses"][0] > meta["losses"][1] and meta["n_train"] > 0
    assert set(out) == set(good)
