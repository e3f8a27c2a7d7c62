"""The process's C heap: the memory the closed form has freed, given back to the system.

torch takes a tensor's memory from the C library's allocator. glibc's keeps the pages of freed
blocks that lie below its heap's top resident (the holes between blocks still in use are only
returned when the heap's top is), so a computation that allocates and frees many tensors of a
few MB holds, after it, the high-water mark of its work space and of the holes between. A
model's Hessian frees its passes' work space before the result's last pages are first written
(the lower triangle's mirror, :meth:`blockhess.result.BlockSum.result`): without a trim in between
the process's peak holds both (docs/results.md, "Whole models"). glibc's ``malloc_trim(0)``
returns every whole free page of the heap to the system and leaves what is in use as it is.

:func:`aligned_rows` lays a GEMM's result out with each row starting on a cache line: a row of an
odd length (GPT-2's 50,257 logits) makes the CPU's float32 GEMM write unaligned vectors.

The other way round, :class:`OutputPool`: an operator's product returns a fresh ``n``-vector each
time, and one above glibc's mmap threshold is a fresh mapping whose pages the
kernel supplies and zeroes on first write. The pool gives a product the memory of the last output
its caller dropped instead.
"""

from __future__ import annotations

import ctypes
import functools
import sys
import threading
import weakref

import numpy as np
import torch

__all__ = ["OutputPool", "POOL_MIN_BYTES", "ROW_ALIGN_BYTES", "aligned_rows", "release_free"]

POOL_MIN_BYTES = 32 << 20  # smaller outputs come from glibc's heap, whose freed pages are reused already
ROW_ALIGN_BYTES = 64  # a cache line; the rows of :func:`aligned_rows` start at multiples of it
_NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64}


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


def aligned_rows(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor of ``shape`` (dtype and device of ``like``) whose rows along the last
    dimension start a whole number of :data:`ROW_ALIGN_BYTES` apart (``shape[-1]`` elements rounded up
    to that), so on cache lines, as torch's CPU allocator aligns a tensor's first row to 64 bytes. It
    is contiguous where ``shape[-1]`` elements fill whole lines, else the first ``shape[-1]`` columns
    of a contiguous tensor with wider rows: every dimension but the last still folds into one (as
    ``view(-1, shape[-1])`` needs), and the extra columns are never written or read. On other devices
    a plain contiguous ``torch.empty`` (the cause is the CPU's GEMM; other devices keep torch's layout).

    For a GEMM's output whose rows have an odd length: the CPU's float32 GEMM (MKL) writes rows that
    start off a vector's alignment markedly slower (docs/results.md, "Aligned logit rows"). Raises
    nothing beyond ``torch.empty``'s."""
    per_line = max(ROW_ALIGN_BYTES // like.element_size(), 1)
    n = shape[-1]
    wide = -(-n // per_line) * per_line if like.device.type == "cpu" else n
    buf = torch.empty(*shape[:-1], wide, dtype=like.dtype, device=like.device)
    return buf if wide == n else buf[..., :n]


class OutputPool:
    """Memory for an operator's one-vector outputs, recycled once the caller has dropped them.

    :meth:`empty` returns an uninitialised CPU tensor ``(n,)`` as ``torch.empty`` would, for a caller
    that writes every entry (an operator's product writes every row). Where ``n`` entries of a
    float32/float64 dtype take at least :data:`POOL_MIN_BYTES`, the memory is that of the last output of
    the same size and dtype whose storage was freed (every tensor, view, NumPy array and DLPack capsule of
    it gone), if any: its pages are already the process's, so the product writes them without a page fault
    each (docs/results.md, "A pooled output"). An output still referenced anywhere is never handed out
    again. Such an output's storage cannot be resized (``resize_`` to another size raises).

    The pool keeps at most one dropped output's memory, and only until the next request: :meth:`empty` takes
    it and either hands it out (same size and dtype) or lets it go before allocating; :meth:`clear` lets it go
    at once (an operator calls it before products that take no output from the pool). Other devices, dtypes
    and smaller sizes get a plain ``torch.empty``. Thread-safe: an output may be dropped on any thread. A
    deep copy of a pool is an empty pool."""

    def __init__(self):
        self._free = None  # a NumPy array: the memory of the last dropped output
        self._lock = threading.RLock()

    def empty(self, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised ``(n,)`` tensor of ``dtype`` on ``device`` (see the class docstring)."""
        with self._lock:
            mem, self._free = self._free, None
        np_dtype = _NUMPY_DTYPES.get(dtype)
        if torch.device(device).type != "cpu" or np_dtype is None or n * np.dtype(np_dtype).itemsize < POOL_MIN_BYTES:
            return torch.empty(n, dtype=dtype, device=device)
        if mem is None or mem.shape != (n,) or mem.dtype != np_dtype:
            mem = None  # let the other size go before the allocation
            mem = torch.empty(n, dtype=dtype, device="cpu").numpy()  # torch's allocation (NumPy's asks for huge pages)
        handle = mem.view()  # the tensor's storage holds this object alone: it dies with the last view
        weakref.finalize(handle, self._give_back, mem).atexit = False
        return torch.from_numpy(handle)

    def _give_back(self, mem: np.ndarray) -> None:
        with self._lock:
            self._free = mem

    def clear(self) -> None:
        """Let go of the kept memory (the system gets it back once nothing else holds it)."""
        with self._lock:
            self._free = None

    def __deepcopy__(self, memo) -> "OutputPool":
        return OutputPool()
