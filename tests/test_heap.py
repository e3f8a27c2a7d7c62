"""blockhess.heap: the C heap's free pages given back to the system, nothing in use touched."""

import platform
import subprocess
import sys

import pytest
import torch

from blockhess import heap
from conftest import assert_close, assert_float32_close

GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


def _rss_anon() -> int:
    """Resident anonymous memory of this process, bytes (``/proc/self/status``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def test_release_free_reports_whether_the_c_library_can():
    assert heap.release_free() is GLIBC


_HOLES = """
import ctypes, sys, threading
from blockhess import heap


def rss_anon():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024


libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
size, count = 64 << 10, 400
pins = []


def fragment():
    big = []
    for _ in range(count):
        p = libc.malloc(size)
        ctypes.memset(p, 1, size)  # touched: resident
        big.append(p)
        pins.append(libc.malloc(64))
    for p in big:
        libc.free(p)


t = threading.Thread(target=fragment)
t.start()
t.join()
before = rss_anon()
assert heap.release_free()
print(before - rss_anon(), count * size)
"""


@pytest.mark.skipif(not GLIBC, reason="malloc_trim is glibc's")
def test_the_holes_between_blocks_in_use_go_back():
    """400 blocks of 64 KiB (below glibc's mmap threshold: on a heap), each followed by a small one
    kept, allocated in a thread of their own (a fresh arena: the small ones lie between the large
    ones): freeing the large ones leaves 25 MiB of holes that free() keeps resident; the trim
    returns them. In a fresh interpreter: in a long test process the thread may be handed an arena
    other threads (torch's, the lock-step estimators') left behind, whose layout the test cannot know."""
    r = subprocess.run([sys.executable, "-c", _HOLES], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    freed, total = map(int, r.stdout.split())
    assert freed >= total // 2, (freed, total)


def test_tensors_in_use_are_unchanged():
    x = torch.randn(512, 512, dtype=torch.float64)
    y = x.clone()
    parts = [torch.randn(4096) for _ in range(64)]
    del parts
    heap.release_free()
    assert torch.equal(x, y)


def test_pool_recycles_only_what_the_caller_dropped(monkeypatch):
    """An output's memory goes back to the pool when its storage is freed (not while the tensor or any view
    of it lives), and only to an output of the same size and dtype; other devices' and smaller outputs are
    plain ``torch.empty``; :meth:`clear` lets go of what it keeps."""
    monkeypatch.setattr(heap, "POOL_MIN_BYTES", 800)
    pool = heap.OutputPool()
    a = pool.empty(100, torch.float64, torch.device("cpu"))
    assert a.shape == (100,) and a.dtype == torch.float64 and a.is_contiguous()
    ptr = a.data_ptr()
    part = a[10:20]
    del a
    b = pool.empty(100, torch.float64, torch.device("cpu"))
    assert b.data_ptr() != ptr  # a view of the first output still lives
    part.fill_(7.0)
    del part
    c = pool.empty(100, torch.float64, torch.device("cpu"))
    assert c.data_ptr() == ptr  # the first output's memory, now that nothing holds it
    assert b.data_ptr() != c.data_ptr()
    del c
    assert pool._free is not None
    monkeypatch.setattr(heap, "POOL_MIN_BYTES", 400)
    f = pool.empty(100, torch.float32, torch.device("cpu"))  # the same size, another dtype: fresh
    assert f.dtype == torch.float32
    monkeypatch.setattr(heap, "POOL_MIN_BYTES", 800)
    pool.clear()
    assert pool._free is None
    e = pool.empty(100, torch.float64, torch.device("cpu"))
    del e
    assert pool._free is not None
    pool.empty(10, torch.float64, torch.device("cpu"))  # a request the kept memory does not fit lets it go
    assert pool._free is None
    for n, dtype in ((99, torch.float64), (1000, torch.float16), (1000, torch.int64)):  # below the threshold;
        t = pool.empty(n, dtype, torch.device("cpu"))  # no NumPy twin: torch.empty, never kept
        assert t.dtype == dtype and t.shape == (n,)
        del t
        assert pool._free is None


def test_pool_takes_outputs_dropped_on_another_thread(monkeypatch):
    import threading

    monkeypatch.setattr(heap, "POOL_MIN_BYTES", 0)
    pool = heap.OutputPool()
    box = [pool.empty(64, torch.float32, torch.device("cpu"))]
    ptr = box[0].data_ptr()
    t = threading.Thread(target=box.clear)
    t.start()
    t.join()
    assert pool.empty(64, torch.float32, torch.device("cpu")).data_ptr() == ptr


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(3, 50257), (2, 5, 17), (4, 16), (1, 1), (2, 0, 9), (7,)])
def test_aligned_rows_start_on_cache_lines_and_fold(shape, dtype):
    like = torch.zeros((), dtype=dtype)
    t = heap.aligned_rows(shape, like)
    n = shape[-1]
    assert t.shape == shape and t.dtype == dtype and t.device == like.device
    assert t.stride(-1) == 1
    if len(shape) > 1:
        row = t.stride(-2)
        assert row >= n and (row * t.element_size()) % heap.ROW_ALIGN_BYTES == 0
        assert row - n < heap.ROW_ALIGN_BYTES // t.element_size()  # the least such width
        if t.numel() > n:  # more than one row (a single row is contiguous whatever its stride)
            assert t.is_contiguous() == (row == n)
    flat = t.view(-1, n)  # every dimension but the last folds into one
    flat.copy_(torch.arange(flat.numel(), dtype=dtype).reshape(flat.shape))
    assert torch.equal(t.reshape(-1), torch.arange(t.numel(), dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_aligned_rows_as_a_gemm_output(dtype):
    """A GEMM writes into the padded rows in place (its storage, the wider rows kept) with the product's values
    (float32 judged by the same product into a contiguous result)."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(6, 8, generator=gen, dtype=dtype), torch.randn(8, 50257, generator=gen, dtype=dtype)
    out = heap.aligned_rows((2, 3, 50257), a)
    storage = out.untyped_storage().data_ptr()
    torch.mm(a, b, out=out.view(6, 50257))
    assert out.untyped_storage().data_ptr() == storage and not out.is_contiguous()
    want = a.double() @ b.double()
    if dtype == torch.float64:
        assert_close(out.reshape(6, 50257), want, what="a GEMM into aligned rows")
    else:
        assert_float32_close(out.reshape(6, 50257), a @ b, want, what="a float32 GEMM into aligned rows")
