"""2D lesion segmentation from a hospital-style index with masks (fedmed.site.seg2d): a site per source, FedAvg that
learns, the 004_ assessment on 2D images, references, and the checks."""

import csv
import json

import numpy as np
import pytest
import yaml
from PIL import Image

from fedmed.config import ConfigError, load_config
from fedmed.run.followups import ServingPlan

SOURCES = {"scanA": 0.15, "scanB": 0.35, "scanC": 0.55}  # background brightness: the sources differ


def _index(tmp_path, n_patients=12, size=32):
    """Noisy images with one bright disc (the lesion) each, its mask, a patient per image."""
    rng = np.random.default_rng(0)
    (tmp_path / "img").mkdir()
    rows = []
    yy, xx = np.mgrid[:size, :size]
    for s, bg in SOURCES.items():
        for p in range(n_patients):
            cy, cx, r = rng.integers(9, size - 9, 2).tolist() + [int(rng.integers(4, 8))]
            mask = ((yy - cy) ** 2 + (xx - cx) ** 2 <= r * r)
            img = np.clip(bg + 0.08 * rng.standard_normal((size, size)) + 0.4 * mask, 0, 1)
            Image.fromarray((img * 255).astype(np.uint8)).save(tmp_path / "img" / f"{s}_{p}.png")
            Image.fromarray(mask.astype(np.uint8) * 255).save(tmp_path / "img" / f"{s}_{p}_mask.png")
            rows.append({"image": f"img/{s}_{p}.png", "mask": f"img/{s}_{p}_mask.png", "label": p % 2, "site": s,
                         "case": f"{s}{p}"})
    f = tmp_path / "index.csv"
    with f.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return f


def _config(tmp_path, methods, **over):
    raw = {"name": "seg2d", "dataset": {"task": "segmentation", "image_size": 32, "channels": 1,
                                        "sources": [{"path": str(_index(tmp_path)), "mask_column": "mask"}]},
           "federation": {"partition": "natural", "test_fraction": 0.25, "val_fraction": 0.2},
           "model": {"arch": "unet", "channels": [8, 16, 32]},
           "train": {"rounds": 5, "local_epochs": 4, "batch_size": 4, "lr": 0.01, "weight_decay": 0.0},
           "privacy": {"k_min": 2}, "methods": methods, "seeds": [0], **over}
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(raw))
    return load_config(p)


def test_a_segmentation_federation_from_an_index_has_masks_as_labels_and_patients_apart(tmp_path):
    from fedmed.run.experiment import prepare_federation

    exp = _config(tmp_path, [{"name": "FedAvg", "workflow": "fedavg"}])
    out = prepare_federation(exp, 0, tmp_path / "fed")
    meta = json.loads((out / "dataset.json").read_text())
    assert meta["sites"] == ["scanA", "scanB", "scanC"]
    for s in meta["sites"]:
        doc = json.loads((out / f"{s}.json").read_text())
        entries = doc["training"] + doc["validation"] + doc["test"]
        assert len(entries) == 12 and all(e["label"].endswith("_mask.png") and e["image"].split("/")[-1].startswith(s)
                                         for e in entries)
        assert not {e["subject"] for e in doc["test"]} & {e["subject"] for e in doc["training"]}


def test_a_segmentation_source_without_masks_is_refused_when_the_config_is_read(tmp_path):
    with pytest.raises(ConfigError, match="name no mask_column"):
        _config(tmp_path, [{"name": "FedAvg", "workflow": "fedavg"}],
                dataset={"task": "segmentation", "sources": [{"path": str(tmp_path / "x.csv")}]})


def test_ditto_for_2d_lesions_is_refused_when_the_config_is_read(tmp_path):
    """Ditto runs for classification and 3D segmentation; a 2D lesion site cannot, so the config says so before any
    round (the site's own refusal came only once the job ran)."""
    with pytest.raises(ConfigError, match="Ditto is not available for 2D lesion segmentation"):
        _config(tmp_path, [{"name": "Ditto", "workflow": "ditto"}])


def test_fedavg_learns_2d_lesions_and_the_assessment_sees_the_sources(tmp_path):
    """FedAvg of a 2D U-Net over three sources: the served model's lesion Dice rises well above the untrained one's;
    the 004_ assessment on 2D images names the brightest source as the most distant by EMD, and the two-cluster split
    keeps each source whole."""
    from fedmed.run.experiment import prepare_federation, with_classes
    from fedmed.run.jobspec import job_spec, run_spec_in_process

    exp = _config(tmp_path, [{"name": "FedAvg", "workflow": "fedavg"},
                             {"name": "Assess", "workflow": "seg_assess"}])
    data = prepare_federation(exp, 0, tmp_path / "fed")
    exp = with_classes(exp, data)
    assert exp.federation.site_names == ["scanA", "scanB", "scanC"]
    status, fed = run_spec_in_process(job_spec(exp, exp.methods[0], 0), data, tmp_path / "fedavg")
    assert status == "finished"
    rounds = fed.recorder.doc["rounds"]
    first, last = rounds[0]["summary"]["mean"]["dice_mean"], rounds[-1]["summary"]["mean"]["dice_mean"]
    assert rounds[-1]["task"] == "validate" and last > 0.6 and last > first + 0.3, (first, last)
    assert "val_dice_mean" in rounds[-1]["summary"]["mean"]
    status, fed = run_spec_in_process(job_spec(exp, exp.methods[1], 0), data, tmp_path / "assess")
    assert status == "finished"
    rep = json.loads((tmp_path / "assess" / "assessment" / "assessment.json").read_text())
    assert rep["emd"]["most_distant"] in ("scanA", "scanC")  # an end of the brightness range
    assert rep["euc"]["encoder"][0].startswith("efficientnet_lite0")


def test_the_2d_references_score_each_site_on_its_own_test_split(tmp_path):
    from fedmed.run.experiment import prepare_federation, with_classes
    from fedmed.run.references import seg2d_reference_rows

    exp = _config(tmp_path, [{"name": "FedAvg", "workflow": "fedavg"}])
    data = prepare_federation(exp, 0, tmp_path / "fed")
    exp = with_classes(exp, data)
    meta = json.loads((data / "dataset.json").read_text())
    rows = seg2d_reference_rows(exp, data, meta["sites"], 0, meta["groups"], log=lambda *_: None)
    names = [r["method"] for r in rows]
    assert names.count("Centralized") == exp.train.rounds + 1
    assert names.count("Each source alone") == exp.train.rounds and names[-1] == "Each source alone"
    central = [r for r in rows if r["method"] == "Centralized"]
    assert central[-1]["dice_mean"] > central[0]["dice_mean"] + 0.3
    assert set(rows[-1]["sites"]) == {"scanA", "scanB", "scanC"}
    # every round has the sites' validation Dice: `selection: validation` picks the references' round on it (a
    # BUS-BRA experiment stopped here: "Centralized seed 0: selection 'validation' needs validation metrics")
    assert all(isinstance(r.get("val_dice_mean"), float) for r in rows)
    from fedmed.report.summary import reported_rows

    picked = reported_rows(rows, "validation")
    best = max(central, key=lambda r: (r["val_dice_mean"], -r["round"]))
    assert picked[("Centralized", 0)]["round"] == best["round"]


def test_a_2d_experiments_report_and_table_are_written(tmp_path):
    """A BUS-BRA run stopped at its very end: the report tried to draw 3D slices with the final 2D model (`fedmed
    predict` refuses 2D lesion models). A 2D run's report is written without them; its table's intro speaks of images,
    and the FP column says n/a when no test image is lesion-free (BUS-BRA has none)."""
    from fedmed.nn.predict import save_model
    from fedmed.nn.seg2d import seg2d_metrics, seg2d_model
    from fedmed.nn.train import get_params
    from fedmed.report.html import write_report
    from fedmed.report.summary import write_outputs

    import torch

    x = torch.rand(3, 1, 16, 16)
    y = torch.zeros(3, 1, 16, 16)
    y[:, :, 4:9, 4:9] = 1  # every image holds a lesion
    assert np.isnan(seg2d_metrics(seg2d_model(1, channels=(4, 8), seed=0), x, y)["fp_pixels"])
    out = tmp_path / "out"
    run = out / "runs" / "seed0" / "FedAvg"
    (run / "server" / "models").mkdir(parents=True)
    (out / "data" / "seed0").mkdir(parents=True)
    (out / "data" / "seed0" / "dataset.json").write_text(json.dumps({"sites": ["scanA"]}))
    cfg = {"task": "segmentation", "data": {"spatial_dims": 2, "image_size": 16, "in_channels": 1},
           "model": {"arch": "unet", "channels": [4, 8]}}
    save_model(run / "server" / "models" / "global.pt", get_params(seg2d_model(1, channels=(4, 8), seed=0)), cfg)
    (run / "metrics.json").write_text(json.dumps({"status": "finished", "reason": "", "sites": ["scanA"], "rounds": [],
                                                  "meta": {"config": cfg}}))
    rows = [{"method": "FedAvg", "kind": "method", "seed": 0, "round": r, "task": "train", "dice_mean": 0.3 + 0.2 * r,
             "fp_pixels": float("nan"), "sites": {"scanA": {"dice_mean": 0.3 + 0.2 * r}}} for r in range(2)]
    md = write_outputs(rows, out, title="t", command="fedmed experiment x")
    assert "Dice per test image holding a lesion" in md and "HD95" not in md
    assert "| FedAvg | final (1) | 50.00 | n/a |" in md, md
    assert write_report(out).is_file()


def test_the_serving_plan_chooses_2d_lesion_segmenters_on_the_sites_validation_dice(tmp_path):
    """#57 for 2D lesion segmentation: the plan's sites score the global model and their cluster's model on their
    validation images and send paired counts of per-image lesion Dice (never a Dice per image); each site is served
    one of the two (its ``models/<site>.pt`` that model's file), the served model's validation Dice is the one it was
    chosen on, and a candidate that is the global model itself is never served (no image differs). The global model
    fine-tuned at each site is a candidate too (it stays at the site). A 3D segmenter is refused when the job is
    built, in one line."""
    from fedmed.report.html import plan_html, visible_text
    from fedmed.run.experiment import prepare_federation, with_classes
    from fedmed.run.jobspec import BuildError, job_spec, run_spec_in_process

    exp = _config(tmp_path, [{"name": "FedAvg", "workflow": "fedavg"},
                             {"name": "Clusters", "workflow": "seg_clusters", "distance": "emd"}],
                  train={"rounds": 3, "local_epochs": 2, "batch_size": 4, "lr": 0.01, "weight_decay": 0.0})
    data = prepare_federation(exp, 0, tmp_path / "fed")
    exp = with_classes(exp, data)
    for m in exp.methods:
        status, fed = run_spec_in_process(job_spec(exp, m, 0), data, tmp_path / m.name)
        assert status == "finished", fed.recorder.doc.get("reason")
    plan = {"reference": tmp_path / "FedAvg", "candidates": {"Clusters": tmp_path / "Clusters", "Same": tmp_path / "FedAvg"}}
    status, fed = run_spec_in_process(job_spec(exp, exp.methods[0], 0, follows=ServingPlan(**plan)), data, tmp_path / "plan")
    assert status == "finished", fed.recorder.doc.get("reason")
    chosen = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert sorted(chosen) == ["scanA", "scanB", "scanC"]
    rounds = {r["task"]: r["sites"] for r in fed.recorder.doc["rounds"]}
    for site, v in chosen.items():
        assert v["served"] in ("global", "Clusters")
        same = v["evidence"]["Same"]  # 0 wins and 0 losses: counts below k_min (2) are never sent (#86); the sums
        assert same == {"n": same["n"], "sum_d": 0.0, "sum_d2": 0.0}  # of the Dice differences are, over >= k_min
        c = v["evidence"]["Clusters"]  # the counts only where each is at least k_min
        assert c["n"] >= 2 and ("wins" not in c or (min(c["wins"], c["losses"]) >= 2 and c["wins"] + c["losses"]
                                                    <= c["n"]))
        scored = rounds["serve_score"][site]
        assert set(scored) >= {"val_dice_mean/global", "val_dice_mean/Clusters"}
        assert rounds["served"][site]["val_dice_mean"] == pytest.approx(scored[f"val_dice_mean/{v['served']}"])
        assert rounds["global"][site]["val_dice_mean"] == pytest.approx(scored["val_dice_mean/global"])
        want = tmp_path / "FedAvg" / "models" / "global.pt" if v["served"] == "global" else \
            tmp_path / "Clusters" / "models" / v["file"]
        assert (tmp_path / "plan" / "models" / f"{site}.pt").read_bytes() == want.read_bytes()
    page = visible_text(plan_html(tmp_path / "plan"))
    assert "Clusters (val)" in page and "Same (val)" in page and page.count("✓") == 3
    # the global model fine-tuned at each site: scored on its validation images; where it is served, the served round
    # makes it again at the site (the same seed and settings: the same validation Dice) and no file leaves the site
    tuned = {**plan, "candidates": {}, "finetune": {"epochs": 3, "lr_scale": 1.0}, "alpha": 0.5}
    status, fed = run_spec_in_process(job_spec(exp, exp.methods[0], 0, follows=ServingPlan(**tuned)), data, tmp_path / "tuned")
    assert status == "finished", fed.recorder.doc.get("reason")
    chosen = json.loads((tmp_path / "tuned" / "plan.json").read_text())
    rounds = {r["task"]: r["sites"] for r in fed.recorder.doc["rounds"]}
    for site, v in chosen.items():
        scored = rounds["serve_score"][site]
        assert scored["val_dice_mean/finetuned"] != scored["val_dice_mean/global"]  # it trained
        c = v["evidence"]["finetuned"]
        assert "wins" not in c or min(c["wins"], c["losses"]) >= 2
        assert rounds["served"][site]["val_dice_mean"] == pytest.approx(scored[f"val_dice_mean/{v['served']}"])
        assert (tmp_path / "tuned" / "models" / f"{site}.pt").exists() == (v["served"] != "finetuned")
    assert "finetuned" in {v["served"] for v in chosen.values()}, chosen  # 3 epochs at lr 0.01 beat 3 rounds' model
    from fedmed.core.resources import shipped_config

    vol = load_config(shipped_config("demo_seg_phantoms.yaml"))  # 3D: its sites score volumes, not yet by the plan
    with pytest.raises(BuildError, match=r"scores classifiers and 2D lesion segmenters \(this config's task: "
                                         r"segmentation, 3D\)"):
        job_spec(vol, vol.methods[0], 0, follows=ServingPlan(**plan))


def test_a_2d_sites_fine_tuning_replies_carry_only_aggregates(tmp_path):
    """What leaves a 2D lesion site when the plan fine-tunes there (docs/privacy.md): ``serve_score`` sends per
    candidate only n, the sums of its per-image Dice differences (and wins / losses where none is below k_min) and
    each model's mean validation Dice; ``finetune_local`` (the served round's
    remake) only its scores, its training loss and counts — no parameters, no per-image value. The remake is the
    model ``serve_score`` scored: the same validation Dice."""
    from fedmed.core.packing import pack_models
    from fedmed.nn.seg2d import seg2d_model
    from fedmed.nn.train import get_params
    from fedmed.run.experiment import prepare_federation, with_classes
    from fedmed.run.jobspec import job_spec
    from fedmed.site.seg2d import Seg2DSiteRunner

    from conftest import own_site

    exp = _config(tmp_path, [{"name": "FedAvg", "workflow": "fedavg"}])
    data = prepare_federation(exp, 0, tmp_path / "fed")
    cfg = job_spec(with_classes(exp, data), exp.methods[0], 0).task_config
    runner = own_site("scanA", data, k_min=2, cls=Seg2DSiteRunner)
    p = get_params(seg2d_model(1, channels=(8, 16, 32), seed=0))
    ft = {"epochs": 2, "lr_scale": 1.0}
    _, metrics, meta, params = runner.handle("serve_score", pack_models([p]), {**cfg, "method_options": {
        "names": ["global"], "finetune": ft}})
    ours = {"site_policy", "notes"}  # the site's own policy (first reply of a run) and its notes: no data
    assert not params and set(meta) - ours <= {"serving", "reference", "finetune_train_loss", "not_scored"}
    sent = meta["serving"]["finetuned"]  # n and the Dice-difference sums; wins and losses where none is below k_min
    assert set(meta["serving"]) == {"finetuned"} and set(sent) - {"wins", "losses"} == {"n", "sum_d", "sum_d2"}
    assert "wins" not in sent or min(sent["wins"], sent["losses"]) >= 2
    assert set(metrics) == {"val_dice_mean/global", "val_dice_mean/finetuned"}
    _, metrics2, meta2, params2 = runner.handle("finetune_local", p, {**cfg, "method_options": ft})
    assert not params2 and set(meta2) - ours <= {"n_test", "val_n_test", "n_train", "train_loss"}
    assert all(np.ndim(v) == 0 for k, v in [*metrics2.items(), *meta2.items()] if k not in ours)
    assert metrics2["val_dice_mean"] == pytest.approx(metrics["val_dice_mean/finetuned"])
    assert metrics2["val_dice_mean"] != pytest.approx(metrics["val_dice_mean/global"])


def test_fedmed_experiment_runs_the_2d_serving_plan_and_its_rows_join_the_dice_table(tmp_path, monkeypatch):
    """``serving:`` in a 2D lesion-segmentation config: after the seed's methods the plan runs, its two rows (each
    site's served model, and the reference's global model beside it) join the Dice table; a 3D config is refused when
    the config is read; fine-tuning at the site is accepted. (The jobs run in-process here; the plan's FLARE path is
    tests/test_plan.py's.)"""
    import fedmed.run.experiment as E
    from fedmed.run.jobspec import run_spec_in_process

    def run_job(spec, datalists, work, n_sites=0, *a, **k):
        status, fed = run_spec_in_process(spec, datalists, Path(work) / "server")
        assert status == "finished", fed.recorder.doc.get("reason")
        return fed.recorder.doc

    from pathlib import Path

    monkeypatch.setattr("fedmed.run.jobs.run_job", run_job)
    methods = [{"name": "FedAvg", "workflow": "fedavg"}, {"name": "Clusters", "workflow": "seg_clusters",
                                                           "distance": "emd"}]
    exp = _config(tmp_path, methods, train={"rounds": 2, "local_epochs": 1, "batch_size": 4, "lr": 0.01,
                                            "weight_decay": 0.0},
                  references=[], serving={"reference": "FedAvg", "candidates": ["Clusters"]})
    rows = E.run_experiment(str(tmp_path / "c.yaml"), tmp_path / "out", log=lambda *_: None)
    plan_rows = [r for r in rows if r["method"] in (E.PLAN_METHOD, E.PLAN_GLOBAL)]
    assert [(r["method"], r["task"]) for r in plan_rows] == [(E.PLAN_METHOD, "served"), (E.PLAN_GLOBAL, "global")]
    assert all(0.0 <= r["dice_mean"] <= 1.0 for r in plan_rows)
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert f"| {E.PLAN_METHOD} | per site, on val. |" in summary
    assert exp.serving.candidates == ["Clusters"]
    raw = yaml.safe_load((tmp_path / "c.yaml").read_text())
    assert load_config({**raw, "serving": {"reference": "FedAvg", "finetune": {"epochs": 1}}}).serving.finetune.epochs == 1
    from fedmed.core.resources import shipped_config

    vol = yaml.safe_load(shipped_config("demo_seg_phantoms.yaml").read_text())
    vol["methods"] = vol["methods"][:1] + [{"name": "Two", "workflow": "seg_clusters"}]
    with pytest.raises((ConfigError, ValueError), match="2D lesion segmenters .this config's task: segmentation, 3D"):
        load_config({**vol, "serving": {"reference": vol["methods"][0]["name"], "candidates": ["Two"]}})


def test_the_2d_references_stop_by_the_runs_rule(tmp_path):
    """#85: the centralized and each-source-alone 2D references under ``train.stop`` (a ``min_delta`` no Dice can rise
    by: only the first scored block counts as an improvement): each stops after ``patience`` blocks, scores one more
    (as a federated run's final round) and its rows end there."""
    from fedmed.run.experiment import prepare_federation, with_classes
    from fedmed.run.references import seg2d_reference_rows

    exp = _config(tmp_path, [{"name": "FedAvg", "workflow": "fedavg"}],
                  train={"rounds": 5, "local_epochs": 1, "batch_size": 4, "lr": 0.01, "weight_decay": 0.0,
                         "stop": {"patience": 1, "min_delta": 1.0}})
    data = prepare_federation(exp, 0, tmp_path / "fed")
    exp = with_classes(exp, data)
    sites = json.loads((data / "dataset.json").read_text())["sites"]
    rows = seg2d_reference_rows(exp, data, sites, 0, log=lambda *_: None)
    assert [r["round"] for r in rows if r["method"] == "Centralized"] == [0, 1, 2]
    assert [r["round"] for r in rows if r["method"] == "Each site alone" or r["method"] == "Each source alone"] == [1, 2, 3]
