"""``fedmed experiment``: run the methods of a config over seeds through ``nvflare simulator``.

For each seed the federation is built (seeded partition -> per-site datalists), then every
method's job is built by ``jobs/build.py`` and run with ``nvflare simulator`` in a subprocess
(the same exported job folder POC and the admin console accept). Outputs in ``OUT``:

* ``results.csv`` — one row per (method, seed, round): per-site mean and std of accuracy,
  macro-F1, AUC, and the pooled (all test samples) figures;
* ``summary.md`` / ``summary.csv`` — mean ± std over seeds at each method's best round (the
  round with the highest seed-mean of the per-site mean accuracy, as FMCL §4.6 selects);
* ``curves.png`` — learning curves (mean ± std over seeds);
* ``runs/<seed>/<method>/`` — each job's ``metrics.json`` and simulator log.

fedmed itself never imports nvflare: jobs are built and run as subprocesses.
"""

from __future__ import annotations

import csv
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from .config import ExperimentConfig

__all__ = ["REPO_ROOT", "prepare_federation", "run_experiment", "summarize", "write_outputs"]

REPO_ROOT = Path(__file__).resolve().parents[1]
CLS_METRICS = ("accuracy", "macro_f1", "auc")
SEG_METRICS = ("dice_wt", "dice_tc", "dice_et", "dice_mean")
FIELDS = ["method", "seed", "round", "phase", "accuracy", "macro_f1", "auc", "accuracy_std", "macro_f1_std", "auc_std",
          "pooled_accuracy", "pooled_macro_f1", "pooled_auc", "ari", "n_sites", "n_failed"]
SEG_FIELDS = ["method", "seed", "round", *SEG_METRICS, *[f"{m}_std" for m in SEG_METRICS], "n_sites", "n_failed"]


def prepare_federation(exp: ExperimentConfig, seed: int, out_dir) -> Path:
    """Partition the dataset for ``seed`` and write the site datalists into ``out_dir``."""
    from . import partition as P
    from .data import discover, write_site_datalists

    fed = exp.federation
    if exp.dataset.task == "segmentation":
        from .seg_data import discover_subjects, write_seg_federation

        d = exp.dataset
        entries = discover_subjects(d.path, d.modalities, d.label_pattern, d.mask_pattern, d.hemispheres)
        out = Path(out_dir)
        if out.exists():
            shutil.rmtree(out)
        partition = fed.partition if fed.partition in ("iid", "label_volume") else "label_volume"
        return write_seg_federation(entries, fed.sites, out, partition=partition, region=fed.volume_region,
                                    test_fraction=fed.test_fraction, seed=seed)
    pool = discover(exp.dataset.path, max_per_class=exp.dataset.max_per_class, seed=seed)
    rng = np.random.default_rng(seed)
    transforms = None
    extra: dict = {"partition": fed.partition, "seed": seed}
    if fed.partition == "iid":
        parts = P.iid_partition(len(pool.labels), fed.sites, rng)
    elif fed.partition == "dirichlet":
        parts = P.dirichlet_label_partition(pool.labels, fed.sites, fed.alpha, rng)
    elif fed.partition == "quantity":
        parts = P.quantity_partition(len(pool.labels), fed.sites, fed.alpha, rng)
    elif fed.partition == "predi":
        res = P.predi(pool.n_classes, fed.sites, fed.predi_prevalence, fed.predi_disparity, rng)
        parts = P.predi_partition(pool.labels, res.assignment, rng, samples_per_cell=None)
        extra.update(prevalence=res.prevalence, disparity=res.disparity)
    else:  # anda
        sites = P.anda_federation(pool.labels, fed.sites + fed.unseen_sites, fed.anda_shift, rng,
                                  level=fed.anda_level, n_groups=fed.anda_groups)
        parts = [s.indices for s in sites]
        transforms = [(lambda img, lab, s=s: P.apply_anda_transform(img, lab, s)) for s in sites]
        extra.update(shift=fed.anda_shift, level=fed.anda_level)
    out = Path(out_dir)
    if out.exists():
        shutil.rmtree(out)
    names = [f"site-{k + 1}" for k in range(len(parts))]
    if fed.partition == "anda":
        groups = [s.group for s in sites]
        # held-out sites: one per group in turn, taken from the end of the site list
        unseen: list[str] = []
        order = list(range(len(names)))[::-1]
        g = 0
        while len(unseen) < fed.unseen_sites:
            pick = next((k for k in order if groups[k] == g % fed.anda_groups and names[k] not in unseen), None)
            if pick is not None:
                unseen.append(names[pick])
            g += 1
        unseen_names = [f"unseen-{j + 1}" for j in range(len(unseen))]
        rename = dict(zip(unseen, unseen_names))
        names = [rename.get(n, n) for n in names]
        extra.update(groups=dict(zip(names, groups)), unseen_sites=unseen_names)
    write_site_datalists(pool, parts, out, test_fraction=fed.test_fraction, seed=seed, transforms=transforms,
                         extra=extra, site_names=names)
    meta_path = out / "dataset.json"
    import json as _json

    meta = _json.loads(meta_path.read_text())
    meta["sites"] = [n for n in names if not n.startswith("unseen-")]
    meta_path.write_text(_json.dumps(meta, indent=1))
    return out


def job_clients(job: Path) -> list[str]:
    meta = json.loads((job / "meta.json").read_text())
    return sorted({s for t in meta.get("deploy_map", {}).values() for s in t if s not in ("server", "@ALL")})


def simulator_cmd(job: Path, ws: Path) -> list[str]:
    clients = job_clients(job)
    return [str(Path(sys.executable).parent / "nvflare"), "simulator", str(job), "-w", str(ws), "-c", ",".join(clients),
            "-t", str(len(clients))]


def _run(cmd, log: Path, timeout: int) -> float:
    t0 = time.time()
    with log.open("w") as fh:
        proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout, cwd=REPO_ROOT)
    if proc.returncode != 0:
        tail = log.read_text()[-2000:]
        raise RuntimeError(f"command failed ({proc.returncode}): {' '.join(map(str, cmd))}\n--- {log} (tail) ---\n{tail}")
    return time.time() - t0


def run_job(config_path: str, overrides: list[str], method: str, seed: int, datalists: Path, work: Path,
            n_sites: int = 0, timeout: int = 3600, extra_build_args: list[str] | None = None) -> dict:
    """Build one (method, seed) job with ``jobs/build.py`` and run it in ``nvflare simulator``.

    Keeps the server's ``fedmed/`` output (metrics.json, reports, plots, tb/, models/) under
    ``work/server`` and returns the ``metrics.json`` document; the simulator workspace is deleted.
    ``n_sites`` is informational (the clients come from the job's deploy map).
    """
    work.mkdir(parents=True, exist_ok=True)
    jobs_dir = work / "job"
    build = [sys.executable, str(REPO_ROOT / "jobs" / "build.py"), "--config", str(config_path), "--datalists",
             str(datalists), "--out", str(jobs_dir), "--method", method, "--seed", str(seed), *(extra_build_args or [])]
    for o in overrides:
        build += ["--set", o]
    _run(build, work / "build.log", 600)
    job = next(p for p in jobs_dir.iterdir() if p.is_dir())
    ws = work / "workspace"
    if ws.exists():
        shutil.rmtree(ws)
    secs = _run(simulator_cmd(job, ws), work / "simulator.log", timeout)
    produced = ws / "server" / "simulate_job" / "fedmed"
    metrics = produced / "metrics.json"
    if not metrics.is_file():
        raise RuntimeError(f"{job.name}: the simulator finished without writing {metrics}; see {work / 'simulator.log'}")
    keep = work / "server"
    if keep.exists():
        shutil.rmtree(keep)
    shutil.copytree(produced, keep)
    shutil.copy(metrics, work / "metrics.json")
    shutil.rmtree(ws, ignore_errors=True)  # workspaces are large; metrics.json and logs are kept
    doc = json.loads((work / "metrics.json").read_text())
    doc["wall_seconds"] = secs
    return doc


def run_test_job(config_path, overrides, method, seed, datalists: Path, work: Path, training: Path, known: dict,
                 sizes: dict, n_sites: int = 0) -> dict:
    """The unseen-site job (Flux Algorithm 2, or the baselines' counterpart) after a training job."""
    extra = ["--test-phase", "--training-result", str(training.resolve()), "--known-clusters", json.dumps(known),
             "--cluster-sizes", json.dumps(sizes)]
    return run_job(config_path, overrides, method, seed, datalists, work, n_sites, 1800, extra)


def training_assignment(doc: dict, workflow: str) -> dict:
    """site -> cluster after training (Flux: its assignment; IFCA: last training round's choice)."""
    if workflow == "flux":
        return {k: int(v) for k, v in doc.get("assignment", {}).items()}
    if workflow == "ifca":
        train_rounds = [r for r in doc["rounds"] if r["task"] == "train"]
        return {s: int(v["cluster"]) for s, v in train_rounds[-1]["sites"].items()} if train_rounds else {}
    return {s: 0 for s in doc["rounds"][-1]["sites"]}


def known_association(groups: dict, assign: dict, unseen: list) -> dict:
    """unseen site -> the cluster most training sites of its true group ended in."""
    out = {}
    for u in unseen:
        votes = [assign[s] for s, g in groups.items() if g == groups[u] and s in assign]
        if votes:
            out[u] = int(max(set(votes), key=lambda c: (votes.count(c), -c)))
    return out


def rows_from_metrics(method: str, seed: int, doc: dict) -> list[dict]:
    rows = []
    failed_by_round: dict[int, int] = {}
    for e in doc.get("errors", []):
        failed_by_round[e["round"]] = failed_by_round.get(e["round"], 0) + 1
    for r in doc["rounds"]:
        s = r["summary"]
        row = {"method": method, "seed": seed, "round": r["round"], "n_sites": s["n_sites"],
               "n_failed": failed_by_round.get(r["round"], 0)}
        keys = SEG_METRICS if any(k.startswith("dice") for k in s["mean"]) else CLS_METRICS
        for m in keys:
            row[m] = s["mean"].get(m, float("nan"))
            row[f"{m}_std"] = s["std"].get(m, float("nan"))
            if keys is CLS_METRICS:
                row[f"pooled_{m}"] = s.get("pooled", {}).get(m, float("nan"))
        row["sites"] = {site: {k: v.get(k) for k in keys} for site, v in r.get("sites", {}).items()}
        rows.append(row)
    return rows


def _fmt(vals) -> str:
    vals = [v for v in vals if v is not None and math.isfinite(v)]
    if not vals:
        return "n/a"
    return f"{100 * np.mean(vals):.2f} ± {100 * np.std(vals):.2f}"


def _is_seg(rows) -> bool:
    return bool(rows) and "dice_mean" in rows[0]


def summarize_phases(rows: list[dict]) -> str:
    """Flux-style table: clustering ARI, known-association and test-phase accuracy on unseen sites."""
    phased = [r for r in rows if r.get("phase")]
    if not phased:
        return ""
    lines = ["| Method | Clustering ARI | Known assoc. acc | Test phase acc | Known assoc. F1 | Test phase F1 |",
             "|---|---|---|---|---|---|"]
    for m in dict.fromkeys(r["method"] for r in phased):
        get = lambda ph, k: [r[k] for r in phased if r["method"] == m and r["phase"] == ph]  # noqa: E731
        aris = [r["ari"] for r in phased if r["method"] == m and r["phase"] == "test phase"]
        ari = f"{np.mean(aris):.2f} ± {np.std(aris):.2f}" if aris else "n/a"
        lines.append(f"| {m} | {ari} | {_fmt(get('known assoc.', 'accuracy'))} | {_fmt(get('test phase', 'accuracy'))} | "
                     f"{_fmt(get('known assoc.', 'macro_f1'))} | {_fmt(get('test phase', 'macro_f1'))} |")
    return "\n".join(lines) + "\n"


def read_results(path) -> list[dict]:
    """Rows of a ``results.csv`` written by :func:`write_outputs` (numbers parsed, empty cells dropped)."""
    rows = []
    with Path(path).open(newline="") as fh:
        for r in csv.DictReader(fh):
            row = {}
            for k, v in r.items():
                if v in ("", None):
                    continue
                if k in ("method", "phase"):
                    row[k] = v
                else:
                    row[k] = int(v) if k in ("seed", "round", "n_sites", "n_failed") else float(v)
            rows.append(row)
    return rows


def sweep_table(cases: list[tuple[str, list[str], list[dict]]]) -> str:
    """One table over a sweep's cases: per case and method, the clustering ARI against the true groups, the
    trained sites' accuracy at the best round, and the unseen sites' known-association / test-phase accuracy
    (mean ± std over seeds, accuracies in %)."""
    lines = ["| Case | Method | Seeds | Clustering ARI | Trained sites acc | Unseen: known assoc. acc | "
             "Unseen: test phase acc |", "|---|---|---|---|---|---|---|"]
    for name, sets, rows in cases:
        summ = {s["method"]: s for s in summarize(rows)}
        stats = sweep_stats([(name, sets, rows)])

        def cell(panel, m, scale):
            mu, sd = stats.get(panel, {}).get(name, {}).get(m, (None, None))
            return "n/a" if mu is None else f"{scale * mu:.2f} ± {scale * sd:.2f}"

        for m in dict.fromkeys(r["method"] for r in rows):
            s = summ.get(m, {})
            lines.append(f"| {name} | {m} | {s.get('seeds', 0)} | {cell(ARI_PANEL, m, 1)} | "
                         f"{s.get('accuracy', 'n/a')} | {cell(KNOWN_PANEL, m, 100)} | {cell(TEST_PANEL, m, 100)} |")
    return "\n".join(lines) + "\n"


TEST_PANEL, KNOWN_PANEL, ARI_PANEL = ("unseen sites: test phase accuracy", "unseen sites: known assoc. accuracy",
                                      "clustering ARI vs true groups")


def sweep_stats(cases: list[tuple[str, list[str], list[dict]]]) -> dict:
    """The numbers behind :func:`fedmed.plots.plot_sweep`: per panel, case and method, (mean, std) over seeds."""
    panels = {TEST_PANEL: "test phase", KNOWN_PANEL: "known assoc.", ARI_PANEL: None}
    out: dict = {p: {} for p in panels}
    for name, _, rows in cases:
        for m in dict.fromkeys(r["method"] for r in rows if r.get("phase")):
            for panel, phase in panels.items():
                if phase is None:
                    vals = [r["ari"] for r in rows if r["method"] == m and r.get("phase") == "test phase" and "ari" in r]
                else:
                    vals = [r["accuracy"] for r in rows if r["method"] == m and r.get("phase") == phase]
                vals = [v for v in vals if v is not None and math.isfinite(v)]
                if vals:
                    out[panel].setdefault(name, {})[m] = (float(np.mean(vals)), float(np.std(vals)))
    return {p: v for p, v in out.items() if v}


def summarize(rows: list[dict]) -> list[dict]:
    """Per method: the round with the best seed-mean per-site accuracy (Dice for segmentation),
    mean ± std over seeds there."""
    rows = [r for r in rows if not r.get("phase")]
    if _is_seg(rows):
        return summarize_seg(rows)
    out = []
    methods = list(dict.fromkeys(r["method"] for r in rows))
    for m in methods:
        mr = [r for r in rows if r["method"] == m]
        rounds = sorted({r["round"] for r in mr})
        means = {k: np.nanmean([r["accuracy"] for r in mr if r["round"] == k]) for k in rounds}
        best = max(rounds, key=lambda k: (means[k] if math.isfinite(means[k]) else -1, -k))
        at = [r for r in mr if r["round"] == best]
        last = [r for r in mr if r["round"] == rounds[-1]]
        out.append({"method": m, "best_round": best, "seeds": len(at),
                    **{k: _fmt([r[k] for r in at]) for k in ("accuracy", "macro_f1", "auc", "pooled_accuracy",
                                                             "pooled_macro_f1", "pooled_auc")},
                    "final_accuracy": _fmt([r["accuracy"] for r in last])})
    return out


def summarize_seg(rows: list[dict]) -> list[dict]:
    """``004_`` Tables 3/4: Dice at the final round, mean ± std over seeds, plus per-site Dice."""
    out = []
    for m in dict.fromkeys(r["method"] for r in rows):
        mr = [r for r in rows if r["method"] == m]
        last = max(r["round"] for r in mr)
        at = [r for r in mr if r["round"] == last]
        entry = {"method": m, "best_round": last, "seeds": len(at), **{k: _fmt([r[k] for r in at]) for k in SEG_METRICS}}
        sites = sorted({s for r in at for s in r.get("sites", {})})
        for s in sites:
            entry[f"{s} dice_mean"] = _fmt([r["sites"][s]["dice_mean"] for r in at if s in r.get("sites", {})])
        out.append(entry)
    return out


def write_outputs(rows: list[dict], out_dir, *, title: str, command: str, notes: list[str] | None = None) -> str:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if _is_seg(rows):
        return write_seg_outputs(rows, out, title=title, command=command, notes=notes)
    with (out / "results.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k) for k in FIELDS})
    summ = summarize(rows)
    with (out / "summary.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(summ[0]))
        w.writeheader()
        w.writerows(summ)
    head = ("| Method | Best round | Acc (site mean) | Macro-F1 | AUC | Pooled Acc | Pooled F1 | Pooled AUC |\n"
            "|---|---|---|---|---|---|---|---|\n")
    body = "".join(f"| {s['method']} | {s['best_round']} | {s['accuracy']} | {s['macro_f1']} | {s['auc']} | "
                   f"{s['pooled_accuracy']} | {s['pooled_macro_f1']} | {s['pooled_auc']} |\n" for s in summ)
    text = (f"## {title}\n\nProduced by: `{command}`\n\nValues in %, mean ± std over {summ[0]['seeds']} seed(s) at each "
            f"method's best round; per-site metrics are averaged over sites first (each site scores the model it is "
            f"served on its own test split), pooled metrics use all sites' test samples.\n\n" + head + body)
    phases = summarize_phases(rows)
    if phases:
        text += ("\n### Unseen sites (test-time assignment)\n\nAccuracy in %, mean ± std over seeds of the mean over "
                 "unseen sites (scored on all their data). Known assoc.: the cluster model of the site's true group; "
                 "test phase: the model the method assigns without labels (Flux: nearest label-free centroid, Eq. 9; "
                 "FedAvg: the global model; IFCA: the cluster models' outputs weighted by cluster size). ARI: the "
                 "training clustering against the true groups.\n\n" + phases)
    if notes:
        text += "\n" + "\n".join(f"- {n}" for n in notes) + "\n"
    (out / "summary.md").write_text(text)
    plot_curves([r for r in rows if not r.get("phase")], out / "curves.png", title)
    return text


def write_seg_outputs(rows, out: Path, *, title: str, command: str, notes=None) -> str:
    with (out / "results.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=SEG_FIELDS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    summ = summarize_seg(rows)
    sites = sorted({k.split(" ")[0] for s in summ for k in s if k.endswith(" dice_mean")})
    head = ("| Method | WT | TC | ET | Mean Dice |" + "".join(f" {s} |" for s in sites) + "\n"
            + "|---" * (5 + len(sites)) + "|\n")
    body = "".join(f"| {s['method']} | {s['dice_wt']} | {s['dice_tc']} | {s['dice_et']} | {s['dice_mean']} |"
                   + "".join(f" {s.get(f'{x} dice_mean', 'n/a')} |" for x in sites) + "\n" for s in summ)
    text = (f"## {title}\n\nProduced by: `{command}`\n\nDice in %, at the final round, mean ± std over "
            f"{summ[0]['seeds']} seed(s); region columns and Mean Dice average the sites (each site scores the model "
            f"it is served — global, its cluster's, or its Ditto personal model — on its own test cases); the "
            f"site columns give each site's mean Dice over WT/TC/ET.\n\n" + head + body)
    if notes:
        text += "\n" + "\n".join(f"- {n}" for n in notes) + "\n"
    (out / "summary.md").write_text(text)
    return text


def plot_curves(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for m in dict.fromkeys(r["method"] for r in rows):
        mr = [r for r in rows if r["method"] == m]
        rounds = sorted({r["round"] for r in mr})
        for ax, key in zip(axes, ("accuracy", "pooled_macro_f1")):
            vals = [[r[key] for r in mr if r["round"] == k] for k in rounds]
            mu = np.array([np.nanmean(v) for v in vals])
            sd = np.array([np.nanstd(v) for v in vals])
            ax.plot(rounds, mu, label=m)
            ax.fill_between(rounds, mu - sd, mu + sd, alpha=0.15)
    axes[0].set_ylabel("accuracy (mean over sites)")
    axes[1].set_ylabel("pooled macro-F1")
    for ax in axes:
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_fingerprint(exp, method, seed: int) -> str:
    """What determines one (seed, method) run: the resolved config (less the other methods, the seed list
    and the sweep block), the method's settings and the seed. ``--resume`` reuses a run only when this matches.
    The files under ``dataset.path`` are not hashed: a dataset replaced in place needs a run without ``--resume``."""
    import hashlib

    cfg = exp.model_dump(mode="json", exclude={"methods", "seeds", "sweep", "name"})
    blob = json.dumps({"config": cfg, "method": method.model_dump(mode="json"), "seed": seed}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def run_experiment(config_path: str, out_dir, *, overrides: list[str] | None = None, methods: list[str] | None = None,
                   log=print, resume: bool = False) -> list[dict]:
    """Run every (seed, method) of the config; returns the result rows and writes the outputs.

    Each finished run leaves ``runs/seed<S>/<method>/run.json`` (its fingerprint and result rows). With
    ``resume=True`` a run whose stored fingerprint matches the current config is not run again; its rows are
    reused (a changed setting, seed or method definition changes the fingerprint, so stale runs are redone).
    """
    from .config import load_config

    overrides = list(overrides or [])
    exp = load_config(config_path, overrides)
    chosen = [m for m in exp.methods if not methods or m.name in methods]
    if methods and len(chosen) != len(methods):
        raise ValueError(f"unknown method(s) {sorted(set(methods) - {m.name for m in exp.methods})} in {config_path}")
    out = Path(out_dir)
    rows: list[dict] = []
    total = len(exp.seeds) * len(chosen)
    k = 0
    for seed in exp.seeds:
        data_dir = prepare_federation(exp, seed, out / "data" / f"seed{seed}")
        log(f"[seed {seed}] federation: {exp.federation.sites} sites, {exp.federation.partition} partition -> {data_dir}")
        for m in chosen:
            k += 1
            work = out / "runs" / f"seed{seed}" / "".join(c if c.isalnum() else "_" for c in m.name)
            fp = run_fingerprint(exp, m, seed)
            saved = work / "run.json"
            if resume and saved.is_file():
                try:
                    prev = json.loads(saved.read_text())
                except (OSError, ValueError):
                    prev = {}
                if prev.get("fingerprint") == fp:
                    rows.extend(prev["rows"])
                    log(f"[{k}/{total}] seed {seed} {m.name}: finished earlier with the same settings, reused ({saved})")
                    continue
                log(f"[{k}/{total}] seed {seed} {m.name}: {saved} was made with other settings, running again")
            if saved.is_file():
                saved.unlink()
            first = len(rows)
            log(f"[{k}/{total}] seed {seed} {m.name} ({m.workflow}, {exp.train.rounds} rounds) ...", )
            doc = run_job(str(config_path), overrides, m.name, seed, data_dir, work, exp.federation.sites)
            new = rows_from_metrics(m.name, seed, doc)
            rows.extend(new)
            if not new:  # an assessment-only job
                a = doc.get("assessment", {})
                log(f"    done in {doc['wall_seconds']:.0f} s: " + "; ".join(
                    f"{k.upper()} most distant {v.get('most_distant')}, clusters {v.get('clusters')}"
                    for k, v in a.items() if isinstance(v, dict)) + f" (report: {work / 'server' / 'assessment'})")
                saved.write_text(json.dumps({"fingerprint": fp, "method": m.name, "seed": seed, "rows": []}))
                continue
            last = new[-1]
            errs = len(doc.get("errors", []))
            meta = json.loads((data_dir / "dataset.json").read_text())
            if meta.get("unseen_sites") and m.workflow in ("flux", "ifca", "fedavg", "fedprox"):
                from sklearn.metrics import adjusted_rand_score

                assign = training_assignment(doc, m.workflow)
                groups = meta["groups"]
                trained = sorted(assign)
                ari = float(adjusted_rand_score([groups[x] for x in trained], [assign[x] for x in trained]))
                for row in new:
                    row["ari"] = ari
                known = known_association(groups, assign, meta["unseen_sites"])
                sizes = {str(c): sum(1 for v in assign.values() if v == c) for c in set(assign.values())}
                tdoc = run_test_job(str(config_path), overrides, m.name, seed, data_dir, work / "test_phase",
                                    work / "server", known, sizes, len(meta["unseen_sites"]))
                for r in tdoc["rounds"]:
                    phase = {"test_phase": "test phase", "known_association": "known assoc."}[r["task"]]
                    rows.append({"method": m.name, "seed": seed, "round": last["round"], "phase": phase, "ari": ari,
                                 **{k: r["summary"]["mean"].get(k) for k in CLS_METRICS},
                                 **{f"pooled_{k}": r["summary"].get("pooled", {}).get(k) for k in CLS_METRICS}})
                log(f"    clustering ARI vs true groups {ari:.2f}; unseen sites: " + ", ".join(
                    f"{r['task']} accuracy {r['summary']['mean']['accuracy']:.3f}" for r in tdoc["rounds"]))
            key = "dice_mean" if "dice_mean" in last else "accuracy"
            log(f"    done in {doc['wall_seconds']:.0f} s: final {key} {last[key]:.3f} (site mean)"
                + (f", pooled {last['pooled_accuracy']:.3f}" if key == "accuracy" else "")
                + (f"; {errs} site error(s), see metrics.json" if errs else ""))
            saved.write_text(json.dumps({"fingerprint": fp, "method": m.name, "seed": seed, "rows": rows[first:]}))
            write_outputs(rows, out, title=exp.name, command=_command(config_path, overrides))
    if rows:  # once more, so that a fully reused experiment still has its outputs
        write_outputs(rows, out, title=exp.name, command=_command(config_path, overrides))
    return rows


def _command(config_path, overrides) -> str:
    return " ".join(["fedmed experiment", str(config_path), *[f"--set {o}" for o in overrides]])
