"""How the 3D post-processing was chosen, on inner validation data only (docs/readings.md "3D recipe").

    .venv/bin/python benchmarks/seg_inner_validation.py [--seed 0] [--rounds 10]

Builds ``app_configs/brats_seg.yaml``'s federation for ``--seed`` and uses **only its training cases**: site-2's
training subject is held out as the validation case, the other sites' training cases are pooled and trained
centrally with the config's recipe (the same ``train_seg_local`` the sites run). After each round the validation
case is scored with and without :func:`fedmed.nn.seg.keep_largest_component` (WT / TC / ET Dice, WT HD95 in mm,
false-positive voxels on tumour-free halves). The test subjects of the federation are never read. About one
minute per round on one CPU thread.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None):
    import torch

    from fedmed.nn import seg as S
    from fedmed.config import load_config
    from fedmed.run.experiment import prepare_federation
    from fedmed.site.seg import SegSiteRunner
    from fedmed.nn.train import make_optimizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "app_configs" / "brats_seg.yaml"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=None, help="default: the config's train.rounds")
    ap.add_argument("--holdout", default="site-2", help="the site whose training case is the validation case")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    exp = load_config(a.config)
    data = prepare_federation(exp, a.seed, Path(tempfile.mkdtemp(prefix="seg_inner_")))
    sites = json.loads((data / "dataset.json").read_text())["sites"]
    cfg = {"task": "segmentation", "seed": a.seed, "model": exp.model.model_dump(), "train": exp.train.model_dump(),
           "data": {"shape": exp.dataset.shape, "roi": exp.dataset.roi, "in_channels": len(exp.dataset.modalities)},
           "privacy": exp.privacy.model_dump()}
    train_cases = {s: SegSiteRunner(s, data).cases(cfg)[0] for s in sites}  # [0]: training cases only
    val = train_cases[a.holdout]
    train = [c for s in sites if s != a.holdout for c in train_cases[s]]
    print(f"training cases {len(train)}, validation cases {len(val)} "
          f"({sum(int(c['label'][0].sum() > 0) for c in val)} with tumour); test cases not read", flush=True)
    t, roi = exp.train, tuple(exp.dataset.roi)
    model = S.seg_model(cfg["data"]["in_channels"], channels=exp.model.channels, seed=a.seed)
    opt = make_optimizer(model, cfg["train"])
    keys = ("dice_wt", "dice_tc", "dice_et", "hd95_wt", "fp_voxels")
    t0 = time.time()
    print("round | seconds | " + " | ".join(f"plain {k}" for k in keys) + " | " + " | ".join(f"largest {k}" for k in keys))
    for r in range(1, (a.rounds or t.rounds) + 1):
        S.train_seg_local(model, train, epochs=t.local_epochs, optimizer=opt, roi=roi,
                          patches=t.seg.patches_per_volume, pos_fraction=t.seg.pos_fraction, loss=t.seg.loss,
                          seed=a.seed * 1000 + r)
        plain = S.seg_metrics(model, val, roi, largest_component=False)
        lcc = S.seg_metrics(model, val, roi, largest_component=True)
        print(f"{r} | {time.time() - t0:.0f} | " + " | ".join(f"{plain[k]:.3f}" for k in keys) + " | "
              + " | ".join(f"{lcc[k]:.3f}" for k in keys), flush=True)


if __name__ == "__main__":
    main()
