import numpy as np
import pytest
import torch

from fedmed.algorithms.aggregation import cluster_average, down_weight, prep_weights, weighted_average


def test_weighted_average_numpy_and_torch():
    a = {"w": np.array([1.0, 2.0]), "n": np.array(3)}
    b = {"w": np.array([3.0, 6.0]), "n": np.array(6)}
    out = weighted_average([a, b], [1, 3])
    np.testing.assert_allclose(out["w"], [2.5, 5.0])
    assert out["n"].dtype == a["n"].dtype and int(out["n"]) == 5  # rint(5.25)
    ta = {"w": torch.tensor([1.0, 2.0])}
    tb = {"w": torch.tensor([3.0, 6.0])}
    tout = weighted_average([ta, tb], [1, 1])
    assert isinstance(tout["w"], torch.Tensor) and torch.allclose(tout["w"], torch.tensor([2.0, 4.0]))


def test_weighted_average_errors():
    with pytest.raises(ValueError, match="b: 'w' has shape"):
        weighted_average([{"w": np.zeros(2)}, {"w": np.zeros(3)}], [1, 1], names=["a", "b"])
    with pytest.raises(ValueError, match="b: 'w' contains NaN"):
        weighted_average([{"w": np.zeros(2)}, {"w": np.array([np.nan, 0])}], [1, 1], names=["a", "b"])
    with pytest.raises(ValueError, match="b: state keys differ"):
        weighted_average([{"w": np.zeros(2)}, {"v": np.zeros(2)}], [1, 1], names=["a", "b"])
    with pytest.raises(ValueError, match="all be zero"):
        weighted_average([{"w": np.zeros(2)}], [0])


def test_down_weight_eq2():
    w = down_weight([10, 10, 10, 10], 0, 0.1)
    np.testing.assert_allclose(w, np.array([0.1, 1, 1, 1]) / 3.1)
    np.testing.assert_allclose(down_weight([10, 20], None, 0.5), [1 / 3, 2 / 3])
    with pytest.raises(ValueError, match="omega should be <= 1"):
        down_weight([1, 1], 0, 1.5)


def test_cluster_average():
    states = [{"w": np.array([float(i)])} for i in range(4)]
    out = cluster_average(states, [1, 1, 1, 1], [0, 1, 0, 1])
    assert out[0]["w"][0] == 1.0 and out[1]["w"][0] == 2.0


def test_prep_weights_eq1_eq2():
    p, w = prep_weights([{0, 1, 2}, {0, 1}, {0}, {0, 3}], n_classes=5)
    np.testing.assert_array_equal(p, [4, 2, 1, 1, 0])
    np.testing.assert_allclose(w, [0.25, 0.5, 1.0, 1.0, 0.0])
    with pytest.raises(ValueError, match="site 1: class ids should lie in"):
        prep_weights([{0}, {7}], 5)
