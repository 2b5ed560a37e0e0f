"""The base of every server workflow: its config, the model it starts from, and the calls it makes on its
:class:`~fedmed.workflows.federation.Federation`."""

from __future__ import annotations

import copy
from pathlib import Path
from types import MappingProxyType

__all__ = ["Workflow", "initial_params"]


def initial_params(cfg: dict, app_custom=None) -> dict:
    """The model every site starts from (the seeded network, or ``model.init_weights``, which the job carries in the
    server app's custom folder ``app_custom``)."""
    from fedmed.core.schema import task_config
    from fedmed.nn.train import get_params

    t = task_config(cfg)
    m, d = t.model.model_dump(), t.data
    if t.task == "mae":
        from fedmed.nn.mae import mae_model

        return get_params(mae_model(d.channels, mask_ratio=t.mae.mask_ratio, seed=t.seed))
    if t.task == "segmentation":
        from fedmed.nn.models import seg_model_from_config

        return get_params(seg_model_from_config(m, d.in_channels, seed=t.seed, init_root=app_custom))
    from fedmed.nn.models import model_from_config

    return get_params(model_from_config(m, d.channels, d.n_classes, seed=t.seed, init_root=app_custom))


class Workflow:
    """One method's server algorithm. Subclasses implement :meth:`run` (their paper's algorithm box) with the calls
    below, all answered by the federation the workflow is run on (``Federation.run(workflow)``).

    Args:
        num_rounds: training rounds R (a final ``validate`` round R follows).
        fedmed_config: the task config every task carries to the sites (:func:`fedmed.run.taskconfig.fedmed_config`).
        **args: the workflow's own options (the registry builds them from the method's config).
    """

    record_name = "Workflow"  # what the run's record, checkpoint and saved models call this workflow
    stable_cluster_ids = True  # a cluster id names the same model in every round (CFL renumbers when it splits)
    fed = None  # the Federation it runs on

    def __init__(self, num_rounds: int, fedmed_config: dict, **args):
        self.num_rounds = int(num_rounds)
        self._cfg = copy.deepcopy(dict(fedmed_config))
        self.task_extra: dict = {}  # what this run adds to every task it sends (e.g. PreP-WFL's class weights)
        if args:
            raise TypeError(f"{type(self).__name__}: unknown option(s) {sorted(args)}")

    def run(self) -> None:
        raise NotImplementedError

    @property
    def task_cfg(self):
        """The task config, typed (:class:`~fedmed.core.schema.TaskConfig`)."""
        from fedmed.core.schema import task_config

        return task_config(self._cfg)

    @property
    def cfg(self) -> MappingProxyType:
        """The task config this run was given, read-only: a run adds to its tasks (:attr:`task_extra`, ``extra`` of
        :meth:`task`) and never changes the config."""
        return MappingProxyType(self._cfg)

    # ------------------------------------------------------------------ the federation's calls
    @property
    def sites(self) -> list:
        return self.fed.sites

    @property
    def recorder(self):
        return self.fed.recorder

    @property
    def resumed(self) -> dict:
        return self.fed.resumed

    @property
    def min_clients(self) -> int:
        return self.fed.min_clients

    @property
    def out_dir(self) -> Path:
        return self.fed.out_dir

    @property
    def app_custom(self):
        return self.fed.app_custom

    def task(self, params: dict, round_: int, **extra):
        """The message of one task: ``params`` and the task config (with ``extra`` entries, e.g. ``cluster``)."""
        return self.fed.message(params, round_, {**copy.deepcopy(self._cfg), **self.task_extra, **extra})

    def send(self, task_name: str, data, targets=None) -> list:
        return self.fed.send(task_name, data, targets)

    def send_groups(self, task_name: str, groups: dict) -> dict:
        return self.fed.send_groups(task_name, groups)

    def record_rows(self, round_, rows, task) -> list:
        return self.fed.record_rows(round_, rows, task)

    def checkpoint(self, next_round: int, models: dict, **state):
        self.fed.checkpoint(next_round, models, **state)

    def save_final(self, params: dict, name: str = "global", *, sites=None, cluster=None):
        self.fed.save_final(params, name, sites=sites, cluster=cluster)

    def save_onboarding(self, mode: str, clusters: dict, arrays: dict | None = None, **state):
        """What a new site needs to be given the cluster model that fits it after this run
        (:class:`fedmed.workflows.onboard.Onboard`): the ``mode`` of assignment, ``clusters`` (cluster id -> its
        training sites) and the method's ``state`` (aggregates the sites already sent: signatures, assessments, a
        split tree) in ``onboarding.json``, arrays in ``onboarding.npz``. Written only by a run that finished."""
        import json

        import numpy as np

        from fedmed.core.io import json_default

        doc = {"mode": mode, "workflow": self.record_name, "clusters": {str(c): list(s) for c, s in clusters.items()},
               "state": state}
        (self.out_dir / "onboarding.json").write_text(json.dumps(doc, default=json_default))
        if arrays:
            np.savez(self.out_dir / "onboarding.npz", **{k: np.asarray(v) for k, v in arrays.items()})

    def start_round(self) -> int:
        return int(self.resumed.get("next_round", 0))

    def resumed_models(self) -> dict:
        return self.resumed.get("models", {})

    def initial_params(self, cfg: dict | None = None) -> dict:
        return initial_params(cfg or self._cfg, self.app_custom)

    def info(self, msg: str) -> None:
        self.fed.info(msg)

    def warning(self, msg: str) -> None:
        self.fed.warning(msg)

    def error(self, msg: str) -> None:
        self.fed.error(msg)
