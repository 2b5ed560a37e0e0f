"""fedmed.core.memtrace: the opt-in tracing behind ``benchmarks/bench_memory.py --trace``."""

import tracemalloc

from fedmed.core import memtrace


def test_off_without_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv(memtrace.ENV, raising=False)
    assert memtrace.start() is False
    memtrace.checkpoint("site-1", 0)
    assert list(tmp_path.iterdir()) == []


def test_names_the_line_whose_allocations_grow(tmp_path, monkeypatch):
    monkeypatch.setenv(memtrace.ENV, str(tmp_path))
    monkeypatch.setenv("FEDMED_MEMTRACE_EVERY", "10")
    was_tracing = tracemalloc.is_tracing()
    kept = []
    try:
        assert memtrace.start()
        for r in range(31):
            kept.append(bytearray(64 * 1024))  # the leak: 64 KiB kept every round
            memtrace.checkpoint("site-x", r)
    finally:
        if not was_tracing:
            tracemalloc.stop()
    assert sorted(p.name for p in tmp_path.glob("*.snap")) == [f"site-x_r{r:04d}.snap" for r in (0, 10, 20, 30)]
    rows, totals = memtrace.compare(tmp_path, "site-x", 10, 30)
    where, grown, count = rows[0]
    assert "test_memtrace.py" in where and count >= 20  # a bytearray is its object and its buffer
    assert 20 * 64 * 1024 <= grown < 21 * 64 * 1024
    assert totals["traced"][1] - totals["traced"][0] >= 20 * 64 * 1024
    assert totals["rss"][0] > 0


TRIM_CHILD = r"""
import sys
sys.path.insert(0, sys.argv[1])
from fedmed.core import memtrace
big = bytearray(8 << 20)
del big  # after this free glibc raises its mmap threshold: later 1 MiB blocks come from the heap
blocks, keep = [], []
for _ in range(400):  # 400 MiB of 1 MiB heap blocks, pinned apart by small live ones (like FLARE's stream buffers)
    blocks.append(bytearray(1 << 20))
    keep.append(bytearray(64))
for b in blocks:
    b[::4096] = b"\1" * len(b[::4096])
del blocks
freed = memtrace.rss_bytes()
print(freed, memtrace.trim(), memtrace.rss_bytes())
"""


def test_trim_gives_freed_heap_blocks_back():
    """The mechanism behind the simulator's RSS growth and its fix: freed 1 MiB heap blocks stay resident until
    ``trim`` (``malloc_trim``) returns them."""
    import platform
    import subprocess
    import sys
    from pathlib import Path

    import pytest

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        pytest.skip("malloc_trim is glibc's")
    out = subprocess.run([sys.executable, "-c", TRIM_CHILD, str(Path(__file__).resolve().parents[1])],
                         capture_output=True, text=True, check=True).stdout.split()
    freed, trimmed, after = int(out[0]), out[1] == "True", int(out[2])
    assert trimmed
    assert freed > 350 * 2**20  # glibc kept the freed blocks
    assert after < freed - 300 * 2**20  # trim gave them back
