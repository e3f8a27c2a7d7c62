"""The closed form against a 40-digit oracle, where float64 autograd is itself inexact.

At large input scales the softmax saturates and the loss Hessian becomes ill-conditioned in
its inputs: there the closed form and ``torch.func`` differ by ~1e-10 (relative to the
functional term), and the question is which one is right. The oracle evaluates the block in
``mpmath`` (40 digits) on hyper-dual numbers ``a + b ε1 + c ε2 + d ε1ε2`` (``ε1² = ε2² = 0``):
along directions ``v, w`` the ``ε1ε2`` part of the loss is exactly ``vᵀ H w``, with no
step size, and that of each output ``Z_o`` gives ``vᵀ ∇²Z_o w``, so the functional term
``Σ_o (∂ℓ/∂Z_o) vᵀ∇²Z_o w`` and the outer term ``Σ_o,o' (J v)_o ∇²ℓ (J w)_o'`` come apart.
The inputs are the float64 values exactly, so the oracle is the true value for them.
"""

import mpmath as mp
import pytest
import torch

import blockhess as bh

mp.mp.dps = 40


class HD:
    """A hyper-dual number ``a + b ε1 + c ε2 + d ε1ε2`` over ``mpmath.mpf``."""

    __slots__ = ("a", "b", "c", "d")

    def __init__(self, a, b=0, c=0, d=0):
        self.a, self.b, self.c, self.d = mp.mpf(a), mp.mpf(b), mp.mpf(c), mp.mpf(d)

    def __add__(self, o):
        if not isinstance(o, HD):
            return HD(self.a + o, self.b, self.c, self.d)
        return HD(self.a + o.a, self.b + o.b, self.c + o.c, self.d + o.d)

    __radd__ = __add__

    def __neg__(self):
        return HD(-self.a, -self.b, -self.c, -self.d)

    def __sub__(self, o):
        return self + (-o)

    def __mul__(self, o):
        if not isinstance(o, HD):
            return HD(self.a * o, self.b * o, self.c * o, self.d * o)
        return HD(self.a * o.a, self.a * o.b + self.b * o.a, self.a * o.c + self.c * o.a,
                  self.a * o.d + self.b * o.c + self.c * o.b + self.d * o.a)

    __rmul__ = __mul__

    def _chain(self, f0, f1, f2):  # f(a + δ) with f', f'' at a
        return HD(f0, f1 * self.b, f1 * self.c, f1 * self.d + f2 * self.b * self.c)

    def exp(self):
        e = mp.exp(self.a)
        return self._chain(e, e, e)

    def recip(self):
        return self._chain(1 / self.a, -1 / self.a**2, 2 / self.a**3)

    def rsqrt(self):
        return self._chain(self.a ** mp.mpf(-0.5), -mp.mpf(0.5) * self.a ** mp.mpf(-1.5), mp.mpf(0.75) * self.a ** mp.mpf(-2.5))

    def relu(self):
        return self if self.a > 0 else HD(0)


def _sum(xs):
    xs = list(xs)
    return sum(xs[1:], xs[0])


def _matmul(A, B):
    return [[_sum(A[i][t] * B[t][j] for t in range(len(B))) for j in range(len(B[0]))] for i in range(len(A))]


def _add(A, B):
    return [[a + b for a, b in zip(ra, rb)] for ra, rb in zip(A, B)]


def _attention(X, p, dk):
    Q, K, V = _matmul(X, p["W_Q"]), _matmul(X, p["W_K"]), _matmul(X, p["W_V"])
    out = []
    for q in Q:
        s = [_sum(q[t] * k[t] for t in range(dk)) * (1 / mp.sqrt(dk)) for k in K]
        top = max(x.a for x in s)
        e = [(x - top).exp() for x in s]
        r = _sum(e).recip()
        out.append([_sum(e[j] * r * V[j][c] for j in range(len(V))) for c in range(len(V[0]))])
    return out


def _layernorm(X):
    out = []
    for row in X:
        mean = _sum(row) * (1 / mp.mpf(len(row)))
        cen = [x - mean for x in row]
        r = (_sum(c * c for c in cen) * (1 / mp.mpf(len(row)))).rsqrt()
        out.append([c * r for c in cen])
    return out


def _forward(X, p, cfg):
    A = _attention(X, p, cfg.head_dim)
    if cfg.kind == "attention":
        return A
    Y = _layernorm(_add(X, A))
    F = _matmul([[h.relu() for h in row] for row in _matmul(Y, p["W_1"])], p["W_2"])
    return _layernorm(_add(Y, F))


def _oracle(params, X, T, cfg, v, w):
    """``(vᵀHw, vᵀ outer w, vᵀ functional w)`` of the MSE loss, to 40 digits."""
    P, off = {}, 0
    for name, t in params.items():
        rows, cols = t.shape
        P[name] = [[HD(t[i, j].item(), v[off + i * cols + j].item(), w[off + i * cols + j].item())
                    for j in range(cols)] for i in range(rows)]
        off += t.numel()
    N = X.numel()
    full = outer = functional = mp.mpf(0)
    for b in range(X.shape[0]):
        Z = _forward([[HD(x) for x in row] for row in X[b].tolist()], P, cfg)
        for i, row in enumerate(Z):
            for c, z in enumerate(row):
                r = z - mp.mpf(T[b, i, c].item())
                sq = r * r * (1 / mp.mpf(N))
                full += sq.d
                outer += 2 * z.b * z.c / N
                functional += 2 * r.a * z.d / N
    return full, outer, functional


@pytest.mark.parametrize("kind, scale", [("attention", 10.0), ("block", 10.0), ("block", 1.0)])
def test_closed_form_against_a_40_digit_oracle(kind, scale):
    """Each part along random directions is as close to the truth as torch.func's, in units of
    the full Hessian's norm times the directions' norms."""
    L, d, dk, B = 4, 6, 3, 2
    cfg = bh.BlockConfig(d_model=d, d_ff=5, d_k=dk, kind=kind)
    params = bh.init_params(cfg, seed=0)
    g = torch.Generator().manual_seed(1)
    X = scale * torch.randn(B, L, d, generator=g, dtype=torch.float64)
    T = torch.randn(B, L, d, generator=g, dtype=torch.float64)
    H = bh.hessian(params, X, cfg, loss="mse", target=T)
    R = bh.reference.hessian(params, X, cfg, loss="mse", target=T)
    parts = {"full": (H.dense(), R.dense()), "outer": (H.outer.dense(), R.outer.dense()),
             "functional": (H.functional.dense(), R.functional.dense())}
    norm = float(H.dense().norm())
    worst = {"closed form": 0.0, "torch.func": 0.0}
    for _ in range(3):
        v = torch.randn(sum(H.sizes), generator=g, dtype=torch.float64)
        w = torch.randn(sum(H.sizes), generator=g, dtype=torch.float64)
        unit = norm * float(v.norm() * w.norm())
        for (ours, ref), true in zip(parts.values(), _oracle(params, X, T, cfg, v, w)):
            worst["closed form"] = max(worst["closed form"], abs(float(v @ ours @ w) - float(true)) / unit)
            worst["torch.func"] = max(worst["torch.func"], abs(float(v @ ref @ w) - float(true)) / unit)
    # at least as close to the truth as float64 autograd (up to 2x), and at float64 rounding
    # times this problem's conditioning: measured 2.7e-13 (torch.func 3.0e-13) for attention
    # at scale 10, where the softmax saturates; 5e-16 and 2e-17 for the block
    assert worst["closed form"] <= max(2 * worst["torch.func"], 1e-15), worst
    assert worst["closed form"] <= 1e-12, worst
