"""Aggregation math: FedAvg, distance-weighted FedAvg, per-cluster FedAvg, PreP weights.

State dicts are mappings from names to numpy arrays or torch tensors; the result has the same
type per entry. Integer entries (e.g. BatchNorm's ``num_batches_tracked``) are averaged and
rounded back to their integer dtype.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from fedmed.core.validation import check_finite_number

__all__ = [
    "cluster_average",
    "down_weight",
    "ifca_models",
    "pooled_norm_stats",
    "prep_weights",
    "server_opt_step",
    "weighted_average",
]

# state-dict entries FedOpt averages instead of stepping: batch-norm running statistics and counters
NOT_STEPPED = ("running_mean", "running_var", "num_batches_tracked")


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


def weighted_average(states: Sequence[Mapping], weights: Sequence[float], *, names=None) -> dict:
    """FedAvg: ``theta = sum_i w_i theta_i / sum_i w_i`` for every entry.

    Args:
        states: one state dict per site, all with the same keys and shapes.
        weights: non-negative weights (usually sample counts), not all zero.
        names: site names for error messages.

    Raises:
        ValueError: mismatched keys or shapes (naming the site and key), negative or all-zero
            weights, NaN/inf in an update.
    """
    if len(states) == 0:
        raise ValueError("weighted_average needs at least one state dict.")
    if len(weights) != len(states):
        raise ValueError(f"weights should have one entry per state ({len(states)}), got {len(weights)}.")
    names = list(names) if names is not None else [f"site-{i + 1}" for i in range(len(states))]
    w = np.asarray([check_finite_number(x, f"weight of {n}", low=0.0) for x, n in zip(weights, names)], dtype=np.float64)
    if w.sum() <= 0:
        raise ValueError("weights should not all be zero.")
    w = w / w.sum()
    keys = list(states[0].keys())
    for n, s in zip(names, states):
        if set(s.keys()) != set(keys):
            missing = sorted(set(keys) - set(s.keys()))
            extra = sorted(set(s.keys()) - set(keys))
            raise ValueError(f"{n}: state keys differ from {names[0]}'s (missing {missing[:3]}, extra {extra[:3]}).")
    out = {}
    for k in keys:
        vals = [states[i][k] for i in range(len(states))]
        torch_in = _is_torch(vals[0])
        arrs = [v.detach().cpu().numpy() if _is_torch(v) else np.asarray(v) for v in vals]
        shape = arrs[0].shape
        for n, a in zip(names, arrs):
            if a.shape != shape:
                raise ValueError(f"{n}: '{k}' has shape {a.shape}, expected {shape}.")
            if a.dtype.kind == "f" and not np.isfinite(a).all():
                raise ValueError(f"{n}: '{k}' contains NaN or inf.")
        acc = sum(wi * a.astype(np.float64) for wi, a in zip(w, arrs))
        if arrs[0].dtype.kind in "iub":
            acc = np.rint(acc)
        acc = acc.astype(arrs[0].dtype)
        if torch_in:
            import torch

            acc = torch.from_numpy(np.ascontiguousarray(acc)).to(dtype=vals[0].dtype)
        out[k] = acc
    return out


def down_weight(n_samples: Sequence[float], site: int | None, omega: float) -> np.ndarray:
    """FedAvg_w weights (``004_`` Eq. 2): every site has ``omega_i = 1`` except the most distant
    site ``site``, which gets ``omega``; combined with sample counts as ``omega_i * n_i``
    (the paper's federations are balanced, where this is just ``omega_i``). Returned normalised.
    """
    check_finite_number(omega, "omega", low=0.0, high=1.0)
    n = np.asarray([check_finite_number(x, "n_samples", low=0.0) for x in n_samples], dtype=np.float64)
    om = np.ones_like(n)
    if site is not None:
        if not 0 <= site < len(n):
            raise ValueError(f"site index should be in [0, {len(n)}), got {site}.")
        om[site] = omega
    w = om * n
    if w.sum() <= 0:
        raise ValueError("all aggregation weights are zero.")
    return w / w.sum()


def cluster_average(states: Sequence[Mapping], weights: Sequence[float], labels: Sequence[int], *, names=None) -> dict[int, dict]:
    """Per-cluster FedAvg: one weighted average per cluster label present in ``labels``."""
    labels = np.asarray(labels)
    if labels.shape != (len(states),):
        raise ValueError(f"labels should have one entry per state ({len(states)}), got shape {labels.shape}.")
    names = list(names) if names is not None else [f"site-{i + 1}" for i in range(len(states))]
    out = {}
    for m in sorted(set(labels.tolist())):
        idx = np.flatnonzero(labels == m)
        out[int(m)] = weighted_average([states[i] for i in idx], [weights[i] for i in idx], names=[names[i] for i in idx])
    return out


def ifca_models(models: Sequence[Mapping], states: Sequence[Mapping], weights: Sequence[float],
                choices: Sequence[int], *, empty: str = "keep", all_answered: bool = True,
                names=None) -> tuple[list, list[int]]:
    """IFCA's server step (Ghosh et al. 2020, Alg. 2): model ``j`` becomes the weighted average of the updates of
    the sites that chose it.

    A model no site chose: ``empty="keep"`` leaves it unchanged (the paper); ``empty="global"`` (fedmed) sets it
    to the weighted average of *all* updates of the round, but only when every site answered
    (``all_answered``): then no site's data prefers that model, and a stale copy would only steal later rounds
    from the live one when sites alternate between equally good models (docs/readings.md, "IFCA"). With
    partial participation a cluster can be empty because its sites were not sampled, so it is kept.

    Returns:
        (the K models, the ids of the models refilled this round).
    """
    if empty not in ("keep", "global"):
        raise ValueError(f"empty should be 'keep' or 'global', got {empty!r}.")
    out = list(models)
    for j in range(len(models)):
        idx = [i for i, c in enumerate(choices) if c == j]
        if idx:
            out[j] = weighted_average([states[i] for i in idx], [weights[i] for i in idx],
                                      names=[names[i] for i in idx] if names else None)
    refilled = [j for j in range(len(models)) if j not in set(choices)]
    if empty == "global" and all_answered and states and refilled:
        glob = weighted_average(states, weights, names=names)
        for j in refilled:
            out[j] = glob
    else:
        refilled = []
    return out, refilled


def prep_weights(label_sets: Sequence, n_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """PreP-WFL (``001_`` Eq. 1-2): prevalence ``p_c = sum_k 1{c in C_k}`` and ``w_c = 1 / p_c``.

    Only label ids leave a site. A class held by no site gets weight 0 (it never occurs in any
    site's loss, so its weight is irrelevant; 0 keeps the vector finite).

    Returns:
        (prevalence (C,), weights (C,)).
    """
    check_finite_number(n_classes, "n_classes", low=1, integer=True)
    p = np.zeros(int(n_classes))
    for k, s in enumerate(label_sets):
        s = sorted(set(int(c) for c in s))
        if s and (s[0] < 0 or s[-1] >= n_classes):
            raise ValueError(f"site {k}: class ids should lie in [0, {n_classes}), got {s}.")
        p[s] += 1
    with np.errstate(divide="ignore"):
        w = np.where(p > 0, 1.0 / np.maximum(p, 1), 0.0)
    return p, w


def pooled_norm_stats(stats: Sequence[Mapping], n_batches: Sequence[int]) -> dict[str, np.ndarray]:
    """Batch-norm running statistics of one pass over all the sites' batches, from each site's own
    (:func:`fedmed.nn.train.norm_statistics`: a cumulative average over its ``n_batches`` batches): their average
    weighted by batches — what :func:`torch.optim.swa_utils.update_bn` gives on the sites' batches in one stream.
    Only the keys every site sent."""
    if not stats:
        raise ValueError("pooled_norm_stats: no site's statistics")
    w = np.asarray(n_batches, dtype=np.float64)
    if w.shape != (len(stats),) or (w <= 0).any():
        raise ValueError(f"pooled_norm_stats: one positive batch count per site, got {list(n_batches)}")
    keys = set(stats[0]).intersection(*stats[1:])
    return {k: (sum(wi * np.asarray(st[k], dtype=np.float64) for wi, st in zip(w, stats)) / w.sum()).astype(
        np.asarray(stats[0][k]).dtype) for k in sorted(keys)}


def server_opt_step(theta: Mapping, avg: Mapping, state: dict, *, kind: str, lr: float = 1.0, beta1: float = 0.9,
                    beta2: float = 0.99, tau: float = 1e-3) -> dict:
    """One server step of FedOpt (Reddi et al., ICLR 2021, "Adaptive Federated Optimization", Alg. 2).

    The averaged update ``Delta = avg - theta`` is the pseudo-gradient's negative; per entry:

    * ``avgm`` (FedAvgM, Hsu et al. 2019): ``m = beta1 m + Delta``; ``theta' = theta + lr m``;
    * ``adam`` (FedAdam): ``m = beta1 m + (1 - beta1) Delta``; ``v = beta2 v + (1 - beta2) Delta^2``;
      ``theta' = theta + lr m / (sqrt(v) + tau)``;
    * ``yogi`` (FedYogi): as adam with ``v = v - (1 - beta2) Delta^2 sign(v - Delta^2)``.

    ``m`` starts at 0 and ``v`` at ``tau^2`` (Alg. 2: ``v_{-1} >= tau^2``), without bias correction, as the paper
    writes it. Integer entries and batch-norm running statistics (:data:`NOT_STEPPED`) take the average. ``state``
    (``{"m": {...}, "v": {...}}``, empty at the first step) is updated in place; ``kind`` ``none`` returns ``avg``.
    """
    if kind == "none":
        return dict(avg)
    if kind not in ("avgm", "adam", "yogi"):
        raise ValueError(f"server optimizer should be 'none', 'avgm', 'adam' or 'yogi', got {kind!r}.")
    m, v = state.setdefault("m", {}), state.setdefault("v", {})
    out = {}
    for k, a in avg.items():
        a = np.asarray(a)
        if a.dtype.kind != "f" or k.rsplit(".", 1)[-1] in NOT_STEPPED:
            out[k] = a
            continue
        t = np.asarray(theta[k], dtype=np.float64)
        d = a.astype(np.float64) - t
        if kind == "avgm":
            m[k] = beta1 * np.asarray(m.get(k, 0.0)) + d
            new = t + lr * m[k]
        else:
            m[k] = beta1 * np.asarray(m.get(k, 0.0)) + (1 - beta1) * d
            v0 = np.asarray(v[k]) if k in v else np.full_like(d, tau ** 2)
            d2 = d * d
            v[k] = beta2 * v0 + (1 - beta2) * d2 if kind == "adam" else v0 - (1 - beta2) * d2 * np.sign(v0 - d2)
            new = t + lr * m[k] / (np.sqrt(v[k]) + tau)
        out[k] = new.astype(a.dtype)
    return out
