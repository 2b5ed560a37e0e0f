"""``pip install .`` (not editable) gives a fedmed that runs outside a clone: the FLARE adapters, job runners and
shipped configs come with the package (``fedmed.core.resources``)."""

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _copy_source(dest: Path) -> Path:
    """The clone's source as a fresh checkout would hold it (no venv, results or build leftovers)."""
    skip = shutil.ignore_patterns(".git", ".venv", "results", "workspace*", "build", "*.egg-info", "__pycache__",
                                  ".pytest_cache", "_shipped")
    shutil.copytree(ROOT, dest, ignore=skip)
    return dest


@pytest.mark.slow
def test_a_non_editable_install_runs_the_demo_and_python_m_fedmed_from_any_folder(tmp_path):
    """A fresh virtualenv outside the clone, fedmed installed into it from a copy of the source (not editable; the
    dependencies come from this environment, as a package index would give them): ``python -m fedmed --help``,
    ``fedmed demo``'s smallest part and the job builder (``fedmed job build``) run from an empty folder, with
    fedmed's code, adapters and configs from the installed package."""
    src = _copy_source(tmp_path / "src")
    env_dir = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(env_dir)], check=True, timeout=300)
    py = env_dir / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # the dependencies (torch, nvflare, monai, ...) from this environment; not its editable fedmed
    (Path(site) / "_fedmed_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PIP_NO_INDEX"] = "1"
    # a wheel built from the source (this environment's setuptools: no download), installed as a user would
    w = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet", "-w",
                        str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=600, env=env,
                       cwd=tmp_path)
    assert w.returncode == 0, w.stderr[-3000:]
    wheel = next((tmp_path / "dist").glob("fedmed-*.whl"))
    p = subprocess.run([str(py), "-m", "pip", "install", "--no-deps", "--quiet", str(wheel)],
                       capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    shutil.rmtree(src)  # nothing may be read from the source any more

    work = tmp_path / "elsewhere"
    work.mkdir()
    where = subprocess.run([str(py), "-c", "import fedmed, fedmed.core.resources as r; print(fedmed.__file__); "
                            "print(r.project_root())"], capture_output=True, text=True, env=env, cwd=work, timeout=120)
    assert where.returncode == 0, where.stderr[-2000:]
    pkg_file, root = where.stdout.split()
    assert pkg_file.startswith(site) and str(ROOT) not in pkg_file
    assert root.startswith(site) and root.endswith("_shipped")

    h = subprocess.run([str(py), "-m", "fedmed", "--help"], capture_output=True, text=True, env=env, cwd=work,
                       timeout=120)
    assert h.returncode == 0 and "experiment" in h.stdout and "demo" in h.stdout, h.stderr[-2000:]

    demo = subprocess.run([str(env_dir / "bin" / "fedmed"), "demo", "--part", "flux", "--out", "out"],
                          capture_output=True, text=True, env=env, cwd=work, timeout=900)
    assert demo.returncode == 0, (demo.stdout[-3000:], demo.stderr[-3000:])
    assert "clusters found in training" in demo.stdout
    assert (work / "out" / "flux" / "summary.md").is_file()
    assert (work / "out" / "report.html").is_file()

    # the job builder, shipped with the package, from the same folder (a relative --out is the caller's), naming a
    # shipped config as the docs do (app_configs/<name>: "config file not found" outside a clone before)
    job = subprocess.run([str(env_dir / "bin" / "fedmed"), "job", "build", "--config", "app_configs/demo_digits.yaml",
                          "--method", "FedAvg", "--out", "jobs", "--set", "dataset.classes=[a,b,c,d,e,f,g,h,i,j]"],
                         capture_output=True, text=True, env=env, cwd=work, timeout=300)
    assert job.returncode == 0, job.stderr[-3000:]
    assert (work / "jobs" / "demo_digits_fedavg_s0" / "meta.json").is_file()
    bad = subprocess.run([str(env_dir / "bin" / "fedmed"), "job", "build", "--config", "nope.yaml", "--method", "X",
                          "--out", "jobs"], capture_output=True, text=True, env=env, cwd=work, timeout=300)
    assert bad.returncode == 2 and "nope.yaml: config file not found" in bad.stderr

    # an experiment of the user's own: a relative config in the user's folder, run from there (one round)
    import yaml

    study = work / "study"
    study.mkdir()
    (study / "cfg.yaml").write_text(yaml.safe_dump({
        "name": "mine", "dataset": {"path": "builtin:digits", "image_size": 8, "channels": 1, "max_per_class": 8},
        "federation": {"sites": 2}, "model": {"arch": "resnet9", "width": 4},
        "train": {"rounds": 1, "local_epochs": 1, "batch_size": 8}, "privacy": {"k_min": 2}, "references": []}))
    run = subprocess.run([str(env_dir / "bin" / "fedmed"), "experiment", "cfg.yaml", "--out", "out"],
                         capture_output=True, text=True, env=env, cwd=study, timeout=600)
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-3000:])
    assert "done in" in run.stdout, run.stdout[-2000:]
    assert (study / "out" / "results.csv").is_file()
    spec = next((study / "out" / "runs").rglob("job_spec.json"))
    assert str(ROOT) not in spec.read_text()  # built by the installed fedmed, not the clone
