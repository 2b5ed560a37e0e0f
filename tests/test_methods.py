"""fedmed.methods: every method's options are defined once (its own model) and handed on from there; a method of a
user's own is one file, registered without editing fedmed, and runs in this process and in FLARE's simulator."""

import ast
import inspect
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[1]


def _schema_models():
    import fedmed.core.schema as S

    return [c for _, c in inspect.getmembers(S, inspect.isclass) if issubclass(c, BaseModel) and c.__module__ == S.__name__]


def test_every_method_option_has_one_definition():
    """A method's option is defined (and defaulted) in its method model only: a section of the task config that
    carries it holds no default of its own (required, or None where the method does not use it) — before, defaults
    were restated there (mask_ratio, layer_decay, n_basis, k1_silhouette) and drifted (Flux's k1_silhouette: null
    passed the config and failed at the server)."""
    from fedmed.methods import METHODS

    options = {o for cls in METHODS.values() for o in cls.model_fields if o not in ("name", "workflow")}
    restated = []
    for model in _schema_models():  # the sections a task carries (TrainTask: its own field, fedprox_mu)
        if not (model.__name__.endswith("Task") or model.__name__ == "TaskConfig"):
            continue
        own = model.__dict__.get("__annotations__", {})
        for name, field in model.model_fields.items():
            if name not in own:
                continue
            if name in options and not field.is_required() and field.get_default(call_default_factory=True) is not None:
                restated.append(f"{model.__name__}.{name} = {field.get_default(call_default_factory=True)!r}")
    assert restated == []


def test_the_one_definition_check_would_catch_a_restated_default(monkeypatch):
    import fedmed.core.schema as S
    from pydantic import Field

    class RestatedTask(S.Strict):
        k1_silhouette: float = Field(0.25)

    RestatedTask.__module__ = S.__name__  # as if written in fedmed.core.schema
    monkeypatch.setattr(S, "RestatedTask", RestatedTask, raising=False)
    with pytest.raises(AssertionError, match=r"RestatedTask.k1_silhouette = 0.25"):
        test_every_method_option_has_one_definition()


def _config_names() -> set:
    """Every option of a method and every field of a config or task-config section."""
    import fedmed.config as C
    from fedmed.methods import METHODS

    models = _schema_models() + [c for _, c in inspect.getmembers(C, inspect.isclass) if issubclass(c, BaseModel)]
    return {n for m in [*models, *METHODS.values()] for n in m.model_fields}


def _defaults_read_by_getattr(files, names) -> list[str]:
    bad = []
    for f in files:
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "getattr" and len(node.args) == 3 \
                    and isinstance(node.args[1], ast.Constant) and node.args[1].value in names:
                bad.append(f"{f.relative_to(ROOT)}:{node.lineno}: getattr(..., {node.args[1].value!r}, default)")
    return bad


def test_no_config_value_is_read_with_a_default_of_its_own():
    """Workflows, sites, networks and the method table read a config value from its typed model, never through
    ``getattr(method, "n_basis", 3)`` (the registry did)."""
    files = [p for d in ("workflows", "site", "nn") for p in (ROOT / "fedmed" / d).glob("*.py")]
    files += [*(ROOT / "fedmed" / "methods").glob("*.py"), ROOT / "fedmed" / "run" / "taskconfig.py", ROOT / "fedmed" / "run" / "jobspec.py"]
    assert _defaults_read_by_getattr(files, _config_names()) == []


def test_the_getattr_check_would_catch_the_registrys_old_read(tmp_path):
    f = ROOT / "fedmed" / "_probe_getattr.py"
    try:
        f.write_text("def f(method):\n    return getattr(method, 'n_basis', 3)\n")
        assert _defaults_read_by_getattr([f], _config_names()) == ["fedmed/_probe_getattr.py:2: getattr(..., 'n_basis', default)"]
    finally:
        f.unlink()


def test_each_method_hands_its_own_values_on():
    """What a workflow and the sites receive comes from the method's values (changed values arrive changed)."""
    from fedmed.config import load_config
    from fedmed.run.taskconfig import build_task_config

    raw = {"name": "m", "dataset": {"path": "builtin:digits", "classes": list("ab")}, "train": {"rounds": 3},
           "methods": [{"name": "P", "workflow": "pacfl", "n_basis": 5, "angle": "official"},
                       {"name": "F", "workflow": "flux", "k1_silhouette": None, "dbscan_scale": 2.0, "box": "scalar",
                        "absent_class": "minus_one"},
                       {"name": "M", "workflow": "fedmae", "mask_ratio": 0.6},
                       {"name": "X", "workflow": "fedprox", "fedprox_mu": 0.3}]}
    exp = load_config(raw)
    p, f, m, x = exp.methods
    assert p.workflow_options(exp, 1)["signature"] == {"kind": "pacfl", "encoder": "pixels", "image_size": None,
                                                       "seed": 1, "options": {"n_basis": 5}}
    assert p.workflow_options(exp, 1)["clustering"]["options"] == {"angle": "official"}  # the server's distance
    fo = f.workflow_options(exp, 0)
    assert fo["k1_silhouette"] is None and fo["scale"] == 2.0 and fo["flux"]["box"] == "scalar"
    assert fo["flux"]["absent_class"] == "minus_one"
    assert build_task_config(exp, 0, m, None)["method_options"] == {"mask_ratio": 0.6, "base_lr": 1.5e-4, "warmup": 0.05, "rounds": 3}
    assert build_task_config(exp, 0, x, None)["train"]["fedprox_mu"] == 0.3
    from fedmed.core.schema import task_config

    assert task_config(build_task_config(exp, 0, exp.methods[0], None)).train.fedprox_mu is None


# ------------------------------------------------------------------------------------------------- a plugin
def plugin_files(folder: Path, sites: int = 4) -> Path:
    """docs/architecture.md's plugin file and config lines, as written, in a folder of the user's (outside fedmed)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    code = re.search(r"`majority_split.py`:\n\n```python\n(.*?)```", text, flags=re.S).group(1)
    lines = yaml.safe_load(re.search(r"```yaml\n(plugins:.*?)```", text, flags=re.S).group(1))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "majority_split.py").write_text(code)
    raw = {"name": "plugin", "dataset": {"path": "builtin:digits", "image_size": 8, "channels": 1, "max_per_class": 16},
           "federation": {"sites": sites, "partition": "dirichlet", "alpha": 0.1},
           "model": {"arch": "resnet9", "width": 4}, "train": {"rounds": 2, "local_epochs": 1, "batch_size": 16},
           "privacy": {"k_min": 2}, "references": [], **lines}
    (folder / "study.yaml").write_text(yaml.safe_dump(raw))
    return folder / "study.yaml"


def _models(folder: Path) -> dict:
    import torch

    return {p.name: {k: v.numpy() for k, v in torch.load(p, weights_only=True)["state_dict"].items()}
            for p in sorted(folder.glob("*.pt"))}


@pytest.mark.slow
def test_a_plugin_method_runs_in_process_and_in_flares_simulator_with_the_same_models(tmp_path):
    """A method defined in one file outside fedmed (docs/architecture.md's majority_split.py: config model, server
    workflow, site task) is registered by naming it in the config, and runs in this process and in FLARE's
    simulator — started from the user's folder with the relative config — with the same groups and final models."""
    from fedmed.config import load_config
    from fedmed.methods import METHODS
    from fedmed.run.experiment import prepare_federation, with_classes
    from fedmed.run.jobspec import job_spec, run_spec_in_process

    user = tmp_path / "study"
    cfg = plugin_files(user)
    assert sorted(p.name for p in user.iterdir()) == ["majority_split.py", "study.yaml"]  # all a new method needs
    exp = load_config(cfg)
    assert "majority_split" in METHODS and exp.methods[0].min_share == 0.6 and exp.methods[0].min_count == 3
    data = prepare_federation(exp, 0, user / "data")
    exp = with_classes(exp, data)
    spec = job_spec(exp, exp.methods[0], 0)
    assert spec.task_config["plugins"] == ["majority_split"]
    assert spec.task_config["method_options"] == {"min_count": 3}  # the plugin task's own option, in the open key
    assert [Path(src).name for src, _ in spec.user_code] == ["majority_split.py"]  # the job carries the file

    status, fed = run_spec_in_process(spec, data, tmp_path / "inproc")
    assert status == "finished", fed.recorder.doc.get("reason")
    ours = fed.recorder.doc
    assert [t["task"] for t in ours["task_log"]][0] == "class_counts"
    groups = ours["clustering"]["clusters"]
    assert ours["clustering"]["min_count"] == [3]  # every site read it through the method's own model
    assert sorted(s for g in groups for s in g) == exp.site_names()

    p = subprocess.run([sys.executable, str(ROOT / "jobs" / "run.py"), "--config", "study.yaml", "--method",
                        "Majority", "--env", "sim", "--datalists", "data", "--workspace", "ws", "--site-policy",
                        "simulation", "--jobs-dir", "jobs", "--set", f"dataset.classes={json.dumps(exp.dataset.classes)}"],
                       cwd=user, capture_output=True, text=True, timeout=600)
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert p.returncode == 0 and res["status"] == "finished", p.stdout[-2000:] + p.stderr[-3000:]
    sim = Path(res["result"])
    assert sim.is_relative_to(user / "ws")
    assert list((user / "jobs").rglob("custom/fedmed_user_code/majority_split.py"))
    sim_doc = json.loads((sim / "metrics.json").read_text())
    assert sim_doc["clustering"]["clusters"] == groups and sim_doc["clustering"]["min_count"] == [3]
    a, b = _models(sim / "models"), _models(tmp_path / "inproc" / "models")
    assert sorted(a) == sorted(b) == sorted([f"cluster{c}.pt" for c in range(len(groups))] +  # and each one's model
                                            [f"selected_cluster{c}.pt" for c in range(len(groups))])  # of its best round
    for f in a:
        for k in a[f]:
            assert np.array_equal(a[f][k], b[f][k]), (f, k)


def test_a_site_whose_policy_does_not_list_the_plugin_refuses_its_task(tmp_path):
    """A site imports a plugin's module only when its policy lists it; otherwise it answers with one line."""
    from fedmed.config import load_config
    from fedmed.core.policy import SitePolicy
    from fedmed.run.experiment import prepare_federation, with_classes
    from fedmed.run.jobspec import job_spec
    from fedmed.site.reply import answer
    from fedmed.site.settings import settings_for_dir

    cfg = plugin_files(tmp_path / "study", sites=2)
    exp = load_config(cfg)
    data = prepare_federation(exp, 0, tmp_path / "data")
    spec = job_spec(with_classes(exp, data), exp.methods[0], 0)
    strict = settings_for_dir("site-1", data, policy=SitePolicy(k_min=2))
    _, (_, metrics, meta, _), err = answer("site-1", None, "class_counts", {}, spec.task_config, 0, settings=strict)
    assert metrics == {"failed": 1.0} and "plugin 'majority_split' may not be imported here" in meta["error"]
    ok = settings_for_dir("site-1", data, policy=SitePolicy(k_min=2, modules=("majority_split",)))
    _, (_, metrics, meta, _), err = answer("site-1", None, "class_counts", {}, spec.task_config, 0, settings=ok)
    assert err is None and len(meta["counts"]) == len(exp.dataset.classes or with_classes(exp, data).dataset.classes)


def test_a_method_under_a_taken_name_is_refused():
    from typing import Literal

    from fedmed.methods import Method, MethodError, register_method

    class Other(Method):
        workflow: Literal["fmcl"]

    with pytest.raises(MethodError, match="workflow 'fmcl' is taken by fedmed.methods.fmcl.FMCLMethod"):
        register_method(Other)


def test_every_method_names_the_weights_file_it_was_given():
    """The weights a method names (its encoder's, the Fed-MAE encoder to fine-tune from) are what the job builder
    checks and ships; a method that takes a file must say so (a mix-in's property shadowed by the base class's None
    hid FMCL's file from the up-front check)."""
    from fedmed.methods import METHODS

    for name, cls in METHODS.items():
        if "encoder_weights" in cls.model_fields:
            m = cls.model_validate({"name": "m", "workflow": name, "encoder_weights": "w.pth"})
            assert m.weights_file == "w.pth", name


# a kind of one-shot signature of one's own: one file (#88 target), the signature task, the clustering, the
# onboarding and `fedmed distances` are fedmed's and read the kind from its registration
TRIMMED_SIGNATURE = '''"""trimmed: sites clustered by the trimmed mean of their images' embeddings (the middle half of each coordinate)."""
from dataclasses import dataclass
from typing import Literal

import numpy as np
from scipy.stats import trim_mean

from fedmed.algorithms.baselines import fecfl_distance_matrix
from fedmed.algorithms.signatures import SignatureKind, register_signature_kind
from fedmed.methods import register_method
from fedmed.methods.signature import SignatureMethod


@dataclass(frozen=True)
class TrimmedSignature:
    trimmed: np.ndarray

    def validate(self, site="site"):
        t = np.asarray(self.trimmed, dtype=np.float64)
        if t.ndim != 1 or not np.isfinite(t).all():
            raise ValueError(f"{site}: a trimmed signature should be one finite vector, got shape {t.shape}")
        return TrimmedSignature(t)


def release(feats, _y, _kept, *, epsilon, delta, clip, rng):
    if epsilon is not None:
        raise ValueError("the trimmed signature has no DP mechanism")
    return TrimmedSignature(trim_mean(feats, 0.25, axis=0)), []


def distances(sigs, names):
    return fecfl_distance_matrix([s.trimmed for s in sigs], site_names=names)


register_signature_kind(SignatureKind("trimmed", TrimmedSignature, ("trimmed",), release, distances, per_class=False))


@register_method
class TrimmedMethod(SignatureMethod):
    workflow: Literal["trimmed"]
'''


def test_a_new_one_shot_signature_method_is_one_file(tmp_path):
    """#88: a fourth kind of signature took seven files; now it is the file above, outside fedmed — its typed
    signature, what a site releases, the distance, its method — named in a config's plugins. It runs through
    fedmed's signature task, clustering and records, with no kind branch anywhere to extend."""
    from fedmed.algorithms.signatures import SIGNATURE_KINDS
    from fedmed.config import load_config
    from fedmed.run.experiment import prepare_federation, with_classes
    from fedmed.run.jobspec import job_spec, run_spec_in_process

    user = tmp_path / "study"
    user.mkdir()
    (user / "trimmed_signature.py").write_text(TRIMMED_SIGNATURE)
    raw = {"name": "trimmed", "dataset": {"path": "builtin:digits", "image_size": 8, "channels": 1,
                                          "max_per_class": 16},
           "federation": {"sites": 4, "partition": "dirichlet", "alpha": 0.1},
           "model": {"arch": "resnet9", "width": 4}, "train": {"rounds": 1, "local_epochs": 1, "batch_size": 16},
           "privacy": {"k_min": 2}, "references": [], "plugins": ["trimmed_signature.py"],
           "methods": [{"name": "Trimmed", "workflow": "trimmed", "encoder": "random_cnn", "n_clusters": 2}]}
    (user / "study.yaml").write_text(yaml.safe_dump(raw))
    exp = load_config(user / "study.yaml")
    assert "trimmed" in SIGNATURE_KINDS
    data = prepare_federation(exp, 0, user / "data")
    exp = with_classes(exp, data)
    spec = job_spec(exp, exp.methods[0], 0)
    assert spec.task_config["plugins"] == ["trimmed_signature"]
    status, fed = run_spec_in_process(spec, data, tmp_path / "run")
    assert status == "finished", fed.recorder.doc.get("reason")
    doc = fed.recorder.doc
    assert [t["task"] for t in doc["task_log"]][0] == "signature"
    assert doc["clustering"]["k"] == 2 and sorted(s for g in doc["clustering"]["clusters"] for s in g) == \
        exp.site_names()
    onboarding = json.loads((tmp_path / "run" / "onboarding.json").read_text())
    assert onboarding["state"]["signature"]["kind"] == "trimmed"
    assert all(set(m) == {"trimmed", "encoder"} for m in onboarding["state"]["signatures"].values())
