"""The matrix-free Hessian-vector product (blockhess.block.hvp) and each layer's tangent and
second-order adjoint.

* Layers: each ``tangent`` against ``torch.func.jvp`` of the layer's plain function, each
  ``second_adjoint`` against the tangent of its vector-Jacobian product (``jvp`` of ``vjp``: double
  backward), whole and in its two parts (``second=False``: ``Jᵀ dg`` alone; ``dg = None``: the
  second-order terms alone), float64, relative Frobenius error <= 1e-12: the layer formulas are
  the same products as autograd's, a few roundings each.
* Block: ``H V`` against the dense closed form ``bh.hessian(...).dense() @ V`` (full, outer,
  functional), over the option design of settings.py (every triple of options, MSE and CE, ``L = 1``
  included), the size grid for both kinds and the named configurations, ``k = 1`` and ``k = 3``:
  relative error <= 1e-12 (two closed forms of one quantity, both to rounding).
* Input directions ``dX`` and the input adjoint's tangent ``dgX``: against ``torch.func`` on the plain
  reference forward as a function of ``(X, weights)`` (``jvp`` of ``grad``; Gauss–Newton by ``jvp``,
  ``Ω``, ``vjp``), relative error <= 1e-12, and against the joint closed form (``wrt_input=True``).
* Identities: ``uᵀ(Hv) = vᵀ(Hu)`` for each part, outer + functional = full, ``vᵀ(G v) >= 0`` for the
  Gauss–Newton part of a convex loss, to rounding; float32 judged by float32 autograd's own error.
"""

from __future__ import annotations

import math

import pytest
import psutil
import torch

import blockhess as bh
from blockhess import losses
from blockhess.block import Adjoints, adjoints, directional, forward_cache, hvp
from blockhess.block.directional import vjp
from blockhess.layers import attention, ffn, layernorm, linear, softmax

from conftest import (EPS64, assert_close, assert_float32_close, fro, make_case,
                      randomize_vectors, spy_calls)
from settings import (ACTIVATIONS, KINDS, LAYERNORM_CASES, MULTIHEAD_CASES, NAMED_CONFIGS, OPTION_CASES, OPTION_IDS,
                      SIZE_IDS, SIZES, SOFTMAX_SHAPES, make_target)

DT = torch.float64
TOL_HVP = 1e-12  # two exact forms of one product in float64: each a few roundings per entry (brief's rule)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def randn(shape, g, scale=1.0):
    return scale * torch.randn(shape, generator=g, dtype=DT)


def stack_close(got: dict, ref: dict, what: str, tol=TOL_HVP):
    """Every entry of ``got`` to ``ref`` (``None`` in ``got`` = zero) by its own norm, and to the
    rounding of the whole (the norm of all of ``ref``) where it is zero or below it."""
    whole = math.sqrt(sum(fro(r) ** 2 for r in ref.values()))
    for name, r in ref.items():
        a = got[name] if got[name] is not None else torch.zeros_like(r)
        assert_close(a, r, scale=whole, tol=tol, what=f"{what} {name}")


# ----------------------------------------------------------------------------- layer references

def jvp_of_vjp(f, primals: tuple, tangents: tuple, g_out, dg_out):
    """``(df, d(vjp))``: the tangent of ``f``'s output and of its vector-Jacobian product
    ``vjp_f(primals)(g_out)`` along ``(tangents, dg_out)``, by ``torch.func`` (double backward)."""
    def adj(*args):
        *xs, g = args
        return torch.func.vjp(f, *xs)[1](g)

    df = torch.func.jvp(f, primals, tangents)[1]
    dadj = torch.func.jvp(adj, (*primals, g_out), (*tangents, dg_out))[1]
    return df, dadj


def per_vector(fn, k):
    """``fn(i)`` for each of ``k`` directions, results stacked on a leading axis (tuples entrywise)."""
    outs = [fn(i) for i in range(k)]
    if isinstance(outs[0], torch.Tensor):
        return torch.stack(outs)
    return tuple(torch.stack([o[j] for o in outs]) for j in range(len(outs[0])))


def check_three_ways(ours, ref_full, ref_first, ref_second, what):
    """``ours(second, dg_given)`` -> tuple of results; against the whole, ``Jᵀ dg`` alone and the
    second-order terms alone (references as tuples of tensors in the same order)."""
    for (second, with_dg), ref in (((True, True), ref_full), ((False, True), ref_first), ((True, False), ref_second)):
        got = ours(second, with_dg)
        stack_close(dict(enumerate(got)), dict(enumerate(ref)), f"{what} second={second} dg={with_dg}")


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_tangent_and_second_adjoint(k, bias):
    g = gen(0)
    x, W, b = randn((2, 3, 4), g), randn((4, 5), g), randn((5,), g)
    gy = randn((2, 3, 5), g)
    dx, dW, db, dg = randn((k, 2, 3, 4), g), randn((k, 4, 5), g), randn((k, 5), g), randn((k, 2, 3, 5), g)

    def f(x, W, b):
        return x @ W + (b if bias else 0)

    ref = [jvp_of_vjp(f, (x, W, b), (dx[i], dW[i], db[i]), gy, dg[i]) for i in range(k)]
    dy = torch.stack([r[0] for r in ref])
    assert_close(linear.tangent(x, W, dx, dW, db if bias else None), dy, tol=TOL_HVP, what="dy")
    full = [torch.stack([r[1][j] for r in ref]) for j in range(3)]
    first = per_vector(lambda i: torch.func.vjp(f, x, W, b)[1](dg[i]), k)
    second_only = tuple(a - b for a, b in zip(full, first))

    def ours(second, with_dg):
        gx, gW, gb = linear.second_adjoint(x, W, gy, dg if with_dg else None, dx, dW, second, bias=bias)
        return gx, gW, (gb if bias else torch.zeros(k, 5, dtype=DT)) if with_dg else torch.zeros(k, 5, dtype=DT)

    ref_b = lambda t: t if bias else torch.zeros_like(t)
    check_three_ways(ours, (full[0], full[1], ref_b(full[2])), (first[0], first[1], ref_b(first[2])),
                     (second_only[0], second_only[1], torch.zeros(k, 5, dtype=DT)), "linear")


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("dirs", ["all", "map", "norm"])
def test_linear_scaled_input(k, affine, dirs):
    """A ``Scaled`` input ``x = n ⊙ γ + β`` moving along ``(γ̇, β̇)`` only: the tangent, the weight's and
    bias's rows and the pair ``(Σ ġ_x ⊙ n, Σ ġ_x)`` against ``torch.func`` on ``(n ⊙ γ + β) W + b`` as a
    function of ``(γ, β, W, b)`` (whose adjoint's tangent in ``γ, β`` is that pair)."""
    g = gen(1)
    n, W, b = randn((6, 4), g), randn((4, 5), g), randn((5,), g)
    gam, bet = (randn((4,), g), randn((4,), g)) if affine else (torch.ones(4, dtype=DT), torch.zeros(4, dtype=DT))
    gy, dg = randn((6, 5), g), randn((k, 6, 5), g)
    dgam, dbet, dW, db = randn((k, 4), g), randn((k, 4), g), randn((k, 4, 5), g), randn((k, 5), g)
    zero = torch.zeros_like
    if dirs == "map":
        dgam, dbet = zero(dgam), zero(dbet)
    if dirs == "norm":
        dW, db = zero(dW), zero(db)

    def f(gam, bet, W, b):
        return (n * gam + bet) @ W + b

    prim = (gam, bet, W, b)
    ref = [jvp_of_vjp(f, prim, (dgam[i], dbet[i], dW[i], db[i]), gy, dg[i]) for i in range(k)]
    first = per_vector(lambda i: torch.func.vjp(f, *prim)[1](dg[i]), k)
    full = [torch.stack([r[1][j] for r in ref]) for j in range(4)]
    second_only = [a - c for a, c in zip(full, first)]

    def opt(t):  # a zero direction passed as None, as the block does
        return None if not bool(t.any()) else t

    s = linear.Scaled(n, gam if affine else None, bet if affine else None, opt(dgam), opt(dbet))
    x = n * gam + bet
    dy = linear.tangent(x, W, s, opt(dW), opt(db))
    assert_close(dy, torch.stack([r[0] for r in ref]), tol=TOL_HVP, what="dy")
    mom = linear.moments(n, gy)

    def ours(second, with_dg):
        rows, hW, hb = linear.second_adjoint(x, W, None, dg if with_dg else None, s, opt(dW), second, bias=True,
                                             moments=mom)
        r_n, r_1 = (None, None) if rows is None else rows
        return tuple(zero(full[j]) if t is None else t for j, t in enumerate((r_n, r_1, hW, hb)))

    check_three_ways(ours, full, first, second_only, f"linear, Scaled input ({dirs})")


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SOFTMAX_SHAPES, ids=[f"{a}x{b}" for a, b in SOFTMAX_SHAPES])
def test_softmax_tangent_and_second_adjoint(shape, causal, k):
    L, Lp = shape
    g = gen(1)
    T = randn((2, L, Lp), g, 2.0)
    mask = torch.ones(L, Lp, dtype=torch.bool).triu(1) if causal else torch.zeros(L, Lp, dtype=torch.bool)

    def f(T):
        return torch.softmax(T.masked_fill(mask, float("-inf")), -1)

    A = f(T)
    gA, dT, dgA = randn((2, L, Lp), g), randn((k, 2, L, Lp), g), randn((k, 2, L, Lp), g)
    ref = [jvp_of_vjp(f, (T,), (dT[i],), gA, dgA[i]) for i in range(k)]
    dA_ref = torch.stack([r[0] for r in ref])
    dA = softmax.tangent(A, dT)
    assert_close(dA, dA_ref, tol=TOL_HVP, scale=fro(dA_ref) + 1.0, what="dA")  # L' = 1: a constant softmax, dA = 0
    full = torch.stack([r[1][0] for r in ref])
    first = per_vector(lambda i: torch.func.vjp(f, T)[1](dgA[i])[0], k)
    u = softmax.centred(A, gA)
    assert_close(A * u, torch.func.vjp(f, T)[1](gA)[0], tol=TOL_HVP, scale=fro(gA), what="g_T")
    s = fro(full) + fro(first)  # the whole's norm: every part is zero at L' = 1
    for second, with_dg, r in ((True, True, full), (False, True, first), (True, False, full - first)):
        got = softmax.second_adjoint(A, dA if second else None, u, dgA if with_dg else None)
        assert_close(got, r, scale=s, tol=TOL_HVP, what=f"dg_T second={second} dg={with_dg}")


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("case", LAYERNORM_CASES, ids=[f"L{c[0]}-d{c[1]}-eps{c[2]:g}-affine{c[3]}" for c in LAYERNORM_CASES])
def test_layernorm_tangent_and_second_adjoint(case, k):
    L, d, eps, affine = case
    g = gen(2)
    x, gam, bet = randn((L, d), g), 1 + 0.5 * randn((d,), g), randn((d,), g, 0.3)
    gout = randn((L, d), g)
    dx, dgam, dbet, dg = randn((k, L, d), g), randn((k, d), g), randn((k, d), g), randn((k, L, d), g)

    def f(x, gam, bet):
        m = x - x.mean(-1, keepdim=True)
        y = m / torch.sqrt((m * m).mean(-1, keepdim=True) + eps)
        return y * gam + bet if affine else y

    ref = [jvp_of_vjp(f, (x, gam, bet), (dx[i], dgam[i], dbet[i]), gout, dg[i]) for i in range(k)]
    y, r = layernorm.normalise(x, eps)
    gamma = gam if affine else None
    dy, rho = layernorm.tangent(y, r, dx)
    dout = layernorm.affine_tangent(y, dy, gamma, dgam if affine else None, dbet if affine else None)
    assert_close(dout, torch.stack([q[0] for q in ref]), tol=TOL_HVP, what="dLN")
    assert_close(layernorm.adjoint(y, r, gout, gamma), torch.func.vjp(f, x, gam, bet)[1](gout)[0], tol=TOL_HVP, what="g_x")
    full = [torch.stack([q[1][j] for q in ref]) for j in range(3)]
    first = per_vector(lambda i: torch.func.vjp(f, x, gam, bet)[1](dg[i]), k)
    g_x = layernorm.adjoint(y, r, gout, gamma)
    zeros = torch.zeros(k, d, dtype=DT)

    def ours(second, with_dg):
        gx, hg, hb = layernorm.second_adjoint(y, r, gout, g_x, dg if with_dg else None, dy, rho, gamma,
                                              dgam if affine else None, second, variables=(affine, affine))
        return gx, zeros if hg is None else hg, zeros if hb is None else hb

    if not affine:
        full, first = [full[0], zeros, zeros], [first[0], zeros, zeros]
    check_three_ways(ours, full, first, tuple(a - b for a, b in zip(full, first)), "LayerNorm")


def plain_attention(X, W_Q, W_K, W_V, b_Q, b_K, b_V, H, causal):
    """Multi-head attention in plain ops (heads by reshape), the layer's output O before W_O."""
    B, L, d = X.shape
    Q, K, V = X @ W_Q + b_Q, X @ W_K + b_K, X @ W_V + b_V
    Qh, Kh, Vh = (t.reshape(B, L, H, -1).transpose(1, 2) for t in (Q, K, V))
    T = Qh @ Kh.transpose(-1, -2) / math.sqrt(Qh.shape[-1])
    if causal:
        T = T.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
    return (torch.softmax(T, -1) @ Vh).transpose(1, 2).reshape(B, L, d)


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("case", MULTIHEAD_CASES, ids=[f"B{c[0]}-L{c[1]}-d{c[2]}-H{c[3]}-dk{c[4]}-causal{c[5]}"
                                                       for c in MULTIHEAD_CASES])
def test_attention_tangent_and_second_adjoint(case, k):
    B, L, d, H, dk, causal = case
    g = gen(3)
    q = H * dk
    shapes = {"W_Q": (d, q), "W_K": (d, q), "W_V": (d, d), "b_Q": (q,), "b_K": (q,), "b_V": (d,)}
    p = {n: randn(s, g, 0.7) for n, s in shapes.items()}
    X = randn((B, L, d), g)
    gF, dX, dgF = randn((B, L, d), g), randn((k, B, L, d), g), randn((k, B, L, d), g)
    dp = {n: randn((k, *s), g) for n, s in shapes.items()}
    names = list(shapes)

    def f(X, *w):
        return plain_attention(X, *w, H, causal)

    prim = (X, *(p[n] for n in names))
    ref = [jvp_of_vjp(f, prim, (dX[i], *(dp[n][i] for n in names)), gF, dgF[i]) for i in range(k)]
    c = attention.forward(X, p["W_Q"], p["W_K"], p["W_V"], p["b_Q"], p["b_K"], p["b_V"], H, causal)
    t = attention.tangent(c, p, dp, dX)
    dF_ref = torch.stack([r[0] for r in ref])
    assert_close(t.dF, dF_ref, tol=TOL_HVP, what="dO")
    a = attention.adjoint(c, p, gF, want_input=True)
    g1 = torch.func.vjp(f, *prim)[1](gF)
    stack_close({"X": a.gX, "W_Q": torch.einsum("bld,ble->de", X, a.gQ)}, {"X": g1[0], "W_Q": g1[1]}, "first-order")
    full = [torch.stack([r[1][j] for r in ref]) for j in range(len(prim))]
    first = list(per_vector(lambda i: torch.func.vjp(f, *prim)[1](dgF[i]), k))

    def ours(second, with_dg):
        gx, hv = attention.second_adjoint(c, p, dp, a, t, dgF if with_dg else None, dX, second)
        return (gx, *(torch.zeros(k, *shapes[n], dtype=DT) if hv[n] is None else hv[n] for n in names))

    check_three_ways(ours, full, first, tuple(x - y for x, y in zip(full, first)), "attention")


def plain_ffn(Y, W_1, b_1, W_2, b_2, gamma, beta, act, pre, eps):
    Yf = Y
    if pre:
        m = Y - Y.mean(-1, keepdim=True)
        Yf = m / torch.sqrt((m * m).mean(-1, keepdim=True) + eps) * gamma + beta
    H1 = Yf @ W_1 + b_1
    h = torch.relu(H1) if act == "relu" else torch.nn.functional.gelu(H1, approximate="tanh" if act == "gelu_tanh" else "none")
    return h @ W_2 + b_2 + Y


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("pre", [False, True], ids=["post", "pre"])
@pytest.mark.parametrize("act", ACTIVATIONS)
def test_ffn_tangent_and_second_adjoint(act, pre, k):
    g = gen(4)
    T_, d, ff, eps = 5, 4, 6, 1e-3
    shapes = {"W_1": (d, ff), "b_1": (ff,), "W_2": (ff, d), "b_2": (d,), "gamma_2": (d,), "beta_2": (d,)}
    p = {n: randn(s, g, 0.7) for n, s in shapes.items()}
    p["gamma_2"] = 1 + 0.5 * randn((d,), g)
    if not pre:
        del shapes["gamma_2"], shapes["beta_2"]
    names = list(shapes)
    Y = randn((T_, d), g)
    gS, dY, dgS = randn((T_, d), g), randn((k, T_, d), g), randn((k, T_, d), g)
    dp = {n: randn((k, *s), g) for n, s in shapes.items()}

    def f(Y, *w):
        q = dict(zip(names, w))
        return plain_ffn(Y, q["W_1"], q["b_1"], q["W_2"], q["b_2"], q.get("gamma_2"), q.get("beta_2"), act, pre, eps)

    prim = (Y, *(p[n] for n in names))
    ref = [jvp_of_vjp(f, prim, (dY[i], *(dp[n][i] for n in names)), gS, dgS[i]) for i in range(k)]
    c = ffn.forward(Y, p["W_1"], p["W_2"], p["b_1"], p["b_2"], act, pre_ln=pre, ln_eps=eps,
                    gamma=p["gamma_2"] if pre else None, beta=p["beta_2"] if pre else None, jacobian=False)
    q = {n: p[n] for n in names}
    t = ffn.tangent(c, q, dp, dY)
    assert_close(t.dS, torch.stack([r[0] for r in ref]), tol=TOL_HVP, what="dS")
    a = ffn.adjoint(c, gS)
    assert_close(a.g_Y, torch.func.vjp(f, *prim)[1](gS)[0], tol=TOL_HVP, what="g_Y")
    full = [torch.stack([r[1][j] for r in ref]) for j in range(len(prim))]
    first = list(per_vector(lambda i: torch.func.vjp(f, *prim)[1](dgS[i]), k))

    def ours(second, with_dg):
        gy, hv = ffn.second_adjoint(c, q, dp, a, t, dgS if with_dg else None, second)
        return (gy, *(torch.zeros(k, *shapes[n], dtype=DT) if hv[n] is None else hv[n] for n in names))

    check_three_ways(ours, full, first, tuple(x - y for x, y in zip(full, first)), "FFN")


# ----------------------------------------------------------------------------- the block

def loss_parts(c, loss, target):
    """``(g, omega)`` of ``loss`` at the cache's output from blockhess.losses.derivatives: the
    gradient, and the per-token loss Hessian applied to a tangent ``(k, B, L, d)`` by einsum."""
    B, L, d = c.out.shape
    tb = target[None] if c.X.shape != c.x_shape else target
    ld = losses.derivatives(loss, losses.check(loss, tb, c.out), c.out)
    assert ld.per_token

    def omega(dZ):
        return torch.einsum("tij,ktj->kti", ld.hess, dZ.reshape(dZ.shape[0], B * L, d)).reshape(dZ.shape)

    return ld.grad, omega


def directions(p: dict, k: int, seed: int, names=None) -> dict:
    g = gen(seed)
    return {n: randn((k, *v.shape), g) for n, v in p.items() if names is None or n in names}


def as_matrix(HV: dict, names, dgX=None) -> torch.Tensor:
    """``(n, k)``: the rows of every name (``dgX`` first when given) in order, as ``H.dense()``'s."""
    k = next(iter(HV.values())).shape[0]
    parts = ([] if dgX is None else [dgX.reshape(k, -1)]) + [HV[n].reshape(k, -1) for n in names]
    return torch.cat(parts, 1).T


def against_dense(cfg, p, X, loss, target, k, seed=0, plain=True, names=None):
    """Every part of ``hvp`` against the dense closed form times the same directions."""
    c = forward_cache(p, X, cfg, plain=plain)
    g, omega = loss_parts(c, loss, target)
    H = bh.hessian(p, X, cfg, loss=loss, target=target)
    V = directions(p, k, seed, names)
    Vm = as_matrix({n: V.get(n, torch.zeros(k, *p[n].shape, dtype=DT)) for n in p}, H.names)
    whole = fro(H.dense() @ Vm)
    for part, outer, functional in (("full", True, True), ("outer", True, False), ("functional", False, True)):
        D = H.dense() if part == "full" else getattr(H, part).dense()
        HV, dgX = hvp(c, g, V, omega, outer=outer, functional=functional)
        assert dgX is None and list(HV) == list(H.names)
        assert all(HV[n].shape == (k, *p[n].shape) for n in p)
        # a part to its own norm and to the whole's rounding (a part can be zero, e.g. outer at L = 1 in Q, K)
        assert_close(as_matrix(HV, H.names), D @ Vm, tol=TOL_HVP, scale=whole, what=part)


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("case", OPTION_CASES, ids=OPTION_IDS)
def test_hvp_against_the_dense_closed_form(case, k):
    row, shape, loss = case
    cfg, p, X, g = make_case(*shape, **row)
    p = randomize_vectors(p)
    against_dense(cfg, p, X, loss, make_target(loss, X, g, cfg.d_model), k)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("size", SIZES, ids=SIZE_IDS)
def test_hvp_over_the_size_grid(size, kind):
    cfg, p, X, g = make_case(*size, kind=kind)
    against_dense(cfg, p, X, "mse", make_target("mse", X, g, cfg.d_model), 3, plain=False)


@pytest.mark.parametrize("loss", ["mse", "ce"])
@pytest.mark.parametrize("name", list(NAMED_CONFIGS))
def test_hvp_named_configurations(name, loss):
    cfg, p, X, g = make_case(3, 6, 2, 5, 2, 1.0, **NAMED_CONFIGS[name])
    against_dense(cfg, randomize_vectors(p), X, loss, make_target(loss, X, g, cfg.d_model), 3)


@pytest.mark.parametrize("names", [("W_2",), ("W_Q", "gamma_2"), ("gamma_1", "b_K", "W_1")])
def test_hvp_of_some_weights_only(names):
    """Absent names are zero directions; every name's rows are returned."""
    cfg, p, X, g = make_case(3, 4, 2, 5, 2, 1.0, n_heads=2, bias=True, out_proj=True, ln_affine=True,
                             activation="gelu", norm="pre")
    against_dense(cfg, randomize_vectors(p), X, "ce", make_target("ce", X, g, 4), 2, names=names)


ATTENTION_CASE = (dict(kind="attention", n_heads=2, bias=True, out_proj=True, causal=True), (3, 4, 2, 5, 2, 1.0), "mse")


@pytest.mark.parametrize("case", OPTION_CASES + [ATTENTION_CASE], ids=OPTION_IDS + ["attention-H2-bias-out_proj"])
def test_hvp_wanted_rows_are_the_full_products_rows(case):
    """``wanted``: exactly the wanted names' rows (canonical order, no other key), equal to the
    unrestricted product's, each weight alone, pairs far apart, none with the input's rows only; with
    and without input directions, every part."""
    row, shape, loss = case
    cfg, p, X, g = make_case(*shape, **row)
    p = randomize_vectors(p)
    c = forward_cache(p, X, cfg, plain=True)
    gl, omega = loss_parts(c, loss, make_target(loss, X, g, cfg.d_model))
    a = adjoints(c, gl)
    V, dX = directions(p, 2, 1), randn((2, *c.X.shape), gen(2))
    names = list(p)
    sets = [(n,) for n in names] + [(names[0], names[-1]), tuple(names[::-1]), ()]
    for outer, functional in ((True, True), (True, False), (False, True)):
        for dXi in (None, dX):
            full, dg_full = hvp(c, a, V, omega, dX=dXi, outer=outer, functional=functional, input_adjoint=True)
            whole = math.sqrt(sum(fro(v) ** 2 for v in full.values()))
            for wanted in sets:
                for inp in (False, True):
                    if not wanted and not inp:
                        continue
                    HV, dgX = hvp(c, a, V, omega, dX=dXi, outer=outer, functional=functional, input_adjoint=inp,
                                  wanted=wanted)
                    what = f"wanted {wanted}, input {inp}, dX {dXi is not None}, outer {outer}, functional {functional}"
                    assert list(HV) == [n for n in names if n in wanted], what
                    for n in wanted:
                        assert_close(HV[n], full[n], scale=whole, tol=TOL_HVP, what=f"{what}: {n}")
                    if inp:
                        assert_close(dgX, dg_full, scale=fro(dg_full), tol=TOL_HVP, what=f"{what}: dgX")
                    else:
                        assert dgX is None


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_hvp_restricted_pass_skips_what_is_not_wanted(monkeypatch, norm):
    """The restriction is real: each weight alone forms one weight's rows (one ``linear.second_adjoint``
    with ``weight=True``), W_2's and W_1's never reach the attention, W_V's skips the softmax's pass."""
    cfg, p, X, g = make_case(3, 4, 2, 5, 2, 1.0, n_heads=2, bias=True, out_proj=True, ln_affine=True, norm=norm,
                             activation="gelu")
    c = forward_cache(p, X, cfg, plain=True)
    gl, omega = loss_parts(c, "mse", make_target("mse", X, g, 4))
    V = directions(p, 2, 3)
    lin = spy_calls(monkeypatch, linear, "second_adjoint")
    att = spy_calls(monkeypatch, attention, "second_adjoint")
    soft = spy_calls(monkeypatch, softmax, "second_adjoint")
    hvp(c, gl, V, omega)
    assert sum(kw.get("weight", True) for kw in lin) == 6 and len(att) == 1 and len(soft) == 1  # the six maps
    for wanted, n_lin, n_att, n_soft in ((("W_2",), 1, 0, 0), (("W_1",), 2, 0, 0), (("W_O",), None, 0, 0),
                                         (("W_V",), None, 1, 0), (("W_Q",), None, 1, 1), (("W_K",), None, 1, 1)):
        lin.clear(), att.clear(), soft.clear()
        hvp(c, gl, V, omega, wanted=wanted)
        assert sum(kw.get("weight", True) for kw in lin) == 1, wanted
        assert n_lin is None or len(lin) == n_lin, wanted
        assert (len(att), len(soft)) == (n_att, n_soft), wanted


def test_vjp_against_autograd():
    """``vjp``: ``J_θᵀ w`` and ``J_Xᵀ w`` for ``k`` output adjoints against autograd's on the plain
    forward (float64, relative 1e-12), restricted as ``hvp`` (only the wanted keys)."""
    cfg, p, X, g = make_case(3, 4, 2, 5, 2, 1.0, n_heads=2, bias=True, out_proj=True, ln_affine=True, norm="pre",
                             activation="gelu", causal=True)
    p = randomize_vectors(p)
    c = forward_cache(p, X, cfg, plain=True)
    W = randn((3, *c.X.shape), gen(5))
    rows, dgX = vjp(c, W)
    assert list(rows) == list(p)
    leaves = {n: v.clone().requires_grad_() for n, v in p.items()}
    Xl = X.clone().requires_grad_()
    Z = bh.forward(leaves, Xl, cfg)
    for i in range(W.shape[0]):
        ref = torch.autograd.grad(Z, [*leaves.values(), Xl], W[i].reshape(Z.shape), retain_graph=True,
                                  allow_unused=True)
        ref = {n: (torch.zeros_like(p[n]) if r is None else r) for n, r in zip([*leaves, "X"], ref)}
        for n in p:
            assert_close(rows[n][i], ref[n], scale=fro(ref["X"]), tol=TOL_HVP, what=f"vjp {n}")
        assert_close(dgX[i].reshape(X.shape), ref["X"], tol=TOL_HVP, what="vjp X")
    part, none = vjp(c, W, wanted=("W_1", "gamma_1"), input_adjoint=False)
    assert list(part) == ["gamma_1", "W_1"] and none is None
    assert torch.equal(part["W_1"], rows["W_1"]) and torch.equal(part["gamma_1"], rows["gamma_1"])


def reference_products(p, X, cfg, loss, target, V, dX):
    """``(full, outer)``, each ``(dgX, {name: rows})`` stacked over the ``k`` directions, by torch.func on
    the plain reference forward as a function of ``(X, weights)``: the full product as ``jvp`` of
    ``grad``, the outer one as ``vjp(Ω jvp)``."""
    names = list(p)
    k = dX.shape[0]
    tgt = losses.check(loss, target, bh.reference.forward(p, X, cfg))

    def fwd(X, *w):
        return bh.reference.forward(dict(zip(names, w)), X, cfg)

    def f(X, *w):
        return losses.value(loss, tgt, fwd(X, *w))

    prim = (X, *(p[n] for n in names))
    grad = torch.func.grad(f, argnums=tuple(range(len(prim))))
    Z = fwd(*prim)
    ld = losses.derivatives(loss, tgt, Z)
    B, L, d = Z.shape
    full, outer = [], []
    for i in range(k):
        tan = (dX[i], *(V[n][i] for n in names))
        full.append(torch.func.jvp(grad, prim, tan)[1])
        dZ = torch.func.jvp(fwd, prim, tan)[1]
        oz = torch.einsum("tij,tj->ti", ld.hess, dZ.reshape(B * L, d)).reshape(dZ.shape)
        outer.append(torch.func.vjp(fwd, *prim)[1](oz))

    def pack(rows):
        return torch.stack([r[0] for r in rows]), {n: torch.stack([r[j + 1] for r in rows]) for j, n in enumerate(names)}

    return pack(full), pack(outer)


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("case", OPTION_CASES[::2] + OPTION_CASES[1::4], ids=OPTION_IDS[::2] + OPTION_IDS[1::4])
def test_hvp_with_input_directions_against_autograd(case, k):
    row, shape, loss = case
    cfg, p, X, g = make_case(*shape, **row)
    p = randomize_vectors(p)
    Xb = X if X.ndim == 3 else X[None]
    target = make_target(loss, Xb, g, cfg.d_model)
    V = directions(p, k, 5)
    dX = randn((k, *Xb.shape), gen(6))
    (fx, fp), (ox, op) = reference_products(p, Xb, cfg, loss, target, V, dX)
    c = forward_cache(p, X, cfg, plain=True)
    gl, omega = loss_parts(c, loss, target[0] if X.ndim == 2 else target)
    whole = math.sqrt(fro(fx) ** 2 + sum(fro(v) ** 2 for v in fp.values()))
    for part, outer, functional, (rx, rp) in (("full", True, True, (fx, fp)), ("outer", True, False, (ox, op)),
                                              ("functional", False, True, (fx - ox, {n: fp[n] - op[n] for n in fp}))):
        HV, dgX = hvp(c, gl, V, omega, dX=dX, outer=outer, functional=functional)
        got = torch.cat([dgX.reshape(k, -1)] + [HV[n].reshape(k, -1) for n in p], 1)
        ref = torch.cat([rx.reshape(k, -1)] + [rp[n].reshape(k, -1) for n in p], 1)
        assert_close(got, ref, tol=TOL_HVP, scale=whole, what=f"{part} (X and weights)")
        assert_close(dgX, rx, tol=TOL_HVP, scale=whole, what=f"{part} dgX")  # the input's rows on their own


@pytest.mark.parametrize("case", OPTION_CASES[:8], ids=OPTION_IDS[:8])
def test_hvp_with_input_directions_against_the_joint_closed_form(case):
    row, shape, loss = case
    cfg, p, X, g = make_case(*shape, **row)
    p = randomize_vectors(p)
    T = make_target(loss, X, g, cfg.d_model)
    H = bh.hessian(p, X, cfg, loss=loss, target=T, wrt_input=True)
    c = forward_cache(p, X, cfg, wrt_input=True)
    gl, omega = loss_parts(c, loss, T)
    k = 3
    V = directions(p, k, 7)
    dX = randn((k, *X.shape), gen(8))  # (k, L, d) for an unbatched input: accepted as it is
    Vm = as_matrix(V, H.names[1:], dX)
    HV, dgX = hvp(c, gl, V, omega, dX=dX)
    assert dgX.shape == (k, *c.X.shape)
    assert_close(as_matrix(HV, H.names[1:], dgX), H.dense() @ Vm, tol=TOL_HVP, what="joint")


def symmetric_case(seed=0, **options):
    cfg, p, X, g = make_case(4, 4, 3, 5, 2, 1.0, seed=seed, **options)
    p = randomize_vectors(p, seed)
    loss = "ce"
    c = forward_cache(p, X, cfg, plain=True)
    gl, omega = loss_parts(c, loss, make_target(loss, X, g, cfg.d_model))
    V = directions(p, 2, seed + 11)
    dX = randn((2, *X.shape), gen(seed + 12))
    return c, gl, omega, V, dX


def inner(HV, dgX, V, dX, i, j):
    """``⟨v_i, (H v)_j⟩`` over every weight and the input."""
    return sum(float((V[n][i] * HV[n][j]).sum()) for n in V) + float((dX[i] * dgX[j]).sum())


@pytest.mark.parametrize("options", [dict(), dict(n_heads=2, bias=True, out_proj=True, ln_affine=True, ln_eps=1e-3,
                                                     activation="gelu", causal=True),
                                     dict(norm="pre", n_heads=2, bias=True, ln_affine=True, activation="gelu_tanh"),
                                     dict(kind="attention", bias=True, out_proj=True)],
                         ids=["paper", "post-all", "pre-all", "attention"])
def test_symmetry_identities_and_psd(options):
    c, gl, omega, V, dX = symmetric_case(**options)
    parts = {}
    for part, outer, functional in (("full", True, True), ("outer", True, False), ("functional", False, True)):
        HV, dgX = hvp(c, gl, V, omega, dX=dX, outer=outer, functional=functional)
        parts[part] = (HV, dgX)
        a, b = inner(HV, dgX, V, dX, 0, 1), inner(HV, dgX, V, dX, 1, 0)
        norm_u = math.sqrt(sum(fro(V[n][0]) ** 2 for n in V) + fro(dX[0]) ** 2)
        norm_hv = math.sqrt(sum(fro(HV[n][1]) ** 2 for n in V) + fro(dgX[1]) ** 2)
        n = sum(v[0].numel() for v in V.values()) + dX[0].numel()
        assert abs(a - b) <= n * EPS64 * norm_u * norm_hv * 4, f"{part}: uᵀHv {a!r} != vᵀHu {b!r}"
        if part == "outer":  # CE is convex in Z: the Gauss–Newton part is PSD
            for i in range(2):
                assert inner(HV, dgX, V, dX, i, i) >= -n * EPS64 * norm_u * norm_hv
    (F, fx), (O, ox), (U, ux) = parts["full"], parts["outer"], parts["functional"]
    assert_close(ox + ux, fx, tol=TOL_HVP, what="outer + functional = full, dgX")
    for n in F:
        assert_close(O[n] + U[n], F[n], tol=TOL_HVP, scale=fro(fx), what=f"outer + functional = full, {n}")


def test_adjoints_reused_and_input_adjoint_without_input_directions():
    c, gl, omega, V, dX = symmetric_case(norm="pre", ln_affine=True, bias=True)
    a = adjoints(c, gl)
    assert isinstance(a, Adjoints)
    HV1, dg1 = hvp(c, gl, V, omega, input_adjoint=True)
    HV2, dg2 = hvp(c, a, V, omega, input_adjoint=True)
    assert dg1 is not None and torch.equal(dg1, dg2)
    assert all(torch.equal(HV1[n], HV2[n]) for n in HV1)
    HV3, dg3 = hvp(c, a, V, omega, dX=dX, input_adjoint=False)
    assert dg3 is None
    # the Gauss–Newton product reads no gradient
    HVo, _ = hvp(c, None, V, omega, functional=False)
    HVr, _ = hvp(c, gl, V, omega, functional=False)
    assert all(torch.equal(HVo[n], HVr[n]) for n in HVo)


def test_b_K_rows_are_exactly_zero():
    c, gl, omega, V, dX = symmetric_case(bias=True, n_heads=2)
    HV, _ = hvp(c, gl, V, omega, dX=dX)
    assert torch.count_nonzero(HV["b_K"]) == 0
    # and its direction moves nothing
    only = {"b_K": V["b_K"]}
    HV, dgX = hvp(c, gl, only, omega, input_adjoint=True)
    assert all(torch.count_nonzero(v) == 0 for v in HV.values()) and torch.count_nonzero(dgX) == 0


@pytest.mark.parametrize("options", [dict(), dict(norm="pre", n_heads=2, bias=True, out_proj=True, ln_affine=True,
                                                     ln_eps=1e-5, activation="gelu", causal=True)],
                         ids=["paper", "pre-all"])
def test_float32_within_autograds_own_error(options):
    """float32 ``hvp`` against the float64 reference on the same (float32) inputs, judged by float32
    torch.func's error there (conftest.assert_float32_close)."""
    cfg, p, X, g = make_case(3, 4, 3, 5, 2, 1.0, **options)
    p = randomize_vectors(p)
    T = make_target("mse", X, g, 4)
    k = 2
    V, dX = directions(p, k, 3), randn((k, *X.shape), gen(4))
    p32, X32, T32, V32, dX32 = ({n: v.float() for n, v in p.items()}, X.float(), T.float(),
                                {n: v.float() for n, v in V.items()}, dX.float())
    (r64x, r64p), _ = reference_products({n: v.double() for n, v in p32.items()}, X32.double(), cfg, "mse",
                                         T32.double(), {n: v.double() for n, v in V32.items()}, dX32.double())
    (a32x, a32p), _ = reference_products(p32, X32, cfg, "mse", T32, V32, dX32)
    c = forward_cache(p32, X32, cfg, plain=True)
    gl, omega = loss_parts(c, "mse", T32)
    HV, dgX = hvp(c, gl, V32, omega, dX=dX32)
    assert dgX.dtype == torch.float32
    cat = lambda x, q: torch.cat([x.reshape(k, -1)] + [q[n].reshape(k, -1) for n in p], 1)
    assert_float32_close(cat(dgX, HV), cat(a32x, a32p), cat(r64x, r64p), what="float32 HV")


# ----------------------------------------------------------------------------- bad inputs

def bad_case():
    cfg, p, X, g = make_case(3, 4, 2, 5, 2, 1.0)
    c = forward_cache(p, X, cfg, plain=True)
    gl, omega = loss_parts(c, "mse", make_target("mse", X, g, 4))
    return c, gl, omega, directions(p, 2, 0)


@pytest.mark.parametrize("change, match", [
    (lambda c, g, o, V: dict(c=None), "c must be a blockhess.block.Cache"),
    (lambda c, g, o, V: dict(V=[1]), "V must be a dict"),
    (lambda c, g, o, V: dict(V={"X": V["W_Q"]}), "the input's directions go in dX"),
    (lambda c, g, o, V: dict(V={"W_Z": V["W_Q"]}), r"V must map names of the block's weights"),
    (lambda c, g, o, V: dict(V={"W_Q": V["W_Q"][0]}), r"V\['W_Q'\] must have shape \(k, 4, 2\)"),
    (lambda c, g, o, V: dict(V={"W_Q": V["W_Q"], "W_K": V["W_K"][:1]}), "the same number k of directions"),
    (lambda c, g, o, V: dict(V={"W_Q": V["W_Q"].float()}), "dtype"),
    (lambda c, g, o, V: dict(V={"W_Q": V["W_Q"] * float("nan")}), "NaN"),
    (lambda c, g, o, V: dict(V={}), "at least one direction"),
    (lambda c, g, o, V: dict(dX=torch.zeros(3, 2, 3, 4, dtype=DT)), r"dX must have shape \(2, 2, 3, 4\)"),
    (lambda c, g, o, V: dict(g=None), "g .* is required with functional=True"),
    (lambda c, g, o, V: dict(g=g[0]), r"g must have the output's shape \(2, 3, 4\)"),
    (lambda c, g, o, V: dict(omega=None), "omega must be a callable"),
    (lambda c, g, o, V: dict(omega=lambda dZ: dZ[0]), r"omega\(dZ\) must return a tensor of dZ's shape"),
    (lambda c, g, o, V: dict(omega=lambda dZ: dZ * float("inf")), r"omega\(dZ\)"),
    (lambda c, g, o, V: dict(outer=False, functional=False), "both False"),
    (lambda c, g, o, V: dict(outer=1), "outer must be True or False"),
    (lambda c, g, o, V: dict(input_adjoint="yes"), "input_adjoint must be True or False"),
    (lambda c, g, o, V: dict(wanted="W_Q"), "wanted must be None or a collection"),
    (lambda c, g, o, V: dict(wanted=("W_Q", "X")), r"wanted must name weights of the block"),
])
def test_bad_inputs_are_refused_by_name(change, match):
    c, gl, omega, V = bad_case()
    kw = dict(c=c, g=gl, V=V, omega=omega)
    kw.update(change(c, gl, omega, V))
    with pytest.raises(ValueError, match=match):
        hvp(**kw)


@pytest.mark.parametrize("change, match", [
    (lambda c, W: dict(c=None), "c must be a blockhess.block.Cache"),
    (lambda c, W: dict(W=W[0]), r"W must have shape \(k, 2, 3, 4\)"),
    (lambda c, W: dict(W=W.float()), "dtype"),
    (lambda c, W: dict(wanted=["b_Z"]), "wanted must name weights"),
    (lambda c, W: dict(input_adjoint=None), "input_adjoint must be True or False"),
])
def test_vjp_bad_inputs_are_refused_by_name(change, match):
    c, _, _, _ = bad_case()
    kw = dict(c=c, W=torch.zeros(2, *c.X.shape, dtype=DT))
    kw.update(change(c, kw["W"]))
    with pytest.raises(ValueError, match=match):
        vjp(**kw)


def test_memory_is_checked_before_any_work(monkeypatch):
    cfg = bh.BlockConfig(d_model=4, d_ff=5)
    p = bh.init_params(cfg, seed=0)
    X = randn((1, 256, 4), gen(0))
    c = forward_cache(p, X, cfg, plain=True)
    V = directions(p, 64, 0, names=("W_1",))
    need = directional.work_entries(cfg, 1, 256, 64) * 8

    class Memory:
        available = need // 2

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Memory)

    def fail(*args, **kwargs):
        raise AssertionError("the adjoints ran before the memory check")

    monkeypatch.setattr(directional, "adjoints", fail)
    with pytest.raises(bh.InsufficientMemoryError, match=r"the Hessian-vector products of 64 directions would need"):
        hvp(c, torch.zeros(1, 256, 4, dtype=DT), V, lambda dZ: dZ)


def test_rows_written_into_the_callers_destinations():
    """``into``: the projections' rows land in the caller's tensors (returned as those tensors) with the
    values of a product without it; a destination of the wrong shape is refused by name."""
    cfg = bh.BlockConfig(d_model=8, d_ff=12, n_heads=2, bias=True, out_proj=True, ln_affine=True, norm="pre")
    p = bh.init_params(cfg, seed=1)
    g0 = torch.Generator().manual_seed(2)
    X, T = (torch.randn(2, 3, 8, generator=g0, dtype=torch.float64) for _ in range(2))
    from blockhess.block import forward_cache
    from blockhess.block.directional import adjoints, hvp
    from blockhess import losses
    c = forward_cache(p, X, cfg, plain=True)
    g, omega = losses.directional("mse", T, c.out)
    a = adjoints(c, g)
    V = {n: torch.randn(1, *v.shape, generator=g0, dtype=torch.float64) for n, v in p.items()}
    plain, _ = hvp(c, a, V, omega=omega)
    into = {n: torch.full((1, *p[n].shape), float("nan"), dtype=torch.float64) for n in ("W_Q", "W_K", "W_V", "W_O", "W_1", "W_2")}
    got, _ = hvp(c, a, V, omega=omega, into=into)
    for n in plain:
        assert torch.allclose(got[n], plain[n], rtol=1e-13, atol=1e-15), n
    # W_Q, W_K, W_V read LN_1's output, whose tangent here is a Scaled one (nothing moves below it): their
    # rows are not one product there, so they come back as tensors of their own; the others are written in
    assert [n for n, t in into.items() if got[n] is t] == ["W_O", "W_1", "W_2"]
    with pytest.raises(ValueError, match=r"into\['W_1'\] must be a contiguous"):
        hvp(c, a, V, omega=omega, into={"W_1": torch.zeros(1, 3, 3, dtype=torch.float64)})


def test_memory_check_counts_only_the_weights_a_call_touches(monkeypatch):
    cfg = bh.BlockConfig(d_model=4, d_ff=5)
    p = bh.init_params(cfg, seed=0)
    X = randn((1, 8, 4), gen(0))
    c = forward_cache(p, X, cfg, plain=True)
    g = torch.zeros(1, 8, 4, dtype=DT)
    asked = []
    monkeypatch.setattr(directional, "check_fits", lambda nbytes, what, device="cpu": asked.append(nbytes))
    dX = randn((3, 1, 8, 4), gen(1))
    hvp(c, g, {}, lambda dZ: dZ, dX=dX, wanted=())  # a model's tangent through the block: no weight copies
    hvp(c, g, directions(p, 3, 0, names=("W_1",)), lambda dZ: dZ, wanted=("W_1",))  # W_1's direction and rows
    hvp(c, g, directions(p, 3, 0, names=("W_1",)), lambda dZ: dZ)  # W_1's direction, every weight's rows
    per_token = directional.work_entries(cfg, 1, 8, 3, weights=())
    assert asked == [per_token * 8, (per_token + 3 * 4 * p["W_1"].numel()) * 8,
                     directional.work_entries(cfg, 1, 8, 3) * 8]
