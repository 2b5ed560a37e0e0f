"""fedmed's one exception base (#88): every error fedmed raises on purpose derives from :class:`FedmedError`, with its
standard-library base kept as a second parent where callers rely on it (``ValueError`` for bad input, ``RuntimeError``
for a run that failed, ...). The command line catches it and prints its message as one line."""

from __future__ import annotations

__all__ = ["FedmedError"]


class FedmedError(Exception):
    """An error fedmed raises on purpose: its message is for the user (one line naming the file, site or parameter)."""
