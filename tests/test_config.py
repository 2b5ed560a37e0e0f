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
    for bad in ("0", "-1", ".inf", ".nan"):
        with pytest.raises(ConfigError, match=r"privacy.dp_epsilon: .*finite number > 0"):
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
