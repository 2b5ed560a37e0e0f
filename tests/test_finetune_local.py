"""Local fine-tuning (#57's personalisation baseline, ``finetune_local``): FedAvg, then every site trains the final
global model a few epochs more on its own training split and is served that model, which never leaves the site."""

import numpy as np
import yaml


def _federation(tmp_path, **method):
    from fedmed.config import load_config
    from fedmed.run.experiment import prepare_federation, with_classes

    raw = {"name": "ftl", "dataset": {"path": "builtin:digits", "image_size": 8, "channels": 1, "max_per_class": 20},
           "federation": {"sites": 3, "partition": "dirichlet", "alpha": 0.3}, "model": {"arch": "resnet9", "width": 4},
           "train": {"rounds": 3, "local_epochs": 2, "batch_size": 8, "optimizer": "adam", "lr": 0.01},
           "privacy": {"k_min": 2}, "references": [],
           "methods": [{"name": "FT", "workflow": "finetune_local", **method}]}
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    exp = load_config(tmp_path / "c.yaml")
    data = prepare_federation(exp, 0, tmp_path / "data")
    return with_classes(exp, data), data


def test_finetune_local_alone_learns_and_serves_each_site_its_own_model(tmp_path):
    """The run's last round is every site's fine-tuned model, scored on its own splits: it learned (far above the
    untrained round 0) and it is not the global model (its scores differ from round R's); the options reach the site
    through the method's own model; no parameters come back from the fine-tuning."""
    from fedmed.run.jobspec import job_spec, run_spec_in_process

    exp, data = _federation(tmp_path, ft_epochs=3, ft_lr_scale=0.5)
    spec = job_spec(exp, exp.methods[0], 0)
    assert spec.task_config["method_options"] == {"epochs": 3, "lr_scale": 0.5}
    status, fed = run_spec_in_process(spec, data, tmp_path / "run")
    assert status == "finished", fed.recorder.doc.get("reason")
    rounds = fed.recorder.doc["rounds"]
    assert [r["task"] for r in rounds] == ["train", "train", "train", "validate", "finetune_local"]
    first, glob, own = (rounds[i]["summary"]["mean"] for i in (0, 3, 4))
    assert own["accuracy"] > first["accuracy"] + 0.3, (first, own)
    assert all(s["train_loss"] > 0 for s in rounds[4]["sites"].values())
    per_site = {s: (rounds[3]["sites"][s]["accuracy"], v["accuracy"]) for s, v in rounds[4]["sites"].items()}
    assert any(a != b for a, b in per_site.values()), per_site  # each site's own model, not the global one
    assert sorted(p.name for p in (tmp_path / "run" / "models").glob("*.pt")) == ["global.pt", "selected_global.pt"]
    # only the global one (final, and at its validation-selected round): the fine-tuned models stay at the sites


def test_a_site_rejects_finetune_options_out_of_range(tmp_path):
    """The site validates the options with the method's own model (here a job edited by hand)."""
    from fedmed.nn.models import model_from_config
    from fedmed.nn.train import get_params
    from fedmed.run.jobspec import job_spec
    from fedmed.site.reply import answer

    exp, data = _federation(tmp_path)
    cfg = job_spec(exp, exp.methods[0], 0).task_config
    theta = get_params(model_from_config(exp.model.model_dump(), 1, 10))
    cfg["method_options"] = {"epochs": 0, "lr_scale": 0.1}
    _, (_, metrics, meta, sent), err = answer("site-1", None, "finetune_local", theta, cfg, 4, settings=data)
    assert metrics == {"failed": 1.0} and "epochs" in meta["error"] and sent == {}
    cfg["method_options"] = {"epochs": 1, "lr_scale": 0.1}
    _, (_, metrics, meta, sent), err = answer("site-1", None, "finetune_local", theta, cfg, 4, settings=data)
    assert err is None and sent == {} and np.isfinite(metrics["accuracy"])


def test_the_method_and_the_serving_plan_fine_tune_the_same_model_from_the_same_seed(tmp_path):
    """#86: the finetune_local method's fine-tune (its last round, R + 1) and the plan's (serve_score in round 0, then
    its served round) scored 42.3 and 63.5 at one site: two seeds. One procedure now makes both: from the same global
    model the same training loss and the same validation accuracy at every site; and the method's reported row is its
    fine-tuned round, never a round of the plain FedAvg before it."""
    from fedmed.core.packing import pack_models
    from fedmed.report.summary import reported_rows, rows_from_metrics
    from fedmed.run.jobspec import job_spec, run_spec_in_process
    from fedmed.site.runner import SiteRunner
    from fedmed.site.settings import settings_for_dir
    from fedmed.core.policy import SitePolicy
    from fedmed.nn.predict import load_model
    from fedmed.nn.train import get_params

    exp, data = _federation(tmp_path, ft_epochs=2, ft_lr_scale=0.5)
    spec = job_spec(exp, exp.methods[0], 0)
    status, fed = run_spec_in_process(spec, data, tmp_path / "run")
    assert status == "finished", fed.recorder.doc.get("reason")
    method = fed.recorder.doc["rounds"][-1]["sites"]  # round R + 1: each site's fine-tuned model
    net, _ = load_model(tmp_path / "run" / "models" / "global.pt")
    params = get_params(net)
    opts = {"epochs": 2, "lr_scale": 0.5}
    cfg = {**spec.task_config, "method_options": {"names": ["global"], "finetune": opts}}
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the in-process federation's sites compute
    try:
        replies = {}
        for site in method:
            runner = SiteRunner(site, settings_for_dir(site, data, policy=SitePolicy.simulating(2)))
            replies[site] = runner.handle("serve_score", pack_models([params]), cfg, 0)
    finally:
        torch.set_num_threads(threads)
    for site, (_, metrics, meta, _) in replies.items():
        assert meta["finetune_train_loss"] == method[site]["train_loss"], site  # the same data order and model
        got = metrics["val_accuracy/finetuned"]
        assert np.isnan(got) or got == method[site]["val_accuracy"], site
    rows = rows_from_metrics("FT", 0, fed.recorder.doc)
    for selection in ("final", "validation"):
        assert reported_rows(rows, selection)[("FT", 0)]["task"] == "finetune_local"
