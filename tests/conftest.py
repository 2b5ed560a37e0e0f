import os
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("FEDMED_SHARED_DATA", ROOT.parent / "shared" / "data"))


def shared_path(*parts) -> Path:
    """A path under ../shared/data, or skip the test with the reason."""
    p = SHARED_DATA.joinpath(*parts)
    if not p.exists():
        pytest.skip(f"shared data not found at {p} (set FEDMED_SHARED_DATA or place ../shared/data beside the repo)")
    return p


def pytest_configure(config):
    """Sites cache decoded data (fedmed.site.cache); the suite's sites share one cache folder of the suite's own, so
    that its many small federations of the same data decode it once (jobs started by tests and xdist's workers
    inherit it). The process that made the folder removes it when the session ends (it held ~50 MB after a suite);
    a folder given in FEDMED_CACHE_DIR is the user's and stays."""
    import tempfile

    if not os.environ.get("FEDMED_CACHE_DIR"):
        os.environ["FEDMED_CACHE_DIR"] = config._fedmed_cache_made = tempfile.mkdtemp(prefix="fedmed_test_cache_")


def pytest_unconfigure(config):
    import shutil

    if made := getattr(config, "_fedmed_cache_made", None):
        shutil.rmtree(made, ignore_errors=True)


# The files with the longest tests, longest first (their summed durations in a `make test` run, 2026-12-02: readme
# 282 s, deployment 200, jobs_e2e 191, networks 182, bundle 114, jobs 87, encoders 82, tracking 59, onboard 55, plan
# 34; every other file under 30 s). ``make test`` runs the suite on two workers, a file to a worker (``pytest -n 2
# --dist loadfile``); a worker takes the next file when it is free, so a long file collected last would run alone at
# the end (test_readme's ``make demo``, about 5 minutes, did). Only the order changes. xdist (3.6+) reorders the files
# by their number of tests unless told ``--no-loadscope-reorder``, which ``make test`` says: under xdist's order the
# few-test long files ran last (simulated from the durations above: 845 s against 785 s in this order).
LONG_FILES = ("test_readme.py", "test_deployment.py", "test_jobs_e2e.py", "test_networks.py", "test_bundle.py",
              "test_jobs.py", "test_encoders.py", "test_tracking.py", "test_onboard.py", "test_plan.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FILES)))  # stable: a file's own order is kept


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def own_site(site: str, folder, *, k_min: int = 1, cls=None, **policy):
    """A site runner whose datalist is ``<folder>/<site>.json`` and whose policy is the experimenter's own
    (``SitePolicy.simulating``: the floor is ``k_min``, so a job's smaller ``privacy.k_min`` is what applies) — the
    site of a unit test of a task. A site without a policy file runs the defaults (floor 5): tests of that are in
    test_policy.py."""
    from dataclasses import replace

    from fedmed.core.policy import SitePolicy
    from fedmed.site.runner import SiteRunner
    from fedmed.site.settings import settings_for_dir

    p = replace(SitePolicy.simulating(k_min), **policy)
    return (cls or SiteRunner)(site, settings_for_dir(site, folder, policy=p))


def doc_commands(page: str) -> list[str]:
    """The command lines of the bash blocks of ``docs/<page>``."""
    import re

    text = (ROOT / "docs" / page).read_text()
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        joined = re.sub(r"\\\n\s*", "", block)  # a command continued on the next line is one command
        out += [ln.strip() for ln in joined.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    return out


def doc_json(page: str, caption: str):
    """The first JSON block of ``docs/<page>`` after ``caption`` (e.g. the file it is for), parsed."""
    import json
    import re

    text = (ROOT / "docs" / page).read_text()
    return json.loads(re.search(r"```json\n(.*?)```", text[text.index(caption):], flags=re.S).group(1))


# ------------------------------------------------------------------ task-config sections as a method hands them on
def flux_section(**kw) -> dict:
    """The ``flux`` section a Flux workflow sends its sites (its values from ``fedmed.methods.FluxMethod``)."""
    from fedmed.methods import FluxMethod

    return {**FluxMethod(name="Flux", workflow="flux").workflow_options(None, 0)["flux"], **kw}


def signature_section(kind: str, encoder: str, **kw) -> dict:
    """The ``signature`` section of an FMCL / PACFL / FECFL workflow's task (from the method's defaults)."""
    from fedmed.methods import METHODS

    m = METHODS[kind](name=kind, workflow=kind, encoder=encoder)
    return {**m.workflow_options(None, 0)["signature"], **kw}


def mae_section(rounds: int = 1, **kw) -> dict:
    """The ``method_options`` of a Fed-MAE task (from ``fedmed.methods.FedMAEMethod``'s defaults)."""
    from types import SimpleNamespace

    from fedmed.methods import FedMAEMethod

    exp = SimpleNamespace(train=SimpleNamespace(rounds=rounds))
    return {**FedMAEMethod(name="MAE", workflow="fedmae").site_options(exp, 0), **kw}
