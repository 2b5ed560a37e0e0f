"""The centralized reference of a ``fedmed experiment`` at another epoch budget, on the experiment's own splits
(issue #53).

    .venv/bin/python benchmarks/central_reference.py results/transfer_factors_head/recipe+epochs_4 --seeds 0 1 2 \\
        --set model.init_weights=imagenet --set train.local_epochs=4

``references=[centralized]`` trains one model on the pooled training images of every site for ``rounds x
local_epochs`` epochs and scores it after every ``local_epochs`` epochs (:func:`fedmed.run.references.centralized_rows`,
the rows an experiment makes). A federated run with more local epochs a round is then compared with a reference of the
same budget: this script makes that reference alone, for a finished experiment's ``data/seed<N>`` splits, without
training its federated methods again. The config is ``app_configs/breast_us_lite0.yaml`` (``--config`` for another)
with ``--set`` overrides as ``fedmed experiment`` takes them. Each seed's rows go to
``<run>/central_reference/<rounds>x<local_epochs>/seed<N>.json`` (reused when present); the table prints the
validation-selected epoch (the best site-mean validation accuracy, as the report selects a round; ``--selection
validation_auc``: the best pooled validation AUC; ``--selection final``: the last epoch) and the test numbers there,
mean ± std over the seeds.

``--alone`` makes the other reference of a natural federation the same way: each source alone (one model per source on
its sites' pooled training images, :func:`fedmed.run.references.alone_rows`, every site scored with its source's
model; each site alone where the splits have no sources), under ``<run>/alone_reference/<R>x<E>/``, and prints it per
source too, as ``benchmarks/natural_per_source.py`` prints a method (issue #57's reference rows).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _log(line: str) -> None:
    """Progress lines as they come, also when the output goes to a file (print alone buffers it to the end)."""
    print(line, flush=True)


ROOT = Path(__file__).resolve().parents[1]


def seed_rows(run: Path, seed: int, config: Path, sets: list[str], alone: bool = False) -> list[dict]:
    """The reference's rows of one seed (one per evaluation), trained on ``run``'s splits or read back. ``alone``:
    each source alone (a natural federation; each site alone elsewhere) instead of the centralized model."""
    from fedmed.config import load_config
    from fedmed.run.references import alone_rows, centralized_rows

    exp = load_config(config, [*sets, f"references=[{'alone' if alone else 'centralized'}]"])
    folder = "alone_reference" if alone else "central_reference"
    out = run / folder / f"{exp.train.rounds}x{exp.train.local_epochs}" / f"seed{seed}.json"
    if out.exists():
        return json.loads(out.read_text())
    data = run / "data" / f"seed{seed}"
    meta = json.loads((data / "dataset.json").read_text())
    exp = exp.model_copy(update={"dataset": exp.dataset.model_copy(update={"classes": meta["class_names"]})})
    if alone:  # as fedmed.run.experiment._reference_rows calls it
        sources = meta.get("groups") if meta.get("partition") == "natural" else None
        rows = alone_rows(exp, data, meta["sites"], seed, sources, log=_log)
    else:
        rows = centralized_rows(exp, data, meta["sites"], seed, log=_log)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, default=float))
    return rows


def _shown(p: Path) -> str:
    """A path as a command line from the clone names it (relative to the clone where it lies inside)."""
    try:
        return str(p.resolve().relative_to(ROOT))
    except ValueError:
        return str(p)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run", type=Path, help="a finished fedmed experiment folder (its data/seed<N> splits are used)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--config", type=Path, default=ROOT / "app_configs" / "breast_us_lite0.yaml")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="a config override, as fedmed experiment")
    ap.add_argument("--selection", choices=("validation", "validation_auc", "final"), default="validation",
                    help="the epoch reported: by one of the report's validation rules, or the last")
    ap.add_argument("--alone", action="store_true",
                    help="each source alone (each site alone outside a natural federation) instead of the centralized "
                         "model, with the same budget; a natural federation's rows are then also printed per source")
    a = ap.parse_args(argv)
    from fedmed.report.summary import fmt, reported_rows

    picked, seeds = [], []
    for s in a.seeds:
        rows = seed_rows(a.run, s, a.config, a.sets, alone=a.alone)
        picked += reported_rows(rows, a.selection).values()
        seeds.append(s)
        print(f"seed {s}: {len(rows) - 1} evaluations, selected {picked[-1]['round']}", flush=True)
    cols = [("pooled_val_auc", "val AUC (pooled)"), ("val_accuracy", "val acc (site mean)"),
            ("accuracy", "test acc (site mean)"), ("pooled_auc", "test pooled AUC")]
    name = picked[0]["method"] if a.alone else "Centralized reference"
    default = ap.get_default("config")
    conf = "" if a.config.resolve() == default.resolve() else f" --config {_shown(a.config)}"
    cmd = (f".venv/bin/python benchmarks/central_reference.py {a.run}{conf} --seeds {' '.join(map(str, a.seeds))}"
           + "".join(f" --set {s}" for s in a.sets) + f" --selection {a.selection}" + (" --alone" if a.alone else ""))
    print(f"\n{name}, `{cmd}`\n")
    print("| selected evaluation (per seed) | " + " | ".join(c[1] for c in cols) + " |")
    print("|---|" + "---|" * len(cols))
    print(f"| {', '.join(str(r['round']) for r in picked)} | " + " | ".join(fmt([r.get(k) for r in picked])
                                                                          for k, _ in cols) + " |")
    if a.alone:
        per_source(a.run, seeds, picked)
    return 0


def per_source(run: Path, seeds: list[int], picked: list[dict]) -> None:
    """The selected rows per source, as ``benchmarks/natural_per_source.py`` reads a method's (balanced accuracy from
    the source's pooled test confusion matrices, the mean AUC of its sites; %, mean ± std over seeds); nothing where
    the splits have no sources."""
    import sys

    import numpy as np

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from natural_per_source import source_metrics

    cells: dict = {}
    for seed, row in zip(seeds, picked):
        groups = json.loads((run / "data" / f"seed{seed}" / "dataset.json").read_text()).get("groups") or {}
        for src, got in source_metrics(row.get("sites") or {}, groups).items():
            c = cells.setdefault(src, {"bacc": [], "auc": []})
            for k, v in got.items():
                c[k].append(v)
    if not cells:
        return

    def cell(v):
        return f"{100 * np.mean(v):.1f} ± {100 * np.std(v):.1f}" if v else "n/a"

    print("\n| per source | " + " | ".join(f"{s}: bal. acc | {s}: AUC" for s in cells) + " |")
    print("|---|" + "---|---|" * len(cells))
    print(f"| {picked[0]['method']} | " + " | ".join(f"{cell(c['bacc'])} | {cell(c['auc'])}" for c in cells.values())
          + " |")


if __name__ == "__main__":
    raise SystemExit(main())
