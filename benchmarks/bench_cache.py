"""The site-side cache (issue #28 item 4): how long a site takes to load its data with and without it.

    .venv/bin/python benchmarks/bench_cache.py [--config app_configs/brats_seg.yaml] [--pairs 5]

Writes the config's federation (seed 0), then for every site times what a run's first task does to get its data —
a fresh site runner (``fedmed.site``: a new process has no memory of earlier runs) loading every case or image of
its datalist — in interleaved pairs (A B A B ..., ``benchmarks/_common.py``): A with the cache off
(``FEDMED_CACHE=0``: decode, crop, resample as every run did before), B with a cache an earlier run filled (what a
study's later runs do: hash the files, read the stored arrays). Both sides must give bit-identical arrays and the
same case metadata before any timing. The default is BraTS-2013 (6 subjects as 12 hemisphere cases, FLAIR + T1c,
NIfTI, resampled to the config's shape); any classification config works too (its image splits).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import compare


def main(argv=None) -> int:
    from fedmed.config import load_config
    from fedmed.run.experiment import prepare_federation
    from fedmed.run.taskconfig import build_task_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "app_configs" / "brats_seg.yaml"))
    ap.add_argument("--pairs", type=int, default=5)
    a = ap.parse_args(argv)
    exp = load_config(a.config)
    if not Path(exp.dataset.path).exists() and not str(exp.dataset.path).startswith("builtin:"):
        print(f"the dataset {exp.dataset.path} is absent; nothing to measure")
        return 1
    tmp = Path(tempfile.mkdtemp(prefix="bench_cache_"))
    data = prepare_federation(exp, 0, tmp / "data")
    meta = json.loads((data / "dataset.json").read_text())
    seg = exp.dataset.task == "segmentation"
    if seg:
        cfg = build_task_config(exp, 0, exp.methods[-1], meta["sites"])
    cache_dir = tmp / "cache"

    def load(cache_on: bool):
        if cache_on:
            os.environ.pop("FEDMED_CACHE", None)
        else:
            os.environ["FEDMED_CACHE"] = "0"
        os.environ["FEDMED_CACHE_DIR"] = str(cache_dir)
        out = {}
        for site in meta["sites"]:
            if seg:
                from fedmed.site.seg import SegSiteRunner

                tr, te = SegSiteRunner(site, data).cases(cfg)
                out[site] = [(c["image"], c["label"], c["meta"]) for c in (*tr, *te)]
            else:
                from fedmed.site.runner import SiteRunner

                d = SiteRunner(site, data).data(exp.dataset.image_size, exp.dataset.channels)
                out[site] = [np.asarray(t) for split in (d.train, d.val, d.test) for t in split]
        return out

    def same(x, y) -> bool:
        for site in x:
            for u, v in zip(x[site], y[site]):
                for p, q in (zip(u, v) if isinstance(u, tuple) else [(u, v)]):
                    if isinstance(p, dict):
                        if json.dumps(p, sort_keys=True) != json.dumps(q, sort_keys=True):
                            return False
                    elif not np.array_equal(np.asarray(p), np.asarray(q)):
                        return False
                    elif (np.asarray(p).dtype, np.asarray(p).strides) != (np.asarray(q).dtype, np.asarray(q).strides):
                        return False  # the same values in another memory layout train apart (#38)
        return True

    n = sum(len(json.loads((data / f"{s}.json").read_text()).get(k, [])) for s in meta["sites"]
            for k in ("training", "validation", "test"))
    print(f"{Path(a.config).name}: {len(meta['sites'])} sites, {n} datalist entries; cache in {cache_dir}")
    load(True)  # an earlier run filled the cache
    res = compare("site data loading", lambda: load(False), lambda: load(True), label_a="no cache",
                  label_b="cache filled", pairs=a.pairs, same=same)
    size = sum(f.stat().st_size for f in cache_dir.rglob("*") if f.is_file())
    print(f"cache size {size / 2**20:.1f} MiB; saved per run {res['a_wall'] - res['b_wall']:.1f} s of "
          f"{res['a_wall']:.1f} s (wall, all sites in one process)")
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
