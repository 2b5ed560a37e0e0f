"""fedmed.core.schema: the task config a site reads is typed, its defaults are the schema's, and a mistake in it is a
clear error instead of a silently used default."""

import ast
import json
from pathlib import Path

import numpy as np
import pytest

from fedmed.config import load_config
from fedmed.core.schema import TaskConfig, task_config
from fedmed.run.taskconfig import build_task_config
from fedmed.methods import server_workflow_path


def workflow_args(exp, m, seed, cfg=None):
    return server_workflow_path(type(m)), m.workflow_options(exp, seed)

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("path", sorted((ROOT / "app_configs").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_configs_tasks_are_typed_task_configs(path):
    """Every method of every shipped config: the task config its job sends, and what its workflow adds to tasks
    (the signature section; Flux's and IFCA's options, in method_options), validate as TaskConfig and as the options
    models of the tasks that read them — nothing travels that a model does not name."""
    from fedmed.methods.flux import FluxOptions
    from fedmed.methods.ifca import IFCAOptions

    exp = load_config(path)
    if exp.dataset.task == "classification" and not exp.dataset.classes:
        exp = load_config(path, ["dataset.classes=[a,b]"])
    for m in exp.methods:
        if getattr(m, "encoder_weights", None) or getattr(exp.model, "init_weights", None):
            continue  # a weights file of the coordinator's (not on this machine)
        cfg = build_task_config(exp, 0, m, exp.site_names())
        t = task_config(json.loads(json.dumps(cfg)))  # as it arrives
        assert t.seed == 0 and t.model.arch == exp.model.arch and t.train.lr == exp.train.lr
        _, args = workflow_args(exp, m, 0, cfg)
        extra = {}
        if "signature" in args:
            extra["signature"] = args["signature"]
        if type(m).site_options_model is not None:  # the method's own site options, as its site reads them
            type(m).options_at_site(t)
        if "flux" in args:
            extra["method_options"] = FluxOptions.model_validate(args["flux"]).model_dump()
        if m.workflow == "ifca":
            extra["method_options"] = IFCAOptions.model_validate({"k": args["k"], "train": True}).model_dump()
        if extra:
            task_config({**cfg, **extra, "cluster": 0})


def test_a_mistake_in_a_task_config_is_an_error_the_site_sends_not_a_default(tmp_path):
    """A misspelled key (``train.lr_rate``) used to be ignored (the site read ``train.lr`` or its own default); now
    the site answers with an error naming the key."""
    from fedmed.site.reply import answer

    (tmp_path / "site-1.json").write_text(json.dumps({"training": [], "validation": [], "test": []}))
    cfg = {"seed": 0, "data": {"image_size": 8, "channels": 1, "n_classes": 2}, "train": {"lr_rate": 0.1}}
    _, (_, metrics, meta, _), err = answer("site-1", None, "validate", {}, cfg, 0, settings=tmp_path)
    assert metrics == {"failed": 1.0} and err is not None
    assert "train.lr_rate" in meta["error"] and "Extra inputs are not permitted" in meta["error"]
    with pytest.raises(ValueError, match="evaluate_on"):
        task_config({"evaluate_on": "everything"})


def test_what_a_task_config_leaves_out_takes_the_schemas_defaults():
    """Before, a site's reads restated defaults that disagreed with the schema: a partial ``train`` section gave SGD
    without momentum and a fresh optimizer every round, while the config's defaults are Adam, weight decay 5e-4 and
    an optimizer kept across rounds. Now both read the schema."""
    import torch

    from fedmed.config import TrainConfig
    from fedmed.nn.train import make_optimizer
    from fedmed.site.runner import SiteRunner

    net = torch.nn.Linear(3, 2)
    opt = make_optimizer(net, {"lr": 0.01})
    assert type(opt).__name__ == {"adam": "Adam", "sgd": "SGD", "adamw": "AdamW"}[TrainConfig().optimizer]
    assert opt.param_groups[0]["weight_decay"] == TrainConfig().weight_decay
    runner = SiteRunner.__new__(SiteRunner)
    runner._optimizers = {}
    cfg = {"train": {"lr": 0.01}}
    from fedmed.nn.recipe import resolved

    kept = resolved(TrainConfig(), {})["keep_optimizer_state"]  # None in the schema: the (scratch) recipe's value
    assert kept is True
    assert (runner.optimizer(net, cfg, key=0) is runner.optimizer(net, cfg, key=0)) == kept
    assert task_config({}).privacy.k_min == TaskConfig().privacy.k_min == 5


def test_the_flux_dp_box_bound_is_a_setting_of_the_config():
    """``privacy.latent_bound`` was read with a default no config could set; it is a field of the schema now."""
    from fedmed.algorithms.privacy import private_bounds

    exp = load_config(ROOT / "app_configs" / "demo_flux_digits.yaml", ["privacy.latent_bound=4.0"])
    assert exp.privacy.latent_bound == 4.0
    z = np.random.default_rng(0).uniform(0, 9, size=(20, 3))
    lo, hi, _ = private_bounds(z, k_min=2, privacy={**exp.privacy.model_dump(), "dp_epsilon": 1.0})
    assert np.all(lo == 0) and np.all(hi == 4.0)


def test_site_and_workflow_code_reads_no_task_config_key_with_a_default_of_its_own():
    """No ``cfg.get(...)`` and no ``.get("<task config section>", default)`` in the site runners and the
    workflows: a value a task config leaves out takes the schema's default (``fedmed.core.schema``)."""
    configs = {"cfg", "self.cfg", "self._cfg", "self.task_config", "self.flux", "self.signature", "self.clustering"}
    bad = []
    for folder in ("site", "workflows"):
        for f in sorted((ROOT / "fedmed" / folder).glob("*.py")):
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "get" and \
                        ast.unparse(node.func.value).split(".get(")[0] in configs:
                    bad.append(f"{f.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert bad == []
