"""NVFlare Client API script: one site's side of every fedmed workflow.

It reads the site's datalist (``<datalist_dir>/<site>.json``; the environment variable
``FEDMED_DATALIST_DIR`` overrides the job's argument on provisioned sites) and hands each task to
``fedmed.site.SiteRunner``. A task the site cannot do (missing/corrupt image, bad datalist) is
answered with an error message instead of crashing, so the rest of the federation finishes.
"""

import argparse
import os
import traceback

import numpy as np
import nvflare.client as flare
from nvflare.app_common.abstract.fl_model import FLModel
from nvflare.client.tracking import SummaryWriter

from fedmed.site import SiteRunner


def to_meta(d: dict) -> dict:
    """Arrays travel in FLModel.meta (not params) as plain lists."""
    return {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in d.items()}


def make_runner(site, datalists, cfg):
    if cfg.get("task") == "segmentation":
        from fedmed.seg_site import SegSiteRunner

        return SegSiteRunner(site, datalists)
    return SiteRunner(site, datalists)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--datalist-dir", required=True)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads for this site")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(max(1, args.threads))
    flare.init()
    site = flare.get_site_name()
    datalists = os.environ.get("FEDMED_DATALIST_DIR", args.datalist_dir)
    runner = None
    writer = SummaryWriter()
    while flare.is_running():
        incoming = flare.receive()
        if incoming is None:
            break
        task = flare.get_task_name()
        cfg = incoming.meta.get("fedmed", {})
        rnd = incoming.current_round or 0
        if runner is None:
            runner = make_runner(site, datalists, cfg)
        try:
            params, metrics, meta = runner.handle(task, incoming.params or {}, cfg, rnd)
        except Exception as e:  # reported to the server by name; the federation goes on
            msg = str(e) if str(e).startswith(site) else f"{site}: {type(e).__name__}: {e}"
            print(f"[fedmed] {msg}\n{traceback.format_exc()}", flush=True)
            flare.send(FLModel(params={}, metrics={"failed": 1.0}, meta={"error": msg, "task": task}))
            continue
        for k, v in metrics.items():
            if isinstance(v, (int, float)) and np.isfinite(v):
                writer.add_scalar(f"{task}/{k}", float(v), global_step=int(rnd))
        flare.send(FLModel(params=params, metrics=metrics, meta=to_meta({**meta, "task": task, "round": rnd,
                                                                          "cluster": meta.get("cluster", cfg.get("cluster"))})))


if __name__ == "__main__":
    main()
