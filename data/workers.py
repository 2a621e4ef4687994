"""Worker processes for the data commands (`lwm tokenize`'s decoders, `lwm synthetic`'s
renderers): how many cores there are, and a pool of spawned workers that leave Ctrl-C to the
main process."""

from __future__ import annotations

import multiprocessing
import multiprocessing.pool
import os
import signal
from collections.abc import Callable

__all__ = ["spawn_pool", "usable_cores"]


def usable_cores() -> int:
    """The CPU cores this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def spawn_pool(workers: int, setup: Callable[[], None] | None = None) -> multiprocessing.pool.Pool:
    """``workers`` spawned processes (no fork of a process that holds JAX state), each running
    ``setup`` (a module-level function) when it starts. They ignore SIGINT: Ctrl-C reaches the
    whole process group, and the main process stops the pool (``terminate``); a worker
    interrupted itself could die holding the task queue's lock, which ``terminate`` then waits
    for forever, and prints a traceback."""
    ctx = multiprocessing.get_context("spawn")
    return ctx.Pool(workers, initializer=_start, initargs=(setup,))


def _start(setup: Callable[[], None] | None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if setup is not None:
        setup()
