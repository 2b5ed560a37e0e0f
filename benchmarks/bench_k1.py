"""The auto-K K = 1 test's threshold (docs/readings.md, FMCL "Alg. 5: K = 1"): FMCL's silhouette at the chosen K
on IID vs label-skewed BUSI federations.

    .venv/bin/python benchmarks/bench_k1.py [--partitions iid dirichlet] [--seeds 0 1 2]
    .venv/bin/python benchmarks/bench_k1.py --config app_configs/busi_fmcl.yaml \
        --set dataset.path=../shared/data/pneumoniamnist/pneumoniamnist.npz --set dataset.max_per_class=300
                                           # data the threshold was not chosen on (#38)

For each partition and seed, builds ``app_configs/busi_fmcl.yaml``'s federation (20 sites; ``iid`` overrides the
partition), has every site compute its FMCL signature exactly as in a job (``SiteRunner.handle("signature")``:
random ViT-Tiny at 112 px, classes under k_min withheld), and runs auto-K *without* the K = 1 test
(``k1_silhouette=None``, the paper's literal rule). Prints K*, S(K*) and the silhouette curve: a federation without
structure (IID) should score below the threshold, a label-skewed one above; the last column says what the K = 1
test at 0.5 keeps. No training; about a minute per federation on one CPU thread. ``--config`` / ``--set`` build
another federation (the threshold was chosen on BUSI; #38 re-validates it on data it was not chosen on).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None):
    import torch

    from fedmed.algorithms.signatures import signature_distances
    from fedmed.algorithms.clustering import auto_k
    from fedmed.config import load_config  # (and every method's signature kind, registered by fedmed.methods)
    from fedmed.run.experiment import prepare_federation
    from fedmed.site.runner import SiteRunner

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--partitions", nargs="+", default=["iid", "dirichlet"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--config", default=str(ROOT / "app_configs" / "busi_fmcl.yaml"))
    ap.add_argument("--set", action="append", default=[], help="config override key.path=value (repeatable)")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="bench_k1_"))
    print(f"{Path(a.config).name} {' '.join(a.set)}")
    print("partition | seed | K* | S(K*) | silhouette per K | K with the K = 1 test (0.5)")
    for part in a.partitions:
        for seed in a.seeds:
            over = list(a.set) + (["federation.partition=iid"] if part == "iid" else
                                  ["federation.partition=dirichlet"])
            exp = load_config(a.config, over)
            data = prepare_federation(exp, seed, tmp / f"{part}{seed}")
            meta = json.loads((data / "dataset.json").read_text())
            sites = meta["sites"]
            cfg = {"seed": seed, "data": {"image_size": exp.dataset.image_size, "channels": exp.dataset.channels,
                                          "n_classes": len(meta["class_names"])},
                   "signature": {"kind": "fmcl", "encoder": "vit_tiny", "image_size": 112, "seed": 0},
                   "privacy": {"k_min": exp.privacy.k_min}}
            sigs = {s: SiteRunner(s, data).handle("signature", {}, cfg).meta for s in sites}
            _, D = signature_distances("fmcl", sigs)
            res = auto_k(D, k1_silhouette=None)
            curve = {int(k): round(float(v), 3) for k, v in sorted(res.scores.items())}
            kept = auto_k(D, k1_silhouette=0.5).k
            print(f"{part} | {seed} | {res.k} | {curve.get(res.k)} | {curve} | {kept}", flush=True)


if __name__ == "__main__":
    main()
