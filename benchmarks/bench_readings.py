"""The measured effect of every reading in docs/readings.md, each pair of readings on the same inputs.

    .venv/bin/python benchmarks/bench_readings.py [--only pacfl dirichlet flux anda encoders preprocessing usfm]

* pacfl — PACFL on a BUSI Dirichlet(0.1) federation of 20 sites (raw-pixel class bases, p = 3): the distance
  matrices under the principal-angle and the official-code angle; agreement of their K = 3 clusterings (ARI),
  and UPGMA ("average") vs WPGMA ("weighted", the code's "average") on the official matrix.
* dirichlet — classes per site on 10 balanced classes, 20 sites, alpha = 1: Hsu's Dir(alpha p) vs FedLab's
  per-client Dir(alpha); and the first vs last ten sites when sites are filled one after the other (the usual
  code, reproduced here) vs fedmed's turn-taking.
* flux — FedAvg-trained ResNet-9 on a PneumoniaMNIST ANDA feature-shift federation (10 sites, 3 groups, level 5);
  the descriptors under each Flux reading (S1 box element-wise vs the code's scalar [0, 1.02 max]; descriptors
  raw vs min-max scaled; an absent class as zeros vs -1) and the clustering ARI against the true groups; and
  the round at which the start rule fires under the paper's and the code's reading on the same accuracy curve.
* encoders — MedicalNet: features of the same BraTS volumes with a zero vs an N(0, 1) background, with the
  authors' positive-voxel statistics vs the non-zero-voxel ones and vs the whole-volume z-score, the raw volume
  resampled trilinearly vs by the authors' ``ndimage.zoom(order=0)``, and the official dilated network vs MONAI's
  resnet18 with the same weights; USFM: the authors' mean-pooled feature vs the final-norm CLS token (random weights:
  no release is stored here).
* usfm — USFM's two features on BUSI clustering: FMCL Table 1's federation (``app_configs/busi_fmcl.yaml``, 20 sites,
  Dirichlet(0.1) label skew), each site's FMCL signature from the authors' mean-pooled feature and from the CLS token
  (random weights), clustered at the table's K = 3 and at Auto-K; the ARI between the two readings' clusters and of
  each against the sites' label mixes (their majority class).
* anda — the same federation with ANDA's colour reading (channel at full intensity, gray elsewhere) vs fedmed's
  (gray in one channel): clustering ARI of the Flux descriptors.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHARED = ROOT.parent / "shared" / "data"


def pacfl():
    from sklearn.metrics import adjusted_rand_score

    from fedmed.algorithms.baselines import pacfl_distance_matrix, pacfl_signature
    from fedmed.algorithms.clustering import agglomerative
    from fedmed.data.images import discover, load_images
    from fedmed.data.partition import dirichlet_label_partition

    pool = discover(str(SHARED / "busi"), seed=0)
    parts = dirichlet_label_partition(pool.labels, 20, 0.1, 0)
    bases = []
    for p in parts:
        x, y = load_images([{"image": pool.items[i], "label": int(pool.labels[i])} for i in p], image_size=32, channels=1)
        bases.append(pacfl_signature(x.reshape(len(p), -1).numpy(), y.numpy(), n_basis=3))
    Dp = pacfl_distance_matrix(bases, mode="smallest")
    Do = pacfl_distance_matrix(bases, mode="official")
    off = ~np.eye(20, dtype=bool)
    diff = np.abs(Dp - Do)[off]
    lp = agglomerative(Dp, n_clusters=3)
    lo = agglomerative(Do, n_clusters=3)
    lw = agglomerative(Do, n_clusters=3, linkage_method="weighted")
    print(f"PACFL angle (BUSI, 20 sites, Dir 0.1, pixels, p=3): principal mean {Dp[off].mean():.2f} deg, official mean "
          f"{Do[off].mean():.2f} deg; |difference| mean {diff.mean():.2f}, max {diff.max():.2f} deg; K=3 clusterings "
          f"agree ARI {adjusted_rand_score(lp, lo):.2f}")
    print(f"PACFL linkage on the official matrix: UPGMA vs WPGMA K=3 clusterings ARI {adjusted_rand_score(lo, lw):.2f}")


def _sequential_fill(y, n_sites, alpha, seed, per_client):
    """The usual per-site Dirichlet code: sites filled one after the other (kept here only to measure it)."""
    rng = np.random.default_rng(seed)
    classes = np.unique(y)
    pools = [list(rng.permutation(np.flatnonzero(y == c))) for c in classes]
    prior = np.ones(len(classes)) if per_client else np.array([len(p) for p in pools], float) / y.size
    parts = []
    for size in [len(a) for a in np.array_split(np.arange(y.size), n_sites)]:
        q = rng.dirichlet(alpha * prior)
        got = []
        while len(got) < size:
            avail = np.array([len(p) > 0 for p in pools])
            w = q * avail
            w = w / w.sum() if w.sum() > 0 else avail / avail.sum()
            for c, k in enumerate(rng.multinomial(size - len(got), w)):
                take = min(int(k), len(pools[c]))
                got += pools[c][:take]
                del pools[c][:take]
        parts.append(np.asarray(got))
    return parts


def dirichlet():
    from fedmed.data.partition import dirichlet_label_partition

    y = np.repeat(np.arange(10), 100)
    cps = lambda parts: np.array([len(np.unique(y[p])) for p in parts])  # noqa: E731
    hsu = np.mean([cps(dirichlet_label_partition(y, 20, 1.0, s, mode="per-site")).mean() for s in range(10)])
    pc = np.mean([cps(dirichlet_label_partition(y, 20, 1.0, s, mode="per-client")).mean() for s in range(10)])
    print(f"Dirichlet alpha=1, 10 classes, 20 sites: classes per site Hsu Dir(alpha p) {hsu:.1f}, per-client "
          f"Dir(alpha) {pc:.1f} (10 seeds)")
    for per_client, name in ((False, "hsu"), (True, "per_client")):
        seq = [cps(_sequential_fill(y, 20, 1.0, s, per_client)) for s in range(10)]
        turn = [cps(dirichlet_label_partition(y, 20, 1.0, s, mode="per-client" if per_client else "per-site"))
                for s in range(10)]
        print(f"  {name}: sequential fill first 10 / last 10 sites {np.mean([c[:10].mean() for c in seq]):.1f} / "
              f"{np.mean([c[10:].mean() for c in seq]):.1f} classes; turn-taking "
              f"{np.mean([c[:10].mean() for c in turn]):.1f} / {np.mean([c[10:].mean() for c in turn]):.1f}")


def _anda_federation(colour: str, tmp: Path):
    from fedmed.config import load_config
    from fedmed.run.experiment import prepare_federation

    raw = {"name": "readings", "dataset": {"path": str(SHARED / "pneumoniamnist" / "pneumoniamnist.npz"),
                                           "image_size": 28, "channels": 3, "max_per_class": 300},
           "federation": {"sites": 10, "partition": "anda", "anda_shift": "feature", "anda_level": 5,
                          "anda_groups": 3, "anda_colour": colour},
           "model": {"arch": "resnet9", "width": 8}, "privacy": {"k_min": 5}}
    exp = load_config(raw)
    return exp, prepare_federation(exp, 0, tmp / colour)


def _trained_latents(exp, data, rounds=4):
    from fedmed.workflows import fedavg_in_process
    from fedmed.nn.models import model_from_config
    from fedmed.site.runner import SiteRunner
    from fedmed.nn.train import latents, set_params

    meta = json.loads((data / "dataset.json").read_text())
    cfg = {"seed": 0, "model": exp.model.model_dump(), "train": exp.train.model_dump(),
           "data": {"image_size": 28, "channels": 3, "n_classes": 2}, "privacy": {"k_min": 5}}
    theta, summ = fedavg_in_process(cfg, data, meta["sites"], rounds=rounds)
    model = model_from_config(cfg["model"], 3, 2)
    set_params(model, theta)
    out = {}
    for s in meta["sites"]:
        sp = SiteRunner(s, data).data(28, 3)
        out[s] = (latents(model, sp.train[0]), sp.train[1].numpy())
    return meta, out, [x["mean"].get("val_accuracy") for x in summ], [x["mean"].get("accuracy") for x in summ]


def _flux_ari(meta, lat, *, box="elementwise", scaling="none", absent="zeros", k_min=5, second="std", eps=None):
    from sklearn.metrics import adjusted_rand_score

    from fedmed.algorithms.clustered import flux_cluster
    from fedmed.algorithms.flux import flux_descriptor, merge_bounds, shared_pca
    from fedmed.algorithms.privacy import private_bounds

    bounds = [private_bounds(z, k_min=k_min, privacy={}, box=box)[:2] for z, _ in lat.values()]
    lo, hi = merge_bounds(bounds)
    pca = shared_pca(lo, hi, n_components=10, seed=0)
    descs = {}
    for s, (z, y) in lat.items():
        d = flux_descriptor(z, pca, y, n_classes=2, k_min=k_min, absent=absent, second_moment=second, dp_epsilon=eps,
                            rng=np.random.default_rng(0) if eps else None)
        descs[s] = {"full": d.full, "label_free": d.label_free}
    info = flux_cluster(descs, scaling=scaling)
    sites = info["sites"]
    return adjusted_rand_score([meta["groups"][s] for s in sites], info["labels"]), info["k"]


def flux(tmp: Path):
    from fedmed.algorithms.flux import should_start_clustering

    exp, data = _anda_federation("channel", tmp)
    meta, lat, acc, test_acc = _trained_latents(exp, data)
    for name, kw in (("paper readings (element-wise box, raw descriptors, absent = 0)", {}),
                     ("Σ of Eq. 7 as variances (second_moment var)", {"second": "var"}),
                     ("DP on, ε = 10 (Laplace scale from the public box's range / n)", {"eps": 10.0}),
                     ("DP on, ε = 1", {"eps": 1.0}),
                     ("S1 box: official scalar [0, 1.02 max]", {"box": "scalar"}),
                     ("descriptors min-max scaled (official)", {"scaling": "minmax"}),
                     ("absent class = -1 (official), k_min 1", {"absent": "minus_one", "k_min": 1}),
                     ("absent class = 0, k_min 1", {"k_min": 1}),
                     ("all official readings", {"box": "scalar", "scaling": "minmax", "absent": "minus_one", "k_min": 1})):
        ari, k = _flux_ari(meta, lat, **kw)
        print(f"Flux {name}: ARI {ari:.2f}, K {k}")
    for which, curve in (("validation", acc), ("test", test_acc)):  # Eq. 14's accuracy: fedmed's validation reading
        curve = [a for a in curve[1:]]  # accuracy after rounds 1..R
        for rule in ("paper", "official"):
            fires = next((r for r in range(1, len(curve) + 1) if should_start_clustering(curve[:r], 8, rule=rule)),
                         None)
            print(f"start rule ({rule}) on the FedAvg {which}-accuracy curve {np.round(curve, 3).tolist()}: fires at "
                  f"round {fires}")
    return meta, lat


def anda(tmp: Path):
    for colour in ("channel", "anda"):
        exp, data = _anda_federation(colour, tmp)
        meta, lat, acc, _ = _trained_latents(exp, data)
        ari, k = _flux_ari(meta, lat)
        print(f"ANDA colour '{colour}': FedAvg validation accuracy after 4 rounds {100 * acc[-1]:.1f}%, Flux ARI "
              f"{ari:.2f} (K {k})")


def encoders():
    """MedicalNet's statistics, background, resize and network; USFM's pooling — on BraTS cases (random weights: no
    release is stored here)."""
    import nibabel as nib
    import torch
    from scipy import ndimage

    from fedmed.data.nifti import load_case
    from fedmed.data.seg_federation import discover_subjects
    from fedmed.nn.encoders import build_encoder, extract_features, preprocess_volume

    def cos(a, b):
        a, b = a.ravel().double(), b.ravel().double()
        return float(a @ b / (a.norm() * b.norm()))

    def nonzero_zscore(v):  # fedmed's reading before #35's session: every non-zero voxel in the statistics
        fg = v[v != 0]
        return torch.where(v == 0, torch.zeros_like(v), (v - fg.mean()) / fg.std(unbiased=False))

    entries = discover_subjects(SHARED / "brats2013", {"FLAIR": "*Flair*", "T1c": "*T1c*"}, "*OT*", None)[:3]
    enc = build_encoder("medicalnet_resnet18", seed=0)
    gen = torch.Generator().manual_seed(0)
    from monai.networks.nets import resnet18

    monai = resnet18(spatial_dims=3, n_input_channels=1, feed_forward=False, shortcut_type="A", bias_downsample=True)
    monai.load_state_dict({k[len("net."):]: v for k, v in enc.module.state_dict().items()})
    monai.eval()
    rows, negative = [], []
    for e in entries:
        v = torch.from_numpy(load_case(e, shape=(64, 64, 64))["image"][:1])[None]
        negative.append(float((v < 0).float().mean()))
        zero = preprocess_volume(v)
        noise = torch.where(v != 0, zero, torch.randn(v.shape, generator=gen))
        noise2 = torch.where(v != 0, zero, torch.randn(v.shape, generator=gen))
        whole = (v - v.mean()) / v.std()
        raw = np.asarray(nib.load(e["image"][0]).dataobj, dtype=np.float32)  # the FLAIR volume as stored
        tri = torch.nn.functional.interpolate(torch.from_numpy(raw)[None, None], size=(64, 64, 64), mode="trilinear",
                                              align_corners=False)
        near = torch.from_numpy(ndimage.zoom(raw, [64 / d for d in raw.shape], order=0)[None, None].copy())
        with torch.no_grad():
            f = {k: enc.module(x) for k, x in (("zero", zero), ("noise", noise), ("noise2", noise2), ("whole", whole),
                                                ("nonzero", nonzero_zscore(v)), ("tri", preprocess_volume(tri)),
                                                ("zoom", preprocess_volume(near)))}
            fm = monai(zero)
        rows.append((cos(f["zero"], f["noise"]), cos(f["noise"], f["noise2"]), cos(f["zero"], f["whole"]),
                     cos(f["zero"], fm), cos(f["zero"], f["nonzero"]), cos(f["tri"], f["zoom"])))
    r = np.asarray(rows)
    print(f"MedicalNet (3 BraTS cases, FLAIR at 64^3, random weights): cosine of the 512-d features, zero vs N(0,1) "
          f"background {r[:, 0].mean():.6f} (two noise draws of the same volume {r[:, 1].mean():.6f}); positive-voxel vs "
          f"whole-volume z-score {r[:, 2].mean():.6f}; positive-voxel (the authors') vs non-zero-voxel statistics "
          f"{r[:, 4].mean():.4f} on fedmed's z-scored crops ({100 * np.mean(negative):.0f}% of voxels negative); the raw "
          f"volume resampled trilinearly vs by the authors' ndimage.zoom(order=0) {r[:, 5].mean():.4f}; official "
          f"dilated network vs MONAI resnet18 with the same weights {r[:, 3].mean():.4f}")
    x = torch.rand(4, 3, 224, 224, generator=gen)
    mean = extract_features(build_encoder("usfm", seed=0), x)
    cls = extract_features(build_encoder("usfm_cls", seed=0), x)
    print(f"USFM (random weights, 4 random images): cosine of the authors' feature (fc_norm of the mean patch token) vs "
          f"the final-norm CLS token {np.mean([cos(torch.from_numpy(a), torch.from_numpy(b)) for a, b in zip(mean, cls)]):.4f}")


def usfm_busi(seeds=(0, 1, 2)):
    """USFM's mean-pooled patch feature (the authors' downstream one, fedmed's default) vs the final-norm CLS token,
    as FMCL signatures on FMCL Table 1's BUSI federation: the clusters each gives (random weights: no release is
    stored here, so this measures what the reading alone moves)."""
    import time

    from sklearn.metrics import adjusted_rand_score

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from natural_assessment import site_features

    from fedmed.algorithms.clustered import choose_clusters
    from fedmed.algorithms.signatures import signature_distances
    from fedmed.algorithms.privacy import signature_payload
    from fedmed.config import load_config
    from fedmed.run.experiment import prepare_federation, with_classes

    exp = load_config(ROOT / "app_configs" / "busi_fmcl.yaml")
    tmp = Path(tempfile.mkdtemp(prefix="readings_usfm_"))
    t0 = time.time()
    rows = []
    for seed in seeds:
        data_dir = tmp / f"seed{seed}"
        prepare_federation(exp, seed, data_dir)
        sites = json.loads((data_dir / "dataset.json").read_text())["sites"]
        exp_s = with_classes(exp, data_dir)
        clusters = {}
        for enc in ("usfm", "usfm_cls"):  # the same seeded weights: the two networks differ only in their pooling/norm
            feats = site_features(exp_s, data_dir, sites, enc, None, "encoder", seed, tmp / f"f_{seed}_{enc}.npz")
            sigs = {s: signature_payload("fmcl", x, y, k_min=exp.privacy.k_min, privacy=exp.privacy.model_dump(),
                                         rng=np.random.default_rng(seed), site=s) for s, (x, y) in feats.items()}
            names, D = signature_distances("fmcl", sigs, overlap=True)
            for label, k in (("K=3", 3), ("Auto-K", None)):
                info = choose_clusters(D, names, n_clusters=k)
                clusters[(enc, label)] = {s: i for i, c in enumerate(info["clusters"]) for s in c}
        majority = {s: int(np.bincount(y).argmax()) for s, (_, y) in feats.items()}  # the labels: either encoder's
        for label in ("K=3", "Auto-K"):
            a, b = clusters[("usfm", label)], clusters[("usfm_cls", label)]
            rows.append((seed, label, max(a.values()) + 1, max(b.values()) + 1,
                         adjusted_rand_score([a[s] for s in sites], [b[s] for s in sites]),
                         adjusted_rand_score([majority[s] for s in sites], [a[s] for s in sites]),
                         adjusted_rand_score([majority[s] for s in sites], [b[s] for s in sites])))
            print(f"[seed {seed}] {label}: K mean-patch {rows[-1][2]}, CLS {rows[-1][3]}; ARI between them "
                  f"{rows[-1][4]:.2f}; vs the sites' majority class: mean-patch {rows[-1][5]:.2f}, CLS {rows[-1][6]:.2f} "
                  f"({time.time() - t0:.0f} s)", flush=True)
    for label in ("K=3", "Auto-K"):
        r = np.asarray([x[2:] for x in rows if x[1] == label], dtype=float)
        print(f"USFM on BUSI clustering (busi_fmcl.yaml, FMCL {label}, random weights, seeds {list(seeds)}): K mean-patch "
              f"{r[:, 0].astype(int).tolist()}, CLS {r[:, 1].astype(int).tolist()}; ARI between the two readings' "
              f"clusters {r[:, 2].mean():.2f} ± {r[:, 2].std():.2f}; ARI vs the sites' majority class: mean-patch "
              f"{r[:, 3].mean():.2f} ± {r[:, 3].std():.2f}, CLS {r[:, 4].mean():.2f} ± {r[:, 4].std():.2f}")


def preprocessing():
    """Each 2D encoder's own input normalisation vs the one fedmed used for all before #26, ``(x - 0.5) / 0.25``: the
    cosine of the two features of 16 BUSI images (the ImageNet EfficientNet-Lite0 release when installed; the others
    seeded random: no release is stored here)."""
    import dataclasses

    import torch

    from fedmed.data.images import discover, load_images
    from fedmed.nn.encoders import build_encoder, extract_features
    from fedmed.nn.releases import released_weights

    pool = discover(str(SHARED / "busi"), max_per_class=6)
    x, _ = load_images([{"image": str(f), "label": 0} for f in pool.items[:16]], image_size=224, channels=3)
    names = ["vit_tiny", "usfm", "ctranspath", "efficientnet_lite0"]
    for name in names:
        w = released_weights(name) if name.startswith("efficientnet") else None
        enc = build_encoder(name, weights=w, seed=0, in_channels=3)
        own = torch.from_numpy(extract_features(enc, x))
        old = torch.from_numpy(extract_features(dataclasses.replace(enc, normalize="half"), x))
        c = torch.nn.functional.cosine_similarity(own, old, dim=1)
        print(f"{name} ({'ImageNet release' if w else 'random weights'}; its own input: {enc.preprocessing}): cosine "
              f"of its features vs (x - 0.5) / 0.25 on 16 BUSI images {float(c.mean()):.4f} (min {float(c.min()):.4f})")


def main(argv=None):
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=["pacfl", "dirichlet", "flux", "anda", "encoders", "preprocessing",
                                                  "usfm"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds of --only usfm")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="readings_"))
    if "pacfl" in a.only:
        pacfl()
    if "dirichlet" in a.only:
        dirichlet()
    if "flux" in a.only:
        flux(tmp)
    if "anda" in a.only:
        anda(tmp)
    if "encoders" in a.only:
        encoders()
    if "preprocessing" in a.only:
        preprocessing()
    if "usfm" in a.only:
        usfm_busi(a.seeds)


if __name__ == "__main__":
    main()
