"""Intra-op threads: the closed form's small operations on one thread, its large ones on the caller's.

torch runs each operation on its intra-op threads (``torch.get_num_threads()``, one per core
by default) through OpenMP, and each parallel region forks and joins that team: MKL opens two
for most matrix products from a few thousand multiply-adds up (and two per matrix of a batched
product whose output is not contiguous, as the closed form's rows GEMMs are), LAPACK about
one per column of a factorisation, ATen one per elementwise operation over 32,768 entries.
When another process holds a core, each join waits for the scheduler to run the team's
thread there. The closed form is many small operations (per token, per core row of a
Kronecker factor), so it pays that wait far more often per unit of work than autograd's
batched operations; the count and its cost: docs/results.md, "Threads".

:func:`serial` runs the enclosed calls on one thread; inside it (or anywhere),
:func:`threads_for` gives an operation with enough work to gain from a team the caller's
thread count (``PARALLEL_MACS`` multiply-adds per parallel region of a product,
``PARALLEL_ENTRIES`` entries written by a copy, sum or fill) and runs a smaller one on one
thread. Both restore the thread count on exit, also after an error. They call
``torch.set_num_threads`` meanwhile: the OpenMP and MKL counts it sets are the calling
thread's, the default it records for threads that start their first parallel work during
the call is the process's.

*The team fits the free cores.* :func:`serial` gives large work at most :func:`free_cores` threads: the
machine's cores that no runnable task of another process holds at the call's start. A team larger than
that waits, at every join, for the thread that shares a core with the other work to be scheduled again
(docs/results.md, "Threads against autograd"). The reading is Linux's count of runnable tasks on the whole
machine (``/proc/loadavg``) less this process's own running threads (``/proc/self/task/*/stat``, read before
and after it, the larger count taken), taken at most every ``FREE_CORES_TTL`` seconds. It is taken only
where the process may run on every online core: a count over the whole machine says nothing about the
cores of a narrower affinity (``taskset``, a cpuset), so there, where ``/proc`` cannot be read, or with the
environment variable ``BLOCKHESS_FIT_FREE_CORES=0`` (read at import; for a container whose
``/proc/loadavg`` counts a whole shared host's tasks) every core of the affinity counts as free.
"""

from __future__ import annotations

import glob
import os
import threading
import time
from contextlib import contextmanager

import torch

__all__ = ["serial", "threads_for", "free_cores", "PARALLEL_MACS", "PARALLEL_ENTRIES", "TRANSPOSE_ENTRIES",
           "FREE_CORES_TTL"]

# From where a team gains on one thread on an idle machine (docs/results.md, "Threads", "The fix"):
PARALLEL_MACS = 1 << 18  # multiply-adds per parallel region of a matrix product or factorisation
PARALLEL_ENTRIES = 1 << 18  # entries written by one copy, sum or fill (contiguous rows)
TRANSPOSE_ENTRIES = 4  # a transposed copy counts each entry this many times (docs/results.md, "The fix")

FREE_CORES_TTL = 0.05  # seconds a reading of free_cores() is kept (a reading scans this process's threads twice)

_state = threading.local()  # .threads: the team for large work within the outermost serial() call
_reading = {"at": -1.0, "free": None}  # the last free_cores() reading and its time.monotonic()
_FIT = os.environ.get("BLOCKHESS_FIT_FREE_CORES", "1") != "0"
_clock = time.monotonic


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def _own_running() -> int:
    """This process's threads in state ``R`` (``/proc/self/task/*/stat``; 0 where unreadable)."""
    own = 0
    for path in glob.glob("/proc/self/task/*/stat"):
        try:
            with open(path) as f:
                stat = f.read()
        except OSError:  # a thread that ended meanwhile
            continue
        end = stat.rfind(")")  # the state follows the command name, which may hold spaces or parentheses
        own += end >= 0 and stat[end + 2 : end + 3] == "R"
    return own


def _running_elsewhere() -> int | None:
    """The runnable tasks of other processes now: ``/proc/loadavg``'s running count (every process's,
    this reading thread included) less this process's threads in state ``R`` (counted before and after
    it, the larger count: a spinning thread of ours that sleeps meanwhile is not taken for another
    process's); ``None`` where unreadable."""
    before = _own_running()
    try:
        with open("/proc/loadavg") as f:
            running = int(f.read().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0, running - max(before, _own_running(), 1))


def _whole_machine() -> bool:
    """Whether this process may run on every online core (where a count of the machine's tasks applies)."""
    return _cores() == (os.cpu_count() or 1)


def free_cores() -> int:
    """The cores not held by another process's runnable task now, at least 1, where the process may run on
    every online core; else, where ``/proc`` cannot be read, or with ``BLOCKHESS_FIT_FREE_CORES=0``, every
    core of its affinity. A reading is kept ``FREE_CORES_TTL`` seconds."""
    now = _clock()
    if _reading["free"] is None or now - _reading["at"] > FREE_CORES_TTL:
        cores = _cores()
        elsewhere = _running_elsewhere() if _FIT and _whole_machine() else None
        _reading["free"] = cores if elsewhere is None else max(1, cores - elsewhere)
        _reading["at"] = now
    return _reading["free"]


def _set(n: int) -> None:
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


@contextmanager
def serial():
    """Run the enclosed torch calls on one intra-op thread (those inside :func:`threads_for`
    with enough work on the caller's count, at most :func:`free_cores` at the outermost call's start);
    nested uses keep the outermost caller's team. Restores ``torch.get_num_threads()`` on exit. Usable
    as a decorator, ``@serial()``."""
    n = torch.get_num_threads()
    outer = getattr(_state, "threads", None)
    if outer is None:
        _state.threads = min(n, free_cores()) if n > 1 else n
    _set(1)
    try:
        yield
    finally:
        _set(n)
        if outer is None:
            _state.threads = None


class threads_for:
    """Run the enclosed operation on the caller's thread count (inside :func:`serial`: the
    team its outermost call took) if it does at least ``PARALLEL_MACS`` multiply-adds per
    parallel region (``macs``: a whole ``mm`` or contiguous ``bmm``, one matrix of a ``bmm``
    into a strided output, a column of a factorisation) or writes at least
    ``PARALLEL_ENTRIES`` entries (``entries``), else on one thread. Restores the thread count
    on exit. (A class, not a generator: it is entered for every block product.)"""

    __slots__ = ("_large", "_restore")

    def __init__(self, macs: int = 0, entries: int = 0):
        self._large = macs >= PARALLEL_MACS or entries >= PARALLEL_ENTRIES
        self._restore = None

    def __enter__(self):
        now = torch.get_num_threads()
        n = (getattr(_state, "threads", None) or now) if self._large else 1
        if n != now:
            torch.set_num_threads(n)
            self._restore = now
        return self

    def __exit__(self, *exc):
        if self._restore is not None:
            torch.set_num_threads(self._restore)
            self._restore = None
        return False
