"""CFL (Sattler, Müller & Samek 2020): FedAvg inside clusters that split by gradient similarity."""

import numpy as np

from fedmed.workflows.fedavg import FedAvg


def weighted_mean(updates: list[dict], weights) -> dict:
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    return {k: sum(wi * np.asarray(u[k], dtype=np.float64) for wi, u in zip(w, updates)) for k in updates[0]}


class CFL(FedAvg):
    """Algorithm box (CFL, Alg. 1): every round each cluster trains from its model; when a cluster's mean
    update is small but some site's update is large (``fedmed.algorithms.clustered.cfl_split``), it is bipartitioned
    by cosine similarity of the updates and each half continues from the cluster's model. The parameter tree (the
    model at each split and each half's mean update) is kept so a new site can be sent down it (Sattler et al.,
    Sec. "clustering new clients"; :class:`fedmed.workflows.onboard.Onboard`)."""

    record_name = "CFLController"

    stable_cluster_ids = False

    def __init__(self, num_rounds: int, fedmed_config: dict, eps1: float = 0.4, eps2: float = 1.6,
                 warmup_rounds: int = 2, **kw):
        super().__init__(num_rounds, fedmed_config, **kw)
        self.eps1, self.eps2, self.warmup_rounds = float(eps1), float(eps2), int(warmup_rounds)

    def run(self):
        from fedmed.algorithms.clustered import cfl_split

        st = self.resumed.get("state", {})
        clusters = [[s for s in c if s in self.sites] for c in st.get("clusters", [self.sites])]
        saved = self.resumed_models()
        theta = [saved.get(f"cluster{c}") or self.initial_params() for c in range(len(clusters))]
        splits = st.get("splits", [])
        tree = {k: v for k, v in saved.items() if k.startswith("split")}  # the parameter tree (for onboarding)
        for r in range(self.start_round(), self.num_rounds + 1):
            task = "train" if r < self.num_rounds else "validate"
            replies = self.send_groups(task, {c: (self.task(theta[c], r, cluster=c), sites)
                                              for c, sites in enumerate(clusters) if sites})
            ok = {row[0] for row in self.record_rows(r, [row for rows in replies.values() for row in rows], task)}
            if task != "train":
                break
            new_clusters, new_theta = [], []
            for c, sites in enumerate(clusters):
                good = [row for row in replies.get(c, []) if row[0] in ok]
                if not good:
                    new_clusters.append(sites)
                    new_theta.append(theta[c])
                    continue
                updates = [{k: np.asarray(p[k]) - np.asarray(theta[c][k]) for k in theta[c]} for *_, p in good]
                decision = cfl_split(updates, [meta["n_train"] for _, _, meta, _ in good], eps1=self.eps1,
                                     eps2=self.eps2)
                agg = self.aggregate(good)
                if decision["split"] and r >= self.warmup_rounds:
                    names = [s for s, *_ in good]
                    halves = [[n for n, lab in zip(names, decision["labels"]) if lab == h] for h in (0, 1)]
                    halves[0] += [s for s in sites if s not in names]  # sites that did not answer stay with half 0
                    new_clusters += halves
                    new_theta += [agg, agg]
                    i = len(splits)
                    tree[f"split{i}_model"] = theta[c]
                    for h in (0, 1):
                        tree[f"split{i}_u{h}"] = weighted_mean(
                            [u for u, lab in zip(updates, decision["labels"]) if lab == h],
                            [meta["n_train"] for (_, _, meta, _), lab in zip(good, decision["labels"]) if lab == h])
                    splits.append({"round": r, "cluster": sites, "into": halves, "mean_norm": decision["mean_norm"],
                                   "max_norm": decision["max_norm"]})
                    self.info(f"CFL split in round {r}: {halves}")
                else:
                    new_clusters.append(sites)
                    new_theta.append(agg)
            clusters, theta = new_clusters, new_theta
            self.checkpoint(r + 1, {**{f"cluster{c}": t for c, t in enumerate(theta)}, **tree}, clusters=clusters,
                            splits=splits)
        self.recorder.note("clustering", {"clusters": clusters, "splits": splits, "rule": "CFL"})
        for c, sites in enumerate(clusters):
            self.save_final(theta[c], name=f"cluster{c}", sites=sites, cluster=c)
        self.save_onboarding("cfl", dict(enumerate(clusters)), splits=[{"cluster": sp["cluster"], "into": sp["into"]}
                                                                       for sp in splits],
                             arrays={f"{name}/{k}": v for name, p in tree.items() for k, v in p.items()})
