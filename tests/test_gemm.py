"""blockhess.gemm: the token rows' products by a weight, on oneDNN for float32 on the CPU and on torch's
own GEMM elsewhere: values against float64 for operands in every layout the passes give them (contiguous,
transposed views, column slices), float32 judged by torch's own float32 product; when oneDNN is used and
when not; autograd through the fallback; the fallback's rows on cache lines."""

from __future__ import annotations

import pytest
import torch

from blockhess import gemm, heap
from conftest import assert_close, assert_float32_close

ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _operand(shape, layout, gen, dtype):
    """A tensor of ``shape`` and ``dtype`` laid out as ``layout``: contiguous, the transpose of a
    contiguous tensor, or the leading columns of a wider one."""
    r, c = shape
    if layout == "contiguous":
        return torch.randn(r, c, generator=gen, dtype=torch.float64).to(dtype)
    if layout == "transposed":
        return torch.randn(c, r, generator=gen, dtype=torch.float64).to(dtype).T
    return torch.randn(r, c + 5, generator=gen, dtype=torch.float64).to(dtype)[:, :c]


def _judge(got, dtype, want64, torch32, what):
    assert got.dtype == dtype and got.shape == want64.shape, what
    if dtype == torch.float64:
        assert_close(got, want64, what=what)
    else:
        assert_float32_close(got, torch32, want64, what=what)


SHAPES = [(1, 1, 1), (5, 8, 13), (32, 17, 64), (128, 96, 257), (3, 300, 7)]
LAYOUTS = ["contiguous", "transposed", "sliced"]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("m, p, q", SHAPES)
@pytest.mark.parametrize("a_layout", LAYOUTS)
@pytest.mark.parametrize("b_layout", LAYOUTS)
def test_mm_and_addmm_values(dtype, m, p, q, a_layout, b_layout):
    gen = torch.Generator().manual_seed(m * 1000 + p * 10 + q)
    a, b = _operand((m, p), a_layout, gen, dtype), _operand((p, q), b_layout, gen, dtype)
    c = torch.randn(m, q, generator=gen, dtype=torch.float64).to(dtype)
    want = a.double() @ b.double()
    _judge(gemm.mm(a, b), dtype, want, a @ b, f"mm {a_layout} @ {b_layout}")
    got = gemm.addmm(c.clone(), a, b)
    _judge(got, dtype, c.double() + want, c + a @ b, f"addmm {a_layout} @ {b_layout}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("with_c", [False, True])
@pytest.mark.parametrize("transposed", [False, True])
def test_mm_each_values(dtype, k, with_c, transposed):
    gen = torch.Generator().manual_seed(7 * k + 2 * with_c + transposed)
    m, p, q = 24, 40, 51
    a = torch.randn(m, p, generator=gen, dtype=torch.float64).to(dtype)
    B = torch.randn(k, p, q, generator=gen, dtype=torch.float64).to(dtype)
    if transposed:  # a direction's weight read as Ẇᵀ, as the passes read it
        B = torch.randn(k, q, p, generator=gen, dtype=torch.float64).to(dtype).mT
    c = torch.randn(k, m, q, generator=gen, dtype=torch.float64).to(dtype) if with_c else None
    want = a.double() @ B.double() + (0 if c is None else c.double())
    torch32 = a @ B + (0 if c is None else c)
    c_in = None if c is None else c.clone()
    got = gemm.mm_each(a, B, c_in)
    _judge(got, dtype, want, torch32, f"mm_each k={k}")
    if c is not None and k > 1:  # several directions' sums written into the caller's c
        assert got.data_ptr() == c_in.data_ptr()


def test_onednn_used_for_float32_on_the_cpu_only():
    a32, b32 = torch.randn(4, 3), torch.randn(3, 5)
    assert gemm.onednn(a32, b32) == ONEDNN
    assert not gemm.onednn(a32.double(), b32.double())
    assert not gemm.onednn(a32, b32.double())
    assert not gemm.onednn(torch.randn(0, 3), b32)
    tracked = b32.clone().requires_grad_()
    assert not gemm.onednn(a32, tracked)
    with torch.no_grad():
        assert gemm.onednn(a32, tracked) == ONEDNN


@pytest.mark.skipif(not ONEDNN, reason="torch built without oneDNN")
def test_reduced_precision_setting_turns_onednn_off():
    """A user's ``torch.backends.mkldnn.matmul.fp32_precision = "bf16"`` would round float32 products to
    bfloat16 inside oneDNN: the products then leave it, and stay float32-exact."""
    matmul = torch.backends.mkldnn.matmul
    before = matmul.fp32_precision
    a, b = torch.randn(64, 96), torch.randn(96, 80)
    try:
        matmul.fp32_precision = "bf16"
        assert not gemm.onednn(a, b)
        want = a.double() @ b.double()
        assert_float32_close(gemm.mm(a, b), a @ b, want, what="mm with bf16 set")
    finally:
        matmul.fp32_precision = before
    assert gemm.onednn(a, b)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_tracked_operands_differentiate(dtype):
    """A tracked operand goes to torch's products, so its gradient is autograd's (oneDNN's op has none)."""
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(6, 5, generator=gen, dtype=dtype)
    b = torch.randn(5, 7, generator=gen, dtype=dtype, requires_grad=True)
    B = torch.randn(2, 5, 7, generator=gen, dtype=dtype, requires_grad=True)
    c = torch.randn(6, 7, generator=gen, dtype=dtype)
    w = torch.randn(6, 7, generator=gen, dtype=dtype)
    y = (gemm.mm(a, b) * w).sum() + (gemm.addmm(c.clone(), a, b) * w).sum() + (gemm.mm_each(a, B) * w).sum()
    gb, gB = torch.autograd.grad(y, [b, B])
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(gb, 2 * a.T @ w, rtol=tol, atol=tol)
    torch.testing.assert_close(gB, (a.T @ w).expand(2, -1, -1), rtol=tol, atol=tol)


def test_fallback_rows_on_cache_lines_and_addmm_in_place():
    """Where torch's GEMM writes the rows (float64 here), a row of an odd length starts on a cache line,
    and ``addmm`` adds into the caller's ``c``."""
    a, b = torch.randn(9, 4, dtype=torch.float64), torch.randn(4, 13, dtype=torch.float64)
    out = gemm.mm(a, b)
    assert out.stride(1) == 1 and (out.stride(0) * out.element_size()) % heap.ROW_ALIGN_BYTES == 0
    each = gemm.mm_each(a, b.expand(2, -1, -1))
    assert each.stride(2) == 1 and (each.stride(1) * each.element_size()) % heap.ROW_ALIGN_BYTES == 0
    c = torch.randn(9, 13, dtype=torch.float64)
    assert gemm.addmm(c, a, b).data_ptr() == c.data_ptr()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_forward_mode_and_torch_func_differentiate(dtype):
    """Forward-mode tangents (``forward_ad`` duals, ``torch.func.jvp``) and ``vmap`` go to torch's products,
    so the tangent is carried (oneDNN's op would drop it), and the primal is the product."""
    from torch.autograd import forward_ad

    gen = torch.Generator().manual_seed(11)
    a = torch.randn(6, 5, generator=gen, dtype=dtype)
    b, t = torch.randn(5, 7, generator=gen, dtype=dtype), torch.randn(5, 7, generator=gen, dtype=dtype)
    c = torch.randn(6, 7, generator=gen, dtype=dtype)
    B, TB = torch.randn(3, 5, 7, generator=gen, dtype=dtype), torch.randn(3, 5, 7, generator=gen, dtype=dtype)
    tol = 1e-12 if dtype == torch.float64 else 1e-5

    def check(f, primal, tangent, want_primal, want_tangent):
        out, jv = torch.func.jvp(f, (primal,), (tangent,))
        torch.testing.assert_close(out, want_primal, rtol=tol, atol=tol)
        torch.testing.assert_close(jv, want_tangent, rtol=tol, atol=tol)

    check(lambda w: gemm.mm(a, w), b, t, a @ b, a @ t)
    check(lambda w: gemm.addmm(c.clone(), a, w), b, t, c + a @ b, a @ t)
    check(lambda W: gemm.mm_each(a, W), B, TB, a @ B, a @ TB)
    with forward_ad.dual_level():
        y = gemm.mm(a, forward_ad.make_dual(b, t))
        torch.testing.assert_close(forward_ad.unpack_dual(y).tangent, a @ t, rtol=tol, atol=tol)
    got = torch.func.vmap(lambda w: gemm.mm(a, w))(B)
    torch.testing.assert_close(got, a @ B, rtol=tol, atol=tol)


@pytest.mark.skipif(not ONEDNN, reason="torch built without oneDNN")
def test_disabled_onednn_is_not_used():
    a, b = torch.randn(8, 4), torch.randn(4, 6)
    torch.backends.mkldnn.enabled = False
    try:
        assert not gemm.onednn(a, b)
        assert_float32_close(gemm.mm(a, b), a @ b, a.double() @ b.double(), what="mm with oneDNN disabled")
    finally:
        torch.backends.mkldnn.enabled = True
    assert gemm.onednn(a, b)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("layout", ["expanded", "transposed"])
def test_mm_each_into_a_c_not_contiguous_is_torchs(dtype, layout):
    """A ``c`` that is not contiguous (directions sharing memory, or rows transposed) is summed into as
    torch's ``baddbmm_`` sums into it, never slice by slice behind its back."""
    gen = torch.Generator().manual_seed(2)
    a, B = torch.randn(4, 3, generator=gen, dtype=dtype), torch.randn(2, 3, 5, generator=gen, dtype=dtype)

    def make():
        g = torch.Generator().manual_seed(9)
        if layout == "expanded":
            return torch.randn(1, 4, 5, generator=g, dtype=dtype).expand(2, -1, -1)
        return torch.randn(2, 5, 4, generator=g, dtype=dtype).mT

    want = make().clone() if layout == "transposed" else None
    got = gemm.mm_each(a, B, make())
    torch_own = make().baddbmm_(a.expand(2, -1, -1), B)
    assert torch.equal(got, torch_own)
    if want is not None:
        assert_close(got.double(), want.double() + a.double() @ B.double(), tol=1e-5 if dtype == torch.float32 else 1e-12,
                     what="mm_each into a transposed c")
