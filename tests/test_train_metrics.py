import numpy as np
import pytest
import torch

from fedmed.metrics import auc_from_histograms, pooled_metrics, site_metrics
from fedmed.models import build_model
from fedmed.train import get_params, set_params, train_local


def test_pooled_equals_concatenated(rng):
    C = 3
    ys = [rng.integers(0, C, 50), rng.integers(0, C, 30)]
    ps = [rng.dirichlet(np.ones(C), 50), rng.dirichlet(np.ones(C), 30)]
    sites = [site_metrics(y, p, C) for y, p in zip(ys, ps)]
    pooled = pooled_metrics([s["confusion"] for s in sites], [s["score_hist"] for s in sites])
    allm = site_metrics(np.concatenate(ys), np.concatenate(ps), C)
    assert pooled["accuracy"] == pytest.approx(allm["accuracy"])
    from sklearn.metrics import f1_score
    y, p = np.concatenate(ys), np.concatenate(ps)
    assert pooled["macro_f1"] == pytest.approx(f1_score(y, p.argmax(1), average="macro"))
    assert abs(pooled["auc"] - allm["auc"]) < 0.02  # binned AUC within the histogram resolution


def test_histogram_auc_exact_when_no_ties():
    pos = np.zeros(10)
    neg = np.zeros(10)
    pos[[7, 8]] = 1
    neg[[2, 8]] = 1
    assert auc_from_histograms(pos, neg) == pytest.approx((1 + 1 + 0.5 + 0) / 4)


def test_single_class_site_auc_nan(rng):
    m = site_metrics(np.zeros(5, int), rng.dirichlet(np.ones(3), 5), 3)
    assert np.isnan(m["auc"]) and m["n_test"] == 5


def test_seeded_model_and_training_reduce_loss():
    a = build_model("resnet9", 1, 3, width=4, seed=1)
    b = build_model("resnet9", 1, 3, width=4, seed=1)
    for k, v in get_params(a).items():
        np.testing.assert_array_equal(v, get_params(b)[k])
    g = torch.Generator().manual_seed(0)
    x = torch.rand(24, 1, 16, 16, generator=g)
    y = (x.mean((1, 2, 3)) > 0.5).long() + (x[:, 0, 0, 0] > 0.5).long()
    first = train_local(a, x, y, epochs=1, lr=0.05, generator=g)["loss"]
    for _ in range(8):
        last = train_local(a, x, y, epochs=1, lr=0.05, generator=g)["loss"]
    assert last < first


def test_fedprox_keeps_weights_closer():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(16, 1, 8, 8, generator=g)
    y = torch.randint(0, 2, (16,), generator=g)
    base = get_params(build_model("resnet9", 1, 2, width=4))
    drift = {}
    for mu in (0.0, 10.0):
        m = build_model("resnet9", 1, 2, width=4)
        train_local(m, x, y, epochs=3, lr=0.1, mu=mu, generator=torch.Generator().manual_seed(1), augment="none")
        drift[mu] = sum(float(((get_params(m)[k] - base[k]) ** 2).sum()) for k in base if "weight" in k)
    assert drift[10.0] < drift[0.0]


def test_set_params_mismatch():
    m = build_model("resnet9", 1, 2, width=4)
    p = get_params(m)
    p["fc.weight"] = np.zeros((5, 5), np.float32)
    with pytest.raises(ValueError, match="'fc.weight' has shape \\(5, 5\\)"):
        set_params(m, p)
    with pytest.raises(ValueError, match="missing"):
        set_params(m, {})


def test_monai_resnet18_builds():
    m = build_model("resnet18", 3, 10)
    assert m(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
    assert m.forward_features(torch.zeros(2, 3, 32, 32)).shape == (2, 512)
