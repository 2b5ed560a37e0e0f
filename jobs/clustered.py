"""One-shot clustered FL jobs (FMCL, PACFL, FECFL) and the CFL baseline.

    python jobs/build.py --config app_configs/busi.yaml --datalists DIR --out JOBS --method "FMCL (Auto-K)"
"""

from __future__ import annotations

from jobs.common import fedmed_config, new_job, read_dataset_meta


def build(exp, datalist_dir: str, *, seed: int = 0, method=None, name: str | None = None):
    from custom.controllers import CFLController, ClusteredFedAvgController

    meta = read_dataset_meta(datalist_dir)
    cfg = fedmed_config(exp, meta, seed, method)
    if method.workflow == "cfl":
        ctrl = CFLController(num_rounds=exp.train.rounds, fedmed_config=cfg, eps1=method.cfl_eps1, eps2=method.cfl_eps2)
    else:
        signature = {"kind": method.workflow, "encoder": method.encoder, "weights": method.encoder_weights,
                     "image_size": method.encoder_image_size, "n_basis": method.n_basis, "seed": seed}
        clustering = {"n_clusters": method.n_clusters, "threshold": method.threshold, "overlap": method.overlap}
        ctrl = ClusteredFedAvgController(num_rounds=exp.train.rounds, fedmed_config=cfg, signature=signature,
                                         clustering=clustering)
    job_name = name or "".join(ch if ch.isalnum() else "_" for ch in f"{exp.name}_{method.name}_s{seed}").lower()
    return new_job(job_name, meta["sites"], datalist_dir, ctrl)
