"""Flux (``003_``): latent-moment descriptors, density clustering, label-free assignment of unseen sites.

Its server workflow: Flux (``003_`` Algorithm 1) with partial participation.
"""

from __future__ import annotations

from typing import ClassVar, Literal, Optional

import numpy as np
from pydantic import Field

from fedmed.core.jobfiles import TRAINING as TRAINING_DIR
from fedmed.core.schema import Strict, TaskConfig, task_config
from fedmed.methods.base import Method, register_method
from fedmed.site.tasks import Reply, TaskError, register_task, task_seed
from fedmed.workflows.base import round_mean
from fedmed.workflows.fedavg import FedAvg
from fedmed.workflows.federation import RunFailed


# ------------------------------------------------------------------ its site tasks

class FluxOptions(Strict):
    """What Flux's site tasks read, S1-S4 (the task config's ``method_options``, set by the workflow each task; the
    server's clustering options are the workflow's own)."""

    pca_seed: int
    n_components: int = Field(10, ge=1, description="the shared PCA's components (003_)")
    box: Optional[Literal["elementwise", "scalar"]] = Field(None, description="S1 (the method's; None: a task that "
                                                           "builds no box)")
    absent_class: Optional[Literal["zeros", "minus_one"]] = Field(None, description="the method's; None: a label-free "
                                                                  "descriptor (no class slots)")
    second_moment: Literal["std", "var"] = "std"
    lo: Optional[list[float]] = None
    hi: Optional[list[float]] = None
    label_free: bool = False


def _latents(runner, params, cfg, split: str = "train"):
    import torch

    from fedmed.nn.train import latents, set_params

    model = runner.model(cfg)
    set_params(model, params)
    s = runner.splits(cfg)
    if split == "all":
        x, y = torch.cat([s.train[0], s.val[0], s.test[0]]), torch.cat([s.train[1], s.val[1], s.test[1]])
    else:
        x, y = s.train
    return latents(model, runner.on_device(x, cfg)), y.numpy()


def latent_bounds(runner, params: dict, cfg: TaskConfig, round_: int = 0) -> Reply:
    """Flux S1: the box of the latents (two z-vectors leave the site; with DP or k_min they are
    clipped quantile bounds, :func:`fedmed.algorithms.privacy.private_bounds`)."""
    from fedmed.algorithms.privacy import private_bounds

    cfg = task_config(cfg)
    f = FluxOptions.model_validate(cfg.method_options)
    if f.box is None:
        raise TaskError(f"{runner.site}: latent_bounds needs the task's box (the Flux method's)")
    z, _ = _latents(runner, params, cfg, "all" if f.label_free else "train")
    rng = np.random.default_rng(task_seed(cfg, runner.site, salt=3))
    lo, hi, note = private_bounds(z, k_min=runner.k_min(cfg), privacy=cfg.privacy.model_dump(), rng=rng,
                                  site=runner.site, box=f.box)
    meta = {"lo": lo, "hi": hi, "notes": [note] if note else []}
    return Reply(runner.site, {"n_samples": float(z.shape[0])}, meta, {})


def descriptor(runner, params: dict, cfg: TaskConfig, round_: int = 0) -> Reply:
    """Flux S2-S4: the descriptor (label-free when ``flux.label_free``, e.g. an unseen site)."""
    from fedmed.algorithms.flux import flux_descriptor, shared_pca

    cfg = task_config(cfg)
    f = FluxOptions.model_validate(cfg.method_options)
    label_free = f.label_free
    z, y = _latents(runner, params, cfg, "all" if label_free else "train")
    pca = shared_pca(np.asarray(f.lo), np.asarray(f.hi), n_components=f.n_components, seed=f.pca_seed)
    rng = np.random.default_rng(task_seed(cfg, runner.site))
    if not label_free and f.absent_class is None:
        raise TaskError(f"{runner.site}: a descriptor with class slots needs absent_class (the Flux method's)")
    d = flux_descriptor(z, pca, None if label_free else y, n_classes=None if label_free else cfg.data.n_classes,
                        second_moment=f.second_moment, dp_epsilon=cfg.privacy.dp_epsilon, rng=rng,
                        site=runner.site, k_min=runner.k_min(cfg),
                        **({} if label_free else {"absent": f.absent_class}))  # label-free: no class slot
    meta = {"label_free": d.label_free, "n_samples": d.n_samples, "warnings": d.warnings}
    if cfg.privacy.dp_epsilon is not None:  # the run's privacy ledger composes it (SiteRunner.account)
        meta["dp"] = {"epsilon": cfg.privacy.dp_epsilon, "mechanism": "laplace, b = Range(g_i) / (n epsilon) (003_ "
                      "App. C.2)"}
    if d.full is not None:
        meta["full"] = d.full
    for w in d.warnings:
        print(f"[fedmed] {w}", flush=True)
    length = len(d.full) if d.full is not None else len(d.label_free)
    return Reply(runner.site, {"descriptor_length": float(length)}, meta, {})


register_task("latent_bounds", latent_bounds)
register_task("descriptor", descriptor)


class Flux(FedAvg):
    """Algorithm box (Flux, Alg. 1):

    1. FedAvg rounds (a seeded ``participation`` fraction of sites each round) until the start rule of
       Eq. 14 fires on the served global model's mean *validation* accuracy;
    2. S1: sampled sites send the latent box of the global model ``theta*`` (aggregates of k_min samples,
       or nothing with DP on); the server merges and broadcasts it; S2-S4: sites send descriptors
       (shared PCA, optional DP);
    3. clustering: adaptive DBSCAN (Flux) or K-means with ``n_clusters`` (Flux-prior); centroids of the
       full and the label-free descriptors;
    4. per-cluster FedAvg for the remaining rounds; a site sampled later without a cluster first sends
       its descriptor (computed with ``theta*``) and joins the nearest centroid (Eq. 9).
    Writes ``flux_state.npz`` (``theta*``, the box, centroids) for the test-time job.
    """

    record_name = "Flux"
    earlier_record_names = ("FluxController",)  # what runs of fedmed before 2026-11-25 recorded

    START_THRESHOLD = 0.06  # Eq. 14's threshold on the accuracy gain

    def __init__(self, num_rounds: int, task_config: dict, *, flux: dict, participation: float, n_clusters: int,
                 scale: float, k1_silhouette, scaling: str, start_rule: str, **kw):
        """``flux``: the site's side (:class:`FluxOptions`); the rest: the server's clustering
        options — every value from the method (``fedmed.methods.FluxMethod``)."""
        super().__init__(num_rounds, task_config, **kw)
        self.flux = FluxOptions.model_validate(flux)
        self.box: dict = {}  # the merged latent box (S1): lo, hi
        self.participation = float(participation)
        self.n_clusters = int(n_clusters or 0)
        self.scale, self.k1_silhouette, self.scaling, self.start_rule = float(scale), k1_silhouette, scaling, start_rule

    def descriptors(self, theta_star, sites, label_free=False) -> dict:
        got = self.gather("descriptor", self.task(theta_star, 0, method_options={
            **self.flux.model_dump(), **self.box, "label_free": label_free}),
                          "descriptor", targets=sites, consequence="stays unassigned")
        return {s: r.meta for s, r in got.items()}

    def warmup(self):
        """FedAvg until Eq. 14 fires; returns (theta*, the round clustering happens at)."""
        from fedmed.algorithms.flux import should_start_clustering

        st = self.resumed.get("state", {})
        theta = self.resumed_models().get("global") or self.initial_params()
        acc, r = list(st.get("acc", [])), self.start_round()
        while r < self.num_rounds - 1:
            part = self.sample(r, self.participation)
            rows = self.record_rows(r, self.send("train", self.task(theta, r), targets=part), "train")
            theta = self.next_model(rows, theta, r)
            score = round_mean(rows, "val_accuracy")  # the served model's validation accuracy (Eq. 14's a_r)
            score = round_mean(rows, "accuracy") if score is None else score
            acc.append(0.0 if score is None else score)
            r += 1
            self.checkpoint(r, {"global": theta}, phase="warmup", acc=acc)
            if should_start_clustering(acc, self.num_rounds, threshold=self.START_THRESHOLD,
                                       rule=self.start_rule):
                break
        return theta, r

    def cluster_sites(self, theta_star, r):
        from fedmed.algorithms.clustered import flux_cluster
        from fedmed.algorithms.flux import merge_bounds

        part = self.sample(r, self.participation)
        got = self.gather("latent_bounds", self.task(theta_star, r, method_options=self.flux.model_dump()), "latent bounds",
                          targets=part, round_=r)
        bounds = [(np.asarray(g.meta["lo"]), np.asarray(g.meta["hi"])) for g in got.values()]
        if not bounds:
            raise RunFailed(f"round {r}: no site sent latent bounds; Flux cannot build its descriptor space")
        lo, hi = merge_bounds(bounds)
        self.box = {"lo": lo.tolist(), "hi": hi.tolist()}
        descs = self.descriptors(theta_star, part)
        info = flux_cluster(descs, n_clusters=self.n_clusters or None, scale=self.scale, seed=self.task_cfg.seed,
                            scaling=self.scaling, k1_silhouette=self.k1_silhouette)
        n_params = sum(np.asarray(v).size for v in theta_star.values())
        self.recorder.note("clustering", {k: v for k, v in info.items() if not k.startswith("centroids")} |
                           {"start_round": r, "descriptor_to_model_ratio": info["descriptor_length"] / n_params,
                            "model_params": int(n_params)})
        self.recorder.note("privacy", {"k_min": self.task_cfg.privacy.k_min,
                                       "dp_epsilon": self.task_cfg.privacy.dp_epsilon,
                                       "descriptor_dp": "Laplace, b = Range(g_i) / (n epsilon) (003_ App. C.2)"})
        self.info(f"Flux clusters at round {r} ({info['rule']}): {info['clusters']}")
        return lo, hi, info

    def run(self):
        from fedmed.algorithms.flux import assign_nearest

        st = self.resumed.get("state", {})
        if st.get("phase") == "clustered":
            saved = self.resumed_models()
            theta_star, r0 = saved["theta_star"], self.start_round()
            lo, hi = np.asarray(st["lo"]), np.asarray(st["hi"])
            self.box = {"lo": lo.tolist(), "hi": hi.tolist()}
            info = {k: (np.asarray(v) if k.startswith("centroids") else v) for k, v in st["info"].items()}
            assign = {s: int(c) for s, c in st["assign"].items()}
            models = {c: saved[f"cluster{c}"] for c in range(info["k"])}
        else:
            theta_star, r0 = self.warmup()
            lo, hi, info = self.cluster_sites(theta_star, r0)
            assign = {s: lab for s, lab in zip(info["sites"], info["labels"])}
            models = {c: theta_star for c in range(info["k"])}
        stop = self.stopper("global")  # train.stop on the federation's validation score once clustered (#85)
        last = self.num_rounds if stop.stopped_at is None else stop.stopped_at + 1
        for rr in range(r0, self.num_rounds + 1):
            task = "train" if rr < last else "validate"
            sampled = self.sample(rr, self.participation) if task == "train" else list(self.sites)
            new = [s for s in sampled if s not in assign]
            for s, meta in self.descriptors(theta_star, new).items() if new else []:
                assign[s] = assign_nearest(meta["full"], info["centroids_full"])
                self.info(f"{s} joins cluster {assign[s]} (nearest centroid)")
            replies = self.cluster_round(rr, task, models, {c: [s for s in sampled if assign.get(s) == c]
                                                            for c in models})
            halt = self.observe(stop, rr, [x for rows in replies.values() for x in rows], None)
            if task != "train":
                break
            for c, good in replies.items():
                if good:
                    models[c] = self.next_model(good, models[c], rr, key=f"cluster{c}")
            if halt:
                stop.stopped_at, last = rr, rr + 1
            self.checkpoint(rr + 1, {"theta_star": theta_star, **{f"cluster{c}": m for c, m in models.items()}},
                            phase="clustered", lo=lo, hi=hi, assign=assign,
                            info={k: v for k, v in info.items() if k not in ("labels",)}, stoppers={"global": stop})
        self.save_selected({"global": stop}, last)
        self.recorder.note("assignment", assign)
        for c, th in models.items():
            self.save_final(th, name=f"cluster{c}", sites=[s for s, a in assign.items() if a == c], cluster=c)
        np.savez(self.out_dir / "flux_state.npz", lo=lo, hi=hi,
                 centroids_label_free=info["centroids_label_free"], centroids_full=info["centroids_full"],
                 pca_seed=self.flux.pca_seed, n_components=self.flux.n_components,
                 **{f"theta_star/{k}": v for k, v in theta_star.items()})
        self.save_onboarding("flux", {c: [s for s, a in assign.items() if a == c] for c in models})

    # ------------------------------------------------------------------ a new site after training (fedmed.workflows.onboard)
    onboard_needs_state = True
    onboard_label_free = True

    @classmethod
    def assign_new_sites(cls, ob, st: dict, models: dict) -> dict:
        """Algorithm 2: the new site's label-free descriptor with ``theta*`` and the training box; the nearest
        label-free centroid (Eq. 9)."""
        from fedmed.algorithms.flux import assign_nearest

        f = ob.root / "flux_state.npz"
        if not f.is_file():
            raise RunFailed(f"the job carries no Flux state ({TRAINING_DIR}/flux_state.npz)")
        z = np.load(f)
        theta_star = {k[len("theta_star/"):]: z[k] for k in z.files if k.startswith("theta_star/")}
        flux = {"lo": z["lo"].tolist(), "hi": z["hi"].tolist(), "pca_seed": int(z["pca_seed"]),
                "n_components": int(z["n_components"]), "label_free": True}
        return ob.assigned({s: assign_nearest(meta["label_free"], z["centroids_label_free"]) for s, (meta, _) in
                           ob.new_site_replies("descriptor", ob.task(theta_star, 0, method_options=flux), "descriptor").items()})


@register_method
class FluxMethod(Method):
    workflow: Literal["flux"]
    n_clusters: Optional[int] = Field(None, ge=1, description="Flux-prior: K-means with this K; None = adaptive DBSCAN")
    participation: float = Field(1.0, gt=0, le=1, description="fraction of sites sampled per round")
    dbscan_scale: float = Field(1.0, gt=0, description="eps scale factor (the paper's per-dataset factor)")
    k1_silhouette: Optional[float] = Field(0.25, ge=-1, le=1, description="keep a DBSCAN split only when its "
                                           "silhouette reaches this (None: the paper's literal DBSCAN)")
    box: Literal["elementwise", "scalar"] = Field("elementwise", description="S1 box: the paper's element-wise "
                                                  "min/max, or the official code's [0, 1.02 max]")
    scaling: Literal["none", "minmax"] = Field("none", description="min-max scale descriptors before clustering "
                                               "(official code)")
    start_rule: Literal["paper", "official"] = Field("paper", description="Eq. 14 gains from round 3 (paper) or "
                                                     "including round 2 (official code)")
    absent_class: Literal["zeros", "minus_one"] = Field("zeros", description="slot of a class with < 2 samples")
    server: ClassVar = Flux
    site_tasks: ClassVar[tuple] = ("train", "latent_bounds", "descriptor", "validate")
    clustered: ClassVar[bool] = True
    onboards: ClassVar[bool] = True

    def check_experiment(self, exp):
        super().check_experiment(exp)
        from fedmed.nn.models import BUILTIN_ARCHS, PRETRAINED_ARCHS

        if exp.model.arch not in (*BUILTIN_ARCHS, *PRETRAINED_ARCHS):
            raise ValueError(f"method {self.name!r}: Flux describes a site by the latents of fedmed's networks "
                             f"(forward_features); model.arch {exp.model.arch!r} has none")

    @classmethod
    def training_assignment(cls, doc):
        return {k: int(v) for k, v in doc.get("assignment", {}).items()}  # the run's last clustering

    def workflow_options(self, exp, seed):
        return {"flux": {"pca_seed": seed, "box": self.box, "absent_class": self.absent_class},
                "participation": self.participation, "n_clusters": self.n_clusters or 0,
                "scale": self.dbscan_scale, "k1_silhouette": self.k1_silhouette, "scaling": self.scaling,
                "start_rule": self.start_rule}
