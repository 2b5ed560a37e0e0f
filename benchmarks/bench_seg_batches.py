"""3D training steps on patch batches as MONAI's transforms give them (``MetaTensor``) against the same batches as
plain tensors (what ``fedmed.nn.seg`` now feeds the network): the same U-Net start, batches, optimizer and steps,
interleaved A B A B, the same losses checked, the ratio of the medians printed.

    python benchmarks/bench_seg_batches.py [--reps 5] [--steps 24] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch
from monai.data import MetaTensor

from fedmed.nn.seg import seg_loss, seg_model, seg_step


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    # demo-sized batches: two 16^3 patches of 2 modalities, 3 region masks
    batches = [(torch.randn(2, 2, 16, 16, 16, generator=g), (torch.rand(2, 3, 16, 16, 16, generator=g) > 0.8).float())
               for _ in range(a.steps)]
    loss_fn = seg_loss("dice_focal")

    def run(meta: bool):
        torch.manual_seed(0)
        net = seg_model(2, channels=(8, 16, 32)).train()
        opt = torch.optim.Adam(net.parameters(), lr=1e-3)
        data = [(MetaTensor(x), MetaTensor(y)) if meta else (x, y) for x, y in batches]
        t = time.perf_counter()
        losses = [seg_step(net, loss_fn, x, y, opt, None)[0] for x, y in data]
        return time.perf_counter() - t, losses

    res: dict = {"MetaTensor": [], "plain": []}
    for _ in range(a.reps):
        for side in res:
            dt, losses = run(side == "MetaTensor")
            res[side].append((dt, losses))
            print(f"{side:10s} {dt:6.2f} s  final loss {losses[-1]:.6f}", flush=True)
    same = all(m[1] == p[1] for m, p in zip(res["MetaTensor"], res["plain"]))
    med = {s: sorted(d for d, _ in v)[len(v) // 2] for s, v in res.items()}
    print(f"median: MetaTensor {med['MetaTensor']:.2f} s, plain {med['plain']:.2f} s; "
          f"MetaTensor / plain = {med['MetaTensor'] / med['plain']:.2f}; same losses: {same}")


if __name__ == "__main__":
    main()
