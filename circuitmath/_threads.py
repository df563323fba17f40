"""How many torch threads a check computes with: the cores that are idle, never more than torch's own choice.

torch's intra-op thread pool assumes it owns every core it may run on. On a busy machine its
threads wait at each parallel region's barrier for a thread the scheduler has put aside, and a
check of a small model can take many times what it takes with one thread. :func:`idle_threads`
counts the cores this process may run on (``os.sched_getaffinity``) less the runnable tasks of
other processes (``/proc/loadavg``'s fourth field, less this one; the one-minute load average
elsewhere) and caps that at torch's current setting, so that a quiet machine keeps every thread
torch would use and a busy one drops to what is free, at least one. :func:`check_threads` applies
it for the duration of a public check and restores the caller's setting on the way out, so no
setting of the caller is changed for good; a check inside a check keeps the outer one's count.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Iterator

import torch

__all__ = ["idle_threads", "check_threads", "with_check_threads"]

_PROC_LOADAVG = "/proc/loadavg"

_depth = threading.local()


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def _others_running(loadavg_path: str = _PROC_LOADAVG) -> float:
    """The tasks of other processes running or waiting for a core now (Linux), else the load average."""
    try:
        with open(loadavg_path) as handle:
            running = int(handle.read().split()[3].split("/")[0])
        return max(running - 1, 0)  # less the thread reading the file
    except (OSError, ValueError, IndexError):
        try:
            return max(os.getloadavg()[0] - 1, 0.0)
        except OSError:
            return 0.0


def idle_threads(ceiling: int | None = None, *, cores: int | None = None, others: float | None = None) -> int:
    """``min(ceiling, cores - others)``, at least 1: the threads a check may use without waiting
    for cores other processes hold. ``ceiling`` defaults to ``torch.get_num_threads()``, ``cores``
    to the cores this process may run on, ``others`` to the runnable tasks of other processes."""
    ceiling = torch.get_num_threads() if ceiling is None else ceiling
    cores = _usable_cores() if cores is None else cores
    others = _others_running() if others is None else others
    return max(1, min(ceiling, int(cores - others)))


@contextlib.contextmanager
def check_threads() -> Iterator[int]:
    """Compute with :func:`idle_threads` torch threads within; the caller's count is restored after."""
    if getattr(_depth, "value", 0):
        _depth.value += 1
        try:
            yield torch.get_num_threads()
        finally:
            _depth.value -= 1
        return
    before = torch.get_num_threads()
    chosen = idle_threads(before)
    _depth.value = 1
    if chosen != before:
        torch.set_num_threads(chosen)
    try:
        yield chosen
    finally:
        _depth.value = 0
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def with_check_threads(function: Callable) -> Callable:
    """``function`` run within :func:`check_threads`."""

    @functools.wraps(function)
    def run(*args, **kwargs):
        with check_threads():
            return function(*args, **kwargs)

    return run
