"""The ``fedmed`` command line.

Verbs: ``cluster``, ``distances``, ``partition`` (the papers' math on files), ``data`` (per-site
datalists), ``experiment`` (methods x seeds through NVFlare), ``assess`` (segmentation site
heterogeneity), ``demo``. Errors in user input print one line naming the file/parameter and exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from fedmed.core.errors import FedmedError
from fedmed.core.helpformat import HELP  # one formatter for every verb and the job scripts

__all__ = ["main"]


def _print_json(obj):
    from fedmed.core.io import json_default

    print(json.dumps(obj, indent=2, default=json_default))


# ---------------------------------------------------------------------------------------- cluster

def cmd_cluster(a):
    from fedmed.algorithms import clustering
    from fedmed.core.io import read_distance_csv

    method = a.method
    uses = {"--k": method == "agglomerative", "--threshold": method == "agglomerative",
            "--k-max": method == "auto-k", "--rule": method == "farthest-split", "--scale": method == "dbscan",
            "--linkage": method in ("agglomerative", "auto-k"), "--k1-silhouette": method == "auto-k"}
    given = {"--k": a.k is not None, "--threshold": a.threshold is not None, "--k-max": a.k_max is not None,
             "--rule": a.rule != "objective", "--scale": a.scale != 1.0, "--linkage": a.linkage != "average",
             "--k1-silhouette": a.k1_silhouette != 0.5}
    bad = [f for f, g in given.items() if g and not uses[f]]
    if bad:
        hint = " (auto-k chooses K itself; --k-max bounds it)" if "--k" in bad and method == "auto-k" else ""
        raise ValueError(f"{', '.join(bad)} does not apply to --method {method}{hint}")
    names, D = read_distance_csv(a.dist)
    out: dict = {"method": method, "sites": names}
    if method == "farthest-split":
        res = clustering.farthest_split(D, rule=a.rule)
        out.update(most_distant=names[res["most_distant"]], clusters=[[names[i] for i in c] for c in res["clusters"]],
                   rule=res["rule"], column_sums=dict(zip(names, np.asarray(D).sum(0).tolist())))
    elif method == "agglomerative":
        if a.k is None and a.threshold is None:
            raise ValueError("--method agglomerative needs --k or --threshold.")
        labels = clustering.agglomerative(D, n_clusters=a.k, threshold=a.threshold, linkage_method=a.linkage)
        out.update(clusters=clustering.labels_to_clusters(labels, names), linkage=a.linkage)
    elif method == "auto-k":
        res = clustering.auto_k(D, linkage_method=a.linkage, k_max=a.k_max,
                                k1_silhouette=a.k1_silhouette if a.k1_silhouette >= 0 else None)
        out.update(clusters=clustering.labels_to_clusters(res.labels, names), k=res.k, cv=res.cv, window=res.window,
                   silhouette={str(k): v for k, v in res.scores.items()}, local_maxima=res.local_maxima, rule=res.rule)
    elif method == "dbscan":
        res = clustering.adaptive_dbscan(D, precomputed=True, scale=a.scale)
        out.update(clusters=clustering.labels_to_clusters(res["labels"], names), eps=res["eps"],
                   eps_source=res["eps_source"], n_noise=res["n_noise"])
    _print_json(out)


# -------------------------------------------------------------------------------------- distances

def cmd_distances(a):
    import inspect

    import fedmed.methods  # noqa: F401  (each method's module registers its signature kind)
    from fedmed.algorithms.signatures import SIGNATURE_KINDS, signature_from_wire
    from fedmed.core.io import read_signature_dir, write_distance_csv

    kind = a.kind
    if kind in SIGNATURE_KINDS:  # a method's signature, by its kind's own distance and options
        sk = SIGNATURE_KINDS[kind]
        sigs = read_signature_dir(a.signature_dir, sk.fields)
        names = list(sigs)
        given = {"alpha": a.alpha, "beta": a.beta, "eps": a.eps, "overlap": not a.no_overlap, "angle": a.angle}
        takes = inspect.signature(sk.distances).parameters
        D = sk.distances([signature_from_wire(kind, s, n) for n, s in sigs.items()], names,
                         **{k: v for k, v in given.items() if k in takes})
    elif kind == "euclidean":
        from fedmed.algorithms.heterogeneity import embedding_distance_matrix

        sigs = read_signature_dir(a.signature_dir, ("embeddings",))
        names = list(sigs)
        D = embedding_distance_matrix([s["embeddings"] for s in sigs.values()], site_names=names)
    elif kind != "emd":
        raise ValueError(f"kind should be one of {[*SIGNATURE_KINDS, 'emd', 'euclidean']}, got {kind!r}")
    else:
        from fedmed.algorithms.heterogeneity import d_emd, emd_matrix

        sigs = read_signature_dir(a.signature_dir)
        names = list(sigs)
        keys = [set(s) for s in sigs.values()]
        common = sorted(set.intersection(*keys))
        intensity = [k for k in common if k.startswith("intensity__")]
        labels = [k for k in common if k.startswith("label__")]
        if not intensity or not labels:
            raise ValueError(f"{a.signature_dir}: emd signatures need arrays named intensity__<modality> and "
                             f"label__<label> present at every site, found {common}.")
        edges_key = lambda k: "edges__" + k  # noqa: E731
        mats = {}
        for k in intensity + labels:
            edges = sigs[names[0]].get(edges_key(k))
            mats[k] = emd_matrix([s[k] for s in sigs.values()], edges=edges, site_names=names, feature=k)
        res = d_emd({k: mats[k] for k in intensity}, {k: mats[k] for k in labels})
        D = res["D"]
        print(f"EMD_maxI: {res['max_intensity']}  EMD_maxL: {res['max_label']}", file=sys.stderr)
    write_distance_csv(a.out, names, D)
    print(f"wrote {a.out} ({len(names)} sites)", file=sys.stderr)


# -------------------------------------------------------------------------------------- partition

def _read_labels(path) -> np.ndarray:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: labels file not found.")
    if path.suffix == ".npy":
        return np.load(path)
    try:
        return np.loadtxt(path, dtype=np.int64, ndmin=1)
    except ValueError as e:
        raise ValueError(f"{path}: expected one integer label per line ({e}).") from None


def cmd_partition(a):
    from fedmed.data import anda, partition as P

    out: dict = {"scheme": a.scheme, "seed": a.seed}
    if a.scheme == "predi":
        res = P.predi(a.classes, a.sites, a.prevalence, a.disparity, a.seed)
        out.update(assignment=res.assignment, prevalence=res.prevalence, disparity=res.disparity,
                   class_prevalence=res.class_prevalence, classes_per_site=res.classes_per_site,
                   targets={"prevalence": a.prevalence, "disparity": a.disparity}, attempts=res.attempts)
    elif a.scheme == "quantity":
        n = a.n_samples if a.n_samples is not None else (len(_read_labels(a.labels)) if a.labels else None)
        if n is None:
            raise ValueError("quantity partition needs --n-samples or --labels.")
        parts = P.quantity_partition(n, a.sites, a.alpha, a.seed)
        out.update(sites=[p.tolist() for p in parts], sizes=[len(p) for p in parts])
    else:
        if not a.labels:
            raise ValueError(f"{a.scheme} partition needs --labels FILE (one integer label per sample).")
        y = _read_labels(a.labels)
        if a.scheme == "dirichlet":
            parts = P.dirichlet_label_partition(y, a.sites, a.alpha, a.seed,
                                                mode={"hsu": "per-site", "per_client": "per-client"}[a.dirichlet_scheme])
            out.update(sites=[p.tolist() for p in parts], sizes=[len(p) for p in parts],
                       class_counts=[np.bincount(y[p], minlength=int(y.max()) + 1).tolist() for p in parts])
        else:  # anda
            sites = anda.anda_federation(y, a.sites, a.shift, a.seed, level=a.level, n_groups=a.groups)
            out.update(shift=a.shift, level=a.level, groups=[s.group for s in sites], sites=[s.to_json() for s in sites])
    if a.json:
        _print_json(out)
    else:
        for k, v in out.items():
            if k not in ("sites", "assignment"):
                print(f"{k}: {v}")
        if "assignment" in out:
            print(np.asarray(out["assignment"]))


# ------------------------------------------------------------------------------------------- main

def version() -> str:
    """The installed fedmed's version (its package metadata)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as _version

    try:
        return _version("fedmed")
    except PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fedmed", description=__doc__.splitlines()[0], formatter_class=HELP)
    p.add_argument("--version", action="version", version=f"fedmed {version()}")
    sub = p.add_subparsers(dest="verb", required=True)

    c = sub.add_parser("cluster", help="cluster sites from a distance-matrix CSV, print JSON", formatter_class=HELP)
    c.add_argument("dist", help="square CSV; header row and first column are site names")
    c.add_argument("--method", required=True, choices=["farthest-split", "agglomerative", "auto-k", "dbscan"],
                   help="004_ Alg. 1 two-cluster split, FMCL Alg. 4 (needs --k or --threshold), FMCL Alg. 5, or Flux's "
                   "adaptive DBSCAN")
    c.add_argument("--k", type=int, help="agglomerative: fixed number of clusters")
    c.add_argument("--threshold", type=float, help="agglomerative: merge-distance threshold")
    c.add_argument("--linkage", default="average", choices=["single", "complete", "average", "weighted"],
                   help="agglomerative / auto-k: cluster-to-cluster distance (weighted = WPGMA, PACFL's code)")
    c.add_argument("--k-max", type=int, default=None, help="auto-k: largest K considered (default min(10, N))")
    c.add_argument("--k1-silhouette", type=float, default=0.5, help="auto-k: keep one cluster unless the best "
                   "silhouette reaches this (a negative value turns the K = 1 test off)")
    c.add_argument("--rule", default="objective", choices=["objective", "printed"],
                   help="farthest-split: which reading of 004_ Alg. 1 (docs/readings.md)")
    c.add_argument("--scale", type=float, default=1.0, help="dbscan: eps scale factor")
    c.set_defaults(func=cmd_cluster)

    d = sub.add_parser("distances", help="site-by-site distances from per-site <site>.npz signatures", formatter_class=HELP)
    d.add_argument("kind", help="which signature and distance: a method's signature kind (fmcl, pacfl, fecfl), emd or "
                   "euclidean")
    d.add_argument("signature_dir", help="folder of <site>.npz files (see the README for their arrays)")
    d.add_argument("--out", required=True, help="output CSV")
    d.add_argument("--alpha", type=float, default=1.0, help="fmcl: overlap exponent")
    d.add_argument("--beta", type=float, default=100.0, help="fmcl: cap of the overlap multiplier")
    d.add_argument("--eps", type=float, default=1e-3, help="fmcl: numerical floor")
    d.add_argument("--no-overlap", action="store_true", help="fmcl: the ablation without overlap scaling")
    d.add_argument("--angle", default="principal", choices=["principal", "official"],
                   help="pacfl: smallest principal angle, or the official code's arccos of single entries")
    d.set_defaults(func=cmd_distances)

    q = sub.add_parser("partition", help="seeded partition of a label set; prints the assignment and its statistics",
                       formatter_class=HELP)
    q.add_argument("scheme", choices=["dirichlet", "quantity", "predi", "anda"], help="partition scheme")
    q.add_argument("--labels", help="labels file (.npy, or text with one integer per line); dirichlet/anda, or the "
                   "sample count for quantity")
    q.add_argument("--n-samples", type=int, help="quantity: number of samples (instead of --labels)")
    q.add_argument("--sites", type=int, required=True, help="number of sites")
    q.add_argument("--alpha", type=float, default=0.1, help="dirichlet / quantity: concentration")
    q.add_argument("--dirichlet-scheme", default="hsu", choices=["hsu", "per_client"],
                   help="dirichlet: Dir(alpha p) per site (Hsu et al.) or Dir(alpha) per site (FedLab)")
    q.add_argument("--classes", type=int, default=36, help="predi: number of classes C")
    q.add_argument("--prevalence", type=float, default=3.0, help="predi: target average prevalence p*")
    q.add_argument("--disparity", type=float, default=0.0, help="predi: target disparity sigma*")
    q.add_argument("--shift", default="feature", choices=["feature", "label", "p_y_given_x", "p_x_given_y", "quantity"],
                   help="anda: shift type")
    q.add_argument("--level", type=int, default=3, help="anda: severity level")
    q.add_argument("--groups", type=int, default=2, help="anda: number of distributions")
    q.add_argument("--seed", type=int, default=0, help="seed of the partition")
    q.add_argument("--json", action="store_true", help="print JSON (with the per-site indices)")
    q.set_defaults(func=cmd_partition)

    _add_workflow_verbs(sub)
    return p


def _add_workflow_verbs(sub):
    """Verbs that prepare data, run experiments, assess and demo (``fedmed.cli.commands``)."""
    from fedmed.cli import commands

    commands.register(sub)
    t = sub.add_parser("tune", help="choose a recipe on the federation's own validation data (Optuna, successive "
                       "halving); writes tuned.yaml", formatter_class=HELP)
    t.add_argument("config", help="experiment config (app_configs/*.yaml)")
    t.add_argument("--budget", type=float, required=True, help="full runs of the config's recipe to spend (rounds x "
                   "local epochs each); a larger budget continues an earlier tuning")
    t.add_argument("--out", help="output folder (default results/<config name>_tune): tuning.db, tuned.yaml, tuning.md")
    t.add_argument("--storage", help="an Optuna RDB URL (default sqlite:///<out>/tuning.db): several machines may "
                   "share one study")
    t.add_argument("--set", action="append", default=[], help="config override key.path=value (repeatable)")
    t.set_defaults(func=cmd_tune)


def cmd_tune(a) -> int:
    """``fedmed tune`` (:mod:`fedmed.run.tune`)."""
    from fedmed.config import load_config
    from fedmed.run.tune import tune

    out = Path(a.out) if a.out else Path("results") / f"{load_config(a.config, a.set).name}_tune"
    tune(a.config, out, a.budget, storage=a.storage, overrides=a.set)
    return 0


def _exit_on_sigterm() -> None:
    """SIGTERM ends ``fedmed`` as Ctrl-C does (``SystemExit``), so a running job is stopped and its record marked
    ``stopped`` on the way out, instead of the job being left running without its launcher."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def main(argv=None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    _exit_on_sigterm()
    try:
        rc = a.func(a)
    except (FedmedError, ValueError, TypeError, OSError, RuntimeError) as e:  # one line each (OSError: a folder it
        # cannot write; every error fedmed raises on purpose is a FedmedError, #88)
        from fedmed.run.experiment import ExperimentError

        from pydantic import ValidationError

        from fedmed.core.schema import error_lines

        # one line per bad key for a pydantic error; a message that names the command already is not prefixed twice
        msg = "; ".join(error_lines(e)) if isinstance(e, ValidationError) else str(e)
        print(msg if msg.startswith(f"fedmed {a.verb}:") else f"fedmed {a.verb}: error: {msg}", file=sys.stderr)
        return 1 if isinstance(e, ExperimentError) else 2
    return rc if isinstance(rc, int) else 0


if __name__ == "__main__":
    sys.exit(main())
