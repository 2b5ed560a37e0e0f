"""Work-arounds for the Python runtime fedmed's processes run in (no NVFlare import here).

:func:`serialize_ast_parse` — CPython 3.11 keeps the AST constructor's recursion depth in per-interpreter state
(``ast2obj_*``, gh-95185 / gh-106905): when a cyclic garbage collection inside one thread's ``ast.parse`` runs a
finalizer and the interpreter switches to another thread that parses too, the first fails with ``SystemError: AST
constructor recursion depth mismatch``. NVFlare decodes every numpy array it receives with ``np.load``, whose header
is read by ``ast.literal_eval`` → ``ast.parse``, in one thread per concurrent download: a FLARE server taking two
sites' results at once failed the whole job this way ("failed to decode streamed submit_update ... exiting job
process"; seen in ``fedmed demo``'s FMCL run). Serialising ``ast.parse`` behind one process-wide lock removes the
interleaving; parses are a few microseconds, so the lock costs nothing measurable.
"""

from __future__ import annotations

import ast
import threading

__all__ = ["serialize_ast_parse"]

_LOCK = threading.RLock()


def serialize_ast_parse() -> None:
    """Wrap ``ast.parse`` (which ``ast.literal_eval`` and so ``np.load`` call) in a process-wide lock; idempotent."""
    if getattr(ast.parse, "_fedmed_serialized", False):
        return
    parse = ast.parse

    def locked_parse(*args, **kwargs):
        with _LOCK:
            return parse(*args, **kwargs)

    locked_parse.__doc__ = parse.__doc__
    locked_parse.__wrapped__ = parse
    locked_parse._fedmed_serialized = True
    ast.parse = locked_parse
