"""IFCA (Ghosh et al. 2020): K models; each site trains the one with its lowest loss.

Its server workflow: IFCA (Ghosh et al. 2020): K models, each site trains the one with the lowest local loss.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import numpy as np
from pydantic import Field

from fedmed.algorithms.aggregation import ifca_models
from fedmed.core.packing import pack_models, unpack_model
from fedmed.core.schema import Strict, TaskConfig, task_config
from fedmed.methods.base import Method, register_method
from fedmed.site.tasks import Reply, TaskError, register_task, served_metrics, train_locally
from fedmed.workflows.fedavg import FedAvg


# ------------------------------------------------------------------ its site tasks

class IFCAOptions(Strict):
    """What the ``ifca`` site task reads (the task config's ``method_options``, set by the workflow each task)."""

    k: int = Field(ge=1)
    train: bool = True
    pseudo_labels: bool = Field(False, description="a site without labels: each model's loss on all the site's images "
                                "against its own predicted classes (onboarding)")


def ifca(runner, params: dict, cfg: TaskConfig, round_: int = 0) -> Reply:
    """IFCA: evaluate the K cluster models on local training data, train the one with the
    lowest loss, and report which (``params`` holds the K models as ``m<k>/<name>``)."""
    import torch

    from fedmed.nn.train import get_params, set_params

    cfg = task_config(cfg)
    opts = IFCAOptions.model_validate(cfg.method_options)
    K = opts.k
    model = runner.model(cfg)
    s = runner.splits(cfg)
    xtr, ytr = s.train
    if opts.pseudo_labels:  # no labels: every image, each model against its own predicted classes
        if opts.train:
            raise TaskError(f"{runner.site}: IFCA trains on labels; pseudo-labels are for onboarding only")
        xtr = torch.cat([s.train[0], s.val[0], s.test[0]])
    runner.require_k_min(int(xtr.shape[0]), "training images", cfg, "IFCA")  # the K losses average them
    dev = runner.device(cfg)
    xd, yd = (xtr.to(dev) - 0.5) / 0.5, ytr.to(dev)
    losses = []
    for k in range(K):
        set_params(model, unpack_model(params, k))
        model.eval()
        with torch.no_grad():
            out = model(xd)
            target = out.argmax(dim=1) if opts.pseudo_labels else yd
            losses.append(float(torch.nn.functional.cross_entropy(out, target)))
    best = int(np.argmin(losses))
    set_params(model, unpack_model(params, best))
    metrics, meta = served_metrics(runner, model, cfg)
    meta.update(cluster=best, losses=losses)
    if opts.train:
        meta.update(train_locally(runner, model, cfg, round_, ("ifca", best)))
        metrics["train_loss"] = meta["train_loss"]
        return Reply(runner.site, metrics, meta, get_params(model))
    return Reply(runner.site, metrics, meta, {})


register_task("ifca", ifca)


class IFCA(FedAvg):
    """Algorithm box (IFCA, Alg. 2): every round each sampled site receives all K models, picks the one
    with the lowest loss on its training data and trains it; the server averages per chosen model
    (:func:`fedmed.algorithms.aggregation.ifca_models`; a model nobody chose: ``empty_cluster``)."""

    record_name = "IFCA"
    earlier_record_names = ("IFCAController",)  # what runs of fedmed before 2026-11-25 recorded

    def __init__(self, num_rounds: int, task_config: dict, *, k: int, participation: float, empty_cluster: str,
                 **kw):
        """Every option from the method (``fedmed.methods.IFCAMethod``)."""
        super().__init__(num_rounds, task_config, **kw)
        self.k = int(k)
        self.participation = float(participation)
        self.empty_cluster = empty_cluster

    def start_config(self, j: int) -> dict:
        """The config model ``j`` starts from: its own seed; and its own seeded head even where the transfer recipe
        would zero it (``fedmed.nn.recipe``): IFCA tells its K models apart by their losses, and K models started
        from one pretrained file differ only in their heads — zeroed, they would be one model (every site ties on
        model 0). A ``train.head_init`` the config sets is kept."""
        cfg = {**self.cfg, "seed": self.task_cfg.seed * 1000 + j}
        if self.task_cfg.train.head_init is None:
            cfg["train"] = {**self.task_cfg.train.model_dump(), "head_init": "seeded"}
        return cfg

    def run(self):
        saved = self.resumed_models()
        models = [saved.get(f"cluster{j}") or self.initial_params(self.start_config(j)) for j in range(self.k)]
        rows = []
        stop = self.stopper("global")  # train.stop on the federation's validation score (#85: every clustered loop)
        last = self.num_rounds if stop.stopped_at is None else stop.stopped_at + 1
        for r in range(self.start_round(), self.num_rounds + 1):
            train = r < last
            packed = pack_models(models)
            sites = self.sample(r, self.participation) if train else list(self.sites)
            rows = self.record_rows(r, self.send("ifca", self.task(packed, r, method_options={"k": self.k, "train": train}),
                                                 targets=sites), "train" if train else "validate")
            halt = self.observe(stop, r, rows, None)  # K models: no single selected one is kept
            if not train:
                break
            before = models
            models, refilled = ifca_models(
                models, [x.params for x in rows], [x.meta["n_train"] for x in rows],
                [x.meta["cluster"] for x in rows], empty=self.empty_cluster,
                all_answered=len(rows) == len(self.sites), names=[x.site for x in rows])
            moved = {x.meta["cluster"] for x in rows} | set(refilled)
            chose = {j: sorted(x.site for x in rows if x.meta["cluster"] == j) for j in moved}
            models = [self.recalibrated(self.server_step(old, m, f"cluster{j}"), r + 1,  # as next_model does
                                        targets=chose[j] or sorted(x.site for x in rows)) if j in moved else m
                      for j, (old, m) in enumerate(zip(before, models))]
            if refilled:
                self.info(f"IFCA round {r}: no site chose model(s) {refilled}; set to this round's average")
            if halt:
                stop.stopped_at, last = r, r + 1
            self.checkpoint(r + 1, {f"cluster{j}": m for j, m in enumerate(models)}, stoppers={"global": stop})
        self.recorder.note("clustering", {"k": self.k, "rule": "IFCA (lowest local loss)"})
        self.save_selected({"global": stop}, last)
        chose = {j: [x.site for x in rows if x.meta["cluster"] == j] for j in range(self.k)}  # the final round's
        for j, m in enumerate(models):
            self.save_final(m, name=f"cluster{j}", sites=chose[j], cluster=j)
        self.save_onboarding("ifca", chose, k=self.k)

    # ------------------------------------------------------------------ a new site after training (fedmed.workflows.onboard)
    onboard_needs_state = True
    onboard_pseudo_labels = True
    onboard_label_free = False  # the K models' losses on its labeled training split

    @classmethod
    def assign_new_sites(cls, ob, st: dict, models: dict) -> dict:
        """The K models' losses on the new site's labeled training split; the lowest (IFCA's own rule). Without
        labels: each model against its own predicted classes (the most confident model)."""
        ids = sorted(models)
        packed = pack_models([models[c] for c in ids])
        replies = ob.new_site_replies("ifca", ob.task(packed, 0, method_options={
            "k": len(ids), "train": False, "pseudo_labels": not ob.labels}), "losses")
        ob.recorder.note("onboarding", {"losses": {s: dict(zip(ids, m["losses"])) for s, (m, _) in replies.items()}})
        return ob.assigned({s: ids[int(m["cluster"])] for s, (m, _) in replies.items()})

    @classmethod
    def after_onboarding(cls, ob, models: dict, sizes: dict) -> None:
        ob.ensemble(models, sizes, 2 + len(models), "ensemble")  # IFCA's label-free counterpart (the Flux paper's)


@register_method
class IFCAMethod(Method):
    workflow: Literal["ifca"]
    n_clusters: int = Field(2, ge=1, description="K models")
    participation: float = Field(1.0, gt=0, le=1)
    empty_cluster: Literal["global", "keep"] = Field(
        "global", description="a model no site chose in a round with every site answering: replaced by that "
        "round's average of all updates (fedmed; docs/readings.md), or kept unchanged (the paper)")
    server: ClassVar = IFCA
    site_tasks: ClassVar[tuple] = ("ifca",)
    clustered: ClassVar[bool] = True
    onboards: ClassVar[bool] = True

    @classmethod
    def training_assignment(cls, doc):
        train_rounds = [r for r in doc["rounds"] if r["task"] == "train"]  # each site's choice in the last round
        return {s: int(v["cluster"]) for s, v in train_rounds[-1]["sites"].items()} if train_rounds else {}

    def workflow_options(self, exp, seed):
        return {"k": self.n_clusters, "participation": self.participation, "empty_cluster": self.empty_cluster}
