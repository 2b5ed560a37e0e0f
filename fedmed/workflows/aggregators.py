"""How a workflow turns the sites' updates into a model, passed to it (as FLARE's ``ModelAggregator`` is) rather
than inherited: FedAvg's weighted average, and ``004_``'s down-weighting of one site (Eq. 2)."""

from __future__ import annotations

from fedmed.algorithms.aggregation import down_weight, weighted_average

__all__ = ["DownWeighted", "WeightedAverage"]


class WeightedAverage:
    """FedAvg (McMahan et al. 2017): each update weighted by its site's training samples ``n_train``."""

    def weights(self, rows) -> list:
        return down_weight([r.meta["n_train"] for r in rows], None, 1.0)

    def aggregate(self, rows) -> dict:
        return weighted_average([r.params for r in rows], self.weights(rows), names=[r.site for r in rows])


class DownWeighted(WeightedAverage):
    """FedAvg_w (``004_`` Eq. 2): ``site``'s weight multiplied by ``omega``."""

    def __init__(self, site: str, omega: float):
        self.site, self.omega = site, float(omega)

    def weights(self, rows) -> list:
        names = [r.site for r in rows]
        return down_weight([r.meta["n_train"] for r in rows], names.index(self.site) if self.site in names else None,
                           self.omega)
