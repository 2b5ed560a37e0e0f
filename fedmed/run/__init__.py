"""Experiments: the task config a job carries (taskconfig), `fedmed experiment` (experiment), the 001_ SSL study (ssl), reference rows (references).

Every name below is importable from ``fedmed.run`` (loaded on first use)."""

from fedmed.core.faces import lazy_face

_PUBLIC = {
    "BuildError": "taskconfig",
    "ExperimentError": "experiment",
    "REPO_ROOT": "experiment",
    "RunError": "experiment",
    "centralized_rows": "references",
    "classes_override": "experiment",
    "cluster_majority_rows": "references",
    "build_task_config": "taskconfig",
    "majority_rows": "references",
    "min_clients": "taskconfig",
    "prepare_federation": "experiment",
    "run_experiment": "experiment",
    "run_fingerprint": "experiment",
    "run_job": "experiment",
    "run_key": "ssl",
    "run_ssl": "ssl",
}

__all__ = sorted(_PUBLIC)

__getattr__, __dir__ = lazy_face(__name__, _PUBLIC)
