"""Packaging hook (everything else is in pyproject.toml): a built fedmed (``pip install .``, a wheel) carries the
shipped configs (``app_configs/``) as ``fedmed/_shipped/``, so ``fedmed
experiment`` and ``fedmed demo`` run outside a clone (``fedmed.core.resources``). An editable install reads them from
the clone. The FLARE side (adapters, job builder, runner, simulator) is the package ``fedmed_flare``, installed
beside ``fedmed``."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

SHIPPED = ("app_configs",)


class BuildWithShipped(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        here = Path(__file__).resolve().parent
        dest = Path(self.build_lib) / "fedmed" / "_shipped"
        for name in SHIPPED:
            shutil.copytree(here / name, dest / name, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


setup(cmdclass={"build_py": BuildWithShipped})
