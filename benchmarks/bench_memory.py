"""Memory of a long simulator run: does the federation's RSS grow with the rounds? (issue #7/#10)

    .venv/bin/python benchmarks/bench_memory.py [--rounds 200] [--sites 4]

Runs FedAvg on the bundled digits for ``--rounds`` rounds in NVFlare's simulator (``jobs/run.py --env sim``),
samples the RSS of every process of the run (the jobs/run.py process, the simulator's server and each site
process) once a second together with the round the server has recorded, and prints: total RSS at round 20
and at the last round, the growth in %, each process's own growth, and how many MB a round costs — so where
growth sits inside NVFlare itself the table shows which process grows. Also prints the peak total RSS and the peak
total PSS (proportional set size: a page shared by n processes counts 1/n in each — what the run really holds;
RSS counts the shared pages of torch and Python once per process), and the kernel's view: how far the machine's
available memory (``MemAvailable``) fell during the run below its level at the start. ``--plain`` starts the site processes as FLARE
does (``FEDMED_SIM_FORK=0``: a fresh interpreter per site) instead of forking them from fedmed's preloaded
template (fedmed_flare.simulator), for the before/after figure.

    .venv/bin/python benchmarks/bench_memory.py --sites 20 --rounds 30 [--plain]
    .venv/bin/python benchmarks/bench_memory.py --loop      # the same site calls without FLARE, one process
    .venv/bin/python benchmarks/bench_memory.py --trace     # + tracemalloc in the site scripts and the controller
    .venv/bin/python benchmarks/bench_memory.py --env MALLOC_ARENA_MAX=2   # an environment setting for the run

The site script and the controller call ``fedmed.core.memtrace.trim`` (glibc ``malloc_trim``) once per round, giving back
the heap pages of FLARE's freed 1 MiB stream buffers; ``--env MALLOC_MMAP_THRESHOLD_=1048576`` is the allocator
setting compared with it in docs/lab/performance.md ("Memory"; its training cost: ``benchmarks/bench_malloc.py``).

``--trace`` (``fedmed.core.memtrace``) has every site script and the server's controller snapshot its live Python
allocations every 10 rounds; the script then prints, per process, RSS growth next to the growth of traced Python
memory, and the source lines whose live allocations grew most (tracing slows the run).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def role(cmdline: list[str]) -> str:
    text = " ".join(cmdline)
    if "jobs/run.py" in text:
        return "jobs/run.py (builder)"
    if "forkserver" in text:
        return "site template (forkserver)"
    if "simulator_worker" in text or "multiprocessing" in text:
        site = cmdline[cmdline.index("--client") + 1] if "--client" in cmdline else "?"
        return "site processes" if site != "?" else "multiprocessing helper"
    if "simulator" in text:
        return "simulator server"
    return text[:60]


def main(argv=None):
    import psutil

    from fedmed.config import load_config
    from fedmed.run.experiment import classes_override, prepare_federation

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--sites", type=int, default=4)
    ap.add_argument("--from-round", type=int, default=20)
    ap.add_argument("--plain", action="store_true", help="site processes as FLARE starts them (no fork template)")
    ap.add_argument("--loop", action="store_true",
                    help="reference without FLARE: the same SiteRunner calls in one process (fedmed.workflows.fedavg_in_process); "
                         "flat RSS there puts the simulator's growth in FLARE's path, not in fedmed's site code")
    ap.add_argument("--trace", action="store_true", help="tracemalloc in the site scripts and the controller")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="environment setting for the run")
    ap.add_argument("--config", help="an experiment config to run instead of the bundled digits (its dataset, model "
                                     "and recipe; --sites and --rounds override its federation.sites/train.rounds)")
    ap.add_argument("--method", default="FedAvg", help="the config's method to run (with --config)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (with --config)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    import os

    env = {**os.environ, "FEDMED_SIM_FORK": "0" if a.plain else "1", **dict(e.split("=", 1) for e in a.env)}
    tmp = Path(tempfile.mkdtemp(prefix="bench_memory_"))
    if a.trace:
        env.update({"FEDMED_MEMTRACE": str(tmp / "trace"), "FEDMED_MEMTRACE_EVERY": "10"})
    if a.config:
        cfg = yaml.safe_load(Path(a.config).read_text())
        base = Path(a.config).resolve().parent  # the config's relative dataset path, as `fedmed experiment` reads it
        path = cfg["dataset"]["path"]
        if not str(path).startswith("builtin:") and not Path(path).is_absolute():
            cfg["dataset"]["path"] = str((ROOT / path) if (ROOT / path).exists() else (base / path))
        cfg["federation"].update(sites=a.sites, unseen_sites=0)
        cfg["train"]["rounds"] = a.rounds
        cfg.pop("sweep", None)
    else:
        cfg = {"name": "memory", "dataset": {"path": "builtin:digits", "image_size": 8, "channels": 1,
                                             "max_per_class": 20},
               "federation": {"sites": a.sites, "partition": "iid"}, "model": {"arch": "resnet9", "width": 4},
               "train": {"rounds": a.rounds, "local_epochs": 1, "batch_size": 16}, "privacy": {"k_min": 2},
               "methods": [{"name": "FedAvg", "workflow": "fedavg"}]}
    (tmp / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    exp = load_config(tmp / "cfg.yaml", a.set)
    data = prepare_federation(exp, a.seed, tmp / "data")
    if a.loop:
        return loop_reference(tmp / "cfg.yaml", data, a)
    cmd = [sys.executable, str(ROOT / "jobs" / "run.py"), "--config", str(tmp / "cfg.yaml"), "--method", a.method,
           "--seed", str(a.seed), "--env", "sim", "--datalists", str(data), "--workspace", str(tmp / "ws"),
           *[x for o in [*a.set, *classes_override(data, exp)] for x in ("--set", o)]]
    avail0 = psutil.virtual_memory().available  # the kernel's view: how much the run takes from the machine
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    root = psutil.Process(proc.pid)
    samples = []  # (round, {role: rss}, total pss)
    avail_min = avail0
    t0 = time.time()
    while proc.poll() is None:
        hits = list((tmp / "ws").glob("*/server/simulate_job/fedmed/metrics.json"))
        rnd = -1
        if hits:
            try:
                rnd = len(json.loads(hits[0].read_text()).get("rounds", [])) - 1
            except (OSError, ValueError):
                pass
        rss, pss = {}, 0
        try:
            for p in [root, *root.children(recursive=True)]:
                try:
                    info = p.memory_full_info()
                    k = role(p.cmdline())
                    if k.startswith("site template") and p.parent() and "forkserver" in " ".join(p.parent().cmdline()):
                        # forked from the template: the simulator (jobs/run.py forks it; its server and Manager are
                        # its children, forks of a fork) or a site
                        grand = p.parent().parent()
                        if grand is not None and "forkserver" in " ".join(grand.cmdline()):
                            k = "simulator server and Manager (forked)"
                        elif p.children():
                            k = "simulator (forked)"
                        else:
                            k = "site processes (forked)"
                    rss[k] = rss.get(k, 0) + info.rss
                    pss += info.pss
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    pass
        except psutil.NoSuchProcess:
            break
        samples.append((rnd, rss, pss))
        avail_min = min(avail_min, psutil.virtual_memory().available)
        time.sleep(1.0)
    at = lambda r: next((s for s in samples if s[0] >= r), None)  # noqa: E731
    live = [s for s in samples if any(k.startswith("site processes") and v > 0 for k, v in s[1].items())]
    first, last = at(a.from_round), max(live or samples, key=lambda s: s[0])
    if first is None or last[0] <= a.from_round:
        print(f"the run did not reach round {a.from_round} (last recorded {last[0]}); see {tmp}")
        return 1
    mb = lambda x: x / 2**20  # noqa: E731
    tot0, tot1 = sum(first[1].values()), sum(last[1].values())
    peak = max(sum(s[1].values()) for s in samples)
    wall = time.time() - t0
    print(f"{a.method}, {a.sites} sites, {a.rounds} rounds in the simulator"
          + (f" ({Path(a.config).name}{''.join(' --set ' + o for o in a.set)}, seed {a.seed})" if a.config else "")
          + f": {wall:.0f} s")
    hits = list((tmp / "ws").glob("*/server/simulate_job/fedmed/metrics.json"))
    if hits:  # the run's own record: did it finish, with how many sites, and what did the final model score
        doc = json.loads(hits[0].read_text())
        last_r = doc["rounds"][-1] if doc.get("rounds") else {}
        mean = last_r.get("summary", {}).get("mean", {})
        sizes = Counter(v.get("cluster") for v in last_r.get("sites", {}).values() if v.get("cluster") is not None)
        acc = mean.get("accuracy")  # None: every site withheld it (fewer than k_min test images)
        print(f"status {doc.get('status')}; final round {last_r.get('round')} ({last_r.get('task')}): "
              f"{last_r.get('summary', {}).get('n_sites')} site(s), test accuracy (site mean) "
              f"{'n/a (withheld below k_min)' if acc is None else f'{100 * acc:.2f}%'}; "
              f"{len(doc.get('errors', []))} site error(s)"
              + (f"; cluster sizes {dict(sorted(sizes.items()))}" if sizes else ""))
    print(f"| process | RSS at round {first[0]} (MB) | RSS at round {last[0]} (MB) | growth | MB per round |")
    print("|---|---|---|---|---|")
    n = last[0] - first[0]
    for k in sorted(set(first[1]) | set(last[1])):
        r0, r1 = mb(first[1].get(k, 0)), mb(last[1].get(k, 0))
        print(f"| {k} | {r0:.0f} | {r1:.0f} | {100 * (r1 - r0) / max(r0, 1e-9):+.1f}% | {(r1 - r0) / n:.3f} |")
    print(f"| **total** | {mb(tot0):.0f} | {mb(tot1):.0f} | {100 * (tot1 - tot0) / tot0:+.1f}% | {mb(tot1 - tot0) / n:.3f} |")
    step = max(10, last[0] // 10)
    marks = [s for r in range(step, last[0] + 1, step) if (s := at(r)) is not None and s[0] <= last[0]]
    print("total RSS by round (MB): " + ", ".join(f"{s[0]}: {mb(sum(s[1].values())):.0f}" for s in marks))
    sites = lambda s: sum(v for k, v in s[1].items() if k.startswith("site processes"))  # noqa: E731
    print("site processes' RSS by round (MB): " + ", ".join(f"{s[0]}: {mb(sites(s)):.0f}" for s in marks))
    print(f"peak total RSS {mb(peak):.0f} MB; peak total PSS {mb(max(s[2] for s in samples)):.0f} MB "
          f"({'plain FLARE site processes' if a.plain else 'sites forked from the template'})"
          f"{''.join(f'; {e}' for e in a.env)}")
    print(f"peak drop of the machine's available memory during the run (MemAvailable, all processes): "
          f"{mb(avail0 - avail_min):.0f} MB")
    if a.trace:
        print_trace(tmp / "trace", a.from_round)
    return 0


def print_trace(folder: Path, from_round: int) -> None:
    """Per traced process: RSS growth vs traced-Python growth, and the lines whose live allocations grew."""
    from fedmed.core import memtrace

    mb = lambda x: x / 2**20  # noqa: E731
    for log in sorted(folder.glob("*.jsonl")):
        tag = log.stem
        rounds = sorted(json.loads(line)["round"] for line in log.read_text().splitlines())
        first = min((r for r in rounds if r >= from_round), default=None)
        if first is None or rounds[-1] <= first:
            continue
        rows, tot = memtrace.compare(folder, tag, first, rounds[-1])
        n = rounds[-1] - first
        print(f"\n{tag}, rounds {first} -> {rounds[-1]}: RSS {mb(tot['rss'][0]):.0f} -> {mb(tot['rss'][1]):.0f} MB "
              f"({mb(tot['rss'][1] - tot['rss'][0]) / n:.3f} MB/round); traced Python {mb(tot['traced'][0]):.1f} -> "
              f"{mb(tot['traced'][1]):.1f} MB ({mb(tot['traced'][1] - tot['traced'][0]) / n:.3f} MB/round)")
        for where, size, count in rows:
            print(f"  {size / 1024:+9.1f} KiB {count:+7d} blocks  {where}")


def loop_reference(cfg_path, data, a) -> int:
    """The bare loop's own RSS after every round (all sites' SiteRunner calls in this one process)."""
    import psutil
    import torch

    from fedmed.config import load_config
    from fedmed.run.experiment import classes_override
    from fedmed.workflows import fedavg_in_process
    from fedmed.run.taskconfig import build_task_config

    torch.set_num_threads(1)
    exp = load_config(cfg_path, classes_override(data, load_config(cfg_path)))
    meta = json.loads((data / "dataset.json").read_text())
    cfg = build_task_config(exp, 0, exp.methods[0], meta["sites"])
    me, rss = psutil.Process(), []
    t0 = time.time()
    fedavg_in_process(cfg, data, meta["sites"], rounds=a.rounds, log=lambda _line: rss.append(me.memory_info().rss))
    mb = lambda x: x / 2**20  # noqa: E731
    r0, r1, n = rss[a.from_round], rss[-1], len(rss) - 1 - a.from_round
    print(f"FedAvg, {a.sites} sites, {a.rounds} rounds as a bare loop in one process: {time.time() - t0:.0f} s")
    print(f"RSS at round {a.from_round} {mb(r0):.0f} MB, at round {len(rss) - 1} {mb(r1):.0f} MB: "
          f"{100 * (r1 - r0) / r0:+.1f}%, {mb(r1 - r0) / n:.3f} MB per round ({mb(r1 - r0) / n / a.sites:.3f} per site)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
