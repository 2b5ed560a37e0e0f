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
    "flux": "jobs.flux",
    "ifca": "jobs.flux",
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
    ap.add_argument("--test-phase", action="store_true", help="build the unseen-site job (Flux Algorithm 2)")
    ap.add_argument("--training-result", default="", help="the training run's fedmed/ folder (flux_state.npz)")
    ap.add_argument("--known-clusters", default="", help="JSON {unseen site: cluster of its true group}")
    ap.add_argument("--cluster-sizes", default="", help="JSON {cluster: training sites} (IFCA ensemble weights)")
    a = ap.parse_args(argv)
    exp = load_config(a.config, a.set)
    methods = {m.name: m for m in exp.methods}
    if a.method not in methods:
        raise SystemExit(f"method {a.method!r} is not in {a.config} (has {sorted(methods)})")
    if a.test_phase:
        import json

        from jobs.flux import build_test

        job = build_test(exp, a.datalists, seed=a.seed, method=methods[a.method], training_result=a.training_result,
                         known_clusters=json.loads(a.known_clusters) if a.known_clusters else {},
                         cluster_sizes=json.loads(a.cluster_sizes) if a.cluster_sizes else {}, name=a.name)
        print(export(job, a.out))
        return
    print(export(build_for_method(exp, methods[a.method], a.datalists, a.seed, a.name), a.out))


if __name__ == "__main__":
    main()
