"""A site's training on a GPU against a plain PyTorch loop of the same model on the same GPU (``benchmarks/_common.py``).

Side A is a bare loop written here (the model, Adam, the same shuffled batches from the same seeded generator, the
same flips, ``autocast`` at the same precision, the same loss); side B is what a fedmed site runs for one round
(``SiteRunner.handle("train")``: score the served model on the validation and test splits, then train). Both start
from the same weights and must end with the same weights (checked: bit for bit on the CPU, within ``--atol`` on a
GPU, whose kernels are not deterministic by default). Then interleaved pairs (A B A B ...) give seconds per round
and training images per second for both, and the ratio B / A.

    .venv/bin/python benchmarks/bench_gpu.py [--arch DenseNet121 --image-size 224 --n 512 --precision bf16 --pairs 5]
    .venv/bin/python benchmarks/bench_gpu.py --device cpu --arch resnet9 --image-size 32 --n 64 --pairs 1  # smoke run

Data: BUSI from ../shared/data (sklearn digits when absent). Without a CUDA GPU the script says so and measures
nothing (unless ``--device cpu`` is given): docs/results.md never reports a GPU number that was not measured.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import compare  # noqa: E402

BUSI = Path(__file__).resolve().parents[2] / "shared" / "data" / "busi"


def federation(n: int, tmp: Path) -> tuple[Path, int]:
    from fedmed.data.images import discover, write_site_datalists

    src = str(BUSI) if BUSI.exists() else "builtin:digits"
    pool = discover(src, seed=0)
    idx = np.random.default_rng(0).permutation(len(pool.labels))[: int(n * 1.25)]
    write_site_datalists(pool.subset(np.sort(idx)), [np.arange(len(idx))], tmp, test_fraction=0.2, seed=0)
    return tmp, pool.n_classes


def bare_round(model, x, y, *, epochs, batch_size, lr, seed, precision, device):
    """One round of plain PyTorch training, the operations a site's ``train_local`` does (same order, same RNG use)."""
    from fedmed.nn.train import augment_batch

    g = torch.Generator()
    g.manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=0.0)
    scaler = torch.amp.GradScaler("cuda") if precision == "fp16" and device.type == "cuda" else None
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    loss_fn = torch.nn.CrossEntropyLoss()
    n = x.shape[0]
    model.train()
    for _ in range(epochs):
        order = torch.randperm(n, generator=g)
        for s in range(0, n, batch_size):
            idx = order[s:s + batch_size]
            if idx.numel() < 2 and n >= 2:
                continue
            xb, yb = augment_batch(x[idx], "flip", g).to(device), y[idx].to(device)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                loss = loss_fn(model((xb - 0.5) / 0.5).float(), yb)
            opt.zero_grad()
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (a smoke run)")
    ap.add_argument("--arch", default="DenseNet121", help="model.arch (fedmed's, a MONAI network, package.module:Class)")
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--n", type=int, default=512, help="training images of the site")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=1, help="local epochs per round")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--atol", type=float, default=1e-3, help="GPU: largest weight difference (relative to each tensor's "
                    "scale, at least 1) still 'the same'")
    ap.add_argument("--json", help="also write the result here")
    ap.add_argument("--deterministic", action="store_true", help="cuDNN's deterministic algorithms on both sides (the "
                    "site through its train.deterministic)")
    a = ap.parse_args(argv)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench_gpu: no CUDA GPU on this machine; nothing measured (give --device cpu for a smoke run)")
        return 0
    from fedmed.nn.models import model_from_config
    from fedmed.site.runner import SiteRunner
    from fedmed.nn.train import get_params, set_params

    device = torch.device(a.device)
    if a.deterministic:  # cuDNN's deterministic algorithms only: the site by its train.deterministic, the loop here
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    tmp = Path(tempfile.mkdtemp(prefix="bench_gpu_"))
    root, n_classes = federation(a.n, tmp)
    model_cfg = {"arch": a.arch, "width": 16, "norm": "batch"}
    cfg = {"seed": 0, "data": {"image_size": a.image_size, "channels": 1, "n_classes": n_classes},
           "model": model_cfg, "privacy": {"k_min": 1},
           "train": {"local_epochs": a.epochs, "batch_size": a.batch_size, "optimizer": "adam", "lr": 1e-3,
                     "weight_decay": 0.0, "augment": "flip", "keep_optimizer_state": False, "device": a.device,
                     "precision": a.precision, "deterministic": a.deterministic}}
    runner = SiteRunner("site-1", root)
    s = runner.splits(cfg)
    x, y = s.train
    theta = get_params(model_from_config(model_cfg, 1, n_classes, seed=0))
    net = model_from_config(model_cfg, 1, n_classes, seed=0).to(device)

    def side_a():
        set_params(net, theta)
        return get_params(bare_round(net, x, y, epochs=a.epochs, batch_size=a.batch_size, lr=1e-3,
                                     seed=runner.generator(cfg, 0).initial_seed(), precision=a.precision,
                                     device=device))

    def side_b():
        _, _, _, out = runner.handle("train", theta, cfg, 0)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return out

    def worst(pa, pb):
        # per tensor, the largest difference relative to the tensor's scale (at least 1): batch-norm running
        # variances of a deep network run into the thousands, where an absolute tolerance says nothing
        diffs = {k: float(np.abs(pa[k].astype(np.float64) - pb[k]).max()) /
                 max(1.0, float(np.abs(pa[k].astype(np.float64)).max())) for k in pa if pa[k].size}
        key = max(diffs, key=diffs.get)
        return diffs[key], key

    def same(pa, pb):
        d, key = worst(pa, pb)
        print(f"largest weight difference after one round: {d:.3g} (relative to the tensor's scale; {key})")
        if device.type == "cpu":
            return d == 0.0
        # a GPU's kernels need not be deterministic: the plain loop run twice is the spread the two sides may differ by
        spread, skey = worst(pa, side_a())
        print(f"the plain loop against itself, run again: {spread:.3g} ({skey}); the sides count as the same within "
              f"max(--atol {a.atol:g}, 2 x that)")
        return d <= max(a.atol, 2 * spread)

    name = f"{a.arch} {a.image_size}px {a.precision} on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}"
    res = compare(name, side_a, side_b, label_a="plain PyTorch loop", label_b="fedmed site round", pairs=a.pairs,
                  same=same)
    images = a.epochs * x.shape[0]
    res.update(device=name, images_per_round=images, a_images_per_s=images / res["a_wall"],
               b_images_per_s=images / res["b_wall"])
    print(f"[{name}] images/s: plain {res['a_images_per_s']:.1f}, fedmed site {res['b_images_per_s']:.1f} "
          f"(the site also scores the served model on its validation and test splits each round)")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
