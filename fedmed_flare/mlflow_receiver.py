"""FLARE's MLflow receiver with the server as a run of its own and a ``file:`` store in the run's folder by default
(:mod:`fedmed_flare.tracking`). Imported only when a job turns MLflow on (it needs ``mlflow``)."""

from __future__ import annotations

from pathlib import Path

from nvflare.apis.fl_context import FLContext
from nvflare.app_opt.tracking.mlflow.mlflow_receiver import MLflowReceiver as _FlareMLflowReceiver

from fedmed_flare.destinations import allow_file_store, check_receiver, file_store_uri

__all__ = ["MLflowReceiver"]


class MLflowReceiver(_FlareMLflowReceiver):
    """``nvflare.app_opt.tracking.mlflow.MLflowReceiver``, same arguments; see the module notes."""

    def _get_tracking_uri(self, fl_ctx: FLContext):
        uri = self.tracking_uri or file_store_uri(fl_ctx.get_engine().get_workspace().get_run_dir(fl_ctx.get_job_id()))
        allow_file_store(uri)
        return uri

    def _get_artifact_location(self, relative_path: str, fl_ctx: FLContext):
        """Beside a local store (``file:`` or ``sqlite:``), so that the artifacts stay with it; else FLARE's (the run's
        folder at the server)."""
        from urllib.parse import unquote, urlparse

        uri = self._get_tracking_uri(fl_ctx)
        if uri.startswith("file:"):
            return str(Path(unquote(urlparse(uri).path)).parent / "mlartifacts")
        if uri.startswith("sqlite:///"):
            return str(Path(uri[len("sqlite:///"):]).parent / "mlartifacts")
        return super()._get_artifact_location(relative_path, fl_ctx)

    def initialize(self, fl_ctx: FLContext):
        check_receiver(self)  # the server's policy decides where metrics may go, before anything is contacted
        super().initialize(fl_ctx)
        me = fl_ctx.get_identity_name()  # the server: its own metrics, the run's parameters and result
        if me and me not in self.buffer:
            art = self._get_artifact_location(self.artifact_location, fl_ctx)
            tags = self._get_tags("experiment_tags", kwargs=self.kw_args)
            self._mlflow_setup(art, self.kw_args.get("experiment_name", "FLARE FL Experiment"), tags, [me], fl_ctx)
            self._init_buffer([me])
