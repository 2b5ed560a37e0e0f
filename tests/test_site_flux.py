"""Flux and IFCA site tasks without the FL runtime (plain dicts in, aggregates out)."""

import json

import numpy as np
import pytest

from fedmed.data.images import DataError, discover

from fedmed.data.datalists import write_site_datalists
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
    _, _, b, _ = r.handle("latent_bounds", params(), dict(CFG, method_options=flux_section()))
    assert b["lo"].shape == b["hi"].shape == (32,) and (b["hi"] >= b["lo"]).all()
    flux = flux_section(lo=b["lo"].tolist(), hi=b["hi"].tolist(), n_components=5)
    _, m, d, _ = r.handle("descriptor", params(), dict(CFG, method_options=flux))
    assert d["full"].shape == (2 * 11 * 5,) and d["label_free"].shape == (10,)
    np.testing.assert_array_equal(d["full"][:10], d["label_free"])
    _, _, lf, _ = r.handle("descriptor", params(), dict(CFG, method_options={**flux, "label_free": True}))
    assert "full" not in lf and lf["label_free"].shape == (10,)


def test_nan_latents_are_a_clear_error(site_dir):
    p = params()
    key = [k for k in p if k.endswith("running_var")][-1]  # poison the last feature block (before fc)
    p[key] = np.full_like(p[key], np.nan)
    flux = flux_section(lo=[0.0] * 32, hi=[1.0] * 32, n_components=5)
    with pytest.raises(ValueError, match="site-1: latents contain NaN or inf"):
        SiteRunner("site-1", site_dir).handle("descriptor", p, dict(CFG, method_options=flux))


def test_unseen_site_without_images(tmp_path):
    (tmp_path / "unseen-1.json").write_text(json.dumps({"training": [], "validation": [], "test": []}))
    with pytest.raises(DataError, match="unseen-1: datalist .*unseen-1.json has no training images"):
        SiteRunner("unseen-1", tmp_path).handle("descriptor", params(), dict(CFG, method_options=flux_section(lo=[0.0] * 32, hi=[1.0] * 32)))


def test_ifca_picks_lowest_loss_model(site_dir):
    good, bad = params(), params()
    bad = {k: (v * 0 + 5.0 if k == "fc.bias" else v) for k, v in bad.items()}
    bad["fc.bias"] = np.where(np.arange(10) == 3, 50.0, 0.0).astype(np.float32)  # always predicts class 3: high loss
    packed = {**{f"m0/{k}": v for k, v in bad.items()}, **{f"m1/{k}": v for k, v in good.items()}}
    _, metrics, meta, out = SiteRunner("site-1", site_dir).handle("ifca", packed, dict(CFG, method_options={"k": 2, "train": True}))
    assert meta["cluster"] == 1 and meta["losses"][0] > meta["losses"][1] and meta["n_train"] > 0
    assert set(out) == set(good)


def test_flux_describes_an_efficientnet_lite_site_by_its_pre_logit_features(tmp_path):
    """Flux from the ImageNet release (issue #53's Flux row): a site of model.arch efficientnet_lite0 answers
    latent_bounds over the network's 1280 pooled pre-logit features — what timm's own ``forward_head(pre_logits=True)``
    gives, the layer before the classifier — and the config check no longer refuses the pairing."""
    import torch

    from fedmed.config import load_config
    from fedmed.nn.models import PRETRAINED_ARCHS
    from fedmed.nn.train import latents

    pool = discover("builtin:digits", max_per_class=3)
    write_site_datalists(pool, [np.arange(len(pool.labels))], tmp_path, test_fraction=0.25, seed=0)
    cfg = {**CFG, "data": {"image_size": 32, "channels": 3, "n_classes": 10}, "model": {"arch": "efficientnet_lite0"}}
    torch.manual_seed(0)
    model = PRETRAINED_ARCHS["efficientnet_lite0"](3, 10)
    r = SiteRunner("site-1", tmp_path)
    _, _, b, _ = r.handle("latent_bounds", get_params(model), dict(cfg, method_options=flux_section()))
    assert b["lo"].shape == b["hi"].shape == (1280,) and (b["hi"] >= b["lo"]).all() and (b["hi"] > b["lo"]).any()
    x = torch.rand(4, 3, 32, 32)  # a site's images in [0, 1]; every network is fed (x - 0.5) / 0.5
    model.eval()
    with torch.no_grad():
        x = (x - 0.5) / 0.5
        want = model.net.forward_head(model.net.forward_features(x), pre_logits=True).numpy()
        np.testing.assert_allclose(latents(model, x * 0.5 + 0.5), want, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(model.net.classifier(torch.from_numpy(want)).numpy(), model(x).numpy(), rtol=1e-5,
                                   atol=1e-5)  # the layer the classifier reads
    exp = load_config({"name": "f", "dataset": {"path": "builtin:digits", "image_size": 32, "channels": 3},
                       "model": {"arch": "efficientnet_lite0"}, "methods": [{"name": "Flux", "workflow": "flux"}]})
    assert exp.methods[0].workflow == "flux"
