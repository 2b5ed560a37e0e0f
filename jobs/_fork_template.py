"""Imported last by the simulator's site template (jobs/simulator.py): move every object the preloaded modules made
into the garbage collector's permanent generation, so the collector in a forked site process never writes to
those pages and they stay shared between the sites (``gc.freeze``, the CPython docs' advice before fork without
exec)."""

import gc

gc.collect()
gc.freeze()
