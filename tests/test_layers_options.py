"""The layers' options beyond the paper: multi-head attention with biases and a causal mask (factors
per head, dO/dX, the contracted second derivatives w.r.t. weights and input), and the FFN's
activations (ReLU, GELU, GELU-tanh) with their derivatives, each against torch.func in float64."""

import math

import pytest
import torch

from blockhess.result import BlockSum
from blockhess.layers import attention, ffn

from conftest import EPS64, ROUND, assert_blocks_close, assert_close, fro
from settings import ACTIVATIONS, MULTIHEAD_CASES

DT = torch.float64


def ref_O(X, p, H, causal):
    Q, K, V = X @ p["W_Q"] + p["b_Q"], X @ p["W_K"] + p["b_K"], X @ p["W_V"] + p["b_V"]
    B, L, d = X.shape
    dk = Q.shape[-1] // H
    Qh, Kh = (t.reshape(B, L, H, dk).transpose(1, 2) for t in (Q, K))
    Vh = V.reshape(B, L, H, -1).transpose(1, 2)
    T = Qh @ Kh.transpose(-1, -2) / math.sqrt(dk)
    if causal:
        T = T.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
    return (torch.softmax(T, -1) @ Vh).transpose(1, 2).reshape(B, L, -1)


@pytest.mark.parametrize("B, L, d, H, dk, causal", MULTIHEAD_CASES)
def test_multihead_attention(B, L, d, H, dk, causal):
    g = torch.Generator().manual_seed(L * 10 + H)
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=DT)  # noqa: E731
    p = {"W_Q": rnd(d, H * dk), "b_Q": rnd(H * dk), "W_K": rnd(d, H * dk), "b_K": rnd(H * dk), "W_V": rnd(d, d), "b_V": rnd(d)}
    X, G = rnd(B, L, d), rnd(B, L, d)
    c = attention.forward(X, p["W_Q"], p["W_K"], p["W_V"], p["b_Q"], p["b_K"], p["b_V"], n_heads=H, causal=causal)
    assert_close(c.F, ref_O(X, p, H, causal), what="O")
    J = attention.input_jacobian(c, p["W_Q"], p["W_K"], p["W_V"])
    Jr = torch.func.vmap(torch.func.jacrev(lambda x: ref_O(x[None], p, H, causal)[0]))(X).reshape(B, L * d, L * d)
    assert_close(J, Jr, what="dO/dX")
    dv = d // H
    f = attention.weight_jacobians(c, tuple(p))
    Jw = torch.func.jacrev(lambda q: ref_O(X, {**p, **q}, H, causal))(p)
    whole = fro(torch.stack([torch.tensor(fro(v)) for v in Jw.values()]))
    assert "b_K" not in f and fro(Jw["b_K"]) <= ROUND * EPS64 * whole  # shift invariance: autograd's is zero to rounding
    assert_close(f["b_V"].dense(), Jw["b_V"].reshape(B * L, d, d), what="dO/db_V")

    def sub(h):
        nm = attention.head_names(H, h)
        qk, v = slice(h * dk, (h + 1) * dk), slice(h * dv, (h + 1) * dv)
        return nm, {nm["W_Q"]: ("W_Q", qk), nm["b_Q"]: ("b_Q", qk), nm["W_K"]: ("W_K", qk), nm["W_V"]: ("W_V", v)}

    split, blocks = {}, {}
    for h in range(H):
        nm, m = sub(h)
        for k, (base, sl) in m.items():
            blocks[k] = (f[k].dense(), Jw[base].reshape(B * L, d, *p[base].shape)[..., sl].reshape(B * L, d, -1))
            split[k] = p[base][..., sl]
    assert_blocks_close(blocks, what="dO")  # the query/key parts are zero at L = 1: the whole's rounding

    def join(q):
        cat = lambda base: torch.cat([q[attention.head_names(H, h)[base]] for h in range(H)], -1)  # noqa: E731
        return {"W_Q": cat("W_Q"), "b_Q": cat("b_Q"), "W_K": cat("W_K"), "W_V": cat("W_V"), "b_K": p["b_K"], "b_V": p["b_V"]}

    def phi(q, x):
        return (G * ref_O(x, join(q), H, causal)).sum()

    Hr = torch.func.hessian(phi)(split, X)
    acc = BlockSum(tuple(split), {k: tuple(v.shape) for k, v in split.items()})
    attention.contract_hessian(c, G, acc, tuple(p))
    Hc = acc.result(X)
    # every block to its own norm; the zero ones (across heads, V with V) to the whole's rounding
    assert_blocks_close({(a, b): (Hc[a, b], Hr[a][b].reshape(Hc[a, b].shape)) for a in split for b in split}, what="d2phi")
    XX, XW = attention.contract_input_hessian(c, G, p["W_Q"], p["W_K"], p["W_V"], tuple(p))
    HXX = torch.func.hessian(lambda x: phi(split, x))(X)
    assert_close(XX, torch.stack([HXX[b, :, :, b] for b in range(B)]), what="d2phi/dX2")
    HXW = torch.func.jacrev(torch.func.grad(phi, argnums=1), argnums=0)(split, X)
    assert_blocks_close({k: (v, HXW[k]) for k, v in XW.items()}, what="d2phi/dX")  # zero at L = 1 for Q, K: the whole's rounding


@pytest.mark.parametrize("kind", ACTIVATIONS)
def test_activation_derivatives(kind):
    x = torch.linspace(-4, 4, 101, dtype=DT) + 1e-3  # off the ReLU kink
    ref = {"relu": torch.relu, "gelu": torch.nn.functional.gelu,
           "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh")}[kind]
    h, a1, a2 = ffn.activation(x, kind)
    d1 = torch.func.vmap(torch.func.grad(ref))(x)
    d2 = torch.func.vmap(torch.func.grad(torch.func.grad(ref)))(x)
    assert_close(h, ref(x), what="act")
    assert_close(a1, d1, what="act'")
    if kind == "relu":
        assert a2 is None and d2.abs().max() == 0
    else:
        assert_close(a2, d2, what="act''")
    with pytest.raises(ValueError, match="activation must be"):
        ffn.activation(x, "swish")
