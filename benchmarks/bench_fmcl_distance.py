"""FMCL distance matrix (Algorithm 3): vectorised vs a straightforward loop over pairs and classes.

Sites hold C = 36 classes' prototypes of dimension d = 768 under Dirichlet(0.5) class skew
(each site keeps the classes with at least 1% of its samples). Prints wall times, their ratio
and the largest absolute difference between the two matrices, in one run.

    .venv/bin/python benchmarks/bench_fmcl_distance.py            # N = 100 and 1,000
    .venv/bin/python benchmarks/bench_fmcl_distance.py --loop-max 300   # cap the slow loop
"""

import argparse
import time

import numpy as np

from fedmed.fmcl import ClassSignature, fmcl_distance_matrix, fmcl_distance_matrix_loop


def federation(n, C=36, d=768, seed=0):
    rng = np.random.default_rng(seed)
    protos = rng.normal(size=(C, d))
    sigs = []
    for _ in range(n):
        mix = rng.dirichlet(np.full(C, 0.5))
        counts = rng.multinomial(500, mix)
        cls = np.flatnonzero(counts >= 5)
        if cls.size == 0:
            cls = np.array([int(np.argmax(counts))])
        means = protos[cls] + 0.2 * rng.normal(size=(cls.size, d))
        sigs.append(ClassSignature(cls, means, np.maximum(counts[cls], 1).astype(float)))
    return sigs


def timed(fn, *args):
    t = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[100, 1000])
    ap.add_argument("--loop-max", type=int, default=1000, help="largest N for which the loop runs")
    a = ap.parse_args()
    print(f"{'N':>6} {'classes/site':>13} {'vectorised s':>13} {'loop s':>10} {'ratio':>8} {'max |diff|':>11}")
    for n in a.sizes:
        sigs = federation(n)
        fast, tf = timed(fmcl_distance_matrix, sigs)
        per_site = np.mean([s.classes.size for s in sigs])
        if n <= a.loop_max:
            slow, ts = timed(fmcl_distance_matrix_loop, sigs)
            diff = float(np.abs(fast - slow).max())
            print(f"{n:>6} {per_site:>13.1f} {tf:>13.3f} {ts:>10.2f} {ts / tf:>7.1f}x {diff:>11.2e}")
        else:
            print(f"{n:>6} {per_site:>13.1f} {tf:>13.3f} {'-':>10} {'-':>8} {'-':>11}")


if __name__ == "__main__":
    main()
