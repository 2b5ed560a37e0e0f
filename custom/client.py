"""NVFlare Client API script: one site's side of every fedmed workflow.

The job names no data: the site finds its datalist through its own settings
(``fedmed.site_settings``: ``FEDMED_DATALIST`` / ``FEDMED_DATALIST_DIR`` / ``FEDMED_SITE_CONFIG`` or the
startup kit's ``local/fedmed_site.json``) and hands each task to ``fedmed.site.SiteRunner``. A task the
site cannot do (no data configured, missing/corrupt image, bad datalist) is answered with an error
message — naming the site and files relative to its data root, never an absolute path — instead of
crashing, so the rest of the federation finishes.
"""

import argparse
import sys
import traceback
from pathlib import Path

import nvflare.client as flare
from nvflare.app_common.abstract.fl_model import FLModel

from fedmed.compat import serialize_ast_parse
from fedmed.models import USER_CODE_DIR

serialize_ast_parse()  # FLARE decodes arrays in its own threads (np.load -> ast.parse): fedmed/compat.py


def to_meta(d: dict) -> dict:
    """Arrays travel in FLModel.meta (not params)."""
    import numpy as np

    return {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in d.items()}


APP_CUSTOM = Path(__file__).resolve().parents[1]  # this job's custom folder at the site (shipped weights live here)
if str(APP_CUSTOM / USER_CODE_DIR) not in sys.path:  # a user's network class travels in the job (fedmed.models)
    sys.path.insert(0, str(APP_CUSTOM / USER_CODE_DIR))


def localize(cfg: dict) -> dict:
    """Weights shipped in the job are named relative to the job's custom folder."""
    for section in ("signature", "assess"):
        sec = cfg.get(section)
        if isinstance(sec, dict) and sec.get("weights") and not Path(sec["weights"]).is_absolute():
            sec["weights"] = str(APP_CUSTOM / sec["weights"])
    return cfg


def make_runner(site: str, cfg: dict):
    from fedmed.site_settings import resolve_site_settings

    settings = resolve_site_settings(site)
    if cfg.get("task") == "mae":
        from fedmed.ssl_site import MAESiteRunner

        return MAESiteRunner(site, settings)
    if cfg.get("task") == "segmentation":
        from fedmed.seg_site import SegSiteRunner

        return SegSiteRunner(site, settings)
    from fedmed.site import SiteRunner

    return SiteRunner(site, settings)


def scrubbed(site: str, runner, err: Exception) -> str:
    from fedmed.site_settings import scrub

    msg = str(err) if str(err).startswith(site) else f"{site}: {type(err).__name__}: {err}"
    return runner.settings.scrub(msg) if runner is not None else scrub(msg, [])


POLL_S = 0.02  # seconds between the in-process Client API's checks (FLARE 2.9: 0.5, no public setting)


def fast_polling(ctx) -> None:
    """FLARE 2.9's in-process Client API polls twice per task at 0.5 s: the executor waiting for this script's
    result (``in_process_backend._RESULT_POLL_INTERVAL``, read at every wait) and this script's ``receive()``
    waiting for the next task (the API object's ``result_check_interval``). Both are waits, not work: ~0.5 s of
    every round at every site. Set both to :data:`POLL_S` where this FLARE has them; nothing else changes."""
    try:
        from nvflare.app_common.executors.client_api import in_process_backend

        if hasattr(in_process_backend, "_RESULT_POLL_INTERVAL"):
            in_process_backend._RESULT_POLL_INTERVAL = POLL_S
    except ImportError:
        pass
    api = getattr(ctx, "api", None)
    if hasattr(api, "result_check_interval"):
        api.result_check_interval = POLL_S


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads for this site")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(max(1, args.threads))
    from fedmed import memtrace

    tracing = memtrace.start()  # benchmarks/bench_memory.py --trace only
    fast_polling(flare.init())
    site = flare.get_site_name()
    runner = None
    writer = None
    while flare.is_running():
        incoming = flare.receive()
        if incoming is None:
            break
        task = flare.get_task_name()
        cfg = localize(incoming.meta.get("fedmed", {}))
        rnd = incoming.current_round or 0
        try:
            if runner is None:
                runner = make_runner(site, cfg)
            params, metrics, meta = runner.handle(task, incoming.params or {}, cfg, rnd)
            meta = runner.settings.scrub_reply(meta)  # no absolute path in any text that leaves the site
        except Exception as e:  # reported to the server by name; the federation goes on
            msg = scrubbed(site, runner, e)
            print(f"[fedmed] {msg}\n{traceback.format_exc()}", flush=True)
            flare.send(FLModel(params={}, metrics={"failed": 1.0}, meta={"error": msg, "task": task}))
            continue
        if writer is None:
            from nvflare.client.tracking import SummaryWriter

            writer = SummaryWriter()
        import math

        for k, v in metrics.items():  # served model's metrics before training; train loss of this round
            if isinstance(v, (int, float)) and math.isfinite(v):
                tag = f"train/{k}" if k == "train_loss" else f"{'val' if k.startswith('val_') else 'test'}/" \
                      f"{k[4:] if k.startswith('val_') else k}"
                writer.add_scalar(f"{site}/{tag}", float(v), global_step=int(rnd))
        flare.send(FLModel(params=params, metrics=metrics, meta=to_meta({**meta, "task": task, "round": rnd,
                                                                          "cluster": meta.get("cluster", cfg.get("cluster"))})))
        memtrace.trim()  # FLARE's freed stream buffers back to the system (halves the sites' RSS growth)
        if tracing:
            memtrace.checkpoint(site, rnd)


if __name__ == "__main__":
    main()
