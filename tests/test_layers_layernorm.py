"""LayerNorm Jacobian (Theorem 2) and Hessian (Theorem 3) w.r.t. the input, against torch.func."""

import pytest
import torch
import torch.nn.functional as Fn

import blockhess as bh
from blockhess.layers import layernorm

from conftest import EPS64, TOL, assert_close, fro, rel_err, rounding
from settings import DTYPES, LAYERNORM_CASES, LAYERNORM_SCALES, LAYERNORM_TINY_EPS


def _inputs(L, d, affine, scale=1.0):
    g = torch.Generator().manual_seed(L * 10 + d)
    X = scale * torch.randn(L, d, generator=g, dtype=torch.float64)
    gamma = (1 + 0.5 * torch.randn(d, generator=g, dtype=torch.float64)) if affine else None
    return X, gamma


def _ln(X, eps, gamma):
    return Fn.layer_norm(X, X.shape[-1:], weight=gamma, eps=eps)


@pytest.mark.parametrize("L, d, eps, affine", LAYERNORM_CASES)
@pytest.mark.parametrize("scale", LAYERNORM_SCALES)
def test_jacobian_and_hessian_against_autograd(L, d, eps, affine, scale):
    X, gamma = _inputs(L, d, affine, scale)
    J_ref = torch.func.jacrev(_ln)(X, eps, gamma).reshape(L * d, L * d)
    H_ref = torch.func.jacfwd(torch.func.jacrev(_ln))(X, eps, gamma).reshape((L * d) ** 2, L * d)
    assert_close(bh.layernorm.jacobian(X, eps, gamma), J_ref, what="J dense")
    assert_close(bh.layernorm.hessian(X, eps, gamma), H_ref, what="H dense")


@pytest.mark.parametrize("L, d, eps, affine", LAYERNORM_CASES)
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
    X = torch.randn(2, 3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(49))
    J = bh.layernorm.jacobian(X, compact=True)
    assert J.shape == (2, 3, 5, 5)
    ones = torch.ones(5, dtype=torch.float64)
    # shifting a token's entries together changes nothing: zero to n ε times the magnitudes of Theorem 2's terms
    # before they cancel, Σ_b (δ_ab + 1/d + |x̂_a x̂_b|/d)/σ (an entry's own size can be far below its terms')
    mu = X.mean(-1, keepdim=True)
    sigma = (X - mu).pow(2).mean(-1, keepdim=True).sqrt()
    xh = (X - mu) / sigma
    terms = (torch.eye(5, dtype=X.dtype) + 1 / 5 + (xh[..., :, None] * xh[..., None, :]).abs() / 5) / sigma[..., None]
    assert bool(((J @ ones).abs() <= 5 * EPS64 * terms.sum(-1)).all())
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
    with pytest.raises(ValueError, match="must be float32 or float64"):
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


def _functions(X, eps, gamma=None):
    G = torch.ones_like(X)
    return {"forward": lambda: layernorm.forward(X, eps, gamma), "jacobian": lambda: layernorm.jacobian(X, eps, gamma),
            "hessian": lambda: layernorm.hessian(X, eps, gamma),
            "contract_hessian": lambda: layernorm.contract_hessian(X, G, eps, gamma)}


def _assert_right(X, eps, hessian_eps=None):
    """Jacobian and Hessian against torch.func in float64 (the Hessian's taken at ``hessian_eps`` where
    autograd's own 1/sigma^3 overflows): float64 to the rule, float32 within 3x of float32 torch.func's error."""
    for f, ref, ref_eps in ((layernorm.jacobian, torch.func.jacrev(_ln), eps),
                            (layernorm.hessian, torch.func.jacfwd(torch.func.jacrev(_ln)), hessian_eps or eps)):
        got = f(X, eps).double()
        R, R32 = (ref(x, ref_eps, None).reshape(got.shape).double() for x in (X.double(), X))
        R, R32, got = (M / R.abs().max() for M in (R, R32, got))  # entries of 1/eps: squares would overflow the norm
        own = rel_err(R32, R) if torch.isfinite(R32).all() else 0.0
        assert_close(got, R, tol=TOL if X.dtype == torch.float64 else 3 * max(own, torch.finfo(torch.float32).eps),
                     what=f.__name__)  # float32: 3x torch.func, or 3 roundings where torch.func's error is below one


@pytest.mark.parametrize("dtype, eps", LAYERNORM_TINY_EPS)
def test_tiny_eps_on_a_constant_row(dtype, eps):
    """A row constant at 0.7 is refused (its centred entries are rounding, times 1/sigma = eps^-1/2); a row
    of zeros is exact, refused only where var + eps is below tiny/e (float64 1e-300), else right."""
    X = torch.randn(3, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64).to(dtype)
    X[1] = 0.7
    for name, f in _functions(X, eps).items():
        with pytest.raises(ValueError, match=r"X: LayerNorm input row \(1,\) is constant to the rounding of its values"):
            f()
    X[1] = 0.0
    if eps == 1e-300:
        for name, f in _functions(X, eps).items():
            with pytest.raises(ValueError, match=r"the variance of LayerNorm input row \(1,\) plus ln_eps is 1e-300, below"):
                f()
        return
    for name, f in _functions(X, eps).items():
        assert torch.isfinite(f()).all(), name
    _assert_right(X, eps)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("c", [1.0, 0.0])
def test_eps_just_either_side_of_the_threshold(dtype, c):
    """var + eps must stand above tiny/e plus the squared rounding of the row's values (e^2 c^2 for a row
    constant at c): 0.9 of that is refused by every function, 1.1 gives finite, right results."""
    fi = torch.finfo(dtype)
    threshold = fi.tiny / fi.eps + fi.eps**2 * c * c
    X = torch.randn(3, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64).to(dtype)
    X[1] = c
    for name, f in _functions(X, 0.9 * threshold).items():
        with pytest.raises(ValueError, match=r"LayerNorm input row \(1,\) (is constant to the rounding|plus ln_eps is)"):
            f()
    for name, f in _functions(X, 1.1 * threshold).items():
        assert torch.isfinite(f()).all(), name
    # the zero row's Hessian is 0 (y = 0) and the other rows' var dwarfs eps: autograd, whose 1/sigma^3 overflows
    # at this eps, is taken at 1e-20
    _assert_right(X, 1.1 * threshold, hessian_eps=1e-20 if c == 0.0 else None)


def test_large_gamma_overflowing_is_an_error():
    """Finite inputs whose result overflows (gamma 1e306 times 1/sigma^2, about 1e4): a named error, not Inf."""
    X = 1e-2 * torch.randn(3, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    gamma = torch.full((4,), 1e306, dtype=torch.float64)
    with pytest.raises(ValueError, match="the LayerNorm Hessian contains NaN or Inf: a value overflowed torch.float64"):
        layernorm.hessian(X, 0.0, gamma)
    with pytest.raises(ValueError, match="the LayerNorm output contains NaN or Inf"):  # y_0 = sqrt(7) for a one-hot row
        layernorm.forward(torch.eye(8, dtype=torch.float64), 0.0, torch.full((8,), 1e308, dtype=torch.float64))
    assert torch.isfinite(layernorm.hessian(X, 0.0, gamma / 1e6)).all()  # 1e300 times 1/sigma^2 (1e4): representable
