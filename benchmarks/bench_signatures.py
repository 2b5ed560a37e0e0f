"""Signature extraction and FMCL's clustering step, measured honestly (``benchmarks/_common.py``).

1. ``fedmed.nn.encoders.extract_features`` against a bare torch loop doing the same operations (same batches, resize,
   channel repeat, normalisation, forward): both must give the same features (checked), then interleaved timing.
2. The server's clustering step (FMCL distances + auto-K on 20 sites' signatures) against one FedAvg round's compute
   (every site trains ResNet-9 for the recipe's local epochs, then the average): a cost ratio of two different
   computations, interleaved, with no result check.

Data: BUSI from ../shared/data (sklearn digits when absent), 32x32 grayscale.

    .venv/bin/python benchmarks/bench_signatures.py [--encoder vit_tiny --encoder-size 112 --n 400 --pairs 5]
"""

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import compare  # noqa: E402

from fedmed.algorithms.aggregation import weighted_average  # noqa: E402
from fedmed.algorithms.clustered import choose_clusters  # noqa: E402
from fedmed.algorithms.signatures import signature_distances  # noqa: E402
from fedmed.methods import METHODS  # noqa: E402,F401  (each method's module registers its signature kind)
from fedmed.data.images import discover  # noqa: E402
from fedmed.nn.encoders import build_encoder, extract_features  # noqa: E402
from fedmed.algorithms.fmcl import class_signature  # noqa: E402
from fedmed.nn.models import build_model  # noqa: E402
from fedmed.data.partition import dirichlet_label_partition  # noqa: E402
from fedmed.nn.train import get_params, make_optimizer, train_local  # noqa: E402

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
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--encoder", default="vit_tiny")
    ap.add_argument("--encoder-size", type=int, default=112)
    ap.add_argument("--n", type=int, default=400)
    ap.add_argument("--sites", type=int, default=20)
    ap.add_argument("--pairs", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(2)
    x, y, source = load(a.n)
    enc = build_encoder(a.encoder, in_channels=1, image_size=a.encoder_size)
    print(f"data: {source}, {len(y)} images 32x32; encoder {enc.description}")

    def bare():
        outs = []
        with torch.no_grad():
            for s in range(0, len(x), 32):
                xb = torch.nn.functional.interpolate(x[s:s + 32], size=(a.encoder_size,) * 2, mode="bilinear",
                                                     align_corners=False)
                outs.append(enc.module(((xb.repeat(1, 3, 1, 1)) - 0.5) / 0.25).double())
        return torch.cat(outs).numpy()

    compare("signature extraction", bare, lambda: extract_features(enc, x, batch_size=32), label_a="bare torch loop",
            label_b="fedmed extract_features", pairs=a.pairs, same=lambda p, q: np.array_equal(p, q))

    feats = extract_features(enc, x)
    parts = dirichlet_label_partition(y, a.sites, 0.1, 0)
    sigs = {}
    for k, p in enumerate(parts):
        s = class_signature(feats[p], y[p])
        sigs[f"site-{k + 1}"] = {"classes": s.classes, "means": s.means, "counts": s.counts}

    def clustering():
        names, D = signature_distances("fmcl", sigs)
        return choose_clusters(D, names)

    theta = get_params(build_model("resnet9", 1, 3, width=16))
    recipe = {"optimizer": "adam", "lr": 1e-3, "weight_decay": 5e-4}

    def fedavg_round():
        states, weights = [], []
        for p in parts:
            m = build_model("resnet9", 1, 3, width=16)
            m.load_state_dict({k: torch.as_tensor(v) for k, v in theta.items()})
            train_local(m, x[p], torch.as_tensor(y[p]), epochs=3, batch_size=16, optimizer=make_optimizer(m, recipe),
                        generator=torch.Generator().manual_seed(0))
            states.append(get_params(m))
            weights.append(len(p))
        return weighted_average(states, weights)

    out = compare("FMCL clustering step vs one FedAvg round (different computations)", fedavg_round, clustering,
                  label_a="FedAvg round", label_b="clustering", pairs=a.pairs, check=False)
    print(f"clustering ({a.sites} sites, K={clustering()['k']}) costs {out['wall_ratio']:.4f} of a FedAvg round")


if __name__ == "__main__":
    main()
