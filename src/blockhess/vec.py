r"""Row-wise vectorisation and the matrix-calculus helpers of the paper (§1.1, P1–P10).

``vec_r(A)`` stacks the rows of ``A``: for a row-major tensor it is ``A.reshape(-1)``.
A Jacobian :math:`\partial N/\partial W` is :math:`\partial\,\mathrm{vec}_r N / \partial\,
\mathrm{vec}_r W^\top`, of shape ``(N.numel(), W.numel())``. With this convention

* P1: :math:`\mathrm{vec}_r(AXB) = (A \otimes B^\top)\,\mathrm{vec}_r X`;
* P10: :math:`\partial A^\top/\partial A = K_{n,m}` for ``A`` of shape ``(m, n)``;
* P4: :math:`\partial (X\otimes Y)/\partial X = (I_n \otimes K_{p,q} \otimes I_r)(I_{nq}\otimes \mathrm{vec}_r Y)`
  for ``X`` of shape ``(n, q)`` and ``Y`` of shape ``(p, r)``.

These dense helpers exist for the paper's layout and for tests; the library's fast paths
never build a commutation matrix or a dense Kronecker product.
"""

from __future__ import annotations

import torch

__all__ = ["vec_r", "unvec_r", "vec", "commutation", "kron_jacobians"]


def vec_r(A: torch.Tensor) -> torch.Tensor:
    """Row-wise vectorisation: ``(m, n) -> (m*n,)``, rows stacked (paper §1.1)."""
    return A.reshape(-1)


def unvec_r(v: torch.Tensor, m: int, n: int) -> torch.Tensor:
    """Inverse of :func:`vec_r`: ``(m*n,) -> (m, n)``.

    Raises ``ValueError`` if ``v`` does not hold ``m*n`` entries.
    """
    if v.numel() != m * n:
        raise ValueError(f"unvec_r: v has {v.numel()} entries, expected m*n = {m * n}")
    return v.reshape(m, n)


def vec(A: torch.Tensor) -> torch.Tensor:
    """Column-wise vectorisation: ``(m, n) -> (m*n,)``, columns stacked; ``vec(A) = vec_r(A^T)``."""
    return A.T.reshape(-1)


def commutation(m: int, n: int, dtype: torch.dtype = torch.float64, device=None) -> torch.Tensor:
    r"""Commutation matrix :math:`K_{m,n}` of shape ``(m*n, m*n)``.

    The unique permutation matrix with :math:`K_{m,n}\,\mathrm{vec}(A) = \mathrm{vec}(A^\top)`
    for every ``A`` of shape ``(m, n)`` (paper §1.1). Consequences:
    ``vec_r(A) = K_{m,n} vec(A)`` and ``K_{n,m} K_{m,n} = I``.

    Raises ``ValueError`` for non-positive sizes.
    """
    if m < 1 or n < 1:
        raise ValueError(f"commutation: m and n must be positive, got m={m}, n={n}")
    K = torch.zeros(m * n, m * n, dtype=dtype, device=device)
    i = torch.arange(m).repeat_interleave(n)  # entry A[i, j] ...
    j = torch.arange(n).repeat(m)
    # ... sits at vec index j*m + i and at vec(A^T) index i*n + j
    K[i * n + j, j * m + i] = 1
    return K


def kron_jacobians(X: torch.Tensor, Y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Jacobians of :math:`X \otimes Y` w.r.t. ``X`` and ``Y`` (property P4, Ormaniec et al.).

    For ``X`` of shape ``(n, q)`` and ``Y`` of shape ``(p, r)``:

    .. math::
        \frac{\partial (X\otimes Y)}{\partial X} = (I_n \otimes K_{p,q} \otimes I_r)
            (I_{nq} \otimes \mathrm{vec}_r Y),\qquad
        \frac{\partial (X\otimes Y)}{\partial Y} = (I_n \otimes K_{p,q} \otimes I_r)
            (\mathrm{vec}_r X \otimes I_{pr}).

    Returns two dense matrices of shapes ``(n*p*q*r, n*q)`` and ``(n*p*q*r, p*r)``.
    """
    n, q = X.shape
    p, r = Y.shape
    kw = dict(dtype=X.dtype, device=X.device)
    perm = torch.kron(
        torch.kron(torch.eye(n, **kw), commutation(p, q, **kw)), torch.eye(r, **kw)
    )
    dX = perm @ torch.kron(torch.eye(n * q, **kw), vec_r(Y)[:, None])
    dY = perm @ torch.kron(vec_r(X)[:, None], torch.eye(p * r, **kw))
    return dX, dY
