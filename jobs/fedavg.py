"""FedAvg / FedProx / FedAvg_w job builder.

    python jobs/fedavg.py --config app_configs/busi_fedavg.yaml --datalists DIR --out JOBS [--seed 0]
        [--mu 0.01] [--down-weight-site site-3 --omega 0.3]

then ``nvflare simulator JOBS/<name> -w WS -n <sites> -t <sites>`` or ``poc/run_poc.py JOBS/<name>``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jobs.common import export, fedmed_config, new_job, read_dataset_meta  # noqa: E402  (jobs/ on sys.path)


def build(exp, datalist_dir: str, *, seed: int = 0, method=None, name: str | None = None,
          down_weight_site: str = "", omega: float = 1.0):
    from custom.controllers import FedAvgController

    meta = read_dataset_meta(datalist_dir)
    cfg = fedmed_config(exp, meta, seed, method)
    ctrl = FedAvgController(num_rounds=exp.train.rounds, fedmed_config=cfg, down_weight_site=down_weight_site,
                            omega=omega)
    label = (method.name if method else ("fedprox" if cfg["train"]["fedprox_mu"] > 0 else "fedavg"))
    job_name = name or "".join(ch if ch.isalnum() else "_" for ch in f"{exp.name}_{label}_s{seed}").lower()
    return new_job(job_name, meta["sites"], datalist_dir, ctrl)


def main(argv=None):
    from fedmed.config import load_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--datalists", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mu", type=float, default=None, help="FedProx proximal weight (0 = FedAvg)")
    ap.add_argument("--down-weight-site", default="")
    ap.add_argument("--omega", type=float, default=1.0)
    ap.add_argument("--set", action="append", default=[], help="config override key.path=value")
    a = ap.parse_args(argv)
    exp = load_config(a.config, a.set)
    if a.mu is not None:
        exp.train.fedprox_mu = a.mu
    job = build(exp, a.datalists, seed=a.seed, down_weight_site=a.down_weight_site, omega=a.omega)
    print(export(job, a.out))


if __name__ == "__main__":
    main()
