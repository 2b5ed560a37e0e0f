"""A site's round on a GPU against a tuned plain PyTorch loop of the same model on the same GPU (issue #54;
``benchmarks/_common.py``).

Side A is a loop written here with none of fedmed's code, as a well-written loop runs on a GPU: the images kept on
the device as uint8, each batch gathered, flipped and normalised there, channels_last, a fused Adam, the loss summed
on the device and read once a round; it scores the served model on the validation and test images first (batch 256),
as a site does. Side B is what a fedmed site runs for one round (``SiteRunner.handle("train")``). Both take their
random draws from the same seeded generator in the same order and start from the same weights, so they must end
with the same weights (checked: bit for bit on the CPU, on a GPU within the tuned loop's own run-to-run spread).
Then interleaved pairs (A B A B ...) give seconds per round, images per second and the ratio. The same for inference:
fedmed's ``predict_proba`` of the site's images kept on the device against the tuned pass (the same probabilities).

    .venv/bin/python benchmarks/bench_gpu.py [--arch DenseNet121 --image-size 224 --n 512 --precision bf16 --pairs 5]
    .venv/bin/python benchmarks/bench_gpu.py --device cpu --arch resnet9 --image-size 32 --n 64 --pairs 1  # smoke run
    .venv/bin/python benchmarks/bench_gpu.py --task seg3d --precision bf16 --pairs 3   # 3D patches (SegResNet, 96^3)
    .venv/bin/python benchmarks/bench_gpu.py --task seg3d --device cpu --volume 20 24 20 --roi 16 --cases 2 --pairs 1

Data: BUSI from ../shared/data, or ``--data`` (a folder of class folders; sklearn digits when absent). Without a CUDA GPU the script says so and measures
nothing (unless ``--device cpu`` is given): docs/results.md never reports a GPU number that was not measured.
"""

from __future__ import annotations

import argparse
import atexit
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import compare  # noqa: E402

BUSI = Path(__file__).resolve().parents[2] / "shared" / "data" / "busi"


def federation(n: int, tmp: Path, data: Path = BUSI) -> tuple[Path, int]:
    from fedmed.data.images import discover
    from fedmed.data.datalists import write_site_datalists

    src = str(data) if data.exists() else "builtin:digits"
    pool = discover(src, seed=0)
    idx = np.random.default_rng(0).permutation(len(pool.labels))[: int(n * 1.25)]
    write_site_datalists(pool.subset(np.sort(idx)), [np.arange(len(idx))], tmp, test_fraction=0.2, seed=0)
    return tmp, pool.n_classes


def tuned_round(model, data, *, epochs, batch_size, lr, seed, precision, device):
    """One round as a well-written plain loop does it, with none of fedmed's code: the served model scored on the
    validation and test images (what a site round does first, :func:`tuned_scores`), then ``epochs`` of training —
    the images kept on the device as uint8, the batch gathered, flipped and normalised there, channels_last, a fused
    Adam on a GPU, the loss summed on the device and read once. Its random draws come from the same seeded CPU
    generator in the same order as a site's (permutation, then each batch's flips), so both train on the same batches."""
    tuned_scores(model, [data["val"], data["test"]], precision=precision, device=device)
    g = torch.Generator()
    g.manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=0.0,
                           **({"fused": True} if device.type == "cuda" else {}))
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    scaler = torch.amp.GradScaler("cuda") if precision == "fp16" and device.type == "cuda" else None
    x, y = data["train"]
    n = x.shape[0]
    cl = device.type == "cuda"
    total = torch.zeros((), device=device)
    model.train()
    for _ in range(epochs):
        order = torch.randperm(n, generator=g)
        starts = [s for s in range(0, n, batch_size) if n - s >= 2]
        flips = torch.cat([torch.rand(min(batch_size, n - s), generator=g) < 0.5 for s in starts])
        if device.type == "cuda":
            order, flips = order.pin_memory().to(device, non_blocking=True), flips.pin_memory().to(device, non_blocking=True)
        j = 0
        for s in starts:
            b = min(batch_size, n - s)
            idx, f = order[s:s + b], flips[j:j + b]
            j += b
            xb = x.index_select(0, idx).float().div_(255)
            xb = torch.where(f[:, None, None, None], xb.flip(-1), xb)
            xb = (xb - 0.5) / 0.5
            if cl:
                xb = xb.contiguous(memory_format=torch.channels_last)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                loss = torch.nn.functional.cross_entropy(model(xb).float(), y.index_select(0, idx))
            opt.zero_grad(set_to_none=True)
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            total += loss.detach()
    float(total)  # the one read of the round
    return model


@torch.no_grad()
def tuned_scores(model, xs, *, precision, device, batch_size=256):
    """Class probabilities of ``model`` on each uint8 image set of ``xs`` (resident), in the training precision, the
    whole set at ``batch_size`` with one copy back per set; none of fedmed's code."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    model.eval()
    out = []
    for x in xs:
        ps = []
        for s in range(0, x.shape[0], batch_size):
            xb = (x[s:s + batch_size].float().div_(255) - 0.5) / 0.5
            if device.type == "cuda":
                xb = xb.contiguous(memory_format=torch.channels_last)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                ps.append(torch.softmax(model(xb).float(), dim=1))
        out.append(torch.cat(ps).cpu().numpy() if ps else np.zeros((0, 0)))
    return out


def worst(pa, pb):
    """The largest weight difference between two state dicts, per tensor relative to its scale (at least 1: batch-norm
    running variances of a deep network run into the thousands, where an absolute tolerance says nothing), and where."""
    diffs = {k: float(np.abs(pa[k].astype(np.float64) - pb[k]).max()) /
             max(1.0, float(np.abs(pa[k].astype(np.float64)).max())) for k in pa if pa[k].size}
    key = max(diffs, key=diffs.get)
    return diffs[key], key


def same_weights(rerun, device, atol):
    """The check of :func:`_common.compare`: bit for bit on the CPU; on a GPU, whose kernels need not be
    deterministic, within ``max(atol, 2 x)`` the tuned loop's own difference from itself (``rerun()`` once more)."""
    def same(pa, pb):
        d, key = worst(pa, pb)
        print(f"largest weight difference after one round: {d:.3g} (relative to the tensor's scale; {key})")
        if device.type == "cpu":
            return d == 0.0
        spread, skey = worst(pa, rerun())
        print(f"the tuned loop against itself, run again: {spread:.3g} ({skey}); the sides count as the same within "
              f"max(--atol {atol:g}, 2 x that)")
        return d <= max(atol, 2 * spread)
    return same


def synthetic_cases(n: int, shape, seed: int = 0):
    """``n`` two-channel volumes of ``shape`` with an ellipsoid "tumour" each (three nested label channels)."""
    rng = np.random.default_rng(seed)
    grid = np.stack(np.meshgrid(*[np.arange(d) for d in shape], indexing="ij"))
    cases = []
    for _ in range(n):
        c = np.array([rng.uniform(0.3, 0.7) * d for d in shape])[:, None, None, None]
        r = np.array([rng.uniform(0.08, 0.15) * d for d in shape])[:, None, None, None]
        d2 = (((grid - c) / r) ** 2).sum(0)
        lab = np.stack([d2 < 1, d2 < 0.5, d2 < 0.2]).astype(np.uint8)
        img = rng.normal(size=(2, *shape)).astype(np.float32) + lab[:1].astype(np.float32)
        cases.append({"image": img, "label": lab, "meta": {"subject": f"s{len(cases)}"}})
    return cases


def tuned_seg_round(model, vols, *, epochs, patches, pos_fraction, roi, seed, precision, device, lr):
    """One site's 3D training as a well-written loop does it, with none of fedmed's code: each volume resident on
    the device (``vols``: (image, label, foreground flat indices, background flat indices) per case, the indices on
    the host), each patch centred on a drawn voxel and cut, flipped, scaled and shifted on the device, a fused Adam,
    MONAI's DiceFocalLoss, the loss summed on the device and read once. Its draws are the site's, in the site's
    order (case permutation; per patch: foreground or not, the voxel, three flips, scale, shift)."""
    from monai.losses import DiceFocalLoss

    opt = torch.optim.Adam(model.parameters(), lr=lr, **({"fused": True} if device.type == "cuda" else {}))
    loss_fn = DiceFocalLoss(sigmoid=True)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    rng = np.random.default_rng(seed)
    total = torch.zeros((), device=device)
    model.train()
    for _ in range(epochs):
        for i in rng.permutation(len(vols)):
            img, lab, fg, bg = vols[int(i)]
            shape = img.shape[1:]
            xs, ys = [], []
            for _k in range(patches):
                pos = rng.random() < pos_fraction
                pos = pos if len(fg) and len(bg) else bool(len(fg))
                pool = fg if pos else bg
                c = np.unravel_index(int(pool[rng.integers(len(pool))]), shape)
                st = [min(max(int(ci) - r // 2, 0), d - r) for ci, r, d in zip(c, roi, shape)]
                sl = (slice(None),) + tuple(slice(a, a + r) for a, r in zip(st, roi))
                x, y = img[sl], lab[sl]
                flips = [ax + 1 for ax in range(3) if rng.random() < 0.5]
                if flips:
                    x, y = torch.flip(x, flips), torch.flip(y, flips)
                scale, shift = 1.0 + rng.uniform(-0.1, 0.1), rng.uniform(-0.1, 0.1)
                xs.append(x * scale + shift)
                ys.append(y)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                loss = loss_fn(model(torch.stack(xs)).float(), torch.stack(ys).float())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += loss.detach()
    float(total)
    return model


def main_seg3d(a, device) -> int:
    """3D patches: the tuned loop against fedmed's ``train_seg_local`` over volumes kept on the device
    (``DeviceVolumes``), both from the same weights and draws; and the time of the CPU-crop path (MONAI transforms in
    ``--workers`` loader processes, the path a GPU site took before #54) for reference."""
    from fedmed.nn.models import seg_model_from_config
    from fedmed.nn.resident import DeviceVolumes
    from fedmed.nn.seg import train_seg_local
    from fedmed.nn.train import get_params, make_optimizer, set_params

    shape, roi = tuple(a.volume), (a.roi,) * 3
    cases = synthetic_cases(a.cases, shape)
    cfg = {"arch": "SegResNet", "args": {"init_filters": 16, "blocks_down": [1, 2, 2, 4], "blocks_up": [1, 1, 1]}}
    net = seg_model_from_config(cfg, 2, seed=0).to(device)
    theta = get_params(net)
    vols = DeviceVolumes(cases, device, roi)
    mine = [(vols.images[i], vols.labels[i], vols.fg[i], vols.bg[i]) for i in range(len(vols))]
    kw = dict(epochs=a.epochs, patches=a.patches, pos_fraction=0.67, seed=0, precision=a.precision)
    lr = 3e-4

    def adam():  # fedmed's optimizer for the site (fused on a GPU), as the tuned loop's: Adam, no weight decay
        return make_optimizer(net, {"optimizer": "adam", "lr": lr, "weight_decay": 0.0})

    def side_a():
        set_params(net, theta)
        return get_params(tuned_seg_round(net, mine, roi=roi, device=device, lr=lr, **kw))

    def side_b():
        set_params(net, theta)
        train_seg_local(net, vols, roi=roi, optimizer=adam(), **kw)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return get_params(net)

    same = same_weights(side_a, device, a.atol)

    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    name = f"SegResNet {a.roi}^3 patches {a.precision}, {a.cases} cases of 2x{'x'.join(map(str, shape))} on {card}"
    res = compare(name, side_a, side_b, label_a="tuned 3D loop", label_b="fedmed DeviceVolumes", pairs=a.pairs,
                  same=same)
    n_patches = a.epochs * a.cases * a.patches
    res.update(device=name, patches_per_round=n_patches, a_patches_per_s=n_patches / res["a_wall"],
               b_patches_per_s=n_patches / res["b_wall"])
    def side_c():  # the path before #54: MONAI's crops on the CPU in loader processes (other draws: timed only)
        set_params(net, theta)
        train_seg_local(net, cases, roi=roi, optimizer=adam(), workers=a.workers, **kw)
        if device.type == "cuda":
            torch.cuda.synchronize()

    crops = compare(f"{name}, CPU crops", side_b, side_c, label_a="fedmed DeviceVolumes",
                    label_b=f"fedmed with MONAI's crops on the CPU in {a.workers} loader processes", pairs=a.pairs,
                    check=False)
    res["cpu_crops_patches_per_s"] = n_patches / crops["b_wall"]
    print(f"[{name}] patches/s: tuned loop {res['a_patches_per_s']:.1f}, fedmed on the device "
          f"{res['b_patches_per_s']:.1f} (x{res['a_wall'] / res['b_wall']:.2f}), fedmed with MONAI's crops on the CPU "
          f"in {a.workers} loader processes {res['cpu_crops_patches_per_s']:.1f} (interleaved with the device path)")
    if device.type == "cuda":
        res["peak_device_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        print(f"[{name}] peak device memory: {res['peak_device_memory_gib']:.2f} GiB")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1, default=str))
    return 0


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
    ap.add_argument("--data", type=Path, default=BUSI, help="a folder of class folders (default: BUSI)")
    ap.add_argument("--task", default="classification", choices=["classification", "seg3d"],
                    help="seg3d: 3D patches (SegResNet) on synthetic volumes, --volume/--roi/--cases/--patches")
    ap.add_argument("--volume", type=int, nargs=3, default=[144, 176, 144])
    ap.add_argument("--roi", type=int, default=96)
    ap.add_argument("--cases", type=int, default=8)
    ap.add_argument("--patches", type=int, default=2, help="patches per case per step")
    ap.add_argument("--workers", type=int, default=4, help="loader processes of the CPU-crop reference")
    ap.add_argument("--device-data-gb", type=float, default=None, help="the site's device_data_gb (0: its images stay "
                    "in pinned host memory, each batch copied on a side stream)")
    ap.add_argument("--deterministic", action="store_true", help="cuDNN's deterministic algorithms on both sides (the "
                    "site through its train.deterministic)")
    a = ap.parse_args(argv)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench_gpu: no CUDA GPU on this machine; nothing measured (give --device cpu for a smoke run)")
        return 0
    if a.task == "seg3d":
        return main_seg3d(a, torch.device(a.device))
    from fedmed.nn.models import model_from_config
    from fedmed.site.runner import SiteRunner
    from fedmed.nn.train import get_params, set_params

    device = torch.device(a.device)
    if a.deterministic:  # cuDNN's deterministic algorithms only: the site by its train.deterministic, the loop here
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    tmp = Path(tempfile.mkdtemp(prefix="bench_gpu_"))
    atexit.register(shutil.rmtree, tmp, True)  # the benchmark's datalists: removed when the process ends
    root, n_classes = federation(a.n, tmp, a.data)
    model_cfg = {"arch": a.arch, "width": 16, "norm": "batch"}
    cfg = {"seed": 0, "data": {"image_size": a.image_size, "channels": 1, "n_classes": n_classes},
           "model": model_cfg, "privacy": {"k_min": 1},
           "train": {"local_epochs": a.epochs, "batch_size": a.batch_size, "optimizer": "adam", "lr": 1e-3,
                     "weight_decay": 0.0, "augment": "flip", "keep_optimizer_state": False, "device": a.device,
                     "precision": a.precision, "deterministic": a.deterministic}}
    runner = SiteRunner("site-1", root)
    runner.settings.device_data_gb = a.device_data_gb
    s = runner.splits(cfg)
    x, y = s.train

    def u8(t):  # the benchmark's own copy of the images on the device, as 8-bit codes
        return (t * 255).round().to(torch.uint8).to(device)

    data = {"train": (u8(x), y.to(device)), "val": u8(s.val[0]), "test": u8(s.test[0])}
    theta = get_params(model_from_config(model_cfg, 1, n_classes, seed=0))
    net = model_from_config(model_cfg, 1, n_classes, seed=0).to(device)
    if device.type == "cuda":
        net = net.to(memory_format=torch.channels_last)
    seed = runner.generator(cfg, 0).initial_seed()

    def side_a():
        set_params(net, theta)
        return get_params(tuned_round(net, data, epochs=a.epochs, batch_size=a.batch_size, lr=1e-3, seed=seed,
                                      precision=a.precision, device=device))

    def side_b():
        out = runner.handle("train", theta, cfg, 0).params
        if device.type == "cuda":
            torch.cuda.synchronize()
        return out

    same = same_weights(side_a, device, a.atol)

    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    name = f"{a.arch} {a.image_size}px {a.precision} batch {a.batch_size} on {card}"
    res = compare(name, side_a, side_b, label_a="tuned loop", label_b="fedmed site round", pairs=a.pairs, same=same)
    images = a.epochs * x.shape[0]
    res.update(device=name, images_per_round=images, a_images_per_s=images / res["a_wall"],
               b_images_per_s=images / res["b_wall"])
    print(f"[{name}] training images/s: tuned loop {res['a_images_per_s']:.1f}, fedmed site {res['b_images_per_s']:.1f} "
          f"(site / tuned x{res['a_wall'] / res['b_wall']:.2f}; both also score the served model on the validation "
          f"and test images first)")

    # inference: fedmed's scoring of a split kept on the device against the tuned pass, over all the site's images
    from fedmed.nn.train import predict_proba

    xs_all = torch.cat([x, s.val[0], s.test[0]])
    all_u8 = u8(xs_all)
    model = runner.model(cfg)
    set_params(model, theta)
    set_params(net, theta)
    resident = runner.on_device(xs_all, cfg)

    def inf_a():
        return tuned_scores(net, [all_u8], precision=a.precision, device=device)[0]

    def inf_b():
        return predict_proba(model, resident, precision=a.precision)

    def same_probs(pa, pb):
        d = float(np.abs(pa - pb).max())
        print(f"largest probability difference: {d:.3g}")
        return d <= (0.0 if device.type == "cpu" else 1e-2)

    inf = compare(f"inference {name}", inf_a, inf_b, label_a="tuned pass", label_b="fedmed predict_proba",
                  pairs=a.pairs, same=same_probs)
    m = xs_all.shape[0]
    res["inference"] = {**inf, "images": m, "a_images_per_s": m / inf["a_wall"], "b_images_per_s": m / inf["b_wall"]}
    print(f"[{name}] inference images/s: tuned pass {m / inf['a_wall']:.1f}, fedmed {m / inf['b_wall']:.1f} "
          f"(fedmed / tuned x{inf['a_wall'] / inf['b_wall']:.2f})")
    if device.type == "cuda":
        res["peak_device_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        print(f"[{name}] peak device memory: {res['peak_device_memory_gib']:.2f} GiB")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
