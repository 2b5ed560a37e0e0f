"""FedAvg as a plain in-process loop over the same :class:`~fedmed.site.SiteRunner` calls the NVFlare
workflow makes — no FLARE, one process.

Two uses: the reference side of ``benchmarks/bench_simulator.py`` (FLARE's overhead is measured against
it, and both must give the same final model), and quick recipe studies (``benchmarks/tune_recipe.py``),
where starting a simulator per configuration would cost more than the training.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .aggregation import weighted_average
from .reporting import summarize_sites

__all__ = ["fedavg_loop"]


def fedavg_loop(cfg: dict, datalists, sites: list[str], *, rounds: int, log=None,
                init: dict | None = None) -> tuple[dict, list[dict]]:
    """Run FedAvg for ``rounds`` rounds with the task config ``cfg`` (the dict jobs send to sites); ``init``
    overrides entries of the initial parameters (e.g. a pre-trained encoder).

    Returns:
        (final global params, one summary per round — the model served in rounds 0..R, as the workflow records).
    """
    from .models import model_from_config
    from .site import SiteRunner
    from .train import get_params

    runners = {s: SiteRunner(s, Path(datalists)) for s in sites}
    d = cfg["data"]
    theta = get_params(model_from_config(cfg["model"], d["channels"], d["n_classes"], seed=cfg.get("seed", 0)))
    if init:
        theta.update({k: v for k, v in init.items() if k in theta})
    summaries = []
    for r in range(rounds + 1):
        task = "train" if r < rounds else "validate"
        results = {s: run.handle(task, theta, cfg, r) for s, run in runners.items()}
        per_site = {s: {**metrics, **{k: v for k, v in meta.items() if k in ("n_test", "val_n_test", "confusion",
                                                                              "score_hist", "val_confusion",
                                                                              "val_score_hist")}}
                    for s, (_, metrics, meta) in results.items()}
        summaries.append({"round": r, "task": task, **summarize_sites(per_site)})
        if log:
            m = summaries[-1]["mean"]
            log(f"round {r}: val acc {m.get('val_accuracy', np.nan):.3f} test acc {m.get('accuracy', np.nan):.3f}"
                f" loss {m.get('train_loss', np.nan):.3f}")
        if task == "train":
            names = sorted(results)
            theta = weighted_average([results[s][0] for s in names], [results[s][2]["n_train"] for s in names],
                                     names=names)
    return theta, summaries
