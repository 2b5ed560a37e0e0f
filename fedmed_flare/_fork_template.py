"""Imported last by the simulator's site template (fedmed_flare.simulator): move every object the preloaded modules made
into the garbage collector's permanent generation, so the collector in a forked site process never writes to
those pages and they stay shared between the sites (``gc.freeze``, the CPython docs' advice before fork without
exec).

The template itself exits with ``os._exit`` once the simulator closes it (forkserver raises SystemExit in it):
finalizing an interpreter that imported torch takes ~1 s and the simulator waits for it at the end of every run.
Site workers never run this (multiprocessing ends a forked child with ``os._exit``; the pid check makes sure)."""

import gc

gc.collect()
gc.freeze()

import atexit
import os

_TEMPLATE_PID = os.getpid()


def _exit_now():
    if os.getpid() == _TEMPLATE_PID:
        os._exit(0)


atexit.register(_exit_now)  # registered last, so it runs first
