"""Where fedmed finds what ships beside the library: the configs (``app_configs/``). (The FLARE side — adapters, job
builder, runner and simulator — is a package of its own, ``fedmed_flare``, installed with fedmed.)

In a clone (or an editable install) they are the clone's folders; a built package (``pip install .``) carries a
copy in ``fedmed/_shipped/`` (``setup.py``). Either way ``fedmed experiment`` and ``fedmed demo`` work from any
folder.
"""

from __future__ import annotations

from fedmed.core.errors import FedmedError

from pathlib import Path

__all__ = ["ResourceError", "project_root", "shipped_config"]

_PACKAGE = Path(__file__).resolve().parents[1]  # the fedmed package


class ResourceError(FedmedError, FileNotFoundError):
    """fedmed's shipped files are missing (a broken install)."""


def _complete(root: Path) -> bool:
    return (root / "app_configs" / "demo_digits.yaml").is_file()


def project_root() -> Path:
    """The folder holding ``app_configs/``: the clone fedmed runs from, else the copy
    installed with the package."""
    for root in (_PACKAGE.parent, _PACKAGE / "_shipped"):
        if _complete(root):
            return root
    raise ResourceError(f"fedmed's shipped configs are missing (neither a clone's app_configs/ beside the package nor "
                        f"{_PACKAGE.name}/_shipped/): reinstall fedmed with `pip install .` from its source")


def shipped_config(name: str) -> Path:
    """A config shipped with fedmed (``app_configs/<name>``)."""
    path = project_root() / "app_configs" / name
    if not path.is_file():
        raise ResourceError(f"app_configs/{name}: not shipped with this fedmed")
    return path
