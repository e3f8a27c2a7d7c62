"""Row-wise softmax derivatives (paper §2.1) against torch.func."""

import pytest
import torch

from blockhess.components import softmax

from conftest import assert_close


@pytest.mark.parametrize("L, Lp", [(1, 1), (3, 4), (4, 4)])
def test_jacobian_and_hessian(L, Lp):
    T = torch.randn(L, Lp, dtype=torch.float64)
    A = torch.softmax(T, -1)
    f = lambda t: torch.softmax(t, -1)  # noqa: E731
    J = torch.func.jacrev(f)(T).reshape(L * Lp, L * Lp)
    H = torch.func.jacfwd(torch.func.jacrev(f))(T)  # (L, Lp, L, Lp, L, Lp)
    assert_close(softmax.jacobian(A, compact=False), J, scale=1.0, what="dA/dT")
    assert_close(softmax.hessian(A, compact=False), H.reshape(L * Lp * L * Lp, L * Lp), scale=1.0, what="d2A/dT2")
    rows = torch.arange(L)
    assert_close(softmax.hessian(A), H[rows, :, rows, :, rows, :], scale=1.0, what="compact")


def test_contracted_hessian():
    T, B = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    A = torch.softmax(T, -1)
    H = softmax.hessian(A)  # (L, j, k, l)
    ref = torch.einsum("...ij,...ijkl->...ikl", B, H)
    assert_close(softmax.contract_hessian(A, B), ref, what="Psi")
    assert torch.equal(softmax.contract_hessian(A, B), softmax.contract_hessian(A, B).transpose(-1, -2))
