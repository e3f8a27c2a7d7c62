r"""The ReLU FFN with its residual, :math:`S = \mathrm{relu}(Y W_1) W_2 + Y`, and its derivatives (§2.6).

With :math:`D_t = \mathbb 1[y_t W_1 > 0]` (Lemma 1; all results hold almost everywhere, off
the kinks) and :math:`h = \mathrm{relu}(YW_1)`, per token ``t``:

* :math:`B_1 = \partial S/\partial W_1`: rows :math:`y_t^\top \otimes W_2^\top \mathrm{diag}(D_t)`
  (paper: :math:`(I_L\otimes W_2^\top) D_\sigma (Y\otimes I_{d_{ff}})`);
* :math:`B_2 = \partial S/\partial W_2`: rows :math:`h_t^\top \otimes I` (paper: :math:`h \otimes I_{d_V}`);
* :math:`J_{SY} = \partial S/\partial Y`: per token :math:`I + W_2^\top \mathrm{diag}(D_t) W_1^\top`.

Second derivatives of :math:`\sum_{tc} g_{tc} S_{tc}` (ReLU: the ``(Y,Y)``, ``(W_1,W_1)`` and
``(W_2,W_2)`` blocks vanish; derived here, docs/derivations.md §ffn, the corrected ξ_12 / ξ_21):

* ``(W_1, W_2)``: :math:`\delta_{bb'} \sum_t y_{ta} D_{tb} g_{tc}`;
* ``(Y, W_1)``: per token rows :math:`I \otimes (D_t \odot g_t W_2^\top)^\top`;
* ``(Y, W_2)``: per token rows :math:`W_1\mathrm{diag}(D_t) \otimes g_t^\top`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..kronecker import TokenKron

__all__ = ["Cache", "forward", "weight_jacobians", "input_jacobian", "contract_hessian"]


class Cache(NamedTuple):
    """FFN forward quantities over ``T`` tokens (batch and sequence axes merged)."""

    Y: torch.Tensor  # (T, d)
    D: torch.Tensor  # (T, d_ff) ReLU derivative, 0/1
    h: torch.Tensor  # (T, d_ff) relu(Y W_1)
    S: torch.Tensor  # (T, d) output
    W_1: torch.Tensor
    W_2: torch.Tensor


def forward(Y: torch.Tensor, W_1: torch.Tensor, W_2: torch.Tensor) -> Cache:
    """``S = relu(Y W_1) W_2 + Y`` for ``Y`` of shape ``(T, d)``. No checks (kernel)."""
    pre = Y @ W_1
    D = (pre > 0).to(Y.dtype)
    h = pre * D
    return Cache(Y, D, h, h @ W_2 + Y, W_1, W_2)


def weight_jacobians(c: Cache) -> dict[str, TokenKron]:
    """``B_1`` and ``B_2`` (paper §2.6) as per-token Kronecker factors."""
    T, d = c.Y.shape
    eye = torch.eye(d, dtype=c.Y.dtype, device=c.Y.device).expand(T, d, d)
    return {
        "W_1": TokenKron("left", c.Y, c.W_2.T[None] * c.D[:, None, :]),
        "W_2": TokenKron("left", c.h, eye),
    }


def input_jacobian(c: Cache) -> torch.Tensor:
    """``J_SY`` per token, shape ``(T, d, d)``: ``I + W_2^T diag(D_t) W_1^T`` (paper §2.6)."""
    d = c.Y.shape[1]
    eye = torch.eye(d, dtype=c.Y.dtype, device=c.Y.device)
    return eye + (c.W_2.T[None] * c.D[:, None, :]) @ c.W_1.T


def contract_hessian(c: Cache, g: torch.Tensor, acc) -> dict[str, TokenKron]:
    r"""Second derivatives of :math:`\sum_{tc} g_{tc} S_{tc}` over ``(Y, W_1, W_2)`` (ReLU, a.e.).

    ``g`` has shape ``(T, d)``. Adds the ``(W_1, W_2)`` block (``(d·d_ff, d_ff·d)``) to the
    :class:`~blockhess.blocks.BlockSum` ``acc`` if wanted, and returns the ``(Y, W_k)``
    blocks as per-token factors (rows: the ``d`` entries of ``y_t``) for chaining through
    ``∂Y/∂W``. The ``(Y,Y)``, ``(W_1,W_1)`` and ``(W_2,W_2)`` blocks are zero for ReLU.
    Derived here (docs/derivations.md §ffn). No checks (kernel).
    """
    T, d = c.Y.shape
    if acc.wants("W_1", "W_2"):  # δ_bb' R_abc: only the diagonal b = b' of the 4-D block
        acc.add_diagonal("W_1", "W_2", 1, 2, torch.einsum("ta,tb,tc->acb", c.Y, c.D, g))
    eye = torch.eye(d, dtype=g.dtype, device=g.device).expand(T, d, d)
    return {
        "W_1": TokenKron("right", c.D * (g @ c.W_2.T), eye),
        "W_2": TokenKron("right", g, c.W_1[None] * c.D[:, None, :]),
    }
