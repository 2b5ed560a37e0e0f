"""How often adaptive DBSCAN recovers planted client groups exactly, per eps rule.

Prints, for each group-size configuration, the number of seeds (of 20) with ARI = 1 for the
paper's literal eps (knee of the nearest-neighbour curve, ``level_factor=1``) and for fedmed's
default (``level_factor=2``). Descriptors: group centres ~ N(0, 3^2 I) in R^20, sites within a
group ~ centre + N(0, 0.05^2 I).

    .venv/bin/python benchmarks/bench_dbscan_eps.py
"""

import numpy as np
from sklearn.metrics import adjusted_rand_score

from fedmed.algorithms.clustering import adaptive_dbscan

CONFIGS = [(5, 5), (4, 3, 3), (3, 3, 2, 2), (2, 2, 2, 2, 2), (4, 5, 6), (10, 10), (25, 25, 25, 25),
           (5, 5, 1), (6, 6, 1, 1), (20,), (3, 2)]


def main(seeds: int = 20):
    print(f"{'groups':<22}{'literal (x1)':>14}{'fedmed (x2)':>14}")
    for sizes in CONFIGS:
        hits = {1.0: 0, 2.0: 0}
        for seed in range(seeds):
            rng = np.random.default_rng(seed)
            centres = rng.normal(size=(len(sizes), 20)) * 3
            X = np.vstack([c + 0.05 * rng.normal(size=(n, 20)) for c, n in zip(centres, sizes)])
            truth = np.repeat(np.arange(len(sizes)), sizes)
            for f in hits:
                hits[f] += adjusted_rand_score(truth, adaptive_dbscan(X, level_factor=f)["labels"]) == 1.0
        print(f"{str(sizes):<22}{hits[1.0]:>11}/{seeds}{hits[2.0]:>11}/{seeds}")


if __name__ == "__main__":
    main()
