"""One-shot clustered FL: FMCL (``000_`` Fig. 1, Alg. 2-5), and PACFL / FECFL with their signatures."""


import numpy as np

from fedmed.core.schema import ClusteringTask, SignatureTask
from fedmed.workflows.federation import RunFailed
from fedmed.workflows.fedavg import FedAvg


def wire_only(kind: str, meta: dict) -> dict:
    """Of a signature reply, what the distances read (its wire arrays) and the encoder that made it: what a finished
    run keeps for onboarding new sites (:mod:`fedmed.workflows.onboard`)."""
    from fedmed.algorithms.signatures import FIELDS

    keep = FIELDS[kind] + ("classes", "encoder")
    return {k: v for k, v in meta.items() if k in keep}


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
                             clustering={"overlap": c.overlap, "linkage": c.linkage})

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
        from fedmed.algorithms.clustered import choose_clusters, signature_distances
        from fedmed.core.io import write_distance_csv
        from fedmed.report.plots import plot_dendrogram, plot_heatmap, plot_silhouette

        out = self.out_dir
        if len(sigs) < self.min_clients:
            raise RunFailed(f"{len(sigs)} site(s) sent a signature, fewer than min_clients={self.min_clients}")
        try:
            c = self.clustering
            names, D = signature_distances(self.signature.kind, sigs, overlap=c.overlap, angle=self.signature.angle)
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
    LABEL_FREE_KINDS = ("fecfl",)  # FMCL's prototypes and PACFL's subspaces are per class
    onboard_pseudo_labels = True

    @classmethod
    def onboard_is_label_free(cls, state: dict) -> bool:
        return state.get("state", {}).get("signature", {}).get("kind") in cls.LABEL_FREE_KINDS

    @classmethod
    def assign_new_sites(cls, ob, st: dict, models: dict) -> dict:
        """The new site's signature; its distance to every training site by the method's distance; the cluster at
        the smallest linkage distance. Without labels (FMCL, PACFL): :meth:`_assign_signature_pseudo`."""
        from fedmed.algorithms.clustered import assign_by_linkage, signature_distances

        state, clusters = st["state"], st["clusters"]
        sig = {k: v for k, v in state["signature"].items() if k != "weights"}  # the weights: cfg.encoder_weights
        trained = state["signatures"]
        encoders = sorted({m.get("encoder", "?") for m in trained.values()})
        if not ob.labels and sig["kind"] not in cls.LABEL_FREE_KINDS:
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
                                               overlap=state["clustering"]["overlap"], angle=sig["angle"])
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
        from fedmed.algorithms.clustered import assign_by_linkage, signature_distances

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
                                                                 s: meta}, overlap=state["clustering"]["overlap"],
                                                   angle=sig["angle"])
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
