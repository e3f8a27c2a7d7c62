"""The process's C heap: the memory the closed form has freed, given back to the system.

torch takes a tensor's memory from the C library's allocator. glibc's keeps the pages of freed
blocks that lie below its heap's top resident (the holes between blocks still in use are only
returned when the heap's top is), so a computation that allocates and frees many tensors of a
few MB holds, after it, the high-water mark of its work space and of the holes between. A
model's Hessian frees its passes' work space before the result's last pages are first written
(the lower triangle's mirror, :meth:`blockhess.result.BlockSum.result`): without a trim in between
the process's peak holds both (docs/results.md, "Whole models"). glibc's ``malloc_trim(0)``
returns every whole free page of the heap to the system and leaves what is in use as it is.
"""

from __future__ import annotations

import ctypes
import functools
import sys

__all__ = ["release_free"]


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim`` (``int malloc_trim(size_t pad)``), or ``None`` where the C library has none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_free() -> bool:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim(0)``); returns whether
    this C library can (``False`` elsewhere: a no-op). Touches no memory in use: every tensor is as
    it was. Its cost is a walk over the heap's free blocks (well under a millisecond to a few)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
