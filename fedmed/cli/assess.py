"""``fedmed assess`` (the ``004_`` heterogeneity assessment of a federation's cases) and ``fedmed sweep`` (a config's
sweep of cases, each run and tabled)."""

from __future__ import annotations

import sys
from pathlib import Path


def cmd_assess(a):
    """Run the 004_ assessment locally over several sites' segmentation datalists."""
    import json

    from fedmed.algorithms.assessment import assess
    from fedmed.report.assessment_report import write_assessment_report as write_report
    from fedmed.site.seg_aggregates import site_assessment
    from fedmed.nn.encoders import build_encoder
    from fedmed.site.seg import load_datalist_seg
    from fedmed.data.nifti import load_case

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

    from fedmed.config import load_config
    from fedmed.run.experiment import read_results, run_experiment, sweep_stats, sweep_table
    from fedmed.run.records import clustering_agreement

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
    from fedmed.run.experiment import output_lock

    with output_lock(out):  # one sweep writes its table at a time (each case's folder is locked by its experiment)
        return _sweep_cases(a, cases, out, run_experiment, read_results, sweep_table, clustering_agreement, sweep_stats)


def _check_cases(a, cases) -> None:
    """Every case a sweep will run (``cases``: those chosen) is checked before the first one runs: its config validates and, for a
    classification dataset read from one path, the classes the config names are that dataset's (the check
    ``prepare_federation`` makes when the case's turn comes). A case that changed ``dataset.path`` but inherited
    another dataset's ``dataset.classes`` used to fail only then, after the cases before it had run
    (``dp_cost.yaml``'s Flux cases, after 20 minutes of FMCL runs)."""
    from fedmed.config import load_config
    from fedmed.data.images import discover
    from fedmed.run.experiment import check_classes

    found: dict = {}  # (path, max_per_class) -> class names: each dataset discovered once
    for name, sets, _ in cases:
        exp = load_config(a.config, list(a.set) + sets)
        d = exp.dataset
        if d.task != "classification" or d.sources or not d.classes or d.path is None:
            continue
        key = (d.path, d.max_per_class)
        if key not in found:
            found[key] = discover(d.path, max_per_class=d.max_per_class).class_names
        try:
            check_classes(exp, found[key])
        except ValueError as e:
            raise ValueError(f"sweep case {name!r}: {e} (set dataset.classes for the case, or dataset.classes=null); "
                             f"nothing was run") from None


def _sweep_cases(a, cases, out, run_experiment, read_results, sweep_table, clustering_agreement, sweep_stats):
    todo = [] if a.report_only else [c for c in cases if not a.cases or c[0] in a.cases]
    _check_cases(a, todo)
    for name, sets, methods in todo:
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
    agreement = clustering_agreement(parts)
    if agreement:
        text += ("### Clusters found, and agreement with the first case\n\nEach clustering method's clusters per seed "
                 "(at its final round) and the adjusted Rand index against the clusters the same method found for "
                 "the same seed in the first case it runs in.\n\n" + agreement + "\n")
    missing = [n for n, _, d in parts if not (d / "results.csv").is_file()]
    if missing:
        text += f"Not run yet: {', '.join(missing)}.\n\n"
    text += "\n".join(f"### {n} (`{' '.join('--set ' + x for x in s) or 'no overrides'}`)\n\n"
                      + (d / "summary.md").read_text().split("\n", 3)[-1] for n, s, d in done)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.md").write_text(text)
    stats = sweep_stats(results)
    if stats:
        from fedmed.report.plots import plot_sweep

        plot_sweep(stats, out / "summary.png", title=f"{Path(a.config).stem}: unseen sites and clustering")
        text += f"\nPlot: {out / 'summary.png'}\n"
    print(text)


def register_assess(sub):
    from fedmed.core.helpformat import HELP as H
    w = sub.add_parser("sweep", help="run a config's sweep cases (or a --grid); one combined summary.md", formatter_class=H)
    w.add_argument("config", help="experiment config with a sweep: block (or use --grid)")
    w.add_argument("--grid", action="append", default=[], help="key.path=v1,v2: one case per combination (repeatable; "
                   "replaces the config's cases)")
    w.add_argument("--set", action="append", default=[], help="fixed override key.path=value (repeatable)")
    w.add_argument("--methods", nargs="+", help="only these methods (of each case)")
    w.add_argument("--cases", nargs="+", help="only these of the config's sweep cases")
    w.add_argument("--resume", action="store_true", help="reuse runs finished earlier with the same settings")
    w.add_argument("--report-only", action="store_true", help="run nothing; rebuild summary.md/png from OUT")
    w.add_argument("--out", help="output folder (default results/<config name>_sweep)")
    w.set_defaults(func=cmd_sweep)

    s = sub.add_parser("assess", help="004_ site heterogeneity assessment of segmentation datalists, locally",
                       formatter_class=H)
    s.add_argument("datalists", nargs="+", help="one <site>.json segmentation datalist per site")
    s.add_argument("--out", default="results/assessment", help="report folder")
    s.add_argument("--shape", type=int, nargs=3, default=[32, 48, 40], help="resampled case shape (D H W)")
    s.add_argument("--weights", help="MedicalNet ResNet-18 weights file (default: seeded random init)")
    s.add_argument("--seed", type=int, default=0, help="seed of the random-init encoder")
    s.add_argument("--per-value", action="store_true", help="use per-image metadata values, not histograms")
    s.add_argument("--no-embeddings", action="store_true", help="metadata EMD only (no embedding distance)")
    s.set_defaults(func=cmd_assess)
