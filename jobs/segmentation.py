"""Segmentation jobs of ``004_``: assessment, FedAvg_w, per-cluster FedAvg (FedAvg, FedProx and
Ditto use ``jobs.fedavg`` with the segmentation config).

    python jobs/build.py --config app_configs/brats_seg.yaml --datalists DIR --out JOBS --method "FedAvg_w 0.3"
"""

from __future__ import annotations

from jobs.common import fedmed_config, new_job, read_dataset_meta

MODES = {"seg_assess": "assess", "fedavg_w": "fedavg_w", "seg_clusters": "clusters"}


def build(exp, datalist_dir: str, *, seed: int = 0, method=None, name: str | None = None):
    from custom.controllers import SegAssessmentController

    meta = read_dataset_meta(datalist_dir)
    cfg = fedmed_config(exp, meta, seed, method)
    ctrl = SegAssessmentController(num_rounds=exp.train.rounds, fedmed_config=cfg, mode=MODES[method.workflow],
                                   distance=method.distance, omega=method.omega, site=method.site,
                                   clusters=method.clusters)
    job_name = name or "".join(ch if ch.isalnum() else "_" for ch in f"{exp.name}_{method.name}_s{seed}").lower()
    return new_job(job_name, meta["sites"], datalist_dir, ctrl)
