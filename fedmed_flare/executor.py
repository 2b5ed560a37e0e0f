"""A site's side of every fedmed workflow on FLARE: one :class:`SiteExecutor`, installed with fedmed and named by the
job by class path (the job carries no code).

The job names no data: the site finds its datalist and its policy through its own settings
(``fedmed.site.settings``: ``FEDMED_DATALIST`` / ``FEDMED_DATALIST_DIR`` / ``FEDMED_SITE_CONFIG`` or the startup kit's
``local/fedmed_site.json``; ``fedmed.site.policy``: ``local/fedmed_policy.json``) and hands each task to
``fedmed.site.reply.answer`` — the same reply loop the in-process federation runs. A task the site cannot do (no data
configured, a job asking for what the site's policy does not allow, a missing or corrupt image) is answered with a
one-line error that names the split and position, never a file or folder, so the rest of the federation finishes;
the site's own log has the full message.
"""

from __future__ import annotations

import math
from pathlib import Path

from nvflare.apis.analytix import AnalyticsDataType
from nvflare.apis.event_type import EventType
from nvflare.apis.executor import Executor
from nvflare.apis.fl_constant import FLContextKey
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.apis.signal import Signal
from nvflare.apis.utils.analytix_utils import create_analytic_dxo, send_analytic_dxo
from nvflare.app_common.abstract.fl_model import FLModel
from nvflare.app_common.utils.fl_model_utils import FLModelUtils

from fedmed.core.compat import serialize_ast_parse
from fedmed.core.jobfiles import USER_CODE_DIR

serialize_ast_parse()  # FLARE decodes arrays in its own threads (np.load -> ast.parse): fedmed/core/compat.py

__all__ = ["SiteExecutor"]


def _tag(key: str) -> str:
    """The TensorBoard tag of a reply metric: train loss, validation and test scores of the served model."""
    if key == "train_loss":
        return f"train/{key}"
    return f"val/{key[4:]}" if key.startswith("val_") else f"test/{key}"


class SiteExecutor(Executor):
    """Answers every fedmed task at this site.

    Args:
        threads: torch CPU threads of this site's work.
    """

    def __init__(self, threads: int = 1):
        super().__init__()
        self.threads = int(threads)  # attribute named as the argument: FedJob exports it from the instance
        self._runner = None

    def handle_event(self, event_type: str, fl_ctx: FLContext):
        if event_type == EventType.START_RUN:
            import torch

            torch.set_num_threads(max(1, self.threads))
            from fedmed.core import memtrace

            memtrace.start()  # benchmarks/bench_memory.py --trace only
            app_root = fl_ctx.get_prop(FLContextKey.APP_ROOT)
            user_code = Path(app_root or ".") / "custom" / USER_CODE_DIR
            if user_code.is_dir():
                from fedmed.core.plugins import add_code_folder

                # only a job FLARE authorised as custom code (BYOC) has this folder; whether a module in it may be
                # imported is still the site policy's decision (fedmed.site.policy); it comes after everything
                # installed, so none of its modules shadows an installed one
                add_code_folder(user_code)

    def _may_track(self, cfg: dict, fl_ctx: FLContext) -> bool:
        """Whether this site sends its per-round metrics to the job's trackers — its own policy's decision alone: a
        policy of ``tracking: []`` (the default) keeps them at the site whatever the job says (the job's ``tracking``
        list is the job's own word, not where the server's receivers really send); a policy that lists destinations
        (or ``"*"``) sends where it allows every destination the job names. Said once in the site's log when not."""
        if self._runner is None:
            return False
        policy = self._runner.policy
        why = "its policy keeps its metrics at the site (tracking: [])" if not policy.tracking else \
            policy.refused_tracking(list(cfg.get("tracking") or []))
        if why and not getattr(self, "_tracking_noted", False):
            self._tracking_noted = True
            self.log_warning(fl_ctx, f"[fedmed] this site sends no metrics to the job's trackers: {why}",
                             fire_event=False)
        return why is None

    def execute(self, task_name: str, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        from fedmed.core import memtrace
        from fedmed.site.reply import answer

        site = fl_ctx.get_identity_name()
        incoming = FLModelUtils.from_shareable(shareable)
        cfg = dict((incoming.meta or {}).get("task_config", {}))
        rnd = int(incoming.current_round or 0)
        self._runner, reply, error = answer(site, self._runner, task_name, incoming.params or {}, cfg, rnd,
                                            workspace=Path.cwd())  # FLARE runs a site in its own folder
        metrics, meta = reply.metrics, reply.meta
        if error is not None:  # one line in this site's log (files named relative to its data root), the traceback
            # at debug level; the server gets the redacted one-line reply
            line, _, trace = error.partition("\n")
            self.log_error(fl_ctx, f"[fedmed] {line}", fire_event=False)
            if trace:
                self.log_debug(fl_ctx, f"[fedmed] {trace}", fire_event=False)
            return FLModelUtils.to_shareable(FLModel(params={}, metrics=metrics, meta=meta))
        for k, v in metrics.items() if self._may_track(cfg, fl_ctx) else ():  # served model's metrics before
            # training; train loss of this round
            if isinstance(v, (int, float)) and math.isfinite(v):
                dxo = create_analytic_dxo(f"{site}/{_tag(k)}", float(v), AnalyticsDataType.SCALAR, global_step=rnd)
                send_analytic_dxo(self, dxo, fl_ctx)
        out = FLModelUtils.to_shareable(FLModel(params=reply.params, metrics=metrics, meta=meta))
        memtrace.trim()  # freed stream buffers back to the system (halves the sites' RSS growth)
        memtrace.checkpoint(site, rnd)
        return out
