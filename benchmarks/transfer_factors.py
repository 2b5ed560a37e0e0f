"""Why a pretrained network fine-tunes worse federated than centrally (issue #53): one factor at a time, on
validation data.

    W=$(.venv/bin/python -c "from fedmed.nn.encoders import released_weights; print(released_weights('efficientnet_lite0'))")
    .venv/bin/python benchmarks/transfer_factors.py --weights $W --out results/transfer_factors [--seeds 0] \\
        [--only release zero_head ...] [--table-only]

Every factor is one ``fedmed experiment`` of ``app_configs/breast_us_lite0.yaml`` (FedAvg, 17 natural sites, the
ImageNet EfficientNet-Lite0 release, 64 px, 12 rounds x 1 local epoch, Adam 1e-3, batch 16) with the ``--set``
overrides below, run one after the other (``--resume``: a finished one is read back, an interrupted one continues).
``release`` is the run before the recipe (``train.recipe=scratch``: the seeded head, one learning rate, training
batch-norm statistics at the network's own momentum, the site's Adam state kept); every other row changes one thing
from it; ``a+b`` rows change both ``a`` and ``b``; ``recipe`` is fedmed's default for a network started from weights. ``central`` is the centralized reference (``references=[centralized]``: one model on the
pooled training data, the same splits, network, loop and epoch budget), made beside ``release`` (as before) and
beside ``recipe`` (with the recipe's head, learning rates and batch norm).

The table ranks nothing on test data: its columns are the pooled **validation** AUC (the final round's, and at the round
fedmed's report selects: the best site-mean validation accuracy, the earliest on a tie), that validation accuracy, and
the sites' mean training loss in round 0 and in the last round. Test numbers are not printed here; ``docs/results.md`` reports them for the chosen recipe only, after the choice.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "app_configs" / "breast_us_lite0.yaml"
BEFORE = ["train.recipe=scratch"]

FACTORS = {
    "release": [],
    "zero_head": ["train.head_init=zero"],
    "reset_opt": ["train.keep_optimizer_state=false"],
    "sgd": ["train.optimizer=sgd", "train.lr=0.01"],
    "fedavgm": ["train.server_opt.kind=avgm", "train.server_opt.beta1=0.6"],
    "fedadam": ["train.server_opt.kind=adam", "train.server_opt.lr=0.001"],
    "fedbn": ["methods=[{name: FedBN, workflow: fedbn}]"],
    "frozen_bn": ["train.norm_stats=frozen"],
    "backbone_0.1": ["train.backbone_lr_scale=0.1"],
    "epochs_2": ["train.local_epochs=2"],
    "recipe": "recipe",  # the transfer recipe as fedmed defaults to it (train.recipe=auto)
}


def overrides(name: str) -> list[str]:
    """The ``--set`` overrides of a factor; ``a+b`` combines factors ``a`` and ``b``."""
    if "+" in name:
        return BEFORE + [s for part in name.split("+") for s in FACTORS[part]]
    f = FACTORS[name]
    return [] if f == "recipe" else BEFORE + list(f)


def described(name: str) -> str:
    if "+" in name:
        return " ".join(s for part in name.split("+") for s in FACTORS[part])
    return "train.recipe=auto (the default)" if FACTORS[name] == "recipe" else " ".join(FACTORS[name]) or "—"


def record(out: Path, seed: int) -> dict | None:
    d = out / "runs" / f"seed{seed}"
    for f in sorted(d.glob("*/server/metrics.json")) + sorted(d.glob("*/metrics.json")):
        if not f.parent.name.startswith("_"):
            return json.loads(f.read_text())
    return None


def row(doc: dict) -> dict:
    """Validation numbers of one run record: the final round's and the validation-selected round's."""
    rounds = [r for r in doc.get("rounds", []) if r.get("summary")]
    val = [(r["round"], r["summary"]["mean"].get("val_accuracy"), (r["summary"].get("pooled_val") or {}))
           for r in rounds]
    val = [v for v in val if v[1] is not None]
    if not val:
        return {}
    sel = max(val, key=lambda v: (v[1], -v[0]))  # fedmed's report's rule: best site-mean val accuracy, earliest
    loss = [r["summary"]["mean"].get("train_loss") for r in rounds if r.get("task") == "train"]
    loss = [x for x in loss if x is not None]
    return {"final_val_auc": val[-1][2].get("auc"), "sel_round": sel[0], "sel_val_auc": sel[2].get("auc"),
            "sel_val_acc": sel[1], "loss0": loss[0] if loss else None, "loss_last": loss[-1] if loss else None}


def central_row(out: Path, seed: int) -> dict:
    f = out / "runs" / f"seed{seed}" / "_references" / "run.json"
    if not f.is_file():
        return {}
    rows = [r for r in json.loads(f.read_text()).get("rows", []) if r.get("method") == "Centralized"]
    if not rows:
        return {}
    sel = max(rows, key=lambda r: (r.get("val_accuracy") or -1, -r["round"]))
    return {"final_val_auc": rows[-1].get("pooled_val_auc"), "sel_round": sel["round"],
            "sel_val_auc": sel.get("pooled_val_auc"), "sel_val_acc": sel.get("val_accuracy")}


def main(argv=None) -> int:
    import numpy as np

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", required=True, help="the EfficientNet-Lite0 release file (released_weights)")
    ap.add_argument("--out", default="results/transfer_factors")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--only", nargs="*", default=[], help=f"factors to run, of {list(FACTORS)}, or a+b (both)")
    ap.add_argument("--table-only", action="store_true", help="read the runs back, run nothing")
    a = ap.parse_args(argv)
    names = a.only or list(FACTORS)
    with_central = ("release", "recipe")
    out = Path(a.out)
    seeds = "[" + ",".join(map(str, a.seeds)) + "]"
    for name in names:
        if a.table_only:
            break
        sets = overrides(name) + [f"references=[{'centralized' if name in with_central else ''}]"]
        cmd = [sys.executable, "-m", "fedmed", "experiment", str(CONFIG), "--out", str(out / name), "--resume",
               "--set", f"model.init_weights={a.weights}", "--set", f"seeds={seeds}"]
        for s in sets:
            cmd += ["--set", s]
        print(f"== {name}: {' '.join(sets) or '(as before)'}", flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    print(f"\nValidation only (pooled over the 17 sites' validation splits), seeds {a.seeds}; made by "
          f"`benchmarks/transfer_factors.py --out {a.out} --seeds {' '.join(map(str, a.seeds))}`\n")
    print("| factor | overrides | val AUC, final round | val-selected round | val AUC there | val acc there (site mean) | "
          "train loss, round 0 | train loss, last round |")
    print("|---|---|---|---|---|---|---|---|")

    def fmt(xs, scale=100.0):
        xs = [x for x in xs if x is not None]
        if not xs:
            return "—"
        return f"{scale * np.mean(xs):.2f} ± {scale * np.std(xs):.2f}" if len(xs) > 1 else f"{scale * xs[0]:.2f}"

    rows = []
    for name in names:
        sets = described(name)
        rows.append((name, sets, [row(d) if (d := record(out / name, s)) else {} for s in a.seeds]))
        if name in with_central:
            rows.append((f"centralized ({name})", sets, [central_row(out / name, s) for s in a.seeds]))
    for name, sets, rs in rows:
        if not any(rs):
            continue
        print(f"| {name} | `{sets}` | {fmt([r.get('final_val_auc') for r in rs])} | "
              f"{', '.join(str(r.get('sel_round')) for r in rs)} | {fmt([r.get('sel_val_auc') for r in rs])} | "
              f"{fmt([r.get('sel_val_acc') for r in rs])} | {fmt([r.get('loss0') for r in rs], 1)} | "
              f"{fmt([r.get('loss_last') for r in rs], 1)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
