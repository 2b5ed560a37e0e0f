"""Choose the 2D training recipe on validation data (issue #9/#12): FedAvg on an IID federation of BUSI.

    .venv/bin/python benchmarks/tune_recipe.py [--data ../shared/data/busi] [--sites 20] [--rounds 20] [--seeds 0]

For every recipe in the grid, FedAvg runs as an in-process loop over the same SiteRunner calls as the NVFlare
workflow (``fedmed.workflows.fedavg_in_process``) and the table ranks recipes by the final round's site-mean accuracy on the sites'
*validation* splits (held out of their training data). Test metrics are not computed for the ranking: they are
printed only for the chosen recipe, after the choice. The chosen recipe is what ``TrainConfig`` / ``ModelConfig``
default to (docs/readings.md, "2D recipe").
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GRID = {
    "norm": ["batch", "group"],
    "optimizer": ["sgd", "adam"],
    "local_epochs": [1, 3],
    "augment": ["flip", "flip_crop"],
}
LR = {"sgd": 0.05, "adam": 1e-3}


def main(argv=None):
    import numpy as np
    import torch

    from fedmed.config import load_config
    from fedmed.run.experiment import prepare_federation
    from fedmed.workflows import fedavg_in_process

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "busi"))
    ap.add_argument("--sites", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--only", nargs="*", default=[], help="key=value filters on the grid, e.g. norm=group")
    ap.add_argument("--grid", help='JSON replacing the grid, e.g. \'{"norm": ["batch"], "local_epochs": [3, 5]}\'')
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    grid = {**GRID, **(json.loads(a.grid) if a.grid else {})}
    results = []
    tmp = Path(tempfile.mkdtemp(prefix="tune_"))
    for seed in a.seeds:
        raw = {"name": "tune", "dataset": {"path": a.data, "image_size": a.image_size, "channels": 1},
               "federation": {"sites": a.sites, "partition": "iid", "test_fraction": 0.2, "val_fraction": 0.15},
               "privacy": {"k_min": 1, "accept_k_min_below_2": True}, "seeds": [seed]}
        exp = load_config(raw)
        data = prepare_federation(exp, seed, tmp / f"seed{seed}")
        meta = json.loads((data / "dataset.json").read_text())
        for combo in itertools.product(*grid.values()):
            rec = dict(zip(grid, combo))
            if any(str(rec.get(k)) != v for k, v in (f.split("=") for f in a.only)):
                continue
            cfg = {"seed": seed, "model": {"arch": "resnet9", "width": 16, "norm": rec["norm"]},
                   "data": {"image_size": a.image_size, "channels": 1, "n_classes": len(meta["class_names"])},
                   "train": {"local_epochs": rec["local_epochs"], "batch_size": 16, "optimizer": rec["optimizer"],
                             "lr": LR[rec["optimizer"]], "momentum": 0.9, "weight_decay": 5e-4,
                             "augment": rec["augment"], "keep_optimizer_state": True},
                   "privacy": {"k_min": 1}}
            t0 = time.time()
            _, summ = fedavg_in_process(cfg, data, meta["sites"], rounds=a.rounds)
            val = [s["mean"].get("val_accuracy", np.nan) for s in summ]
            pooled_val = [s.get("pooled_val", {}).get("accuracy", np.nan) for s in summ]
            results.append({**rec, "seed": seed, "val_final": val[-1], "pooled_val_final": pooled_val[-1],
                            "val_best": float(np.nanmax(val)), "seconds": time.time() - t0,
                            "test_final": summ[-1]["mean"].get("accuracy")})
            r = results[-1]
            print(f"{rec} seed {seed}: val final {100 * r['val_final']:.1f}% (pooled {100 * r['pooled_val_final']:.1f}%)"
                  f", best {100 * r['val_best']:.1f}%, {r['seconds']:.0f} s", flush=True)
    keys = list(grid)
    groups: dict = {}
    for r in results:
        groups.setdefault(tuple(r[k] for k in keys), []).append(r)
    ranked = sorted(groups.items(), key=lambda kv: -np.mean([r["val_final"] for r in kv[1]]))
    print("\n| " + " | ".join(keys) + " | val acc final (site mean) | pooled val acc | seconds |")
    print("|" + "---|" * (len(keys) + 3))
    for k, rs in ranked:
        print("| " + " | ".join(map(str, k)) + f" | {100 * np.mean([r['val_final'] for r in rs]):.2f} | "
              f"{100 * np.mean([r['pooled_val_final'] for r in rs]):.2f} | {np.mean([r['seconds'] for r in rs]):.0f} |")
    best = ranked[0]
    print(f"\nchosen on validation: {dict(zip(keys, best[0]))}; its test accuracy (site mean, final round): "
          f"{100 * np.mean([r['test_final'] for r in best[1]]):.2f}%")


if __name__ == "__main__":
    main()
