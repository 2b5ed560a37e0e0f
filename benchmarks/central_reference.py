"""The centralized reference of a ``fedmed experiment`` at another epoch budget, on the experiment's own splits
(issue #53).

    .venv/bin/python benchmarks/central_reference.py results/transfer_factors_head/recipe+epochs_4 --seeds 0 1 2 \\
        --set model.init_weights=$W --set train.local_epochs=4

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
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]


def seed_rows(run: Path, seed: int, config: Path, sets: list[str]) -> list[dict]:
    from fedmed.config import load_config
    from fedmed.run.references import centralized_rows

    exp = load_config(config, [*sets, "references=[centralized]"])
    out = run / "central_reference" / f"{exp.train.rounds}x{exp.train.local_epochs}" / f"seed{seed}.json"
    if out.exists():
        return json.loads(out.read_text())
    data = run / "data" / f"seed{seed}"
    meta = json.loads((data / "dataset.json").read_text())
    exp = exp.model_copy(update={"dataset": exp.dataset.model_copy(update={"classes": meta["class_names"]})})
    rows = centralized_rows(exp, data, meta["sites"], seed)  # as fedmed.run.experiment._references calls it
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, default=float))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run", type=Path, help="a finished fedmed experiment folder (its data/seed<N> splits are used)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--config", type=Path, default=ROOT / "app_configs" / "breast_us_lite0.yaml")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="a config override, as fedmed experiment")
    ap.add_argument("--selection", choices=("validation", "validation_auc", "final"), default="validation",
                    help="the epoch reported: by one of the report's validation rules, or the last")
    a = ap.parse_args(argv)
    from fedmed.report.summary import fmt, reported_rows

    picked = []
    for s in a.seeds:
        rows = seed_rows(a.run, s, a.config, a.sets)
        picked += reported_rows(rows, a.selection).values()
        print(f"seed {s}: {len(rows) - 1} evaluations, selected {picked[-1]['round']}", flush=True)
    cols = [("pooled_val_auc", "val AUC (pooled)"), ("val_accuracy", "val acc (site mean)"),
            ("accuracy", "test acc (site mean)"), ("pooled_auc", "test pooled AUC")]
    print(f"\nCentralized reference, `benchmarks/central_reference.py {a.run} --seeds {' '.join(map(str, a.seeds))}"
          + "".join(f" --set {s}" for s in a.sets) + f" --selection {a.selection}`\n")
    print("| selected evaluation (per seed) | " + " | ".join(c[1] for c in cols) + " |")
    print("|---|" + "---|" * len(cols))
    print(f"| {', '.join(str(r['round']) for r in picked)} | " + " | ".join(fmt([r.get(k) for r in picked])
                                                                          for k, _ in cols) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
