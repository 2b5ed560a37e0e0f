import pytest

from fedmed.config import ConfigError, load_config

BASE = {"name": "t", "dataset": {"path": "builtin:digits"}}


def test_defaults_and_overrides():
    cfg = load_config(BASE, ["train.rounds=7", "seeds=[1, 2]", "methods=[{name: A}, {name: B, workflow: fedprox}]"])
    assert cfg.train.rounds == 7 and cfg.seeds == [1, 2] and [m.workflow for m in cfg.methods] == ["fedavg", "fedprox"]


def test_unknown_key_is_named(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("name: t\ndataset: {path: builtin:digits}\nmodel: {arch: resnet9, depth: 5}\n")
    with pytest.raises(ConfigError, match=r"c.yaml: invalid configuration: model.depth: Extra inputs are not permitted"):
        load_config(f)


def test_ill_typed_key_is_named():
    with pytest.raises(ConfigError, match=r"train.lr: Input should be greater than 0"):
        load_config(BASE, ["train.lr=-1"])
    with pytest.raises(ConfigError, match=r"federation.sites: Input should be a valid integer"):
        load_config(BASE, ["federation.sites=many"])
    with pytest.raises(ConfigError, match=r"dataset: required key is missing"):
        load_config({"name": "x"})


def test_duplicate_methods_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="duplicates \\['A'\\]"):
        load_config(BASE, ["methods=[{name: A}, {name: A}]"])
    with pytest.raises(ConfigError, match="nope.yaml: config file not found"):
        load_config(tmp_path / "nope.yaml")


def test_every_shipped_config_validates():
    from pathlib import Path

    for f in sorted((Path(__file__).parents[1] / "app_configs").glob("*.yaml")):
        load_config(f)


def test_privacy_settings_are_validated_with_their_names():
    with pytest.raises(ConfigError, match=r"privacy: .*k_min=1 lets a single patient's statistics leave a site.*"
                                          r"accept_k_min_below_2"):
        load_config(BASE, ["privacy.k_min=1"])
    assert load_config(BASE, ["privacy.k_min=1", "privacy.accept_k_min_below_2=true"]).privacy.k_min == 1
    assert load_config(BASE, ["privacy.k_min=2"]).privacy.k_min == 2
    for bad in ("0", "-1"):
        with pytest.raises(ConfigError, match=r"privacy.dp_epsilon: .*finite number > 0"):
            load_config(BASE, [f"privacy.dp_epsilon={bad}"])
    for bad in (".inf", ".nan"):  # every number of a config is finite (#87): the one rule says it first
        with pytest.raises(ConfigError, match=r"privacy.dp_epsilon: Input should be a finite number"):
            load_config(BASE, [f"privacy.dp_epsilon={bad}"])


def test_an_option_of_another_workflow_is_a_one_line_error_naming_it():
    with pytest.raises(ConfigError) as e:
        load_config(BASE, ["methods=[{name: FMCL, workflow: fmcl, omega: 0.3}]"])
    msg = str(e.value)
    assert "\n" not in msg
    assert "methods.FMCL: option 'omega' (an option of fedavg_w) does not apply to workflow 'fmcl'" in msg
    assert "encoder" in msg  # what fmcl does take


def test_duplicate_site_names_rejected():
    with pytest.raises(ConfigError, match="site names should be unique, got duplicates \\['a'\\]"):
        load_config(BASE, ["federation.sites=2", "federation.site_names=[a, a]"])


# ------------------------------------------------------------------ paths relative to the config file (#56 item 1)

def _png_classes(root, classes=("benign", "malignant", "normal"), n=6):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in classes:
        (root / c).mkdir(parents=True)
        for i in range(n):
            Image.fromarray(rng.integers(0, 255, (12, 12), dtype=np.uint8)).save(root / c / f"{c}_{i}.png")


def _shipped(name):
    from pathlib import Path

    return Path(__file__).resolve().parents[1] / "app_configs" / name


def test_fedmed_experiment_runs_a_copied_config_whose_data_path_is_relative_to_it(tmp_path, monkeypatch):
    """#56: a copy of busi_fmcl.yaml in elsewhere/cfg/ naming its data relative to itself failed from elsewhere/ (the
    path was read against the working folder). Under that reading ../../data/busi from elsewhere/ is /data/busi."""
    import json

    import yaml

    from fedmed.cli.main import main
    from fedmed.run import experiment as E

    _png_classes(tmp_path / "data" / "busi")
    raw = yaml.safe_load(_shipped("busi_fmcl.yaml").read_text())
    raw["dataset"]["path"] = "../../data/busi"
    (tmp_path / "elsewhere" / "cfg").mkdir(parents=True)
    (tmp_path / "elsewhere" / "cfg" / "busi_fmcl.yaml").write_text(yaml.safe_dump(raw))
    ran = []

    def run_job(spec, datalists, work, *a, **k):
        ran.append(spec.method)
        work.mkdir(parents=True, exist_ok=True)
        m = {"accuracy": 0.5, "macro_f1": 0.5, "auc": 0.5}
        return {"rounds": [{"round": 1, "summary": {"n_sites": 2, "mean": m, "std": m, "pooled": m}}], "errors": [],
                "wall_seconds": 0.0}

    monkeypatch.setattr("fedmed.run.jobs.run_job", run_job)
    monkeypatch.chdir(tmp_path / "elsewhere")
    main(["experiment", "cfg/busi_fmcl.yaml", "--out", "out", "--methods", "FedAvg", "--set", "federation.sites=2",
          "--set", "federation.partition=iid", "--set", "seeds=[0]", "--set", "references=[]"])
    assert ran == ["FedAvg"]
    site = json.loads((tmp_path / "elsewhere" / "out" / "data" / "seed0" / "site-1.json").read_text())
    images = [r["image"] for split in ("training", "validation", "test") for r in site[split]]
    assert images and all("benign" in p or "malignant" in p or "normal" in p for p in images)
    assert "data ../data/busi" in (tmp_path / "elsewhere" / "out" / "summary.md").read_text()


def test_a_missing_data_path_names_what_was_written_and_the_folder_it_was_resolved_against(tmp_path, monkeypatch):
    import yaml

    (tmp_path / "cfg").mkdir()
    raw = yaml.safe_load(_shipped("busi_fmcl.yaml").read_text())
    (tmp_path / "cfg" / "c.yaml").write_text(yaml.safe_dump(raw))
    monkeypatch.chdir(tmp_path)
    exp = load_config("cfg/c.yaml")
    with pytest.raises(ConfigError) as e:
        exp.check_data_paths()
    msg = str(e.value)
    assert "'../../shared/data/busi' does not exist" in msg and f"config file's folder {tmp_path / 'cfg'}" in msg
    assert "--set dataset.path=DIR" in msg and "\n" not in msg
    exp = load_config("cfg/c.yaml", ["dataset.path=nowhere/busi"])  # --set: the working folder
    with pytest.raises(ConfigError, match=rf"'nowhere/busi' does not exist.*the working folder {tmp_path}"):
        exp.check_data_paths()
    _png_classes(tmp_path / "nowhere" / "busi")
    load_config("cfg/c.yaml", ["dataset.path=nowhere/busi"]).check_data_paths()


def test_paths_of_a_base_config_and_of_sweep_cases_are_relative_to_their_own_files(tmp_path, monkeypatch):
    import os

    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "w").mkdir()
    (tmp_path / "a" / "w" / "init.pt").write_bytes(b"")  # model.init_weights must exist where the config is read
    (tmp_path / "a" / "base.yaml").write_text("name: base\ndataset: {path: data/x}\nmodel: {init_weights: w/init.pt}\n"
                                              "methods: [{name: F, workflow: fmcl, encoder_weights: w/enc.pt}]\n")
    (tmp_path / "a" / "b" / "c.yaml").write_text(
        "extends: ../base.yaml\nname: c\nsweep: [{name: s, set: [dataset.path=other, train.rounds=2, "
        "methods.F.encoder_weights=null]}]\n")
    monkeypatch.chdir(tmp_path)
    exp = load_config("a/b/c.yaml")
    assert exp.dataset.path == os.path.join("a", "data", "x")
    assert exp.model.init_weights == os.path.join("a", "w", "init.pt")
    assert exp.methods[0].encoder_weights == os.path.join("a", "w", "enc.pt")
    assert exp.sweep[0].set == [f"dataset.path={os.path.join('a', 'b', 'other')}", "train.rounds=2",
                                "methods.F.encoder_weights=null"]
    assert load_config("a/b/c.yaml", exp.sweep[0].set).dataset.path == os.path.join("a", "b", "other")
    assert load_config("a/b/c.yaml", ["dataset.path=mine"]).dataset.path == "mine"
    assert load_config({"name": "d", "dataset": {"path": "mine"}}).dataset.path == "mine"  # a dict: the working folder
    for kept in ("builtin:digits", str(tmp_path / "abs")):
        (tmp_path / "k.yaml").write_text(f"name: k\ndataset: {{path: '{kept}'}}\n")
        assert load_config("k.yaml").dataset.path == kept


def test_every_shipped_config_finds_the_shared_data_from_any_folder(tmp_path, monkeypatch):
    """Every shipped config names its data relative to app_configs/; from the repository root they read as before
    (../shared/data/...), and from any other folder they name the same files."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    for cwd in (root, tmp_path):
        monkeypatch.chdir(cwd)
        for f in sorted((root / "app_configs").glob("*.yaml")):
            d = load_config(f).dataset
            for p in [d.path] if d.path else [s.path for s in d.sources]:
                if p.startswith("builtin:"):
                    continue
                target = (cwd / p).resolve()  # ../shared may be a link to the data: compare resolved paths
                assert target.is_relative_to((root.parent / "shared" / "data").resolve()) or \
                    target == (root / "results" / "demo" / "phantoms"), (f.name, p)


def test_selection_by_validation_auc_is_for_classifiers():
    from pathlib import Path

    assert load_config(BASE, ["selection=validation_auc"]).selection == "validation_auc"
    seg = Path(__file__).parents[1] / "app_configs" / "demo_seg_phantoms.yaml"
    assert load_config(seg, ["selection=validation"]).selection == "validation"
    with pytest.raises(ConfigError, match="selection: 'validation_auc' selects a classifier's round"):
        load_config(seg, ["selection=validation_auc"])


def test_the_imagenet_release_is_named_by_name_not_by_a_shell_variable(tmp_path):
    """#89: docs defined the release's path in a shell variable ($W) that a new shell left empty, and the "transfer
    recipe" trained from random weights. ``imagenet`` names the installed release of the network (or the encoder);
    written in a config file it is no path relative to that file; a network without a release is one line."""
    import pytest
    import yaml

    from fedmed.nn.releases import released_weights

    release = released_weights("efficientnet_lite0")
    if release is None:
        pytest.skip("the EfficientNet-Lite0 release package is not installed")
    raw = {**BASE, "model": {"arch": "efficientnet_lite0", "init_weights": "imagenet"},
           "methods": [{"name": "FMCL", "workflow": "fmcl", "encoder": "efficientnet_lite0",
                        "encoder_weights": "imagenet"}]}
    (tmp_path / "sub").mkdir()
    f = tmp_path / "sub" / "c.yaml"
    f.write_text(yaml.safe_dump(raw))
    exp = load_config(f)
    assert exp.model.init_weights == exp.methods[0].encoder_weights == release
    assert load_config(BASE, ["model.arch=efficientnet_lite0", "model.init_weights=imagenet"]).model.init_weights == \
        release
    with pytest.raises(ConfigError, match=r"model.init_weights: imagenet names the ImageNet release of 'resnet9'; "
                                          r"fedmed knows one for efficientnet_lite0"):
        load_config(BASE, ["model.init_weights=imagenet"])
