r"""Multi-head softmax self-attention and its closed-form derivatives (paper §2.2–2.3, extended).

Per head ``h`` (columns ``h·d_k:(h+1)·d_k`` of ``W_Q, W_K``, ``h·d_v:(h+1)·d_v`` of ``W_V``):
:math:`O_h = A_h V_h`, :math:`A_h = \mathrm{softmax}_{row}(T_h [+ \text{causal mask}])`,
:math:`T_h = Q_h K_h^\top/\sqrt{d_k}`, :math:`Q = XW_Q + b_Q`, :math:`K = XW_K + b_K`,
:math:`V = XW_V + b_V`; the output ``O`` concatenates the heads (``F`` in the paper's
one-head notation). Notation per head: :math:`S_l = \mathrm{diag}(a_l) - a_l a_l^\top`
(softmax Jacobian of row ``l``), :math:`s = 1/\sqrt{d_k}`. A mask (causal: ``m > l``; a key padding
mask; any boolean ``(B, L, L)`` of the pairs allowed) sets ``a_lm = 0`` on the pairs it masks; every
formula below holds unchanged (``S_l`` and ``Ψ_l`` vanish on masked entries). A query row with no key
allowed has ``a_l = 0`` (its output is zero, ``b_V``'s too; docs/derivations.md §22).

First derivatives (Noci et al. Lemma A.2 as in the paper, §2.2), per output token ``l``,
rows of head ``h``'s output block:

* :math:`G_Q`: :math:`x_l^\top \otimes s V_h^\top S_l K_h` (``b_Q``: the same without ``x_l``);
* :math:`G_K`: :math:`s V_h^\top S_l X \otimes q_{l,h}^\top` (the paper's :math:`K_{d_K,d_V}` factor,
  typo 2 of docs/derivations.md §15, is absorbed in the right-Kronecker layout); ``b_K``: exactly zero
  (:math:`S_l \mathbf 1 = 0`: softmax is shift-invariant per row);
* :math:`G_V`: :math:`(A_h X)_l^\top \otimes I_{d_v}`; ``b_V``: the identity (rows of ``A`` sum to 1).

Second derivatives contracted with an output weight ``G`` (the Φ blocks of §2.3 with
:math:`R` applied; derived here, docs/derivations.md §4): per head, with
:math:`\phi = \sum_{lj} A_{lj} B_{lj}`, :math:`B = G_h V_h^\top`,

* T–T curvature :math:`\Psi_l = \sum_j B_{lj}\nabla^2 A_{lj}` sandwiched by :math:`\partial T_l/\partial W_{Q,K}`;
* the bilinear Q–K term :math:`\delta_{bb'}\,s\,(X^\top \Gamma_T X)_{aa'}`, :math:`\Gamma_T = \partial\phi/\partial T`;
* the T–W_V cross term, rows :math:`S_l X \otimes G_l^\top`; and :math:`\Phi_{VV} = 0`.

Derivatives w.r.t. the input ``X`` (dense within a sequence): :func:`input_jacobian` and
:func:`contract_input_hessian`.

Grouped-query attention (``G`` key/value heads, query head ``h`` reading key/value head
``h // (H/G)``), a value width ``d_v`` with ``H·d_v`` other than the input width, and rotary
embeddings (:math:`Q_l \mapsto Q_l R_l`, :math:`K_m \mapsto K_m R_m` per head, ``R_l`` the rotate-half
rotation of token ``l`` at its position) have the directional derivatives (:func:`tangent`, :func:`adjoint`,
:func:`second_adjoint`): the key/value tangents are repeated over each group and the adjoints summed
over it, the rotation applied to the projections' tangents and its transpose to their adjoints
(docs/derivations.md §20). The Kronecker-factor functions refuse them by name.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as Fn

from ..kronecker import TokenKron
from . import linear, softmax
from .linear import add
from .protocol import Contraction

__all__ = ["Cache", "forward", "allowed", "masked_softmax", "rope_tables", "weight_jacobians", "input_jacobian", "contract_hessian",
           "contract_input_hessian", "head_names", "NAMES",
           # directional derivatives, for a matrix-free product (docs/derivations.md §18)
           "Tangent", "Adjoint", "tangent", "adjoint", "second_adjoint"]

NAMES = ("W_Q", "W_K", "W_V")


class Cache(NamedTuple):
    """Forward quantities of one batch of sequences, all with leading batch axis ``B``."""

    X: torch.Tensor  # (B, L, d) attention input
    Q: torch.Tensor  # (B, L, H*d_k), bias included
    K: torch.Tensor  # (B, L, H*d_k)
    V: torch.Tensor  # (B, L, d)
    A: torch.Tensor  # (B, L, L) for one head, (B, H, L, L) for several
    F: torch.Tensor  # (B, L, d): the concatenated head outputs O
    scale: float  # 1/sqrt(d_k)
    n_heads: int = 1
    n_kv: int | None = None  # key/value heads G (None: n_heads); K is (B, L, G*d_k), V (B, L, G*d_v)
    rope: tuple | None = None  # (cos, sin), each (L, d_k) or (B, 1, L, d_k): Q and K above are rotated (after the bias)
    mask: torch.Tensor | None = None  # (B, L, L) or (L, L) bool, True where query l may attend to key m; None: every pair


def _plain(c: Cache, what: str) -> None:
    """Refuse, by name, a Kronecker-factor function on attention it does not cover (docs/derivations.md §20)."""
    H = c.n_heads
    options = [o for o, on in (("n_kv_heads", c.n_kv is not None and c.n_kv != H), ("rope", c.rope is not None),
                               ("d_v", c.F.shape[-1] != c.X.shape[-1])) if on]
    if options:
        raise NotImplementedError(f"attention.{what}: the Kronecker factors do not cover {', '.join(options)}; "
                                  "the matrix-free products (attention.tangent, attention.second_adjoint) do")


def rope_tables(L: int, d_k: int, theta: float, like: torch.Tensor,
                positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` in ``like``'s dtype and device: HF's default rotary tables, angle
    ``l · theta^(-2i/d_k)`` at entries ``i`` and ``i + d_k/2`` of a token at position ``l`` (computed
    in float64, then cast); each ``(L, d_k)`` at positions ``0..L-1``, or ``(B, 1, L, d_k)`` (broadcast
    over the heads) at the integer ``positions`` ``(B, L)``."""
    inv = theta ** (-torch.arange(0, d_k, 2, dtype=torch.float64) / d_k)
    pos = torch.arange(L, dtype=torch.float64) if positions is None else positions.to(torch.float64).cpu()[:, None]
    ang = pos[..., None] * inv
    ang = torch.cat([ang, ang], -1)
    return ang.cos().to(like.dtype).to(like.device), ang.sin().to(like.dtype).to(like.device)


def _signed(sin: torch.Tensor, transpose: bool) -> torch.Tensor:
    """The rotation's sine table with the signs of rotate-half folded in: with ``rotate_half(t) = [-t_2, t_1]``
    (halves ``1`` and ``2`` of the last axis) and ``roll(t, d_k/2) = [t_2, t_1]``, ``rotate_half(t) ⊙ sin`` is
    ``roll(t, d_k/2) ⊙ [-sin_1, sin_2]`` (``transpose=False``) and ``-rotate_half(t ⊙ sin)`` is
    ``roll(t, d_k/2) ⊙ [sin_2, -sin_1]`` (``transpose=True``)."""
    h = sin.shape[-1] // 2
    lo, hi = sin[..., :h], sin[..., h:]
    return torch.cat([hi, -lo] if transpose else [-lo, hi], -1)


def rotate(t, cs):
    """``t R_l`` per token: ``t ⊙ cos + rotate_half(t) ⊙ sin`` for ``t`` ``(..., L, d_k)`` (``None``: ``None``;
    ``cs`` ``None``: ``t``), the half-swap taken as a roll with the signs in the table (:func:`_signed`)."""
    if t is None or cs is None:
        return t
    t = t.contiguous()  # a product's strided layout laid out once: the roll of a strided tensor is far slower
    return torch.addcmul(t * cs[0], t.roll(t.shape[-1] // 2, -1), _signed(cs[1], False))


def unrotate(t, cs):
    """The transpose, ``t R_lᵀ``: ``t ⊙ cos - rotate_half(t ⊙ sin)`` (``rotate_half`` is antisymmetric),
    as :func:`rotate` with the transpose's signs."""
    if t is None or cs is None:
        return t
    t = t.contiguous()  # as in rotate
    return torch.addcmul(t * cs[0], t.roll(t.shape[-1] // 2, -1), _signed(cs[1], True))


def _kv(c: Cache, t):
    """Key/value rows ``(..., B, L, G·w)`` as the query heads read them, ``(..., B, H, L, w)`` (each of
    the ``G`` heads repeated for its ``H/G`` query heads); ``None``: ``None``."""
    return None if t is None else _repeat(c, _heads(t, c.n_kv or c.n_heads))


def _repeat(c: Cache, th: torch.Tensor) -> torch.Tensor:
    """``(..., B, G, L, w) -> (..., B, H, L, w)``: each key/value head repeated for its ``H/G`` query heads."""
    G = th.shape[-3]
    return th if G == c.n_heads else th.repeat_interleave(c.n_heads // G, dim=-3)


def _kv_sum(c: Cache, t):
    """The adjoint of :func:`_kv` before the merge: ``(..., B, H, L, w) -> (..., B, G, L, w)``, summed over each group."""
    G = c.n_kv or c.n_heads
    if t is None or G == c.n_heads:
        return t
    v = t.reshape(*t.shape[:-3], G, c.n_heads // G, *t.shape[-2:])  # a view: the head axis split
    out = v[..., 0, :, :] + v[..., 1, :, :]  # the group's heads added one by one (faster than a reduction on strides)
    for i in range(2, v.shape[-3]):
        out += v[..., i, :, :]
    return out


class Head(NamedTuple):
    """One head's slices of a :class:`Cache` (views; the whole cache for one head)."""

    X: torch.Tensor
    Q: torch.Tensor  # (B, L, d_k)
    K: torch.Tensor
    V: torch.Tensor  # (B, L, d_v)
    A: torch.Tensor  # (B, L, L)
    F: torch.Tensor  # (B, L, d_v)
    scale: float
    cols: slice  # this head's output columns (of O, W_V)
    qk: slice  # this head's query/key columns (of W_Q, W_K)


def head_names(n_heads: int, h: int) -> dict[str, str]:
    """Internal names of head ``h``'s column groups: ``W_Q#h`` etc. (the public names for one head)."""
    if n_heads == 1:
        return {n: n for n in ("W_Q", "b_Q", "W_K", "W_V")}
    return {n: f"{n}#{h}" for n in ("W_Q", "b_Q", "W_K", "W_V")}


def head(c: Cache, h: int) -> Head:
    """Head ``h`` of ``c`` as a single-head cache (views)."""
    H = c.n_heads
    dk, dv = c.Q.shape[-1] // H, c.V.shape[-1] // H
    qk, cols = slice(h * dk, (h + 1) * dk), slice(h * dv, (h + 1) * dv)
    A = c.A if H == 1 else c.A[:, h]
    if H == 1:
        return Head(X=c.X, Q=c.Q, K=c.K, V=c.V, A=A, F=c.F, scale=c.scale, cols=cols, qk=qk)
    return Head(X=c.X, Q=c.Q[..., qk], K=c.K[..., qk], V=c.V[..., cols], A=A, F=c.F[..., cols], scale=c.scale, cols=cols,
                qk=qk)


def allowed(L: int, causal: bool, mask: torch.Tensor | None, device) -> torch.Tensor | None:
    """The boolean ``(…, L, L)`` of the pairs (query ``l``, key ``m``) attended: ``mask`` (``(B, L, L)`` or
    ``(L, L)``, True = attend; ``None``: every pair) and, with ``causal``, ``m <= l``; ``None`` when every
    pair is. Kernel: no checks."""
    if causal:
        tril = torch.ones(L, L, dtype=torch.bool, device=device).tril()
        return tril if mask is None else mask & tril
    return mask


def masked_softmax(T: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``softmax(T)`` over the keys ``mask`` allows (``(B, L, L)`` or ``(L, L)``, broadcast over the heads of
    ``T`` ``(B, L, L)`` or ``(B, H, L, L)``), exactly 0 elsewhere; a row with no key allowed is all zeros
    (its output ``A V`` is zero; docs/derivations.md §22). Kernel: no checks."""
    if mask is None:
        return softmax.forward(T)
    m = mask if T.ndim == 3 or mask.ndim == 2 else mask[:, None]
    empty = ~m.any(-1, keepdim=True)
    A = softmax.forward(T.masked_fill(~(m | empty), float("-inf")))  # an empty row: a finite softmax, zeroed below
    return A.masked_fill(empty, 0.0) if bool(empty.any()) else A


def forward(X: torch.Tensor, W_Q: torch.Tensor, W_K: torch.Tensor, W_V: torch.Tensor, b_Q=None, b_K=None,
            b_V=None, n_heads: int = 1, causal: bool = False, n_kv_heads: int | None = None,
            rope_theta: float | None = None, mask: torch.Tensor | None = None,
            positions: torch.Tensor | None = None) -> Cache:
    """Self-attention on ``X`` of shape ``(B, L, d)``; returns the :class:`Cache` (``.F`` is the
    concatenated output ``O``, ``(B, L, H·d_v)``). One head, no biases, no mask: the paper's
    ``F = softmax(X W_Q W_K^T X^T / sqrt(d_k)) X W_V``. ``n_kv_heads``: grouped key/value heads;
    ``rope_theta``: rotary embeddings of that base on the queries and keys (after the biases), at
    ``positions`` ``(B, L)`` (integers; ``None``: ``0..L-1``). ``mask``: the pairs attended, boolean
    ``(B, L, L)`` or ``(L, L)`` (True = attend), with ``causal`` too where set (:func:`allowed`,
    :func:`masked_softmax`). No checks (kernel)."""
    H = n_heads
    mask = allowed(X.shape[1], causal, mask, X.device)
    if (n_kv_heads is not None and n_kv_heads != H) or rope_theta is not None:
        return _forward_general(X, W_Q, W_K, W_V, b_Q, b_K, b_V, H, mask, n_kv_heads or H, rope_theta, positions)
    scale = 1.0 / math.sqrt(W_Q.shape[1] // H)
    Q, K, V = X @ W_Q, X @ W_K, X @ W_V
    if b_Q is not None:
        Q = Q + b_Q
    if b_K is not None:
        K = K + b_K
    if b_V is not None:
        V = V + b_V
    B, L, _ = X.shape
    if H == 1:
        T = Q @ K.transpose(-1, -2) * scale
    else:
        Qh = Q.reshape(B, L, H, -1).transpose(1, 2)
        Kh = K.reshape(B, L, H, -1).transpose(1, 2)
        T = Qh @ Kh.transpose(-1, -2) * scale
    A = masked_softmax(T, mask)
    if H == 1:
        F = A @ V
    else:
        F = (A @ V.reshape(B, L, H, -1).transpose(1, 2)).transpose(1, 2).reshape(B, L, -1)
    return Cache(X=X, Q=Q, K=K, V=V, A=A, F=F, scale=scale, n_heads=H, mask=mask)


def _forward_general(X, W_Q, W_K, W_V, b_Q, b_K, b_V, H: int, mask, G: int, theta, positions) -> Cache:
    """:func:`forward` with ``G`` key/value heads and/or rotary embeddings (``theta`` or ``None``)."""
    B, L, _ = X.shape
    dk = W_Q.shape[1] // H
    scale = 1.0 / math.sqrt(dk)
    Q, K, V = X @ W_Q, X @ W_K, X @ W_V
    Q, K, V = (t if b is None else t + b for t, b in ((Q, b_Q), (K, b_K), (V, b_V)))
    cs = None if theta is None else rope_tables(L, dk, theta, X, positions)
    Q, K = _merge(rotate(_heads(Q, H), cs)), _merge(rotate(_heads(K, G), cs))
    c = Cache(X=X, Q=Q, K=K, V=V, A=None, F=None, scale=scale, n_heads=H, n_kv=G, rope=cs, mask=mask)
    T = _heads(Q, H) @ _kv(c, K).transpose(-1, -2) * scale
    A = masked_softmax(T, mask)
    F = _merge(A @ _kv(c, V))
    return c._replace(A=A if H > 1 else A[:, 0], F=F)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """Merge the batch and token axes: ``(B, L, ...) -> (B*L, ...)``."""
    return t.reshape(-1, *t.shape[2:])


def _vt_s(c, M: torch.Tensor) -> torch.Tensor:
    """``V^T S_l M`` for every token ``l``: ``(B, L, d_v, m)`` for ``M`` of shape ``(B, L, m)``."""
    return c.V.transpose(-1, -2)[:, None] @ softmax.apply_row_jacobians(c.A, M[:, None])  # V^T (S_l M)


def _pad_rows(t: torch.Tensor, cols: slice, d: int) -> torch.Tensor:
    """Place a head's output rows ``(…, d_v, m)`` at rows ``cols`` of a ``(…, d, m)`` block."""
    if t.shape[-2] == d:
        return t
    return Fn.pad(t, (0, 0, cols.start, d - cols.stop))


def weight_jacobians(c: Cache, names=None) -> dict[str, TokenKron]:
    """``∂O/∂W`` per token over ``B·L`` tokens, keyed by internal name (per head ``W_Q#h``, ``b_Q#h``,
    ``W_K#h``, ``W_V#h`` for several heads; ``W_Q`` etc. for one), plus ``b_V``.

    ``names``: the public names wanted (default ``W_Q, W_K, W_V``); only their factors are
    formed. ``b_K`` gets no factor: its Jacobian is exactly zero (softmax is shift-invariant per row).
    Returns ``{name: TokenKron}`` (:class:`blockhess.kronecker.TokenKron`; ``.dense()`` is the
    ``(B·L·d_model, numel)`` Jacobian, ``vec_r`` columns). Source: Theorem 1's first
    derivatives (paper §2.2, Ormaniec et al.). Kernel: no checks.
    """
    _plain(c, "weight_jacobians")
    names = NAMES if names is None else names
    B, L, d = c.X.shape
    eye = torch.eye(d, dtype=c.X.dtype, device=c.X.device)
    out = {}
    for h in range(c.n_heads):
        hd, nm = head(c, h), head_names(c.n_heads, h)
        if "W_Q" in names or "b_Q" in names:
            GQ = _pad_rows(_flat(_vt_s(hd, hd.K)) * c.scale, hd.cols, d)
            out[nm["W_Q"]] = TokenKron("left", _flat(c.X), GQ)
            if "b_Q" in names:
                out[nm["b_Q"]] = TokenKron("vector", None, GQ)
        if "W_K" in names:
            out[nm["W_K"]] = TokenKron("right", _flat(hd.Q), _pad_rows(_flat(_vt_s(hd, c.X)) * c.scale, hd.cols, d))
        if "W_V" in names:
            out[nm["W_V"]] = TokenKron("left", _flat(hd.A @ c.X),
                                       eye[:, hd.cols].expand(B * L, d, hd.cols.stop - hd.cols.start))
    if "b_V" in names:
        bV = eye.expand(B * L, d, d)
        if c.mask is not None:  # a row with no key allowed has a zero output, b_V's part of it too
            live = c.mask.expand(B, L, L).any(-1).reshape(-1)
            bV = bV if bool(live.all()) else bV * live.to(eye.dtype)[:, None, None]
        out["b_V"] = TokenKron("vector", None, bV)
    return out


def _input_terms(hd: Head, W_Q, W_K):
    """``κ = s K W_Q^T`` and ``w = s Q W_K^T`` (``(B, L, d)`` each) for one head:
    ``∂T_lm/∂X_pa = δ_lp κ_ma + δ_mp w_la``."""
    return hd.K @ W_Q[:, hd.qk].T * hd.scale, hd.Q @ W_K[:, hd.qk].T * hd.scale


def input_jacobian(c: Cache, W_Q: torch.Tensor, W_K: torch.Tensor, W_V: torch.Tensor, compact: bool = False) -> torch.Tensor:
    r"""``dO/dX`` per sequence: ``(B, L·d, L·d)``, rows ``(l, c)``, columns ``(m, a)``; or
    ``(B, L, d, L, d)`` with ``compact=True``.

    Per head, :math:`\partial O_{lc}/\partial X_{ma} = A_{lm} (W_V)_{ac} + \delta_{lm}(V^\top S_l \kappa)_{ca}
    + (V^\top S_l)_{cm}\, w_{la}`, :math:`\kappa = s K W_Q^\top`, :math:`w = s Q W_K^\top`
    (biases included in ``Q``, ``K``, ``V``). Derived here (docs/derivations.md §4).
    """
    _plain(c, "input_jacobian")
    B, L, d = c.X.shape
    eye = torch.eye(L, dtype=c.X.dtype, device=c.X.device)
    parts = []
    for h in range(c.n_heads):
        hd = head(c, h)
        kappa, w = _input_terms(hd, W_Q, W_K)
        S = softmax.row_jacobians(hd.A)  # (B, L, L, L)
        VtS = torch.einsum("bjc,bljm->blcm", hd.V, S)  # (B, L, d_v, L): V^T S_l
        J = hd.A[:, :, None, :, None] * W_V[:, hd.cols].T[None, None, :, None, :]
        J = J + eye[None, :, None, :, None] * (VtS @ kappa[:, None])[:, :, :, None, :]
        J = J + VtS[..., None] * w[:, :, None, None, :]
        parts.append(J)
    J = parts[0] if len(parts) == 1 else torch.cat(parts, 2)
    return J if compact else J.reshape(B, L * d, L * d)


def contract_hessian(c: Cache, G: torch.Tensor, acc, names=None) -> Contraction:
    r"""Add the blocks of :math:`\sum_{b,l,c} G_{blc}\,\nabla^2_{W} O_{blc}` over the attention weights to ``acc``.

    ``G`` has the shape of ``O``, ``(B, L, d)``; the blocks sum over the batch. ``acc`` is a
    :class:`~blockhess.result.BlockSum` (or anything with its ``wants``/``add``/``add_sandwich``/``add_diagonal``)
    over internal names (:func:`head_names`); only the pairs it wants are computed.
    ``names``: the public names present (``b_Q`` is the only bias with curvature here:
    ``b_K`` has none and ``b_V`` enters linearly with :math:`S_l\mathbf 1 = 0`). The
    ``(W_V, W_V)`` block is exactly zero (O is linear in ``W_V``) and is never added.
    With ``G = (2/(L d)) (F - Target)`` this is Ormaniec et al.'s functional Hessian
    (Theorem 3.2); with one-hot ``G`` it gives the Φ blocks of paper §2.3.
    Returns the :class:`~blockhess.layers.protocol.Contraction` with nothing left to finish: every
    block is among the attention's own weights (its input curvature, dense within a sequence, is
    :func:`contract_input_hessian`, formed only when the input is a variable).
    Derived here (docs/derivations.md §4). No checks (kernel).
    """
    _plain(c, "contract_hessian")
    names = NAMES if names is None else names
    for h in range(c.n_heads):
        _contract_head(head(c, h), G[..., head(c, h).cols], acc, head_names(c.n_heads, h), "b_Q" in names)
    return Contraction(gamma=None, cross={}, core={})


def _contract_head(c: Head, G: torch.Tensor, acc, nm: dict, has_bQ: bool) -> None:
    B, L, d = c.X.shape
    nQ, nbQ, nK, nV = nm["W_Q"], nm["b_Q"], nm["W_K"], nm["W_V"]
    Bm = G @ c.V.transpose(-1, -2)  # (B, L, L): B_lj = G_l . V_j
    Psi = _flat(softmax.contract_hessian_unchecked(c.A, Bm))  # (B*L, L, L)

    def per_token(t):  # the sequence's (L, m) matrix, once per token: (B*L, L, m)
        return _flat(t[:, None].expand(B, L, *t.shape[1:]))

    sK = per_token(c.K) * c.scale
    dT = {  # ∂T_l/∂W per token, rows = the L keys
        nQ: TokenKron("left", _flat(c.X), sK),
        nK: TokenKron("right", _flat(c.Q), per_token(c.X) * c.scale),
    }
    order = [nQ, nK]
    if has_bQ:
        dT[nbQ] = TokenKron("vector", None, sK)
        order = [nQ, nbQ, nK]
    for i, a in enumerate(order):
        for b in order[i:]:
            if acc.wants(a, b):
                acc.add_sandwich(a, b, dT[a], dT[b], Psi)
    want_qk, want_bk = acc.wants(nQ, nK), has_bQ and acc.wants(nbQ, nK)
    if want_qk or want_bk:  # T is bilinear in (Q, K): δ_bb' s (X^T Γ_T X)_aa'
        grad_T = softmax.apply_row_jacobians(c.A, Bm[..., None])[..., 0]  # dφ/dT, row l = S_l b_l
        dk = c.Q.shape[-1]
        if want_qk:
            P = (c.X.transpose(1, 2) @ (grad_T @ c.X)).sum(0) * c.scale  # Σ_b X_bᵀ (∂φ/∂T)_b X_b
            acc.add_diagonal(nQ, nK, 1, 3, P[:, :, None].expand(*P.shape, dk))
        if want_bk:
            p = torch.einsum("blj,bja->a", grad_T, c.X) * c.scale
            acc.add_diagonal(nbQ, nK, 0, 2, p[:, None].expand(d, dk))
    cross = [a for a in order if acc.wants(a, nV)]
    if cross:
        SX = softmax.apply_row_jacobians(c.A, c.X[:, None])  # (B, L, L, d): S_l X
        cross_V = TokenKron("right", _flat(G), _flat(SX))  # ∂²φ/∂T_l ∂W_V, rows = keys
        for a in cross:
            acc.add_sandwich(a, nV, dT[a], cross_V)


def contract_input_hessian(c: Cache, G: torch.Tensor, W_Q, W_K, W_V, names=None, weights: bool = True):
    r"""Second derivatives of :math:`\phi = \sum G \odot O` involving the input ``X`` (per sequence).

    Returns ``(XX, XW)``: ``XX`` of shape ``(B, L, d, L, d)`` (:math:`\partial^2\phi/\partial X\partial X`),
    and ``XW`` a dict internal name → ``(B, L, d, *shape)`` (:math:`\partial^2\phi/\partial X\partial W`) for
    ``W_Q``, ``b_Q``, ``W_K``, ``W_V`` of every head (``weights=False`` skips them); the
    other biases have none. Per head, with :math:`D_l[m,(p,a)] = \delta_{lp}\kappa_{ma} + \delta_{mp} w_{la}`
    (:math:`\partial T_l/\partial X`), :math:`\Gamma_T`, :math:`\Psi_l` as in :func:`contract_hessian`:
    :math:`\sum_l D_l^\top \Psi_l D_l + \sum_l (D_l^\top S_l e\, (W_V G_l)^\top + \text{transpose})
    + s(\Gamma_T \otimes W_QW_K^\top + \text{transpose})` and the matching terms per weight
    (docs/derivations.md §4). No checks (kernel).
    """
    _plain(c, "contract_input_hessian")
    names = NAMES if names is None else names
    B, L, d = c.X.shape
    X = c.X
    eye_d = torch.eye(d, dtype=X.dtype, device=X.device)
    XX = X.new_zeros(B, L, d, L, d)
    XW = {}
    for h in range(c.n_heads):
        hd, nm = head(c, h), head_names(c.n_heads, h)
        Gh = G[..., hd.cols]
        s = hd.scale
        kappa, w = _input_terms(hd, W_Q, W_K)  # (B, L, d)
        Bm = Gh @ hd.V.transpose(-1, -2)
        Psi = softmax.contract_hessian_unchecked(hd.A, Bm)  # (B, L, L, L) [l, m, n]
        S = softmax.row_jacobians(hd.A)  # (B, L, L, L)
        Gam = softmax.apply_row_jacobians(hd.A, Bm[..., None])[..., 0]  # (B, L, L): S_l b_l
        gv = Gh @ W_V[:, hd.cols].T  # (B, L, d): W_V G_l
        M = W_Q[:, hd.qk] @ W_K[:, hd.qk].T  # (d, d)
        # X–X: T–T curvature
        PsiK = torch.einsum("bpmn,bma->bpan", Psi, kappa)  # (κ^T Ψ_p)[a, n]
        t = torch.einsum("bpan,bnc->bpac", PsiK, kappa)  # κ^T Ψ_p κ on the (p, p) diagonal
        XXh = torch.diag_embed(t.permute(0, 2, 3, 1), dim1=1, dim2=3)  # (B, L, d, L, d)
        t2 = PsiK[..., None] * w[:, :, None, None, :]  # [(p,a),(q,b)] = (κ^TΨ_p)[a,q] w_p[b]
        t4 = torch.einsum("blpq,bla,blc->bpaqc", Psi, w, w)
        # T–V cross: (D_l^T S_l)[(p,a), q] (W_V G_l)[b]
        SK = torch.einsum("bpmq,bma->bpaq", S, kappa)  # (κ^T S_p)[a, q]
        t5 = SK[..., None] * gv[:, :, None, None, :] + torch.einsum("blpq,bla,blc->bpaqc", S, w, gv)
        t3 = s * Gam[:, :, None, :, None] * M[None, None, :, None, :]
        sym = t2 + t5 + t3
        XXh = XXh + t4 + sym + sym.permute(0, 3, 4, 1, 2)
        XX = XX + XXh
        if not weights:
            continue
        # X–W blocks, layout (z, p, e, *W) with (p, e) the entry of X (batch axis z)
        sKm = hd.K * s  # (B, L, dk)
        PsiKs = Psi @ sKm[:, None]  # (B, L, L, dk): Ψ_l sK
        SKs = S @ sKm[:, None]  # S_l sK
        W_Qh, W_Kh = W_Q[:, hd.qk], W_K[:, hd.qk]
        t1 = torch.einsum("zme,zpmc->zpec", kappa, PsiKs)  # (κ^T Ψ_p sK)[e, c]
        tw = torch.einsum("zle,zlpc->zpec", w, PsiKs) + torch.einsum("zlpc,zle->zpec", SKs, gv)
        XQ = torch.einsum("zpa,zpec->zpeac", X, t1)
        XQ = XQ + torch.einsum("zla,zle,zlpc->zpeac", X, w, PsiKs) + torch.einsum("zla,zlpc,zle->zpeac", X, SKs, gv)
        XQ = XQ + (Gam @ sKm)[:, :, None, None, :] * eye_d[None, None, :, :, None]
        XQ = XQ + s * torch.einsum("zla,zlp,ec->zpeac", X, Gam, W_Kh)
        XW[nm["W_Q"]] = XQ
        if "b_Q" in names:
            XW[nm["b_Q"]] = t1 + tw + s * Gam.sum(1)[:, :, None, None] * W_Kh[None, None]
        sX = X * s
        PsiX = Psi @ sX[:, None]  # (B, L, L, d): Ψ_l sX
        SXs = S @ sX[:, None]
        XK = torch.einsum("zme,zpma,zpc->zpeac", kappa, PsiX, hd.Q) + torch.einsum("zle,zlpa,zlc->zpeac", w, PsiX, hd.Q)
        XK = XK + torch.einsum("zlc,zlpa,zle->zpeac", hd.Q, SXs, gv)
        XK = XK + s * (Gam @ X)[:, :, None, :, None] * W_Qh[None, None, :, None, :]
        XK = XK + s * (Gam.transpose(1, 2) @ hd.Q)[:, :, None, None, :] * eye_d[None, None, :, :, None]
        XW[nm["W_K"]] = XK
        SX1 = S @ X[:, None]  # (B, L, L, d): S_l X
        XV = torch.einsum("zme,zpma,zpc->zpeac", kappa, SX1, Gh) + torch.einsum("zle,zlpa,zlc->zpeac", w, SX1, Gh)
        XV = XV + (hd.A.transpose(1, 2) @ Gh)[:, :, None, None, :] * eye_d[None, None, :, :, None]
        XW[nm["W_V"]] = XV
    return XX, XW


class Tangent(NamedTuple):
    """The attention's tangents along ``k`` directions (:func:`tangent`); ``None`` where zero.
    Heads split: ``(k, B, H, L, ·)``."""

    dQ: torch.Tensor | None  # (k, B, H, L, d_k), the query tangent (bias included)
    dK: torch.Tensor | None  # (k, B, H, L, d_k)
    dV: torch.Tensor | None  # (k, B, H, L, d_v)
    dA: torch.Tensor | None  # (k, B, H, L, L), the attention weights' tangent
    dF: torch.Tensor | None  # (k, B, L, d), the concatenated output's tangent
    m: torch.Tensor | None = None  # (B, H, L, 1) softmax.peaks(A), the shift the softmax's products use


class Adjoint(NamedTuple):
    """The attention's first-order adjoints of an output adjoint ``g_F`` (:func:`adjoint`), computed
    once per operator: heads split ``(B, H, L, ·)``, projections merged ``(B, L, ·)``."""

    gO: torch.Tensor  # (B, H, L, d_v) the output adjoint per head
    u: torch.Tensor  # (B, H, L, L) softmax.centred of g_A = g_O V^T: g_T = A ⊙ u
    gT: torch.Tensor  # (B, H, L, L) the scores' adjoint
    gQ: torch.Tensor  # (B, L, H·d_k)
    gK: torch.Tensor  # (B, L, H·d_k)
    gV: torch.Tensor  # (B, L, d)
    gX: torch.Tensor | None  # (B, L, d) the input's, or None (not asked)
    moments: dict | None = None  # W_Q, W_K, W_V -> linear.moments(n, g_Q) etc., for a Scaled input n (or None)
    m: torch.Tensor | None = None  # (B, H, L, 1) softmax.peaks(A), for the products' tangents


def _heads(t: torch.Tensor, H: int) -> torch.Tensor:
    """``(..., B, L, H·w) -> (..., B, H, L, w)`` (a view where it can be)."""
    return t.reshape(*t.shape[:-1], H, t.shape[-1] // H).transpose(-2, -3)


def _merge(t: torch.Tensor) -> torch.Tensor:
    """``(..., B, H, L, w) -> (..., B, L, H·w)``."""
    t = t.transpose(-2, -3)
    return t.reshape(*t.shape[:-2], -1)


def _weights(c: Cache) -> torch.Tensor:
    """``A`` with its head axis: ``(B, H, L, L)``."""
    return c.A if c.A.ndim == 4 else c.A[:, None]


#: a per-direction product of at most this many multiply-adds (``B·H·m·p·q``) is folded with the others into one
#: GEMM (:func:`_products`): below it the call per direction costs more than the copy of the directions' factor
FOLD_ENTRIES = 1 << 16


def _products(pairs, alpha: float = 1.0):
    """``alpha · Σ x @ y`` over the pairs ``(x, y)`` whose factors are both given (``None``: zero), one
    factor of each pair with the directions' axis ``(k, B, H, m, p)``, the other without it (shared by
    the ``k`` directions): one batched product over ``B·H`` per pair and direction, into the result's
    own slice, the sum and the scaling done by the GEMMs themselves (``baddbmm``), the shared factor
    never copied per direction; where each is small (:data:`FOLD_ENTRIES`), one product for every
    direction, the directions' factor laid out with ``k`` beside its rows (or columns) in one copy, the
    shared one scaled by ``alpha``; a pair with both factors per direction, one product over ``k·B·H``.
    Returns ``(k, B, H, m, q)``, contiguous (the elementwise work after it is slower on the product's own
    strided layout than one copy), or ``None`` when no pair has both factors."""
    out = None
    for x, y in pairs:
        if x is None or y is None:
            continue
        lead = (x if x.ndim == 5 else y).shape[:3]
        k = lead[0]
        (m, p), q = x.shape[-2:], y.shape[-1]
        n = lead[1] * lead[2]
        folded = k > 1 and n * m * p * q <= FOLD_ENTRIES and (x.ndim == 4 or y.ndim == 4)
        if folded:  # small products: the k directions folded into one GEMM's rows (or columns), laid out in one copy
            if x.ndim == 5:  # (B·H, k·m, p) @ (B·H, p, q)
                y3 = y.reshape(-1, p, q)
                r = torch.bmm(x.permute(1, 2, 0, 3, 4).reshape(n, k * m, p), y3 if alpha == 1.0 else y3 * alpha)
                r = r.view(n, k, m, q).transpose(0, 1)
            else:  # (B·H, m, p) @ (B·H, p, k·q)
                x3 = x.reshape(-1, m, p)
                r = torch.bmm(x3 if alpha == 1.0 else x3 * alpha, y.permute(1, 2, 3, 0, 4).reshape(n, p, k * q))
                r = r.view(n, m, k, q).permute(2, 0, 1, 3)
            out = r if out is None else out.add_(r)
            continue
        x3 = x.reshape(-1, m, p) if x.ndim == 4 else x.reshape(k, n, m, p)
        y3 = y.reshape(-1, p, q) if y.ndim == 4 else y.reshape(k, n, p, q)
        if x.ndim == 5 and y.ndim == 5:  # both per direction: one product over k·B·H
            if out is not None and out.is_contiguous():
                out.view(k * n, m, q).baddbmm_(x3.reshape(k * n, m, p), y3.reshape(k * n, p, q), alpha=alpha)
                continue
            r = torch.baddbmm(x3.new_empty(()), x3.reshape(k * n, m, p), y3.reshape(k * n, p, q), beta=0,
                              alpha=alpha).view(k, n, m, q)
        else:
            if out is None:
                out = x.new_empty(k, n, m, q)
                beta = 0
            else:
                beta = 1
            for i in range(k):
                xi, yi = (x3 if x.ndim == 4 else x3[i]), (y3 if y.ndim == 4 else y3[i])
                out[i].baddbmm_(xi, yi, beta=beta, alpha=alpha)  # beta 0: the empty slice ignored
            continue
        out = r if out is None else out.add_(r)
    return None if out is None else out.reshape(*lead, *out.shape[-2:]).contiguous()


def tangent(c: Cache, p: dict, dp: dict, dX=None, m=None) -> Tangent:
    r"""The tangents of the attention along ``k`` directions of its input ``dX`` ``(k, B, L, d)`` and
    weights ``dp`` (name → ``(k, *shape)``, absent or ``None``: zero), at the cached point ``c`` with
    weights ``p`` (``W_Q, W_K, W_V``, biases if present). Per head:

    .. math::
        \dot Q = \dot X W_Q + X\dot W_Q + \dot b_Q\ (\text{so } \dot K, \dot V),\quad
        \dot T = s(\dot Q K^\top + Q\dot K^\top),\quad \dot A = S\,\dot T\ (\text{row-wise}),\quad
        \dot O = \dot A V + A\dot V.

    ``b_K``'s direction is dropped: it moves every score of a row by one number, which softmax
    ignores (exactly zero). A causal mask needs nothing: ``\dot A`` is zero where ``A`` is.
    ``dX`` may be a :class:`~blockhess.layers.linear.Scaled` (the input a LayerNorm's output with
    nothing moving below it). ``m``: :func:`~blockhess.layers.softmax.peaks` of ``A`` (the
    :class:`Adjoint`'s; computed here when ``None``). Grouped key/value heads: :math:`\dot K, \dot V`
    repeated over each group; rotary embeddings: :math:`\dot Q_l R_l`, :math:`\dot K_m R_m` (then ``b_K``'s
    direction moves the scores of a row by ``b R_m``, different per key: it is kept). Returns the
    :class:`Tangent` (its ``dK``, ``dV`` per query head, rotated). Kernel: no checks."""
    H, s = c.n_heads, c.scale
    A = _weights(c)
    dQ = linear.tangent(c.X, p["W_Q"], dX, dp.get("W_Q"), dp.get("b_Q"))
    dK = linear.tangent(c.X, p["W_K"], dX, dp.get("W_K"), dp.get("b_K") if c.rope is not None else None)
    dV = linear.tangent(c.X, p["W_V"], dX, dp.get("W_V"), dp.get("b_V"))
    dQ = None if dQ is None else rotate(_heads(dQ, H), c.rope)
    dK = None if dK is None else _repeat(c, rotate(_heads(dK, c.n_kv or H), c.rope))  # rotated per K/V head, then repeated
    dV = _kv(c, dV)
    Qh, Kh, Vh = _heads(c.Q, H), _kv(c, c.K), _kv(c, c.V)
    dT = _products([(dQ, Kh.mT), (Qh, None if dK is None else dK.mT)], alpha=s)
    dA = None
    if dT is not None:
        m = softmax.peaks(A) if m is None else m
        dA = softmax.tangent(A, dT, m)
    dO = _products([(dA, Vh), (A, dV)])
    return Tangent(dQ=dQ, dK=dK, dV=dV, dA=dA, dF=None if dO is None else _merge(dO), m=m)


def adjoint(c: Cache, p: dict, gF: torch.Tensor, want_input: bool = False, n=None) -> Adjoint:
    r"""The first-order adjoints of the output adjoint ``gF`` ``(B, L, d)`` (the back-propagated
    gradient at ``O``): :math:`g_A = g_O V^\top`, :math:`g_T = S g_A`, :math:`g_V = A^\top g_O`,
    :math:`g_Q = s\,g_T K`, :math:`g_K = s\,g_T^\top Q` per head, and with ``want_input`` the input's
    :math:`g_X = g_Q W_Q^\top + g_K W_K^\top + g_V W_V^\top`. With ``n`` ``(B·L, d)``, the normalised
    rows of a LayerNorm whose output is the input (``c.X = n ⊙ γ + β``), the projections'
    :func:`~blockhess.layers.linear.moments` for a :class:`~blockhess.layers.linear.Scaled` input
    direction. Grouped heads and rotary embeddings: ``g_Q``, ``g_K``, ``g_V`` are the projections'
    (before the rotation: :math:`g R_l^\top`; summed over each group). Returns the :class:`Adjoint`. Kernel."""
    H, s = c.n_heads, c.scale
    A = _weights(c)
    gO = _heads(gF, H)
    Qh, Kh, Vh = _heads(c.Q, H), _kv(c, c.K), _kv(c, c.V)
    m = softmax.peaks(A)
    u = softmax.centred(A, gO @ Vh.transpose(-1, -2), m)
    gT = A * u
    gQ = _merge(unrotate(gT @ Kh, c.rope)) * s
    gK = _merge(unrotate(_kv_sum(c, gT.transpose(-1, -2) @ Qh), c.rope)) * s
    gV = _merge(_kv_sum(c, A.transpose(-1, -2) @ gO))
    gX = None
    if want_input:
        gX = linear.adjoint(p["W_Q"], gQ) + linear.adjoint(p["W_K"], gK) + linear.adjoint(p["W_V"], gV)
    mom = None if n is None else {w: linear.moments(n, g) for w, g in (("W_Q", gQ), ("W_K", gK), ("W_V", gV))}
    return Adjoint(gO=gO, u=u, gT=gT, gQ=gQ, gK=gK, gV=gV, gX=gX, moments=mom, m=m)


def second_adjoint(c: Cache, p: dict, dp: dict, a: Adjoint, t: Tangent, dgF, dX=None, second: bool = True,
                   want_input: bool = True, wanted=None, into=None) -> tuple:
    r"""``(dg_X, hv)``: the tangent of the input adjoint ``(k, B, L, d)`` (``None`` with
    ``want_input=False`` or when zero) and the attention weights' rows of the Hessian-vector
    product, ``hv`` name → ``(k, *shape)`` for each weight of ``p`` in ``wanted`` (default: every
    one; ``None`` where zero; ``b_K``'s is exactly zero, shift invariance). A weight not wanted is
    absent and costs nothing; without ``want_input`` only the projections whose rows are wanted are
    passed through (``W_V``'s rows alone skip ``ġ_A``, ``ġ_T``, ``ġ_Q``, ``ġ_K``). Per head, with ``[·]``
    the second-order (functional) terms that ``second=False`` drops (the Gauss–Newton product):

    .. math::
        \dot g_A = \dot g_O V^\top + [g_O\dot V^\top],\quad
        \dot g_T = S\dot g_A + [\dot A\odot u - A\odot(\dot A\cdot u)\mathbf 1^\top],\quad
        \dot g_V = A^\top\dot g_O + [\dot A^\top g_O],

        \dot g_Q = s(\dot g_T K + [g_T\dot K]),\quad \dot g_K = s(\dot g_T^\top Q + [g_T^\top\dot Q]),

    then each projection's :func:`~blockhess.layers.linear.second_adjoint`. ``c``, ``p`` as for
    :func:`tangent`, ``a`` the :func:`adjoint` of the cached output adjoint, ``t`` the
    :func:`tangent` along the same directions ``dp``, ``dX``; ``dgF`` ``(k, B, L, d)`` the output
    adjoint's tangent or ``None``. With a :class:`~blockhess.layers.linear.Scaled` ``dX`` (``a`` then
    from :func:`adjoint` with ``n``), ``dg_X`` is the pair :math:`(\sum\dot g_X\odot n, \sum\dot g_X)`
    ``(k, d)`` each, the LayerNorm's rows, instead of :math:`\dot g_X`. ``into``: name → a ``(k, *shape)``
    destination for a projection's rows (:func:`~blockhess.layers.linear.second_adjoint`'s ``out``), or
    ``None``. Derived in docs/derivations.md §18. Kernel: no checks."""
    H, s = c.n_heads, c.scale
    A = _weights(c)
    Qh, Kh, Vh = _heads(c.Q, H), _kv(c, c.K), _kv(c, c.V)
    dgO = None if dgF is None else _heads(dgF, H)
    rope = c.rope is not None
    m = a.m if a.m is not None else t.m
    if not second:
        t = Tangent(None, None, None, None, t.dF)

    def mT(x):
        return None if x is None else x.mT

    want = {n for n in p if n in NAMES + ("b_Q", "b_K", "b_V")} if wanted is None else set(wanted)
    need = {w: want_input or bool(want & {w, b}) for w, b in (("W_Q", "b_Q"), ("W_K", "b_K"), ("W_V", "b_V"))}
    if not rope:
        need["W_K"] = want_input or "W_K" in want  # b_K's rows are exactly zero: they need no pass
    dgQ = dgK = dgV = None
    if need["W_Q"] or need["W_K"]:
        dgA = _products([(dgO, Vh.mT), (a.gO, mT(t.dV))])
        dgT = softmax.second_adjoint(A, t.dA, a.u, dgA, m)
        if need["W_Q"]:
            dgQ = _products([(dgT, Kh), (a.gT, t.dK)], alpha=s)
        if need["W_K"]:
            dgK = _kv_sum(c, _products([(mT(dgT), Qh), (mT(a.gT), t.dQ)], alpha=s))
        dgQ, dgK = (None if v is None else _merge(unrotate(v, c.rope)) for v in (dgQ, dgK))
    if need["W_V"]:
        dgV = _kv_sum(c, _products([(A.mT, dgO), (mT(t.dA), a.gO)]))
        dgV = None if dgV is None else _merge(dgV)
    hv, dg_X = {}, None
    scaled = isinstance(dX, linear.Scaled)
    for w, b, g, dg in (("W_Q", "b_Q", a.gQ, dgQ), ("W_K", "b_K" if rope else None, a.gK, dgK),
                        ("W_V", "b_V", a.gV, dgV)):
        if not need[w]:
            continue
        mom = None if not (scaled and second) or a.moments is None else a.moments[w]
        x_in, hv_w, hb = linear.second_adjoint(c.X, p[w], g, dg, dX, dp.get(w), second, want_input,
                                               bias=b in p and b in want, weight=w in want, moments=mom,
                                               out=(into or {}).get(w))
        if scaled:  # the pair (Σ ġ_X ⊙ n, Σ ġ_X), summed over the projections
            dg_X = x_in if dg_X is None else (dg_X if x_in is None else tuple(map(add, dg_X, x_in)))
        else:
            dg_X = add(dg_X, x_in)
        if w in want:
            hv[w] = hv_w
        if b in p and b in want:
            hv[b] = hb
    if "b_K" in p and "b_K" in want and not rope:
        hv["b_K"] = None
    return dg_X, hv
