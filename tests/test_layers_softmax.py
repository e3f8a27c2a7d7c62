"""Row-wise softmax derivatives (paper §2.1) against torch.func, single and batched, and their checks."""

import pytest
import torch

from blockhess.layers import softmax

from conftest import assert_close
from settings import SOFTMAX_SHAPES

f = lambda t: torch.softmax(t, -1)  # noqa: E731


@pytest.mark.parametrize("L, Lp", SOFTMAX_SHAPES)
def test_jacobian_and_hessian(L, Lp):
    T = torch.randn(L, Lp, dtype=torch.float64)
    A = torch.softmax(T, -1)
    J = torch.func.jacrev(f)(T).reshape(L * Lp, L * Lp)
    H = torch.func.jacfwd(torch.func.jacrev(f))(T)  # (L, Lp, L, Lp, L, Lp)
    assert_close(softmax.jacobian(A), J, what="dA/dT")
    assert_close(softmax.hessian(A), H.reshape(L * Lp * L * Lp, L * Lp), what="d2A/dT2")
    rows = torch.arange(L)
    assert_close(softmax.jacobian(A, compact=True), J.reshape(L, Lp, L, Lp)[rows, :, rows, :], what="compact J")
    assert_close(softmax.hessian(A, compact=True), H[rows, :, rows, :, rows, :], what="compact H")


def test_batched_dense_is_one_per_sequence():
    T = torch.randn(2, 3, 3, 4, dtype=torch.float64)  # batch (2, 3) of (L, L') = (3, 4)
    A = torch.softmax(T, -1)
    J, H = softmax.jacobian(A), softmax.hessian(A)
    assert J.shape == (2, 3, 12, 12) and H.shape == (2, 3, 144, 12)
    for b in range(2):
        for c in range(3):
            assert torch.equal(J[b, c], softmax.jacobian(A[b, c])) and torch.equal(H[b, c], softmax.hessian(A[b, c]))


def test_contracted_hessian():
    T, B = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    A = torch.softmax(T, -1)
    H = softmax.hessian(A, compact=True)  # (L, j, k, l)
    ref = torch.einsum("...ij,...ijkl->...ikl", B, H)
    assert_close(softmax.contract_hessian(A, B), ref, what="Psi")
    assert torch.equal(softmax.contract_hessian(A, B), softmax.contract_hessian(A, B).transpose(-1, -2))


def test_errors():
    A = torch.softmax(torch.randn(3, 4, dtype=torch.float64), -1)
    with pytest.raises(ValueError, match=r"A must have shape \(\.\.\., L, L'\)"):
        softmax.jacobian(A[0])  # one row: no row axis
    with pytest.raises(ValueError, match="softmax probabilities.*not the scores"):
        softmax.hessian(torch.randn(3, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="A contains NaN"):
        softmax.jacobian(torch.full((2, 2), float("nan"), dtype=torch.float64))
    with pytest.raises(ValueError, match="must be float32 or float64"):
        softmax.jacobian(torch.ones(2, 1, dtype=torch.long))
    with pytest.raises(ValueError, match=r"B must have the shape of A \(3, 4\)"):
        softmax.contract_hessian(A, A[:2])
    with pytest.raises(ValueError, match="B has dtype torch.float32 but A has torch.float64"):
        softmax.contract_hessian(A, A.float())


def test_probability_checks():
    with pytest.raises(ValueError, match="softmax probabilities"):
        softmax.jacobian(torch.tensor([[1.5, -0.5]], dtype=torch.float64))  # sums to 1, one entry negative
    A = torch.softmax(torch.randn(3, 4, dtype=torch.float64), -1)
    with pytest.raises(ValueError, match="softmax probabilities"):
        softmax.jacobian(A * (1 + 1e-11))  # rows off by 1e-11: far above float64 rounding
    long_rows = torch.softmax(10 * torch.randn(2, 4096), -1)  # float32 rows of 4,096 entries sum to 1 only to rounding
    assert softmax.jacobian(long_rows, compact=True).shape == (2, 4096, 4096)
    causal = torch.softmax(torch.randn(3, 3, dtype=torch.float64).masked_fill(torch.ones(3, 3).triu(1).bool(), float("-inf")), -1)
    softmax.hessian(causal)  # exact zeros are probabilities too
