"""FMCL costs, measured in one run on this machine.

1. Signature-extraction throughput of ``fedmed.encoders.extract_features`` (MONAI transforms,
   batching) against a bare torch forward loop over the same images and encoder.
2. The server's clustering step (FMCL distances + auto-K on 20 sites' signatures) against one
   FedAvg round's compute (every site trains ResNet-9 for one local epoch, then the average).

Data: BUSI from ../shared/data (sklearn digits when absent), 32x32 grayscale.

    .venv/bin/python benchmarks/bench_signatures.py [--encoder vit_tiny --encoder-size 112 --n 400]
"""

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from fedmed.aggregation import weighted_average
from fedmed.clustered import choose_clusters, signature_distances
from fedmed.data import discover
from fedmed.encoders import build_encoder, extract_features
from fedmed.fmcl import class_signature
from fedmed.models import build_model
from fedmed.partition import dirichlet_label_partition
from fedmed.train import get_params, train_local

BUSI = Path(__file__).resolve().parents[2] / "shared" / "data" / "busi"


def load(n, size=32):
    from PIL import Image

    pool = discover(str(BUSI) if BUSI.exists() else "builtin:digits")
    idx = np.random.default_rng(0).permutation(len(pool.labels))[:n]
    xs = []
    for i in idx:
        item = pool.items[i]
        im = Image.open(item).convert("L") if isinstance(item, str) else Image.fromarray(item)
        xs.append(np.asarray(im.resize((size, size)), dtype=np.float32) / 255)
    return torch.from_numpy(np.stack(xs))[:, None], pool.labels[idx], pool.source


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--encoder", default="vit_tiny")
    ap.add_argument("--encoder-size", type=int, default=112)
    ap.add_argument("--n", type=int, default=400)
    ap.add_argument("--sites", type=int, default=20)
    a = ap.parse_args()
    torch.set_num_threads(2)
    x, y, source = load(a.n)
    enc = build_encoder(a.encoder, in_channels=1, image_size=a.encoder_size)
    print(f"data: {source}, {len(y)} images 32x32; encoder {enc.description}")
    extract_features(enc, x[:8])  # warm-up
    t = time.perf_counter()
    feats = extract_features(enc, x, batch_size=32)
    t_fedmed = time.perf_counter() - t

    t = time.perf_counter()
    with torch.no_grad():
        for s in range(0, len(x), 32):
            xb = torch.nn.functional.interpolate(x[s:s + 32], size=(a.encoder_size,) * 2, mode="bilinear")
            enc.module(((xb - 0.5) / 0.25).repeat(1, 3, 1, 1))
    t_bare = time.perf_counter() - t
    print(f"signature extraction: fedmed {len(x) / t_fedmed:.1f} img/s, bare torch loop {len(x) / t_bare:.1f} img/s, "
          f"ratio fedmed/bare throughput = {t_bare / t_fedmed:.2f}")

    parts = dirichlet_label_partition(y, a.sites, 0.1, 0)
    sigs = {}
    for k, p in enumerate(parts):
        s = class_signature(feats[p], y[p])
        sigs[f"site-{k + 1}"] = {"classes": s.classes, "means": s.means, "counts": s.counts}
    choose_clusters(*reversed(signature_distances("fmcl", sigs)))  # warm-up: first call pays imports
    t = time.perf_counter()
    names, D = signature_distances("fmcl", sigs)
    info = choose_clusters(D, names)
    t_cluster = time.perf_counter() - t

    model = build_model("resnet9", 1, 3, width=16)
    theta = get_params(model)
    g = torch.Generator().manual_seed(0)
    t = time.perf_counter()
    states, weights = [], []
    for p in parts:
        m = build_model("resnet9", 1, 3, width=16)
        m.load_state_dict({k: torch.as_tensor(v) for k, v in theta.items()})
        train_local(m, x[p], torch.as_tensor(y[p]), epochs=1, batch_size=16, lr=0.01, generator=g)
        states.append(get_params(m))
        weights.append(len(p))
    weighted_average(states, weights)
    t_round = time.perf_counter() - t
    print(f"clustering step (FMCL distances + auto-K, {len(names)} sites, K={info['k']}): {1000 * t_cluster:.1f} ms; "
          f"one FedAvg round ({len(parts)} sites x 1 epoch): {t_round:.2f} s; ratio clustering/round = "
          f"{t_cluster / t_round:.4f}")


if __name__ == "__main__":
    main()
