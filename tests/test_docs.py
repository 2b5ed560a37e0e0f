"""Every command of docs/deployment.md and docs/recipes.md either runs in a test as written, or says here why it
cannot run on this machine; a command added to those pages without either fails this file."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import doc_commands

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"

# the start of a documented command -> the test that runs it as written
RUN_HERE = {
    ".venv/bin/nvflare provision -p project.yml -w provision --force": "test_deployment.py: Deployment.provision / add_site",
    ".venv/bin/python -m fedmed_flare.kit provision/<project>/prod_00/*/": "test_deployment.py: Deployment.allow_fedmed",
    ".venv/bin/python -m fedmed_flare.kit --allow-log-streaming provision/<project>/prod_00/hospital-a/":
        "test_docs.py: test_the_kit_command_turns_log_streaming_off_unless_the_site_turns_it_on",
    ".venv/bin/python jobs/build.py --config app_configs/busi_fmcl.yaml --method FMCL --out job_folders --sites":
        "test_docs.py: test_deployment_section_6_builds_the_job_it_names_as_written",
    "provision/<project>/prod_00/fl.coordinator.example.org/startup/start.sh": "test_deployment.py: Deployment.start",
    "provision/<project>/prod_00/hospital-a/startup/start.sh": "test_deployment.py: Deployment.start",
    ".venv/bin/fedmed experiment app_configs/demo_digits.yaml --out results/tracked":
        "test_tracking.py: test_a_run_tracked_in_mlflow_has_every_sites_and_the_servers_rounds_its_settings_and_result",
    "MLFLOW_ALLOW_FILE_STORE=true .venv/bin/mlflow ui --backend-store-uri file://$PWD/results/tracked/mlruns":
        "test_tracking.py: test_a_run_tracked_in_mlflow_has_every_sites_and_the_servers_rounds_its_settings_and_result",
    ".venv/bin/fedmed experiment app_configs/busi_224.yaml":
        "test_docs.py: test_the_busi_224_recipe_as_written_names_the_missing_weights_before_any_training",
    ".venv/bin/fedmed tune app_configs/demo_digits.yaml --budget 2 --out results/demo_tune":
        "test_docs.py: test_the_recipes_tune_command_runs_as_written",
}
# the start of a documented command -> why it does not run here as written
NOT_HERE = {
    "git clone <fedmed>": "a placeholder address; tests/test_readme.py (its install test) builds fedmed from its source and installs it "
                          "into a fresh venv, as these lines do",
    "python3 -m venv .venv": "the CI's own setup (make setup) runs it; tests/test_readme.py (its install test) makes a fresh venv",
    ".venv/bin/pip install -c constraints.txt .": "tests/test_readme.py (its install test) installs the built wheel into a fresh venv",
    ".venv/bin/python jobs/run.py --config app_configs/busi_fmcl.yaml --method FMCL --env prod":
        "busi_fmcl's FMCL on its 20 sites for 20 rounds; test_deployment.py submits jobs with jobs/run.py --env prod "
        "and the admin's kit to its own provisioned sites",
    ".venv/bin/python jobs/run.py --config CONFIG --method NAME --env prod --startup-kit ADMIN_KIT --resume-from":
        "placeholders of a real deployment's job; test_deployment.py resumes a stopped job",
    ".venv/bin/python jobs/build.py --config app_configs/busi_fmcl.yaml --method FMCL --out job_folders --onboard":
        "needs a finished run of a real deployment; test_deployment.py onboards a new hospital",
    ".venv/bin/fedmed bundle results/readme/runs/seed0/FedAvg/server/models/global.pt":
        "a model of the README's run; test_bundle.py runs fedmed bundle on a checkpoint and a run's own export",
    ".venv/bin/python -m monai.bundle run --config_file BUNDLE/configs/inference.json":
        "placeholders (BUNDLE, IMAGES, OUT); test_bundle.py runs this command on a finished run's bundle and compares "
        "it with fedmed predict",
    ".venv/bin/fedmed experiment app_configs/breast_us_lite0.yaml --set model.init_weights=imagenet":
        "the natural federation's 17 sites x 12 rounds x 3 seeds from the ImageNet release (about half an hour on 2 "
        "cores); test_transfer.py reads its --set values as the config does and runs FedAvgM through a job of a "
        "digits federation",
    ".venv/bin/fedmed experiment app_configs/breast_us_lite0_e4.yaml --set model.init_weights=imagenet":
        "the natural federation's 17 sites x 12 rounds x 4 local epochs x 3 seeds from the ImageNet release (about 75 "
        "minutes on 2 cores); test_config.py validates the config, test_transfer.py reports a run by its selection",
    ".venv/bin/fedmed experiment app_configs/breast_us_lite0_e8_val30.yaml --set model.init_weights=imagenet":
        "the natural federation's 17 sites x 12 rounds x 8 local epochs x 3 seeds from the ImageNet release, 30% of "
        "each site's images for validation (35-37 minutes a seed with two runs sharing 2 cores); test_config.py "
        "validates the config and finds its data; its selection is breast_us_lite0_e4.yaml's, by which "
        "test_transfer.py reports a run",
    ".venv/bin/fedmed experiment app_configs/brats_1mm.yaml":
        "hours of 3D training on 2 cores; its jobs are built and validated in test_schema.py (every shipped config)",
}


# results.md and readings.md: each command made the table or the measurement it precedes
STUDIES = {
    "fedmed experiment app_configs/": "a study behind a results table (minutes to hours on 2 cores); "
                                     "test_results_tables.py checks each table names the commit and command that made "
                                     "it, test_config.py that every shipped config loads and finds its data",
    "fedmed sweep app_configs/": "a sweep behind a results table (hours on 2 cores); as above",
    ".venv/bin/fedmed tune app_configs/revalidate_breastmnist.yaml": "the tuning behind a results table (needs "
        "../shared/data; about 40 s); test_tune.py runs fedmed tune and test_docs.py the recipes page's tune command",
    ".venv/bin/fedmed tune app_configs/breast_us_lite0_e8_val30.yaml": "the tuning behind results.md's breast "
        "finding (about 85 minutes on 2 cores, needs ../shared/data); test_tune.py tunes a natural federation",
    ".venv/bin/fedmed experiment results/tune_breastmnist/tuned.yaml": "the evaluation of that tuning's choice; "
        "test_tune.py loads a tuned.yaml and builds its job",
    ".venv/bin/fedmed experiment app_configs/": "a study behind a results table; as above",
    "fedmed ssl app_configs/": "a Fed-MAE study behind a results table (tens of minutes per seed); as above",
    ".venv/bin/fedmed ssl app_configs/": "as above",
    ".venv/bin/fedmed sweep app_configs/": "a sweep behind a results table (hours on 2 cores); as above",
    "W=$(": "names the ImageNet release file for the study that follows (test_encoders.py loads that file)",
    ".venv/bin/python benchmarks/": "a benchmark or study script behind a table or a reading (minutes to hours); "
                                    "some are run shrunk by tests (bench_memory, ssl_validation, transfer_factors), "
                                    "the others only as the docs' commands",
    "python benchmarks/": "as above",
    "BUSI_DIR=... bash benchmarks/gpu_check.sh": "the GPU check behind results.md 'On a GPU' (needs a CUDA GPU; "
                                                 "test_device.py runs bench_gpu.py's CPU smoke runs, 2D and 3D)",
    "BRATS_DIR=... bash benchmarks/gpu_check.sh": "as above",
    "IN_PROCESS=1 JOBS=3 SEEDS=": "the 224-px rows of results.md (needs a CUDA GPU); test_experiment.py and "
                                  "test_jobs_e2e.py run fedmed experiment --in-process, which each of its runs is, and "
                                  "test_transfer.py the flag's way through transfer_factors.py",
}


LAB = sorted(f"lab/{p.name}" for p in (ROOT / "docs" / "lab").glob("*.md"))  # results.md's history (#89)


@pytest.mark.parametrize("page", ["deployment.md", "recipes.md", "results.md", "readings.md", *LAB])
def test_every_documented_command_runs_in_a_test_or_says_why_not(page):
    studies = page in ("results.md", "readings.md") or page.startswith("lab/")
    known = [*RUN_HERE, *NOT_HERE, *(STUDIES if studies else {})]
    unclassified = [c for c in doc_commands(page) if not any(c.startswith(k) for k in known)]
    assert unclassified == []


def clone_like(tmp_path: Path) -> Path:
    """A folder laid out as the clone a page's commands run in: this venv as .venv, the clone's jobs/ and
    app_configs/ — so what a command writes lands here, not in the source tree."""
    here = tmp_path / "fedmed"
    here.mkdir()
    (here / ".venv").symlink_to(Path(sys.prefix))
    for name in ("jobs", "app_configs"):
        (here / name).symlink_to(ROOT / name)
    return here


def _run(cmd: str, cwd: Path, timeout=600):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    return subprocess.run(["bash", "-c", cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def _command(page: str, start: str) -> str:
    return next(c for c in doc_commands(page) if c.startswith(start))


def test_deployment_section_6_builds_the_job_it_names_as_written(tmp_path):
    """§6's build command failed as written ("dataset.classes is not set") and named a job folder it did not write
    (into the source tree's jobs/): as written it builds the job, which the page's submit_job names."""
    here = clone_like(tmp_path)
    cmd = _command("deployment.md", ".venv/bin/python jobs/build.py --config app_configs/busi_fmcl.yaml --method FMCL "
                                    "--out job_folders --sites")
    p = _run(cmd, here)
    assert p.returncode == 0, p.stderr[-3000:]
    folder = Path(p.stdout.strip().splitlines()[-1])
    text = (ROOT / "docs" / "deployment.md").read_text()
    named = re.search(r"submit_job (job_folders/\S+?)`", text).group(1)
    assert folder == (here / named).resolve() and (folder / "meta.json").is_file()
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["deploy_map"] == {"app_server": ["server"], "app_hospital-a": ["hospital-a"],
                                  "app_hospital-b": ["hospital-b"]}
    assert not list(folder.rglob("custom"))  # a job of fedmed's own methods carries no code


def test_the_busi_224_recipe_as_written_names_the_missing_weights_before_any_training(tmp_path):
    """The recipe's command where the weights it names are not (yet) downloaded: one line naming the file, at once —
    not after the methods before the one that needs it have trained."""
    here = clone_like(tmp_path)
    if (here / "weights").exists():
        pytest.skip("weights/ is present: the recipe would run for hours")
    p = _run(_command("recipes.md", ".venv/bin/fedmed experiment app_configs/busi_224.yaml"), here, timeout=300)
    assert p.returncode != 0
    assert "weights/densenet121_3class.pt" in p.stderr and "not found" in p.stderr, p.stderr[-2000:]
    assert len(p.stderr.strip().splitlines()) <= 2 and "Traceback" not in p.stderr
    assert not (here / "results" / "busi_224" / "runs").exists()  # nothing trained


def test_the_kit_command_turns_log_streaming_off_unless_the_site_turns_it_on(tmp_path):
    """docs/deployment.md §4's two kit commands as written, on kits laid out as ``nvflare provision`` writes them (FLARE's
    shipped ``resources.json.default`` has ``allow_log_streaming: true``): the first turns streaming off in every kit
    and keeps FLARE's allow list and settings; the second turns it on in hospital-a's kit alone and says it changed."""
    prod = tmp_path / "provision" / "<project>" / "prod_00"
    shipped = {"format_version": 2, "allow_log_streaming": True, "class_allow_list": [
        "nvflare.app_common.", "nvflare.app_opt.tracking.mlflow.mlflow_receiver.MLflowReceiver",
        "nvflare.app_opt.tracking.wandb.wandb_receiver.WandBReceiver"],
               "components": [{"id": "site_log_streamer",
                               "path": "nvflare.app_common.logging.site_log_streamer.SiteLogStreamer"}]}
    for kit in ("server1", "hospital-a", "hospital-b"):
        (prod / kit / "local").mkdir(parents=True)
        (prod / kit / "startup").mkdir()
        (prod / kit / "local" / "resources.json.default").write_text(json.dumps(shipped))
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")

    def run(cmd):
        cmd = cmd.replace(".venv/bin/python", sys.executable).replace("provision/<project>/prod_00", str(prod))
        r = subprocess.run(["bash", "-c", cmd.replace("<project>", "'<project>'")], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        return r.stdout

    cmds = [c for c in doc_commands("deployment.md") if "fedmed_flare.kit" in c]
    everyone, one = cmds
    out = run(everyone)
    for kit in ("server1", "hospital-a", "hospital-b"):
        doc = json.loads((prod / kit / "local" / "resources.json").read_text())
        assert doc["allow_log_streaming"] is False
        assert doc["components"] == shipped["components"] and doc["class_allow_list"][0] == "nvflare.app_common."
        assert any(p.startswith("fedmed_flare.") for p in doc["class_allow_list"])
        assert not any("tracking.mlflow.mlflow_receiver" in p or "tracking.wandb" in p for p in doc["class_allow_list"])
    assert out.count("allow_log_streaming false") == 3
    out = run(one)
    assert "allow_log_streaming true (was false)" in out
    assert json.loads((prod / "hospital-a" / "local" / "resources.json").read_text())["allow_log_streaming"] is True
    assert json.loads((prod / "hospital-b" / "local" / "resources.json").read_text())["allow_log_streaming"] is False


def test_architecture_walks_one_config_through_at_most_five_forms_each_of_them_real(tmp_path):
    """#55: docs/architecture.md walks one config from command to site and names each form it takes — at most five —
    and each form it names is what the code holds: the classes and functions exist, the job's controller carries the
    spec's task config as the same JSON value under the name the page gives it, and a task message carries it under
    the wire key the page names."""
    import importlib
    import json
    import re

    import yaml

    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text[text.index("**One config, from command to site"):text.index("**What travels.**")]
    forms = re.findall(r"^\d\. \*\*(.+?)\*\*", section, flags=re.M)
    assert 2 <= len(forms) <= 5, forms
    for dotted in sorted(set(re.findall(r"`(fedmed(?:_flare)?(?:\.\w+)+)`", section))):
        mod, _, attr = dotted.rpartition(".")
        try:
            obj = importlib.import_module(dotted)
        except ImportError:
            obj = getattr(importlib.import_module(mod), attr, None)
        assert obj is not None, dotted

    from fedmed.config import load_config
    from fedmed.run.jobspec import JobSpec, job_spec, select_method
    from fedmed_flare.build import export, job_from_spec

    raw = {"name": "walk", "dataset": {"path": "builtin:digits", "image_size": 8, "channels": 1, "max_per_class": 8,
                                       "classes": [str(c) for c in range(10)]},
           "federation": {"sites": 2}, "model": {"arch": "resnet9", "width": 4}, "train": {"rounds": 1},
           "privacy": {"k_min": 2}, "methods": [{"name": "FedAvg", "workflow": "fedavg"}]}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    exp = load_config(tmp_path / "c.yaml")
    spec = job_spec(exp, select_method(exp, "FedAvg", "c.yaml"), 0)
    again = JobSpec.from_file(spec.to_file(tmp_path / "job_spec.json"))
    assert again.task_config == spec.task_config
    job = export(job_from_spec(again), tmp_path / "jobs")
    server = json.loads(next(job.rglob("config_fed_server.json")).read_text())
    ctrl = next(c for c in server["workflows"] if c["path"].endswith("WorkflowController"))
    assert ctrl["args"]["task_config"] == json.loads(json.dumps(spec.task_config))
    assert 'FLModel.meta["task_config"]' in section
    from fedmed_flare.controller import WorkflowController

    msg = WorkflowController(num_rounds=1, task_config=spec.task_config).message({}, 0, spec.task_config)
    assert msg.meta == {"task_config": spec.task_config}


def test_the_recipes_tune_command_runs_as_written(tmp_path):
    """docs/recipes.md "A federation of your own": its `fedmed tune` line in a clone-like folder writes a tuned.yaml
    that loads as a config, within its budget."""
    from fedmed.config import load_config

    here = clone_like(tmp_path)
    cmd = _command("recipes.md", ".venv/bin/fedmed tune")
    p = _run(cmd, here)
    assert p.returncode == 0, p.stderr[-2000:]
    out = here / "results" / "demo_tune"
    exp = load_config(out / "tuned.yaml")
    assert exp.name == "demo-digits" and "full run(s) of the config's recipe (budget 2)" in (out / "tuning.md").read_text()


def test_a_page_whose_commands_are_not_prefixed_says_to_activate_the_environment_first():
    """#89: every command of every page runs as written in a new shell, prefixed with the clone's ``.venv/bin/`` or
    after one stated ``source .venv/bin/activate`` before the page's first command."""
    prefixed = (".venv/", "MLFLOW_ALLOW_FILE_STORE=true .venv/", "BUSI_DIR=", "BRATS_DIR=", "IN_PROCESS=", "git clone",
                "python3 -m venv", "provision/", "source ")
    pages = ["deployment.md", "recipes.md", "results.md", "readings.md", *LAB]
    for page in pages:
        bare = [c for c in doc_commands(page) if not c.startswith(prefixed)]
        if bare:
            text = (ROOT / "docs" / page).read_text()
            assert "`source .venv/bin/activate`" in text[:text.index("```bash")], (page, bare[0])
    assert any(not c.startswith(prefixed) for p in LAB for c in doc_commands(p))  # the check has work to do


def test_architecture_shows_a_built_in_methods_module_as_it_is():
    """#88 item 7: docs/architecture.md's example of a method's module is a built-in one, printed whole — the page
    fails when fedmed/methods/fecfl.py changes and the page does not."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    shown = re.search(r"The\nwhole of FECFL, `fedmed/methods/fecfl.py`:\n\n```python\n(.*?)```", text, flags=re.S)
    assert shown is not None
    assert shown.group(1) == (ROOT / "fedmed" / "methods" / "fecfl.py").read_text()
