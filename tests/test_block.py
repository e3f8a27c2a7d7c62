"""The post-LN block: forward, Jacobian (Theorem 4), second derivatives (Theorem 5) against torch.func,
and Theorem 4 / eq. 9 recomposed from the dense component derivatives in the paper's layout."""

import math

import pytest
import torch
import torch.nn.functional as Fn

import blockhess as bh

from conftest import assert_blocks_close, assert_close, make_case
from settings import BLOCK_OPTIONS, SECOND_ORDER_SIZE_IDS, SECOND_ORDER_SIZES


@pytest.mark.parametrize("ln_eps", BLOCK_OPTIONS["ln_eps"])
def test_forward_and_jacobian(grid_case, ln_eps):
    L, d, dk, dff, batch, scale = grid_case
    cfg, p, X, _ = make_case(L, d, dk, dff, batch, scale, ln_eps=ln_eps)
    assert_close(bh.forward(p, X, cfg), bh.reference.forward(p, X, cfg), what="Z")
    J, J_ref = bh.jacobian(p, X, cfg), bh.reference.jacobian(p, X, cfg)
    assert list(J) == list(p)
    for n in p:
        assert J[n].shape == ((L * d, p[n].numel()) if batch is None else (batch, L * d, p[n].numel()))
    assert_blocks_close({n: (J[n], J_ref[n]) for n in p}, what="dZ")  # W_Q's and W_K's are zero at L = 1: the whole's rounding
    assert list(bh.jacobian(p, X, cfg, wrt=["W_2", "W_K"])) == ["W_K", "W_2"]


@pytest.mark.parametrize("case", SECOND_ORDER_SIZES, ids=SECOND_ORDER_SIZE_IDS)
def test_all_second_derivatives(case):
    L, d, dk, dff, _, scale = case
    cfg, p, X, _ = make_case(L, d, dk, dff, None, scale, ln_eps=1e-4)
    ref = torch.func.jacfwd(torch.func.jacrev(lambda q: bh.reference.forward(q, X, cfg)))(p)
    blocks = {(a, b): (bh.second_derivative(p, X, cfg, a, b), ref[a][b].reshape(L * d * p[a].numel(), p[b].numel()))
              for a in p for b in p}
    assert all(H.shape == R.shape for H, R in blocks.values())
    assert_blocks_close(blocks, what="d2Z")  # the structurally zero ones (ReLU's (W_1, W_1)): the whole's rounding


def test_theorems_4_and_5_recomposed_in_paper_layout():
    """∂Z/∂W_i = J_Z B_i and eq. 9: H_tr^(i,j) = (J_Z ⊗ I) ξ_ij + (I ⊗ B_iᵀ) H_Z B_j."""
    cfg, p, X, _ = make_case(3, 4, 3, 5, None, 1.0)
    d = 4

    def S_of(q):
        T = (X @ q["W_Q"]) @ (X @ q["W_K"]).T / math.sqrt(q["W_Q"].shape[1])
        Y = Fn.layer_norm(X + torch.softmax(T, -1) @ (X @ q["W_V"]), (d,), eps=0.0)
        return torch.relu(Y @ q["W_1"]) @ q["W_2"] + Y

    S = S_of(p)
    J_Z = bh.layernorm.jacobian(S)  # (Ld, Ld), Theorem 2
    H_Z = bh.layernorm.hessian(S).reshape(12, 12, 12)  # Theorem 3, rows (o, q) o-major
    B = {n: v.reshape(12, -1) for n, v in torch.func.jacrev(S_of)(p).items()}
    J = bh.jacobian(p, X, cfg)
    for i in p:
        assert_close(J[i], J_Z @ B[i], what=f"Theorem 4 for {i}")
        for j in p:
            xi = bh.second_derivative(p, X, cfg, i, j, of="S").reshape(12, p[i].numel(), p[j].numel())
            eq9 = torch.einsum("os,sij->oij", J_Z, xi) + torch.einsum("oqr,qi,rj->oij", H_Z, B[i], B[j])
            assert_close(bh.second_derivative(p, X, cfg, i, j), eq9.reshape(-1, p[j].numel()), what=f"eq. 9 ({i},{j})")
