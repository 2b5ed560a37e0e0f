"""NVFlare Client API script: one site's side of every fedmed workflow.

The job names no data: the site finds its datalist through its own settings
(``fedmed.site.settings``: ``FEDMED_DATALIST`` / ``FEDMED_DATALIST_DIR`` / ``FEDMED_SITE_CONFIG`` or the
startup kit's ``local/fedmed_site.json``) and hands each task to ``fedmed.site.runner.answer`` (the same reply loop the in-process federation runs). A task the
site cannot do (no data configured, missing/corrupt image, bad datalist) is answered with an error
message — naming the site and files relative to its data root, never an absolute path — instead of
crashing, so the rest of the federation finishes.
"""

import argparse
import sys
from pathlib import Path

import nvflare.client as flare
from nvflare.app_common.abstract.fl_model import FLModel

from fedmed.core.compat import serialize_ast_parse
from fedmed.nn.models import USER_CODE_DIR
from fedmed.site.runner import answer

serialize_ast_parse()  # FLARE decodes arrays in its own threads (np.load -> ast.parse): fedmed/compat.py


APP_CUSTOM = Path(__file__).resolve().parents[1]  # this job's custom folder at the site (shipped weights live here)
if str(APP_CUSTOM / USER_CODE_DIR) not in sys.path:  # a user's network class travels in the job (fedmed.nn.models)
    sys.path.insert(0, str(APP_CUSTOM / USER_CODE_DIR))


def localize(cfg: dict) -> dict:
    """Weights shipped in the job are named relative to the job's custom folder."""
    for section in ("signature", "assess"):
        sec = cfg.get(section)
        if isinstance(sec, dict) and sec.get("weights") and not Path(sec["weights"]).is_absolute():
            sec["weights"] = str(APP_CUSTOM / sec["weights"])
    return cfg


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
    from fedmed.core import memtrace

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
        runner, params, metrics, meta, error = answer(site, runner, task, incoming.params or {}, cfg, rnd)
        if error is not None:  # reported to the server by name; the federation goes on
            print(f"[fedmed] {error}", flush=True)
            flare.send(FLModel(params={}, metrics=metrics, meta=meta))
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
        flare.send(FLModel(params=params, metrics=metrics, meta=meta))
        memtrace.trim()  # FLARE's freed stream buffers back to the system (halves the sites' RSS growth)
        if tracing:
            memtrace.checkpoint(site, rnd)


if __name__ == "__main__":
    main()
