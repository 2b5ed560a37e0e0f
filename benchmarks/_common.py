"""Shared helper of fedmed's benchmarks: compare two sides interleaved, honestly.

:func:`compare` first runs each side once and checks that both give the same result (``same(a, b)``), then
times ``pairs`` interleaved pairs (A B A B ...), so a change of machine load hits both sides alike. For every
run it measures wall time and CPU time of the process *and its children* (``resource.getrusage``), and prints
the median and range of the per-pair ratio B / A for both.
"""

from __future__ import annotations

import resource
import statistics
import time
from typing import Callable


def _cpu() -> float:
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def timed(fn: Callable):
    w0, c0 = time.perf_counter(), _cpu()
    out = fn()
    return out, time.perf_counter() - w0, _cpu() - c0


def compare(name: str, a: Callable, b: Callable, *, label_a: str = "A", label_b: str = "B", pairs: int = 5,
            same: Callable | None = None, check: bool = True) -> dict:
    """Time ``a`` and ``b`` in ``pairs`` interleaved pairs; returns medians, ranges and the ratio B / A."""
    if check and same is not None:
        ra, rb = a(), b()
        if not same(ra, rb):
            raise AssertionError(f"{name}: {label_a} and {label_b} give different results; not timing them")
        print(f"[{name}] {label_a} and {label_b} give the same result", flush=True)
    rows = []
    for k in range(pairs):
        _, wa, ca = timed(a)
        _, wb, cb = timed(b)
        rows.append((wa, ca, wb, cb))
        print(f"[{name}] pair {k + 1}/{pairs}: {label_a} {wa:.3f} s wall / {ca:.3f} s CPU, "
              f"{label_b} {wb:.3f} s wall / {cb:.3f} s CPU", flush=True)
    wr = [wb / wa for wa, _, wb, _ in rows]
    cr = [cb / ca if ca > 0 else float("nan") for _, ca, _, cb in rows]
    out = {"name": name, "pairs": pairs,
           "a_wall": statistics.median(r[0] for r in rows), "a_cpu": statistics.median(r[1] for r in rows),
           "b_wall": statistics.median(r[2] for r in rows), "b_cpu": statistics.median(r[3] for r in rows),
           "wall_ratio": statistics.median(wr), "wall_ratio_range": (min(wr), max(wr)),
           "cpu_ratio": statistics.median(cr), "cpu_ratio_range": (min(cr), max(cr))}
    print(f"[{name}] {label_b} / {label_a}: wall x{out['wall_ratio']:.2f} (range {min(wr):.2f}-{max(wr):.2f}), "
          f"CPU x{out['cpu_ratio']:.2f} (range {min(cr):.2f}-{max(cr):.2f}); medians {label_a} "
          f"{out['a_wall']:.3f} s / {out['a_cpu']:.3f} s CPU, {label_b} {out['b_wall']:.3f} s / {out['b_cpu']:.3f} s CPU",
          flush=True)
    return out


def scaling_exponent(ns, seconds) -> float:
    """Least-squares slope of log(time) against log(N)."""
    import numpy as np

    return float(np.polyfit(np.log(ns), np.log(seconds), 1)[0])
