"""3D training with the patch batches as MONAI's transforms give them (``MetaTensor``) against plain tensors (what
``fedmed.nn.seg`` feeds the network): the same U-Net, cases, seed and steps, interleaved A B A B, the same losses
checked, the ratio of the medians printed.

    python benchmarks/bench_seg_batches.py [--reps 5] [--cases 8] [--epochs 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from fedmed.nn import seg


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cases", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    rng = np.random.default_rng(0)
    cases = []
    for _ in range(a.cases):  # demo-sized phantoms: 2 modalities, 3 regions, 24^3, a cubic lesion
        img = rng.standard_normal((2, 24, 24, 24)).astype(np.float32)
        lab = np.zeros((3, 24, 24, 24), np.float32)
        lab[:, 8:14, 8:14, 8:14] = 1
        cases.append({"image": img, "label": lab})
    plain = seg._plain

    def run(as_given: bool):
        seg._plain = torch.as_tensor if as_given else plain  # torch.as_tensor keeps a MetaTensor a MetaTensor
        try:
            torch.manual_seed(0)
            net = seg.seg_model(2, channels=(8, 16, 32))
            t = time.perf_counter()
            r = seg.train_seg_local(net, cases, epochs=a.epochs, roi=(16, 16, 16), patches=2, seed=1)
            return time.perf_counter() - t, r["loss"]
        finally:
            seg._plain = plain

    res: dict = {"MetaTensor": [], "plain": []}
    for _ in range(a.reps):
        for side in res:
            dt, loss = run(side == "MetaTensor")
            res[side].append((dt, loss))
            print(f"{side:10s} {dt:6.2f} s  loss {loss:.6f}", flush=True)
    same = [x for _, x in res["MetaTensor"]] == [x for _, x in res["plain"]]
    m, p = (float(np.median([d for d, _ in res[s]])) for s in ("MetaTensor", "plain"))
    print(f"median: MetaTensor {m:.2f} s, plain {p:.2f} s; MetaTensor / plain = {m / p:.2f}; same losses: {same}")


if __name__ == "__main__":
    main()
