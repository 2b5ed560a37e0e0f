"""The serving plan for the new sites of an onboarding experiment (issue #57): after ``fedmed experiment`` trained on
the federation and onboarded its held-out sites (``federation.holdout_sites``; each method's ``test_phase``), every new
site is offered, against the global model of the reference method, the model each clustered method assigned it and
(``--finetune``) the global model fine-tuned on its own training split; the site chooses on its validation split by
the plan's rule (``fedmed.algorithms.serving``: the paired test of ``fedmed plan``'s default ``--test``), and only
then are both the served and the global model scored on its test split.

    python benchmarks/newcomer_plan.py results/breast_us_onboard_toshiba app_configs/breast_us_onboard.yaml \
        --candidates FMCL_ImageNet_K5 Flux --finetune --set ... (the experiment's own --set overrides)

Each seed's plan runs ``fedmed plan`` (FLARE's simulator) into ``<out>/runs/seed<N>/_newcomer_plan`` (reused when
its ``plan.json`` is there); the table (``newcomer_plan.md`` in the experiment folder, printed too) gives per seed and
new site the served model, the validation evidence of each candidate (wins / losses against the global model over the
site's validation images, the mean Brier-score gain the test judges, and the one-sided p-value the plan recorded and
compared with ``alpha`` over the number of candidates) and the test accuracy of the served model and of
the global model, then mean ± std over seeds. The test split chooses nothing.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def plan_seed(out: Path, config: str, seed: int, reference: str, candidates: list[str], finetune: bool,
              overrides: list[str]) -> Path:
    from fedmed.run.experiment import run_dir

    data = out / "data" / f"seed{seed}"
    unseen = json.loads((data / "dataset.json").read_text()).get("unseen_sites") or []
    if not unseen:
        raise SystemExit(f"{data}: the experiment held out no site (federation.holdout_sites)")
    dest = out / "runs" / f"seed{seed}" / "_newcomer_plan"
    if (dest / "server" / "plan.json").is_file():
        print(f"seed {seed}: plan found in {dest}, reused", flush=True)
        return dest
    cmd = [sys.executable, "-m", "fedmed", "plan", config, "--global", str(run_dir(out, seed, reference) / "server"),
           "--method", reference, "--data", str(data), "--sites", *unseen, "--seed", str(seed), "--out", str(dest)]
    for c in candidates:
        cmd += ["--candidate", f"{c}={run_dir(out, seed, c) / 'test_phase' / 'server'}"]
    if finetune:
        cmd.append("--finetune")
    for o in overrides:
        cmd += ["--set", o]
    print(f"seed {seed}: {' '.join(cmd[3:6])} ... ({len(unseen)} new site(s))", flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    return dest


def _scores(doc: dict, task: str) -> dict:
    for r in doc.get("rounds", []):
        if r.get("task") == task:
            return {s: v.get("accuracy") for s, v in r.get("sites", {}).items()}
    return {}


def table(out: Path, seeds: list[int]) -> str:
    rows, served_acc, global_acc = [], [], []
    for seed in seeds:
        server = out / "runs" / f"seed{seed}" / "_newcomer_plan" / "server"
        plan = json.loads((server / "plan.json").read_text())
        doc = json.loads((server / "metrics.json").read_text())
        served, glob = _scores(doc, "served"), _scores(doc, "global")
        for site, v in sorted(plan.items()):
            ev = "; ".join(f"{n}: {e['wins']} W / {e['losses']} L of {e['n']}"
                           + (f", mean Brier gain {e['sum_d'] / e['n']:+.3f}" if e.get("sum_d") is not None else "")
                           + (f", p = {v['p'][n]:.3f}" if n in v.get("p", {}) else "")
                           if e else f"{n}: none sent"
                           for n, e in sorted((v.get("evidence") or {}).items()))
            rows.append(f"| {seed} | {site} | {v['served']} | {ev} | {100 * served[site]:.2f} | "
                        f"{100 * glob[site]:.2f} |")
            served_acc.append(served[site])
            global_acc.append(glob[site])
    a, g = 100 * np.asarray(served_acc), 100 * np.asarray(global_acc)
    d = a - g
    head = ("| seed | new site | served | validation evidence against the global model | test acc. served | "
            "test acc. global |\n|---|---|---|---|---|---|\n")
    tail = (f"\nOver {len(a)} (seed, site) pairs: served {a.mean():.2f} ± {a.std():.2f}, global {g.mean():.2f} ± "
            f"{g.std():.2f}; served minus global {d.mean():+.2f} ± {d.std():.2f}.\n")
    return head + "\n".join(rows) + "\n" + tail


def plan_seeds(config, overrides: list[str], seeds: list[int] | None) -> list[int]:
    """The seeds to plan: those given, else the experiment's own (its config's ``seeds`` after its overrides), as
    ``fedmed experiment`` ran them."""
    if seeds:
        return list(seeds)
    from fedmed.config import load_config

    return list(load_config(config, overrides).seeds)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="the onboarding experiment's output folder")
    ap.add_argument("config", help="its config")
    ap.add_argument("--reference", default="FedAvg", help="the method whose global model is the reference")
    ap.add_argument("--candidates", nargs="+", default=[], help="methods whose assigned model (test_phase) is offered")
    ap.add_argument("--finetune", action="store_true", help="also offer the global model fine-tuned at the new site")
    ap.add_argument("--seeds", type=int, nargs="+", help="the seeds to plan (default: the config's, after --set)")
    ap.add_argument("--set", action="append", default=[], help="the experiment's config overrides, as given to it")
    a = ap.parse_args(argv)
    out = Path(a.out).resolve()
    seeds = plan_seeds(a.config, a.set, a.seeds)
    for seed in seeds:
        plan_seed(out, a.config, seed, a.reference, a.candidates, a.finetune, a.set)
    text = ("Produced by: `python benchmarks/newcomer_plan.py " + " ".join(sys.argv[1:] if argv is None else argv)
            + "`\n\n" + table(out, seeds))
    (out / "newcomer_plan.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
