"""What the Fed-MAE encoder of a finished ``fedmed ssl`` study is worth, outside the federation.

    .venv/bin/python benchmarks/ssl_encoder_probe.py --study results/ssl_imagenette [--cases p2.5] [--seeds 0]
        [--finetune-lr 1e-3 6.25e-5] [--epochs 100]

For every seed whose pre-training finished and every fine-tuning case, on the case's pooled labeled training
images (all sites) and its common test set:

* **linear probe** — logistic regression (C = 0.1, fixed, features standardized on the training images) on the
  frozen pooled encoder features, the random ViT (seeded as the classifier is) vs the Fed-MAE encoder;
* **centralized fine-tuning** (``--finetune-lr``, optional) — the encoder plus a linear head trained on the pooled
  labeled images as the sites do (AdamW with layer-wise decay 0.75, warm-up 5% then cosine, flips, batch 16),
  from each init, for each learning rate given: the final epoch's test accuracy (no selection). ``1e-3`` is the
  study's reading of ``001_``'s fine-tuning "base learning rate"; ``1e-3 x 16 / 256 = 6.25e-5`` is MAE's scaling
  rule applied to it (docs/readings.md).

``--clustering`` reads the FMCL runs of the encoder-comparison case instead (no training): from each run's site
distance matrix (``server/distances.csv``) and the true ANDA groups, the separation (mean distance between sites of
different groups / mean distance within a group; 1 = the encoder does not see the shift) and the ARI of the
average-linkage cut at the true number of groups (what a user who knew K would get; auto-K decides the table's K).

Nothing is tuned on the test set: every setting is fixed above. Prints a table per seed and the paired
differences (Fed-MAE minus random).
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


def _pooled(case_dir: Path):
    from fedmed.data.images import load_images
    from fedmed.data.datalists import load_datalist

    meta = json.loads((case_dir / "dataset.json").read_text())
    train, test = [], None
    for s in meta["sites"]:
        doc = load_datalist(case_dir / f"{s}.json", root=case_dir)
        train += doc["training"]
        test = doc["test"]
    xtr, ytr = load_images(train, image_size=32, channels=3)
    xte, yte = load_images(test, image_size=32, channels=3)
    return xtr, ytr, xte, yte, int(meta["n_classes"])


def _classifier(init: str, encoder: Path, n_classes: int):
    import torch

    from fedmed.nn.mae import ViTClassifier

    torch.manual_seed(0)
    m = ViTClassifier(3, n_classes)
    if init == "fedmae":
        missing, unexpected = m.load_state_dict(torch.load(encoder, weights_only=True), strict=False)
        assert not unexpected and set(missing) == {"head.weight", "head.bias"}, (missing, unexpected)
    return m


def linear_probe(init, encoder, data) -> float:
    import torch
    from sklearn.linear_model import LogisticRegression

    xtr, ytr, xte, yte, n_classes = data
    m = _classifier(init, encoder, n_classes).eval()
    with torch.no_grad():
        ftr = m.forward_features((xtr - 0.5) / 0.5).numpy()
        fte = m.forward_features((xte - 0.5) / 0.5).numpy()
    mu, sd = ftr.mean(0), ftr.std(0) + 1e-6
    clf = LogisticRegression(max_iter=3000, C=0.1).fit((ftr - mu) / sd, ytr.numpy())
    return float(clf.score((fte - mu) / sd, yte.numpy()))


def finetune(init, encoder, data, lr: float, epochs: int) -> float:
    import torch

    from fedmed.nn.mae import layerwise_param_groups, scheduled_lr
    from fedmed.nn.train import predict_proba, train_local

    xtr, ytr, xte, yte, n_classes = data
    m = _classifier(init, encoder, n_classes)
    opt = torch.optim.AdamW(layerwise_param_groups(m, 0.75), lr=lr, weight_decay=0.05)
    train_local(m, xtr, ytr, epochs=epochs, batch_size=16, optimizer=opt, generator=torch.Generator().manual_seed(0),
                augment="flip", lr_at=lambda f: scheduled_lr(lr, f, 0.05))
    return float((predict_proba(m, xte).argmax(1) == yte.numpy()).mean())


def clustering(study: Path, seeds) -> list[dict]:
    """Separation and fixed-K ARI of each encoder-comparison FMCL run's site distances."""
    import csv

    from sklearn.metrics import adjusted_rand_score

    from fedmed.algorithms.clustering import agglomerative

    rows = []
    for seed in seeds:
        for case_dir in sorted((study / "runs" / f"seed{seed}").iterdir()):
            for run in sorted(case_dir.glob("FMCL*")):
                f = run / "server" / "distances.csv"
                if not f.is_file():
                    continue
                table = list(csv.reader(f.read_text().splitlines()))
                sites = table[0][1:]
                D = np.array([[float(v) for v in r[1:]] for r in table[1:]])
                meta = study / "data" / f"seed{seed}" / case_dir.name / "dataset.json"
                groups = json.loads(meta.read_text())["groups"]
                g = np.array([groups[s] for s in sites])
                off = ~np.eye(len(sites), dtype=bool)
                same, diff = (g[:, None] == g[None, :]) & off, g[:, None] != g[None, :]
                k = len(set(g.tolist()))
                labels = agglomerative(D, n_clusters=k, linkage_method="average")
                doc = json.loads((run / "metrics.json").read_text())["clustering"]
                rows.append({"seed": seed, "case": case_dir.name, "run": run.name,
                             "separation": D[diff].mean() / D[same].mean(),
                             "ari_true_k": adjusted_rand_score(g, labels), "auto_k": doc["k"],
                             "silhouette_2": doc.get("silhouette", {}).get("2")})
                print(json.dumps({k2: (round(v, 3) if isinstance(v, float) else v) for k2, v in rows[-1].items()}))
    runs = sorted({r["run"] for r in rows})
    print("\n| FMCL run | separation (between / within) | ARI at the true K | auto-K |\n|---|---|---|---|")
    for name in runs:
        rs = [r for r in rows if r["run"] == name]
        sep, ari = np.array([r["separation"] for r in rs]), np.array([r["ari_true_k"] for r in rs])
        print(f"| {name} (n = {len(rs)}) | {sep.mean():.3f} ± {sep.std():.3f} | {ari.mean():.2f} ± {ari.std():.2f} | "
              f"{sorted(r['auto_k'] for r in rs)} |")
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--study", default="results/ssl_imagenette")
    ap.add_argument("--cases", nargs="*", default=None, help="fine-tuning cases (default: every PreDi split)")
    ap.add_argument("--seeds", nargs="*", type=int, default=None)
    ap.add_argument("--finetune-lr", nargs="*", type=float, default=[])
    ap.add_argument("--epochs", type=int, default=100, help="fine-tuning epochs (the study: 20 rounds x 5)")
    ap.add_argument("--clustering", action="store_true", help="the encoder-comparison FMCL runs' distances instead")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    study = Path(args.study)
    seeds = args.seeds if args.seeds is not None else sorted(
        int(p.name[4:]) for p in (study / "runs").glob("seed*") if (p / "pretrain/server/models/encoder.pt").is_file())
    if args.clustering:
        return 0 if clustering(study, seeds) else 1
    rows = []
    for seed in seeds:
        encoder = study / "runs" / f"seed{seed}" / "pretrain" / "server" / "models" / "encoder.pt"
        if not encoder.is_file():
            print(f"seed {seed}: no finished pre-training ({encoder.relative_to(study)}), skipped")
            continue
        cases = args.cases or sorted(  # the fine-tuning cases: PreDi splits
            p.name for p in (study / "data" / f"seed{seed}").iterdir() if (p / "dataset.json").is_file()
            and json.loads((p / "dataset.json").read_text()).get("partition") == "predi")
        for case in cases:
            data = _pooled(study / "data" / f"seed{seed}" / case)
            t0 = time.time()
            row = {"seed": seed, "case": case, "n_train": len(data[1])}
            for init in ("random", "fedmae"):
                row[f"probe_{init}"] = linear_probe(init, encoder, data)
                for lr in args.finetune_lr:
                    row[f"ft{lr:g}_{init}"] = finetune(init, encoder, data, lr, args.epochs)
            rows.append(row)
            print(json.dumps({k: (round(100 * v, 1) if isinstance(v, float) else v) for k, v in row.items()})
                  + f"  ({time.time() - t0:.0f} s)", flush=True)
    if not rows:
        return 1
    keys = [k[:-len("_random")] for k in rows[0] if k.endswith("_random")]
    print("\n| measure | random ViT | Fed-MAE encoder | Fed-MAE minus random (pp, paired) |\n|---|---|---|---|")
    for k in keys:
        a = np.array([100 * r[f"{k}_random"] for r in rows])
        b = np.array([100 * r[f"{k}_fedmae"] for r in rows])
        d = b - a
        print(f"| {k} (n = {len(rows)} seed-case pairs) | {a.mean():.1f} ± {a.std():.1f} | "
              f"{b.mean():.1f} ± {b.std():.1f} | "
              f"{d.mean():+.1f} ± {d.std():.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
