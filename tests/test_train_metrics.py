import numpy as np
import pytest
import torch

from fedmed.algorithms.metrics import auc_from_histograms, pooled_metrics, site_metrics
from fedmed.nn.models import build_model
from fedmed.nn.train import get_params, set_params, train_local


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


def test_site_metrics_match_scikit_learn_without_importing_it():
    """binary_auc / macro_f1 replace sklearn's roc_auc_score / f1_score at the sites (start-up): same numbers to
    1e-12, ties included, on binary and multi-class cases."""
    from sklearn.metrics import f1_score, roc_auc_score

    from fedmed.algorithms.metrics import binary_auc, macro_f1

    rng = np.random.default_rng(0)
    for trial in range(50):
        n = int(rng.integers(2, 60))
        y = rng.integers(0, 4, n)
        s = np.round(rng.random(n), int(rng.integers(1, 3)))  # coarse scores: many ties
        pos = y == 1
        if 0 < pos.sum() < n:
            assert binary_auc(pos, s) == pytest.approx(roc_auc_score(pos, s), abs=1e-12)
        pred = rng.integers(0, 5, n)
        assert macro_f1(y, pred) == pytest.approx(f1_score(y, pred, average="macro", zero_division=0), abs=1e-12)
    assert np.isnan(binary_auc(np.ones(3, bool), [0.1, 0.2, 0.3]))


def test_a_site_process_imports_neither_scikit_learn_nor_scipy_to_train_and_validate(tmp_path):
    """Start-up cost per site: sklearn + scipy.stats are ~3 s of imports in every site process."""
    import subprocess
    import sys

    code = f"""
import sys, numpy as np
from fedmed.data.images import ImagePool
from fedmed.data.datalists import write_site_datalists
rng = np.random.default_rng(0)
pool = ImagePool(list((rng.random((24, 8, 8)) * 255).astype(np.uint8)), np.arange(24) % 2, ["a", "b"], "t")
write_site_datalists(pool, [np.arange(24)], {str(tmp_path)!r}, test_fraction=0.25, val_fraction=0.2)
before = {{m for m in sys.modules if m.split('.')[0] in ('sklearn', 'scipy')}}
from fedmed.site.runner import SiteRunner
from fedmed.nn.models import build_model
from fedmed.nn.train import get_params
cfg = {{"seed": 0, "data": {{"image_size": 8, "channels": 1, "n_classes": 2}}, "model": {{"arch": "resnet9", "width": 4}},
       "train": {{"local_epochs": 1, "batch_size": 8, "optimizer": "adam", "lr": 1e-3}}}}
r = SiteRunner("site-1", {str(tmp_path)!r})
p = get_params(build_model("resnet9", 1, 2, width=4))
r.handle("train", p, cfg, 0); r.handle("validate", p, cfg, 0)
print(sorted({{m.split('.')[0] for m in sys.modules if m.split('.')[0] in ('sklearn', 'scipy')}} - {{m.split('.')[0] for m in before}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
