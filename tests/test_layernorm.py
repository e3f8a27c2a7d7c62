"""LayerNorm Jacobian (Theorem 2) and Hessian (Theorem 3) w.r.t. the input, against torch.func."""

import pytest
import torch
import torch.nn.functional as Fn

import blockhess as bh
from blockhess.components import layernorm

from conftest import EPS64, assert_close, fro, rounding

CASES = [(1, 4, 0.0, False), (3, 4, 0.0, False), (5, 7, 1e-3, False), (4, 5, 1e-5, True), (2, 3, 0.0, True)]


def _inputs(L, d, affine, scale=1.0):
    g = torch.Generator().manual_seed(L * 10 + d)
    X = scale * torch.randn(L, d, generator=g, dtype=torch.float64)
    gamma = (1 + 0.5 * torch.randn(d, generator=g, dtype=torch.float64)) if affine else None
    return X, gamma


def _ln(X, eps, gamma):
    return Fn.layer_norm(X, X.shape[-1:], weight=gamma, eps=eps)


@pytest.mark.parametrize("L, d, eps, affine", CASES)
@pytest.mark.parametrize("scale", [1e-2, 1.0, 10.0])
def test_jacobian_and_hessian_against_autograd(L, d, eps, affine, scale):
    X, gamma = _inputs(L, d, affine, scale)
    J_ref = torch.func.jacrev(_ln)(X, eps, gamma).reshape(L * d, L * d)
    H_ref = torch.func.jacfwd(torch.func.jacrev(_ln))(X, eps, gamma).reshape((L * d) ** 2, L * d)
    assert_close(bh.layernorm.jacobian(X, eps, gamma), J_ref, what="J dense")
    assert_close(bh.layernorm.hessian(X, eps, gamma), H_ref, what="H dense")


@pytest.mark.parametrize("L, d, eps, affine", CASES)
def test_dense_layout_equals_compact(L, d, eps, affine):
    X, gamma = _inputs(L, d, affine)
    Jc = bh.layernorm.jacobian(X, eps, gamma, compact=True)
    Hc = bh.layernorm.hessian(X, eps, gamma, compact=True)
    Jd = bh.layernorm.jacobian(X, eps, gamma).reshape(L, d, L, d)
    Hd = bh.layernorm.hessian(X, eps, gamma).reshape(L, d, L, d, L, d)
    for t in range(L):
        assert torch.equal(Jd[t, :, t, :], Jc[t])
        assert torch.equal(Hd[t, :, t, :, t, :], Hc[t])
    mask = torch.eye(L, dtype=torch.bool)
    assert torch.count_nonzero(Jd.permute(0, 2, 1, 3)[~mask]) == 0  # block-diagonal over tokens


def test_batch_dims_and_all_ones_direction():
    X = torch.randn(2, 3, 5, dtype=torch.float64)
    J = bh.layernorm.jacobian(X, compact=True)
    assert J.shape == (2, 3, 5, 5)
    ones = torch.ones(5, dtype=torch.float64)
    # shifting a token's entries together changes nothing: zero to the rounding of a sum of 5 terms (n ε Σ|terms|)
    assert bool(((J @ ones).abs() <= 5 * EPS64 * J.abs().sum(-1)).all())
    assert bh.layernorm.jacobian(X).shape == (2, 15, 15)
    H = bh.layernorm.hessian(X, compact=True)
    for other in (H.transpose(-1, -2), H.transpose(-3, -2)):  # symmetric in its two input indices, to rounding
        assert fro(H - other) <= rounding(H) * fro(H)


def test_contracted_hessian():
    X, G = torch.randn(2, 4, 6, dtype=torch.float64)
    gamma = torch.rand(6, dtype=torch.float64) + 0.5
    H = layernorm.hessian(X, 1e-4, gamma, compact=True)
    ref = torch.einsum("ta,tabc->tbc", G, H)
    assert_close(layernorm.contract_hessian(X, G, 1e-4, gamma), ref, what="Gamma")


def test_errors():
    X = torch.randn(3, 4, dtype=torch.float64)
    X[1] = 2.0
    with pytest.raises(ValueError, match="zero variance"):
        bh.layernorm.jacobian(X)
    bh.layernorm.jacobian(X, eps=1e-5)  # eps > 0 is fine
    X[1] = torch.tensor([1.0, 1.0, 1.0, 1.0 + 2**-52], dtype=torch.float64)  # one rounding step: constant to the dtype
    with pytest.raises(ValueError, match=r"row \(1,\) has zero variance"):
        bh.layernorm.jacobian(X)
    X[1, 3] = 1.0 + 2**-20  # small but real spread: well defined
    assert torch.isfinite(bh.layernorm.jacobian(X)).all()
    with pytest.raises(ValueError, match=r"row \(0,\) overflows torch.float32"):
        bh.layernorm.jacobian(torch.tensor([[3e19, -3e19, 1.0]]), eps=1e-5)  # finite entries, variance inf
    big = 1e155 * (1 + 1e-3 * torch.tensor([[0.3, -1.2, 0.7, 0.2]], dtype=torch.float64))  # mean^2 overflows, the spread is real
    assert_close(bh.layernorm.jacobian(big), bh.layernorm.jacobian(big / 1e150) / 1e150, what="rows at 1e155")  # J(cX) = J(X)/c
    with pytest.raises(ValueError, match="NaN"):
        bh.layernorm.hessian(torch.full((2, 3), float("nan"), dtype=torch.float64))
    with pytest.raises(ValueError, match=r"L >= 1 and d >= 1 for the dense layout, got \(0, 4\)"):
        bh.layernorm.jacobian(torch.zeros(0, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="eps must be a finite float >= 0, got True"):
        bh.layernorm.jacobian(X, eps=True)
    with pytest.raises(ValueError, match="gamma must have shape"):
        bh.layernorm.jacobian(torch.randn(2, 4), gamma=torch.ones(3))
    with pytest.raises(ValueError, match="eps"):
        bh.layernorm.jacobian(torch.randn(2, 4), eps=-1.0)
    with pytest.raises(ValueError, match="floating"):
        bh.layernorm.jacobian(torch.ones(2, 4, dtype=torch.int64))


def test_dense_too_large_is_refused_before_allocating():
    X = torch.randn(2000, 64, dtype=torch.float64)  # dense Hessian: (128000^2 x 128000) doubles
    with pytest.raises(bh.InsufficientMemoryError, match="bytes"):
        bh.layernorm.hessian(X)
    with pytest.raises(MemoryError):
        bh.layernorm.hessian(X)


def test_shared_centering_matrix_is_a_plain_tensor():
    """C = I - 11^T/d is built once per (d, dtype, device); built first under inference mode, it must
    still serve a later call that autograd records (an inference tensor cannot be saved for backward)."""
    layernorm._centering_cached.cache_clear()
    with torch.inference_mode():
        layernorm.hessian(torch.randn(2, 5, dtype=torch.float64), compact=True)
    X = torch.randn(2, 5, dtype=torch.float64, requires_grad=True)
    layernorm.hessian(X, compact=True).sum().backward()
    assert X.grad is not None and torch.isfinite(X.grad).all()
