r"""Row-wise softmax :math:`A = \mathrm{softmax}_{row}(T)` and its derivatives (paper §2.1).

Each row of ``A`` depends only on the same row of ``T``, so both derivatives are
block-diagonal over rows; the compact forms keep one block per row.

* Jacobian (Ormaniec et al., Lemma C.1): :math:`\partial a/\partial t = \mathrm{diag}(a) - a a^\top`.
* Hessian: :math:`\partial^2 a_j/\partial t\,\partial t = a_j(2aa^\top + E_{jj} - \mathrm{diag}(a)
  - e_j a^\top - a e_j^\top)`.
* Contracted with a weight row ``b`` (derived here, docs/derivations.md §softmax):
  :math:`\sum_j b_j \partial^2 a_j/\partial t^2 = \mathrm{diag}(c) - c a^\top - a c^\top`,
  :math:`c = a \odot (b - a^\top b)`.
"""

from __future__ import annotations

import torch

__all__ = ["jacobian", "hessian", "contract_hessian"]


def _eye_like(A: torch.Tensor) -> torch.Tensor:
    return torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)


def jacobian(A: torch.Tensor, compact: bool = True) -> torch.Tensor:
    r"""Jacobian of the row-wise softmax, evaluated at its output ``A`` (shape ``(L, L')``).

    Returns ``S`` with ``S[i] = diag(A_i) - A_i^T A_i`` (compact, shape ``(L, L', L')``),
    or the paper's dense ``∂vec_r A/∂vec_r T`` of shape ``(L·L', L·L')`` (block-diagonal).
    Any leading batch dimensions of ``A`` are kept (compact only). dtype of ``A``.
    Source: Ormaniec et al. Lemma C.1, paper §2.1.
    """
    S = torch.diag_embed(A) - A[..., :, None] * A[..., None, :]
    return S if compact else torch.block_diag(*S)


def hessian(A: torch.Tensor, compact: bool = True) -> torch.Tensor:
    r"""Second derivative of the row-wise softmax at its output ``A`` (shape ``(L, L')``).

    Compact: ``H[i, j, k, l] = ∂²A_ij / ∂T_ik ∂T_il``, shape ``(L, L', L', L')``.
    Dense (paper layout): ``(L·L'·L·L', L·L')`` with rows ``(o, t)`` o-major, ``o = (i, j)``,
    ``t = (i', k)``, column ``(i'', l)``; non-zero only for ``i = i' = i''``.
    Source: paper §2.1 (Ormaniec et al. Lemma C.1), VERIFIED by tests/test_softmax.py.
    """
    I = _eye_like(A)
    a_k = A[..., None, :, None]
    a_l = A[..., None, None, :]
    d_jk = I[:, :, None]
    d_jl = I[:, None, :]
    d_kl = I[None, :, :]
    H = A[..., :, None, None] * (2 * a_k * a_l + d_jk * d_jl - d_kl * a_k - d_jk * a_l - a_k * d_jl)
    if compact:
        return H
    L, Lp = A.shape
    dense = A.new_zeros(L, Lp, L, Lp, L, Lp)
    rows = torch.arange(L)
    dense[rows, :, rows, :, rows, :] = H
    return dense.reshape(L * Lp * L * Lp, L * Lp)


def contract_hessian(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    r"""Row-wise contraction :math:`\Psi_i = \sum_j B_{ij}\, \partial^2 A_{ij}/\partial T_i^2`.

    ``A`` and ``B`` of shape ``(..., L, L')``; returns ``(..., L, L', L')``, symmetric in the
    last two axes: :math:`\Psi_i = \mathrm{diag}(c_i) - c_i a_i^\top - a_i c_i^\top` with
    :math:`c_i = a_i\odot(b_i - a_i^\top b_i)`. Derived here (docs/derivations.md).
    """
    c = A * (B - (A * B).sum(-1, keepdim=True))
    return torch.diag_embed(c) - c[..., :, None] * A[..., None, :] - A[..., :, None] * c[..., None, :]
