"""A CPU site's training round at two commits of fedmed, interleaved in fresh processes (issue #54: "on the CPU the
site round no slower than today's").

Each side is a checkout of the repository (``git worktree add /tmp/old <commit>``); a side's process imports fedmed
from its checkout, builds one BUSI site (640 images, 32 px, ResNet-9, Adam, flips and crops, batch 16), warms up one
round and times ``--rounds`` rounds of ``SiteRunner.handle("train")``. The order alternates A B B A ... (the second
process of a pair ran slower on this machine whichever side it was), both sides must end with the same weights, and
the ratio B / A per pair and its median are printed.

    .venv/bin/python benchmarks/ab_site_round.py /tmp/old . --pairs 6
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r'''
import statistics, sys, tempfile, time
from pathlib import Path
import numpy as np, torch
from fedmed.data.images import discover
from fedmed.data.datalists import write_site_datalists
from fedmed.nn.models import model_from_config
from fedmed.nn.train import get_params
from fedmed.site.runner import SiteRunner
torch.set_num_threads(2)
data, rounds = sys.argv[1], int(sys.argv[2])
tmp = Path(tempfile.mkdtemp())
pool = discover(data, seed=0)
idx = np.random.default_rng(0).permutation(len(pool.labels))[:640]
write_site_datalists(pool.subset(np.sort(idx)), [np.arange(len(idx))], tmp, test_fraction=0.2, val_fraction=0.1, seed=0)
cfg = {"seed": 0, "data": {"image_size": 32, "channels": 1, "n_classes": pool.n_classes}, "model": {"arch": "resnet9"},
       "privacy": {"k_min": 1}, "train": {"local_epochs": 1, "batch_size": 16, "optimizer": "adam", "lr": 1e-3,
                                          "augment": "flip_crop"}}
r = SiteRunner("site-1", tmp)
theta = get_params(model_from_config(cfg["model"], 1, pool.n_classes, seed=0))
r.handle("train", theta, cfg, 0)
ts = []
for k in range(rounds):
    t0 = time.perf_counter()
    out = r.handle("train", theta, cfg, k).params
    ts.append(time.perf_counter() - t0)
print("RESULT", statistics.median(ts), repr(float(sum(np.abs(v).sum() for v in out.values() if v.dtype.kind == "f"))))
'''


def side(root: Path, data: str, rounds: int) -> tuple[float, str]:
    env = {**os.environ, "PYTHONPATH": str(root.resolve())}
    res = subprocess.run([sys.executable, "-c", CHILD, data, str(rounds)], env=env, capture_output=True, text=True,
                         cwd=str(root))
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT")]
    if res.returncode or not line:
        raise SystemExit(f"{root}: {res.stderr[-2000:]}")
    _, t, check = line[-1].split(" ", 2)
    return float(t), check


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", type=Path, help="checkout A (e.g. the commit before)")
    ap.add_argument("b", type=Path, help="checkout B (e.g. this one)")
    ap.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "shared" / "data" / "busi"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pairs", type=int, default=6)
    a = ap.parse_args(argv)
    ratios = []
    for k in range(a.pairs):
        order = [("A", a.a), ("B", a.b)] if k % 2 == 0 else [("B", a.b), ("A", a.a)]
        got = {name: side(root, a.data, a.rounds) for name, root in order}
        if got["A"][1] != got["B"][1]:
            raise SystemExit(f"pair {k + 1}: the two sides end with different weights ({got['A'][1]} vs {got['B'][1]})")
        ratios.append(got["B"][0] / got["A"][0])
        print(f"pair {k + 1} ({order[0][0]} first): A {got['A'][0]:.3f} s/round, B {got['B'][0]:.3f} s/round, "
              f"B / A x{ratios[-1]:.3f} (the same weights)", flush=True)
    print(f"site round B / A: median x{statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f}) "
          f"over {a.pairs} pairs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
