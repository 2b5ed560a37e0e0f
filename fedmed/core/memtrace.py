"""Memory of long runs: :func:`trim` (once per round in the site script and the controller) and opt-in tracing for
``benchmarks/bench_memory.py --trace`` (off unless ``FEDMED_MEMTRACE`` names a folder).

Where does a long run's RSS growth come from? Each traced process (the site script, the server's controller)
starts :mod:`tracemalloc` and, every ``FEDMED_MEMTRACE_EVERY`` rounds, writes a snapshot of its live Python
allocations plus one JSON line with its RSS and the traced total. Comparing two snapshots names the source lines
whose live allocations grew; RSS growing while the traced total stays flat puts the growth outside Python objects
(native buffers, allocator fragmentation). Without the variable the tracing functions do nothing.
"""

from __future__ import annotations

import json
import os
import tracemalloc
from pathlib import Path

ENV = "FEDMED_MEMTRACE"


def _folder() -> Path | None:
    d = os.environ.get(ENV)
    return Path(d) if d else None


def start() -> bool:
    """Start tracing in this process when :data:`ENV` is set; returns whether tracing is on."""
    if _folder() is None:
        return False
    if not tracemalloc.is_tracing():
        tracemalloc.start(int(os.environ.get("FEDMED_MEMTRACE_FRAMES", "1")))
    return True


def rss_bytes() -> int:
    """This process's resident set size (Linux ``/proc/self/statm``; 0 elsewhere)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def checkpoint(tag: str, round_: int) -> None:
    """Every ``FEDMED_MEMTRACE_EVERY`` rounds (default 20): dump a snapshot ``<tag>_r<round>.snap`` and append
    ``{"round", "rss", "traced"}`` to ``<tag>.jsonl`` in the trace folder."""
    d = _folder()
    if d is None or not tracemalloc.is_tracing():
        return
    every = max(1, int(os.environ.get("FEDMED_MEMTRACE_EVERY", "20")))
    if round_ % every:
        return
    d.mkdir(parents=True, exist_ok=True)
    traced, _peak = tracemalloc.get_traced_memory()
    with open(d / f"{tag}.jsonl", "a") as f:
        f.write(json.dumps({"round": int(round_), "rss": rss_bytes(), "traced": int(traced)}) + "\n")
    tracemalloc.take_snapshot().dump(str(d / f"{tag}_r{int(round_):04d}.snap"))


def compare(folder, tag: str, first: int, last: int, top: int = 8) -> tuple[list, dict]:
    """Lines whose live allocations grew most between rounds ``first`` and ``last`` of process ``tag``, and the
    process's RSS / traced totals at both rounds: ``([(where, grown_bytes, grown_count)], {"rss": (a, b),
    "traced": (a, b)})``. The snapshots' own bookkeeping (this module, tracemalloc) is left out."""
    folder = Path(folder)
    keep = [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, __file__),
            tracemalloc.Filter(False, "<frozen importlib._bootstrap>")]
    a = tracemalloc.Snapshot.load(str(folder / f"{tag}_r{first:04d}.snap")).filter_traces(keep)
    b = tracemalloc.Snapshot.load(str(folder / f"{tag}_r{last:04d}.snap")).filter_traces(keep)
    rows = [(str(s.traceback[0]) if s.traceback else "?", s.size_diff, s.count_diff)
            for s in b.compare_to(a, "lineno")[:top]]
    lines = {r["round"]: r for r in map(json.loads, (folder / f"{tag}.jsonl").read_text().splitlines())}
    totals = {k: (lines[first][k], lines[last][k]) for k in ("rss", "traced")}
    return rows, totals


_LIBC = None


def trim() -> bool:
    """Give memory that glibc holds but no longer uses back to the system (``malloc_trim(0)``: every arena, whole
    free pages inside them too). FLARE's site and server processes free a 1 MiB stream buffer per message from many
    threads, which glibc then keeps in their heaps: calling this once per round halved the site processes' RSS
    growth over 200 rounds (+14.9% -> +7.8%, ``benchmarks/bench_memory.py``; docs/lab/performance.md "Memory"). It does not
    change how memory is allocated. Returns False where there is no glibc (nothing done)."""
    global _LIBC
    if _LIBC is None:
        import ctypes

        try:
            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.malloc_trim  # noqa: B018 - glibc only
        except (OSError, AttributeError):
            _LIBC = False
    if not _LIBC:
        return False
    _LIBC.malloc_trim(0)
    return True
