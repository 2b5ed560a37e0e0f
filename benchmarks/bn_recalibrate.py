"""Is a federated classifier held back by its averaged batch-norm statistics? (issue #53, a diagnostic)

    .venv/bin/python benchmarks/bn_recalibrate.py results/transfer_factors_head/recipe --seeds 0 1 2

FedAvg averages each batch-norm layer's running mean and variance over the sites, but the averaged weights' own
activations need not have those statistics (the average of 17 models' statistics is not the statistics of their
average). This reads each seed's final global model (``runs/seed<N>/FedAvg/server/models/global.pt`` of a
``fedmed experiment`` folder) and the seed's datalists (``data/seed<N>``), and scores the model on the pooled
validation images of all sites twice: with the statistics it was sent (the average), and with statistics re-estimated
by one pass of the averaged model over all sites' pooled training images (PyTorch's cumulative average,
``momentum=None``). A diagnostic only: it pools the sites' images on one machine, which a federation would not.
Validation data only; test splits are not read.
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import numpy as np
import torch


def _val_auc(model, data, sites) -> float:
    from sklearn.metrics import roc_auc_score

    from fedmed.nn.train import predict_proba

    p, y = [], []
    for s in sites:
        x, ys = data[s].val
        if len(ys):
            p.append(predict_proba(model, x))
            y.append(np.asarray(ys))
    p, y = np.concatenate(p), np.concatenate(y)
    if p.shape[1] == 2:  # two classes: the positive class's probability
        return 100 * float(roc_auc_score(y, p[:, 1]))
    return 100 * float(roc_auc_score(y, p, multi_class="ovr", labels=np.arange(p.shape[1])))  # macro one-vs-rest


def recalibrated(model, data, sites, batch_size: int = 64):
    """A copy of ``model`` whose batch-norm running statistics are re-estimated over every site's training images
    (:func:`torch.optim.swa_utils.update_bn`: reset, then a cumulative average over every batch, each site's images in
    turn) — what ``train.norm_recalibrate`` computes, here on one machine: each site's
    :func:`fedmed.nn.train.norm_statistics`, pooled by batches (:func:`fedmed.algorithms.aggregation.pooled_norm_stats`)."""
    from fedmed.algorithms.aggregation import pooled_norm_stats
    from fedmed.nn.train import norm_statistics

    got = [norm_statistics(model, data[s].train[0], batch_size) for s in sites if data[s].train[0].shape[0]]
    stats = pooled_norm_stats([g for g, _ in got], [n for _, n in got])
    m = copy.deepcopy(model)
    state = m.state_dict()
    with torch.no_grad():
        for k, v in stats.items():
            state[k].copy_(torch.as_tensor(v))
    return m


def seed_row(run: Path, seed: int, batch_size: int = 64) -> dict:
    from fedmed.nn.predict import load_model
    from fedmed.site.runner import SiteRunner

    net, ck = load_model(run / "runs" / f"seed{seed}" / "FedAvg" / "server" / "models" / "global.pt")
    d = ck["data"]
    dl = run / "data" / f"seed{seed}"
    sites = sorted(p.stem for p in dl.glob("*.json") if p.stem != "dataset")
    data = {s: SiteRunner(s, dl).data(d["image_size"], d["channels"]) for s in sites}
    return {"seed": seed, "averaged": _val_auc(net, data, sites),
            "recalibrated": _val_auc(recalibrated(net, data, sites, batch_size), data, sites)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run", type=Path, help="a fedmed experiment folder with FedAvg runs")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--batch-size", type=int, default=64, help="images per batch of the re-estimating pass (each "
                    "site's images in turn; 64 as first run, a site's training batch size as a federation's sites "
                    "would: train.norm_recalibrate)")
    a = ap.parse_args(argv)
    rows = [seed_row(a.run, s, a.batch_size) for s in a.seeds]
    print(f"\nPooled validation AUC (%) of the final global model, all sites' validation images; made by "
          f"`benchmarks/bn_recalibrate.py {a.run} --seeds {' '.join(map(str, a.seeds))} --batch-size {a.batch_size}`\n")
    print("| seed | averaged statistics (as sent) | re-estimated on the pooled training images | difference |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['seed']} | {r['averaged']:.2f} | {r['recalibrated']:.2f} | {r['recalibrated'] - r['averaged']:+.2f} |")
    diff = np.array([r["recalibrated"] - r["averaged"] for r in rows])
    print(f"| mean ± std | | | {diff.mean():+.2f} ± {diff.std():.2f} |")  # std over seeds as the report's tables
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
