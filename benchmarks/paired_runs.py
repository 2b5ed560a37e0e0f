"""One experiment's method against another's, paired by seed, at the round each run reports (docs/results.md quotes
it next to a validation choice, after that choice):

    python benchmarks/paired_runs.py RUN_DIR REF_DIR [--method M] [--ref-method M] [--metric pooled_auc] \\
        [--selection validation_auc]

Both folders are ``fedmed experiment`` outputs (their ``results.csv``). Each run is read at the round
:func:`fedmed.report.summary.reported_rows` reports under ``--selection`` (validation or final: test data never
selects); the table gives each seed's value of ``--metric`` in both, the difference, and its mean ± std over the seeds
both have, "beyond" where |mean| > std (the project's "beyond the spread").
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np


def reported(out: Path, method: str | None, selection: str) -> tuple[str, dict]:
    """(the method, ``{seed: row}``) of ``out``'s results at the reported round; ``method`` may be left out when the
    folder holds one method. A reference row (``Each source alone``, ``Centralized``, ...) is read when named, at the
    round the report selects for it by the same rule."""
    from fedmed.report.summary import read_results, reported_rows

    rows = [r for r in read_results(out / "results.csv") if r.get("kind") in ("method", "reference")]
    chosen = reported_rows(rows, selection)
    methods = sorted({r["method"] for r in rows if r.get("kind") == "method"})
    named = sorted({m for m, _ in chosen})
    if method is None:
        if len(methods) != 1:
            raise SystemExit(f"{out.name}: holds {len(methods)} methods ({', '.join(methods)}); name one with --method")
        method = methods[0]
    elif method not in named:
        raise SystemExit(f"{out.name}: no method {method!r} (it has {', '.join(named)})")
    return method, {s: r for (m, s), r in chosen.items() if m == method}


def paired(a: dict, b: dict, metric: str) -> list[tuple[int, float, float]]:
    """``(seed, a's value, b's value)`` for the seeds where both runs have ``metric``."""
    return [(s, a[s][metric], b[s][metric]) for s in sorted(set(a) & set(b))
            if a[s].get(metric) is not None and b[s].get(metric) is not None]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run")
    ap.add_argument("ref")
    ap.add_argument("--method", default=None, help="the method of RUN (default: its only one)")
    ap.add_argument("--ref-method", default=None, help="the method of REF (default: its only one)")
    ap.add_argument("--metric", default="pooled_auc", help="a results.csv column (default pooled_auc, the test one)")
    ap.add_argument("--selection", choices=("final", "validation", "validation_auc"), default="validation_auc")
    a = ap.parse_args(argv)
    ma, ra = reported(Path(a.run), a.method, a.selection)
    mb, rb = reported(Path(a.ref), a.ref_method, a.selection)
    pairs = paired(ra, rb, a.metric)
    if not pairs:
        raise SystemExit(f"no seed has {a.metric} in both runs")
    print(f"{ma} ({a.run}) minus {mb} ({a.ref}), {a.metric} at each run's {a.selection} round, in points\n")
    print("| seed | round | value | ref round | ref value | difference |")
    print("|---|---|---|---|---|---|")
    for s, x, y in pairs:
        print(f"| {s} | {ra[s]['round']} | {100 * x:.2f} | {rb[s]['round']} | {100 * y:.2f} | {100 * (x - y):+.2f} |")
    d = np.array([100 * (x - y) for _, x, y in pairs])
    print(f"\npaired: {d.mean():+.2f} ± {d.std():.2f} over {len(d)} seed(s): "
          f"{'beyond' if len(d) > 1 and abs(d.mean()) > d.std() else 'within'} the spread")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
