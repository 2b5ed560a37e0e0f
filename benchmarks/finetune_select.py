"""Choose the serving plan's local fine-tuning (``serving.finetune``: epochs, learning-rate scale) on validation data
(issue #57): over one seed's finished reference run of ``fedmed experiment``, each setting's plan (``fedmed plan
--finetune``, in-process, no other candidate) fine-tunes the global model at every site on its training split and
scores it on the site's validation split. The table gives, per setting, the site mean of the global and of the
fine-tuned model's validation score (accuracy, or lesion Dice for a 2D segmenter), the fine-tuned model's wins and
losses summed over the sites, and at how many sites the plan's rule served it. Test splits are not read while
scoring (``serve_score``); the served round's test numbers are not shown.

    python benchmarks/finetune_select.py results/bus_bra_seg_plan app_configs/bus_bra_seg.yaml --seed 0 \
        --settings 2:0.1 2:1 5:1

Each setting's plan goes to ``<out>/finetune_select/seed<N>/<epochs>_<scale>`` (reused when its ``plan.json`` is
there); the table is written to ``<out>/finetune_select/seed<N>.md`` and printed.
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


def run_setting(out: Path, config: str, seed: int, reference: str, epochs: int, scale: float,
                overrides: list[str]) -> Path:
    from fedmed.run.experiment import run_dir

    dest = out / "finetune_select" / f"seed{seed}" / f"{epochs}_{scale:g}"
    if (dest / "plan.json").is_file():
        print(f"{epochs} epoch(s) at {scale:g} x lr: found in {dest}, reused", flush=True)
        return dest
    cmd = [sys.executable, "-m", "fedmed", "plan", config, "--global", str(run_dir(out, seed, reference) / "server"),
           "--method", reference, "--data", str(out / "data" / f"seed{seed}"), "--seed", str(seed), "--finetune",
           "--finetune-epochs", str(epochs), "--finetune-lr-scale", f"{scale:g}", "--out", str(dest), "--in-process"]
    for o in overrides:
        cmd += ["--set", o]
    print(f"{epochs} epoch(s) at {scale:g} x lr ...", flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return dest


def summarize(dest: Path) -> dict:
    plan = json.loads((dest / "plan.json").read_text())
    doc = json.loads((dest / "metrics.json").read_text())
    scored = next(r["sites"] for r in doc["rounds"] if r["task"] == "serve_score")
    metric = next(k.split("/")[0] for v in scored.values() for k in v if k.endswith("/global"))

    def mean(name):
        vals = [v.get(f"{metric}/{name}") for v in scored.values()]
        vals = [x for x in vals if x is not None and np.isfinite(x)]
        return 100 * float(np.mean(vals)) if vals else float("nan")

    ev = [v["evidence"].get("finetuned") for v in plan.values()]
    ev = [e for e in ev if e]
    return {"metric": metric, "global": mean("global"), "finetuned": mean("finetuned"),
            "wins": sum(e.get("wins", 0) for e in ev), "losses": sum(e.get("losses", 0) for e in ev),  # a site's
            # counts below k_min are not sent (#86): the sums are over the sites that sent them
            "served": sum(v["served"] == "finetuned" for v in plan.values()), "sites": len(plan)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("out", help="the experiment's output folder (fedmed experiment --out)")
    p.add_argument("config", help="its config")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reference", default="FedAvg", help="the method whose global model is fine-tuned")
    p.add_argument("--settings", nargs="+", default=["2:0.1", "2:1", "5:1"], metavar="EPOCHS:LR_SCALE")
    p.add_argument("--set", action="append", default=[], help="the experiment's own --set overrides")
    a = p.parse_args(argv)
    out = Path(a.out)
    rows = []
    for s in a.settings:
        e, sc = s.split(":")
        rows.append((int(e), float(sc), summarize(run_setting(out, a.config, a.seed, a.reference, int(e), float(sc),
                                                                  a.set))))
    metric = rows[0][2]["metric"]
    lines = [f"Fine-tuning at each site, seed {a.seed}: site mean of `{metric}` on the validation splits (%)", "",
             f"`python benchmarks/finetune_select.py {a.out} {a.config} --seed {a.seed} --settings "
             f"{' '.join(a.settings)}`", "",
             "| epochs | lr x train.lr | global (val) | fine-tuned (val) | fine-tuned W / L (all sites) | served at |",
             "|---|---|---|---|---|---|"]
    for e, sc, r in rows:
        lines.append(f"| {e} | {sc:g} | {r['global']:.2f} | {r['finetuned']:.2f} | {r['wins']} / {r['losses']} | "
                     f"{r['served']} of {r['sites']} sites |")
    text = "\n".join(lines) + "\n"
    (out / "finetune_select").mkdir(parents=True, exist_ok=True)
    (out / "finetune_select" / f"seed{a.seed}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
