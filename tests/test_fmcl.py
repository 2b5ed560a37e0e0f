"""FMCL (000_/002_): Algorithm 2 and Algorithm 3."""

import numpy as np
import pytest

from fedmed.algorithms.fmcl import ClassSignature, class_signature, fmcl_distance_matrix, fmcl_distance_matrix_loop


def sig(classes, means, counts):
    return ClassSignature(np.array(classes), np.array(means, float), np.array(counts, float))


def random_federation(rng, n=12, C=6, d=16):
    sigs = []
    protos = rng.normal(size=(C, d))
    for _ in range(n):
        k = rng.integers(1, C + 1)
        cls = np.sort(rng.choice(C, size=k, replace=False))
        means = protos[cls] + 0.3 * rng.normal(size=(k, d))
        counts = rng.integers(1, 50, size=k)
        sigs.append(sig(cls, means, counts))
    return sigs


def test_algorithm2_means_and_weights():
    z = np.array([[1.0, 0.0], [3.0, 0.0], [0.0, 2.0], [0.0, 4.0]])
    s = class_signature(z, np.array([5, 5, 2, 5]))
    assert s.classes.tolist() == [2, 5]
    np.testing.assert_allclose(s.means, [[0, 2], [4 / 3, 4 / 3]])
    np.testing.assert_allclose(s.weights, [0.25, 0.75])


def test_algorithm3_hand_computed_pair():
    a = sig([0, 1], [[1, 0], [0, 1]], [3, 1])  # w = .75, .25
    b = sig([0, 2], [[1, 1], [5, 5]], [1, 1])  # w = .5, .5
    c = sig([1], [[0, 2]], [4])  # shares class 1 with a only
    eps = 1e-3
    dcos = 1 - 1 / (np.sqrt(2) + eps)
    d_ab = (0.5 * dcos / (0.5 + eps)) * min(0.5 ** -1, 100)
    dcos_ac = 1 - 2 / (2 + eps)
    d_ac = (0.25 * dcos_ac / (0.25 + eps)) * min(0.25 ** -1, 100)
    D = fmcl_distance_matrix([a, b, c])
    assert D[0, 1] == pytest.approx(d_ab, rel=1e-12)
    assert D[0, 2] == pytest.approx(d_ac, rel=1e-12)
    # b and c share nothing -> D_big = min(2 P95, P99) of the finite off-diagonal entries
    finite = np.array([d_ab, d_ab, d_ac, d_ac])
    p95, p99 = np.percentile(finite, [95, 99])
    assert D[1, 2] == pytest.approx(min(2 * p95, p99), rel=1e-12)
    assert np.all(np.diag(D) == 0) and np.allclose(D, D.T)


def test_overlap_ablation_drops_multiplier():
    a = sig([0, 1], [[1, 0], [0, 1]], [3, 1])
    b = sig([0, 2], [[1, 1], [5, 5]], [1, 1])
    D_on = fmcl_distance_matrix([a, b])
    D_off = fmcl_distance_matrix([a, b], overlap=False)
    assert D_on[0, 1] == pytest.approx(2 * D_off[0, 1])


def test_beta_caps_multiplier():
    a = sig([0, 1], [[1, 0], [0, 1]], [999, 1])
    b = sig([1, 2], [[1, 1], [5, 5]], [1, 999])
    D = fmcl_distance_matrix([a, b], beta=100)
    dcos = 1 - 1 / (np.sqrt(2) + 1e-3)
    dcap = 1e-3 * dcos / (1e-3 + 1e-3)
    assert D[0, 1] == pytest.approx(dcap * min(1e-3 ** -1, 100))


@pytest.mark.parametrize("overlap", [True, False])
def test_vectorised_equals_loop(rng, overlap):
    sigs = random_federation(rng, n=25)
    np.testing.assert_allclose(fmcl_distance_matrix(sigs, overlap=overlap),
                               fmcl_distance_matrix_loop(sigs, overlap=overlap), rtol=1e-12, atol=1e-14)


def test_blocked_computation_equals_loop_with_no_overlap_pairs(rng):
    """Row blocks smaller than N (bounded memory) and pairs sharing no class (D_big from the percentiles of both
    triangles, computed exactly from one): the same matrix as the literal loop."""
    sigs = []
    for i in range(23):
        cls = np.sort(rng.choice(12, size=rng.integers(1, 3), replace=False))
        sigs.append(ClassSignature(cls, rng.normal(size=(cls.size, 6)), rng.integers(1, 50, size=cls.size).astype(float)))
    slow = fmcl_distance_matrix_loop(sigs)
    assert (slow == slow.max()).sum() > 2  # several pairs got D_big
    for block in (1, 7, 1024):
        np.testing.assert_allclose(fmcl_distance_matrix(sigs, block=block), slow, rtol=1e-12, atol=1e-14)


def test_site_order_invariance(rng):
    sigs = random_federation(rng)
    D = fmcl_distance_matrix(sigs)
    perm = rng.permutation(len(sigs))
    Dp = fmcl_distance_matrix([sigs[i] for i in perm])
    np.testing.assert_allclose(Dp, D[np.ix_(perm, perm)], rtol=1e-12)


def test_class_relabelling_invariance(rng):
    sigs = random_federation(rng)
    mapping = rng.permutation(20)[:6] * 3 + 7  # any injective relabelling
    relab = [sig(mapping[s.classes], s.means, s.counts) for s in sigs]
    np.testing.assert_allclose(fmcl_distance_matrix(relab), fmcl_distance_matrix(sigs), rtol=1e-12)


def test_signature_class_order_is_irrelevant(rng):
    s = sig([3, 1, 2], rng.normal(size=(3, 4)), [1, 2, 3])
    t = sig([1, 2], rng.normal(size=(2, 4)), [5, 5])
    order = [2, 0, 1]
    s2 = sig(s.classes[order], s.means[order], s.counts[order])
    np.testing.assert_allclose(fmcl_distance_matrix([s, t]), fmcl_distance_matrix([s2, t]))


class TestBadInput:
    def test_single_site(self):
        with pytest.raises(ValueError, match="at least 2 sites"):
            fmcl_distance_matrix([sig([0], [[1, 0]], [1])])

    def test_dimension_mismatch(self):
        with pytest.raises(ValueError, match="one embedding dimension.*site-2.: 3"):
            fmcl_distance_matrix([sig([0], [[1, 0]], [1]), sig([0], [[1, 0, 0]], [1])])

    def test_empty_site(self):
        with pytest.raises(ValueError, match="hospital-b: signature holds no samples"):
            fmcl_distance_matrix([sig([0], [[1, 0]], [1]), sig([], np.zeros((0, 2)), [])], site_names=["a", "hospital-b"])

    def test_nan_means(self):
        with pytest.raises(ValueError, match="site-1: signature means contain NaN"):
            fmcl_distance_matrix([sig([0], [[np.nan, 0]], [1]), sig([0], [[1, 0]], [1])])

    def test_no_shared_class_anywhere(self):
        with pytest.raises(ValueError, match="no pair of sites shares a class"):
            fmcl_distance_matrix([sig([0], [[1, 0]], [1]), sig([1], [[1, 0]], [1])])

    def test_bad_hyperparameter(self):
        with pytest.raises(ValueError, match="beta should be > 0"):
            fmcl_distance_matrix([sig([0], [[1, 0]], [1]), sig([0], [[1, 0]], [1])], beta=0)
        with pytest.raises(TypeError, match="alpha should be a number"):
            fmcl_distance_matrix([sig([0], [[1, 0]], [1]), sig([0], [[1, 0]], [1])], alpha=True)


def test_a_sites_signature_sees_its_images_at_the_encoders_input_size(tmp_path):
    """The foundation model sees each image decoded at its own input size (docs/readings.md "Encoder input size"), not
    the classifier's small training images upsampled: the class prototypes a site sends equal the encoder's features
    of its training images decoded at 32 px, and differ from those of the 8 px images upsampled to 32."""
    import yaml

    from fedmed.config import load_config
    from fedmed.data.images import load_images
    from fedmed.data.datalists import load_datalist
    from fedmed.nn.encoders import build_encoder, extract_features
    from fedmed.run.experiment import prepare_federation, with_classes
    from fedmed.run.jobspec import job_spec
    from fedmed.site.reply import answer

    raw = {"name": "sz", "dataset": {"path": "builtin:digits", "image_size": 8, "channels": 1, "max_per_class": 10},
           "federation": {"sites": 2, "partition": "iid"}, "model": {"arch": "resnet9", "width": 4},
           "train": {"rounds": 1, "batch_size": 16}, "privacy": {"k_min": 2},
           "methods": [{"name": "F", "workflow": "fmcl", "encoder": "vit_tiny", "encoder_image_size": 32}]}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    exp = load_config(tmp_path / "c.yaml")
    data = prepare_federation(exp, 0, tmp_path / "data")
    exp = with_classes(exp, data)
    spec = job_spec(exp, exp.methods[0], 0)
    cfg = {**spec.task_config, "signature": spec.workflow_options["signature"]}
    _, (_, _, meta, _), err = answer("site-1", None, "signature", {}, cfg, 0, settings=data)
    assert err is None, err
    doc = load_datalist(data / "site-1.json")
    enc = build_encoder("vit_tiny", seed=0, in_channels=1, image_size=32)
    y = np.array([e["label"] for e in doc["training"]])

    def prototypes(size):
        x, _ = load_images(doc["training"], image_size=size, channels=1)
        f = extract_features(enc, x)
        return np.stack([f[y == c].mean(0) for c in meta["classes"]])

    sent = np.asarray(meta["means"], dtype=np.float64)
    assert np.allclose(sent, prototypes(32), atol=1e-5)
    assert not np.allclose(sent, prototypes(8), atol=1e-3)
