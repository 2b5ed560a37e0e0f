"""Server math at scale (issue #10/#13): FMCL distances, auto-K, one 004_ EMD matrix, Flux clustering.

    .venv/bin/python benchmarks/bench_server_math.py [--sizes 1000 3000 10000] [--pairs 5]

1. Same result, then interleaved timing (A B A B ..., ``benchmarks/_common.py``) of fedmed's implementation against
   the straightforward one at N = 400: the EMD loop of ``scipy.stats.wasserstein_distance`` per pair vs the
   all-pairs CDF form; FMCL's literal loop vs the blocked matrix products; scikit-learn's silhouette per K vs
   one product per K.
2. Scaling: wall time and peak extra memory (``tracemalloc``, which numpy reports its arrays to) of each step at
   every N, and the scaling exponent from the smallest to the largest N. Settings: FMCL with 3 classes of 192-d
   prototypes per site under Dirichlet(0.5) (BUSI-like; ViT-Tiny features), auto-K on that matrix, the EMD of
   150-bin histograms, Flux's clustering (adaptive DBSCAN and its K = 1 silhouette test) on 60-float descriptors (2 classes).
"""

from __future__ import annotations

import argparse
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import compare, scaling_exponent  # noqa: E402


def federation(n, C=3, d=192, seed=0):
    from fedmed.algorithms.fmcl import ClassSignature

    rng = np.random.default_rng(seed)
    protos = rng.normal(size=(C, d))
    sigs = []
    for _ in range(n):
        counts = rng.multinomial(40, rng.dirichlet(np.full(C, 0.5)))
        cls = np.flatnonzero(counts >= 5)
        if cls.size == 0:
            cls = np.array([int(np.argmax(counts))])
        sigs.append(ClassSignature(cls, protos[cls] + 0.3 * rng.normal(size=(cls.size, d)),
                                   np.maximum(counts[cls], 1).astype(float)))
    return sigs


def histograms(n, bins=150, seed=0):
    rng = np.random.default_rng(seed)
    edges = np.linspace(0, 300_000, bins + 1)
    H = np.stack([np.histogram(rng.gamma(2, rng.uniform(10_000, 60_000), size=30), bins=edges)[0] for _ in range(n)])
    return H.astype(float), edges


def measure(fn):
    tracemalloc.start()
    t = time.perf_counter()
    out = fn()
    sec = time.perf_counter() - t
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return out, sec, peak / 2**30


def main(argv=None):
    from sklearn.metrics import silhouette_score
    from scipy.stats import wasserstein_distance

    from fedmed.algorithms.clustered import flux_cluster
    from fedmed.algorithms.clustering import agglomerative, auto_k, silhouette
    from fedmed.algorithms.fmcl import fmcl_distance_matrix, fmcl_distance_matrix_loop
    from fedmed.algorithms.heterogeneity import emd_matrix

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 3000, 10000])
    ap.add_argument("--pairs", type=int, default=5)
    a = ap.parse_args(argv)

    print("== same result, interleaved timing at N = 400 ==")
    H, edges = histograms(400)
    centres = (edges[:-1] + edges[1:]) / 2
    loop_emd = lambda: np.array([[wasserstein_distance(centres, centres, x, y) if x is not y else 0.0  # noqa: E731
                                  for y in H] for x in H])
    compare("004_ EMD matrix (N=400)", loop_emd, lambda: emd_matrix(list(H), edges=edges), label_a="scipy loop",
            label_b="all-pairs CDF form", pairs=min(a.pairs, 3), same=lambda x, y: np.allclose(x, y, rtol=1e-10, atol=1e-8))
    sigs = federation(400)
    compare("FMCL distances (N=400)", lambda: fmcl_distance_matrix_loop(sigs), lambda: fmcl_distance_matrix(sigs),
            label_a="literal loop", label_b="blocked products", pairs=min(a.pairs, 3),
            same=lambda x, y: np.allclose(x, y, rtol=1e-10, atol=1e-12))
    D = fmcl_distance_matrix(sigs)
    labels = {k: agglomerative(D, n_clusters=k) for k in range(2, 11)}
    compare("silhouettes K=2..10 (N=400)", lambda: [silhouette_score(D, labels[k], metric="precomputed") for k in labels],
            lambda: [silhouette(D, labels[k]) for k in labels], label_a="scikit-learn", label_b="one product per K",
            pairs=a.pairs, same=lambda x, y: np.allclose(x, y, atol=1e-12))

    print("\n== scaling ==")
    print("| N | FMCL distances s | FMCL peak extra GiB | auto-K s | K | EMD matrix s | Flux clustering s |")
    print("|---|---|---|---|---|---|---|")
    times: dict = {"fmcl": [], "autok": [], "emd": [], "flux": []}
    warm = np.random.default_rng(2).normal(size=(30, 60))  # first-call imports (scikit-learn) out of the timings
    flux_cluster({f"w{i}": {"full": warm[i], "label_free": warm[i, :20]} for i in range(30)})
    auto_k(fmcl_distance_matrix(federation(30)))
    for n in a.sizes:
        sigs = federation(n)
        D, t_f, mem = measure(lambda: fmcl_distance_matrix(sigs))
        res, t_k, _ = measure(lambda: auto_k(D))
        del D
        H, edges = histograms(n)
        _, t_e, _ = measure(lambda: emd_matrix(list(H), edges=edges))
        X = np.random.default_rng(1).normal(size=(n, 60)) + np.repeat(np.eye(3, 60) * 8, -(-n // 3), axis=0)[:n]
        descs = {f"s{i:05d}": {"full": X[i], "label_free": X[i, :20]} for i in range(n)}
        _, t_d, _ = measure(lambda: flux_cluster(descs))
        for key, t in zip(times, (t_f, t_k, t_e, t_d)):
            times[key].append(t)
        print(f"| {n:,} | {t_f:.2f} | {mem:.2f} | {t_k:.2f} | {res.k} | {t_e:.2f} | {t_d:.2f} |", flush=True)
    if len(a.sizes) > 1:
        print("scaling exponents (log time vs log N, "
              f"{a.sizes[0]:,} to {a.sizes[-1]:,}): " + ", ".join(
                  f"{k} {scaling_exponent(a.sizes, v):.2f}" for k, v in times.items()))


if __name__ == "__main__":
    main()
