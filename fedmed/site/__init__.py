"""A site's side of every method, independent of the FL framework: its settings (settings), the task runners for classification (runner), segmentation (seg) and Fed-MAE (mae), and the one reply loop every federation runs (reply.answer).

Every name below is importable from ``fedmed.site`` (loaded on first use)."""

from fedmed.core.faces import lazy_face

_PUBLIC = {
    "CLASSIFICATION": "tasks",
    "MAESiteRunner": "mae",
    "Reply": "tasks",
    "SETTINGS_FILE": "settings",
    "SegSiteRunner": "seg",
    "SiteConfigError": "settings",
    "SiteRunner": "runner",
    "SiteSettings": "settings",
    "Splits": "runner",
    "TaskError": "runner",
    "answer": "reply",
    "make_runner": "reply",
    "path_spans": "settings",
    "resolve_site_settings": "settings",
    "scrub": "settings",
    "redact": "settings",
    "redact_strings": "settings",
    "scrubbed": "reply",
    "site_assessment": "seg_aggregates",
    "task_seed": "runner",
    "to_meta": "reply",
    "train": "tasks",
    "train_locally": "tasks",
    "validate": "tasks",
    "validate_ensemble": "tasks",
}

__all__ = sorted(_PUBLIC)

__getattr__, __dir__ = lazy_face(__name__, _PUBLIC)
