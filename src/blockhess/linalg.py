"""Symmetric eigensolvers, the matrix 2-norm and the relative Frobenius error, computed in
float64 whatever the input's dtype.

LAPACK's float32 routines behind ``torch.linalg.eigh``/``eigvalsh`` on the CPU can fail to
converge on the block-sparse, rank-deficient matrices this package produces: the float32
functional term of a small block (96 weights, two thirds of its entries exactly zero) raised
``torch.linalg.LinAlgError`` ("failed to converge ... ill-conditioned or has too many repeated
eigenvalues") for 3 of 300 random inputs, and float64 converges on the same matrices. Every
eigendecomposition and spectral norm in the package goes through here; results come back in
the input's dtype (the 2-norm as a Python float). :func:`rel_error` is the one measure every
check against the autograd reference uses (tests, ``blockhess validate``, ``report``, ``bench``).

LAPACK's eigensolvers and SVD do a matrix-vector product per column (each its own OpenMP
parallel region, of about ``m·n`` multiply-adds), so a matrix below ``512 × 512`` is
factorised on one thread (:func:`blockhess.threads.threads_for`), a larger one on the
caller's thread count.
"""

from __future__ import annotations

import math

import torch

from .threads import threads_for

__all__ = ["eigh", "eigvalsh", "norm2", "rel_error"]


def eigh(M: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues (ascending, ``(..., n)``) and eigenvectors (``(..., n, n)``) of symmetric
    ``M`` ``(..., n, n)`` (lower triangle read, as ``torch.linalg.eigh``), in ``M``'s dtype."""
    with threads_for(macs=M.shape[-1] ** 2):
        lam, U = torch.linalg.eigh(M.to(torch.float64))
    return lam.to(M.dtype), U.to(M.dtype)


def eigvalsh(M: torch.Tensor) -> torch.Tensor:
    """Eigenvalues (ascending, ``(..., n)``) of symmetric ``M`` ``(..., n, n)``, in ``M``'s dtype."""
    with threads_for(macs=M.shape[-1] ** 2):
        return torch.linalg.eigvalsh(M.to(torch.float64)).to(M.dtype)


def norm2(M: torch.Tensor) -> float:
    """The spectral norm (largest singular value) of a matrix ``(m, n)``; 0.0 for an empty one."""
    if M.numel() == 0:
        return 0.0
    with threads_for(macs=M.shape[-2] * M.shape[-1]):
        return float(torch.linalg.matrix_norm(M.to(torch.float64), ord=2))


def rel_error(A: torch.Tensor, B: torch.Tensor, scale: float | None = None) -> float:
    """``‖A − B‖_F / scale``, ``scale`` defaulting to ``‖B‖_F``: the relative Frobenius error of
    ``A`` against the reference ``B`` (tensors of the same shape, any number of dimensions, any
    floating dtypes; the norms are accumulated in float64). Give ``scale`` to measure against
    another norm, e.g. a block's error against the whole matrix's norm.

    Returns 0.0 when ``A`` equals ``B`` (two zero tensors included) and ``inf`` when the scale is 0
    and they differ. Raises ``ValueError`` when the shapes differ, or for a negative or non-finite
    ``scale``.
    """
    if A.shape != B.shape:
        raise ValueError(f"rel_error: A has shape {tuple(A.shape)} and the reference B {tuple(B.shape)}; expected the same")
    if scale is not None and not (math.isfinite(scale) and scale >= 0):
        raise ValueError(f"rel_error: scale must be a finite number >= 0, got {scale!r}")
    diff = float(torch.linalg.vector_norm(A - B, dtype=torch.float64))
    den = float(torch.linalg.vector_norm(B, dtype=torch.float64)) if scale is None else float(scale)
    if den == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / den
