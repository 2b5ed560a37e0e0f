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
    """Sites cache decoded data (fedmed.site.cache); the suite keeps its cache in a folder of its own, not the user's
    ~/.cache/fedmed (jobs started by tests inherit it)."""
    import tempfile

    os.environ.setdefault("FEDMED_CACHE_DIR", tempfile.mkdtemp(prefix="fedmed_test_cache_"))


@pytest.fixture
def rng():
    return np.random.default_rng(0)
