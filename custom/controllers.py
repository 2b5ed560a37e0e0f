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
    if cfg.get("task") == "segmentation":
        from fedmed.seg import seg_model

        return get_params(seg_model(d["in_channels"], channels=m["channels"], seed=cfg.get("seed", 0)))
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

    def send(self, task_name: str, data: FLModel, targets=None):
        """send_model_and_wait, with every exchange written to the task log in metrics.json."""
        sites = sorted(targets) if targets else sorted(self.sample_clients())
        self.recorder.doc.setdefault("task_log", []).append(
            {"task": task_name, "round": data.current_round, "sites": sites,
             "cluster": data.meta.get("fedmed", {}).get("cluster")})
        return self.send_model_and_wait(task_name=task_name, data=data, targets=targets)

    def send_groups(self, task_name: str, groups: dict) -> dict:
        """Send one task to several groups of sites at once (``{key: (FLModel, sites)}``), each
        group with its own model, and wait for all replies; returns ``{key: [FLModel, ...]}``."""
        import time

        replies = {key: [] for key in groups}
        for key, (data, sites) in groups.items():
            self.recorder.doc.setdefault("task_log", []).append(
                {"task": task_name, "round": data.current_round, "sites": sorted(sites), "cluster": key})
            self.send_model(task_name=task_name, data=data, targets=list(sites),
                            callback=lambda model, key=key: replies[key].append(model))
        while self.get_num_standing_tasks() > 0:
            if self.abort_signal is not None and self.abort_signal.triggered:
                break
            time.sleep(0.2)
        return replies

    def start_recording(self):
        self.recorder = Recorder(Path(self.get_run_dir()) / "fedmed", meta={"config": self.cfg,
                                                                             "workflow": type(self).__name__})

    def record_rows(self, round_, rows, task):
        """Record ``(site, metrics, meta, params)`` rows; log each failed site by name."""
        ok = set(self.recorder.record(round_, [(s, m, meta) for s, m, meta, _ in rows], task=task))
        for s, _, meta, _ in rows:
            if meta.get("error"):
                self.error(f"site {s} failed {task} in round {round_}: {meta['error']}")
        return [r for r in rows if r[0] in ok]

    def record(self, round_, results, task="train"):
        return self.record_rows(round_, unpack(results), task)

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
        self.train_global()
        self.recorder.close()

    def train_global(self):
        theta = initial_params(self.cfg)
        for r in range(self.num_rounds):
            results = self.send("train", self.task(theta, r))
            updates = self.record(r, results)
            if updates:
                theta = self.aggregate(updates)
        final = self.send("validate", self.task(theta, self.num_rounds))
        self.record(self.num_rounds, final, task="validate")
        self.save(theta)


class ClusteredFedAvgController(FedAvgController):
    """One-shot clustered FL (FMCL ``000_`` Fig. 1; PACFL and FECFL with their signatures).

    1. one ``signature`` task: each site sends its signature (only class ids, means, weights or
       subspace bases leave a site);
    2. the server computes distances and clusters once (auto-K, fixed K or threshold) and writes
       ``clustering.json``, ``distances.csv`` and the heatmap, dendrogram and silhouette plots;
    3. FedAvg runs independently inside each cluster for R rounds, with no extra communication;
       each cluster's model is saved.
    """

    def __init__(self, num_rounds: int, fedmed_config: dict, signature: dict, clustering: dict, **kw):
        super().__init__(num_rounds, fedmed_config, **kw)
        self.signature = dict(signature)
        self.clustering = dict(clustering)

    def collect_signatures(self) -> dict:
        results = self.send("signature", self.task({}, 0, signature=self.signature))
        sigs = {}
        for site, _, meta, _ in unpack(results):
            if meta.get("error"):
                self.recorder.doc["errors"].append({"round": -1, "site": site, "task": "signature", "error": meta["error"]})
                self.error(f"site {site} sent no signature and is left out: {meta['error']}")
            else:
                sigs[site] = meta
                if meta.get("note"):
                    self.info(meta["note"])
        return sigs

    def cluster(self, sigs: dict) -> dict:
        from fedmed.clustered import choose_clusters, signature_distances
        from fedmed.io import write_distance_csv
        from fedmed.plots import plot_dendrogram, plot_heatmap, plot_silhouette

        out = Path(self.get_run_dir()) / "fedmed"
        try:
            names, D = signature_distances(self.signature["kind"], sigs, overlap=self.clustering.get("overlap", True))
            info = choose_clusters(D, names, n_clusters=self.clustering.get("n_clusters"),
                                   threshold=self.clustering.get("threshold"))
        except ValueError as e:  # e.g. fewer than two signatures, or no pair of sites sharing a class
            names = sorted(sigs)
            self.error(f"clustering impossible ({e}); training one model for all {len(names)} sites")
            self.recorder.note("clustering", {"clusters": [names], "rule": f"fallback to one cluster: {e}",
                                              "sites": names})
            return {0: names} if names else {}
        info["encoder"] = sorted({m.get("encoder", "?") for m in sigs.values()})
        write_distance_csv(out / "distances.csv", names, D)
        plot_heatmap(D, names, out / "distance_heatmap.png", title=f"{self.signature['kind']} distances",
                     labels=info["labels"])
        if len(names) > 2:
            plot_dendrogram(D, names, out / "dendrogram.png", k=info["k"])
        if "silhouette" in info:
            plot_silhouette(info["silhouette"], info["window"], info["k"], out / "silhouette.png")
        self.recorder.note("clustering", {**info, "sites": names})
        self.info(f"clusters ({info['rule']}): {info['clusters']}")
        return {c: members for c, members in enumerate(info["clusters"])}

    def run(self):
        self.start_recording()
        self.train_clusters(self.cluster(self.collect_signatures()))
        self.recorder.close()

    def train_clusters(self, clusters: dict):
        theta = {c: initial_params(self.cfg) for c in clusters}
        for r in range(self.num_rounds + 1):
            task = "train" if r < self.num_rounds else "validate"
            rows = []
            replies = self.send_groups(task, {c: (self.task(theta[c], r, cluster=c), sites)
                                              for c, sites in clusters.items()})
            for c, results in replies.items():
                ok = unpack(results)
                rows.extend(ok)
                good = [row for row in ok if not row[2].get("error")]
                if task == "train" and good:
                    theta[c] = self.aggregate(good)
            self.record_rows(r, rows, task)
        for c in clusters:
            self.save(theta[c], name=f"cluster{c}")


class CFLController(FedAvgController):
    """CFL (Sattler et al. 2020): FedAvg inside clusters that split by gradient similarity.

    Every round each cluster trains from its model; when a cluster's mean update is small but
    some site's update is large (``fedmed.clustered.cfl_split``), it is bipartitioned by cosine
    similarity of the updates and each half continues from the cluster's model.
    """

    def __init__(self, num_rounds: int, fedmed_config: dict, eps1: float = 0.4, eps2: float = 1.6,
                 warmup_rounds: int = 2, **kw):
        super().__init__(num_rounds, fedmed_config, **kw)
        self.eps1, self.eps2, self.warmup_rounds = float(eps1), float(eps2), int(warmup_rounds)

    def run(self):
        from fedmed.clustered import cfl_split

        self.start_recording()
        clusters = {0: sorted(self.sample_clients())}
        theta = {0: initial_params(self.cfg)}
        splits = []
        for r in range(self.num_rounds + 1):
            task = "train" if r < self.num_rounds else "validate"
            rows, new_clusters, new_theta = [], {}, {}
            replies = self.send_groups(task, {c: (self.task(theta[c], r, cluster=c), sites)
                                              for c, sites in clusters.items()})
            for c, sites in clusters.items():
                results = unpack(replies[c])
                rows.extend(results)
                good = [row for row in results if not row[2].get("error")]
                if task != "train" or not good:
                    new_clusters[len(new_clusters)], new_theta[len(new_theta)] = sites, theta[c]
                    continue
                updates = [{k: np.asarray(p[k]) - np.asarray(theta[c][k]) for k in theta[c]} for *_, p in good]
                weights = [meta["n_train"] for _, _, meta, _ in good]
                decision = cfl_split(updates, weights, eps1=self.eps1, eps2=self.eps2)
                agg = self.aggregate(good)
                if decision["split"] and r >= self.warmup_rounds:
                    names = [s for s, *_ in good]
                    for half in (0, 1):
                        members = [n for n, lab in zip(names, decision["labels"]) if lab == half]
                        new_clusters[len(new_clusters)] = members
                        new_theta[len(new_theta)] = agg
                    splits.append({"round": r, "cluster": sites, "into": list(new_clusters.values())[-2:],
                                   "mean_norm": decision["mean_norm"], "max_norm": decision["max_norm"]})
                    self.info(f"CFL split in round {r}: {splits[-1]['into']}")
                else:
                    new_clusters[len(new_clusters)], new_theta[len(new_theta)] = sites, agg
            self.record_rows(r, rows, task)
            clusters, theta = new_clusters, new_theta
        self.recorder.note("clustering", {"clusters": list(clusters.values()), "splits": splits, "rule": "CFL"})
        for c in clusters:
            self.save(theta[c], name=f"cluster{c}")
        self.recorder.close()


class SegAssessmentController(ClusteredFedAvgController):
    """``004_``: assess the federation, then train a model that is better for it.

    1. one ``assess`` task: sites send metadata histograms and embedding centroids (aggregates);
       the server computes D_EMD and D_EUC, the most distant site and the two-cluster split and
       writes the report (``assessment/``: CSVs, JSON, heatmaps, report.md);
    2. ``mode``: ``"assess"`` stops there; ``"fedavg_w"`` runs FedAvg with the most distant site
       (by ``distance``, or ``site`` if given) weighted ``omega`` (Eq. 2); ``"clusters"`` runs
       FedAvg per cluster (Alg. 1's split by ``distance``, or ``clusters`` if given).
    With the site or clusters given, the assessment round is skipped.
    """

    def __init__(self, num_rounds: int, fedmed_config: dict, mode: str = "assess", distance: str = "emd",
                 omega: float = 1.0, site: str = "", clusters: list = None, **kw):
        super().__init__(num_rounds, fedmed_config, signature={}, clustering={}, omega=omega, **kw)
        self.mode, self.distance, self.site, self.clusters = mode, distance, site, clusters or []

    def assess_sites(self) -> dict:
        from fedmed.assessment import assess, write_report

        results = self.send("assess", self.task({}, 0))
        sites = {}
        for name, _, meta, _ in unpack(results):
            if meta.get("error"):
                self.recorder.doc["errors"].append({"round": -1, "site": name, "task": "assess", "error": meta["error"]})
                self.error(f"site {name} could not be assessed and is left out: {meta['error']}")
            else:
                sites[name] = meta
        report = assess(sites)
        write_report(report, Path(self.get_run_dir()) / "fedmed" / "assessment")
        summary = {k: {kk: vv for kk, vv in v.items() if kk != "matrix"} for k, v in report.items() if k in ("emd", "euc")}
        self.recorder.note("assessment", {"sites": report["sites"], **summary})
        self.info(f"assessment: " + "; ".join(f"{k} most distant {v['most_distant']}" for k, v in summary.items()))
        return report

    def run(self):
        self.start_recording()
        needs = (self.mode == "assess" or (self.mode == "fedavg_w" and not self.site)
                 or (self.mode == "clusters" and not self.clusters))
        report = self.assess_sites() if needs else {}
        if self.mode == "fedavg_w":
            self.down_weight_site = self.site or report[self.distance]["most_distant"]
            self.recorder.note("down_weighted", {"site": self.down_weight_site, "omega": self.omega,
                                                 "source": "given" if self.site else f"assessment ({self.distance})"})
            self.train_global()
        elif self.mode == "clusters":
            groups = self.clusters or report[self.distance]["clusters"]
            self.recorder.note("clustering", {"clusters": groups, "rule": "given" if self.clusters
                                              else f"004_ Alg. 1 on D_{self.distance.upper()}"})
            self.train_clusters({c: list(g) for c, g in enumerate(groups)})
        self.recorder.close()


class FluxController(FedAvgController):
    """Flux (``003_`` Algorithm 1) with partial participation.

    1. FedAvg rounds (a seeded ``participation`` fraction of sites each round) until the start
       rule of Eq. 14 fires on the served global model's mean accuracy;
    2. S1: sampled sites send latent min/max of the global model ``theta*``; the server merges
       and broadcasts the box; S2-S4: sites send descriptors (shared PCA, optional DP);
    3. clustering: adaptive DBSCAN (Flux) or K-means with ``n_clusters`` (Flux-prior);
       centroids of the full and the label-free descriptors;
    4. per-cluster FedAvg for the remaining rounds; a site sampled later without a cluster first
       sends its descriptor (computed with ``theta*``) and joins the nearest centroid (Eq. 9).
    Writes ``flux_state.npz`` (``theta*``, the box, centroids) for the test-time job.
    """

    def __init__(self, num_rounds: int, fedmed_config: dict, flux: dict, participation: float = 1.0,
                 n_clusters: int = 0, **kw):
        super().__init__(num_rounds, fedmed_config, **kw)
        self.flux = dict(flux)
        self.participation = float(participation)
        self.n_clusters = int(n_clusters or 0)

    def sample(self, r: int) -> list:
        sites = sorted(self.sample_clients())
        k = max(1, int(round(self.participation * len(sites))))
        rng = np.random.default_rng(self.cfg.get("seed", 0) * 100_003 + r)
        return sorted(rng.choice(sites, size=k, replace=False).tolist())

    def descriptors(self, theta_star, sites, label_free=False) -> dict:
        replies = unpack(self.send("descriptor", self.task(theta_star, 0, flux={**self.flux, "label_free": label_free}),
                                   targets=sites))
        out = {}
        for s, _, meta, _ in replies:
            if meta.get("error"):
                self.recorder.doc["errors"].append({"round": -1, "site": s, "task": "descriptor", "error": meta["error"]})
                self.error(f"site {s} sent no descriptor and stays unassigned: {meta['error']}")
            else:
                out[s] = meta
        return out

    def run(self):
        from fedmed.clustered import flux_cluster
        from fedmed.flux import assign_nearest, merge_bounds, should_start_clustering

        self.start_recording()
        theta, acc, r = initial_params(self.cfg), [], 0
        while r < self.num_rounds - 1:
            rows = self.record(r, self.send("train", self.task(theta, r), targets=self.sample(r)))
            theta = self.aggregate(rows) if rows else theta
            acc.append(self.recorder.doc["rounds"][-1]["summary"]["mean"].get("accuracy", 0.0))
            r += 1
            if should_start_clustering(acc, self.num_rounds, threshold=self.flux.get("start_threshold", 0.06)):
                break
        theta_star, part = theta, self.sample(r)
        bounds = [(np.asarray(m["lo"]), np.asarray(m["hi"]))
                  for s, _, m, _ in unpack(self.send("latent_bounds", self.task(theta_star, r), targets=part))
                  if not m.get("error")]
        lo, hi = merge_bounds(bounds)
        self.flux.update(lo=lo.tolist(), hi=hi.tolist())
        descs = self.descriptors(theta_star, part)
        info = flux_cluster(descs, n_clusters=self.n_clusters or None, scale=self.flux.get("scale", 1.0),
                            seed=self.cfg.get("seed", 0))
        assign = {s: lab for s, lab in zip(info["sites"], info["labels"])}
        n_params = sum(np.asarray(v).size for v in theta_star.values())
        self.recorder.note("clustering", {k: v for k, v in info.items() if not k.startswith("centroids")} |
                           {"start_round": r, "descriptor_to_model_ratio": info["descriptor_length"] / n_params,
                            "model_params": int(n_params)})
        self.info(f"Flux clusters at round {r} ({info['rule']}): {info['clusters']}")
        models = {c: theta_star for c in range(info["k"])}
        for rr in range(r, self.num_rounds + 1):
            task = "train" if rr < self.num_rounds else "validate"
            sampled = self.sample(rr) if task == "train" else sorted(self.sample_clients())
            new = [s for s in sampled if s not in assign]
            for s, meta in self.descriptors(theta_star, new).items() if new else []:
                assign[s] = assign_nearest(meta["full"], info["centroids_full"])
                self.info(f"{s} joins cluster {assign[s]} (nearest centroid)")
            groups = {c: (self.task(models[c], rr, cluster=c), [s for s in sampled if assign.get(s) == c])
                      for c in models}
            replies = self.send_groups(task, {c: g for c, g in groups.items() if g[1]})
            rows = [row for c in replies for row in unpack(replies[c])]
            self.record_rows(rr, rows, task)
            for c in replies:
                good = [row for row in unpack(replies[c]) if not row[2].get("error")]
                if task == "train" and good:
                    models[c] = self.aggregate(good)
        self.recorder.note("assignment", assign)
        for c, th in models.items():
            self.save(th, name=f"cluster{c}")
        state = Path(self.get_run_dir()) / "fedmed" / "flux_state.npz"
        np.savez(state, lo=lo, hi=hi, centroids_label_free=info["centroids_label_free"],
                 centroids_full=info["centroids_full"], pca_seed=self.flux.get("pca_seed", 0),
                 n_components=self.flux.get("n_components", 10), **{f"theta_star/{k}": v for k, v in theta_star.items()})
        self.recorder.close()


class FluxTestController(FedMedController):
    """Test phase on unseen, unlabeled sites (Flux Algorithm 2) and the baselines' counterparts.

    ``mode="flux"``: each site sends its label-free descriptor ``d'`` (computed with ``theta*`` and
    the training box); the server assigns the nearest label-free centroid (Eq. 9) and the site
    scores that cluster's model ("test phase"). ``mode="global"`` (FedAvg): the global model.
    ``mode="ensemble"`` (IFCA): the cluster models' probabilities averaged with weights equal to
    their training-site counts, as the Flux paper scores baselines without test-time assignment.
    With ``known_clusters`` (site -> cluster of its true group) each site also scores its known
    cluster's model ("known association"). Unseen sites are scored on all their data.
    """

    def __init__(self, num_rounds: int, fedmed_config: dict, training_result: str, known_clusters: dict = None,
                 mode: str = "flux", cluster_sizes: dict = None, **kw):
        super().__init__(num_rounds, fedmed_config, **kw)
        self.training_result = training_result
        self.known_clusters = dict(known_clusters or {})
        self.mode = mode
        self.cluster_sizes = dict(cluster_sizes or {})

    def run(self):
        from fedmed.flux import assign_nearest

        self.start_recording()
        self.fedmed_config = {**self.cfg, "evaluate_on": "all"}
        root = Path(self.training_result)
        models = {int(p.stem[len("cluster"):]): dict(np.load(p)) for p in sorted((root / "models").glob("cluster*.npz"))}
        if not models and (root / "models" / "global.npz").is_file():
            models = {0: dict(np.load(root / "models" / "global.npz"))}
        sites = sorted(self.sample_clients())
        assign = {}
        if self.mode == "flux":
            st = np.load(root / "flux_state.npz")
            theta_star = {k[len("theta_star/"):]: st[k] for k in st.files if k.startswith("theta_star/")}
            flux = {"lo": st["lo"].tolist(), "hi": st["hi"].tolist(), "pca_seed": int(st["pca_seed"]),
                    "n_components": int(st["n_components"]), "label_free": True}
            for s, _, meta, _ in unpack(self.send("descriptor", self.task(theta_star, 0, flux=flux), targets=sites)):
                if meta.get("error"):
                    self.recorder.doc["errors"].append({"round": 0, "site": s, "task": "descriptor", "error": meta["error"]})
                    self.error(f"unseen site {s} could not be assigned: {meta['error']}")
                else:
                    assign[s] = assign_nearest(meta["label_free"], st["centroids_label_free"])
            self.recorder.note("assignment", {"test_phase": assign, "known_association": self.known_clusters})
            self.validate_assigned("test_phase", 0, assign, models)
        elif self.mode == "global":
            self.validate_assigned("test_phase", 0, {s: 0 for s in sites}, models)
        else:
            packed = {f"m{k}/{n}": v for k, m in sorted(models.items()) for n, v in m.items()}
            weights = [float(self.cluster_sizes.get(str(k), self.cluster_sizes.get(k, 0)) or 0) for k in sorted(models)]
            weights = weights if sum(weights) > 0 else [1.0] * len(models)
            res = self.send("validate_ensemble", self.task(packed, 0, ensemble={"weights": weights}), targets=sites)
            self.recorder.record(0, [(s, m, meta) for s, m, meta, _ in unpack(res)], task="test_phase")
        if self.known_clusters:
            self.validate_assigned("known_association", 1, {s: int(c) for s, c in self.known_clusters.items()}, models)
        self.recorder.close()

    def validate_assigned(self, phase, index, mapping, models):
        groups = {c: (self.task(models[c], 0, cluster=c), [s for s, m in mapping.items() if m == c]) for c in models}
        replies = self.send_groups("validate", {c: g for c, g in groups.items() if g[1]})
        self.recorder.record(index, [(s, m, meta) for c in replies for s, m, meta, _ in unpack(replies[c])], task=phase)


class IFCAController(FedAvgController):
    """IFCA (Ghosh et al. 2020): K models; every round each sampled site receives all K,
    picks the one with the lowest local loss, trains it; the server averages per chosen model."""

    def __init__(self, num_rounds: int, fedmed_config: dict, k: int = 2, participation: float = 1.0, **kw):
        super().__init__(num_rounds, fedmed_config, **kw)
        self.k = int(k)
        self.participation = float(participation)

    sample = FluxController.sample

    def run(self):
        self.start_recording()
        models = [initial_params({**self.cfg, "seed": self.cfg.get("seed", 0) * 1000 + j}) for j in range(self.k)]
        for r in range(self.num_rounds + 1):
            train = r < self.num_rounds
            packed = {f"m{j}/{n}": v for j, m in enumerate(models) for n, v in m.items()}
            sites = self.sample(r) if train else sorted(self.sample_clients())
            results = self.send("ifca", self.task(packed, r, ifca={"k": self.k, "train": train}), targets=sites)
            rows = self.record(r, results, task="train" if train else "validate")
            for j in range(self.k):
                chosen = [row for row in rows if row[2].get("cluster") == j]
                if train and chosen:
                    models[j] = self.aggregate(chosen)
        self.recorder.note("clustering", {"k": self.k, "rule": "IFCA (lowest local loss)"})
        for j, m in enumerate(models):
            self.save(m, name=f"cluster{j}")
        self.recorder.close()
