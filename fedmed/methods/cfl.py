"""CFL (Sattler et al. 2020): FedAvg that bipartitions a cluster when its sites' updates point apart.

Its server workflow: CFL (Sattler, Müller & Samek 2020): FedAvg inside clusters that split by gradient similarity.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import numpy as np
from pydantic import Field

from fedmed.methods.base import Method, register_method
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

    record_name = "CFL"
    earlier_record_names = ("CFLController",)  # what runs of fedmed before 2026-11-25 recorded

    stable_cluster_ids = False

    def __init__(self, num_rounds: int, task_config: dict, *, eps1: float, eps2: float, warmup_rounds: int, **kw):
        """Every option from the method (``fedmed.methods.CFLMethod``)."""
        super().__init__(num_rounds, task_config, **kw)
        self.eps1, self.eps2, self.warmup_rounds = float(eps1), float(eps2), int(warmup_rounds)

    def run(self):
        from fedmed.algorithms.clustered import cfl_split

        st = self.resumed.get("state", {})
        clusters = [[s for s in c if s in self.sites] for c in st.get("clusters", [self.sites])]
        saved = self.resumed_models()
        theta = [saved.get(f"cluster{c}") or self.initial_params() for c in range(len(clusters))]
        splits = st.get("splits", [])
        tree = {k: v for k, v in saved.items() if k.startswith("split")}  # the parameter tree (for onboarding)
        stop = self.stopper("global")  # train.stop on the federation's validation score (#85: every clustered loop)
        last = self.num_rounds if stop.stopped_at is None else stop.stopped_at + 1
        for r in range(self.start_round(), self.num_rounds + 1):
            task = "train" if r < last else "validate"
            replies = self.send_groups(task, {c: (self.task(theta[c], r, cluster=c), sites)
                                              for c, sites in enumerate(clusters) if sites})
            answered = self.record_rows(r, [row for rows in replies.values() for row in rows], task)
            ok = {row[0] for row in answered}
            halt = self.observe(stop, r, answered, None)  # several models: no single selected one is kept
            if task != "train":
                break
            if halt:
                stop.stopped_at, last = r, r + 1
            new_clusters, new_theta, parent = [], [], {}
            for c, sites in enumerate(clusters):
                good = [row for row in replies.get(c, []) if row[0] in ok]
                if not good:
                    parent[len(new_clusters)] = c
                    new_clusters.append(sites)
                    new_theta.append(theta[c])
                    continue
                updates = [{k: np.asarray(p[k]) - np.asarray(theta[c][k]) for k in theta[c]} for *_, p in good]
                decision = cfl_split(updates, [meta["n_train"] for _, _, meta, _ in good], eps1=self.eps1,
                                     eps2=self.eps2)
                agg = self.next_model(good, theta[c], r, key=f"cluster{c}")
                if decision["split"] and r >= self.warmup_rounds:
                    names = [s for s, *_ in good]
                    halves = [[n for n, lab in zip(names, decision["labels"]) if lab == h] for h in (0, 1)]
                    halves[0] += [s for s in sites if s not in names]  # sites that did not answer stay with half 0
                    parent.update({len(new_clusters): c, len(new_clusters) + 1: c})
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
                    parent[len(new_clusters)] = c
                    new_clusters.append(sites)
                    new_theta.append(agg)
            clusters, theta = new_clusters, new_theta
            self.move_server_opt({f"cluster{n}": f"cluster{o}" for n, o in parent.items()})
            self.checkpoint(r + 1, {**{f"cluster{c}": t for c, t in enumerate(theta)}, **tree}, clusters=clusters,
                            splits=splits, stoppers={"global": stop})
        self.recorder.note("clustering", {"clusters": clusters, "splits": splits, "rule": "CFL"})
        self.save_selected({"global": stop}, last)
        for c, sites in enumerate(clusters):
            self.save_final(theta[c], name=f"cluster{c}", sites=sites, cluster=c)
        self.save_onboarding("cfl", dict(enumerate(clusters)), splits=[{"cluster": sp["cluster"], "into": sp["into"]}
                                                                       for sp in splits],
                             arrays={f"{name}/{k}": v for name, p in tree.items() for k, v in p.items()})

    # ------------------------------------------------------------------ a new site after training (fedmed.workflows.onboard)
    onboard_needs_state = True
    onboard_label_free = False  # the new site's training updates need its labels
    onboard_needs_labels = "CFL sends a new site down its tree by the site's training updates, which need labels"

    @classmethod
    def assign_new_sites(cls, ob, st: dict, models: dict) -> dict:
        """Down CFL's parameter tree (Sattler et al. 2020): at each split the site computes its update from the
        model the split was made at, and follows the half whose mean update is most cosine-similar; the leaf is
        its cluster."""
        from fedmed.algorithms.clustered import cosine_of_updates
        splits, clusters = st["state"]["splits"], {int(c): sorted(s) for c, s in st["clusters"].items()}
        tree = ob.arrays()
        root = sorted({s for m in clusters.values() for s in m} | {s for sp in splits for s in sp["cluster"]})
        at = {s: root for s in ob.sites}  # the node (its training sites) each new site is at
        path: dict = {s: [] for s in ob.sites}
        leaf = {tuple(m): c for c, m in clusters.items()}
        for depth in range(len(splits) + 1):
            todo: dict = {}
            for s, node in at.items():
                i = next((i for i, sp in enumerate(splits) if sorted(sp["cluster"]) == node), None)
                if i is not None:
                    todo.setdefault(i, []).append(s)
            if not todo:
                break
            replies = ob.send_groups("train", {i: (ob.task(tree[f"split{i}_model"], 0), sites)
                                                 for i, sites in todo.items()})
            for i, rows in replies.items():
                for s, _, meta, params in rows:
                    if meta.get("error"):
                        ob.recorder.error(0, s, "train", meta["error"])
                        ob.error(f"new site {s} sent no update and cannot be assigned: {meta['error']}")
                        at.pop(s)
                        continue
                    theta = tree[f"split{i}_model"]
                    update = {k: np.asarray(params[k]) - np.asarray(theta[k]) for k in theta}
                    sims = [cosine_of_updates(update, tree[f"split{i}_u{h}"]) for h in (0, 1)]
                    h = int(np.argmax(sims))
                    at[s] = sorted(splits[i]["into"][h])
                    path[s].append({"split": i, "cosine": sims, "half": h})
        assign = {}
        for s, node in at.items():
            c = leaf.get(tuple(node))
            if c is None:  # a node whose sites all left before the end: the cluster holding most of them
                c = max(clusters, key=lambda k: len(set(clusters[k]) & set(node)))
            assign[s] = c
        ob.recorder.note("onboarding", {"cfl_path": path})
        return ob.assigned(assign)


@register_method
class CFLMethod(Method):
    workflow: Literal["cfl"]
    cfl_eps1: float = Field(0.4, gt=0)
    cfl_eps2: float = Field(1.6, gt=0)
    warmup_rounds: int = Field(2, ge=0)
    server: ClassVar = CFL
    clustered: ClassVar[bool] = True
    onboards: ClassVar[bool] = True

    def workflow_options(self, exp, seed):
        return {"eps1": self.cfl_eps1, "eps2": self.cfl_eps2, "warmup_rounds": self.warmup_rounds}
