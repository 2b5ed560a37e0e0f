"""IFCA (Ghosh et al. 2020): K models, each site trains the one with the lowest local loss."""

import numpy as np

from custom.base import initial_params
from custom.fedavg import FedAvgController


class IFCAController(FedAvgController):
    """Algorithm box (IFCA, Alg. 2): every round each sampled site receives all K models, picks the one
    with the lowest loss on its training data and trains it; the server averages per chosen model."""

    def __init__(self, num_rounds: int, fedmed_config: dict, k: int = 2, participation: float = 1.0,
                 resume: bool = False, **kw):
        super().__init__(num_rounds, fedmed_config, resume=resume, **kw)
        self.k = int(k)
        self.participation = float(participation)

    def sample(self, r: int) -> list:
        n = max(1, int(round(self.participation * len(self.sites))))
        rng = np.random.default_rng(self.cfg.get("seed", 0) * 100_003 + r)
        return sorted(rng.choice(self.sites, size=n, replace=False).tolist())

    def workflow(self):
        saved = self.resumed_models()
        models = [saved.get(f"cluster{j}") or initial_params({**self.cfg, "seed": self.cfg.get("seed", 0) * 1000 + j})
                  for j in range(self.k)]
        for r in range(self.start_round(), self.num_rounds + 1):
            train = r < self.num_rounds
            packed = {f"m{j}/{n}": v for j, m in enumerate(models) for n, v in m.items()}
            sites = self.sample(r) if train else list(self.sites)
            rows = self.record_rows(r, self.send("ifca", self.task(packed, r, ifca={"k": self.k, "train": train}),
                                                 targets=sites), "train" if train else "validate")
            if train:
                for j in range(self.k):
                    chosen = [row for row in rows if row[2].get("cluster") == j]
                    if chosen:
                        models[j] = self.aggregate(chosen)
                self.checkpoint(r + 1, {f"cluster{j}": m for j, m in enumerate(models)})
        last = self.recorder.doc["rounds"][-1]["sites"]
        self.recorder.note("clustering", {"k": self.k, "rule": "IFCA (lowest local loss)"})
        for j, m in enumerate(models):
            self.save_final(m, name=f"cluster{j}", sites=[s for s, v in last.items() if v.get("cluster") == j],
                            cluster=j)
