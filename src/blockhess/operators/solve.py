r"""Exact damped inverse-Hessian products: :func:`solve` finds ``x`` with ``(A + λI) x = b`` by the
conjugate gradient method or MINRES on the operator's exact products, to a stated *true* residual;
:func:`influence` is the damped bilinear form ``g_iᵀ (A + λI)⁻¹ g_test`` built on it.

Both Krylov methods are the textbook recurrences, written here from the papers: conjugate gradients
(Hestenes & Stiefel 1952; Saad, *Iterative Methods for Sparse Linear Systems*, 2nd ed. 2003, Algorithm
6.18) and MINRES (Paige & Saunders, "Solution of sparse indefinite systems of linear equations", SIAM J.
Numer. Anal. 12, 1975; in the short form of Greenbaum, *Iterative Methods for Solving Linear Systems*,
1997, §2.5). Derivation notes, the true residual and breakdown: docs/derivations.md, "Solving with the
exact operator".
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from ..validation import check_bool, check_int
from .checks import check_operator
from .estimators import NotConvergedError, pow2_exponent, pow2_scale

__all__ = ["SolveResult", "InfluenceResult", "IndefiniteError", "solve", "influence"]

METHODS = ("auto", "cg", "minres")
MAX_RESTARTS = 8  # fresh recurrences from the current x when the true residual misses tol after the recurrence's did


class IndefiniteError(NotConvergedError):
    """The conjugate gradient method broke down: a search direction ``p`` had ``pᵀ(A + λI)p <= 0``, so
    ``A + λI`` is not positive definite (a Hessian is indefinite in general) and CG's iterates mean
    nothing. Use ``method="minres"`` (any symmetric matrix), or a damping above ``-λ_min(A)``. Raised
    whatever ``allow_unconverged`` says; ``.result`` holds the iterate before the breakdown."""


@dataclass(frozen=True)
class SolveResult:
    """A solution of ``(A + λI) x = b`` (:func:`solve`).

    ``x``: of ``b``'s kind and shape (a tensor ``(n,)``/``(n, k)``, or a list of tensors in the operator's
    list format). ``residual_norm``: the true ``‖b − (A + λI) x‖₂`` of each column, recomputed by one product
    at the end (not the recurrence's estimate): a float for one right-hand side, a tensor ``(k,)`` for ``k``.
    ``relative_residual``: the same over ``‖b‖₂`` (0 for a zero column, whose solution is 0). ``matvecs``:
    columns multiplied by ``A`` (recurrence, initial and final residual products). ``iterations``: recurrence
    steps (the most any column took, restarts included). ``restarts``: fresh recurrences from the current
    iterate after the true residual missed ``tol`` where the recurrence's had reached it. ``converged``:
    every column's true relative residual is at most ``tol``. ``method``: ``"cg"`` or ``"minres"``, the
    one run. ``damping``, ``tol``: as asked."""

    x: torch.Tensor | list
    residual_norm: float | torch.Tensor
    relative_residual: float | torch.Tensor
    matvecs: int
    iterations: int
    restarts: int
    converged: bool
    method: str
    damping: float
    tol: float


@dataclass(frozen=True)
class InfluenceResult:
    """Influence scores (:func:`influence`): ``scores`` ``(m,)``, ``scores[i] = g_iᵀ (A + λI)⁻¹ g_test``;
    ``solution`` the :class:`SolveResult` of ``(A + λI) s = g_test`` they come from (``s`` its ``x``)."""

    scores: torch.Tensor
    solution: SolveResult


# ----------------------------------------------------------------------------- input checks


def _check_real(name: str, value, low: float, low_open: bool, high: float | None = None) -> float:
    ok = not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(float(value))
    if ok:
        v = float(value)
        ok = (v > low if low_open else v >= low) and (high is None or v < high)
    if not ok:
        rng = f"{'(' if low_open else '['}{low:g}, {'inf' if high is None else f'{high:g}'})"
        raise ValueError(f"{name} must be a finite real number in {rng}, got {value!r}")
    return float(value)


def _as_columns(A, b, what: str):
    """``b`` as ``(n, k)`` and a function back to ``b``'s kind: a tensor ``(n,)``/``(n, k)``, or a list in
    ``A``'s list format (tensors of the column variables' shapes, each with an optional trailing ``k``)."""
    n = int(A.shape[1])
    if isinstance(b, list):
        names, shapes = getattr(A, "in_names", None), getattr(A, "in_shapes", None)
        if names is None or shapes is None:
            raise ValueError(f"{what} is a list, but A ({type(A).__name__}) has no list format (in_names/in_shapes): "
                             f"pass a tensor ({n},) or ({n}, k)")
        want = [tuple(shapes[v]) for v in names]
        if len(b) != len(want) or not all(isinstance(t, torch.Tensor) for t in b):
            raise ValueError(f"{what} as a list must hold {len(want)} tensors, one per variable {list(names)}")
        if all(tuple(t.shape) == s for t, s in zip(b, want)):
            k = None
        elif all(t.ndim == len(s) + 1 and tuple(t.shape[:-1]) == s for t, s in zip(b, want)) \
                and len({t.shape[-1] for t in b}) == 1:
            k = int(b[0].shape[-1])
        else:
            raise ValueError(f"{what} as a list must hold tensors of shapes {want}, each with an optional trailing k, "
                             f"got {[tuple(t.shape) for t in b]}")
        for t, v in zip(b, names):
            _check_tensor(A, t, f"{what}[{list(names).index(v)}] ({v!r})")
        B = torch.cat([t.reshape(-1, 1 if k is None else k) for t in b], 0)
        sizes = [math.prod(s) for s in want]

        def back(X):
            out, off = [], 0
            for s, size in zip(want, sizes):
                out.append(X[off:off + size].reshape(s if k is None else (*s, X.shape[1])))
                off += size
            return out

        return B, back, ("list", tuple(want), k)
    if not isinstance(b, torch.Tensor):
        raise ValueError(f"{what} must be a tensor ({n},) or ({n}, k), or a list in A's list format, got "
                         f"{type(b).__name__}")
    if b.ndim not in (1, 2) or b.shape[0] != n or (b.ndim == 2 and b.shape[1] == 0):
        raise ValueError(f"{what} must have shape ({n},) or ({n}, k) with k >= 1, got {tuple(b.shape)}")
    _check_tensor(A, b, what)
    if b.ndim == 1:
        return b[:, None], (lambda X: X[:, 0]), ("vector", n, None)
    return b, (lambda X: X), ("matrix", n, int(b.shape[1]))


def _check_tensor(A, t: torch.Tensor, what: str) -> None:
    if t.dtype != A.dtype:
        raise ValueError(f"{what} must have A's dtype {A.dtype}, got {t.dtype}")
    if t.device != torch.device(A.device):
        raise ValueError(f"{what} must be on A's device {A.device}, got {t.device}")
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{what} contains NaN or Inf")


# ----------------------------------------------------------------------------- the recurrences


class _Shifted:
    """``(A + λI) X`` on the columns asked, counting the columns multiplied."""

    def __init__(self, A, damping: float, budget: int):
        self.A, self.damping, self.budget, self.matvecs = A, damping, budget, 0

    def __call__(self, X: torch.Tensor) -> torch.Tensor:
        Y = self.A @ X
        if not isinstance(Y, torch.Tensor) or tuple(Y.shape) != tuple(X.shape):
            got = tuple(Y.shape) if isinstance(Y, torch.Tensor) else type(Y).__name__
            raise RuntimeError(f"A @ X returned {got} for X of shape {tuple(X.shape)}")
        self.matvecs += X.shape[1]
        return Y + self.damping * X if self.damping else Y

    def left(self) -> int:
        return self.budget - self.matvecs


def _cg(op: _Shifted, X: torch.Tensor, R: torch.Tensor, goal: torch.Tensor, active: torch.Tensor):
    """Conjugate gradients (Saad 2003, Alg. 6.18) on each active column of ``X`` (its residual ``R``) at
    once, each with its own scalars, until ``‖r‖ <= goal`` or the budget. Returns ``(steps, broken)``,
    ``broken`` the columns where ``pᵀ(A + λI)p <= 0``; ``X`` and ``R`` are updated in place."""
    P = R.clone()
    rr = (R * R).sum(0)
    steps = 0
    active = active & (rr.sqrt() > goal)
    broken = torch.zeros_like(active)
    while bool(active.any()) and op.left() >= int(active.sum()):
        idx = active.nonzero()[:, 0]
        Pa = P[:, idx]
        Q = op(Pa)
        pq = (Pa * Q).sum(0)
        bad = pq <= 0
        if bool(bad.any()):
            broken[idx[bad]] = True
            active[idx[bad]] = False
            keep = ~bad
            idx, Pa, Q, pq = idx[keep], Pa[:, keep], Q[:, keep], pq[keep]
            if idx.numel() == 0:
                break
        alpha = rr[idx] / pq
        X[:, idx] += alpha * Pa
        R[:, idx] -= alpha * Q
        rr_new = (R[:, idx] ** 2).sum(0)
        P[:, idx] = R[:, idx] + (rr_new / rr[idx]) * Pa
        rr[idx] = rr_new
        steps += 1
        active[idx] = rr_new.sqrt() > goal[idx]
    return steps, broken


def _minres(op: _Shifted, X: torch.Tensor, R: torch.Tensor, goal: torch.Tensor, active: torch.Tensor):
    """MINRES (Paige & Saunders 1975; Greenbaum 1997 §2.5): the Lanczos recurrence on ``A + λI`` from each
    active column's residual, its tridiagonal matrix reduced by Givens rotations, ``x`` updated along the
    directions ``w``; ``|η|`` is the recurrence's residual norm. All active columns at once, each with its own
    scalars, until ``|η| <= goal``, the Krylov space is invariant (``β = 0``), or the budget. Returns
    ``(steps, broken)`` (``broken`` all False: MINRES needs only symmetry); ``X`` updated in place, ``R``
    left stale (the caller recomputes the true residual)."""
    k = X.shape[1]
    z = X.new_zeros(k)
    beta1 = R.norm(dim=0)
    eta = beta1.clone()
    V = R / torch.where(beta1 > 0, beta1, torch.ones_like(beta1))
    V_old = torch.zeros_like(V)
    W, W_old = torch.zeros_like(V), torch.zeros_like(V)
    beta = z.clone()  # β_j of the Lanczos recurrence (β_1 multiplies v_0 = 0)
    c, c_old, s, s_old = z + 1, z + 1, z.clone(), z.clone()
    active = active & (eta > goal)
    steps = 0
    while bool(active.any()) and op.left() >= int(active.sum()):
        idx = active.nonzero()[:, 0]
        v, b = V[:, idx], beta[idx]
        Z = op(v) - b * V_old[:, idx]
        alpha = (v * Z).sum(0)
        Z = Z - alpha * v
        beta_next = Z.norm(dim=0)
        # the previous rotations on the new column of the tridiagonal matrix, then a new rotation
        ci, co, si, so = c[idx], c_old[idx], s[idx], s_old[idx]
        delta = ci * alpha - co * si * b
        rho1 = torch.sqrt(delta ** 2 + beta_next ** 2)
        rho2 = si * alpha + co * ci * b
        rho3 = so * b
        stalled = rho1 == 0  # δ = β = 0: a singular system whose Krylov space ended (nothing more to gain)
        safe = torch.where(stalled, torch.ones_like(rho1), rho1)
        c_new, s_new = delta / safe, beta_next / safe
        w = (v - rho3 * W_old[:, idx] - rho2 * W[:, idx]) / safe
        step = torch.where(stalled, z[idx], c_new * eta[idx])
        X[:, idx] += step * w
        eta[idx] = torch.where(stalled, eta[idx], -s_new * eta[idx])
        W_old[:, idx], W[:, idx] = W[:, idx], w
        c_old[idx], c[idx], s_old[idx], s[idx] = ci, c_new, si, s_new
        V_old[:, idx] = v
        V[:, idx] = Z / torch.where(beta_next > 0, beta_next, torch.ones_like(beta_next))
        beta[idx] = beta_next
        steps += 1
        done = (eta[idx].abs() <= goal[idx]) | (beta_next == 0) | stalled
        active[idx] = ~done
    return steps, torch.zeros_like(active)


# ----------------------------------------------------------------------------- solve


def solve(A, b, damping: float = 0.0, tol: float = 1e-8, *, method: str = "auto", max_matvecs: int | None = None,
          x0=None, allow_unconverged: bool = False) -> SolveResult:
    r"""Solve ``(A + λI) x = b`` for a symmetric operator ``A`` by its exact products, to a true relative
    residual ``‖b − (A + λI) x‖₂ / ‖b‖₂ <= tol`` in every column.

    ``A``: a symmetric operator (a :class:`~blockhess.operators.HessianOperator`, a square view ``A[a, a]``, the
    module-layout ``A.to_module(model)``, a dense symmetric tensor, any operator with ``@``, ``shape``,
    ``dtype``, ``device``; :func:`~blockhess.operators.checks.check_operator`). ``b``: a tensor ``(n,)`` or
    ``(n, k)`` of ``A``'s dtype and device, or, for an operator with a list format, a list of tensors
    shaped like its variables (``list(model.parameters())`` for ``A.to_module(model)``), each with an
    optional trailing ``k``; ``x`` comes back in the same kind and shape. The ``k`` columns are independent
    recurrences run together (each its own scalars; one product of the columns still running per step; a
    column stops when it has converged). ``damping`` ``λ >= 0``. ``tol`` in ``(0, 1)``.

    ``method``: ``"minres"`` (Paige & Saunders 1975) for any symmetric ``A + λI``, indefinite or singular;
    ``"cg"`` (Hestenes & Stiefel 1952; Saad 2003, Alg. 6.18) only for ``A + λI`` positive definite (the
    Gauss–Newton part ``part="outer"`` with ``λ > 0``); it raises :class:`IndefiniteError` on a direction
    with ``pᵀ(A + λI)p <= 0``. ``"auto"`` is MINRES: a Hessian is indefinite in general, and MINRES's
    iterate has the least residual over the Krylov space, so to a residual tolerance it needs no more
    steps than CG even where CG applies (CG's optimality is in the ``A + λI`` norm of the error).

    Singular ``A + λI`` (``λ = 0``, a Gauss–Newton part of rank below ``n``): for ``b`` in its range and
    ``x0`` zero (or in the range), MINRES's iterates stay in the range, so its solution is the minimum-norm
    one, ``(A + λI)⁺ b``. For ``b`` outside the range no ``x`` reaches ``tol``: :class:`NotConvergedError`,
    and nothing is promised of its ``.result.x``: once the range is exhausted, rounding in the Lanczos
    vectors lets MINRES's iterate grow along the null space, so it is not a least-squares solution in
    general (that needs MINRES-QLP, Choi, Paige & Saunders 2011, not offered).

    ``x0``: the start, of ``b``'s kind and shape (default zero). ``max_matvecs``: at most this many columns
    multiplied in all (default ``k · (10n + 100)``: in exact arithmetic either method ends within ``n`` steps;
    in floating point, without reorthogonalisation, an ill-conditioned system takes several times that).
    The recurrence's residual stops it; then one product gives the true residual, and where that misses
    ``tol`` (rounding over many steps) the recurrence restarts from the current iterate, at most
    ``MAX_RESTARTS`` times and only while each restart lowers the true residual. Each column of ``b`` (and of
    ``x0``) is first scaled by a power of two (exact), so a ``b`` of any size the dtype holds is solved
    alike (norms of entries near ``1e-200`` would underflow in float64).

    Returns a :class:`SolveResult`. Raises ``ValueError`` before any product for an operator that is not
    square or says it is not symmetric (an off-diagonal view ``A[a, b]``), a ``b`` or ``x0`` of another
    shape, dtype or device, with NaN or Inf, a negative, NaN or infinite damping, ``tol`` outside
    ``(0, 1)``, an unknown method, ``max_matvecs`` not an int >= 1; :class:`NotConvergedError` (its
    ``.result`` the :class:`SolveResult` with ``converged=False``) when a column's true relative residual
    is above ``tol`` at the end, unless ``allow_unconverged=True``; :class:`IndefiniteError` (a
    :class:`NotConvergedError`) on CG's breakdown, always. docs/derivations.md, "Solving with the exact
    operator".
    """
    n, _ = check_operator(A, symmetric=True, who="solve")
    damping = _check_real("damping", damping, 0.0, False)
    tol = _check_real("tol", tol, 0.0, True, 1.0)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    check_bool("allow_unconverged", allow_unconverged)
    Bm, back, kind = _as_columns(A, b, "b")
    k = Bm.shape[1]
    budget = k * (10 * n + 100) if max_matvecs is None else check_int("max_matvecs", max_matvecs, 1)
    if x0 is not None:
        X0, _, kind0 = _as_columns(A, x0, "x0")
        if kind0 != kind:
            raise ValueError(f"x0 must be of b's kind and shape ({_describe(kind)}), got {_describe(kind0)}")
    run = "minres" if method == "auto" else method
    # each column scaled by a power of two (exact: (A + λI)(x 2^-c) = b 2^-c), so that the recurrences' inner
    # products neither underflow nor overflow whatever b's size (entries of 1e-200 square to zero in float64)
    c = [pow2_exponent(Bm[:, j]) for j in range(k)]
    Bm = torch.stack([pow2_scale(Bm[:, j], -c[j]) for j in range(k)], 1)
    if x0 is not None:
        X0 = torch.stack([pow2_scale(X0[:, j], -c[j]) for j in range(k)], 1)
    op = _Shifted(A, damping, budget)
    bnorm = Bm.norm(dim=0)
    goal = tol * bnorm
    X = torch.zeros_like(Bm) if x0 is None else X0.clone()
    if x0 is None:
        R = Bm.clone()
    elif op.left() >= k:
        R = Bm - op(X)
    else:
        R = None
    steps = restarts = 0
    broken = torch.zeros(k, dtype=torch.bool, device=Bm.device)
    if R is not None:
        true = R.norm(dim=0)
        iterate = _cg if run == "cg" else _minres
        while True:
            active = true > goal
            if not bool(active.any()) or op.left() < 2 * int(active.sum()):  # a step and its true residual
                break
            op.budget -= int(active.sum())  # keep one true-residual product in hand
            s, broken = iterate(op, X, R, goal, active)
            op.budget += int(active.sum())
            steps += s
            if bool(broken.any()):
                break
            cols = active.nonzero()[:, 0]  # only the columns that ran: the others' residuals stand
            R[:, cols] = Bm[:, cols] - op(X[:, cols])
            before, true = true, true.clone()
            true[cols] = R[:, cols].norm(dim=0)
            missed = true > goal
            if not bool(missed.any()) or restarts >= MAX_RESTARTS or not bool((true[missed] < before[missed]).all()):
                break
            restarts += 1
    else:
        true = torch.full((k,), float("inf"), dtype=Bm.dtype, device=Bm.device)
    relres = torch.where(bnorm > 0, true / torch.where(bnorm > 0, bnorm, torch.ones_like(bnorm)), true)
    converged = bool((true <= goal).all()) and not bool(broken.any())
    X = torch.stack([pow2_scale(X[:, j], c[j]) for j in range(k)], 1)  # back to b's scale
    true = torch.stack([pow2_scale(true[j], c[j]) for j in range(k)])
    single = kind[0] == "vector" or (kind[0] == "list" and kind[2] is None)
    result = SolveResult(back(X), float(true[0]) if single else true, float(relres[0]) if single else relres,
                         op.matvecs, steps, restarts, converged, run, damping, tol)
    if bool(broken.any()):
        cols = broken.nonzero()[:, 0].tolist()
        raise IndefiniteError(f"solve (cg): breakdown, p^T (A + damping I) p <= 0 in column(s) {cols} after {steps} "
                              f"steps: A + {damping:g} I is not positive definite; use method='minres' (any symmetric "
                              "matrix) or a larger damping", result)
    if not converged and not allow_unconverged:
        worst = float(relres.max())
        raise NotConvergedError(f"solve ({run}) did not reach tol={tol:g}: the true relative residual is {worst:.3g} "
                                f"after {op.matvecs} products (max_matvecs={budget}, {restarts} restarts); raise "
                                "max_matvecs or the damping (for a singular A + damping I: b outside its range has no "
                                "solution), or pass allow_unconverged=True", result)
    return result


def _describe(kind) -> str:
    if kind[0] == "list":
        return f"a list of shapes {list(kind[1])}" + ("" if kind[2] is None else f" with a trailing {kind[2]}")
    return f"a tensor ({kind[1]},)" if kind[0] == "vector" else f"a tensor ({kind[1]}, {kind[2]})"


def influence(A, train_grads: torch.Tensor, test_grad: torch.Tensor, damping: float, tol: float = 1e-8, *,
              method: str = "auto", max_matvecs: int | None = None) -> InfluenceResult:
    r"""Influence scores of training examples on a test example: ``scores[i] = g_iᵀ (A + λI)⁻¹ g_test``,
    by one :func:`solve` of ``(A + λI) s = g_test`` and ``scores = train_gradsᵀ s``.

    ``A``: the symmetric operator (the Hessian of the training loss, :func:`~blockhess.operators.solve`'s
    ``A``). ``train_grads``: ``(n, m)``, column ``i`` the gradient ``g_i`` of training example ``i``'s loss,
    flat in ``A``'s order (canonical ``vec_r``; for ``A.to_module(model)``, ``parameters_to_vector``'s).
    ``test_grad``: ``(n,)``, the gradient of the test example's loss. Both of ``A``'s dtype and device, finite.
    ``damping`` ``λ >= 0``, ``tol``, ``method``, ``max_matvecs`` as :func:`solve` (``method="auto"``: MINRES).

    This is the damped bilinear form only; Koh & Liang's influence of up-weighting example ``i`` on the
    test loss (ICML 2017, eq. 2) is ``−scores[i]``, and for a Hessian of the mean loss over ``N`` examples
    removing example ``i`` changes the test loss by about ``scores[i] / N``.

    Returns an :class:`InfluenceResult`. Raises ``ValueError`` before any product for ``train_grads`` not
    ``(n, m)`` with ``m >= 1``, ``test_grad`` not ``(n,)``, another dtype or device, NaN or Inf, and as
    :func:`solve`; :class:`NotConvergedError` as :func:`solve` (no ``allow_unconverged``: a score from an
    unconverged solve would be silently wrong).
    """
    n, _ = check_operator(A, symmetric=True, who="influence")
    if not isinstance(train_grads, torch.Tensor) or train_grads.ndim != 2 or train_grads.shape[0] != n \
            or train_grads.shape[1] == 0:
        got = tuple(train_grads.shape) if isinstance(train_grads, torch.Tensor) else type(train_grads).__name__
        raise ValueError(f"train_grads must be a tensor ({n}, m) with m >= 1 (one training gradient a column), got {got}")
    if not isinstance(test_grad, torch.Tensor) or tuple(test_grad.shape) != (n,):
        got = tuple(test_grad.shape) if isinstance(test_grad, torch.Tensor) else type(test_grad).__name__
        raise ValueError(f"test_grad must be a tensor ({n},), got {got}")
    _check_tensor(A, train_grads, "train_grads")
    try:
        sol = solve(A, test_grad, damping, tol, method=method, max_matvecs=max_matvecs)
    except NotConvergedError as e:
        raise NotConvergedError(str(e).replace(", or pass allow_unconverged=True", " (influence takes no "
                                "allow_unconverged: a score from an unconverged solve would be wrong)"), e.result) from None
    return InfluenceResult(train_grads.T @ sol.x, sol)
