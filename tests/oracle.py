"""A 40-digit oracle of the MSE loss Hessian: the block (default options) or the bare attention
layer (any heads, no biases, no output projection, no mask) evaluated in ``mpmath`` on hyper-dual
numbers ``a + b ε1 + c ε2 + d ε1ε2`` (``ε1² = ε2² = 0``). Along directions ``v, w`` the ``ε1ε2``
part of the loss is exactly ``vᵀ H w``, with no step size, and that of each output ``Z_o`` gives
``vᵀ ∇²Z_o w``, so the functional term ``Σ_o (∂ℓ/∂Z_o) vᵀ∇²Z_o w`` and the outer term
``Σ_o,o' (J v)_o ∇²ℓ (J w)_o'`` come apart. The inputs are the float64 values exactly, so the
oracle is the true value for them (used by tests/test_high_precision.py and, where autograd is
itself inexact, tests/test_hessian_properties.py).
"""

import mpmath as mp
import torch

import blockhess as bh

mp.mp.dps = 40

MAX_VARIABLES = 50  # dense_hessians evaluates n(n+1)/2 directions: a tenth of a second at n = 12


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


def _attention(X, p, n_heads, dk):
    """Heads as :func:`blockhess.reference.forward`: head ``h`` takes columns ``h*dk:(h+1)*dk`` of
    ``Q, K`` and ``h*dv:(h+1)*dv`` of ``V`` (``dv = d_model / n_heads``); outputs side by side."""
    Q, K, V = _matmul(X, p["W_Q"]), _matmul(X, p["W_K"]), _matmul(X, p["W_V"])
    dv = len(V[0]) // n_heads
    out = [[] for _ in Q]
    for h in range(n_heads):
        qs, vs = range(h * dk, (h + 1) * dk), range(h * dv, (h + 1) * dv)
        for i, q in enumerate(Q):
            s = [_sum(q[t] * k[t] for t in qs) * (1 / mp.sqrt(dk)) for k in K]
            top = max(x.a for x in s)
            e = [(x - top).exp() for x in s]
            r = _sum(e).recip()
            out[i] += [_sum(e[j] * r * V[j][c] for j in range(len(V))) for c in vs]
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
    A = _attention(X, p, cfg.n_heads, cfg.head_dim)
    if cfg.kind == "attention":
        return A
    Y = _layernorm(_add(X, A))
    F = _matmul([[h.relu() for h in row] for row in _matmul(Y, p["W_1"])], p["W_2"])
    return _layernorm(_add(Y, F))


def along(params, X, T, cfg, v, w):
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


def covers(cfg: bh.BlockConfig, loss, wrt_input: bool) -> bool:
    """Whether :func:`dense_hessians` computes this case: MSE over the weights, the bare attention
    layer without biases, output projection or mask (or the default block, one head), none of the
    Llama-family options (``qkv_bias``, :attr:`~blockhess.BlockConfig.llama_options`), at most
    ``MAX_VARIABLES`` weights."""
    if loss != "mse" or wrt_input or cfg.bias or cfg.out_proj or cfg.causal or cfg.qkv_bias or cfg.llama_options:
        return False
    if cfg.kind == "block" and not (cfg.n_heads == 1 and cfg.norm == "post" and cfg.activation == "relu"
                                    and not cfg.ln_affine and cfg.ln_eps == 0.0):
        return False
    return sum(torch.Size(s).numel() for s in bh.param_shapes(cfg).values()) <= MAX_VARIABLES


def dense_hessians(params, X, T, cfg):
    """``(full, outer, functional)``: the MSE loss Hessian over the weights (``vec_r``, in the
    order of ``params``), float64 ``(n, n)`` each, rounded from 40 digits. ``X`` ``(L, d)`` or
    ``(B, L, d)``, ``T`` of its shape; a case :func:`covers`."""
    params = {k: params[k] for k in bh.param_shapes(cfg)}  # the order of the result's names
    Xb, Tb = (X[None], T[None]) if X.ndim == 2 else (X, T)
    n = sum(t.numel() for t in params.values())
    I = torch.eye(n, dtype=torch.float64)
    out = [torch.zeros(n, n, dtype=torch.float64) for _ in range(3)]
    for i in range(n):
        for j in range(i, n):
            for M, value in zip(out, along(params, Xb, Tb, cfg, I[i], I[j])):
                M[i, j] = M[j, i] = float(value)
    return tuple(out)
