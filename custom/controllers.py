"""NVFlare server workflows of fedmed: thin ModelController subclasses over fedmed functions.

Each ``run()`` reads like its paper's algorithm box; the math (aggregation, clustering,
distances) is in ``fedmed``. Everything the server writes goes to the job's run directory
(``metrics.json``, ``tb/``, ``models/``) and therefore into the job result that POC and
provisioned deployments download.
"""

from pathlib import Path

import numpy as np
from nvflare.app_common.abstract.fl_model import FLModel
from nvflare.app_common.workflows.model_controller import ModelController

from fedmed.aggregation import down_weight, weighted_average
from fedmed.models import build_model
from fedmed.reporting import Recorder
from fedmed.train import get_params


def initial_params(cfg: dict) -> dict:
    m, d = cfg["model"], cfg["data"]
    model = build_model(m["arch"], d["channels"], d["n_classes"], width=m.get("width", 16), seed=cfg.get("seed", 0))
    return get_params(model)


def unpack(results) -> list:
    """FLModel results -> (site, metrics, meta, params) tuples, sorted by site."""
    out = [(r.meta.get("client_name", "?"), dict(r.metrics or {}), dict(r.meta or {}), r.params) for r in results]
    return sorted(out, key=lambda t: t[0])


class FedMedController(ModelController):
    """Shared plumbing: the fedmed config, the recorder, task construction, saving."""

    def __init__(self, num_rounds: int, fedmed_config: dict, **kwargs):
        super().__init__(persistor_id="", **kwargs)
        # attribute names equal the constructor arguments: FedJob exports them from the instance
        self.num_rounds = int(num_rounds)
        self.fedmed_config = dict(fedmed_config)
        self.recorder = None

    @property
    def cfg(self) -> dict:
        return self.fedmed_config

    def task(self, params: dict, round_: int, **extra) -> FLModel:
        return FLModel(params=params, current_round=round_, total_rounds=self.num_rounds,
                       meta={"fedmed": {**self.cfg, **extra}})

    def start_recording(self):
        self.recorder = Recorder(Path(self.get_run_dir()) / "fedmed", meta={"config": self.cfg,
                                                                             "workflow": type(self).__name__})

    def record(self, round_, results, task="train"):
        rows = unpack(results)
        ok = set(self.recorder.record(round_, [(s, m, meta) for s, m, meta, _ in rows], task=task))
        for s, _, meta, _ in rows:
            if meta.get("error"):
                self.error(f"site {s} failed {task} in round {round_}: {meta['error']}")
        return [r for r in rows if r[0] in ok]

    def save(self, params: dict, name: str = "global"):
        out = Path(self.get_run_dir()) / "fedmed" / "models"
        out.mkdir(parents=True, exist_ok=True)
        np.savez(out / f"{name}.npz", **params)


class FedAvgController(FedMedController):
    """FedAvg (McMahan et al.), FedProx (mu in the config; the proximal term is local) and
    FedAvg_w (``004_`` Eq. 2: ``down_weight_site`` gets weight ``omega``)."""

    def __init__(self, num_rounds: int, fedmed_config: dict, down_weight_site: str = "", omega: float = 1.0, **kw):
        super().__init__(num_rounds, fedmed_config, **kw)
        self.down_weight_site = down_weight_site
        self.omega = float(omega)

    def aggregate(self, rows) -> dict:
        names = [s for s, *_ in rows]
        n = [meta["n_train"] for _, _, meta, _ in rows]
        site = names.index(self.down_weight_site) if self.down_weight_site in names else None
        return weighted_average([p for *_, p in rows], down_weight(n, site, self.omega), names=names)

    def run(self):
        self.start_recording()
        theta = initial_params(self.cfg)
        for r in range(self.num_rounds):
            results = self.send_model_and_wait(task_name="train", data=self.task(theta, r))
            updates = self.record(r, results)
            if updates:
                theta = self.aggregate(updates)
        final = self.send_model_and_wait(task_name="validate", data=self.task(theta, self.num_rounds))
        self.record(self.num_rounds, final, task="validate")
        self.save(theta)
        self.recorder.close()
