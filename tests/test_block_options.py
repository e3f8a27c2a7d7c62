"""The block with every option beyond the paper, closed form against torch.func in float64.

The options (heads, biases, W_O, affine LayerNorm, eps, ReLU/GELU/GELU-tanh, post/pre-LN,
causal mask) are crossed by a 3-wise covering design (every combination of any three option
values appears in some configuration), each run on a small shape from a cycle that includes
``L = 1``, ``d_k != d_model/n_heads`` and batches; vectors are random (nothing hides behind
the usual zeros and ones). Each configuration checks the forward, the full Hessian and its
outer and functional terms w.r.t. every weight *and the input X*, the Jacobians and
``dZ/dX``, at relative Frobenius error <= 1e-10 (conftest.py).
"""

import itertools

import pytest
import torch

import blockhess as bh

from conftest import (EPS64, ROUND, assert_blocks_close, assert_close, assert_float32_hessian, assert_identities, blocks_of,
                      make_case, randomize_vectors)
from settings import (BLOCK_OPTIONS, OPTION_CASES, OPTION_DESIGN, OPTION_IDS, OPTION_SIZES, covered, make_target,
                      option_id)


def make(row, shape, seed=0):
    """:func:`conftest.make_case` of a design row at ``shape``, its vectors randomized."""
    cfg, p, X, g = make_case(*shape, seed=seed, **row)
    return cfg, randomize_vectors(p, seed), X, g


def test_design_covers_every_triple():
    assert len(OPTION_DESIGN) < 40
    for t in (1, 2, 3):
        need = set()
        for ks in itertools.combinations(BLOCK_OPTIONS, t):
            for vs in itertools.product(*(BLOCK_OPTIONS[k] for k in ks)):
                need.add(tuple((k, repr(v)) for k, v in zip(ks, vs)))
        got = set().union(*(covered(r, t) for r in OPTION_DESIGN))
        assert need <= got


@pytest.mark.parametrize("case", OPTION_CASES, ids=OPTION_IDS)
def test_hessian_with_input_against_autograd(case):
    row, shape, loss = case
    cfg, p, X, g = make(row, shape)
    T = make_target(loss, X, g, cfg.d_model)
    assert_close(bh.forward(p, X, cfg), bh.reference.forward(p, X, cfg), what="Z")
    H = bh.hessian(p, X, cfg, loss=loss, target=T, wrt_input=True)
    R = bh.reference.hessian(p, X, cfg, loss=loss, target=T, wrt_input=True)
    assert H.names == ("X",) + tuple(p)
    s = R.dense().norm().item()
    assert_close(H.dense(), R.dense(), what="full")
    assert_close(H.outer.dense(), R.outer.dense(), scale=s, what="outer")  # scale: a part is zero only to the whole's rounding
    assert_close(H.functional.dense(), R.functional.dense(), scale=s, what="functional")
    assert_blocks_close(blocks_of(H, R), what="full")  # every block to its own norm (zero ones: the whole's rounding)


@pytest.mark.parametrize("case", OPTION_CASES[::2], ids=OPTION_IDS[::2])  # the MSE half (a Jacobian takes no loss)
def test_jacobians_against_autograd(case):
    row, shape, _ = case
    cfg, p, X, _ = make(row, shape, seed=1)
    J, R = bh.jacobian(p, X, cfg), bh.reference.jacobian(p, X, cfg)
    s = sum(v.norm().item() ** 2 for v in R.values()) ** 0.5  # the whole dZ/dθ (b_K's part is zero)
    for n in p:
        assert_close(J[n], R[n], scale=s, what=f"dZ/d{n}")  # b_K's is zero (shift invariance): the whole's rounding
        # one weight at a time: the FFN's and LN_2's skip the factors of the earlier stages
        assert_close(bh.jacobian(p, X, cfg, wrt=n)[n], R[n], scale=s, what=f"dZ/d{n} alone")
    ffn_only = [n for n in p if n in ("W_1", "b_1", "W_2", "b_2", "gamma_2", "beta_2")]
    J_ffn = bh.jacobian(p, X, cfg, wrt=ffn_only)
    assert list(J_ffn) == ffn_only
    for n in ffn_only:
        assert_close(J_ffn[n], R[n], scale=s, what=f"dZ/d{n} with the FFN's weights")
    assert_close(bh.input_jacobian(p, X, cfg), bh.reference.input_jacobian(p, X, cfg), what="dZ/dX")


@pytest.mark.parametrize("row", OPTION_DESIGN[:6], ids=[option_id((r, OPTION_SIZES[0], "")) for r in OPTION_DESIGN[:6]])
def test_all_second_derivatives(row):
    """∂²Z/∂W_a∂W_b in the paper's layout (rows (o, i)), every ordered pair, against jacfwd(jacrev)."""
    cfg, p, X, _ = make(row, (3, 4, 2, 3, None, 1.0), seed=2)
    ref = torch.func.jacfwd(torch.func.jacrev(lambda q: bh.reference.forward(q, X, cfg)))(p)
    # every block to its own norm; the structurally zero ones (ReLU's (W_1, W_1), anything with b_K) to the whole's rounding
    assert_blocks_close({(a, b): (bh.second_derivative(p, X, cfg, a, b), ref[a][b].reshape(-1, p[b].numel()))
                         for a in p for b in p}, what="d2Z")


@pytest.mark.parametrize("row", [r for r in OPTION_DESIGN if r["norm"] == "post"][:3])
def test_xi_blocks_post_ln(row):
    """Theorem 5's ξ (second derivatives of S = Y + FFN(Y)) with the options on."""
    cfg, p, X, _ = make(row, (3, 4, 2, 3, None, 1.0), seed=3)

    def S(q):
        Y = bh.reference._ln(q, X + bh.reference._attention(q, X, cfg), cfg, 1)
        return Y + bh.reference._ffn(q, Y, cfg)

    ref = torch.func.jacfwd(torch.func.jacrev(S))(p)
    # every block to its own norm; the structurally zero ones to the whole's rounding
    assert_blocks_close({(a, b): (bh.second_derivative(p, X, cfg, a, b, of="S"), ref[a][b].reshape(-1, p[b].numel()))
                         for a in p for b in p}, what="xi")


@pytest.mark.parametrize("opts", [dict(n_heads=2, bias=True, out_proj=True, causal=True), dict(bias=True), dict(causal=True)])
@pytest.mark.parametrize("loss", ["mse", "ce"])
def test_bare_attention_with_options(opts, loss):
    cfg = bh.BlockConfig(d_model=4, d_k=3, kind="attention", **opts)
    p = randomize_vectors(bh.init_params(cfg, seed=4), 4)
    g = torch.Generator().manual_seed(4)
    X = torch.randn(2, 3, 4, generator=g, dtype=torch.float64)
    T = make_target(loss, X, g, 4)
    H = bh.hessian(p, X, cfg, loss=loss, target=T, wrt_input=True)
    R = bh.reference.hessian(p, X, cfg, loss=loss, target=T, wrt_input=True)
    s = R.dense().norm().item()
    assert_close(H.dense(), R.dense(), what="full")
    assert_close(H.functional.dense(), R.functional.dense(), scale=s, what="functional")  # a part: zero only to the whole's rounding
    J, Jr = bh.jacobian(p, X, cfg), bh.reference.jacobian(p, X, cfg)
    whole = sum(v.norm().item() ** 2 for v in Jr.values()) ** 0.5
    for n in p:
        assert_close(J[n], Jr[n], scale=whole, what=f"dF/d{n}")  # b_K's is zero (shift invariance): the whole's rounding


def test_b_K_is_structurally_zero():
    """Softmax is shift-invariant per row: b_K has an exactly zero gradient and Hessian."""
    cfg = bh.BlockConfig(d_model=4, d_ff=5, d_k=2, n_heads=2, bias=True, out_proj=True, ln_affine=True, activation="gelu")
    p = randomize_vectors(bh.init_params(cfg, seed=5), 5)
    X = torch.randn(2, 3, 4, dtype=torch.float64)
    T = torch.randn(2, 3, 4, dtype=torch.float64)
    H = bh.hessian(p, X, cfg, loss="mse", target=T, wrt_input=True)
    for n in H.names:
        assert torch.count_nonzero(H["b_K", n]) == 0
        assert torch.count_nonzero(H.outer["b_K", n]) == 0 and torch.count_nonzero(H.functional["b_K", n]) == 0
    assert torch.count_nonzero(bh.jacobian(p, X, cfg, wrt="b_K")["b_K"]) == 0
    R = bh.reference.hessian(p, X, cfg, loss="mse", target=T)
    # autograd's b_K blocks are zero up to the whole's rounding
    assert R.dense().norm() > 0 and all(R["b_K", n].norm() <= ROUND * EPS64 * R.dense().norm() for n in p)


def test_identities_and_subsets():
    row = OPTION_DESIGN[1]  # everything on
    cfg, p, X, g = make(row, (3, 4, 2, 5, 3, 1.0), seed=6)
    T = torch.randn(X.shape, generator=g, dtype=torch.float64)
    H = bh.hessian(p, X, cfg, loss="mse", target=T, wrt_input=True)
    assert_identities(H, convex=True)
    # the X–X block is zero across sequences; a batch is the mean of its sequences
    XX = H["X", "X"].reshape(3, 12, 3, 12)
    for b in range(3):
        for c in range(3):
            if b != c:
                assert torch.count_nonzero(XX[b, :, c]) == 0
    per = [bh.hessian(p, X[b], cfg, loss="mse", target=T[b], wrt_input=True) for b in range(3)]
    for b, Hb in enumerate(per):
        assert_close(XX[b, :, b] * 3, Hb["X", "X"], what="X-X per sequence")
        assert_close(H["X", "W_1"].reshape(3, 12, -1)[b] * 3, Hb["X", "W_1"], what="X-W_1 per sequence")
    # every weight block of the batch is the mean of the sequences' (b_K's are zero: the whole's rounding)
    assert_blocks_close({(a, c): (H[a, c], sum(Hb[a, c] for Hb in per) / 3) for a in p for c in p}, what="batch mean")
    sub = ["X", "b_Q", "W_O", "gamma_1", "W_1", "beta_2"]
    part = bh.hessian(p, X, cfg, loss="mse", target=T, wrt=sub, wrt_input=True)
    assert list(part.names) == [n for n in H.names if n in sub]
    assert_blocks_close(blocks_of(part, H), what="wrt")
    assert_blocks_close(blocks_of(part.functional, H.functional), what="wrt functional")


def test_gelu_gives_the_ffn_its_own_functional_term():
    """ReLU: the FFN's (W_1, W_1) functional block is zero (Lemma 1); GELU: it is not."""
    for act, zero in (("relu", True), ("gelu", False), ("gelu_tanh", False)):
        cfg = bh.BlockConfig(d_model=4, d_ff=5, activation=act)
        p = bh.init_params(cfg, seed=7)
        X = torch.randn(3, 4, dtype=torch.float64)
        F = bh.hessian(p, X, cfg, loss="mse", target=torch.zeros_like(X)).functional
        ff = bh.second_derivative(p, X, cfg, "W_1", "W_1", of="S")
        assert (torch.count_nonzero(ff) == 0) == zero
        assert F["W_1", "W_1"].norm() > 0  # through LN_2 it is never zero


@pytest.mark.parametrize("loss", ["custom", "float32"])
def test_custom_loss_and_float32(loss):
    row = OPTION_DESIGN[1]
    cfg, p, X, g = make(row, (3, 4, 2, 5, 2, 1.0), seed=8)
    T = torch.randn(X.shape, generator=g, dtype=torch.float64)
    if loss == "custom":
        def fn(Z, t):
            return torch.log1p(((Z - t) ** 2).sum()) + 0.1 * torch.tanh(Z.sum()) ** 2
        H = bh.hessian(p, X, cfg, loss=fn, target=T, wrt_input=True)
        R = bh.reference.hessian(p, X, cfg, loss=fn, target=T, wrt_input=True)
        assert_close(H.dense(), R.dense(), what="custom loss")
        assert_close(H.outer.dense(), R.outer.dense(), what="custom loss outer")
    else:
        assert_float32_hessian(p, X, cfg, loss="mse", target=T, wrt_input=True)
