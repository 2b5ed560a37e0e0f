"""Flux costs, measured in one run: descriptor size against model size, and the server's
clustering step (adaptive DBSCAN on all descriptors + centroids) against one FedAvg round.

Latents come from a ResNet-9 (width 16) on PneumoniaMNIST sites with an ANDA feature shift
(../shared/data; sklearn digits when absent).

    .venv/bin/python benchmarks/bench_flux.py [--sites 10 --n-classes 2]
"""

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from fedmed.aggregation import weighted_average
from fedmed.clustered import flux_cluster
from fedmed.data import discover
from fedmed.flux import descriptor_length, flux_descriptor, latent_bounds, merge_bounds, shared_pca
from fedmed.models import build_model
from fedmed.partition import anda_federation, apply_anda_transform
from fedmed.train import get_params, latents, train_local

PNEU = Path(__file__).resolve().parents[2] / "shared" / "data" / "pneumoniamnist" / "pneumoniamnist.npz"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sites", type=int, default=10)
    ap.add_argument("--per-class", type=int, default=300)
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

    t = time.perf_counter()
    states, weights = [], []
    g = torch.Generator().manual_seed(0)
    for x, y in data:
        m = build_model("resnet9", 3, C, width=16)
        m.load_state_dict({k: torch.as_tensor(v) for k, v in theta.items()})
        train_local(m, x, y, epochs=1, batch_size=32, lr=0.01, generator=g)
        states.append(get_params(m))
        weights.append(len(y))
    weighted_average(states, weights)
    t_round = time.perf_counter() - t

    lats = [latents(model, x) for x, _ in data]
    lo, hi = merge_bounds([latent_bounds(z) for z in lats])
    pca = shared_pca(lo, hi)
    descs = {f"site-{k + 1}": {"full": d.full, "label_free": d.label_free}
             for k, d in enumerate(flux_descriptor(z, pca, y.numpy(), n_classes=C) for z, (_, y) in zip(lats, data))}
    flux_cluster(descs)  # warm-up: first call pays scikit-learn/kneed imports
    t = time.perf_counter()
    info = flux_cluster(descs)
    t_cluster = time.perf_counter() - t
    print(f"clustering step (adaptive DBSCAN + centroids, {a.sites} sites, found K={info['k']}): {1000 * t_cluster:.1f} ms; "
          f"one FedAvg round ({a.sites} sites x 1 epoch): {t_round:.2f} s; ratio = {t_cluster / t_round:.5f}")


if __name__ == "__main__":
    main()
