"""Conventions of paper §1.1: vec_r, commutation matrices, Kronecker rules P1, P4, P10."""

import torch

from blockhess.vec import commutation, kron_jacobians, unvec_r, vec, vec_r

from conftest import assert_close


def test_vec_r_stacks_rows_and_inverts():
    A = torch.arange(6.0).reshape(2, 3)
    assert vec_r(A).tolist() == [0, 1, 2, 3, 4, 5]
    assert vec(A).tolist() == [0, 3, 1, 4, 2, 5]
    assert torch.equal(unvec_r(vec_r(A), 2, 3), A)


def test_commutation_definition_and_inverse():
    A = torch.randn(3, 5, dtype=torch.float64)
    K = commutation(3, 5)
    assert torch.equal(K @ vec(A), vec(A.T))
    assert torch.equal(K @ vec(A), vec_r(A))
    assert torch.equal(commutation(5, 3) @ K, torch.eye(15, dtype=torch.float64))


def test_P1_vec_r_of_product():
    A, X, B = (torch.randn(s, dtype=torch.float64) for s in [(2, 3), (3, 4), (4, 5)])
    assert_close(vec_r(A @ X @ B), torch.kron(A, B.T.contiguous()) @ vec_r(X), what="P1")
    J = torch.func.jacrev(lambda x: vec_r(A @ x @ B))(X).reshape(10, 12)
    assert_close(J, torch.kron(A, B.T.contiguous()), what="dAXB/dX")


def test_P10_transpose_derivative():
    A = torch.randn(3, 4, dtype=torch.float64)
    J = torch.func.jacrev(lambda a: vec_r(a.T))(A).reshape(12, 12)
    assert torch.equal(J, commutation(4, 3))


def test_P4_kronecker_derivatives():
    X, Y = torch.randn(2, 3, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    dX, dY = kron_jacobians(X, Y)
    ref = torch.func.jacrev(lambda x, y: vec_r(torch.kron(x, y)), argnums=(0, 1))(X, Y)
    assert_close(dX, ref[0].reshape(-1, 6), what="P4 dX")
    assert_close(dY, ref[1].reshape(-1, 8), what="P4 dY")
