"""FedBN (Li et al., ICLR 2021): every site keeps its own batch-norm layers and takes the rest of the served model."""

import numpy as np
import pytest
import yaml


def _federation(tmp_path, workflow="fedbn"):
    from fedmed.config import load_config
    from fedmed.run.experiment import prepare_federation, with_classes

    raw = {"name": "bn", "dataset": {"path": "builtin:digits", "image_size": 8, "channels": 1, "max_per_class": 12},
           "federation": {"sites": 2, "partition": "iid"}, "model": {"arch": "resnet9", "width": 4},
           "train": {"rounds": 2, "local_epochs": 1, "batch_size": 16}, "privacy": {"k_min": 2},
           "methods": [{"name": "M", "workflow": workflow}]}
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    exp = load_config(cfg)
    data = prepare_federation(exp, 0, tmp_path / "data")
    return with_classes(exp, data), data


def test_norm_keys_are_the_batch_norm_layers_values():
    from fedmed.nn.models import build_model
    from fedmed.nn.train import norm_keys

    m = build_model("resnet9", 1, 3, width=4)
    keys = norm_keys(m)
    assert keys and all(".running_mean" in k or ".running_var" in k or ".num_batches_tracked" in k
                        or k.endswith((".weight", ".bias")) for k in keys)
    assert "fc.weight" not in keys and not any("conv" in k.lower() and k.endswith(".weight") and ".1." not in k
                                               for k in keys)
    assert norm_keys(build_model("resnet9", 1, 3, width=4, norm="group")) == []


@pytest.mark.parametrize("workflow", ["fedbn", "fedavg"])
def test_a_fedbn_site_serves_its_own_batch_norm_with_the_servers_other_weights(tmp_path, workflow):
    """Round 0 trains from the server's model; in round 1 the server sends other weights: a FedBN site serves them with
    the batch-norm values it trained in round 0 (FedAvg: the server's)."""
    from fedmed.nn.models import model_from_config
    from fedmed.nn.train import get_params, norm_keys
    from fedmed.run.jobspec import job_spec
    from fedmed.site.reply import answer

    exp, data = _federation(tmp_path, workflow)
    cfg = job_spec(exp, exp.methods[0], 0).task_config
    assert cfg["train"].get("local_norm", False) is (workflow == "fedbn")
    net = model_from_config(exp.model.model_dump(), 1, 10)
    theta0 = get_params(net)
    runner, (_, metrics, meta, trained), err = answer("site-1", None, "train", theta0, cfg, 0, settings=data)
    assert err is None, err
    bn = norm_keys(net)
    theta1 = {k: v + 1.0 if v.dtype.kind == "f" else v for k, v in theta0.items()}  # the "server's" next model
    runner, (_, metrics, meta, _), err = answer("site-1", runner, "validate", theta1, cfg, 1, settings=data)
    assert err is None, err
    served = {k: v.detach().numpy() for k, v in runner._model.state_dict().items()}
    for k in theta1:
        want = trained[k] if (workflow == "fedbn" and k in bn) else theta1[k]
        assert np.array_equal(served[k], want), k
    assert any(not np.array_equal(trained[k], theta1[k]) for k in bn)


def test_fedbn_runs_a_federation_to_the_end(tmp_path):
    from fedmed.run.jobspec import job_spec, run_spec_in_process

    exp, data = _federation(tmp_path)
    status, fed = run_spec_in_process(job_spec(exp, exp.methods[0], 0), data, tmp_path / "out")
    assert status == "finished"
    rounds = fed.recorder.doc["rounds"]
    assert [r["task"] for r in rounds] == ["train", "train", "validate"]
    assert all(r["sites"]["site-2"].get("accuracy") is not None for r in rounds)
