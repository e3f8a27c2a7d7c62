"""The operator contract's checks, shared by the estimators (:mod:`.estimators`) and the solvers
(:mod:`.solve`): an operator has ``A @ X``, a 2-d ``shape``, a float ``dtype`` and a ``device``; a symmetric
one says so (``is_symmetric``/``SELF_ADJOINT``) or, dense, is symmetric to rounding. Every check raises
``ValueError`` before any product."""

from __future__ import annotations

import torch

from ..validation import FLOAT_DTYPES, warn_tf32

__all__ = ["check_operator", "check_symmetric", "asymmetry"]


def check_operator(A, square: bool = True, symmetric: bool = False, who: str = "this estimator") -> tuple[int, int]:
    """``A``'s shape ``(n_out, n_in)`` after checking the operator contract (``@``, a 2-d ``shape``, a float
    ``dtype``, a ``device``); ``square``: ``n_out == n_in``; ``symmetric``: :func:`check_symmetric` too
    (``who`` names the estimator in its error). Raises ``ValueError``."""
    shape = getattr(A, "shape", None)
    if shape is None or len(shape) != 2 or not hasattr(A, "__matmul__"):
        raise ValueError(f"A must be an operator with A @ X and a 2-d shape, got {type(A).__name__}")
    if square and shape[0] != shape[1]:
        raise ValueError(f"A must be square (a symmetric operator), got shape {tuple(shape)}")
    if getattr(A, "dtype", None) not in FLOAT_DTYPES:
        raise ValueError(f"A must have dtype torch.float32 or torch.float64, got {getattr(A, 'dtype', None)!r}")
    if getattr(A, "device", None) is None:
        raise ValueError("A must have a device")
    if symmetric:
        check_symmetric(A, who)
    warn_tf32(A.dtype, A.device)
    return int(shape[0]), int(shape[1])


def asymmetry(A) -> str | None:
    """Why the square ``A`` is not a symmetric operator, or ``None`` where it is (or is taken to be): a
    :class:`~blockhess.operators.HessianOperator` view by its ``is_symmetric`` (an off-diagonal view ``A[a, b]``
    is not, square or not), another operator by a ``SELF_ADJOINT`` attribute (curvlinops), a dense tensor by
    ``‖A − Aᵀ‖_F ≤ n ε ‖A‖_F`` (the rule of ``HessianOperator.from_dense``: symmetric to rounding; one pass over
    its entries, no product). An operator with neither attribute is taken as symmetric."""
    if isinstance(A, torch.Tensor):
        n = A.shape[0]
        asym = float(torch.linalg.matrix_norm(A - A.T))
        allowed = n * torch.finfo(A.dtype).eps * float(torch.linalg.matrix_norm(A))
        if not asym <= allowed:
            return f"a dense tensor with ||A - A^T||_F = {asym:.3g} > n·eps·||A||_F = {allowed:.3g}"
        return None
    sym = getattr(A, "is_symmetric", None)
    if sym is None:
        sym = getattr(A, "SELF_ADJOINT", None)
    if sym is None or bool(sym):
        return None
    rows, cols = getattr(A, "names", None), getattr(A, "in_names", None)
    if rows is not None and cols is not None:
        return f"the off-diagonal view A[{_key(rows)}, {_key(cols)}] (rows {list(rows)}, columns {list(cols)})"
    return f"{type(A).__name__} says it is not (is_symmetric / SELF_ADJOINT False)"


def _key(names) -> str:
    return repr(names[0]) if len(names) == 1 else repr(tuple(names))


def check_symmetric(A, who: str = "this estimator") -> None:
    """Raise ``ValueError`` (naming ``who`` and, for a view, its blocks) unless the square operator ``A`` is
    symmetric as :func:`asymmetry` judges it: before any product, for the estimators that assume a
    symmetric operator (Lanczos, stochastic Lanczos quadrature, Hutch++, the solvers)."""
    why = asymmetry(A)
    if why is not None:
        raise ValueError(f"{who} assumes a symmetric operator, but A is not symmetric: {why}; pass a symmetric "
                         "view A[a, a] (of the estimators, frobenius_norm and hutchinson_diagonal take any operator)")
