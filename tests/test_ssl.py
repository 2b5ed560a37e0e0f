"""Fed-MAE, fine-tuning and PreP-WFL (``001_``): the math, the site tasks and the bad inputs."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fedmed.data.images import DataError, discover

from fedmed.data.datalists import write_site_datalists
from fedmed.nn.mae import (ViTClassifier, encoder_state, layerwise_param_groups, mae_eval_loss, mae_loss, mae_model,
                        patchify, scheduled_lr, train_mae_local)
from fedmed.site.mae import MAESiteRunner

from conftest import mae_section
from fedmed.nn.train import get_params, train_local

ROOT = Path(__file__).resolve().parents[1]
TINY = {"img_size": 16, "patch_size": 4, "hidden_size": 32, "mlp_dim": 64, "num_layers": 2, "num_heads": 2,
        "decoder_hidden_size": 32, "decoder_mlp_dim": 64, "decoder_num_layers": 1, "decoder_num_heads": 2}


def test_prep_wfl_uses_pytorch_weighted_cross_entropy():
    """Eq. 3 read as PyTorch's weighted CE: sum_i w_{y_i} l_i / sum_i w_{y_i} (not / N, the other reading)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 3))
    x = torch.rand(6, 1, 2, 2)
    y = torch.tensor([0, 0, 0, 1, 1, 2])
    w = np.array([1.0, 0.5, 1 / 3])
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # no step: the reported loss is the loss at these weights
    out = train_local(model, x, y, epochs=1, batch_size=6, optimizer=opt, class_weights=w, augment="none")
    with torch.no_grad():
        per = torch.nn.functional.cross_entropy(model((x - 0.5) / 0.5), y, reduction="none").numpy()
    wy = w[y.numpy()]
    pytorch_reading = float((wy * per).sum() / wy.sum())
    per_n_reading = float((wy * per).sum() / len(per))
    assert out["loss"] == pytest.approx(pytorch_reading, rel=1e-5)
    assert abs(out["loss"] - per_n_reading) > 1e-3


def test_patchify_matches_the_patch_embedding_order():
    """Patch j of ``patchify`` is the j-th token of MONAI's conv patch embedding (row-major over the grid)."""
    x = torch.zeros(1, 1, 8, 8)
    for r in range(2):
        for c in range(2):
            x[0, 0, 4 * r:4 * r + 4, 4 * c:4 * c + 4] = 2 * r + c
    p = patchify(x, 4)
    assert p.shape == (1, 4, 16)
    assert [float(v) for v in p[0, :, 0]] == [0.0, 1.0, 2.0, 3.0]
    conv = torch.nn.Conv2d(1, 1, 4, stride=4, bias=False)
    torch.nn.init.constant_(conv.weight, 1 / 16)
    tokens = conv(x).flatten(2).transpose(1, 2)[0, :, 0]
    assert torch.allclose(tokens, p[0].mean(dim=1))


def test_mae_loss_counts_only_masked_patches():
    model = mae_model(1, spec=TINY, mask_ratio=0.75, seed=0)
    x = torch.rand(2, 1, 16, 16)
    torch.manual_seed(3)
    with torch.no_grad():
        pred, mask = model(x, masking_ratio=0.75)
    assert int(mask.sum()) == 2 * 12  # 75% of 16 patches per image
    target = patchify(x, 4)
    err = ((pred - target) ** 2).mean(-1)
    torch.manual_seed(3)
    with torch.no_grad():
        loss = mae_loss(model, x, 0.75)
    assert float(loss) == pytest.approx(float((err * mask).sum() / mask.sum()), rel=1e-5)
    assert float(loss) != pytest.approx(float(err.mean()), rel=1e-3)


def _structured(n, seed):
    g = torch.Generator().manual_seed(seed)
    yy, xx = torch.meshgrid(torch.linspace(0, 1, 16), torch.linspace(0, 1, 16), indexing="ij")
    f = torch.rand(n, 1, 1, generator=g) * 3 + 1
    ph = torch.rand(n, 1, 1, generator=g) * 6
    return (0.5 + 0.5 * torch.sin(f * 6 * xx + ph) * torch.cos(f * 3 * yy)).unsqueeze(1)


def test_mae_reconstruction_loss_falls_with_training():
    model = mae_model(1, spec=TINY, seed=0)
    x, held = _structured(64, 0), _structured(32, 1)
    before = mae_eval_loss(model, held, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.05)
    g = torch.Generator().manual_seed(0)
    for r in range(4):
        out = train_mae_local(model, x, epochs=5, batch_size=16, optimizer=opt, progress=(r / 4, (r + 1) / 4),
                              base_lr=1.5e-3 * 256 / 16, warmup=0.05, generator=g)
        assert np.isfinite(out["loss"]) and out["steps"] == 20
    after = mae_eval_loss(model, held, seed=1)
    assert after < 0.6 * before, (before, after)


def test_mae_training_draws_its_masks_from_the_injected_generator():
    """MONAI's MaskedAutoEncoderViT draws each batch's mask from torch's global generator: Fed-MAE pre-training gave
    other losses and another encoder at every run of the same seed (train loss 0.25774 vs 0.25691 in round 0). The
    masks now come from the task's seeded generator: the same seed, the same model; another seed, other masks."""
    x = _structured(32, 0)

    def run(seed: int, stir: int):
        torch.manual_seed(stir)  # whatever the process's global generator holds
        model = mae_model(1, spec=TINY, seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95))
        out = train_mae_local(model, x, epochs=1, batch_size=16, optimizer=opt, progress=(0.0, 0.5),
                              base_lr=1.5e-3, warmup=0.0, generator=torch.Generator().manual_seed(seed))
        return out["loss"], torch.cat([p.detach().flatten() for p in model.parameters()])

    (a, pa), (b, pb), (c, _) = run(0, 1), run(0, 2), run(1, 1)
    assert a == b and torch.equal(pa, pb)
    assert a != c


def test_mae_lr_schedule_and_scaling_rule():
    assert scheduled_lr(1.0, 0.0, 0.1) == 0.0
    assert scheduled_lr(1.0, 0.05, 0.1) == pytest.approx(0.5)
    assert scheduled_lr(1.0, 0.1, 0.1) == pytest.approx(1.0)
    assert scheduled_lr(1.0, 0.55, 0.1) == pytest.approx(0.5)
    assert scheduled_lr(1.0, 1.0, 0.1) == pytest.approx(0.0, abs=1e-12)
    model = mae_model(1, spec=TINY, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1.0)
    seen = []
    orig = opt.step

    def step(*a, **k):
        seen.append(opt.param_groups[0]["lr"])
        return orig(*a, **k)

    opt.step = step
    train_mae_local(model, torch.rand(64, 1, 16, 16), epochs=1, batch_size=64, optimizer=opt, progress=(0.5, 0.6),
                    base_lr=1.5e-4, warmup=0.05, generator=torch.Generator().manual_seed(0))
    peak = 1.5e-4 * 64 / 256  # MAE's scaling rule: base lr x batch / 256
    assert seen == [pytest.approx(scheduled_lr(peak, 0.5, 0.05))]


def test_layerwise_decay_groups():
    clf = ViTClassifier(1, num_classes=3, spec=TINY)
    groups = {g["lr_scale"]: {id(p) for p in g["params"]} for g in layerwise_param_groups(clf, 0.75)}
    assert id(clf.head.weight) in groups[1.0]
    assert id(clf.patch_embedding.patch_embeddings.weight) in groups[0.75 ** 3]  # L = 2 blocks, +1
    assert id(clf.cls_token) in groups[0.75 ** 3]
    assert id(next(clf.blocks[1].parameters())) in groups[0.75]
    assert id(next(clf.blocks[0].parameters())) in groups[0.75 ** 2]
    assert sum(len(v) for v in groups.values()) == len(list(clf.parameters()))


def test_fedmae_encoder_is_the_classifiers_and_the_registrys_encoder(tmp_path):
    mae = mae_model(3, seed=5)
    enc = encoder_state(dict(mae.state_dict()))
    assert enc and all(k.startswith(("patch_embedding.", "cls_token", "blocks.")) for k in enc)
    clf = ViTClassifier(3, num_classes=10)
    missing, unexpected = clf.load_state_dict(enc, strict=False)
    assert not unexpected and set(missing) == {"head.weight", "head.bias"}
    f = tmp_path / "encoder.pt"
    torch.save(enc, f)
    from fedmed.nn.encoders import build_encoder

    e = build_encoder("fedmae_vit", weights=str(f), seed=0, in_channels=3)
    assert "random" not in e.description.lower()
    x = torch.rand(2, 3, 32, 32)
    clf.eval()
    with torch.no_grad():
        ref = clf.forward_features((x - 0.5) / 0.5)
    assert ref.shape == (2, 128)


# ---------------------------------------------------------------------------------------------- bad input
def _federation(tmp_path, parts_fn):
    pool = discover("builtin:digits", max_per_class=12)
    write_site_datalists(pool, parts_fn(pool.labels), tmp_path, test_fraction=0.25, seed=0)
    return tmp_path


MAE_CFG = {"seed": 0, "task": "mae", "data": {"image_size": 32, "channels": 1, "n_classes": 10},
           "train": {"local_epochs": 1, "batch_size": 8}, "method_options": mae_section(2)}


def test_mae_site_without_unlabeled_images_is_named(tmp_path):
    d = _federation(tmp_path, lambda y: [np.arange(20)])
    doc = json.loads((d / "site-1.json").read_text())
    doc["training"] = []
    (d / "site-1.json").write_text(json.dumps(doc))
    runner = MAESiteRunner("site-1", d)
    with pytest.raises(DataError, match="site-1: .*no training images"):
        runner.handle("train", get_params(runner.model(MAE_CFG)), MAE_CFG, 0)


def test_mae_site_ignores_labels_and_trains(tmp_path):
    d = _federation(tmp_path, lambda y: [np.arange(20)])
    cfg = {**MAE_CFG, "data": {**MAE_CFG["data"], "n_classes": 2}}  # labels beyond 0..1 do not matter unlabeled
    runner = MAESiteRunner("site-1", d)
    _, metrics, meta, params = runner.handle("train", get_params(runner.model(cfg)), cfg, 0)
    assert params and np.isfinite(metrics["train_loss"]) and meta["n_train"] == 15


def test_site_with_labels_outside_the_global_label_space_is_named(tmp_path):
    from fedmed.site.runner import SiteRunner

    d = _federation(tmp_path, lambda y: [np.flatnonzero(y < 3)])
    cfg = {"seed": 0, "classes": ["0", "1"], "data": {"image_size": 8, "channels": 1, "n_classes": 2},
           "model": {"arch": "resnet9", "width": 4}, "train": {"local_epochs": 1, "batch_size": 8, "lr": 0.01}}
    with pytest.raises(DataError, match=r"site-1: datalist .* label\(s\) \[2\] outside the job's global label space "
                                        r"0\.\.1 \(0, 1\)"):
        SiteRunner("site-1", d).handle("class_set", {}, cfg)


def test_prep_round_sends_only_class_ids_of_large_enough_classes(tmp_path):
    from fedmed.site.runner import SiteRunner

    d = _federation(tmp_path, lambda y: [np.r_[np.flatnonzero(y == 1), np.flatnonzero(y == 4)[:2]]])
    cfg = {"seed": 0, "data": {"image_size": 8, "channels": 1, "n_classes": 10}, "privacy": {"k_min": 5}}
    _, metrics, meta, params = SiteRunner("site-1", d).handle("class_set", {}, cfg)
    assert params == {} and meta["classes"] == [1]  # class 4 has < k_min training images: not reported
    assert "k_min" in meta["notes"][0]
    assert set(meta) == {"classes", "notes", "site_policy"}  # site_policy: the site's own rules, once per run
    assert meta["site_policy"]["k_min"] == 5 and meta["site_policy"]["source"] == "default"


def test_predi_target_that_cannot_be_met_names_the_parameter(tmp_path):
    from fedmed.config import load_config
    from fedmed.run.experiment import prepare_federation

    base = {"name": "t", "dataset": {"path": "builtin:digits", "image_size": 8, "channels": 1, "max_per_class": 20},
            "federation": {"sites": 4, "partition": "predi", "predi_prevalence": 3.5, "predi_samples_per_cell": 10,
                           "common_test_fraction": 0.3, "val_fraction": 0.0},
            "methods": [{"name": "FedAvg", "workflow": "fedavg"}]}
    with pytest.raises(ValueError, match=r"federation\.predi_prevalence=3\.5.*cannot be met: class \d+ has \d+ images"):
        prepare_federation(load_config(base), 0, tmp_path / "a")
    with pytest.raises(Exception, match="predi_prevalence"):
        prepare_federation(load_config(base, ["federation.predi_prevalence=5"]), 0, tmp_path / "b")


def test_vit_workflows_need_the_vits_image_size():
    from fedmed.config import ConfigError, load_config

    cfg = {"name": "t", "dataset": {"path": "builtin:digits", "image_size": 64, "channels": 1},
           "methods": [{"name": "MAE", "workflow": "fedmae"}]}
    with pytest.raises(ConfigError, match=r"'MAE'.*32 x 32.*dataset\.image_size: 32 \(got 64\)"):
        load_config(cfg)
    assert load_config(cfg, ["dataset.image_size=32"]).dataset.image_size == 32


def test_finetuning_lr_is_the_configured_lr_not_maes_batch_scaled_one(tmp_path):
    """docs/readings.md (001_ §4.2 "base learning rate 1e-3"): fine-tuning peaks at ``train.lr`` itself (x the
    layer's decay), whatever the batch size; MAE's ``x batch / 256`` rule is applied to pre-training only."""
    from fedmed.core.schema import task_config
    from fedmed.site.tasks import _finetune_optimizer, _finetune_schedule

    cfg = task_config({"seed": 0, "data": {"image_size": 32, "channels": 3, "n_classes": 10},
                       "train": {"lr": 1e-3, "batch_size": 16, "weight_decay": 0.05},
                       "finetune": {"layer_decay": 0.75, "warmup": 0.05, "rounds": 20}})
    at = _finetune_schedule(cfg, 1)  # round 1 of 20: past the 5% warm-up
    assert at(0.0) == pytest.approx(scheduled_lr(1e-3, 1 / 20, 0.05))
    assert at(0.0) > 0.9e-3  # the batch-scaled reading would peak at 1e-3 x 16 / 256 = 6.25e-5
    clf = ViTClassifier(3, num_classes=10)
    opt = _finetune_optimizer(clf, cfg)  # what the training task makes for fine-tuning
    assert max(g["lr"] for g in opt.param_groups) == pytest.approx(1e-3)
    assert {g["lr_scale"] for g in opt.param_groups} == {0.75 ** d for d in range(6)}


def test_resume_key_follows_the_encoders_bytes_not_only_its_path(tmp_path):
    """Every pre-training run into one output folder writes the encoder to the same path: a fine-tuning made from an
    older encoder must not be reused after a pre-training rerun with other settings (it once was)."""
    from fedmed.config import load_config
    from fedmed.run.ssl import run_key

    exp = load_config(ROOT / "app_configs" / "ssl_imagenette.yaml")
    ft = next(m for m in exp.methods if m.name == "Fed-MAE init")
    enc = tmp_path / "encoder.pt"
    torch.save({"w": torch.zeros(3)}, enc)
    before = run_key(exp, ft, 0, ["federation.predi_prevalence=1.5"], enc)
    assert run_key(exp, ft, 0, ["federation.predi_prevalence=1.5"], enc) == before  # stable: --resume can reuse
    torch.save({"w": torch.ones(3)}, enc)
    assert run_key(exp, ft, 0, ["federation.predi_prevalence=1.5"], enc) != before
    assert run_key(exp, ft, 0, ["federation.predi_prevalence=2.5"], enc) != run_key(
        exp, ft, 0, ["federation.predi_prevalence=1.5"], enc)
    rnd = next(m for m in exp.methods if m.name == "Random init")
    assert run_key(exp, rnd, 0, []) == run_key(exp, rnd, 0, [])  # no encoder: the settings alone


def test_ssl_validation_draws_pool_images_outside_the_labeled_split_and_refuses_test_images(tmp_path):
    """benchmarks/ssl_validation.py chooses a study's settings on pool images no site holds as labeled training
    images, and refuses to go on if any of them is a common-test image."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from ssl_validation import validation_datalists

    case, pool = tmp_path / "case", tmp_path / "pool"
    case.mkdir(), pool.mkdir()
    e = lambda site, i: {"image": f"images/{site}/{i:06d}_{i}.png", "label": i % 2}  # noqa: E731
    for s, lab, pl in (("site-1", [1, 2], [1, 2, 3, 4]), ("site-2", [5], [5, 6, 7])):
        (case / f"{s}.json").write_text(json.dumps({"training": [e(s, i) for i in lab], "validation": [],
                                                    "test": [e("common_test", 9)]}))
        (pool / f"{s}.json").write_text(json.dumps({"training": [e(s, i) for i in pl], "validation": []}))
    (case / "dataset.json").write_text("{}")
    assert validation_datalists(case, pool, ["site-1", "site-2"], 10, 0, tmp_path / "val") == 4
    doc = json.loads((tmp_path / "val" / "site-1.json").read_text())
    assert sorted(Path(x["image"]).stem.split("_")[-1] for x in doc["test"]) == ["3", "4", "6", "7"]
    assert [Path(x["image"]).name for x in doc["training"]] == ["000001_1.png", "000002_2.png"]
    (pool / "site-2.json").write_text(json.dumps({"training": [e("site-2", 9)], "validation": []}))
    with pytest.raises(SystemExit, match="in the common test set"):
        validation_datalists(case, pool, ["site-1", "site-2"], 10, 0, tmp_path / "val2")


def test_a_studys_fedmae_lr_reaches_the_sites_not_the_papers_default():
    """app_configs/ssl_pneumonia.yaml pre-trains at base lr 6e-3 (chosen on validation, docs/results.md), not 001_'s
    1.5e-4: the method's value is what the sites' task configuration carries (the site falls back to 1.5e-4 only
    when none is given)."""
    from fedmed.config import load_config
    from fedmed.run.taskconfig import build_task_config

    root = Path(__file__).resolve().parents[1]
    exp = load_config(root / "app_configs" / "ssl_pneumonia.yaml", ['dataset.classes=["normal","pneumonia"]'])
    method = next(m for m in exp.methods if m.workflow == "fedmae")
    cfg = build_task_config(exp, 0, method, exp.site_names())
    assert cfg["task"] == "mae" and cfg["method_options"]["base_lr"] == pytest.approx(6e-3)


@pytest.mark.slow
def test_fedmed_ssl_runs_end_to_end_and_pre_trains_the_same_encoder_twice(tmp_path):
    """README's ``fedmed ssl CONFIG`` (Fed-MAE pre-training in FLARE's simulator, then the PreDi fine-tuning
    federations) on a small digits study, run twice: it finishes, reports a finite pre-training curve and both
    fine-tuning rows, and the two runs pre-train the same encoder (before 8f41ecb MONAI's masks came from torch's
    global generator and no two runs agreed: train loss 0.25774 vs 0.25691 in round 0)."""
    import yaml

    from fedmed.cli.main import main

    raw = {"name": "ssl-small", "dataset": {"path": "builtin:digits", "image_size": 32, "channels": 1,
                                            "max_per_class": 20},
           "federation": {"sites": 3, "partition": "predi", "predi_prevalence": 2.0, "predi_disparity": 0.0,
                          "predi_samples_per_cell": 3, "common_test_fraction": 0.3, "val_fraction": 0.0},
           "model": {"arch": "vit_small"},
           "train": {"rounds": 1, "local_epochs": 1, "batch_size": 16, "optimizer": "adamw", "lr": 1e-3},
           "privacy": {"k_min": 2}, "references": [], "seeds": [0],
           "methods": [{"name": "Fed-MAE", "workflow": "fedmae", "rounds": 1, "local_epochs": 1, "batch_size": 16},
                       {"name": "Fed-MAE init", "workflow": "finetune", "init": "fedmae", "local_only": False},
                       {"name": "Random init", "workflow": "finetune", "init": "random", "local_only": False}],
           "sweep": [{"name": "p2", "set": ["federation.predi_prevalence=2.0"],
                      "methods": ["Fed-MAE init", "Random init"]}]}
    cfg = tmp_path / "ssl.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    runs = []
    for out in (tmp_path / "a", tmp_path / "b"):
        assert main(["ssl", str(cfg), "--out", str(out)]) == 0
        res = json.loads((out / "ssl_results.json").read_text())
        curve = res["pretrain"]["0"]["curve"]
        assert curve and all(np.isfinite(v) for row in curve for v in row[1:] if v is not None)
        assert set(res["finetune"]["p2"]) == {"Fed-MAE init", "Random init"}
        assert (out / "summary.md").is_file() and Path(res["pretrain"]["0"]["encoder"]).is_file()
        runs.append(res)
    assert runs[0]["pretrain"]["0"]["curve"] == runs[1]["pretrain"]["0"]["curve"]
    a, b = (torch.load(r["pretrain"]["0"]["encoder"], weights_only=True) for r in runs)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
