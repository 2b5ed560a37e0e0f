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
site's validation images, the mean Brier score gain the test judges, and the one-sided p-value the plan recorded and
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
    """A plan's or an onboarding job's per-site test record of one task: site -> its entry (accuracy, auc, n_test)."""
    for r in doc.get("rounds", []):
        if r.get("task") == task:
            return dict(r.get("sites", {}))
    return {}


def _pct(e: dict, key: str) -> str:
    v = e.get(key)
    return "—" if v is None or v != v else f"{100 * v:.2f}"


def _paired(name: str, a: list, b: list) -> str:
    d = 100 * (np.asarray(a, dtype=float) - np.asarray(b, dtype=float))
    return f"{name} {d.mean():+.2f} ± {d.std():.2f} (" + ", ".join(f"{v:+.2f}" for v in d) + ")"


def table(out: Path, seeds: list[int], candidates: list[str] = ()) -> str:
    """The plan's table: per seed and new site what was served, its validation evidence, and — read after the plans —
    the served and the global model's test accuracy and AUC, and each candidate method's onboarding assignment scored
    on the site (``<run>/test_phase``; its image count beside it: a label-free assignment is scored on all the site's
    images, the others on its test split). Mean ± std over the (seed, site) pairs after it, and the paired differences
    against the global model (an assignment only where it was scored on the plan's test images)."""
    from fedmed.report.summary import fmt
    from fedmed.run.experiment import run_dir

    rows = []
    col = {k: [] for k in ("served_acc", "global_acc", "served_auc", "global_auc")}
    assigned: dict = {c: {"acc": [], "auc": [], "global_acc": [], "global_auc": []} for c in candidates}
    for seed in seeds:
        server = out / "runs" / f"seed{seed}" / "_newcomer_plan" / "server"
        plan = json.loads((server / "plan.json").read_text())
        doc = json.loads((server / "metrics.json").read_text())
        served, glob = _scores(doc, "served"), _scores(doc, "global")
        onboard = {}
        for c in candidates:
            f = run_dir(out, seed, c) / "test_phase" / "server" / "metrics.json"
            onboard[c] = _scores(json.loads(f.read_text()), "test_phase") if f.is_file() else {}
        for site, v in sorted(plan.items()):
            ev = "; ".join(f"{n}: " + (f"{e['wins']} W / {e['losses']} L of {e['n']}" if "wins" in e else
                                       f"{e['n']} items (counts below k_min not sent)")
                           + (f", mean Brier gain {e['sum_d'] / e['n']:+.3f}" if e.get("sum_d") is not None else "")
                           + (f", p = {v['p'][n]:.3f}" if n in v.get("p", {}) else "")
                           if e else f"{n}: none sent"
                           for n, e in sorted((v.get("evidence") or {}).items()))
            sv, gl = served[site], glob[site]
            cells = [str(seed), site, v["served"], ev, _pct(sv, "accuracy"), _pct(gl, "accuracy"), _pct(sv, "auc"),
                     _pct(gl, "auc")]
            for c in candidates:
                e = onboard[c].get(site) or {}
                cells.append(f"{_pct(e, 'accuracy')} ({e.get('n_test', '—')})")
                if e.get("accuracy") is not None and e.get("n_test") == gl.get("n_test"):
                    assigned[c]["acc"].append(e["accuracy"])
                    assigned[c]["global_acc"].append(gl["accuracy"])
                    if e.get("auc") is not None and gl.get("auc") is not None:
                        assigned[c]["auc"].append(e["auc"])
                        assigned[c]["global_auc"].append(gl["auc"])
            rows.append("| " + " | ".join(cells) + " |")
            col["served_acc"].append(sv["accuracy"])
            col["global_acc"].append(gl["accuracy"])
            if sv.get("auc") is not None and gl.get("auc") is not None:
                col["served_auc"].append(sv["auc"])
                col["global_auc"].append(gl["auc"])
    names = ["seed", "new site", "served", "validation evidence against the global model", "test acc. served",
             "test acc. global", "test AUC served", "test AUC global",
             *(f"test acc. {c}'s assignment (images)" for c in candidates)]
    head = "| " + " | ".join(names) + " |\n|" + "---|" * len(names) + "\n"
    n = len(col["served_acc"])
    tail = (f"\nOver {n} (seed, site) pairs: served {fmt(col['served_acc'])}, global {fmt(col['global_acc'])}; "
            + _paired("served minus global", col["served_acc"], col["global_acc"]) + ".\n")
    if col["served_auc"]:
        tail += (f"AUC: served {fmt(col['served_auc'])}, global {fmt(col['global_auc'])}; "
                 + _paired("served minus global", col["served_auc"], col["global_auc"]) + ".\n")
    for c, v in assigned.items():
        if v["acc"]:
            tail += (f"{c}'s assignment on the same test images ({len(v['acc'])} pairs): accuracy {fmt(v['acc'])}; "
                     + _paired("minus global", v["acc"], v["global_acc"])
                     + (f"; AUC {fmt(v['auc'])}; " + _paired("minus global", v["auc"], v["global_auc"])
                        if v["auc"] else "") + ".\n")
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
            + "`\n\n" + table(out, seeds, a.candidates))
    (out / "newcomer_plan.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
