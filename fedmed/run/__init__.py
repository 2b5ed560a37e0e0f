"""Experiments: the task config a job carries (taskconfig), a seed's federation on disk (federation), running one job (jobs), what makes a run the same run (fingerprint), a run's record into tables (records), `fedmed experiment` (experiment), the 001_ SSL study (ssl), reference rows (references).

Every name below is importable from ``fedmed.run`` (loaded on first use)."""

from fedmed.core.faces import lazy_face

_PUBLIC = {
    "BuildError": "taskconfig",
    "ExperimentError": "experiment",
    "REPO_ROOT": "experiment",
    "RunError": "jobs",
    "centralized_rows": "references",
    "classes_override": "federation",
    "cluster_majority_rows": "references",
    "build_task_config": "taskconfig",
    "majority_rows": "references",
    "min_clients": "taskconfig",
    "prepare_federation": "federation",
    "run_experiment": "experiment",
    "run_fingerprint": "fingerprint",
    "run_job": "jobs",
    "run_key": "ssl",
    "run_ssl": "ssl",
}

__all__ = sorted(_PUBLIC)

__getattr__, __dir__ = lazy_face(__name__, _PUBLIC)
