"""How often the serving plan's two tests serve a planted candidate (issue #57; docs/readings.md "Serving plan").

    python benchmarks/serving_rates.py [--trials 4000]

The planted classifiers are ``tests/test_serving.py``'s (``_prob_trial``, the same seeds as its tests: 570 for the
candidates no better than the global model, 571 for the better one): per case, the share of trials in which
:func:`fedmed.algorithms.serving.choose` serves a candidate under the score test and under the sign test, on the same
trials. No dataset is read.

The last rows (#86, docs/readings.md "the unit of evidence") plant a candidate exactly as good as the global model,
each model's errors mostly shared by the slices of one patient (its log-odds noise drawn per patient, N(0, 1), plus
N(0, 0.3) per slice) on 60 validation slices of 6 or 12 patients: how often the score test serves it when the slices count as independent items, and when each
patient is one unit (``paired_counts(..., units=...)``).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

NULL_CASES = [("equal", 20, 1), ("equal", 60, 1), ("equal", 60, 5), ("noisy", 20, 5), ("sharp", 20, 1)]
BETTER_ITEMS = (20, 60, 100)
PATIENT_CASES = (6, 12)  # patients of 60 validation slices


def _trials_module():
    spec = importlib.util.spec_from_file_location("serving_trials", ROOT / "tests" / "test_serving.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def rates(kind: str, n_items: int, n_candidates: int, trials: int, seed: int, **kw) -> dict:
    from fedmed.algorithms.serving import choose

    make = _trials_module()._prob_trial
    rng = np.random.default_rng(seed)
    served = {"score": 0, "sign": 0}
    for _ in range(trials):
        c = make(rng, n_items, n_candidates, kind, **kw)
        for test in served:
            served[test] += choose(c, test=test).served != "global"
    return {k: v / trials for k, v in served.items()}


def _sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def patient_rates(n_patients: int, n_items: int, trials: int, seed: int) -> dict:
    """The share of trials in which a no-better candidate with per-patient errors is served, by slice and by
    patient (see the module notes)."""
    from fedmed.algorithms.serving import choose, paired_counts

    rng = np.random.default_rng(seed)
    units = np.repeat(np.arange(n_patients), n_items // n_patients)
    served = {"slice": 0, "patient": 0}
    for _ in range(trials):
        z = rng.normal(-0.6, 2.0, n_patients)[units] + rng.normal(0.0, 0.5, units.size)
        y = (rng.random(units.size) < _sigmoid(z)).astype(int)
        ref, cand = (_sigmoid(z + rng.normal(0.0, 1.0, n_patients)[units] + rng.normal(0.0, 0.3, units.size))
                     for _ in range(2))  # each model's errors mostly shared by a patient's slices
        brier = [-2 * (p - y) ** 2 for p in (ref, cand)]  # two classes: -sum_k (p_k - y_k)^2
        right = [((p > 0.5) == y).astype(float) for p in (ref, cand)]
        for by, u in (("slice", None), ("patient", units)):
            c = paired_counts(right[0], right[1], reference_proper=brier[0], candidate_proper=brier[1], units=u)
            served[by] += choose({"c": c}).served != "global"
    return {k: v / trials for k, v in served.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=4000, help="trials per no-better case (a quarter for the better one)")
    a = ap.parse_args(argv)
    print(f"Produced by: `python benchmarks/serving_rates.py --trials {a.trials}`\n")
    print("| candidate | items | candidates | score test | sign test |\n|---|---|---|---|---|")
    for kind, n, m in NULL_CASES:
        r = rates(kind, n, m, a.trials, 570)
        print(f"| {kind} | {n} | {m} | {100 * r['score']:.2f}% | {100 * r['sign']:.2f}% |")
    for n in BETTER_ITEMS:
        r = rates("better", n, 1, max(1, a.trials // 4), 571, noise=1.5, candidate_noise=0.75)
        print(f"| better | {n} | 1 | {100 * r['score']:.1f}% | {100 * r['sign']:.1f}% |")
    print("\n| candidate (exactly as good; errors shared by a patient's slices) | slices | patients | by slice | "
          "by patient |\n|---|---|---|---|---|")
    for n_patients in PATIENT_CASES:
        r = patient_rates(n_patients, 60, a.trials, 572)
        print(f"| its errors per patient | 60 | {n_patients} | {100 * r['slice']:.2f}% | {100 * r['patient']:.2f}% |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
