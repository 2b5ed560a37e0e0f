"""Build the job for one method of an experiment config (dispatch by the method's workflow).

    python jobs/build.py --config app_configs/busi.yaml --datalists DIR --out JOBS --method FedAvg --seed 0

Prints the job folder. Used by ``fedmed experiment``; handy by hand for POC or the admin console.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jobs.common import export  # noqa: E402

BUILDERS = {
    "fedavg": "jobs.fedavg",
    "fedprox": "jobs.fedavg",
    "fmcl": "jobs.clustered",
    "pacfl": "jobs.clustered",
    "fecfl": "jobs.clustered",
    "cfl": "jobs.clustered",
    "ditto": "jobs.fedavg",
    "seg_assess": "jobs.segmentation",
    "fedavg_w": "jobs.segmentation",
    "seg_clusters": "jobs.segmentation",
}


def build_for_method(exp, method, datalists: str, seed: int, name: str | None = None):
    import importlib

    if method.workflow not in BUILDERS:
        raise SystemExit(f"workflow {method.workflow!r} of method {method.name!r} has no job builder yet "
                         f"(available: {sorted(BUILDERS)})")
    mod = importlib.import_module(BUILDERS[method.workflow])
    return mod.build(exp, datalists, seed=seed, method=method, name=name)


def main(argv=None):
    from fedmed.config import load_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--datalists", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--method", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name")
    ap.add_argument("--set", action="append", default=[])
    a = ap.parse_args(argv)
    exp = load_config(a.config, a.set)
    methods = {m.name: m for m in exp.methods}
    if a.method not in methods:
        raise SystemExit(f"method {a.method!r} is not in {a.config} (has {sorted(methods)})")
    print(export(build_for_method(exp, methods[a.method], a.datalists, a.seed, a.name), a.out))


if __name__ == "__main__":
    main()
