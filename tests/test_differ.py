"""Do these sites differ? The split-half permutation test (fedmed.algorithms.differ, issue #57): its false-alarm rate
on federations where the answer is no is at most alpha — with sites of unequal sizes too — and it finds sites that
do differ. The rate on real data (IID splits of the breast-ultrasound images, and the natural federation) is
benchmarks/sites_differ.py's (docs/readings.md "Do the sites differ?")."""

import numpy as np
import pytest

from fedmed.algorithms.differ import ALPHA, differ_test, split_halves


def _federation(rng, sizes, shift: float, dim: int = 16):
    """Per site its images' embeddings: N(mu_site, I); half the sites' mean moved by ``shift`` in every dimension."""
    return [rng.normal(shift * (i % 2), 1.0, size=(n, dim)) for i, n in enumerate(sizes)]


def _halves_distances(rng, feats, scaled: bool = True):
    """Squared Euclidean distances between the sites' half means, the halves' owners and (``scaled``) their sizes."""
    means, owner, sizes = [], [], []
    for i, f in enumerate(feats):
        a, b = split_halves(len(f), rng)
        means += [f[a].mean(axis=0), f[b].mean(axis=0)]
        owner += [i, i]
        sizes += [len(a), len(b)]
    m = np.asarray(means)
    D = ((m[:, None] - m[None, :]) ** 2).sum(axis=-1)
    return D, np.asarray(owner), {"sizes": sizes} if scaled else {}


def _test(rng, feats, scaled=True):
    D, owner, kw = _halves_distances(rng, feats, scaled)
    return differ_test(D, owner, n_perm=199, rng=rng, **kw)


@pytest.mark.parametrize("sizes", [[40] * 8, [12, 20, 30, 60, 90, 150, 20, 40]])  # equal, and unequal like real sites
def test_on_sites_that_do_not_differ_it_says_they_differ_at_most_at_alpha(sizes):
    rng = np.random.default_rng(57)
    trials = 300
    bound = ALPHA + 3 * np.sqrt(ALPHA * (1 - ALPHA) / trials)
    alarms = sum(_test(rng, _federation(rng, sizes, 0.0)).differ for _ in range(trials))
    assert alarms / trials <= bound, alarms / trials
    if len(set(sizes)) > 1:  # the other reading: raw distances, a small site's noisier halves unscaled
        rng = np.random.default_rng(57)
        raw = sum(_test(rng, _federation(rng, sizes, 0.0), scaled=False).differ for _ in range(trials))
        assert raw / trials > bound, raw / trials  # 10.7% on these trials (scaled: below 5%)


def test_sites_that_differ_are_found_and_the_answer_says_how_sure_it_is():
    rng = np.random.default_rng(3)
    found = [_test(rng, _federation(rng, [40] * 8, 0.6)) for _ in range(50)]
    assert np.mean([t.differ for t in found]) > 0.9
    t = found[0]
    assert t.statistic > 0 and t.p < ALPHA and "the 8 sites differ" in t.sentence()
    same = _test(rng, _federation(rng, [40] * 8, 0.0))
    if not same.differ:
        assert same.sentence().startswith("no evidence that the 8 sites differ")


def test_the_test_refuses_what_it_cannot_read():
    D = np.zeros((4, 4))
    with pytest.raises(ValueError, match="exactly two halves"):
        differ_test(D, [0, 0, 0, 1])
    with pytest.raises(ValueError, match="one owner per half"):
        differ_test(D, [0, 0, 1])
    with pytest.raises(ValueError, match="one positive count per half"):
        differ_test(D, [0, 0, 1, 1], sizes=[3, 0, 2, 2])
    a, b = split_halves(7, np.random.default_rng(0))
    assert len(a) == 4 and len(b) == 3 and not set(a) & set(b) and set(a) | set(b) == set(range(7))


def test_a_clustered_run_answers_before_training_whether_its_sites_differ(tmp_path):
    """FMCL on a federation whose two groups of sites hold different classes (ANDA label shift): the sites send the
    means of two random halves with their signatures, the server's split-half test calls them different and the
    record keeps the answer. A site with fewer than 2 k_min training images sends no halves."""
    import yaml

    from fedmed.config import load_config
    from fedmed.run.experiment import classes_override, prepare_federation
    from fedmed.run.jobspec import job_spec, run_spec_in_process

    raw = {"name": "differ", "dataset": {"path": "builtin:digits", "image_size": 8, "channels": 1, "max_per_class": 40},
           "federation": {"sites": 6, "partition": "anda", "anda_shift": "label", "anda_level": 6, "anda_groups": 2},
           "model": {"arch": "resnet9", "width": 4}, "train": {"rounds": 1, "local_epochs": 1, "batch_size": 16},
           "privacy": {"k_min": 2}, "references": [],
           "methods": [{"name": "FECFL", "workflow": "fecfl", "encoder": "random_cnn", "n_clusters": 2}]}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    exp = load_config(tmp_path / "c.yaml")
    data = prepare_federation(exp, 0, tmp_path / "data")
    exp = load_config(tmp_path / "c.yaml", classes_override(data, exp))
    status, fed = run_spec_in_process(job_spec(exp, exp.methods[0], 0), data, tmp_path / "run")
    assert status == "finished"
    d = fed.recorder.doc["differ"]
    assert d["p"] < d["alpha"] == ALPHA and d["answer"].startswith("the 6 sites differ") and len(d["sites"]) == 6
    # k_min above half a site's training images: no halves, the test says why it could not answer
    big = load_config(tmp_path / "c.yaml", [*classes_override(data, exp), "privacy.k_min=40"])
    status, fed = run_spec_in_process(job_spec(big, big.methods[0], 0), data, tmp_path / "run2")
    assert fed.recorder.doc["differ"]["answer"] == "not tested: 0 site(s) sent split-half means"
