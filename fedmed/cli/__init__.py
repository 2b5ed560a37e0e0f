"""The `fedmed` command line (main) and its workflow verbs (commands).

Every name below is importable from ``fedmed.cli`` (loaded on first use)."""

from importlib import import_module

_PUBLIC = {
    "cmd_assess": "commands",
    "cmd_data": "commands",
    "cmd_demo": "commands",
    "cmd_encoders": "commands",
    "cmd_experiment": "commands",
    "cmd_predict": "commands",
    "cmd_report": "commands",
    "cmd_ssl": "commands",
    "cmd_sweep": "commands",
    "main": "main",
    "register": "commands",
    "register_assess": "commands",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name):
    if name in _PUBLIC:
        value = getattr(import_module(f"{__name__}.{_PUBLIC[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))
