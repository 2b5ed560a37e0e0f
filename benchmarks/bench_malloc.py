"""Does the simulator's fixed glibc mmap threshold slow training? (issue #10/#13)

    .venv/bin/python benchmarks/bench_malloc.py [--pairs 3] [--thresholds 131072 1048576]

``jobs/run.py`` starts the simulator with ``MALLOC_MMAP_THRESHOLD_`` fixed (glibc otherwise raises it after the first
large free, which kept FLARE's freed 1 MiB stream buffers in the heap). A fixed threshold also sends torch's larger
tensors through ``mmap``/``munmap``. This runs the same local training — the 2D recipe (ResNet-9 width 16, 32×32,
batch 16, 3 epochs on 300 random images) and a 3D U-Net step loop (32³ patches) — in fresh interpreters with
glibc's default and with each threshold, interleaved (default, t1, t2, default, t1, t2, …), checks that every
arm ends with the same weights (the allocator must not change results), and prints median wall times and ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WORK = r"""
import hashlib, json, sys, time, torch
sys.path.insert(0, sys.argv[1])
torch.set_num_threads(1)
from fedmed.nn.models import model_from_config
from fedmed.nn.train import make_optimizer, train_local
g = torch.Generator(); g.manual_seed(0)
x = torch.rand(300, 1, 32, 32, generator=g); y = torch.randint(0, 3, (300,), generator=g)
m = model_from_config({"arch": "resnet9", "width": 16}, 1, 3, seed=0)
opt = make_optimizer(m, {"optimizer": "adam", "lr": 1e-3})
t0 = time.perf_counter()
train_local(m, x, y, epochs=3, batch_size=16, optimizer=opt, generator=g, augment="flip")
t2d = time.perf_counter() - t0
from fedmed.nn.seg import seg_model
net = seg_model(4, channels=[8, 16, 32], seed=0)
opt3 = torch.optim.Adam(net.parameters(), 1e-3)
xs = torch.rand(2, 4, 32, 32, 32, generator=g); ys = (torch.rand(2, 3, 32, 32, 32, generator=g) > 0.7).float()
t0 = time.perf_counter()
for _ in range(6):
    opt3.zero_grad(); loss = torch.nn.functional.binary_cross_entropy_with_logits(net(xs), ys); loss.backward(); opt3.step()
t3d = time.perf_counter() - t0
h = hashlib.sha256()
for mod in (m, net):
    for p in mod.parameters():
        h.update(p.detach().numpy().tobytes())
print(json.dumps({"t2d": t2d, "t3d": t3d, "hash": h.hexdigest()}))
"""


def run(threshold: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    if threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = threshold
    out = subprocess.run([sys.executable, "-c", WORK, str(ROOT)], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    import statistics

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--thresholds", nargs="+", default=["131072", "1048576"])
    a = ap.parse_args(argv)
    arms = [None, *a.thresholds]
    res = {arm: [] for arm in arms}
    t0 = time.time()
    for i in range(a.pairs):
        for arm in arms:
            res[arm].append(run(arm))
        print(f"round {i + 1}/{a.pairs} done, {time.time() - t0:.0f} s", flush=True)
    hashes = {r["hash"] for rs in res.values() for r in rs}
    if len(hashes) != 1:
        print(f"DIFFERENT RESULTS across arms: {len(hashes)} distinct weight hashes")
        return 1
    print("same weights in every run and arm")
    base = {k: statistics.median(r[k] for r in res[None]) for k in ("t2d", "t3d")}
    print("| MALLOC_MMAP_THRESHOLD_ | 2D recipe, 3 epochs (s) | ratio | 3D U-Net, 6 steps (s) | ratio |")
    print("|---|---|---|---|---|")
    for arm in arms:
        med = {k: statistics.median(r[k] for r in res[arm]) for k in ("t2d", "t3d")}
        print(f"| {arm or 'glibc default (dynamic)'} | {med['t2d']:.2f} | ×{med['t2d'] / base['t2d']:.3f} | "
              f"{med['t3d']:.2f} | ×{med['t3d'] / base['t3d']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
