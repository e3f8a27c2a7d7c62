r"""Single-head softmax self-attention and its closed-form derivatives (paper §2.2–2.3).

:math:`F(X) = A X W_V`, :math:`A = \mathrm{softmax}_{row}(T)`, :math:`T = X W_Q W_K^\top X^\top/\sqrt{d_k}`,
``X`` of shape ``(L, d)`` or a batch ``(B, L, d)``. Notation: :math:`Q = XW_Q`, :math:`K = XW_K`,
:math:`V = XW_V`, :math:`S_l = \mathrm{diag}(a_l) - a_l a_l^\top` (softmax Jacobian of row ``l``),
:math:`s = 1/\sqrt{d_k}`.

First derivatives (Noci et al. Lemma A.2 as in the paper, §2.2), per output token ``l``:

* :math:`G_Q`: rows :math:`x_l^\top \otimes s V^\top S_l K`;
* :math:`G_K`: rows :math:`s V^\top S_l X \otimes q_l^\top` (the paper's :math:`K_{d_K,d_V}` factor,
  typo 2 of §2.10, is absorbed in the right-Kronecker layout);
* :math:`G_V`: rows :math:`(AX)_l^\top \otimes I` (:math:`G_V = AX \otimes I`).

Second derivatives contracted with an output weight ``G`` (the Φ blocks of §2.3 with
:math:`R` applied; derived here, docs/derivations.md §attention): with
:math:`\phi = \sum_{lj} A_{lj} B_{lj}`, :math:`B = G V^\top`,

* T–T curvature :math:`\Psi_l = \sum_j B_{lj}\nabla^2 A_{lj}` sandwiched by :math:`\partial T_l/\partial W_{Q,K}`;
* the bilinear Q–K term :math:`\delta_{bb'}\,s\,(X^\top \Gamma_T X)_{aa'}`, :math:`\Gamma_T = \partial\phi/\partial T`;
* the T–W_V cross term, rows :math:`S_l X \otimes G_l^\top`; and :math:`\Phi_{VV} = 0`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ..kronecker import TokenKron, sandwich
from . import softmax

__all__ = ["Cache", "forward", "weight_jacobians", "input_jacobian", "contract_hessian", "NAMES"]

NAMES = ("W_Q", "W_K", "W_V")


class Cache(NamedTuple):
    """Forward quantities of one batch of sequences, all with leading batch axis ``B``."""

    X: torch.Tensor  # (B, L, d)
    Q: torch.Tensor  # (B, L, d_k)
    K: torch.Tensor  # (B, L, d_k)
    V: torch.Tensor  # (B, L, d)
    A: torch.Tensor  # (B, L, L)
    F: torch.Tensor  # (B, L, d)
    scale: float  # 1/sqrt(d_k)


def forward(X: torch.Tensor, W_Q: torch.Tensor, W_K: torch.Tensor, W_V: torch.Tensor) -> Cache:
    """Self-attention ``F = softmax(X W_Q W_K^T X^T / sqrt(d_k)) X W_V`` on ``X`` of shape
    ``(B, L, d)``; returns the :class:`Cache` (``.F`` is the output). No checks (kernel)."""
    scale = 1.0 / math.sqrt(W_Q.shape[1])
    Q, K, V = X @ W_Q, X @ W_K, X @ W_V
    A = torch.softmax(Q @ K.transpose(-1, -2) * scale, dim=-1)
    return Cache(X, Q, K, V, A, A @ V, scale)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """Merge the batch and token axes: ``(B, L, ...) -> (B*L, ...)``."""
    return t.reshape(-1, *t.shape[2:])


def _vt_s(c: Cache, M: torch.Tensor) -> torch.Tensor:
    """``V^T S_l M`` for every token ``l``: ``(B, L, d, m)`` for ``M`` of shape ``(B, L, m)``."""
    first = torch.einsum("blj,bjc,bjm->blcm", c.A, c.V, M)
    return first - c.F[..., :, None] * (c.A @ M)[..., None, :]


def weight_jacobians(c: Cache) -> dict[str, TokenKron]:
    """``G_Q, G_K, G_V`` (∂F/∂W, paper §2.2) as per-token Kronecker factors over ``B·L`` tokens."""
    d = c.X.shape[-1]
    eye = torch.eye(d, dtype=c.X.dtype, device=c.X.device).expand(c.X.shape[0] * c.X.shape[1], d, d)
    return {
        "W_Q": TokenKron("left", _flat(c.X), _flat(_vt_s(c, c.K)) * c.scale),
        "W_K": TokenKron("right", _flat(c.Q), _flat(_vt_s(c, c.X)) * c.scale),
        "W_V": TokenKron("left", _flat(c.A @ c.X), eye),
    }


def input_jacobian(c: Cache, W_Q: torch.Tensor, W_K: torch.Tensor, W_V: torch.Tensor) -> torch.Tensor:
    r"""``dF/dX`` in the paper's layout, shape ``(B, L·d, L·d)``, rows ``(l, c)``, columns ``(m, a)``.

    :math:`\partial F_{lc}/\partial X_{ma} = A_{lm} (W_V)_{ac} + \delta_{lm}(V^\top S_l X M^\top)_{ca}
    + (V^\top S_l)_{cm} (x_l M)_a`, :math:`M = s W_Q W_K^\top`. Derived here (docs/derivations.md).
    """
    B, L, d = c.X.shape
    M = c.scale * W_Q @ W_K.T
    S = softmax.jacobian(c.A)  # (B, L, L, L)
    VtS = torch.einsum("bjc,bljm->blcm", c.V, S)  # (B, L, d, L): V^T S_l
    J = c.A[:, :, None, :, None] * W_V.T[None, None, :, None, :]
    eye = torch.eye(L, dtype=c.X.dtype, device=c.X.device)
    J = J + eye[None, :, None, :, None] * (VtS @ (c.X @ M.T)[:, None])[:, :, :, None, :]
    J = J + VtS[..., None] * (c.X @ M)[:, :, None, None, :]
    return J.reshape(B, L * d, L * d)


def contract_hessian(c: Cache, G: torch.Tensor, acc) -> None:
    r"""Add the blocks of :math:`\sum_{b,l,c} G_{blc}\,\nabla^2_{W} F_{blc}` over ``(W_Q, W_K, W_V)`` to ``acc``.

    ``G`` has the shape of ``F``, ``(B, L, d)``; the blocks sum over the batch. ``acc`` is a
    :class:`~blockhess.blocks.BlockSum`; only the pairs it wants are computed. The
    ``(W_V, W_V)`` block is exactly zero (F is linear in ``W_V``) and is never added.
    With ``G = (2/(L d)) (F - Target)`` this is Ormaniec et al.'s functional Hessian
    (Theorem 3.2); with one-hot ``G`` it gives the Φ blocks of paper §2.3.
    Derived here (docs/derivations.md §attention). No checks (kernel).
    """
    B, L, d = c.X.shape
    Bm = G @ c.V.transpose(-1, -2)  # (B, L, L): B_lj = G_l . V_j
    Psi = _flat(softmax.contract_hessian(c.A, Bm))  # (B*L, L, L)

    def per_token(t):  # the sequence's (L, m) matrix, once per token: (B*L, L, m)
        return _flat(t[:, None].expand(B, L, *t.shape[1:]))

    dT = {  # ∂T_l/∂W per token, rows = the L keys
        "W_Q": TokenKron("left", _flat(c.X), per_token(c.K) * c.scale),
        "W_K": TokenKron("right", _flat(c.Q), per_token(c.X) * c.scale),
    }
    for a, b in (("W_Q", "W_Q"), ("W_Q", "W_K"), ("W_K", "W_K")):
        if acc.wants(a, b):
            acc.add(a, b, sandwich(dT[a], dT[b], Psi))
    if acc.wants("W_Q", "W_K"):  # T is bilinear in (W_Q, W_K): δ_bb' s (X^T Γ_T X)_aa'
        grad_T = c.A * (Bm - (c.A * Bm).sum(-1, keepdim=True))  # dφ/dT, row l = S_l b_l
        P = torch.einsum("blj,bla,bjc->ac", grad_T, c.X, c.X) * c.scale
        acc.add_diagonal("W_Q", "W_K", 1, 3, P[:, :, None].expand(*P.shape, c.Q.shape[-1]))
    if acc.wants("W_Q", "W_V") or acc.wants("W_K", "W_V"):
        SX = c.A[..., None] * (c.X[:, None, :, :] - (c.A @ c.X)[:, :, None, :])  # (B, L, L, d): S_l X
        cross_V = TokenKron("right", _flat(G), _flat(SX))  # ∂²φ/∂T_l ∂W_V, rows = keys
        for a in ("W_Q", "W_K"):
            if acc.wants(a, "W_V"):
                acc.add(a, "W_V", sandwich(dT[a], cross_V))
