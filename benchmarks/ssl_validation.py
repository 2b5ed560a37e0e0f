"""Choose a ``fedmed ssl`` study's settings on validation images, never on its test set.

    .venv/bin/python benchmarks/ssl_validation.py --config app_configs/ssl_pneumonia.yaml \
        --study results/ssl_pneumonia [--seed 0] [--case p4] [--set federation.predi_samples_per_cell=5 ...] \
        [--encoders fedmae random PATH.pt ...] [--val 500]

For one seed of a study whose Fed-MAE pre-training finished, the federated fine-tuning of a sweep case (the same
``SiteRunner`` calls as the workflow, in one process: ``fedmed.workflows.fedavg_in_process``, the study's recipe and budget)
is scored on **validation images**: ``--val`` images drawn (seeded) from the seed's unlabeled pools outside every
site's labeled split. No common-test image is ever scored (only the test split's file names are read, to refuse
them). Encoders: ``fedmae`` (the study's
``runs/seed<S>/pretrain/server/models/encoder.pt``), ``random`` (the classifier's seeded init), or a path to another
encoder file (``fedmed.nn.mae.encoder_state`` of a MAE). ``--set`` changes the study's settings for this check only
(e.g. the labels per (class, site) or ``train.lr``). Prints the validation macro accuracy of every round (the served
model) and the final one.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _index(entry: dict) -> str:
    """The dataset-wide index an array source's image was written under (``images/<site>/<n>_<index>.png``)."""
    return Path(entry["image"]).stem.split("_")[-1]


def validation_datalists(case_dir: Path, pool_dir: Path, sites: list[str], n_val: int, seed: int, out: Path) -> int:
    """Site datalists whose training split is the case's and whose test split is ``n_val`` pool images that no site
    holds as labeled training images; returns how many validation images there are. Raises if a validation image is
    in the case's common test set (the check this script exists for)."""
    labeled, test = set(), set()
    for s in sites:
        doc = json.loads((case_dir / f"{s}.json").read_text())
        labeled |= {_index(e) for e in doc["training"]}
        test |= {_index(e) for e in doc["test"]}
    pool = []
    for s in sites:
        doc = json.loads((pool_dir / f"{s}.json").read_text())
        pool += [{"image": str(pool_dir / e["image"]), "label": e["label"]} for e in doc["training"] + doc["validation"]
                 if _index(e) not in labeled]
    if not pool:
        raise SystemExit(f"{pool_dir}: no pool images outside the labeled split")
    rng = np.random.default_rng(seed)
    val = [pool[i] for i in sorted(rng.choice(len(pool), min(n_val, len(pool)), replace=False))]
    leaked = {_index(e) for e in val} & test
    if leaked:
        raise SystemExit(f"{len(leaked)} validation image(s) are in the common test set: refusing")
    out.mkdir(parents=True, exist_ok=True)
    for s in sites:
        doc = json.loads((case_dir / f"{s}.json").read_text())
        doc["training"] = [{"image": str(case_dir / e["image"]), "label": e["label"]} for e in doc["training"]]
        doc["validation"], doc["test"] = [], val
        (out / f"{s}.json").write_text(json.dumps(doc))
    shutil.copy(case_dir / "dataset.json", out / "dataset.json")
    return len(val)


def main(argv=None):
    import torch

    from fedmed.config import load_config
    from fedmed.run.experiment import classes_override, prepare_federation
    from fedmed.workflows import fedavg_in_process
    from fedmed.run.taskconfig import build_task_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--study", required=True, help="the study's --out folder (its pre-training must have finished)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--case", default=None, help="a fine-tuning sweep case (default: the first)")
    ap.add_argument("--set", action="append", default=[], help="key.path=value for this check only (repeatable)")
    ap.add_argument("--encoders", nargs="+", default=["fedmae", "random"])
    ap.add_argument("--val", type=int, default=500, help="validation images drawn from the pools")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    study = Path(a.study).resolve()
    exp = load_config(a.config)
    cases = [c for c in exp.sweep if c.name == a.case] if a.case else exp.sweep[:1]
    if not cases:
        raise SystemExit(f"{a.config}: no sweep case {a.case!r} (cases: {[c.name for c in exp.sweep]})")
    case = cases[0]
    over = list(case.set) + list(a.set)
    exp = load_config(a.config, over)
    tmp = Path(tempfile.mkdtemp(prefix="ssl_validation_"))
    cdata = prepare_federation(exp, a.seed, tmp / "case")
    exp = load_config(a.config, over + classes_override(cdata, exp))
    sites = json.loads((cdata / "dataset.json").read_text())["sites"]
    pool = study / "data" / f"seed{a.seed}" / "pretrain"
    n = validation_datalists(cdata, pool, sites, a.val, a.seed, tmp / "val")
    print(f"seed {a.seed}, case {case.name} {a.set or ''}: {n} validation images from the pools (outside the labeled "
          f"split and the common test set)", flush=True)
    trained = study / "runs" / f"seed{a.seed}" / "pretrain" / "server" / "models" / "encoder.pt"
    for enc in a.encoders:
        name = "Random init" if enc == "random" else next(m.name for m in exp.methods if m.workflow == "finetune"
                                                              and m.init == "fedmae")
        method = next(m for m in exp.methods if m.name == name)
        path = None if enc == "random" else (trained if enc == "fedmae" else Path(enc))
        init = {k: v.numpy() for k, v in torch.load(path, weights_only=True).items()} if path else None
        _, summ = fedavg_in_process(build_task_config(exp, a.seed, method, sites), tmp / "val", sites, rounds=exp.train.rounds,
                              init=init)
        curve = [round(100 * s["mean"]["macro_acc"], 1) for s in summ]
        print(f"  {enc}: validation macro accuracy, final {curve[-1]}%; by round {curve}", flush=True)
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
