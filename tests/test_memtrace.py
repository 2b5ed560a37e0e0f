"""fedmed.memtrace: the opt-in tracing behind ``benchmarks/bench_memory.py --trace``."""

import tracemalloc

from fedmed import memtrace


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
