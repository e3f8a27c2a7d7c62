"""Self-attention: G_Q, G_K, G_V, dF/dX (§2.2) and all nine Φ blocks (§2.3) against torch.func."""

import pytest
import torch

import blockhess as bh
from blockhess.layers import attention

from conftest import assert_blocks_close, assert_close, make_case
from settings import SECOND_ORDER_SIZE_IDS, SECOND_ORDER_SIZES, SIZE_IDS, SIZES

NAMES = ("W_Q", "W_K", "W_V")


@pytest.mark.parametrize("case", SIZES, ids=SIZE_IDS)
def test_first_derivatives(case):
    L, d, dk, dff, batch, scale = case
    cfg, p, X, _ = make_case(L, d, dk, dff, batch, scale, kind="attention")
    J = bh.jacobian(p, X, cfg)
    J_ref = bh.reference.jacobian(p, X, cfg)
    # the W_Q, W_K parts are zero at L = 1 (softmax is constant): the whole's rounding there
    assert_blocks_close({n: (J[n], J_ref[n]) for n in NAMES}, what="G")
    Xb = X if batch else X[None]
    c = attention.forward(Xb, *(p[n] for n in NAMES))
    dFdX = attention.input_jacobian(c, *(p[n] for n in NAMES))
    ref = torch.func.vmap(torch.func.jacrev(lambda x: bh.reference.forward(p, x, cfg)))(Xb)
    assert_close(dFdX, ref.reshape(dFdX.shape), what="dF/dX")


@pytest.mark.parametrize("case", SECOND_ORDER_SIZES, ids=SECOND_ORDER_SIZE_IDS)
def test_all_nine_second_derivatives(case):
    L, d, dk, dff, _, scale = case
    cfg, p, X, _ = make_case(L, d, dk, dff, None, scale, kind="attention")
    ref = torch.func.jacfwd(torch.func.jacrev(lambda q: bh.reference.forward(q, X, cfg)))(p)
    # every block to its own norm; the zero ones (Φ_VV, all of them at L = 1) to the whole's rounding
    assert_blocks_close({(a, b): (bh.second_derivative(p, X, cfg, a, b, of="F"), ref[a][b].reshape(L * d * p[a].numel(), p[b].numel()))
                         for a in NAMES for b in NAMES}, what="Phi")
    assert torch.count_nonzero(bh.second_derivative(p, X, cfg, "W_V", "W_V", of="F")) == 0  # Φ_VV = 0
