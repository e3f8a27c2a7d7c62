r"""Row-wise softmax :math:`A = \mathrm{softmax}_{row}(T)` and its derivatives (paper §2.1).

Each row of ``A`` depends only on the same row of ``T``, so both derivatives are
block-diagonal over rows; the compact forms keep one block per row.

* Jacobian (Ormaniec et al., Lemma C.1): :math:`\partial a/\partial t = \mathrm{diag}(a) - a a^\top`.
* Hessian: :math:`\partial^2 a_j/\partial t\,\partial t = a_j(2aa^\top + E_{jj} - \mathrm{diag}(a)
  - e_j a^\top - a e_j^\top)`.
* Contracted with a weight row ``b`` (derived here, docs/derivations.md §2):
  :math:`\sum_j b_j \partial^2 a_j/\partial t^2 = \mathrm{diag}(c) - c a^\top - a c^\top`,
  :math:`c = a \odot (b - a^\top b)`.

The kernels evaluate :math:`b - a^\top b` as :math:`(b - b_m) - a^\top (b - b_m)`, ``m`` the row's
most probable entry (equal where :math:`\sum a = 1`): near saturation (:math:`a_m \to 1`) the plain
form loses :math:`\varepsilon / (1 - a_m)` relative in entry ``m``, the shifted one nothing
(docs/derivations.md §2).
"""

from __future__ import annotations

import torch

from ..validation import check_fits, check_tensor
from .linear import add

__all__ = ["forward", "jacobian", "hessian", "contract_hessian",
           # kernels without checks, for the attention (blockhess.layers.attention)
           "row_jacobians", "apply_row_jacobians", "contract_hessian_unchecked",
           # directional derivatives, for a matrix-free product (docs/derivations.md §18)
           "peaks", "tangent", "centred", "second_adjoint"]


def _check(A: torch.Tensor, name: str = "A") -> None:
    """``A`` must be a softmax output ``(..., L, L')``: float32/float64, finite, rows of
    non-negative entries summing to 1 (to rounding: ``1e3`` machine epsilons)."""
    check_tensor(name, A)
    if A.ndim < 2 or A.shape[-1] < 1:
        raise ValueError(f"{name} must have shape (..., L, L') with L' >= 1 (rows of softmax probabilities), got {tuple(A.shape)}")
    tol = 1e3 * torch.finfo(A.dtype).eps
    if A.numel() and (bool((A < 0).any()) or float((A.sum(-1) - 1).abs().max()) > tol):
        raise ValueError(f"{name} must hold softmax probabilities: each row non-negative and summing to 1 "
                         "(pass softmax(T), not the scores T)")


def forward(T: torch.Tensor) -> torch.Tensor:
    """The row-wise softmax of the scores ``T`` ``(..., L, L')`` (``-inf`` entries, a mask, get weight 0):
    same shape, dtype and device. No checks (kernel: ``T`` is the attention's own scores)."""
    return torch.softmax(T, dim=-1)


def apply_row_jacobians(A: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
    r"""``S_i V_i`` for every row ``i``, :math:`S_i = \mathrm{diag}(a_i) - a_i a_i^\top`: entry
    ``[..., i, j, k]`` is :math:`a_{ij}(V_{ijk} - \sum_{j'} a_{ij'} V_{ij'k})`.

    ``A`` ``(..., L, L')`` (softmax output), ``V`` broadcastable to ``(..., L, L', k)``; returns
    ``(..., L, L', k)`` in ``A``'s dtype. The deviation is taken from ``V`` at the row's most
    probable entry ``m`` (so the ``m``-th is exact where ``a_m`` is near 1; see the module
    docstring). Kernel: no checks.
    """
    a, v = A.shape + (1,), V.shape
    k = max(len(a), len(v))
    a, v = (1,) * (k - len(a)) + tuple(a), (1,) * (k - len(v)) + tuple(v)
    shape = torch.Size(y if x == 1 else x for x, y in zip(a, v))
    V = V.expand(shape)
    m = A.argmax(-1, keepdim=True)[..., None].expand(*shape[:-2], 1, shape[-1])  # (..., L, 1, k)
    D = V - V.gather(-2, m)
    return A[..., None] * (D - (A[..., None] * D).sum(-2, keepdim=True))


def row_jacobians(A: torch.Tensor) -> torch.Tensor:
    """The row-wise Jacobians ``diag(a_i) - a_i a_i^T`` of the softmax output ``A`` ``(..., L, L')``:
    ``(..., L, L', L')``, :func:`jacobian` with ``compact=True`` without its checks (kernel);
    :func:`apply_row_jacobians` of the identity (so ``a_m (1 - a_m)`` is ``a_m Σ_{j≠m} a_j``)."""
    return apply_row_jacobians(A, torch.eye(A.shape[-1], dtype=A.dtype, device=A.device))


def jacobian(A: torch.Tensor, compact: bool = False) -> torch.Tensor:
    r"""Jacobian of the row-wise softmax, evaluated at its output ``A`` of shape ``(..., L, L')``.

    Returns the paper's dense ``∂vec_r A/∂vec_r T`` of shape ``(..., L·L', L·L')``
    (block-diagonal over rows), or with ``compact`` the blocks ``S[..., i] = diag(A_i) - A_i^T A_i``,
    shape ``(..., L, L', L')``. Leading axes are a batch. dtype and device of ``A``.
    Source: Ormaniec et al. Lemma C.1, paper §2.1.

    Raises
    ------
    ValueError
        ``A`` not a float32/float64 tensor of shape ``(..., L, L')``, with NaN/Inf, or not
        softmax probabilities (a negative entry, a row not summing to 1).
    InsufficientMemoryError
        The result would not fit in available memory with the row-wise Jacobians and two
        temporaries of their size (bytes in the message); checked before they are made.
    """
    _check(A)
    batch, L, Lp = A.shape[:-2], A.shape[-2], A.shape[-1]
    rows = 3 * A.numel() * Lp * A.element_size()  # the (L', L') Jacobian of each row and two temporaries
    check_fits(rows + (0 if compact else A.numel() * L * Lp * A.element_size()),
               f"the {'row-wise' if compact else 'dense'} softmax Jacobian", A.device)
    S = row_jacobians(A)
    if compact:
        return S
    dense = A.new_zeros(*batch, L, Lp, L, Lp)
    torch.diagonal(dense, 0, -4, -2).copy_(S.movedim(-3, -1))  # the row-diagonal blocks [..., j, k, i]
    return dense.reshape(*batch, L * Lp, L * Lp)


def hessian(A: torch.Tensor, compact: bool = False) -> torch.Tensor:
    r"""Second derivative of the row-wise softmax at its output ``A`` of shape ``(..., L, L')``.

    Dense (paper layout): ``(..., L·L'·L·L', L·L')`` with rows ``(o, t)`` o-major,
    ``o = (i, j)``, ``t = (i', k)``, column ``(i'', l)``; non-zero only for ``i = i' = i''``.
    Compact: ``H[..., i, j, k, l] = ∂²A_ij / ∂T_ik ∂T_il``, shape ``(..., L, L', L', L')``.
    Leading axes are a batch. dtype and device of ``A``.
    Source: paper §2.1 (Ormaniec et al. Lemma C.1), checked against autograd in tests/test_layers_softmax.py.

    Raises as :func:`jacobian` (the row-wise ``(L', L', L')`` second derivatives counted with
    three temporaries of their size).
    """
    _check(A)
    batch, L, Lp = A.shape[:-2], A.shape[-2], A.shape[-1]
    rows = 4 * A.numel() * Lp * Lp * A.element_size()
    check_fits(rows + (0 if compact else A.numel() * (L * Lp) ** 2 * A.element_size()),
               f"the {'row-wise' if compact else 'dense'} softmax Hessian", A.device)
    I = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
    a_k = A[..., None, :, None]
    a_l = A[..., None, None, :]
    d_jk = I[:, :, None]
    d_jl = I[:, None, :]
    d_kl = I[None, :, :]
    H = A[..., :, None, None] * (2 * a_k * a_l + d_jk * d_jl - d_kl * a_k - d_jk * a_l - a_k * d_jl)
    if compact:
        return H
    dense = A.new_zeros(*batch, L, Lp, L, Lp, L, Lp)
    diag = torch.diagonal(torch.diagonal(dense, 0, -6, -4), 0, -3, -1)  # [..., j, k, l, i]: i = i' = i''
    diag.copy_(H.movedim(-4, -1))
    return dense.reshape(*batch, L * Lp * L * Lp, L * Lp)


def contract_hessian_unchecked(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """:func:`contract_hessian` without checks (kernel)."""
    c = apply_row_jacobians(A, B[..., None])[..., 0]
    return torch.diag_embed(c) - c[..., :, None] * A[..., None, :] - A[..., :, None] * c[..., None, :]


def contract_hessian(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    r"""Row-wise contraction :math:`\Psi_i = \sum_j B_{ij}\, \partial^2 A_{ij}/\partial T_i^2`.

    ``A`` (softmax output) and ``B`` of one shape ``(..., L, L')``, same dtype and device;
    returns ``(..., L, L', L')``, symmetric in the last two axes:
    :math:`\Psi_i = \mathrm{diag}(c_i) - c_i a_i^\top - a_i c_i^\top` with
    :math:`c_i = a_i\odot(b_i - a_i^\top b_i)`. Derived here (docs/derivations.md).

    Raises ``ValueError`` as :func:`jacobian` for ``A``; for ``B`` not a finite float tensor of
    ``A``'s shape, dtype and device; ``InsufficientMemoryError`` before computing if the result
    and two temporaries of its size would not fit.
    """
    _check(A)
    check_tensor("B", B, like=A, like_name="A")
    if B.shape != A.shape:
        raise ValueError(f"B must have the shape of A {tuple(A.shape)}, got {tuple(B.shape)}")
    check_fits(3 * A.numel() * A.shape[-1] * A.element_size(), "the row-wise contracted softmax Hessian", A.device)
    return contract_hessian_unchecked(A, B)


def peaks(A: torch.Tensor) -> torch.Tensor:
    """Each row's most probable entry ``m`` of ``A`` ``(..., L, L')``: indices ``(..., L, 1)``, the shift of
    :func:`tangent`, :func:`centred` and :func:`second_adjoint` (computed once per operator). Kernel."""
    return A.argmax(-1, keepdim=True)


def _shifted(X: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``X - X[..., m]`` per row, ``X`` ``(k, ..., L, L')`` or ``m``'s leading axes, ``m`` ``(..., L, 1)``."""
    return X - X.gather(-1, m.expand(*X.shape[:-1], 1))


def tangent(A: torch.Tensor, dT: torch.Tensor, m=None) -> torch.Tensor:
    r"""The tangent :math:`\dot A_i = S_i \dot T_i = a_i \odot (\dot t_i - a_i^\top \dot t_i)` of every row
    along the scores' tangent ``dT`` (``(k, ..., L, L')``, broadcast against ``A`` ``(..., L, L')``):
    ``(k, ..., L, L')``. ``S_i`` is symmetric, so this is also the adjoint :math:`g_T = S_i g_{A,i}` of an
    output adjoint. Deviations taken from the row's most probable entry ``m`` (:func:`peaks`, computed
    here when ``None``), as in :func:`apply_row_jacobians`: :math:`a\odot D - a\,(a^\top D)`,
    :math:`D = \dot t - \dot t_m`; masked entries (``a = 0``) get 0 whatever ``dT`` holds there. Kernel:
    no checks."""
    D = _shifted(dT, peaks(A) if m is None else m)
    out = A * D
    return out.addcmul_(A, out.sum(-1, keepdim=True), value=-1)


def centred(A: torch.Tensor, G: torch.Tensor, m=None) -> torch.Tensor:
    r"""``u_i = g_i - a_i^\top g_i`` per row of the output adjoint ``G`` (``A``'s shape ``(..., L, L')``),
    evaluated as :math:`(g - g_m) - a^\top(g - g_m)`, ``m`` the row's most probable entry (:func:`peaks`;
    computed here when ``None``; exact near saturation, docs/derivations.md §2): the first-order adjoint
    is :math:`g_T = a \odot u`, and ``u`` enters :func:`second_adjoint`. Kernel: no checks."""
    D = _shifted(G, peaks(A) if m is None else m)
    return D - (A * D).sum(-1, keepdim=True)


def second_adjoint(A: torch.Tensor, dA, u: torch.Tensor, dG, m=None) -> torch.Tensor | None:
    r"""The tangent of the score adjoint :math:`g_T = S(A)\,g_A` along ``(dA, dG)``:
    :math:`\dot g_{T,i} = S_i \dot g_{A,i} + [\dot a_i \odot u_i - a_i\,(\dot a_i^\top u_i)]`, ``(k, ..., L, L')``.

    ``A`` ``(..., L, L')`` the softmax output, ``u`` :func:`centred` of the cached output adjoint,
    ``dG`` ``(k, ..., L, L')`` the output adjoint's tangent, ``dA`` the output's tangent
    (:func:`tangent`); ``None`` for either drops its term (``dA=None``: the Gauss–Newton product, no
    second-order term); ``m`` as for :func:`tangent`. Evaluated as
    :math:`a\odot D + \dot a\odot u - a\,(a^\top D + \dot a^\top u)`, :math:`D = \dot g_A - \dot g_{A,m}`.
    The bracket is :func:`contract_hessian`'s :math:`\Psi_i \dot t_i` without forming :math:`\Psi_i`.
    ``None`` when both are ``None``. Kernel: no checks."""
    out = r = None
    if dG is not None:
        out = A * _shifted(dG, peaks(A) if m is None else m)
        r = out.sum(-1, keepdim=True)
    if dA is not None:
        curv = dA * u
        r = add(r, curv.sum(-1, keepdim=True))
        out = curv if out is None else out.add_(curv)
    return None if out is None else out.addcmul_(A, r, value=-1)
