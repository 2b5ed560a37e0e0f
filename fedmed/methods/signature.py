"""One-shot clustered FL (FMCL ``000_``, PACFL, FECFL): one signature per site from a frozen encoder, clustered
once; each kind's own module (``fmcl``, ``pacfl``, ``fecfl``) says what its signature is and how far two are.

Its server workflow: One-shot clustered FL: FMCL (``000_`` Fig. 1, Alg. 2-5), and PACFL / FECFL with their signatures.
"""

from __future__ import annotations

from typing import ClassVar, Literal, Optional

import numpy as np
from pydantic import Field
from pydantic import field_validator

from fedmed.algorithms.signatures import signature_distances, signature_kind, wire_only
from fedmed.core.schema import TaskConfig, task_config
from fedmed.core.schema import Strict
from fedmed.core.schema import ClusteringTask, SignatureTask
from fedmed.methods.base import Method, check_encoder
from fedmed.site.tasks import Reply, TaskError, pseudo_labelled, register_task, task_seed
from fedmed.workflows.fedavg import FedAvg
from fedmed.workflows.federation import RunFailed


# ------------------------------------------------------------------ its site tasks

def signature(runner, params: dict, cfg: TaskConfig, round_: int = 0) -> Reply:
    """One-shot clustering signature of the site's training data (only aggregates leave).

    ``cfg["signature"]``: ``kind`` (fmcl | pacfl | fecfl), ``encoder``, ``image_size``, ``n_basis`` (PACFL); the
    encoder's weights: ``cfg["encoder_weights"]``, a file of the site's weights folder (None: seeded random init,
    :meth:`~fedmed.site.runner.SiteRunner.weights`); ``cfg["privacy"]``:
    ``k_min`` (classes with fewer samples are withheld), DP settings (:mod:`fedmed.algorithms.privacy`).
    """
    from fedmed.nn.encoders import ENCODERS, build_encoder, extract_features
    from fedmed.algorithms.privacy import signature_payload
    from fedmed.algorithms.signatures import signature_kind

    cfg = task_config(cfg)
    if cfg.signature is None:  # a job that asks for it without its section: one line, not a crash
        raise TaskError(f"{runner.site}: task 'signature' needs the task config's 'signature' section, which this job "
                        f"does not carry")
    sc = cfg.signature
    s = runner.splits(cfg)
    spec = ENCODERS.get(sc.encoder)
    size = sc.image_size or (spec.size if spec is not None else None) or cfg.data.image_size
    x, y = runner.images_at(cfg, size), s.train[1].numpy()  # decoded at the encoder's input size
    if sc.pseudo_labels:  # no labels used: every image, under the served model's predicted classes
        y = pseudo_labelled(runner, params, cfg)
        x = runner.images_at(cfg, size, ("training", "validation", "test"))
    enc = build_encoder(sc.encoder, weights=runner.weights(cfg), seed=sc.seed, in_channels=cfg.data.channels,
                        image_size=sc.image_size, device=runner.device(cfg))
    feats = extract_features(enc, x, progress=lambda m: print(f"[{runner.site}] {m}", flush=True))
    rng = np.random.default_rng(task_seed(cfg, runner.site, salt=17))
    meta = signature_payload(sc.kind, feats, y, k_min=runner.k_min(cfg), privacy=cfg.privacy.model_dump(), rng=rng,
                             site=runner.site, **sc.options)
    meta.update(encoder=enc.description, n_train=int(y.size))
    if sc.halves and not sc.pseudo_labels:
        extra = _halves(runner, feats, cfg)
        if extra.get("notes"):
            meta["notes"] = meta.get("notes", []) + extra.pop("notes")
        meta.update(extra)
    meta["notes"] = meta.get("notes", []) + [f"{runner.site}: {n}" for n in
                                             signature_kind(sc.kind).site_notes(sc.encoder, cfg.privacy.dp_epsilon)]
    for note in meta.get("notes", []):
        print(f"[fedmed] {note}", flush=True)
    return Reply(runner.site, {"n_classes_sent": float(len(meta.get("classes", [])))}, meta, {})


def _halves(runner, feats: np.ndarray, cfg: TaskConfig) -> dict:
    """The 'do the sites differ?' test's share (fedmed.algorithms.differ): the mean embedding of each of two random
    halves of the site's training images and their sizes — aggregates of at least ``k_min`` images each; nothing under
    DP (the means would need their own noise) or on raw pixels (a half's mean is an average image)."""
    from fedmed.algorithms.differ import split_halves

    k = runner.k_min(cfg)
    if cfg.privacy.dp_epsilon or cfg.signature.encoder == "pixels":
        return {"notes": [f"{runner.site}: no split-half means for the 'do the sites differ?' test (not sent under DP "
                          f"or on raw pixels)"]}
    if len(feats) < 2 * k:
        return {"notes": [f"{runner.site}: no split-half means for the 'do the sites differ?' test (fewer than 2 x "
                          f"k_min training images)"]}
    a, b = split_halves(len(feats), np.random.default_rng(task_seed(cfg, runner.site, salt=23)))
    return {"halves": [feats[a].mean(axis=0).tolist(), feats[b].mean(axis=0).tolist()],
            "halves_n": [int(len(a)), int(len(b))]}


register_task("signature", signature)


class OneShotClustered(FedAvg):
    """Algorithm box (FMCL, Fig. 1):

    1. one ``signature`` task: each site sends its signature (class ids, per-class means and counts of
       classes with >= k_min samples; PACFL: subspace bases; FECFL: one mean embedding);
    2. the server computes the distance matrix and clusters once (auto-K, fixed K or threshold) and
       writes ``clustering.json``, ``distances.csv`` and the heatmap, dendrogram and silhouette plots;
    3. FedAvg runs independently inside each cluster for R rounds, with no extra communication (with
       ``fedavg_warmup`` W > 0: FedAvg of the whole federation for rounds 0..W-1, then every cluster model starts
       from that model for rounds W..R-1 — not FMCL's Alg. 5, an option measured in docs/results.md);
       each site is scored with its cluster's model, and each cluster's model is saved.
    """

    record_name = "OneShotClustered"
    earlier_record_names = ("ClusteredFedAvgController",)  # what runs of fedmed before 2026-11-25 recorded

    def __init__(self, num_rounds: int, task_config: dict, *, signature: dict, clustering: dict, fedavg_warmup: int,
                 **kw):
        """``signature``, ``clustering``, ``fedavg_warmup``: the method's (``fedmed.methods``)."""
        super().__init__(num_rounds, task_config, **kw)
        self.fedavg_warmup = int(fedavg_warmup)
        if not 0 <= self.fedavg_warmup < self.num_rounds:
            raise ValueError(f"fedavg_warmup={fedavg_warmup} should be at least 0 and below train.rounds={num_rounds}")
        self.signature = SignatureTask.model_validate(signature) if signature else None
        self.clustering = ClusteringTask.model_validate(clustering) if clustering else None

    def run(self):
        st = self.resumed.get("state", {})
        if st.get("clusters"):
            clusters, signatures = st["clusters"], st.get("signatures", {})
        else:
            sigs = self.collect_signatures()
            clusters = self.cluster(sigs)
            signatures = {s: wire_only(self.signature.kind, m) for s, m in sigs.items()}
        clusters = self.train_clusters(clusters, warmup=self.fedavg_warmup, signatures=signatures)
        c = self.clustering
        self.save_onboarding("signature", dict(enumerate(clusters)), signatures=signatures,
                             signature=self.signature.model_dump(),
                             clustering={"options": c.options, "linkage": c.linkage})

    def collect_signatures(self) -> dict:
        """Step 1: every site's signature, with the means of two random halves of its images (the sites'
        aggregates for :meth:`sites_differ`)."""
        got = self.gather("signature", self.task({}, 0, signature={**self.signature.model_dump(), "halves": True}),
                          "signature")
        sigs = {s: r.meta for s, r in got.items()}
        self.sites_differ(sigs)
        spent = {s: m.get("dp", {}) for s, m in sigs.items()}
        self.recorder.note("privacy", {"k_min": self.task_cfg.privacy.k_min, "signatures": spent,
                                       "withheld_classes": {s: m.get("withheld_classes", []) for s, m in sigs.items()}})
        return sigs

    def sites_differ(self, sigs: dict) -> None:
        """Before training: do the sites differ at all? The split-half permutation test
        (:func:`fedmed.algorithms.differ.differ_test`, alpha 0.05) on the half means the sites sent, recorded as
        ``differ`` (its answer in one sentence); skipped when fewer than two sites sent halves."""
        from fedmed.algorithms.differ import halves_test

        halves = {s: m for s, m in sorted(sigs.items()) if m.get("halves")}
        self.differ = None
        if len(halves) < 2:
            self.recorder.note("differ", {"answer": f"not tested: {len(halves)} site(s) sent split-half means"})
            return
        t = halves_test([m["halves"] for m in halves.values()], [m["halves_n"] for m in halves.values()],
                        rng=np.random.default_rng(self.task_cfg.seed))
        self.differ = t
        self.recorder.note("differ", {"answer": t.sentence(), "p": t.p, "statistic": t.statistic, "alpha": t.alpha,
                                      "n_perm": t.n_perm, "sites": list(halves)})
        self.info(f"before training, do the sites differ? {t.sentence()}")

    differ = None  # the split-half test's answer (sites_differ), read by the differ Auto-K rule

    def k1_gate(self, c) -> tuple[float | None, bool]:
        """Auto-K's K = 1 decision under the method's ``k1_rule`` (#85): ``(k1_silhouette to use, one cluster
        outright)``. ``differ``: the split-half test says whether the sites differ — yes: FMCL's silhouette pick with no
        K = 1 gate; no: one cluster; the silhouette gate where the test did not run. ``silhouette``: the gate alone."""
        if c.k1_rule != "differ" or c.n_clusters is not None or c.threshold is not None:  # None: an older job
            return c.k1_silhouette, False
        if self.differ is None:
            self.warning("auto-K: the 'do the sites differ?' test did not run; the silhouette gate decides K = 1")
            return c.k1_silhouette, False
        return None, not self.differ.differ

    def cluster(self, sigs: dict) -> list:
        from fedmed.algorithms.clustered import choose_clusters
        from fedmed.core.io import write_distance_csv
        from fedmed.report.plots import plot_dendrogram, plot_heatmap, plot_silhouette

        out = self.out_dir
        if len(sigs) < self.min_clients:
            raise RunFailed(f"{len(sigs)} site(s) sent a signature, fewer than min_clients={self.min_clients}")
        try:
            c = self.clustering
            names, D = signature_distances(self.signature.kind, sigs, **c.options)
            k1, one = self.k1_gate(c)
            info = choose_clusters(D, names, n_clusters=1 if one else c.n_clusters, threshold=c.threshold,
                                   linkage_method=c.linkage, k1_silhouette=k1)
            if c.k1_rule == "differ" and c.n_clusters is None and c.threshold is None and self.differ is not None:
                info["rule"] = (f"auto-K, differ rule: the sites {'differ' if self.differ.differ else 'do not differ'}"
                                f" (split-half test p = {self.differ.p:.3g}) -> "
                                + ("FMCL's silhouette pick, no K = 1 gate" if not one else "one cluster"))
        except ValueError as e:  # e.g. fewer than two signatures, or no pair of sites sharing a class
            names = sorted(sigs)
            self.error(f"clustering impossible ({e}); training one model for all {len(names)} sites")
            self.recorder.note("clustering", {"clusters": [names], "rule": f"fallback to one cluster: {e}",
                                              "sites": names})
            return [names] if names else []
        sizes = {s: sigs[s]["n_train"] for s in names if "n_train" in sigs[s]}
        if c.min_cluster_images:  # every cluster model needs data to learn from (#57)
            from fedmed.algorithms.clustering import merge_small_clusters

            merged, merges = merge_small_clusters(info["clusters"], sizes, D, names, c.min_cluster_images)
            for m in merges:
                self.info(f"cluster {m['cluster']} holds {m['images']} training images (< min_cluster_images="
                          f"{c.min_cluster_images}): merged into its nearest cluster {m['into']}")
            if merges:
                info.update(clusters=merged, k=len(merged), merged=merges,
                            labels=[next(i for i, g in enumerate(merged) if n in g) for n in names],
                            rule=f"{info['rule']}, then clusters under {c.min_cluster_images} training images merged")
        if len(sizes) == len(names):  # would each cluster have enough to train on? (the report says, #57)
            info["cluster_images"] = [int(sum(sizes[s] for s in g)) for g in info["clusters"]]
            info["min_cluster_images"] = int(c.min_cluster_images or 0)
        info["encoder"] = sorted({m.get("encoder", "?") for m in sigs.values()})
        write_distance_csv(out / "distances.csv", names, D)
        plot_heatmap(D, names, out / "distance_heatmap.png", title=f"{self.signature.kind} distances",
                     labels=info["labels"])
        if len(names) > 2:
            plot_dendrogram(D, names, out / "dendrogram.png", k=info["k"],
                            linkage_method=self.clustering.linkage)
        if "silhouette" in info:
            plot_silhouette(info["silhouette"], info["window"], info["k"], out / "silhouette.png")
        self.recorder.note("clustering", {**info, "sites": names})
        self.info(f"clusters ({info['rule']}): {info['clusters']}")
        if "cluster_images" in info:
            from fedmed.report.findings import cluster_sizes_sentence

            self.info(cluster_sizes_sentence(info))
        return [list(c) for c in info["clusters"]]

    # ------------------------------------------------------------------ a new site after training (fedmed.workflows.onboard)
    onboard_needs_state = True
    onboard_pseudo_labels = True

    @classmethod
    def onboard_is_label_free(cls, state: dict) -> bool:
        kind = state.get("state", {}).get("signature", {}).get("kind")
        return kind is not None and not signature_kind(kind).per_class

    @classmethod
    def assign_new_sites(cls, ob, st: dict, models: dict) -> dict:
        """The new site's signature; its distance to every training site by the method's distance; the cluster at
        the smallest linkage distance. Without labels (FMCL, PACFL): :meth:`_assign_signature_pseudo`."""
        from fedmed.algorithms.clustered import assign_by_linkage

        state, clusters = st["state"], st["clusters"]
        sig = {k: v for k, v in state["signature"].items() if k != "weights"}  # the weights: cfg.encoder_weights
        trained = state["signatures"]
        encoders = sorted({m.get("encoder", "?") for m in trained.values()})
        if not ob.labels and signature_kind(sig["kind"]).per_class:
            return cls._assign_signature_pseudo(ob, state, clusters, models, sig, trained)
        assign, dists = {}, {}
        for s, (meta, _) in ob.new_site_replies("signature", ob.task({}, 0, signature=sig), "signature").items():
            if meta.get("encoder", "?") not in encoders:
                ob.recorder.error(0, s, "signature", f"{s}: signature made with encoder {meta.get('encoder')}, the "
                                    f"run's sites used {encoders}")
                ob.error(f"new site {s}: its signature was made with {meta.get('encoder')}, not the run's encoder "
                           f"{encoders}; it is not compared")
                continue
            try:
                names, D = signature_distances(sig["kind"], {**{t: m for t, m in trained.items() if t != s}, s: meta},
                                               **state["clustering"]["options"])
            except ValueError as e:
                ob.recorder.error(0, s, "signature", str(e))
                ob.error(f"new site {s} cannot be compared with the training sites: {e}")
                continue
            i = names.index(s)
            row = {n: float(D[i, j]) for j, n in enumerate(names) if n != s and np.isfinite(D[i, j])}
            assign[s], dists[s] = assign_by_linkage(row, clusters, state["clustering"]["linkage"])
        ob.recorder.note("onboarding", {"distances": dists, "linkage": state["clustering"]["linkage"]})
        return ob.assigned(assign)


    @classmethod
    def _assign_signature_pseudo(cls, ob, state, clusters, models, sig, trained) -> dict:
        """No labels at the new site: for each cluster c, its signature under cluster c's model's predicted classes,
        compared with cluster c's members (the linkage of the run); the cluster whose model explains the site's
        images the way its members' data look wins (docs/readings.md, "Onboarding")."""
        from fedmed.algorithms.clustered import assign_by_linkage

        linkage = state["clustering"]["linkage"]
        groups = {c: (ob.task(models[c], 0, signature={**sig, "pseudo_labels": True}), list(ob.sites))
                  for c in sorted(models) if str(c) in clusters}
        dists: dict = {}
        for c, rows in ob.send_groups("signature", groups).items():
            for s, _, meta, _ in rows:
                if meta.get("error"):
                    ob.recorder.error(0, s, "signature", meta["error"])
                    continue
                try:
                    names, D = signature_distances(sig["kind"], {**{t: m for t, m in trained.items() if t != s},
                                                                 s: meta}, **state["clustering"]["options"])
                except ValueError as e:
                    ob.recorder.error(0, s, "signature", str(e))
                    continue
                i = names.index(s)
                row = {n: float(D[i, j]) for j, n in enumerate(names) if n != s and np.isfinite(D[i, j])}
                if any(m in row for m in clusters[str(c)]):
                    dists.setdefault(s, {})[int(c)] = assign_by_linkage(row, {c: clusters[str(c)]}, linkage)[1][int(c)]
        assign = {s: min(sorted(d), key=lambda c: d[c]) for s, d in dists.items()}
        ob.recorder.note("onboarding", {"distances": dists, "linkage": linkage, "pseudo_labels": True})
        return ob.assigned(assign)


class _Encoder(Strict):
    encoder: str = Field("random_cnn", description="see fedmed.nn.encoders.ENCODERS")
    encoder_weights: Optional[str] = Field(None, description="local weights file, or imagenet (the encoder's installed "
                                           "ImageNet release); None = seeded random init")
    encoder_image_size: Optional[int] = Field(None, gt=7)

    @field_validator("encoder_weights")
    @classmethod
    def _release_by_name(cls, v, info):
        if isinstance(v, str) and v.strip().lower() == "imagenet":
            from fedmed.nn.releases import release_file

            return release_file(str(info.data.get("encoder", "")), "encoder_weights")
        return v


class _Clusters(Strict):
    n_clusters: Optional[int] = Field(None, ge=1, description="fixed K; None = auto-K")
    threshold: Optional[float] = Field(None, ge=0, description="agglomerative merge threshold instead of K")
    linkage: Literal["average", "weighted", "complete", "single"] = "average"
    k1_silhouette: Optional[float] = Field(0.5, ge=-1, le=1, description="auto-K keeps one cluster unless the chosen "
                                           "K's silhouette reaches this (Kaufman & Rousseeuw: 0.26-0.50 weak, could be "
                                           "artificial; docs/readings.md); None: no K = 1 test")
    k1_rule: Literal["differ", "silhouette"] = Field(
        "differ", description="how auto-K decides K = 1: 'differ' — the calibrated split-half test ('do the sites "
        "differ?', fedmed.algorithms.differ) answers it: sites that differ get FMCL's silhouette pick with no K = 1 "
        "gate, sites that do not get one cluster (the silhouette gate where the test cannot run); 'silhouette' — "
        "k1_silhouette alone (docs/readings.md 'Auto-K')")
    min_cluster_images: int = Field(0, ge=0, description="a cluster whose sites hold fewer training images than this "
                                    "is merged into its nearest cluster (average distance) before training, so that "
                                    "every cluster model has data to learn from (#57); 0: off")
    fedavg_warmup: int = Field(0, ge=0, description="rounds of FedAvg on the whole federation before the cluster "
                               "models start from its model (the idea of Flux's start rule; docs/readings.md); the "
                               "run keeps train.rounds in all. 0 = cluster models from scratch (FMCL's Alg. 5)")


class SignatureMethod(Method, _Encoder, _Clusters):
    """FMCL, PACFL and FECFL: one signature per site, clustered once (:class:`OneShotClustered`)."""

    server: ClassVar = OneShotClustered
    site_tasks: ClassVar[tuple] = ("signature", "train", "validate")
    clustered: ClassVar[bool] = True
    onboards: ClassVar[bool] = True
    ssl_role: ClassVar[Optional[str]] = "clusters"  # fedmed ssl: clusters from the Fed-MAE encoder (001_ + FMCL)

    @property
    def weights_file(self):
        return self.encoder_weights

    def check_files(self, exp):
        check_encoder(self.encoder, self.weights_file, in_channels=exp.dataset.channels,
                      image_size=self.encoder_image_size)

    def signature_options(self) -> dict:
        """The kind's own options at the site (PACFL: its subspaces), passed to its ``release``."""
        return {}

    def clustering_options(self) -> dict:
        """The kind's own distance options (FMCL: the overlap-aware multiplier; PACFL: the angle), passed to its
        ``distances``."""
        return {}

    def workflow_options(self, exp, seed):
        return {"signature": {"kind": self.workflow, "encoder": self.encoder, "image_size": self.encoder_image_size,
                              "seed": seed, "options": self.signature_options()},
                "clustering": {"n_clusters": self.n_clusters, "threshold": self.threshold, "linkage": self.linkage,
                               "k1_silhouette": self.k1_silhouette, "k1_rule": self.k1_rule,
                               "min_cluster_images": self.min_cluster_images,
                               "options": self.clustering_options()},
                "fedavg_warmup": self.fedavg_warmup}
