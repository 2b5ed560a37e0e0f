"""Small copies of the natural breast-ultrasound federation's images, to travel to a GPU machine (issue #53).

    .venv/bin/python benchmarks/gpu_data.py --out .gpudata/nat [--size 224] [--quality 90]

A GPU machine lent to a session receives the working tree and at most 64 MiB beside it, so the two classification
sources of ``app_configs/breast_us_natural.yaml`` (BUS-BRA's ``index.csv`` + images, BUSI's benign and malignant
folders) are copied at ``size`` x ``size``, resized exactly as fedmed's loader resizes (PIL bilinear, grayscale to the
image's own mode) and stored as JPEG: a run at ``size`` px reads nearly the original pixels (JPEG's rounding only), a
run at a smaller size resizes this copy instead of the original (not bit for bit the CPU runs' inputs; the tables made
from it say so). Masks and BUSI's ``normal`` class are left behind (the classification config never reads them).
Use the copy with ``--set`` overrides of ``dataset.sources`` (``benchmarks/transfer_gpu.sh`` does).
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

from PIL import Image

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def _gray(im) -> bool:
    r, g, b = im.split()
    return r.tobytes() == g.tobytes() == b.tobytes()


def shrink(src: Path, dst: Path, size: int, quality: int) -> None:
    with Image.open(src) as im:
        im = im.convert("RGB") if im.mode not in ("L", "I;16", "I") else im
        if im.mode == "RGB" and _gray(im):
            im = im.convert("L")  # BUSI's RGB files hold one gray plane three times: stored once, read back the same
        dst.parent.mkdir(parents=True, exist_ok=True)
        im.resize((size, size), Image.BILINEAR).save(dst, "JPEG", quality=quality)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".gpudata/nat")
    ap.add_argument("--data", default=str(SHARED), help="the shared data folder (bus_bra/, busi/)")
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--quality", type=int, default=90)
    a = ap.parse_args(argv)
    data, out = Path(a.data), Path(a.out)
    rows = list(csv.DictReader(open(data / "bus_bra" / "index.csv", newline="")))
    cols = [c for c in rows[0] if c != "mask"]
    (out / "bus_bra").mkdir(parents=True, exist_ok=True)
    with open(out / "bus_bra" / "index.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            rel = Path(r["image"]).with_suffix(".jpg")
            shrink(data / "bus_bra" / r["image"], out / "bus_bra" / rel, a.size, a.quality)
            w.writerow({**r, "image": str(rel)})
    n = 0
    for cls in ("benign", "malignant"):
        for src in sorted((data / "busi" / "Dataset_BUSI_with_GT" / cls).iterdir()):
            if src.suffix.lower() in (".png", ".jpg", ".jpeg") and "_mask" not in src.stem:
                shrink(src, out / "busi" / cls / (src.stem + ".jpg"), a.size, a.quality)
                n += 1
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"{out}: {len(rows)} BUS-BRA and {n} BUSI images at {a.size}x{a.size} (JPEG q{a.quality}), "
          f"{total / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
