"""FLARE's overhead: FedAvg in NVFlare's simulator vs a bare loop over the same SiteRunner calls (issue #10/#13).

    .venv/bin/python benchmarks/bench_simulator.py [--cases demo busi] [--pairs 5]

Both sides run as a fresh subprocess (so both pay Python and torch start-up and CPU time includes children):
A = ``fedmed.workflows.fedavg_in_process`` in one process, B = ``jobs/run.py --env sim`` (one process per site). The script
first checks that both end with the same final model (bit for bit), then times interleaved pairs and prints the
median and range of the wall and CPU ratios B / A, and the median and range over the pairs of B's fixed start-up
and per-round wait (each pair: the server's per-round timestamps against that pair's loop's compute). Cases: ``demo`` — app_configs/demo_digits.yaml's FedAvg
(4 sites, 5 rounds); ``busi`` — BUSI with the busi_fmcl.yaml recipe, 20 rounds, 5 sites of up to 60 images per
class (five pairs: ~15 min on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import compare  # noqa: E402

LOOP = """
import json, sys, time, numpy as np, torch
torch.set_num_threads(1)
sys.path.insert(0, {root!r})
from fedmed.workflows import fedavg_in_process
cfg = json.load(open({cfg!r}))
t = [time.time()]
theta, summ = fedavg_in_process(cfg, {data!r}, {sites!r}, rounds={rounds}, log=lambda *_: t.append(time.time()))
np.savez({out!r}, **theta)
json.dump([b - a for a, b in zip(t, t[1:])], open({out!r} + ".times.json", "w"))
"""


def case_config(name: str, tmp: Path) -> Path:
    from fedmed.config import load_config

    if name == "demo":
        raw = yaml.safe_load((ROOT / "app_configs" / "demo_digits.yaml").read_text())
        raw["methods"] = [{"name": "FedAvg", "workflow": "fedavg"}]
    else:
        raw = {"extends": str(ROOT / "app_configs" / "busi_fmcl.yaml"), "name": "bench-busi",
               "dataset": {"max_per_class": 60}, "federation": {"sites": 5, "partition": "iid"},
               "methods": [{"name": "FedAvg", "workflow": "fedavg"}], "seeds": [0]}
        raw["train"] = {"rounds": 20}
        raw["dataset"]["path"] = str(ROOT.parent / "shared" / "data" / "busi")
    p = tmp / f"{name}.yaml"
    p.write_text(yaml.safe_dump(raw))
    load_config(p)
    return p


def main(argv=None):
    import torch

    from fedmed.config import load_config
    from fedmed.run.experiment import classes_override, prepare_federation
    from fedmed.run import build_task_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=["demo", "busi"])
    ap.add_argument("--pairs", type=int, default=5)
    a = ap.parse_args(argv)
    for case in a.cases:
        tmp = Path(tempfile.mkdtemp(prefix=f"bench_sim_{case}_"))
        cfg_path = case_config(case, tmp)
        exp = load_config(cfg_path)
        data = prepare_federation(exp, 0, tmp / "data")
        over = classes_override(data, exp)
        exp = load_config(cfg_path, over)
        sites = exp.site_names()
        task_cfg = build_task_config(exp, 0, exp.methods[0], sites)
        (tmp / "task.json").write_text(json.dumps(task_cfg))
        rounds = exp.train.rounds
        loop_out = tmp / "loop.npz"
        script = LOOP.format(root=str(ROOT), cfg=str(tmp / "task.json"), data=str(data), sites=sites, rounds=rounds,
                             out=str(loop_out))
        sim_cmd = [sys.executable, str(ROOT / "jobs" / "run.py"), "--config", str(cfg_path), "--method", "FedAvg",
                   "--env", "sim", "--datalists", str(data), "--workspace", str(tmp / "ws"),
                   *[x for o in over for x in ("--set", o)]]
        loops, sims = [], []  # per call: the loop's per-round times; (the sim's wall time, its rounds' elapsed)

        def run_loop():
            subprocess.run([sys.executable, "-c", script], check=True, cwd=ROOT)
            loops.append(json.loads((tmp / "loop.npz.times.json").read_text()))
            return dict(np.load(loop_out))

        def run_sim():
            t = time.time()
            p = subprocess.run(sim_cmd, check=True, cwd=ROOT, capture_output=True, text=True)
            wall = time.time() - t
            res = json.loads(p.stdout.strip().splitlines()[-1])
            record = json.loads((Path(res["result"]) / "metrics.json").read_text())
            sims.append((wall, [r["elapsed"] for r in record["rounds"]]))
            sd = torch.load(Path(res["result"]) / "models" / "global.pt", weights_only=True)["state_dict"]
            return {k: v.numpy() for k, v in sd.items()}

        def same(x, y):
            return set(x) == set(y) and all(np.array_equal(x[k], y[k]) for k in x)

        compare(f"FedAvg {case}: {len(sites)} sites, {rounds} rounds", run_loop, run_sim, label_a="bare loop",
                label_b="NVFlare simulator", pairs=a.pairs, same=same)
        # per pair (the same-result check's calls excluded): the sim's fixed start-up — outside the controller's run
        # (process start, deploy, shutdown) plus the wait before round 0's results, less the loop's round-0 compute —
        # and its per-round wait beyond the loop's compute (the loop's rounds 1.. against the sim's)
        startups, waits = [], []
        for steps, (wall, el) in zip(loops[-a.pairs:], sims[-a.pairs:]):
            compute = float(np.sum(steps[1:]))
            waits.append(((el[-1] - el[0]) - compute) / max(rounds, 1))
            startups.append((wall - el[-1]) + (el[0] - steps[0]))
        print(f"[{case}] simulator fixed start-up median {np.median(startups):.1f} s (range {min(startups):.1f}-"
              f"{max(startups):.1f}); per-round wait beyond the loop's compute median {np.median(waits):.2f} s "
              f"(range {min(waits):.2f}-{max(waits):.2f}), over {len(waits)} pairs\n", flush=True)


if __name__ == "__main__":
    main()
