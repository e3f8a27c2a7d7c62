"""FFN with residual: B_1, B_2, J_SY (§2.6) and every ξ_ij = ∂B_i/∂W_j (Theorem 5) against torch.func."""

import math

import pytest
import torch
import torch.nn.functional as Fn

import blockhess as bh
from blockhess.layers import ffn

from conftest import assert_blocks_close, assert_close, make_case
from settings import SIZE_IDS, SIZES


def test_B1_B2_JSY():
    g = torch.Generator().manual_seed(0)
    Y, W_1, W_2 = (torch.randn(s, generator=g, dtype=torch.float64) for s in [(5, 4), (4, 7), (7, 4)])
    S = lambda y, w1, w2: torch.relu(y @ w1) @ w2 + y  # noqa: E731
    c = ffn.forward(Y, W_1, W_2)
    assert_close(c.S, S(Y, W_1, W_2), what="S")
    ref = torch.func.jacrev(S, argnums=(0, 1, 2))(Y, W_1, W_2)
    J = ffn.weight_jacobians(c)
    assert_close(J["W_1"].dense().reshape(20, 28), ref[1].reshape(20, 28), what="B_1")
    assert_close(J["W_2"].dense().reshape(20, 28), ref[2].reshape(20, 28), what="B_2")
    J_SY = ffn.input_jacobian(c)
    ref_Y = ref[0].reshape(5, 4, 5, 4)
    for t in range(5):
        assert_close(J_SY[t], ref_Y[t, :, t, :], what="J_SY")


@pytest.mark.parametrize("case", SIZES[:5], ids=SIZE_IDS[:5])  # run unbatched: the first five, a batch of three among them
def test_all_xi_blocks(case):
    L, d, dk, dff, _, scale = case
    cfg, p, X, _ = make_case(L, d, dk, dff, None, scale)

    def S(q):
        T = (X @ q["W_Q"]) @ (X @ q["W_K"]).T / math.sqrt(q["W_Q"].shape[1])
        Y = Fn.layer_norm(X + torch.softmax(T, -1) @ (X @ q["W_V"]), (d,), eps=0.0)
        return torch.relu(Y @ q["W_1"]) @ q["W_2"] + Y

    ref = torch.func.jacfwd(torch.func.jacrev(S))(p)
    # every block to its own norm; the structurally zero ones (ReLU's (W_1, W_1), (W_2, W_2)) to the whole's rounding
    assert_blocks_close({(a, b): (bh.second_derivative(p, X, cfg, a, b, of="S"), ref[a][b].reshape(-1, p[b].numel()))
                         for a in p for b in p}, what="xi")
