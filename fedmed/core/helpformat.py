"""The help formatter of every ``fedmed`` verb and of the shipped job builder and runner (``fedmed_flare.build``,
``fedmed_flare.run``): argparse's defaults, said once. In ``core`` so that the FLARE side needs nothing of the CLI
(#88)."""

from __future__ import annotations

import argparse

__all__ = ["HELP"]


class HELP(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's defaults in the help, once: not for an option without a default (``None``), a flag, or a help text
    that already says its default in words."""

    def _get_help_string(self, action):
        h = action.help or ""
        if action.default is None or action.nargs == 0 or "(default" in h or "default:" in h:
            return h
        return super()._get_help_string(action)
