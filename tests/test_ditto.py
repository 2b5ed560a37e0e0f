"""Ditto (Li et al., ICML 2021) for classification: each site keeps a personal model, trained on its data with a
proximal term toward the round's global model, serves it, and sends the global update back."""

import numpy as np
import yaml


def _federation(tmp_path, lam):
    from fedmed.config import load_config
    from fedmed.run.experiment import prepare_federation, with_classes

    raw = {"name": "ditto", "dataset": {"path": "builtin:digits", "image_size": 8, "channels": 1, "max_per_class": 12},
           "federation": {"sites": 2, "partition": "iid"}, "model": {"arch": "resnet9", "width": 4},
           "train": {"rounds": 2, "local_epochs": 2, "batch_size": 8, "optimizer": "sgd", "lr": 0.05},
           "privacy": {"k_min": 2}, "methods": [{"name": "Ditto", "workflow": "ditto", "ditto_lambda": lam}]}
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    exp = load_config(cfg)
    data = prepare_federation(exp, 0, tmp_path / "data")
    return with_classes(exp, data), data


def _distance(a: dict, b: dict) -> float:
    return float(np.sqrt(sum(((a[k] - b[k]) ** 2).sum() for k in a if a[k].dtype.kind == "f")))


def test_a_ditto_site_serves_a_personal_model_pulled_toward_the_global_one(tmp_path):
    """The site's reply is the global model's update; the model it serves and scores is its personal one, kept between
    rounds; a larger ditto_lambda keeps the personal model closer to the global model it was trained toward."""
    from fedmed.nn.models import model_from_config
    from fedmed.nn.train import get_params
    from fedmed.run.jobspec import job_spec
    from fedmed.site.reply import answer

    gaps = {}
    for lam in (0.01, 10.0):
        exp, data = _federation(tmp_path / str(lam), lam)
        cfg = job_spec(exp, exp.methods[0], 0).task_config
        assert cfg["ditto_lambda"] == lam
        theta0 = get_params(model_from_config(exp.model.model_dump(), 1, 10))
        runner, (_, metrics, meta, sent), err = answer("site-1", None, "train", theta0, cfg, 0, settings=data)
        assert err is None, err
        personal = runner.state["personal"]
        mine = {k: v.detach().numpy().copy() for k, v in personal.state_dict().items()}
        assert _distance(mine, sent) > 0  # two models: the personal one is not the update sent back
        assert _distance(mine, theta0) > 0  # and it trained
        runner, (_, vmetrics, _, _), err = answer("site-1", runner, "validate", sent, cfg, 1, settings=data)
        assert err is None and runner.state["personal"] is personal  # kept between rounds, and served
        gaps[lam] = _distance(mine, theta0)
    assert gaps[10.0] < gaps[0.01], gaps  # the proximal term toward the round's global model holds it back


def test_a_ditto_run_finishes_and_scores_the_personal_models(tmp_path):
    from fedmed.run.jobspec import job_spec, run_spec_in_process

    exp, data = _federation(tmp_path, 0.1)
    status, fed = run_spec_in_process(job_spec(exp, exp.methods[0], 0), data, tmp_path / "run")
    assert status == "finished"
    rounds = fed.recorder.doc["rounds"]
    assert len(rounds) == exp.train.rounds + 1 and rounds[-1]["task"] == "validate"
    assert all(np.isfinite(r["summary"]["mean"]["accuracy"]) for r in rounds)
