"""Partitioners: seeded, capped, and PreDi's realised statistics (001_ Algorithm 1)."""

import numpy as np
import pytest

from fedmed.data.anda import anda_federation, apply_anda_transform
from fedmed.data.partition import (dirichlet_label_partition, iid_partition, label_volume_federation, predi,
                                   predi_partition, quantity_partition)


def is_partition(parts, n):
    allidx = np.concatenate(parts)
    return len(allidx) == n and len(np.unique(allidx)) == n


def test_iid_and_seeding():
    a = iid_partition(103, 4, 1)
    assert is_partition(a, 103) and {len(p) for p in a} <= {25, 26}
    b = iid_partition(103, 4, np.random.default_rng(1))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("seed", range(5))
def test_dirichlet_busi_setting_succeeds(seed):
    y = np.repeat([0, 1, 2], [437, 210, 133])  # BUSI's class mix, 20 sites, alpha 0.1 (FMCL)
    parts = dirichlet_label_partition(y, 20, 0.1, seed)
    assert is_partition(parts, 780) and min(len(p) for p in parts) >= 2


def test_dirichlet_label_skew(rng):
    y = rng.integers(0, 3, size=780)
    parts = dirichlet_label_partition(y, 20, 0.1, 0)
    assert is_partition(parts, 780) and min(len(p) for p in parts) >= 2
    # strong skew: most sites are dominated by one class
    dom = [np.bincount(y[p], minlength=3).max() / len(p) for p in parts]
    assert np.median(dom) > 0.8
    again = dirichlet_label_partition(y, 20, 0.1, 0)
    assert all(np.array_equal(x, z) for x, z in zip(parts, again))


def test_dirichlet_capped_retries_error():
    with pytest.raises(ValueError, match="after 3 draws"):
        dirichlet_label_partition(np.zeros(30, int), 10, 0.01, 0, mode="per-class", min_size=3, max_retries=3)


def test_quantity_skew():
    parts = quantity_partition(1000, 4, 0.1, 3)
    assert is_partition(parts, 1000)
    sizes = sorted(len(p) for p in parts)
    assert sizes[-1] > 3 * sizes[0]


# The paper's 20 PreDi targets (C = 36 classes, K = 4 sites)
TARGETS = [(p, s) for p in (3.5, 3.0, 2.5, 2.0, 1.5) for s in (0.0, 1.0, 2.0, 3.0)]


@pytest.mark.parametrize("p_star, s_star", TARGETS)
def test_predi_realised_statistics(p_star, s_star):
    res = predi(36, 4, p_star, s_star, seed=int(p_star * 10 + s_star))
    M = res.assignment
    assert M.shape == (36, 4) and set(np.unique(M)) <= {0, 1}
    assert res.prevalence == pytest.approx(M.sum(1).mean())
    assert res.disparity == pytest.approx(M.sum(0).std())
    assert abs(res.prevalence - p_star) <= 1e-12  # C p* is an integer for all 20 targets
    A = round(36 * p_star)
    floor = np.sqrt((A % 4) * (4 - A % 4)) / 4  # integer class counts: sigma* = 0 is unreachable when 4 does not divide A
    assert abs(res.disparity - max(s_star, floor)) <= 0.25  # stated tolerance
    assert M.sum(1).min() >= 1 and M.sum(1).max() <= 4  # 1 <= p_c <= K
    assert M.sum(0).min() >= 1


def test_predi_images():
    y = np.repeat(np.arange(36), 350)
    res = predi(36, 4, 2.0, 1.0, seed=0)
    parts = predi_partition(y, res.assignment, 0, samples_per_cell=50)
    for k, p in enumerate(parts):
        counts = np.bincount(y[p], minlength=36)
        assert set(np.flatnonzero(counts)) == set(np.flatnonzero(res.assignment[:, k]))
        assert set(counts[counts > 0]) == {50}
    assert len(np.unique(np.concatenate(parts))) == sum(len(p) for p in parts)
    c = int(np.argmax(res.assignment.sum(1)))  # a class on >= 2 sites
    need = 200 * int(res.assignment[c].sum())
    with pytest.raises(ValueError, match=f"class {c} has 350 images but PreDi needs 200 x"):
        predi_partition(np.where(y == c, c, 1000), res.assignment, 0, samples_per_cell=200)
    assert need > 350


def test_predi_infeasible():
    with pytest.raises(ValueError, match="prevalence should be <= 4"):
        predi(36, 4, 5.0, 0.0, seed=0)


@pytest.mark.parametrize("shift", ["feature", "label", "p_y_given_x", "p_x_given_y", "quantity"])
def test_anda_groups(shift, rng):
    y = rng.integers(0, 10, size=2000)
    sites = anda_federation(y, 10, shift, 0, level=5, n_groups=3)
    groups = np.array([s.group for s in sites])
    assert sorted(np.bincount(groups).tolist()) == [3, 3, 4]
    allidx = np.concatenate([s.indices for s in sites])
    assert len(np.unique(allidx)) == len(allidx)
    key = {"feature": lambda s: (s.rotation, s.color), "label": lambda s: tuple(s.keep_classes),
           "p_y_given_x": lambda s: tuple(sorted(s.label_map.items())),
           "p_x_given_y": lambda s: tuple(sorted(s.class_rotation.items())),
           "quantity": lambda s: s.group}[shift]
    # same group <=> same distribution spec
    for a in sites:
        for b in sites:
            assert (key(a) == key(b)) == (a.group == b.group) or shift == "quantity"
    if shift == "label":
        for s in sites:
            assert set(np.unique(y[s.indices])) <= set(s.keep_classes)


def test_anda_transform():
    from fedmed.data.anda import SiteShift
    img = np.zeros((4, 4), np.uint8)
    img[0, 0] = 255
    spec = SiteShift(indices=np.arange(1), group=0, rotation=180, color="green", label_map={1: 2})
    out, lab = apply_anda_transform(img, 1, spec)
    assert out.shape == (4, 4, 3) and out[3, 3, 1] == 255 and out[..., 0].sum() == 0 and lab == 2


def test_label_volume_federation():
    v = np.array([5, 1, 9, 3, 7, 2, 8, 4])
    parts = label_volume_federation(v, 4)
    assert [sorted(v[p].tolist()) for p in parts] == [[1, 2], [3, 4], [5, 7], [8, 9]]
