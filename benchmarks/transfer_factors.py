"""Why a pretrained network fine-tunes worse federated than centrally (issue #53): one factor at a time, on
validation data.

    .venv/bin/python benchmarks/transfer_factors.py --weights imagenet --out results/transfer_factors [--seeds 0] \\
        [--only release zero_head ...] [--table-only]

Every factor is one ``fedmed experiment`` of ``app_configs/breast_us_lite0.yaml`` (FedAvg, 17 natural sites, the
ImageNet EfficientNet-Lite0 release, 64 px, 12 rounds x 1 local epoch, Adam 1e-3, batch 16) with the ``--set``
overrides below, run one after the other (``--resume``: a finished one is read back, an interrupted one continues).
``release`` is the run before the recipe (``train.recipe=scratch``: the seeded head, one learning rate, training
batch-norm statistics at the network's own momentum, the site's Adam state kept); every other row changes one thing
from it; ``a+b`` rows change both ``a`` and ``b``; ``recipe+b`` changes ``b`` on top of the recipe; ``recipe`` is fedmed's default for a network started from weights. ``central`` is the centralized reference (``references=[centralized]``: one model on the
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
WITH_CENTRAL = ("release", "recipe")  # factors run beside the centralized reference
IN_PROCESS: list[str] = []  # ["--in-process"] with --in-process: each experiment's jobs without FLARE

FACTORS = {
    "release": [],
    "zero_head": ["train.head_init=zero"],
    "reset_opt": ["train.keep_optimizer_state=false"],
    "sgd": ["train.optimizer=sgd", "train.lr=0.01"],
    "fedavgm": ["train.server_opt.kind=avgm", "train.server_opt.beta1=0.6"],
    "fedadam": ["train.server_opt.kind=adam", "train.server_opt.lr=0.001"],
    "fedbn": ["methods=[{name: FedBN, workflow: fedbn}]"],
    # FMCL with the release as its frozen encoder and the true K (the five sources); {weights} is --weights
    "fmcl_k5": ["methods=[{name: FMCL_ImageNet_K5, workflow: fmcl, encoder: efficientnet_lite0, n_clusters: 5, "
                "encoder_weights: {weights}}]"],
    "flux": ["methods=[{name: Flux, workflow: flux}]"],
    "frozen_bn": ["train.norm_stats=frozen"],
    # the served model's batch-norm statistics re-estimated over the sites' training images after every average
    "norm_recal": ["train.norm_recalibrate=true"],
    "backbone_0.1": ["train.backbone_lr_scale=0.1"],
    "epochs_2": ["train.local_epochs=2"],
    "epochs_4": ["train.local_epochs=4"],
    "epochs_8": ["train.local_epochs=8"],
    "rounds_24": ["train.rounds=24"],
    "batch_8": ["train.batch_size=8"],
    "cosine": ["train.lr_schedule=cosine"],
    "lr_2x": ["train.lr=0.002"],
    "lr_3x": ["train.lr=0.003"],
    "recipe": "recipe",  # the transfer recipe as fedmed defaults to it (train.recipe=auto)
}


def overrides(name: str) -> list[str]:
    """The ``--set`` overrides of a factor; ``a+b`` combines factors ``a`` and ``b``; ``name@224`` runs it at 224 px."""
    if "@" in name:
        name, size = name.split("@")
        return overrides(name) + [f"dataset.image_size={int(size)}"]
    if "+" in name:  # recipe+b: b on top of the recipe; a+b: both on top of the release
        parts = name.split("+")
        base = [] if parts[0] == "recipe" else BEFORE
        return base + [s for part in parts if part != "recipe" for s in FACTORS[part]]
    f = FACTORS[name]
    return [] if f == "recipe" else BEFORE + list(f)


def described(name: str) -> str:
    if "@" in name:
        name, size = name.split("@")
        return f"{described(name)} dataset.image_size={int(size)}"
    if "+" in name:
        return " ".join(described(part) if part == "recipe" else " ".join(FACTORS[part]) for part in name.split("+"))
    return "train.recipe=auto (the default)" if FACTORS[name] == "recipe" else " ".join(FACTORS[name]) or "—"


def _seed_dirs(out: Path, seed: int) -> list[Path]:
    """Where a factor's run of ``seed`` lies: merged into the factor's folder, or still in its own (``--jobs``)."""
    return [out / "runs" / f"seed{seed}", out / f"_seed{seed}" / "runs" / f"seed{seed}"]


def record(out: Path, seed: int) -> dict | None:
    for d in _seed_dirs(out, seed):
        for f in sorted(d.glob("*/server/metrics.json")) + sorted(d.glob("*/metrics.json")):
            if not f.parent.name.startswith("_"):
                return json.loads(f.read_text())
    return None


def row(doc: dict, selection: str = "validation") -> dict:
    """Validation numbers of one run record: the final round's and the validation-selected round's (``selection``:
    the report's rules, ``validation`` best site-mean val accuracy or ``validation_auc`` best pooled val AUC)."""
    rounds = [r for r in doc.get("rounds", []) if r.get("summary")]
    val = [(r["round"], r["summary"]["mean"].get("val_accuracy"), (r["summary"].get("pooled_val") or {}))
           for r in rounds]
    val = [v for v in val if v[1] is not None]
    if not val:
        return {}
    if selection == "validation_auc":  # the report's other rule: best pooled val AUC, earliest
        sel = max(val, key=lambda v: (v[2].get("auc") if v[2].get("auc") is not None else -1.0, -v[0]))
    else:
        sel = max(val, key=lambda v: (v[1], -v[0]))  # fedmed's report's rule: best site-mean val accuracy, earliest
    loss = [r["summary"]["mean"].get("train_loss") for r in rounds if r.get("task") == "train"]
    loss = [x for x in loss if x is not None]
    return {"final_val_auc": val[-1][2].get("auc"), "sel_round": sel[0], "sel_val_auc": sel[2].get("auc"),
            "sel_val_acc": sel[1], "loss0": loss[0] if loss else None, "loss_last": loss[-1] if loss else None}


def central_row(out: Path, seed: int, selection: str = "validation") -> dict:
    f = next((d / "_references" / "run.json" for d in _seed_dirs(out, seed) if (d / "_references" / "run.json").is_file()),
             None)
    if f is None:
        return {}
    rows = [r for r in json.loads(f.read_text()).get("rows", []) if r.get("method") == "Centralized"]
    if not rows:
        return {}
    vkey = "pooled_val_auc" if selection == "validation_auc" else "val_accuracy"
    sel = max(rows, key=lambda r: (r.get(vkey) or -1, -r["round"]))
    return {"final_val_auc": rows[-1].get("pooled_val_auc"), "sel_round": sel["round"],
            "sel_val_auc": sel.get("pooled_val_auc"), "sel_val_acc": sel.get("val_accuracy")}


def _command(name: str, seeds: list[int], out: Path, weights: str, extra: list[str]) -> list[str]:
    sets = overrides(name) + [f"references=[{'centralized' if name.split('@')[0] in WITH_CENTRAL else ''}]"]
    cmd = [sys.executable, "-m", "fedmed", "experiment", str(CONFIG), "--out", str(out), "--resume", *IN_PROCESS,
           "--set", f"model.init_weights={weights}", "--set", "seeds=[" + ",".join(map(str, seeds)) + "]"]
    for s in sets + list(extra):
        cmd += ["--set", s.replace("{weights}", weights)]
    return cmd


def _merge(name: str, seeds: list[int], out: Path, weights: str, extra: list[str]) -> int:
    """Move each seed's run into the factor's folder and write its 3-seed tables by reading them back (--resume:
    nothing is trained again: the fingerprints leave the seed list out)."""
    import shutil

    for s in seeds:
        for part in ("runs", "data"):
            src, dst = out / f"_seed{s}" / part / f"seed{s}", out / part / f"seed{s}"
            if src.is_dir():
                if dst.exists():
                    shutil.rmtree(dst)
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.move(str(src), str(dst))
    with open(out / "merge.log", "w") as log:
        return subprocess.run(_command(name, seeds, out, weights, extra), stdout=log, stderr=subprocess.STDOUT).returncode


def run_all(names, seeds, out: Path, weights: str, extra: list[str], *, jobs: int = 1,
            deadline: float | None = None) -> None:
    """Run every factor; one at a time (each an experiment over all seeds), or ``jobs`` (factor, seed) runs at a time,
    the earliest factors first, each factor's seeds merged once all are done."""
    import time

    t0 = time.monotonic()
    if jobs <= 1:
        for name in names:
            if deadline is not None and time.monotonic() - t0 > deadline:
                print(f"== deadline: {name} and later not started", flush=True)
                break
            print(f"== {name}: {described(name)}", flush=True)
            subprocess.run(_command(name, seeds, out / name, weights, extra), check=True, stdout=subprocess.DEVNULL)
        return
    queue = [(n, s) for n in names for s in seeds]
    running, left = {}, {n: set(seeds) for n in names}
    failed = set()
    while queue or running:
        while queue and len(running) < jobs:
            if deadline is not None and time.monotonic() - t0 > deadline:
                print(f"== deadline after {time.monotonic() - t0:.0f} s: not started: {queue}", flush=True)
                queue = []
                break
            n, s = queue.pop(0)
            d = out / n / f"_seed{s}"
            d.mkdir(parents=True, exist_ok=True)
            log = open(d / "experiment.log", "w")
            running[(n, s)] = (subprocess.Popen(_command(n, [s], d, weights, extra), stdout=log,
                                                stderr=subprocess.STDOUT), time.monotonic(), log)
            print(f"[{time.monotonic() - t0:5.0f} s] started {n} seed {s}", flush=True)
        time.sleep(1.0)
        for key, (proc, started, log) in list(running.items()):
            if proc.poll() is None:
                continue
            log.close()
            del running[key]
            n, s = key
            print(f"[{time.monotonic() - t0:5.0f} s] {n} seed {s}: exit {proc.returncode} after "
                  f"{time.monotonic() - started:.0f} s", flush=True)
            if proc.returncode != 0:
                failed.add(n)
            left[n].discard(s)
            if not left[n] and n not in failed:
                rc = _merge(n, seeds, out / n, weights, extra)
                print(f"[{time.monotonic() - t0:5.0f} s] {n}: seeds merged (exit {rc})", flush=True)


def main(argv=None) -> int:
    import numpy as np

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", required=True, help="the EfficientNet-Lite0 release: imagenet (the installed "
                    "release, by name) or its file")
    ap.add_argument("--out", default="results/transfer_factors")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--only", nargs="*", default=[], help=f"factors to run, of {list(FACTORS)}, or a+b (both)")
    ap.add_argument("--table-only", action="store_true", help="read the runs back, run nothing")
    ap.add_argument("--jobs", type=int, default=1,
                    help="runs at a time; above 1 every (factor, seed) is its own experiment (in FACTOR/_seedN), the "
                         "seeds merged into FACTOR/ and read back with --resume once all are done (a GPU machine)")
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds after which no further run starts (runs in flight finish)")
    ap.add_argument("--set", action="append", default=[],
                    help="an override for every run (e.g. dataset.sources for a copy of the data)")
    ap.add_argument("--selection", choices=("validation", "validation_auc"), default="validation",
                    help="the validation table's selected round: the report's rule 'validation' (best site-mean val "
                         "accuracy) or 'validation_auc' (best pooled val AUC)")
    ap.add_argument("--paired", metavar="FACTOR", default=None,
                    help="also print each row's validation AUC at its selected round minus FACTOR's, paired by seed "
                         "(mean ± std, and each seed's), marked 'beyond' where |mean| > std")
    ap.add_argument("--in-process", action="store_true",
                    help="run each experiment's jobs in its own process (fedmed experiment --in-process: the same "
                         "models without FLARE's process per site; a GPU machine)")
    a = ap.parse_args(argv)
    if a.in_process:
        IN_PROCESS[:] = ["--in-process"]
    names = a.only or list(FACTORS)
    out = Path(a.out)
    if not a.table_only:
        run_all(names, a.seeds, out, a.weights, a.set, jobs=a.jobs, deadline=a.deadline)
    rule = "best pooled val AUC" if a.selection == "validation_auc" else "best site-mean val accuracy"
    print(f"\nValidation only (pooled over the 17 sites' validation splits), seeds {a.seeds}, the round selected by "
          f"{rule}; made by `benchmarks/transfer_factors.py --out {a.out} --seeds {' '.join(map(str, a.seeds))}"
          f"{' --selection validation_auc' if a.selection == 'validation_auc' else ''}`\n")
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
        rows.append((name, sets, [row(d, a.selection) if (d := record(out / name, s)) else {} for s in a.seeds]))
        if name.split("@")[0] in WITH_CENTRAL:
            rows.append((f"centralized ({name})", sets, [central_row(out / name, s, a.selection) for s in a.seeds]))
    for name, sets, rs in rows:
        if not any(rs):
            continue
        print(f"| {name} | `{sets}` | {fmt([r.get('final_val_auc') for r in rs])} | "
              f"{', '.join(str(r.get('sel_round')) for r in rs)} | {fmt([r.get('sel_val_auc') for r in rs])} | "
              f"{fmt([r.get('sel_val_acc') for r in rs])} | {fmt([r.get('loss0') for r in rs], 1)} | "
              f"{fmt([r.get('loss_last') for r in rs], 1)} |")
    if a.paired:
        ref = next((rs for name, _, rs in rows if name == a.paired), None)
        if ref is None:
            raise SystemExit(f"--paired {a.paired}: not among the rows ({', '.join(n for n, _, _ in rows)})")
        print(f"\nPaired by seed against {a.paired}: validation AUC at the selected round, row minus reference\n")
        print("| factor | paired gain | per seed | beyond the spread |")
        print("|---|---|---|---|")
        for name, _, rs in rows:
            if name == a.paired or not any(rs):
                continue
            d = [100 * (r["sel_val_auc"] - q["sel_val_auc"]) for r, q in zip(rs, ref)
                 if r.get("sel_val_auc") is not None and q.get("sel_val_auc") is not None]
            if not d:
                continue
            m, s = float(np.mean(d)), float(np.std(d))
            print(f"| {name} | {m:+.2f} ± {s:.2f} | {', '.join(f'{x:+.2f}' for x in d)} | "
                  f"{'beyond' if abs(m) > s else 'within'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
