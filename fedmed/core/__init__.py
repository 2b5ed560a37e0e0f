"""Plumbing every layer uses: runtime work-arounds (compat), small file formats (io), memory of long runs (memtrace), argument checks (validation), where the shipped files are (resources), the compute device (device), and the run's record (record).

Every name below is importable from ``fedmed.core`` (loaded on first use)."""

from fedmed.core.faces import lazy_face

_PUBLIC = {
    "ClusteringTask": "schema",
    "DataSection": "schema",
    "DeviceError": "device",
    "FederationTiming": "schema",
    "FinetuneTask": "schema",
    "ModelSection": "schema",
    "PRECISIONS": "device",
    "PrivacyConfig": "schema",
    "ResourceError": "resources",
    "SegTrainConfig": "schema",
    "SignatureTask": "schema",
    "Strict": "schema",
    "TaskConfig": "schema",
    "TrainConfig": "schema",
    "TrainTask": "schema",
    "autocast": "device",
    "backward_step": "device",
    "check_distance_matrix": "validation",
    "check_finite_number": "validation",
    "check_site_names": "validation",
    "checkpoint": "memtrace",
    "compare": "memtrace",
    "grad_scaler": "device",
    "json_default": "io",
    "model_device": "device",
    "project_root": "resources",
    "read_distance_csv": "io",
    "read_signature_dir": "io",
    "resolve_device": "device",
    "rss_bytes": "memtrace",
    "serialize_ast_parse": "compat",
    "shipped_config": "resources",
    "start": "memtrace",
    "task_config": "schema",
    "trim": "memtrace",
    "write_distance_csv": "io",
}

__all__ = sorted(_PUBLIC)

__getattr__, __dir__ = lazy_face(__name__, _PUBLIC)
