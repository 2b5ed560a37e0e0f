"""Flux (``003_``) and IFCA training jobs, and the test-time job for unseen sites.

    python jobs/build.py --config app_configs/flux_pneumonia.yaml --datalists DIR --out JOBS --method Flux
    python jobs/build.py ... --method Flux --test-phase --training-result RUN/server   # Algorithm 2
"""

from __future__ import annotations

from jobs.common import fedmed_config, new_job, read_dataset_meta


def _name(exp, method, seed, suffix=""):
    return "".join(ch if ch.isalnum() else "_" for ch in f"{exp.name}_{method.name}{suffix}_s{seed}").lower()


def build(exp, datalist_dir: str, *, seed: int = 0, method=None, name: str | None = None):
    from custom.controllers import FluxController, IFCAController

    meta = read_dataset_meta(datalist_dir)
    cfg = fedmed_config(exp, meta, seed, method)
    if method.workflow == "ifca":
        ctrl = IFCAController(num_rounds=exp.train.rounds, fedmed_config=cfg, k=method.n_clusters or 2,
                              participation=method.participation)
    else:
        flux = {"pca_seed": seed, "n_components": 10, "dp_epsilon": method.dp_epsilon, "scale": method.dbscan_scale}
        ctrl = FluxController(num_rounds=exp.train.rounds, fedmed_config=cfg, flux=flux,
                              participation=method.participation, n_clusters=method.n_clusters or 0)
    return new_job(name or _name(exp, method, seed), meta["sites"], datalist_dir, ctrl)


def build_test(exp, datalist_dir: str, *, seed: int = 0, method=None, training_result: str = "",
               known_clusters: dict | None = None, cluster_sizes: dict | None = None, name: str | None = None):
    from custom.controllers import FluxTestController

    meta = read_dataset_meta(datalist_dir)
    unseen = meta.get("unseen_sites") or []
    if not unseen:
        raise SystemExit(f"{datalist_dir}: dataset.json lists no unseen_sites for a test-phase job")
    cfg = fedmed_config(exp, meta, seed, method)
    mode = {"flux": "flux", "ifca": "ensemble"}.get(method.workflow, "global")
    ctrl = FluxTestController(num_rounds=1, fedmed_config=cfg, training_result=training_result,
                              known_clusters=known_clusters or {}, mode=mode, cluster_sizes=cluster_sizes or {})
    return new_job(name or _name(exp, method, seed, "_test"), unseen, datalist_dir, ctrl)
