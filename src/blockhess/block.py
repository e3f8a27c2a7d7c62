r"""The post-LN Transformer block: forward, Jacobian (Theorem 4), second derivatives (Theorem 5).

.. math::
    U = X + F(X),\quad Y = \mathrm{LN}(U),\quad S = \mathrm{relu}(YW_1)W_2 + Y,\quad Z = \mathrm{LN}(S).

Every map after the attention scores acts token by token, so (Theorem 4), per token,

.. math::
    \frac{\partial Z}{\partial W_i} = J_Z B_i\ (i = 1, 2),\qquad
    \frac{\partial Z}{\partial W_k} = J_Z J_{SY} J_Y G_k\ (k = Q, K, V),

with per-token ``d×d`` factors :math:`J_Z, J_{SY}, J_Y` and :math:`G_k` from
:mod:`~blockhess.components.attention`. Theorem 5 (eq. 9),
:math:`\partial^2 Z/\partial W_i\partial W_j = (J_Z\otimes I)\xi_{ij} + (I\otimes B_i^\top) H_Z B_j`,
is evaluated contracted with an output weight ``g`` (what the loss Hessian needs):

.. math::
    \sum_o g_o \nabla^2 Z_o = B^\top \Gamma_Z(g) B + \xi(J_Z^\top g),\qquad
    \xi(g_S) = \text{FFN}(g_S) + G'^\top \Gamma_Y(g_Y) G' + \Phi(g_U),

:math:`g_Y = J_{SY}^\top g_S`, :math:`g_U = J_Y^\top g_Y`, :math:`\Gamma` the contracted LayerNorm
Hessians, Φ the contracted attention second derivatives. Contracting with every basis vector
gives the paper's dense layouts (:func:`second_derivative`). Derivation and the paper's
typos fixed on the way: docs/derivations.md.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .blocks import BlockSum, dense_second_derivative
from .components import attention, ffn, layernorm
from .config import BlockConfig, param_shapes
from .kronecker import TokenKron, sandwich
from .validation import check_ln_variance, check_params, check_tensor

__all__ = ["forward", "jacobian", "second_derivative"]

class Cache(NamedTuple):
    """Forward quantities of a batch; token axes merged to ``T = B·L`` where noted."""

    cfg: BlockConfig
    names: tuple[str, ...]
    att: attention.Cache
    U: torch.Tensor | None  # (T, d) LN_1 input
    fc: ffn.Cache | None
    E_Y: torch.Tensor | None  # (T, d, d) J_Y per token
    E_Z: torch.Tensor | None  # (T, d, d) J_Z per token
    J_SY: torch.Tensor | None  # (T, d, d)
    out: torch.Tensor  # (B, L, d): Z (block) or F (attention)


def _as_batch(X: torch.Tensor) -> torch.Tensor:
    return X[None] if X.ndim == 2 else X


def check_inputs(params: dict, X: torch.Tensor, cfg: BlockConfig) -> None:
    """Validate ``X`` (``(L, d_model)`` or ``(B, L, d_model)``, finite, floating) and ``params``.

    Raises ``ValueError`` naming the argument on a wrong shape, dtype, device, NaN/Inf.
    """
    if not isinstance(cfg, BlockConfig):
        raise ValueError(f"cfg must be a BlockConfig, got {type(cfg).__name__}")
    check_tensor("X", X, ndim=(2, 3))
    if X.shape[-1] != cfg.d_model or X.shape[-2] < 1 or (X.ndim == 3 and X.shape[0] < 1):
        raise ValueError(f"X must have shape (L, {cfg.d_model}) or (B, L, {cfg.d_model}), got {tuple(X.shape)}")
    check_params(params, param_shapes(cfg), X)


def _forward(params: dict, X: torch.Tensor, cfg: BlockConfig) -> Cache:
    """Forward pass keeping what the derivatives need. No checks (kernel)."""
    Xb = _as_batch(X)
    names = tuple(param_shapes(cfg))
    att = attention.forward(Xb, params["W_Q"], params["W_K"], params["W_V"])
    if cfg.kind == "attention":
        return Cache(cfg, names, att, None, None, None, None, None, att.F)
    eps = cfg.ln_eps
    U = (Xb + att.F).reshape(-1, cfg.d_model)
    Y = layernorm.forward(U, eps)
    fc = ffn.forward(Y, params["W_1"], params["W_2"])
    Z = layernorm.forward(fc.S, eps)
    E_Y = layernorm._compact_jacobian(U, eps, None)
    E_Z = layernorm._compact_jacobian(fc.S, eps, None)
    return Cache(cfg, names, att, U, fc, E_Y, E_Z, ffn.input_jacobian(fc), Z.reshape(Xb.shape))


def _check_variance(c: Cache) -> None:
    if c.cfg.kind == "block":
        check_ln_variance("X (the LayerNorm-1 input X + SA(X))", c.U, c.cfg.ln_eps)
        check_ln_variance("X (the LayerNorm-2 input Y + FFN(Y))", c.fc.S, c.cfg.ln_eps)


class Factors(NamedTuple):
    """Per-token Kronecker factors of the Jacobians of the intermediates w.r.t. the weights."""

    J: dict[str, TokenKron]  # dZ/dW (block) or dF/dW (attention)
    B: dict[str, TokenKron]  # dS/dW, the paper's B_i
    G_Y: dict[str, TokenKron]  # dY/dW_k = J_Y G_k, the paper's G'_k
    G: dict[str, TokenKron]  # dU/dW_k = G_k


def _factors(c: Cache) -> Factors:
    """The :class:`Factors` of a forward pass (Theorem 4 in per-token form)."""
    G = attention.weight_jacobians(c.att)
    if c.cfg.kind == "attention":
        return Factors(G, {}, {}, G)
    G_Y = {k: f.premul(c.E_Y) for k, f in G.items()}
    B = {k: f.premul(c.J_SY) for k, f in G_Y.items()}
    B.update(ffn.weight_jacobians(c.fc))
    J = {k: f.premul(c.E_Z) for k, f in B.items()}
    return Factors(J, B, G_Y, G)


def _contract_S(c: Cache, f: Factors, g_S: torch.Tensor, acc: BlockSum, omega_S: torch.Tensor | None = None) -> None:
    r"""Add ξ contracted with ``g_S`` (``(T, d)``), the blocks of :math:`\sum g_S \nabla^2 S`
    (Theorem 5's ξ_ij), plus :math:`B^\top \Omega_S B` when a per-token ``omega_S`` (``(T, d, d)``)
    is given. Each pair's Kronecker sandwiches with the same factors are merged: for two
    attention weights :math:`B_k = J_{SY} J_Y G_k`, so :math:`B^\top\Omega_S B` and
    :math:`G^\top \Gamma_Y G` share one pass with :math:`\Omega_U = J_Y^\top J_{SY}^\top \Omega_S J_{SY} J_Y + \Gamma_Y`.
    """
    cross = ffn.contract_hessian(c.fc, g_S, acc)
    for i, a in enumerate(c.names):
        for b in c.names[i:]:
            if b in cross and acc.wants(a, b):
                if omega_S is not None:
                    acc.add(a, b, sandwich(f.B[a], f.B[b], omega_S))
                if a in f.G_Y:
                    acc.add(a, b, sandwich(f.G_Y[a], cross[b]))
    g_Y = (c.J_SY.transpose(1, 2) @ g_S[..., None])[..., 0]
    omega_U = layernorm.contract_hessian(c.U, g_Y, c.cfg.ln_eps)
    if omega_S is not None:
        M = c.J_SY @ c.E_Y
        omega_U = omega_U + M.transpose(1, 2) @ omega_S @ M
    for i, k in enumerate(attention.NAMES):
        for l in attention.NAMES[i:]:
            if acc.wants(k, l):
                acc.add(k, l, sandwich(f.G[k], f.G[l], omega_U))
    g_U = (c.E_Y.transpose(1, 2) @ g_Y[..., None])[..., 0]
    attention.contract_hessian(c.att, g_U.reshape(c.att.F.shape), acc)


def contract_output(c: Cache, g: torch.Tensor, f: Factors, acc: BlockSum, omega_S: torch.Tensor | None = None) -> None:
    r"""Add the blocks of :math:`\sum_o g_o \nabla^2_W \mathrm{out}_o` (the functional term of eq. 10) to ``acc``.

    ``g`` has the shape of the output, ``(B, L, d)``. For the block, Theorem 5 contracted:
    :math:`B^\top \Gamma_Z(g) B + \xi(J_Z^\top g)`; for the bare attention layer, Φ(g).
    ``omega_S`` (``(T, d, d)``, block only) is added to :math:`\Gamma_Z` so that a per-token
    outer term :math:`B^\top J_Z^\top \Omega J_Z B` rides on the same pass. No checks (kernel).
    """
    if c.cfg.kind == "attention":
        attention.contract_hessian(c.att, g, acc)
        return
    g = g.reshape(-1, c.cfg.d_model)
    Om = layernorm.contract_hessian(c.fc.S, g, c.cfg.ln_eps)
    if omega_S is not None:
        Om = Om + omega_S
    _contract_S(c, f, (c.E_Z.transpose(1, 2) @ g[..., None])[..., 0], acc, Om)


def forward(params: dict, X: torch.Tensor, cfg: BlockConfig) -> torch.Tensor:
    """The block's output ``Z`` (or ``F`` for ``kind="attention"``), same shape as ``X``.

    ``X``: ``(L, d_model)`` or ``(B, L, d_model)``, float32/float64; ``params`` as
    :func:`~blockhess.config.param_shapes`. Source: paper §1.3.

    Raises ``ValueError`` on wrong shapes, dtypes, devices, NaN/Inf, or a zero-variance
    LayerNorm input row with ``ln_eps = 0``.
    """
    check_inputs(params, X, cfg)
    c = _forward(params, X, cfg)
    _check_variance(c)
    return c.out.reshape(X.shape)


def _select(names: tuple[str, ...], wrt) -> tuple[str, ...]:
    if wrt is None:
        return names
    wrt = (wrt,) if isinstance(wrt, str) else tuple(wrt)
    unknown = [w for w in wrt if w not in names]
    if unknown or not wrt:
        raise ValueError(f"wrt must be a non-empty subset of {list(names)}, got {list(wrt)}")
    return tuple(n for n in names if n in wrt)


def jacobian(params: dict, X: torch.Tensor, cfg: BlockConfig, wrt=None) -> dict[str, torch.Tensor]:
    """Jacobian of the block output w.r.t. each weight (Theorem 4), dense in the paper's layout.

    Returns ``{name: J}`` with ``J`` of shape ``(L·d_model, numel)`` for ``X`` of shape
    ``(L, d_model)``, or ``(B, L·d_model, numel)`` for a batch; ``wrt`` (a name or a list)
    restricts the names. dtype and device of ``X``. Holds almost everywhere (ReLU, Lemma 1).

    Raises ``ValueError`` as :func:`forward`, and for an unknown name in ``wrt``.
    """
    check_inputs(params, X, cfg)
    c = _forward(params, X, cfg)
    _check_variance(c)
    names = _select(c.names, wrt)
    J = _factors(c).J
    B, L, d = c.out.shape
    out = {n: J[n].dense().reshape(B, L * d, -1) for n in names}
    return {n: (v[0] if X.ndim == 2 else v) for n, v in out.items()}


def second_derivative(params: dict, X: torch.Tensor, cfg: BlockConfig, a: str, b: str, of: str = "Z") -> torch.Tensor:
    r"""A second derivative of the block in the paper's dense layout, shape ``(N·n_a, n_b)``.

    ``of="Z"``: :math:`H_{tr}^{(a,b)} = \partial^2 Z/\partial W_a \partial W_b` (Theorem 5, eq. 9);
    ``of="S"``: :math:`\xi_{ab} = \partial B_a/\partial W_b`, ``S = Y + FFN(Y)`` (Theorem 5's ξ,
    including ξ_k1, ξ_k2 that the paper leaves out); for ``kind="attention"`` use ``of="F"``:
    :math:`\Phi_{ab} = \partial^2 F/\partial W_a\partial W_b` (§2.3). Rows ``(o, i)`` o-major over
    output entries ``o`` (``N = L·d_model``) and entries ``i`` of ``W_a``; columns entries of
    ``W_b``. ``X`` is one sequence ``(L, d_model)``. Valid almost everywhere (ReLU).

    Raises ``ValueError`` as :func:`forward`, for an unknown name or ``of``, and
    ``InsufficientMemoryError`` if the result would not fit in memory.
    """
    check_inputs(params, X, cfg)
    if X.ndim != 2:
        raise ValueError(f"X must be one sequence (L, d_model) for a dense second derivative, got {tuple(X.shape)}")
    allowed = ("F",) if cfg.kind == "attention" else ("Z", "S")
    if of not in allowed:
        raise ValueError(f"of must be one of {allowed} for kind={cfg.kind!r}, got {of!r}")
    c = _forward(params, X, cfg)
    _check_variance(c)
    for n in (a, b):
        _select(c.names, n)
    factors = _factors(c)
    if of == "S":
        def contract(g, acc):
            _contract_S(c, factors, g, acc)
    else:
        def contract(g, acc):
            contract_output(c, g[None], factors, acc)
    return dense_second_derivative(contract, tuple(X.shape), c.names, param_shapes(cfg), a, b, X)
