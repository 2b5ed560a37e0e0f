"""The `fedmed` command line (main), its workflow verbs (commands), the demo (demo) and the 004_ assessment and sweep verbs (assess).

Every name below is importable from ``fedmed.cli`` (loaded on first use)."""

from fedmed.core.faces import lazy_face

_PUBLIC = {
    "cmd_assess": "assess",
    "cmd_bundle": "commands",
    "cmd_data": "commands",
    "cmd_demo": "demo",
    "cmd_encoders": "commands",
    "cmd_experiment": "commands",
    "cmd_plan": "commands",
    "cmd_predict": "commands",
    "cmd_report": "commands",
    "cmd_ssl": "commands",
    "cmd_sweep": "assess",
    "main": "main",
    "register": "commands",
    "register_assess": "assess",
}

__all__ = sorted(_PUBLIC)

__getattr__, __dir__ = lazy_face(__name__, _PUBLIC)
