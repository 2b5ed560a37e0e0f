"""Federated fine-tuning of a ViT with a linear head (``001_`` §4.2), optionally with PreP-WFL (Alg. 2).

Its server workflow: Federated fine-tuning of a (Fed-MAE pre-trained) ViT, optionally with PreP-WFL (``001_`` Algorithm 2).
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal, Optional

import numpy as np
from pydantic import Field

from fedmed.core import jobfiles
from fedmed.core.schema import TaskConfig, task_config
from fedmed.methods.base import Method, check_vit_input, register_method
from fedmed.site.tasks import Reply, register_task
from fedmed.workflows.fedavg import FedAvg
from fedmed.workflows.federation import RunFailed


INIT_DIR = jobfiles.FINETUNE_INIT  # inside what the job carries (Federation.job_files): the pre-trained encoder.pt


# ------------------------------------------------------------------ its site tasks

def class_set(runner, params: dict, cfg: TaskConfig, round_: int = 0) -> Reply:
    """PreP-WFL's statistics round (``001_`` Alg. 2): only the ids of the classes this site holds leave it."""
    y = runner.splits(cfg).train[1].numpy()
    ids, counts = np.unique(y, return_counts=True)
    k = runner.k_min(cfg)
    held = sorted(int(c) for c, n in zip(ids, counts) if n >= k)
    meta = {"classes": held}
    if len(held) < ids.size:
        meta["notes"] = [f"{runner.site}: {ids.size - len(held)} class(es) with fewer than k_min={k} training "
                         f"images not reported (privacy.k_min)"]
        print(f"[fedmed] {meta['notes'][0]}", flush=True)
    return Reply(runner.site, {"n_classes_held": float(len(held))}, meta, {})


register_task("class_set", class_set)


class Finetune(FedAvg):
    """Algorithm box (``001_`` Alg. 2):

    (PreP-WFL only) each site sends its set of class ids; the server computes the prevalence
    p_c = sum_k 1{c in C_k} (Eq. 1) and w_c = 1 / p_c (Eq. 2) and broadcasts them; sites train with the weighted
    cross-entropy of Eq. 3. Then FedAvg over the encoder and the head for R rounds, from the Fed-MAE encoder
    (``init="fedmae"``, carried in the job) or from random weights.
    """

    record_name = "Finetune"
    earlier_record_names = ("FinetuneController",)  # what runs of fedmed before 2026-11-25 recorded

    def __init__(self, num_rounds: int, task_config: dict, *, init: str, prep_wfl: bool, **kw):
        """Every option from the method (``fedmed.methods.FinetuneMethod``)."""
        super().__init__(num_rounds, task_config, **kw)
        self.init = init
        self.prep_wfl = bool(prep_wfl)

    def start_params(self) -> dict:
        params = self.initial_params()
        if self.init == "fedmae":
            import torch

            f = Path(self.job_files) / INIT_DIR / "encoder.pt"
            if not f.is_file():
                raise RunFailed(f"init 'fedmae' but the job carries no pre-trained encoder ({INIT_DIR}/encoder.pt)")
            enc = torch.load(f, weights_only=True)
            missing = sorted(set(enc) - set(params))
            if missing:
                raise RunFailed(f"the pre-trained encoder does not fit the classifier (unexpected {missing[:3]})")
            params.update({k: v.numpy() for k, v in enc.items()})
        return params

    def prevalence_round(self):
        from fedmed.algorithms.aggregation import prep_weights

        sets = {}
        for site, _, meta, _ in self.send("class_set", self.task({}, 0)):
            if meta.get("error"):
                self.recorder.error(-1, site, "class_set", meta["error"])
            else:
                sets[site] = meta["classes"]
        p, w = prep_weights(list(sets.values()), self.cfg["data"]["n_classes"])
        self.task_extra = {"class_weights": w.tolist()}
        self.recorder.note("prep_wfl", {"class_sets": sets, "prevalence": p.tolist(), "weights": w.tolist()})
        self.info(f"PreP-WFL: prevalence {p.tolist()}, weights {[round(x, 3) for x in w]}")

    def run(self):
        st = self.resumed.get("state", {})
        if self.prep_wfl:
            if st.get("class_weights"):
                self.task_extra = {"class_weights": st["class_weights"]}
            else:
                self.prevalence_round()
        theta = self.resumed_models().get("global") or self.start_params()
        self.train_global(theta, class_weights=self.task_extra.get("class_weights"))


@register_method
class FinetuneMethod(Method):
    """Federated fine-tuning of a ViT with a linear head (``001_`` §4.2), optionally with PreP-WFL (Alg. 2)."""

    workflow: Literal["finetune"]
    init: Literal["fedmae", "random"] = Field("fedmae", description="the encoder: Fed-MAE pre-trained or random")
    encoder_weights: Optional[str] = Field(None, description="init 'fedmae': the Fed-MAE run's models/encoder.pt "
                                           "(fedmed ssl fills it)")
    prep_wfl: bool = Field(False, description="PreP-WFL: one class-id round, then prevalence-weighted CE (Eq. 1-3)")
    layer_decay: float = Field(0.75, gt=0, le=1)
    warmup: float = Field(0.05, ge=0, lt=1)
    local_only: bool = Field(True, description="also report every site fine-tuning alone (reference)")
    server: ClassVar = Finetune
    site_tasks: ClassVar[tuple] = ("class_set", "train", "validate")
    ssl_role: ClassVar[Optional[str]] = "finetune"

    @property
    def weights_file(self):
        return self.encoder_weights  # the Fed-MAE encoder: the server's, carried in the job (never a site's)

    @property
    def site_weights(self):
        return None  # the server's file (server_files), never in a site's weights folder

    def server_files(self):
        from fedmed.core.jobfiles import FINETUNE_INIT

        return [(self.encoder_weights, FINETUNE_INIT, "encoder.pt")] if self.init == "fedmae" else []

    def check_experiment(self, exp):
        super().check_experiment(exp)
        check_vit_input(self, exp)

    def check_files(self, exp):
        w = self.weights_file
        if self.init == "fedmae" and (not w or not Path(w).is_file()):
            raise ValueError(f"method {self.name!r}: init 'fedmae' needs encoder_weights, the Fed-MAE run's "
                             f"models/encoder.pt (got {w!r})")

    def workflow_options(self, exp, seed):
        return {"init": self.init, "prep_wfl": self.prep_wfl}

    def task_options(self, exp, seed):
        return {"model": {"arch": "vit_small"},
                "finetune": {"layer_decay": self.layer_decay, "warmup": self.warmup, "rounds": exp.train.rounds}}
