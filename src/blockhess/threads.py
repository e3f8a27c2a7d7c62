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
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch

__all__ = ["serial", "threads_for", "PARALLEL_MACS", "PARALLEL_ENTRIES", "TRANSPOSE_ENTRIES"]

# From where a team gains on one thread on an idle machine (docs/results.md, "Threads", "The fix"):
PARALLEL_MACS = 1 << 18  # multiply-adds per parallel region of a matrix product or factorisation
PARALLEL_ENTRIES = 1 << 18  # entries written by one copy, sum or fill (contiguous rows)
TRANSPOSE_ENTRIES = 4  # a transposed copy counts each entry this many times (docs/results.md, "The fix")

_state = threading.local()  # .threads: the outermost serial() caller's thread count


def _set(n: int) -> None:
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


@contextmanager
def serial():
    """Run the enclosed torch calls on one intra-op thread (those inside :func:`threads_for`
    with enough work on the caller's count); nested uses keep the outermost caller's count.
    Restores ``torch.get_num_threads()`` on exit. Usable as a decorator, ``@serial()``."""
    n = torch.get_num_threads()
    outer = getattr(_state, "threads", None)
    if outer is None:
        _state.threads = n
    _set(1)
    try:
        yield
    finally:
        _set(n)
        if outer is None:
            _state.threads = None


class threads_for:
    """Run the enclosed operation on the caller's thread count (inside :func:`serial`: the
    count its outermost caller had) if it does at least ``PARALLEL_MACS`` multiply-adds per
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
