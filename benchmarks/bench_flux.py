"""Flux costs: descriptor size against model size, and the server's clustering step (adaptive DBSCAN on all
descriptors, the K = 1 test, centroids) against one FedAvg round — two different computations, timed interleaved
(``benchmarks/_common.py``, no result check).

Latents come from a ResNet-9 (width 16) on PneumoniaMNIST sites with an ANDA feature shift
(../shared/data; sklearn digits when absent).

    .venv/bin/python benchmarks/bench_flux.py [--sites 10 --pairs 5]
"""

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

from fedmed.algorithms.aggregation import weighted_average
from fedmed.algorithms.clustered import flux_cluster
from fedmed.data.images import discover
from fedmed.algorithms.flux import descriptor_length, flux_descriptor, latent_bounds, merge_bounds, shared_pca
from fedmed.nn.models import build_model
from fedmed.data.anda import anda_federation, apply_anda_transform
from fedmed.nn.train import get_params, latents, make_optimizer, train_local

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import compare  # noqa: E402

PNEU = Path(__file__).resolve().parents[2] / "shared" / "data" / "pneumoniamnist" / "pneumoniamnist.npz"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sites", type=int, default=10)
    ap.add_argument("--per-class", type=int, default=300)
    ap.add_argument("--pairs", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(2)
    pool = discover(str(PNEU) if PNEU.exists() else "builtin:digits", max_per_class=a.per_class)
    sites = anda_federation(pool.labels, a.sites, "feature", 0, level=5, n_groups=3)
    data = []
    for s in sites:
        imgs = []
        labels = []
        for i in s.indices:
            img, lab = apply_anda_transform(np.asarray(pool.items[i]), int(pool.labels[i]), s)
            imgs.append(img.astype(np.float32) / 255.0)
            labels.append(lab)
        x = torch.from_numpy(np.stack(imgs)).permute(0, 3, 1, 2) if imgs[0].ndim == 3 else torch.from_numpy(np.stack(imgs))[:, None]
        data.append((x, torch.tensor(labels)))
    C = pool.n_classes
    model = build_model("resnet9", 3, C, width=16)
    theta = get_params(model)
    n_params = sum(v.size for v in theta.values())
    L = descriptor_length(C, 10)
    print(f"data: {pool.source}, {a.sites} sites, ANDA feature shift (3 groups)")
    print(f"descriptor length L = 2(U+1)l = {L} floats; model p = {n_params} parameters; L/p = {L / n_params:.2e} "
          f"(paper's requirement: <= 1e-2)")

    def fedavg_round():
        states, weights = [], []
        for x, y in data:
            m = build_model("resnet9", 3, C, width=16)
            m.load_state_dict({k: torch.as_tensor(v) for k, v in theta.items()})
            train_local(m, x, y, epochs=3, batch_size=16, generator=torch.Generator().manual_seed(0),
                        optimizer=make_optimizer(m, {"optimizer": "adam", "lr": 1e-3, "weight_decay": 5e-4}))
            states.append(get_params(m))
            weights.append(len(y))
        return weighted_average(states, weights)

    lats = [latents(model, x) for x, _ in data]
    lo, hi = merge_bounds([latent_bounds(z) for z in lats])
    pca = shared_pca(lo, hi)
    descs = {f"site-{k + 1}": {"full": d.full, "label_free": d.label_free}
             for k, d in enumerate(flux_descriptor(z, pca, y.numpy(), n_classes=C) for z, (_, y) in zip(lats, data))}
    out = compare("Flux clustering step vs one FedAvg round (different computations)", fedavg_round,
                  lambda: flux_cluster(descs), label_a="FedAvg round", label_b="Flux clustering", pairs=a.pairs,
                  check=False)
    print(f"clustering ({a.sites} sites, K={flux_cluster(descs)['k']}) costs {out['wall_ratio']:.5f} of a FedAvg round")


if __name__ == "__main__":
    main()
