"""Workflow verbs of the CLI: ``data``, ``experiment``, ``demo``."""

from __future__ import annotations

import sys
from pathlib import Path

from .experiment import REPO_ROOT


def cmd_data(a):
    from .config import load_config
    from .experiment import prepare_federation

    overrides = list(a.set)
    if a.dataset:
        overrides.append(f"dataset.path={a.dataset}")
    if a.config:
        exp = load_config(a.config, overrides)
    else:
        raw = {"name": "data", "dataset": {"path": a.dataset}, "federation": {"sites": a.sites, "partition": a.partition,
                                                                               "alpha": a.alpha}}
        exp = load_config(raw, a.set)
    out = prepare_federation(exp, a.seed, a.out)
    import json

    meta = json.loads((out / "dataset.json").read_text())
    print(f"wrote {len(meta['sites'])} site datalists to {out}")
    if meta.get("task") == "segmentation":
        for s in meta["sites"]:
            vols = meta.get("site_volumes_mm3", {}).get(s)
            print(f"  {s}: samples {meta['site_samples'][s]}" + (f", {meta['region']} volumes (mm^3) {vols}" if vols else ""))
        return
    for s in meta["sites"] + meta.get("unseen_sites", []):
        doc = json.loads((out / f"{s}.json").read_text())
        counts = {}
        for e in doc["training"] + doc["validation"] + doc["test"]:
            counts[e["label"]] = counts.get(e["label"], 0) + 1
        print(f"  {s}: {len(doc['training'])} train / {len(doc['validation'])} validation / {len(doc['test'])} test, "
              f"classes {dict(sorted(counts.items()))}")


def cmd_experiment(a):
    from .experiment import run_experiment

    out = a.out or str(Path("results") / Path(a.config).stem)
    try:
        run_experiment(a.config, out, overrides=a.set, methods=a.methods, resume=a.resume)
    finally:
        if (Path(out) / "summary.md").is_file():
            print((Path(out) / "summary.md").read_text())


def cmd_demo(a):
    from .experiment import run_experiment

    cfg = REPO_ROOT / "app_configs" / "demo_digits.yaml"
    if not cfg.is_file():
        raise FileNotFoundError(f"{cfg}: the demo config ships with the repository; run from a clone")
    overrides = list(a.set)
    if a.data:
        overrides += [f"dataset.path={a.data}", "dataset.image_size=32", "dataset.max_per_class=40"]
    out = Path(a.out)
    print(f"fedmed demo: {'sklearn digits (offline, bundled)' if not a.data else a.data} -> {out}", flush=True)
    print("\n== 1. Classification: FedAvg, FedProx and FMCL (one-shot clustering) ==", flush=True)
    run_experiment(str(cfg), out / "classification", overrides=overrides)
    import json

    for doc in sorted((out / "classification" / "runs" / "seed0").glob("FMCL*/metrics.json")):
        c = json.loads(doc.read_text()).get("clustering", {})
        print(f"FMCL clusters found once, before training ({c.get('rule')}; encoder {', '.join(c.get('encoder', []))}): "
              f"{c.get('clusters')}")
    print()
    print((out / "classification" / "summary.md").read_text())

    print("== 2. Segmentation: 004_ site assessment (synthetic NIfTI phantoms, 4 sites) ==", flush=True)
    from .phantoms import write_phantom_subjects

    phantoms = out / "phantoms"
    write_phantom_subjects(phantoms, [0, 2, 2, 3, 3, 3, 4, 4, 4, 9, 10, 11], size=24)
    seg_cfg = REPO_ROOT / "app_configs" / "demo_seg_phantoms.yaml"
    run_experiment(str(seg_cfg), out / "segmentation", overrides=[f"dataset.path={phantoms.resolve()}"])
    report = next((out / "segmentation" / "runs").rglob("report.md"), None)
    if report:
        print(report.read_text())
    print("(site-4 holds the largest lesions by construction, so the metadata EMD names it most distant; the "
          "embedding distance uses a randomly initialised MedicalNet here and need not agree)")

    print("\n== 3. Flux: clustering during training and unseen-site assignment (digits, ANDA feature shift) ==",
          flush=True)
    flux_cfg = REPO_ROOT / "app_configs" / "demo_flux_digits.yaml"
    run_experiment(str(flux_cfg), out / "flux")

    run = out / "flux" / "runs" / "seed0" / "Flux"
    train = json.loads((run / "metrics.json").read_text())
    test = json.loads((run / "test_phase" / "metrics.json").read_text())
    groups = json.loads((out / "flux" / "data" / "seed0" / "dataset.json").read_text())["groups"]
    print(f"clusters found in training: {train['clustering']['clusters']} (true groups: "
          f"{ {g: [s for s, x in groups.items() if x == g and not s.startswith('unseen')] for g in sorted(set(groups.values()))} })")
    for u, c in test["assignment"]["test_phase"].items():
        print(f"  {u} (true group {groups[u]}, no labels used) -> cluster {c}: {train['clustering']['clusters'][c]}")
    print((out / "flux" / "summary.md").read_text())


def register(sub):
    d = sub.add_parser("data", help="write per-site datalists (dataset + partition)")
    d.add_argument("--config", help="experiment config (dataset and federation sections are used)")
    d.add_argument("--dataset", help="dataset path or builtin:digits (overrides the config's)")
    d.add_argument("--sites", type=int, default=4)
    d.add_argument("--partition", default="iid", choices=["iid", "dirichlet", "quantity", "predi", "anda"])
    d.add_argument("--alpha", type=float, default=0.5)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--out", required=True)
    d.add_argument("--set", action="append", default=[], help="config override key.path=value")
    d.set_defaults(func=cmd_data)

    e = sub.add_parser("experiment", help="run a config's methods over seeds in nvflare simulator")
    e.add_argument("config")
    e.add_argument("--out", help="output folder (default results/<config name>)")
    e.add_argument("--methods", nargs="+", help="run only these methods")
    e.add_argument("--set", action="append", default=[], help="config override key.path=value (repeatable)")
    e.add_argument("--resume", action="store_true", help="reuse runs finished earlier with the same settings; "
                   "continue stopped ones from their checkpoint")
    e.set_defaults(func=cmd_experiment)

    m = sub.add_parser("demo", help="the embedded demo: a small federation, each method's results table")
    m.add_argument("--data", help="a dataset folder instead of the bundled digits, e.g. ../shared/data/busi")
    m.add_argument("--out", default="results/demo")
    m.add_argument("--set", action="append", default=[], help="config override key.path=value")
    m.set_defaults(func=cmd_demo)
    register_assess(sub)
    return sys.modules[__name__]


def cmd_assess(a):
    """Run the 004_ assessment locally over several sites' segmentation datalists."""
    import json

    from .assessment import assess, site_assessment, write_report
    from .encoders import build_encoder
    from .seg_site import load_datalist_seg
    from .seg import load_case

    enc = None if a.no_embeddings else build_encoder("medicalnet_resnet18", weights=a.weights, seed=a.seed)
    sites, errors = {}, {}
    for path in a.datalists:
        p = Path(path)
        name = p.stem
        try:
            doc = load_datalist_seg(p)
            cases = [load_case(e, shape=tuple(a.shape), site=name)
                     for e in doc["training"] + doc["validation"] + doc["test"]]
            if not cases:
                raise ValueError(f"{name}: datalist {p} lists no cases")
            sites[name] = site_assessment(cases, enc, per_value=a.per_value)
            print(f"{name}: {len(cases)} cases assessed", flush=True)
        except ValueError as e:  # one bad site is reported; the others go on
            errors[name] = str(e)
            print(f"{name}: skipped ({e})", file=sys.stderr)
    report = assess(sites)
    write_report(report, a.out)
    summary = {k: {kk: v for kk, v in report[k].items() if kk in ("most_distant", "clusters", "max_intensity",
                                                                  "max_label", "encoder")}
               for k in ("emd", "euc") if k in report}
    print(json.dumps({"sites": report["sites"], **summary, "errors": errors, "report": str(Path(a.out) / "report.md")},
                     indent=2))


def cmd_sweep(a):
    """Run a committed sweep: the config's ``sweep`` cases, or every combination of ``--grid`` values.

    Each case runs as ``fedmed experiment`` into ``OUT/<case>``; ``--resume`` skips runs already finished with
    the same settings, ``--cases`` runs a subset. The combined ``OUT/summary.md`` has one table over all cases
    that have results (methods x cases: clustering ARI, trained-site accuracy, unseen-site accuracy), followed by
    each case's own tables.
    """
    import itertools

    from .config import load_config
    from .experiment import read_results, run_experiment, sweep_stats, sweep_table

    if a.grid:
        grid = []
        for g in a.grid:
            if "=" not in g:
                raise ValueError(f"--grid {g!r} should look like key.path=v1,v2")
            k, vals = g.split("=", 1)
            grid.append([(k, v) for v in vals.split(",")])
        cases = [("_".join(f"{k.split('.')[-1]}-{v}" for k, v in combo), [f"{k}={v}" for k, v in combo], None)
                 for combo in itertools.product(*grid)]
    else:
        exp = load_config(a.config, list(a.set))
        cases = [(c.name, list(c.set), c.methods) for c in exp.sweep] or [("base", [], None)]
    known = [c[0] for c in cases]
    if a.cases:
        unknown = sorted(set(a.cases) - set(known))
        if unknown:
            raise ValueError(f"--cases: unknown case(s) {unknown}; {a.config} defines {known}")
    out = Path(a.out or Path("results") / (Path(a.config).stem + "_sweep"))
    for name, sets, methods in cases:
        if a.report_only or (a.cases and name not in a.cases):
            continue
        chosen = [m for m in methods if m in a.methods] if methods and a.methods else methods or a.methods
        if chosen == []:
            continue  # --methods leaves nothing of this case
        print(f"== {name} ({', '.join(sets) or 'no overrides'}) ==", flush=True)
        run_experiment(a.config, out / name, overrides=list(a.set) + sets, methods=chosen, resume=a.resume)
    parts = [(name, sets, out / name) for name, sets, _ in cases]
    done = [(n, s, d) for n, s, d in parts if (d / "results.csv").is_file()]
    results = [(n, s, read_results(d / "results.csv")) for n, s, d in done]
    cmd = " ".join(["fedmed sweep", a.config, *[f"--grid {g}" for g in a.grid], *[f"--set {x}" for x in a.set]])
    text = (f"# {Path(a.config).stem} sweep\n\nProduced by: `{cmd}` (cases below; `--resume` reuses finished runs)"
            f"\n\n" + sweep_table(results) + "\n")
    missing = [n for n, _, d in parts if not (d / "results.csv").is_file()]
    if missing:
        text += f"Not run yet: {', '.join(missing)}.\n\n"
    text += "\n".join(f"### {n} (`{' '.join('--set ' + x for x in s) or 'no overrides'}`)\n\n"
                      + (d / "summary.md").read_text().split("\n", 3)[-1] for n, s, d in done)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.md").write_text(text)
    stats = sweep_stats(results)
    if stats:
        from .plots import plot_sweep

        plot_sweep(stats, out / "summary.png", title=f"{Path(a.config).stem}: unseen sites and clustering")
        text += f"\nPlot: {out / 'summary.png'}\n"
    print(text)


def register_assess(sub):
    w = sub.add_parser("sweep", help="run a config once per combination of overrides; combined summary.md")
    w.add_argument("config")
    w.add_argument("--grid", action="append", default=[], help="key.path=v1,v2 (repeatable)")
    w.add_argument("--set", action="append", default=[], help="fixed override key.path=value")
    w.add_argument("--methods", nargs="+", help="only these methods (of each case)")
    w.add_argument("--cases", nargs="+", help="only these of the config's sweep cases")
    w.add_argument("--resume", action="store_true", help="reuse runs finished earlier with the same settings")
    w.add_argument("--report-only", action="store_true", help="run nothing; rebuild summary.md/png from OUT")
    w.add_argument("--out")
    w.set_defaults(func=cmd_sweep)

    s = sub.add_parser("assess", help="004_ site heterogeneity assessment of segmentation datalists, locally")
    s.add_argument("datalists", nargs="+", help="one <site>.json segmentation datalist per site")
    s.add_argument("--out", default="results/assessment")
    s.add_argument("--shape", type=int, nargs=3, default=[32, 48, 40])
    s.add_argument("--weights", help="MedicalNet ResNet-18 weights file (default: seeded random init)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--per-value", action="store_true", help="use per-image metadata values, not histograms")
    s.add_argument("--no-embeddings", action="store_true")
    s.set_defaults(func=cmd_assess)
