r"""Estimators on any symmetric operator, as free functions named after their method.

An operator here is anything with ``A @ X`` for a tensor ``X`` of shape ``(n, k)`` (returning
``(n_out, k)``), ``A.shape``, ``A.dtype`` (float32 or float64) and ``A.device``: a
:class:`~blockhess.operators.HessianOperator` or a view of it, a dense tensor, or a curvlinops
operator. The estimators of a symmetric operator (Lanczos, SLQ, Hutch++) refuse one that says it is not
(``ValueError``, before any product): an off-diagonal view ``A[a, b]`` (``is_symmetric`` ``False``, square
or not), an operator with ``SELF_ADJOINT = False``, a dense tensor with ``‖A − Aᵀ‖_F > n ε ‖A‖_F``; an
operator with neither attribute is taken to be symmetric (a Hessian). Every random draw comes from a CPU
``torch.Generator`` seeded with ``seed`` (the same draws on every device; the global RNG untouched).
Formulas, sources and the residual conventions are in docs/derivations.md, "Estimators on operators".
On CUDA in float32 with TF32 matrix products enabled every estimator warns (``UserWarning``): the
reorthogonalisations would then carry about 1e-3 relative error.

* :func:`lanczos_eigs`: extreme eigenpairs by block Lanczos with full reorthogonalisation and
  Krylov–Schur restarts, to a stated residual, never silently unconverged (:class:`NotConvergedError`);
  the dense eigendecomposition below a size.
* :func:`slq_density`: the spectral density by stochastic Lanczos quadrature, with its sampling and
  quadrature errors and a pointwise interval; :meth:`SLQResult.integral` any ``tr f(A) / n`` from it.
* :func:`hutchpp_trace`: the trace by Hutch++, with its standard error and a calibrated interval.
* :func:`frobenius_norm`: exact from the columns, or estimated the Hutch++ way.
* :func:`diagonal`: the engine's exact diagonal (never sampled); :func:`hutchinson_diagonal` samples one.
* :func:`per_block`: any of these for every block ``A[a, a]`` (or pair ``A[a, b]``) in one call.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Callable

import torch

from .. import linalg
from ..validation import InsufficientMemoryError, check_bool, check_fits, check_int
from .checks import asymmetry, check_operator, check_symmetric

__all__ = ["NotConvergedError", "EigResult", "KrylovProbe", "Estimate", "SLQResult", "lanczos_eigs", "slq_density", "lanczos_bytes",
           "slq_bytes", "hutchpp_trace",
           "hutchinson_diagonal", "frobenius_norm", "diagonal", "per_block"]

WHICH = ("LA", "SA", "LM")
RELS = ("each", "scale")
NCV_DEFAULT = 60  # lanczos_eigs's smallest default basis (docs/derivations.md §17: products against ncv)
DGKS = 1 / math.sqrt(2)  # a Gram–Schmidt pass is repeated where a column kept less of its norm
DOT_ROWS = 1 << 16  # inner products over more rows than this are summed by blocks in float64: _dots
NORM_ROWS = 1 << 12  # ... and norms by blocks of this many entries, each block's in float32: _norms
ROTATE_ENTRIES = 1 << 22  # a restart's rows in blocks of this many basis entries (16 MB in float32): _rotate
POW2_FREE = 16  # a first product of 2^-16 to 2^16 in size is not rescaled: _Pow2Scaled (exact either way)
CHECK_COLUMNS = 10  # lanczos_eigs's default check: at least this many products on the complement of the found vectors
FAILURE_PROBABILITY = 1e-6  # lanczos_eigs's default: the check's bound on the probability of a missed eigenvalue
IDENTITY_COLUMNS = 512  # columns of the identity multiplied at a time for exact (column-by-column) results


class NotConvergedError(RuntimeError):
    """An iterative estimator stopped before its stated tolerance; ``.result`` holds what it had (with
    ``converged=False``), for a caller who wants to inspect it."""

    def __init__(self, message: str, result):
        super().__init__(message)
        self.result = result


@dataclass(frozen=True)
class EigResult:
    """Eigenpairs of a symmetric operator (:func:`lanczos_eigs`), most wanted first.

    ``eigenvalues`` ``(k,)``, ``eigenvectors`` ``(n, k)`` (orthonormal columns), ``residuals`` ``(k,)`` the
    true ``‖A v − λ v‖₂`` of each pair (from a product, not the recurrence), ``bounds`` ``(k,)`` what each
    residual had to reach (``tol · |λ_i|``, or ``tol · scale`` for ``rel="scale"`` and for ``|λ_i| < tol ·
    scale``), ``scale`` the largest ``|Ritz value|`` seen (at most ``‖A‖₂``), ``tol``, ``rel``,
    ``converged`` (every residual within its bound, and the check, if any, found nothing beyond),
    ``matvecs`` (every column multiplied: iterations, residual products, checks), ``iterations`` (block
    products of the iteration, the checks' apart), ``restarts`` (Krylov–Schur restarts, and runs continued from the Ritz vectors),
    ``check_matvecs`` (the checks' share of ``matvecs``), ``check_value`` (the last check's most wanted
    Ritz value on the complement of the found vectors; ``None`` without a check), ``which``, ``method``
    (``"lanczos"``, ``"dense"`` or ``"kronecker"``), ``ncv`` (the basis size used; ``n`` for the dense and
    Kronecker paths),
    ``miss_probability`` (the check's bound on the probability that an eigenvalue beyond the ``k``-th found
    one was missed: at most ``failure_probability`` when converged with a check, 1 without a check, 0 for
    the dense path), ``probes`` the runs from random starts kept for :func:`slq_density` (:class:`KrylovProbe`:
    the first run before any restart, where it started at random with one column; the certifying checks),
    ``multiplicity`` what the closed form proves of each returned eigenvalue's multiplicity: on the Kronecker
    path ``d`` of ``A = M ⊗ I_d`` (each eigenvalue of ``M`` is an eigenvalue of ``A`` exactly ``d`` times its
    multiplicity in ``M``: ``d`` times where ``M``'s is simple, a multiple of ``d`` always; the spectrum of
    a Kronecker product, Horn & Johnson, *Topics in Matrix Analysis*, Thm 4.2.12), ``None`` on the other
    paths (nothing claimed). Each eigenvalue lies within its residual of an eigenvalue of ``A``
    (Weyl/Kahan for symmetric ``A``)."""

    eigenvalues: torch.Tensor
    eigenvectors: torch.Tensor
    residuals: torch.Tensor
    bounds: torch.Tensor
    scale: float
    tol: float
    rel: str
    converged: bool
    matvecs: int
    iterations: int
    restarts: int
    check_matvecs: int
    check_value: float | None
    which: str
    method: str
    ncv: int
    miss_probability: float = 1.0
    probes: tuple = ()
    multiplicity: int | None = None


@dataclass(frozen=True)
class KrylovProbe:
    r"""A Lanczos run of :func:`lanczos_eigs` from a random start, kept so that :func:`slq_density` can take it
    as one of its probes (``probes=``) without multiplying again.

    ``T`` ``(m, m)`` float64: the operator projected on the run's Krylov basis (full reorthogonalisation),
    whose first vector is the start, in the operator's own scale. ``deflated`` ``(k,)``: empty for a start
    uniform on the unit sphere of the whole space (the iteration's first run, before any restart); else
    the run was on the operator restricted to the orthogonal complement of ``k`` found vectors, from a
    start uniform on that complement's sphere (a check of :func:`lanczos_eigs`), and these are the found
    vectors' Ritz values. ``n`` the operator's dimension. :meth:`rule` gives the Gauss rule of its first
    ``m`` steps (docs/derivations.md §17, "Probes kept from the eigensolver")."""

    T: torch.Tensor
    deflated: torch.Tensor
    n: int

    @property
    def steps(self) -> int:
        """The run's Lanczos steps (``T``'s order)."""
        return self.T.shape[0]

    def covers(self, m: int) -> bool:
        """Whether the run has the ``m`` steps a probe of ``m`` steps needs: at least ``m``, or all of its
        space's (``n``, or ``n − k`` on a complement: its Gauss rule is then exact)."""
        return self.steps >= min(m, self.n - self.deflated.numel())

    def rule(self, m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        r"""``(nodes, weights, nodes_prev, weights_prev)``, float64: the Gauss rule of the first ``m`` steps (all
        of them where the run has fewer) (:math:`T_m = Y\Theta Y^\top`: nodes :math:`\theta_j`, weights
        :math:`Y_{0j}^2`) and of ``m − 1`` steps (the same rule where ``m`` steps span the space: exact).
        Deflated: the ``k`` found values with weight ``1/n`` each, then the complement's rule scaled by
        ``(n − k)/n``, :math:`\frac1n\sum_i\delta_{\theta_i} + \frac{n-k}{n}\sum_j\tau_j\delta_{\rho_j}`: its
        expectation is the spectral measure of :math:`X\Theta X^\top + PAP` (``P`` the projector on the
        complement), whose eigenvalues are within :math:`\|PR\|_2 \le \|R\|_F` of ``A``'s (Weyl; ``R`` the
        found pairs' residuals)."""
        k = self.deflated.numel()
        m = min(m, self.steps)
        theta, Y = linalg.eigh(self.T[:m, :m])
        if m < self.n - k:
            theta_p, Y_p = linalg.eigh(self.T[: m - 1, : m - 1])
        else:
            theta_p, Y_p = theta, Y
        share = (self.n - k) / self.n
        one = torch.full((k,), 1 / self.n, dtype=torch.float64)
        pad = torch.zeros(1, dtype=torch.float64) if theta_p.numel() < theta.numel() else one[:0]
        return (torch.cat([self.deflated, theta]), torch.cat([one, share * Y[0] ** 2]),
                torch.cat([self.deflated, theta_p, pad]), torch.cat([one, share * Y_p[0] ** 2, pad]))


@dataclass(frozen=True)
class Estimate:
    """A (possibly random) estimate: ``value`` (a float, or a tensor ``(n,)`` for a diagonal), ``stderr`` its
    standard error (an estimate of the estimator's standard deviation; 0 where ``exact``), ``matvecs``
    (columns multiplied), ``exact`` (computed column by column, no sampling), and the interval
    ``[ci_low, ci_high]`` that covers the true value with probability ``confidence`` (each estimator states its
    rule; not ``value ± 1.96 stderr`` in general: few samples need Student's t, a norm's interval is
    asymmetric; ``ci_low = ci_high = value`` where ``exact``). Formulas: docs/derivations.md §17, "Stated
    errors and intervals"."""

    value: float | torch.Tensor
    stderr: float | torch.Tensor
    matvecs: int
    exact: bool
    ci_low: float | torch.Tensor | None = None
    ci_high: float | torch.Tensor | None = None
    confidence: float = 0.95


@dataclass(frozen=True)
class SLQResult:
    r"""A spectral density by stochastic Lanczos quadrature (:func:`slq_density`).

    ``grid`` ``(G,)``, ``density`` ``(G,)`` the Gaussian-broadened density
    :math:`\phi(t) = \frac1P\sum_p \phi_p(t)`, :math:`\phi_p(t) = \sum_j \tau_{pj}\, g_\sigma(t-\theta_{pj})` (unit
    mass, an unbiased estimate, up to quadrature, of :math:`\phi^*(t) = \frac1n\sum_i g_\sigma(t-\lambda_i)`),
    ``stderr`` ``(G,)`` :math:`\sqrt{2 s^2(t) / (nP - 2)}`, :math:`s^2(t) = \frac1P\sum_p\sum_j \tau_{pj}
    (g_\sigma(t-\theta_{pj}) - \phi(t))^2` (from the probes' Gauss rules, no product: an estimate of a bound on
    the standard deviation of :math:`\phi(t)`, not the probes' sample standard deviation; docs/derivations.md
    §17), ``quadrature_error`` ``(G,)`` the mean over probes of :math:`|\phi_p^{(m)}-\phi_p^{(m-1)}|` (the ``m``-
    and ``(m−1)``-node Gauss rules; 0 for a probe whose Krylov space became invariant: its rule is exact),
    ``sigma``; ``nodes``, ``weights`` ``(P, m)`` each probe's Ritz values and squared first components (a probe
    with an invariant Krylov space of dimension ``L < m`` has zero weights after ``L``; ``(P, m + k)`` where a
    probe kept from a check carries the ``k`` found values first, :meth:`KrylovProbe.rule`), ``nodes_prev``,
    ``weights_prev`` the ``(m−1)``-node rules, ``n_probes``, ``n_iter`` (``m``), ``matvecs``, ``reorth``, ``n``
    (the operator's dimension), and the pointwise interval ``ci_low``, ``ci_high`` ``(G,)`` at ``confidence``:
    ``density ± max(q · stderr + quadrature_error, rounding)``, ``q`` Student's t quantile with ``P − 1``
    degrees of freedom, ``rounding`` the change of the density under node errors ``n ε max|θ|`` and the
    rounding of its sums, ``ci_low`` at least 0 (a density is not negative). Each grid point's interval
    covers :math:`\phi^*(t)` at about ``confidence`` (pointwise, not simultaneous over the grid; the rule and
    its coverage: docs/derivations.md §17, "Stated errors and intervals"). :meth:`broaden`
    evaluates another grid or width, :meth:`integral` any :math:`\frac1n \mathrm{tr} f(A)`."""

    grid: torch.Tensor
    density: torch.Tensor
    stderr: torch.Tensor
    quadrature_error: torch.Tensor
    sigma: float
    nodes: torch.Tensor
    weights: torch.Tensor
    nodes_prev: torch.Tensor
    weights_prev: torch.Tensor
    n_probes: int
    n_iter: int
    matvecs: int
    reorth: str
    n: int
    ci_low: torch.Tensor | None = None
    ci_high: torch.Tensor | None = None
    confidence: float = 0.95

    def broaden(self, grid: torch.Tensor, sigma: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(density, stderr, quadrature_error)``, each ``(G,)`` in the nodes' dtype, on ``grid`` ``(G,)`` with
        Gaussian width ``sigma > 0``, by the rules of the class docstring. Raises ``ValueError`` for a
        ``grid`` that is not a finite 1-d tensor, a ``sigma`` that is not a finite float ``> 0``."""
        density, stderr, quad, _ = _broaden(self.nodes, self.weights, self.nodes_prev, self.weights_prev, grid, sigma,
                                            self.n)
        return density, stderr, quad

    def integral(self, f: Callable[[torch.Tensor], torch.Tensor], *, confidence: float | None = None) -> Estimate:
        r"""An :class:`Estimate` of :math:`\frac1n\mathrm{tr} f(A) = \int f\,d\mu` (``f(A)`` for the spectral
        measure ``μ``; ``f = lambda x: x`` gives ``tr A / n``) from the probes' Gauss rules, no product.

        ``f`` maps a tensor of nodes ``(P, m)`` to values of the same shape (elementwise, real). ``value``
        :math:`\bar\phi = \frac1P\sum_p\sum_j\tau_{pj}f(\theta_{pj})`, ``stderr`` :math:`\sqrt{2s^2/(nP-2)}`,
        :math:`s^2 = \frac1P\sum_p\sum_j \tau_{pj}(f(\theta_{pj}) - \bar\phi)^2` (as the density's), the
        interval ``value ± max(q · stderr + quadrature, rounding)`` with ``q`` Student's t quantile with
        ``P − 1`` degrees of freedom, ``quadrature`` the mean over probes of the ``m``- vs ``(m−1)``-node rules'
        difference (0 to rounding for a polynomial of degree ``<= 2m − 3``), ``rounding`` the change of the
        rule under node errors ``n ε max|θ|`` (``f`` at ``θ ± n ε max|θ|``) and the rounding of its sums.
        ``confidence`` defaults to the result's. ``matvecs`` the result's; ``exact`` ``False`` (every probe is a
        sample, an invariant Krylov space included).

        Raises ``ValueError`` when ``f`` returns a tensor of another shape or a non-finite value, for a bad
        ``confidence``.
        """
        conf = self.confidence if confidence is None else _check_confidence(confidence)
        fv, fp = f(self.nodes), f(self.nodes_prev)
        if not isinstance(fv, torch.Tensor) or fv.shape != self.nodes.shape or not isinstance(fp, torch.Tensor) \
                or fp.shape != self.nodes.shape:
            raise ValueError(f"f must map the nodes {tuple(self.nodes.shape)} to a tensor of the same shape")
        used, used_prev = self.weights > 0, self.weights_prev > 0  # a probe's rule stops at its invariant space
        if not bool(torch.isfinite(fv[used]).all()) or not bool(torch.isfinite(fp[used_prev]).all()):
            raise ValueError("f returned NaN or Inf at a node")
        w, wp = self.weights.to(torch.float64), self.weights_prev.to(torch.float64)
        fv = torch.where(used, fv, 0).to(torch.float64)
        fp = torch.where(used_prev, fp, 0).to(torch.float64)
        per = (w * fv).sum(1)
        value = float(per.mean())
        P = per.shape[0]
        s2 = float((w * (fv - value) ** 2).sum(1).mean())
        se = math.sqrt(2 * s2 / max(self.n * P - 2, 1))
        quad = float(((w * fv).sum(1) - (wp * fp).sum(1)).abs().mean())
        eps = torch.finfo(self.nodes.dtype).eps
        delta = self.n * eps * float(self.nodes.abs().max())
        moved = torch.maximum((f(self.nodes + delta).to(torch.float64) - fv).abs(),
                              (f(self.nodes - delta).to(torch.float64) - fv).abs())
        moved = torch.where(used & torch.isfinite(moved), moved, 0)  # (a node within δ of f's domain's edge: f's own)
        rounding = float((w * moved).sum(1).mean()) + (self.n_iter + P) * eps * float((w * fv.abs()).sum(1).mean())
        half = max(_t_quantile(conf, P - 1) * se + quad, rounding)
        return Estimate(value, se, self.matvecs, False, value - half, value + half, conf)


# ----------------------------------------------------------------------------- helpers


def _check_confidence(confidence) -> float:
    if isinstance(confidence, bool) or not isinstance(confidence, numbers.Real) or not (0.5 <= confidence < 1):
        raise ValueError(f"confidence must be a float in [0.5, 1), got {confidence!r}")
    return float(confidence)


def _bisect(cdf: Callable[[float], float], p: float, lo: float, hi: float) -> float:
    """The ``x`` in ``[lo, hi]`` with ``cdf(x) = p`` for an increasing ``cdf`` (``hi`` doubled until it reaches
    ``p``), to 1e-12 relative."""
    while cdf(hi) < p:
        lo, hi = hi, 2 * hi
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
        if hi - lo <= 1e-12 * hi:
            break
    return 0.5 * (lo + hi)


def _t_central(t: float, dof: int) -> float:
    """``P(|T| <= t)`` for Student's t with an integer ``dof >= 1``: the finite sums of Abramowitz & Stegun
    26.7.3 (odd ``dof``) and 26.7.4 (even) in ``θ = atan(t / √dof)``."""
    th = math.atan(t / math.sqrt(dof))
    c2, sn = math.cos(th) ** 2, math.sin(th)
    if dof % 2 == 0:
        term = total = 1.0
        for j in range(2, dof, 2):  # (1·3···(j−1)) / (2·4···j) cos^j θ
            term *= (j - 1) / j * c2
            total += term
        return sn * total
    if dof == 1:
        return 2 * th / math.pi
    term = total = math.cos(th)
    for j in range(3, dof - 1, 2):  # (2·4···(j−1)) / (1·3···j) cos^j θ
        term *= (j - 1) / j * c2
        total += term
    return 2 / math.pi * (th + sn * total)


def _t_quantile(confidence: float, dof: int) -> float:
    """The two-sided ``confidence`` quantile of Student's t with ``dof`` degrees of freedom (``dof >= 1``)."""
    return _bisect(lambda t: _t_central(t, dof), confidence, 0.0, 2.0)


def _chi2_quantile(p: float, nu: float) -> float:
    """The ``p`` quantile of the chi-square distribution with ``nu > 0`` (real) degrees of freedom: the
    regularised lower incomplete gamma ``P(ν/2, x/2)`` (``torch.special.gammainc``) inverted by bisection."""
    a = torch.tensor(nu / 2, dtype=torch.float64)
    return _bisect(lambda x: float(torch.special.gammainc(a, torch.tensor(x / 2, dtype=torch.float64))), p, 0.0,
                   max(nu, 1.0))


def _mm(A, X: torch.Tensor) -> torch.Tensor:
    Y = A @ X
    if not isinstance(Y, torch.Tensor) or tuple(Y.shape) != (A.shape[0], X.shape[1]):
        got = tuple(Y.shape) if isinstance(Y, torch.Tensor) else type(Y).__name__
        raise RuntimeError(f"A @ X returned {got} for X of shape {tuple(X.shape)}, expected {(A.shape[0], X.shape[1])}")
    return Y


def _generator(seed) -> torch.Generator:
    seed = check_int("seed", seed, 0)
    if seed >= 2**63:
        raise ValueError(f"seed must be an int in [0, 2**63), got {seed}")
    return torch.Generator().manual_seed(seed)


def pow2_scale(T: torch.Tensor, e: int) -> torch.Tensor:
    """``T · 2^e``, exact (a power of two only moves exponents), in steps that never overflow the factor."""
    while e:
        s = max(-1000, min(1000, e))
        T = T * 2.0**s
        e -= s
    return T


def pow2_exponent(t: torch.Tensor) -> int:
    """The binary exponent ``e`` of ``max |t|`` (``2^{e-1} <= max|t| < 2^e``; 0 for zero or non-finite)."""
    m = float(t.abs().max()) if t.numel() else 0.0
    return math.frexp(m)[1] if m > 0 and math.isfinite(m) else 0


class _Pow2Scaled:
    """``A`` times ``2^{-e}``, ``e`` fixed by its first product (:func:`pow2_exponent` of it, taken as 0 within
    ``±POW2_FREE``: no pass over the product where the scale is already safe): the same eigenvectors, every
    eigenvalue, residual and bound scaled exactly, and the iteration's norms and inner products far from
    under- and overflow whatever ``A``'s scale (entries of ``1e-200`` square to zero in float64)."""

    def __init__(self, A):
        self.A, self.e = A, None
        self.shape, self.dtype, self.device = A.shape, A.dtype, A.device

    def __matmul__(self, X: torch.Tensor) -> torch.Tensor:
        Y = _mm(self.A, X)
        if self.e is None:
            e = pow2_exponent(Y)
            self.e = 0 if abs(e) <= POW2_FREE else e
        return pow2_scale(Y, -self.e)


def _gaussian(gen, shape, A) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=A.dtype).to(A.device)


def _rademacher(gen, shape, A) -> torch.Tensor:
    return (torch.randint(0, 2, shape, generator=gen) * 2 - 1).to(dtype=A.dtype, device=A.device)


def _columns(A, n_in: int):
    """``(j, A @ I[:, j:j+c])`` for consecutive chunks of the identity's columns."""
    for j in range(0, n_in, IDENTITY_COLUMNS):
        c = min(IDENTITY_COLUMNS, n_in - j)
        E = torch.zeros(n_in, c, dtype=A.dtype, device=A.device)
        E[j : j + c].fill_diagonal_(1)
        yield j, _mm(A, E)


def _norms(W: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """The 2-norms of ``W``'s columns (``dim=0``; rows: ``dim=1``), in ``W``'s dtype; over more than ``DOT_ROWS``
    entries the float32 norms of blocks of ``NORM_ROWS`` entries, their squares summed in float64 (one
    ``vector_norm`` over a view of the blocks: no copy): within a few ε of float64's norm. torch's float32
    ``norm`` over all the entries sums the squares in one running float32 sum, which drifts: 2.7e-3 off for
    38.6M entries (docs/derivations.md §17), which Lanczos' normalised vectors would carry."""
    if W.shape[dim] <= DOT_ROWS:
        return W.norm(dim=dim)
    Wd = W.movedim(dim, 0)  # a view: the norms' dimension first, then split into blocks (a view as well)
    n = Wd.shape[0]
    head = n - n % NORM_ROWS
    sq = torch.linalg.vector_norm(Wd[:head].reshape(head // NORM_ROWS, NORM_ROWS, *Wd.shape[1:]), dim=1)
    sq = sq.double().square().sum(0)
    if head < n:
        sq += torch.linalg.vector_norm(Wd[head:], dim=0).double().square()
    return sq.sqrt().to(W.dtype)


def _fro(W: torch.Tensor) -> float:
    """The Frobenius norm of ``W`` (``(n,)`` or ``(n, b)``) as a float, by :func:`_norms`."""
    return float(_norms(W.reshape(W.shape[0], -1)).double().norm())


def _dots(B: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    """``Bᵀ W`` (``B`` ``(n, m)``, ``W`` ``(n, b)``), for ``n > DOT_ROWS`` as the float64 sum of the products of
    blocks of ``DOT_ROWS`` rows: a BLAS product accumulates in ``W``'s dtype, whose rounding grows with the
    rows summed (about ``√n · ε`` of ``‖B‖‖W‖``: 7e-4 for 38.6M float32 rows, where Lanczos' Ritz vectors then
    stall at residuals of 1e-3 of ``‖A‖``, docs/derivations.md §17); by blocks it is ``√DOT_ROWS · ε``."""
    n = B.shape[0]
    if n <= DOT_ROWS:
        return B.T @ W
    C = torch.zeros(B.shape[1], W.shape[1], dtype=torch.float64, device=W.device)
    for r in range(0, n, DOT_ROWS):
        C += (B[r : r + DOT_ROWS].T @ W[r : r + DOT_ROWS]).double()
    return C.to(W.dtype)


def _project_out(B, W: torch.Tensor, recent: int = 0, out: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``W`` minus its projection on the orthonormal columns of ``B`` (a tensor, or a sequence of tensors whose
    columns side by side are the basis: a basis held in pieces) by classical Gram–Schmidt, a second
    pass where the first cancelled more than ``1 − 1/√2`` of a column's norm (Daniel, Gragg, Kaufman &
    Stewart 1976; "twice is enough", Kahan): ``(W', Bᵀ W of the passes together, ref)``, ``ref`` the
    Frobenius norm of what the last pass started from (``W' ⊥ B`` to about ``ε · ref``). ``recent``: the
    basis' last ``recent`` columns are projected out first, alone (a Lanczos product lies mostly along
    the last block and the one before, in exact arithmetic wholly): the pass over the whole basis then
    cancels little, and the second pass over it is rarely needed (half the reads of a long basis).
    ``out``: a tensor of ``W``'s shape, the caller's own work space (sharing no memory with ``B`` or ``W``),
    that ``W`` is copied into and ``W'`` is computed in, in place (``W'`` is then ``out``): no fresh
    tensor a pass, whose first writes are page faults (70 ms for 38.6M float32 rows, a copy 14 ms)."""
    Bs = [B] if isinstance(B, torch.Tensor) else [b for b in B if b.shape[1]]
    if not Bs or Bs[0].shape[1] == 0:
        return W, W.new_zeros(0, W.shape[1]), _fro(W)
    own = out is not None  # W is ours to overwrite
    if own:
        W = out.copy_(W)
    C_last = None
    if recent > 0:
        last = Bs[-1][:, -min(recent, Bs[-1].shape[1]) :]
        C_last = _dots(last, W)
        W = W.addmm_(last, C_last, alpha=-1) if own else torch.addmm(W, last, C_last, alpha=-1)
        own = True

    def one_pass(W, own):
        C = [_dots(b, W) for b in Bs]
        res = W.addmm_(Bs[0], C[0], alpha=-1) if own else torch.addmm(W, Bs[0], C[0], alpha=-1)
        for b, c in zip(Bs[1:], C[1:]):
            res.addmm_(b, c, alpha=-1)
        return res, torch.cat(C) if len(C) > 1 else C[0]

    before = _norms(W)
    W, C = one_pass(W, own)
    if bool((_norms(W) >= DGKS * before).all()):
        ref = float(before.norm())
    else:
        ref = _fro(W)
        W, C2 = one_pass(W, True)
        C = C + C2
    if C_last is not None:
        C[C.shape[0] - C_last.shape[0] :] += C_last
    return W, C, ref


def _rotate(V: torch.Tensor, m: int, Y: torch.Tensor) -> None:
    """``V[:, :j] = V[:, :m] @ Y`` in place (``Y`` ``(m, j)``, ``j <= m``: a restart's kept Ritz vectors), in
    blocks of rows, each row's new entries depending only on its old ones: no ``(n, j)`` temporary (for a
    38.6M-row basis and 12 kept vectors 1.9 GB), only a block's ``ROTATE_ENTRIES``."""
    n, j = V.shape[0], Y.shape[1]
    step = max(1, ROTATE_ENTRIES // max(m, 1))
    for r in range(0, n, step):
        V[r : r + step, :j] = V[r : r + step, :m] @ Y


def _order(theta: torch.Tensor, which: str) -> torch.Tensor:
    if which == "LA":
        return torch.argsort(theta, descending=True)
    if which == "SA":
        return torch.argsort(theta)
    return torch.argsort(theta.abs(), descending=True)


# ----------------------------------------------------------------------------- eigenpairs


def _bounds(theta: torch.Tensor, scale: float, tol: float, rel: str) -> torch.Tensor:
    """The residual each Ritz value ``theta`` must reach: ``tol · |θ_i|`` (``rel="each"``), or ``tol · s`` where
    ``|θ_i| < tol · s`` (zero to within the scale's accuracy) and always for ``rel="scale"``."""
    floor = tol * scale
    if rel == "scale":
        return torch.full_like(theta, floor)
    a = theta.abs()
    return torch.where(a >= floor, tol * a, torch.full_like(a, floor))


def _new_block(W: torch.Tensor, B: torch.Tensor, room: int, ref: float, gen, A, ortho: float | None = None,
               own: bool = False) -> torch.Tensor:
    """An orthonormal basis ``(n, b')`` of the residual block ``W`` (already orthogonal to ``B``),
    ``b' = min(W's columns, room)``: its left singular vectors above rounding (``√(m+1) · ε · ref``, ``m``
    the columns of ``B``, ``ref`` the Frobenius norm of the product ``W`` came from), orthogonalised
    against ``B`` again when a singular value is below ``ortho / 2`` (``W ⊥ B`` holds to ``ε · ortho``,
    ``ortho`` the norm the last Gram–Schmidt pass started from, :func:`_project_out`; default ``ref``,
    which dividing by a small singular value magnifies), re-orthonormalised by QR (one column: by its
    norm), completed by random vectors orthogonal to everything (an invariant subspace found: the Krylov
    space continues in the complement, as a fresh start). ``own``: ``W`` is the caller's work space, one column
    normalised in place (the result is then a view of it)."""
    width = min(W.shape[1], room)
    if width <= 0:
        return W[:, :0]
    eps = torch.finfo(W.dtype).eps
    ortho = ref if ortho is None else ortho
    if W.shape[1] == 1:  # one column: its norm is its singular value, no SVD or QR
        S = _norms(W)
        U = (W.div_(S) if own else W / S) if float(S) > 0 else W[:, :0]
    else:
        U, S, _ = torch.linalg.svd(W, full_matrices=False)
    good = S[:width] > math.sqrt(B.shape[1] + 1) * eps * max(ref, float(S.max()) if S.numel() else 0.0)
    U = U[:, : int(good.sum())]
    if U.shape[1]:
        if B.shape[1] and float(S[U.shape[1] - 1]) < 0.5 * ortho:
            U = _project_out(B, U)[0]
        if U.shape[1] == 1:
            u = _norms(U)
            U = U / u if float(u) > 0.5 else U[:, :0]  # a column that kept half its norm is orthogonal to rounding
        else:
            Q, R = torch.linalg.qr(U)
            U = Q[:, R.diagonal().abs() > 0.5]
    while U.shape[1] < width:
        R = _gaussian(gen, (W.shape[0], width - U.shape[1]), A)
        R = _project_out(torch.cat([B, U], 1), R)[0]
        Qr, Rr = torch.linalg.qr(R)
        good = Rr.diagonal().abs() > math.sqrt(W.shape[0]) * eps * max(float(R.norm()), 1e-300)
        if not bool(good.any()):
            break  # no room left in the space
        U = torch.cat([U, Qr[:, good]], 1)
    return U


def _dense_eigs(A, n: int, k: int, which: str, tol: float, rel: str) -> EigResult:
    bytes_ = torch.finfo(A.dtype).bits // 8
    check_fits(n * n * bytes_ * 2, f"the dense {n}x{n} matrix of A (dense_below)", A.device)
    M = torch.empty(n, n, dtype=A.dtype, device=A.device)
    for j, cols in _columns(A, n):
        M[:, j : j + cols.shape[1]] = cols
    M = (M + M.T) / 2
    lam, U = linalg.eigh(M)
    scale = float(lam.abs().max())
    idx = _order(lam, which)[:k]
    X, lam = U[:, idx].contiguous(), lam[idx]
    res = (_mm(A, X) - X * lam).norm(dim=0)
    bounds = _bounds(lam, scale, tol, rel)
    return EigResult(lam, X, res, bounds, scale, tol, rel, bool((res <= bounds).all()), n + k, 1, 0, 0, None,
                     which, "dense", n, 0.0)


def _kronecker_eigs(A, M: torch.Tensor, d: int, k: int, which: str, tol: float, rel: str) -> EigResult:
    """The ``k`` wanted eigenpairs of ``A = M ⊗ I_d`` (:meth:`~blockhess.operators.HessianOperator.kronecker_factors`)
    from ``M``'s eigendecomposition: each eigenvalue ``μ_i`` of ``M`` ``d`` times, with eigenvectors
    ``u_i ⊗ e_j`` (``vec_r``: entry ``(a, j)`` is ``u_i[a]``); the residuals from one product of the ``k``
    vectors, as on every path (method ``"kronecker"``, no check: the spectrum is known whole)."""
    mu, U = linalg.eigh((M + M.T) / 2)
    m = mu.numel()
    order = _order(mu, which)
    pick = order[torch.arange(k, device=order.device) // d]  # each of M's values d times, most wanted first
    cols = torch.arange(k) % d
    X = torch.zeros(m, d, k, dtype=A.dtype, device=A.device)
    X[:, cols, torch.arange(k)] = U[:, pick].to(A.dtype)
    X = X.reshape(m * d, k)
    lam = mu[pick].to(A.dtype)
    scale = float(mu.abs().max()) if m else 0.0
    res = (_mm(A, X) - X * lam).norm(dim=0)
    bounds = _bounds(lam, scale, tol, rel)
    return EigResult(lam, X, res, bounds, scale, tol, rel, bool((res <= bounds).all()), k, 0, 0, 0, None, which,
                     "kronecker", m * d, 0.0, multiplicity=d)


def _margin(rho: torch.Tensor, theta_k: float, bound_k: float, which: str) -> torch.Tensor:
    """How far check Ritz values ``rho`` lie on the found side of the ``k``-th found eigenvalue's
    threshold (``θ_k + b_k`` for ``"LA"``, ``θ_k − b_k`` for ``"SA"``, ``|θ_k| + b_k`` in magnitude for
    ``"LM"``): negative for a value beyond it, one that beats the found ``k``."""
    if which == "LA":
        return theta_k + bound_k - rho
    if which == "SA":
        return rho - (theta_k - bound_k)
    return abs(theta_k) + bound_k - rho.abs()


def lanczos_bytes(n: int, dtype: torch.dtype, k: int = 1, ncv: int | None = None, block_size: int | None = None,
                  check: int = CHECK_COLUMNS) -> int:
    """The bytes :func:`lanczos_eigs` on an ``(n, n)`` operator of ``dtype`` checks for before its basis is
    allocated (its arguments ``k``, ``ncv``, ``block_size``, ``check``, defaults as there): ``n · (min(n,
    max(ncv, k + check)) + 2k)`` entries (a check that needs more grows it later, checked again then)."""
    p = min(n, 1 if block_size is None else block_size)
    ncv = min(n, max(3 * k + 2 * p, NCV_DEFAULT) if ncv is None else ncv)
    return n * (min(n, max(ncv, k + check)) + 2 * k) * (torch.finfo(dtype).bits // 8)


def slq_bytes(n: int, dtype: torch.dtype, n_probes: int = 16, n_iter: int = 64, reorth: str = "full") -> int:
    """The bytes of :func:`slq_density`'s Lanczos bases on an ``(n, n)`` operator of ``dtype``: ``n_probes ·
    min(n_iter, n) · n`` entries with ``reorth="full"``, ``3 · n_probes · n`` with ``"none"``."""
    return (min(n_iter, n) if reorth == "full" else 3) * n * n_probes * (torch.finfo(dtype).bits // 8)


def lanczos_eigs(A, k: int = 1, which: str = "LA", tol: float = 1e-4, *, rel: str = "each", max_matvecs: int = 5000,
                 ncv: int | None = None, block_size: int | None = None, check: int = CHECK_COLUMNS, seed: int = 0,
                 v0: torch.Tensor | None = None, allow_unconverged: bool = False, dense_below: int = 0,
                 failure_probability: float = FAILURE_PROBABILITY, check_runs: int = 1) -> EigResult:
    r"""The ``k`` extreme eigenpairs of a symmetric operator ``A`` ``(n, n)``, each to a stated residual
    :math:`\|A v_i - \lambda_i v_i\|_2 \le b_i`: an :class:`EigResult`.

    ``rel="each"`` (default): :math:`b_i = \mathrm{tol}\cdot|\lambda_i|`, except where :math:`|\lambda_i| <
    \mathrm{tol}\cdot s` (a value zero to within ``tol`` of the scale, where a criterion relative to
    :math:`|\lambda_i|` could never be met): there :math:`b_i = \mathrm{tol}\cdot s`. ``rel="scale"``:
    :math:`b_i = \mathrm{tol}\cdot s` for every ``i``. :math:`s` is the largest :math:`|\theta|` over the Ritz
    values seen (:math:`s \le \|A\|_2`). Each eigenvalue lies within its residual of an eigenvalue of ``A``.

    ``which``: ``"LA"`` largest algebraic (descending), ``"SA"`` smallest (ascending), ``"LM"`` largest
    magnitude. Block Lanczos with full reorthogonalisation (every new block orthogonalised against the
    whole basis, a second time where the first pass left a column less than 1/√2 of its norm (DGKS), and
    again after normalisation where the block was small against its product) and Krylov–Schur restarts
    (Stewart 2001): the basis holds at most ``ncv`` vectors (default ``max(3k + 2·block_size, 60)``, capped
    at ``n``; memory ``n · max(ncv, k + check)`` of the dtype (the check's columns need not fit in ``ncv``),
    checked before the allocation, and doubled where the check needs more, each time checked first); at a restart the ``k + (ncv − b − k)//2`` most wanted Ritz vectors are kept
    (``b`` the block width). ``block_size`` (default 1: the fewest products) vectors are multiplied at once.
    A run stops when the recurrence's residual estimates meet the bounds; one product of the ``k`` Ritz
    vectors then gives the true residuals (the reported ``residuals``). If one misses its bound, the
    iteration continues from the ``k`` Ritz vectors (their true residuals start the next block) until the
    bounds are met or ``max_matvecs`` is spent.

    *The check* (``check``, default 10: its fewest products; 0: none): once the residuals are met, Lanczos
    from one fresh random start on ``A`` restricted to the orthogonal complement of the ``k`` found vectors,
    without restarts (its basis grows past ``ncv`` where it needs to, within memory), for at least ``check``
    products and then until it certifies the found ones: the probability that a start uniform on the
    complement's sphere leaves an eigenvalue beyond the ``k``-th found value's threshold
    (:math:`\theta_k + b_k` for ``"LA"``, :math:`\theta_k - b_k` for ``"SA"``, :math:`\pm(|\theta_k| + b_k)`
    for ``"LM"``) unseen is at most :math:`\sqrt{2N/\pi}\,\prod_j\beta_j/|\chi(\alpha)|` (``N = n − k``, ``χ``
    the characteristic polynomial of the check's ``T``, ``β_j`` its subdiagonal, ``α`` the threshold;
    Hochstenbach 2013), and the check stops once that is at most ``failure_probability`` (default 1e-6; the
    bound is ``miss_probability``). This holds whatever ``v0`` and ``check`` were (a warm start orthogonal
    to an eigenvector by construction, a multiplicity above ``block_size``: the check's start is its own).
    A Ritz value there beyond the threshold is a Rayleigh quotient of a vector orthogonal to the found ones,
    so (Cauchy interlacing) the found ``k`` are not the extreme ``k``: those Ritz vectors are taken in, the
    iteration restarts from the found vectors and them, converges, and checks again. The check raises
    :class:`NotConvergedError` where it cannot reach ``failure_probability``: the budget, a basis that
    would not fit, or a bound falling too slowly to get there within four times its products so far
    (a threshold closer to the complement's spectrum than the dtype resolves). With ``check=0`` nothing
    beyond the residuals is claimed (``miss_probability`` 1) and the result is never ``converged``:
    ``NotConvergedError``, or the pairs as they are with ``allow_unconverged=True``. The products it cost
    are in ``matvecs`` and ``check_matvecs``; its most wanted Ritz value is ``check_value``. Each returned :math:`\theta_i` then
    lies, with probability at least ``1 − miss_probability``, within :math:`b_k + \|R\|_2` of the
    ``i``-th wanted eigenvalue of ``A`` (``R = AX − XΘ``; docs/derivations.md §17).

    ``check_runs`` (default 1): that many independent checks, one after another, each from its own start
    and of at least ``check`` products. A missed eigenvalue must escape every one, so their bounds
    :math:`p_i` multiply: the miss probability is at most :math:`\delta\sum_{j<r}\ln(1/\delta)^j/j!`,
    :math:`\delta = \prod_i p_i` (the tail of a product of ``r`` uniforms; docs/derivations.md §17,
    "Several checks"), and each run stops at its share of the level that makes this ``failure_probability``.
    A run finding a value beyond the threshold starts the checks over after taking it in. The runs are
    kept in ``probes`` (with the first run's, where it started at random with ``block_size`` 1, up to its
    first restart): :func:`slq_density` takes them as probes, so a density after a top-k needs fewer
    products or none.

    ``v0`` ``(n,)`` or ``(n, j)``: a warm start (e.g. the eigenvectors of a nearby operator); with ``j >=
    block_size`` the start block is ``block_size`` random combinations of its columns, else its columns
    plus random ones. Residuals certify eigenpairs; that they are the extreme ones is the check's to say.
    *A Kronecker view*: where the operator's closed form shows ``A = M ⊗ I_d`` exactly
    (:meth:`~blockhess.operators.HessianOperator.kronecker_factors`: a pre-LN block's ``W_2`` under MSE), the
    pairs come from ``M``'s eigendecomposition, each value ``d`` times with eigenvectors ``u ⊗ e_j``
    (method ``"kronecker"``, exact multiplicities, ``k`` products for the residuals, no check).
    ``dense_below``: for ``n <= dense_below``, the exact dense eigendecomposition
    of ``A @ I`` (:func:`blockhess.linalg.eigh`, method ``"dense"``, no check).

    ``max_matvecs`` bounds every column multiplied (iterations, the true-residual products and the
    checks; the first block and its residual product are always multiplied). Raises
    :class:`NotConvergedError` (``.result`` the unconverged result) when a residual is above its bound at
    the end, when the residuals stopped improving between two of their products (the dtype's rounding),
    or when the budget left no room for the check, unless ``allow_unconverged=True`` (then the result says
    ``converged=False``); ``ValueError`` for ``k`` not in ``[1, n]``, ``which`` not in ``LA, SA, LM``,
    ``A`` not symmetric (an off-diagonal view ``A[a, b]``, a dense tensor beyond rounding; before any
    product), ``tol`` not in ``(ε, 1)`` of the dtype, ``failure_probability`` not in ``(0, 1)``, ``rel`` not ``"each"``
    or ``"scale"``, a bad ``ncv`` (``< k +
    2·block_size`` below ``n``), ``block_size``, ``check``, ``check_runs``, ``max_matvecs``, ``seed`` or ``v0``;
    ``InsufficientMemoryError`` when the basis ``n × max(ncv, k + check)`` (and the ``2k`` vectors of the residual
    product) does not fit. Source: Golub & Van Loan, *Matrix Computations*, §10.3 (block Lanczos); G. W.
    Stewart, SIAM J. Matrix Anal. Appl. 23 (2001) (Krylov–Schur); M. E. Hochstenbach, J. Sci. Comput. 57
    (2013), "Probabilistic upper bounds for the matrix two-norm" (the check's bound).
    """
    n, _ = check_operator(A, symmetric=True, who="lanczos_eigs")
    k = check_int("k", k, 1)
    if k > n:
        raise ValueError(f"k must be at most n = {n}, got {k}")
    if which not in WHICH:
        raise ValueError(f"which must be one of {WHICH}, got {which!r}")
    eps = torch.finfo(A.dtype).eps
    if isinstance(tol, bool) or not isinstance(tol, numbers.Real) or not (eps < tol < 1):
        raise ValueError(f"tol must be a float in ({eps:.3g}, 1) for {A.dtype}, got {tol!r}")
    tol = float(tol)
    if rel not in RELS:
        raise ValueError(f"rel must be one of {RELS}, got {rel!r}")
    max_matvecs = check_int("max_matvecs", max_matvecs, 1)
    check = check_int("check", check, 0)
    check_runs = check_int("check_runs", check_runs, 1)
    if (isinstance(failure_probability, bool) or not isinstance(failure_probability, numbers.Real)
            or not (0 < failure_probability < 1)):
        raise ValueError(f"failure_probability must be a float in (0, 1), got {failure_probability!r}")
    failure_probability = float(failure_probability)
    check_bool("allow_unconverged", allow_unconverged)
    kron = getattr(A, "kronecker_factors", None)
    factors = kron() if callable(kron) else None
    if n <= check_int("dense_below", dense_below, 0):
        return _finish(_dense_eigs(A, n, k, which, tol, rel), allow_unconverged)
    if factors is not None:  # the engine's closed form: A = M ⊗ I_d exactly, the spectrum from M's
        return _finish(_kronecker_eigs(A, factors[0], factors[1], k, which, tol, rel), allow_unconverged)
    p = 1 if block_size is None else check_int("block_size", block_size, 1)
    p = min(p, n)
    A = _Pow2Scaled(A)  # exact: the result is scaled back below
    if ncv is None:
        ncv = max(3 * k + 2 * p, NCV_DEFAULT)
    else:
        ncv = check_int("ncv", ncv, 1)
        if ncv < k + 2 * p and ncv < n:
            raise ValueError(f"ncv must be at least k + 2*block_size = {k + 2 * p} (or >= n = {n}), got {ncv}")
    ncv = min(ncv, n)
    gen = _generator(seed)
    width = min(n, max(ncv, k + check))  # the basis' storage: the check's k + check columns too
    check_fits(lanczos_bytes(n, A.dtype, k, ncv, p, check), f"the Lanczos basis ({n} x {width} + 2 x {k})", A.device)

    # the start block
    if v0 is None:
        X0 = _gaussian(gen, (n, p), A)
    else:
        if not isinstance(v0, torch.Tensor) or v0.ndim not in (1, 2) or v0.shape[0] != n:
            raise ValueError(f"v0 must be a tensor of shape ({n},) or ({n}, j), got "
                             f"{tuple(v0.shape) if isinstance(v0, torch.Tensor) else type(v0).__name__}")
        if v0.dtype != A.dtype or v0.device != A.device:
            raise ValueError(f"v0 must be {A.dtype} on {A.device} like A, got {v0.dtype} on {v0.device}")
        v0 = v0.reshape(n, -1)
        if not bool(torch.isfinite(v0).all()) or float(v0.norm()) == 0.0:
            raise ValueError("v0 must be finite and not zero")
        j = v0.shape[1]
        X0 = v0 @ _gaussian(gen, (j, p), A) if j >= p else torch.cat([v0, _gaussian(gen, (n, p - j), A)], 1)
    V = torch.zeros(width, n, dtype=A.dtype, device=A.device).T  # column-major: each basis vector contiguous
    T = torch.zeros(ncv, ncv, dtype=A.dtype, device=A.device)
    start, known = _new_block(X0, V[:, :0], n, 0.0, gen, A), None  # a run's start block; its known product
    wmax = max(p, (ncv - k) // 2)  # the widest block a restart leaves room for (k Ritz vectors kept)
    matvecs = iterations = restarts = check_mv = 0
    scale, worst_before, check_value, why, miss = 0.0, math.inf, None, None, 1.0
    first, probes, checks = v0 is None and p == 1, [], []  # the first run from a random start: a probe
    work = None

    def keep_first(m):  # its Krylov space before any restart, in A's scale
        nonlocal first
        if first:
            probes.append(KrylovProbe(pow2_scale(T[:m, :m].double(), A.e or 0), torch.zeros(0, dtype=torch.float64), n))
            first = False
    while True:  # a Krylov–Schur run from `start`, its residual product, the check
        m, q = 0, start.shape[1]
        if start.data_ptr() != V.data_ptr():  # (a start taken in after a check is V's first columns already)
            V[:, :q] = start
        T.zero_()
        while True:
            b = q - m
            if known is not None:  # the start's first columns' product is known (the last residual product)
                AB = torch.cat([known, _mm(A, V[:, known.shape[1] : q])], 1) if q > known.shape[1] else known
                matvecs += q - known.shape[1]
                known = None
            else:
                AB = _mm(A, V[:, m:q])
                matvecs += b
            iterations += 1
            if b == 1 and work is None:
                work = torch.empty(n, 1, dtype=A.dtype, device=A.device)  # one column's work space, reused
            W, C, ortho = _project_out(V[:, :q], AB, 2 * b, work if b == 1 else None)
            T[:q, m:q] = C
            T[m:q, :q] = C.T
            T[m:q, m:q] = (C[m:q] + C[m:q].T) / 2
            m = q
            theta, Y = linalg.eigh(T[:m, :m])
            scale = max(scale, float(theta.abs().max()))
            idx = _order(theta, which)[: min(k, m)]
            Yb = Y[m - b : m, idx]  # A V y - θ V y = W (last rows of y): the residuals ‖W y_b‖
            # one column: ‖w‖ |y_b| (no n × k product); a block: the product, not y_bᵀ (WᵀW) y_b, which
            # cancels to about √ε ‖W‖ |y_b| where W is nearly rank-deficient along y_b (a start block holding
            # eigenvectors: docs/derivations.md §17)
            est = _norms(W)[0] * Yb[0].abs() if b == 1 else _norms(W @ Yb)
            if idx.numel() == k and bool((est <= _bounds(theta[idx], scale, tol, rel)).all()):
                break
            U = _new_block(W, V[:, :m], min(n - m, wmax), _fro(AB), gen, A, ortho, own=b == 1)
            if U.shape[1] == 0 or matvecs + U.shape[1] + k > max_matvecs:
                break
            if m + U.shape[1] > ncv:  # restart: keep the most wanted Ritz vectors, then the pending block
                keep_first(m)
                w = U.shape[1]
                kept = _order(theta, which)[: min(k + max(0, (ncv - w - k) // 2), ncv - w, m - 1)]
                _rotate(V, m, Y[:, kept])
                m = kept.numel()
                T.zero_()
                T[:m, :m] = torch.diag(theta[kept])
                restarts += 1
            V[:, m : m + U.shape[1]] = U
            q = m + U.shape[1]
        keep_first(m)
        X = V[:, :m] @ Y[:, idx]
        lam = theta[idx]
        AX = _mm(A, X)
        matvecs += X.shape[1]
        res = torch.stack([_norms(AX[:, i : i + 1] - X[:, i : i + 1] * lam[i])[0] for i in range(X.shape[1])])  # no (n, k) temporaries
        bounds = _bounds(lam, scale, tol, rel)
        met = idx.numel() == k and bool((res <= bounds).all())
        if not met:
            if idx.numel() < k:
                why = f"the budget max_matvecs={max_matvecs} ran out with {idx.numel()} Ritz values for k = {k}"
                break
            worst = float((res / bounds).max())
            why = f"largest residual / bound {worst:.3g} > 1"
            if worst >= 0.9 * worst_before:
                why += "; the residuals stopped improving between two residual products (the dtype's rounding?)"
                break
            if matvecs + 2 * k > max_matvecs:
                why += f"; the budget max_matvecs={max_matvecs} is spent"
                break
            worst_before = worst  # go on from the Ritz vectors: their true residuals start the next block
            start, known = X, AX
            restarts += 1
            continue
        worst_before, why, miss = math.inf, None, 1.0
        if n == k:
            miss = 0.0  # nothing outside the found vectors
            break
        if check == 0:
            met, why = False, ("check=0: the residuals are met, but nothing rules out an eigenvalue beyond the found "
                               "ones (a start orthogonal to one never sees it); pass check >= 1, or "
                               "allow_unconverged=True to take the pairs as they are")
            break
        c = min(check, n - k)
        if matvecs + c > max_matvecs:
            met, why = False, f"the budget left no room for the check ({c} products)"
            break
        # check_runs independent runs, each from its own start: a miss needs every run to miss, so their bounds
        # multiply (docs/derivations.md §17, "Several checks"); each run aims at its share of what is left
        level, got, cm, checks = _product_level(failure_probability, check_runs), [], 0, []
        for i in range(check_runs):
            target = min(1.0, (level / math.prod(got)) ** (1 / (check_runs - i))) if all(got) else 1.0
            rho, Z, cm_i, bound, short, Tc = _check(A, V, X, c, gen, float(lam[-1]), float(bounds[-1]), which,
                                                    max_matvecs - matvecs, target, max(1, wmax - k))
            matvecs += cm_i
            check_mv += cm_i
            cm += cm_i
            scale = max(scale, float(rho.abs().max()))
            check_value = float(rho[_order(rho, which)[0]])
            beat = _margin(rho, float(lam[-1]), float(bounds[-1]), which) < 0
            if bool(beat.any()):
                break
            got.append(bound)  # (a run not made counts as a bound of 1: the product stays a valid bound)
            if short is not None:
                break
            checks.append(KrylovProbe(pow2_scale(Tc, A.e or 0), pow2_scale(lam.double(), A.e or 0), n))
            if i + 1 < check_runs and matvecs + c > max_matvecs:
                short = f"the budget left no room for check run {i + 2} of {check_runs} ({c} products)"
                break
        if not bool(beat.any()):
            miss = _product_tail(math.prod(got), check_runs)
            if miss > failure_probability:
                met, why = False, (f"the check could not rule out an eigenvalue beyond the k-th value "
                                   f"{math.ldexp(float(lam[-1]), A.e or 0):.6g}: after {cm} products the probability that it missed one is "
                                   f"bounded only by {miss:.3g} > failure_probability={failure_probability:g} "
                                   f"({short}); raise max_matvecs, or loosen tol or failure_probability")
            else:
                probes.extend(checks)
            break
        if matvecs + k + int(beat.sum()) > max_matvecs:
            met, why = False, (f"the check found {math.ldexp(check_value, A.e or 0):.6g}, beyond the k-th value "
                               f"{math.ldexp(float(lam[-1]), A.e or 0):.6g}, and "
                               "the budget left no room to take it in")
            break
        V[:, k : k + Z.shape[1]] = Z  # take them in (X is in V[:, :k], the check's first columns), go on
        start, known, Z = V[:, : k + Z.shape[1]], AX, None
        restarts += 1
    # the check's Ritz values may raise the scale: the bounds with it (looser, so what was met stays met, and
    # the check's threshold, from the smaller bound, certified the stronger statement)
    bounds = _bounds(lam, scale, tol, rel)
    e = A.e or 0  # back to A's own scale (exact)
    result = EigResult(pow2_scale(lam, e), X, pow2_scale(res, e), pow2_scale(bounds, e), math.ldexp(scale, e), tol,
                       rel, met, matvecs, iterations, restarts, check_mv,
                       None if check_value is None else math.ldexp(check_value, e), which, "lanczos", ncv, miss,
                       tuple(probes))
    return _finish(result, allow_unconverged, why)


def _miss_bound(log_beta: float, rho: torch.Tensor, alpha: float, N: int) -> float:
    r"""An upper bound on the probability that a Lanczos run from a start uniform on the unit sphere of an
    ``N``-dimensional space missed an eigenvalue at or beyond ``alpha``, given its Ritz values ``rho`` (all
    on one side of ``alpha``) and the log of the product of its subdiagonal entries ``log_beta``
    (Hochstenbach 2013): the monic characteristic polynomial :math:`\chi` of ``T_m`` has
    :math:`\|\chi(C)v\| = \prod_j\beta_j` and :math:`|\chi|` grows beyond its roots, so an eigenvalue
    beyond ``alpha`` with unit eigenvector ``u`` leaves :math:`|u^\top v| \le x = \prod_j\beta_j/|\chi(\alpha)|`,
    which has probability at most :math:`x\sqrt{2N/\pi}` (docs/derivations.md §17)."""
    gaps = (alpha - rho.double()).abs()
    if bool((gaps == 0).any()):
        return 1.0
    log_x = log_beta - float(gaps.log().sum()) + 0.5 * math.log(2 * N / math.pi)
    return math.exp(min(log_x, 0.0))


def _check_bound(log_beta: float, rho: torch.Tensor, theta_k: float, bound_k: float, which: str, N: int) -> float:
    """:func:`_miss_bound` at the ``k``-th found value's threshold (:func:`_margin`), for ``"LM"`` the sum of
    both ends' (``±(|θ_k| + b_k)``)."""
    if which == "LA":
        return _miss_bound(log_beta, rho, theta_k + bound_k, N)
    if which == "SA":
        return _miss_bound(log_beta, rho, theta_k - bound_k, N)
    top = abs(theta_k) + bound_k
    return min(1.0, _miss_bound(log_beta, rho, top, N) + _miss_bound(log_beta, rho, -top, N))


def _product_tail(delta: float, r: int) -> float:
    r"""``P(U_1 ⋯ U_r <= delta)`` for ``r`` independent uniforms on ``[0, 1]``: :math:`\delta\sum_{j<r}
    \ln(1/\delta)^j / j!` (:math:`-\ln\prod U_i` is Gamma(r, 1)); a bound for independent variables each at
    least as large as a uniform (:math:`P(V_i \le t) \le t`). 1 for ``delta >= 1``, 0 for ``delta <= 0``."""
    if delta >= 1:
        return 1.0
    if delta <= 0:
        return 0.0
    L, term, total = -math.log(delta), 1.0, 1.0
    for j in range(1, r):
        term *= L / j
        total += term
    return min(1.0, delta * total)


def _product_level(failure: float, r: int) -> float:
    """The ``delta`` with :func:`_product_tail` ``(delta, r) = failure`` (``failure`` itself for ``r = 1``), by
    bisection on ``log delta``; never above ``failure``."""
    if r == 1:
        return failure
    lo, hi = math.log(failure) - 10 * r - 50, math.log(failure)  # tail(e^lo) < failure <= tail(e^hi)
    for _ in range(200):
        mid = (lo + hi) / 2
        if _product_tail(math.exp(mid), r) > failure:
            hi = mid
        else:
            lo = mid
    return math.exp(lo)


class _Pieces:
    """A basis of ``n``-vectors held in pieces, column-major (each vector contiguous): the first piece the
    caller's storage, each later one as many columns as all before it (the capacity doubles, as one
    reallocation would) taken with :func:`torch.empty` when the earlier ones are full, its memory checked
    then. Growing copies nothing and holds no old and new storage at once; the columns not yet written are
    never read (nor, in a large piece the C library maps, resident)."""

    def __init__(self, first: torch.Tensor):
        self.pieces, self.starts, self.capacity = [first], [0], first.shape[1]

    def grow(self) -> None:
        """One more piece of :attr:`capacity` columns; raises ``InsufficientMemoryError`` if it does not fit."""
        first = self.pieces[0]
        n, cols = first.shape[0], self.capacity
        check_fits(n * cols * first.element_size(), f"the check's Lanczos basis ({n} x {2 * cols}, "
                   f"its second half)", first.device)
        self.pieces.append(torch.empty(cols, n, dtype=first.dtype, device=first.device).T)
        self.starts.append(self.capacity)
        self.capacity += cols

    def column(self, j: int) -> torch.Tensor:
        """Column ``j`` as an ``(n, 1)`` view (written in place)."""
        i = max(i for i, s in enumerate(self.starts) if s <= j)
        return self.pieces[i][:, j - self.starts[i] : j - self.starts[i] + 1]

    def upto(self, j: int, lo: int = 0) -> list:
        """Columns ``lo:j`` as views, one per piece they lie in."""
        out = []
        for s, P in zip(self.starts, self.pieces):
            a, b = max(lo, s), min(j, s + P.shape[1])
            if a < b:
                out.append(P[:, a - s : b - s])
        return out


def _check(A, V: torch.Tensor, X: torch.Tensor, c: int, gen, theta_k: float, bound_k: float, which: str,
           budget: int, failure: float, take: int):
    r"""Lanczos from one random start on ``A`` restricted to the orthogonal complement of ``X`` ``(n, k)``
    (every vector orthogonalised against ``X`` and the check's own basis), without restarts (a restart
    would lose the start's guarantee), in ``V``'s storage after ``X``, grown when full (by pieces,
    :class:`_Pieces`: ``V`` itself is not replaced): at least ``c``
    products, then on until a Ritz value lies beyond the ``k``-th found value's threshold
    (:func:`_margin`: it *beats* the found ones), or :func:`_check_bound` is at most ``failure``, or the
    Krylov space is invariant (every eigenvalue of the restriction with a component along the start is
    then a Ritz value: bound 0; at the latest once the basis spans the complement), or ``budget`` products
    are spent, or the bound falls too slowly to reach ``failure`` within four times the products so far
    and the complement has more than four times as many dimensions left (*stalled*, judged each time the
    basis fills), or
    a larger basis would not fit in memory. ``(Ritz values, Ritz vectors, products, bound, why)``: the
    Ritz vectors those of the first ``take`` values (ascending) that beat the threshold, ``(n, ≤ take)``;
    ``bound`` the last miss bound (``1`` where a value beat the threshold), ``why`` ``None`` or the reason
    it stopped short of ``failure``, ``T`` the restriction's projection on the check's basis (float64, in
    ``A``'s scale as multiplied; its start first: a :class:`KrylovProbe`'s)."""
    n, k = X.shape
    N = n - k
    eps = torch.finfo(X.dtype).eps
    V[:, :k] = X
    basis = _Pieces(V)
    work = torch.empty(n, 1, dtype=X.dtype, device=X.device)  # each product's projection, in place
    W = _project_out(X, _gaussian(gen, (n, 1), A))[0]
    W = _project_out(X, W)[0]  # twice: the start is uniform on the complement's unit sphere to rounding
    basis.column(k).copy_(W / _fro(W))
    T = torch.zeros(0, 0, dtype=torch.float64, device=V.device)
    m, products, log_beta, bound, why, seen = 0, 0, 0.0, 1.0, None, 0.0
    grown_at, log_bound_then = 0, 0.0
    rho = T.new_zeros(0)
    while True:
        AB = _mm(A, basis.column(k + m))
        products += 1
        W, C, ortho = _project_out(basis.upto(k + m + 1), AB, 2, work)
        C = C[k:, 0].double()  # the coefficients along X are the found pairs' residuals: not the restriction's
        T2 = T.new_zeros(m + 1, m + 1)
        T2[:m, :m] = T
        T2[:, m] = C
        T2[m, :] = C
        T, m = T2, m + 1
        beta = _fro(W)
        invariant = m == N or beta <= math.sqrt(k + m + 1) * eps * max(_fro(AB), seen)
        full = k + m + 1 > basis.capacity  # the basis fills: the progress is judged below
        # T's eigenvalues each step while the basis is small, then every m/16 steps (the bound is judged a few
        # steps late at most; an eigvalsh per step would cost O(m^4) over a long check)
        if invariant or full or (products >= c and (m <= 64 or m % (m // 16) == 0)):
            rho = torch.linalg.eigvalsh(T)
            seen = max(seen, float(rho.abs().max()))
        if (products >= c or invariant) and rho.numel() == m:
            if bool((_margin(rho, theta_k, bound_k, which) < 0).any()):
                bound = 1.0  # beaten: the caller takes the Ritz vectors beyond the threshold in
                break
            bound = 0.0 if invariant else _check_bound(log_beta + math.log(beta), rho, theta_k, bound_k, which, N)
            if bound <= failure:
                break
        if invariant:
            break
        if products + 1 > budget:
            why = f"the budget max_matvecs ran out after {products} products of the check"
            break
        log_beta += math.log(beta)
        u = W.div_(beta)  # (the work space: copied into the basis below, before the next product)
        if beta < 0.5 * ortho:  # dividing by a small β magnifies W's rounding along the basis: once more
            u = _project_out(basis.upto(k + m), u)[0]
            u = u / _fro(u)
        if full:  # the basis is full: judge the progress, then grow it
            lb = math.log(max(_check_bound(log_beta, rho, theta_k, bound_k, which, N), 1e-300))
            if grown_at and N - m > 4 * m and (lb >= log_bound_then or  # (spanning the complement ends it too)
                                               (math.log(failure) - lb) / ((lb - log_bound_then) / (m - grown_at)) > 4 * m):
                why = (f"its bound fell too slowly (to {math.exp(lb):.3g} after {products} products) to reach "
                       f"{failure:g} within four times as many")
                break
            grown_at, log_bound_then = m, lb
            try:
                basis.grow()
            except InsufficientMemoryError as e:
                why = f"a larger basis would not fit ({e})"
                break
        basis.column(k + m).copy_(u)
    rho, Y = linalg.eigh(T.to(V.dtype))
    beat = (_margin(rho, theta_k, bound_k, which) < 0).nonzero()[:take, 0]
    Z = V.new_zeros(n, beat.numel())
    lo = 0
    for P in basis.upto(k + m, k):  # the wanted Ritz vectors only (never n x m), piece by piece
        Z.addmm_(P, Y[lo : lo + P.shape[1], beat])
        lo += P.shape[1]
    return rho, Z, products, bound, why, T


def _finish(result: EigResult, allow_unconverged: bool, why: str | None = None) -> EigResult:
    if result.converged or allow_unconverged:
        return result
    if why is None:
        worst = float((result.residuals / result.bounds.clamp_min(torch.finfo(result.residuals.dtype).tiny)).max())
        why = f"largest residual / bound {worst:.3g} > 1"
    raise NotConvergedError(
        f"lanczos_eigs did not converge: {why} (tol={result.tol:g}, rel={result.rel!r}) after {result.matvecs} "
        f"products ({result.restarts} restarts); raise max_matvecs or ncv, or loosen tol (residuals below about "
        f"eps·n·||A|| are not reachable in {result.eigenvalues.dtype}; rel='scale' judges them against the scale)",
        result)


# ----------------------------------------------------------------------------- spectral density


def _gauss(grid: torch.Tensor, nodes: torch.Tensor, weights: torch.Tensor, sigma: float) -> torch.Tensor:
    """Per probe ``Σ_j w_j g_σ(t − θ_j)`` on ``grid``: ``(P, G)``."""
    z = (grid[None, None, :] - nodes[:, :, None]) / sigma
    return (weights[:, :, None] * torch.exp(-0.5 * z * z)).sum(1) * (1 / (sigma * math.sqrt(2 * math.pi)))


def _check_grid(grid: torch.Tensor) -> None:
    if not bool(torch.isfinite(grid).all()):
        raise ValueError("grid contains NaN or Inf")


def _broaden(nodes, weights, nodes_prev, weights_prev, grid, sigma, n):
    """``(density, stderr, quadrature_error, rounding)`` on ``grid`` ``(G,)``: :class:`SLQResult`'s rules for the
    Gauss rules ``(nodes, weights)`` ``(P, m)`` of an ``(n, n)`` operator."""
    if isinstance(sigma, bool) or not isinstance(sigma, numbers.Real) or not (sigma > 0 and math.isfinite(sigma)):
        raise ValueError(f"sigma must be a finite float > 0, got {sigma!r}")
    if not isinstance(grid, torch.Tensor) or grid.ndim != 1:
        raise ValueError(f"grid must be a 1-d tensor, got {type(grid).__name__}")
    _check_grid(grid)
    sigma = float(sigma)
    grid = grid.to(dtype=nodes.dtype, device=nodes.device)
    P, m = nodes.shape
    x = grid[None, None, :] - nodes[:, :, None]  # (P, m, G)
    c = 1 / (sigma * math.sqrt(2 * math.pi))
    z = x / sigma
    e = torch.exp(-0.5 * z * z)
    per = (weights[:, :, None] * e).sum(1) * c  # (P, G), _gauss's sums
    prev = _gauss(grid, nodes_prev, weights_prev, sigma)
    density = per.mean(0)
    # s²(t) = mean_p Σ_j τ_pj (g(t − θ_pj) − φ(t))²: the Gauss rules' ‖(F − φ I) v_p‖², F = g_σ(t − A)
    s2 = (weights[:, :, None] * (e * c - density) ** 2).sum(1).mean(0)
    stderr = (2 * s2 / max(n * P - 2, 1)).sqrt()
    # rounding: each node moved by δ = n ε max|θ| (the sup of |g'| over [|x| − δ, |x| + δ]), and the sums' own
    eps = torch.finfo(nodes.dtype).eps
    delta = n * eps * float(nodes.abs().max())
    ax = x.abs()
    xs = torch.clamp(torch.full_like(ax, sigma), (ax - delta).clamp_min(0), ax + delta)
    slope = xs / sigma**2 * torch.exp(-0.5 * (xs / sigma) ** 2) * c
    rounding = delta * (weights[:, :, None] * slope).sum(1).mean(0) + (m + P) * eps * density
    return density, stderr, (per - prev).abs().mean(0), rounding


def slq_density(A, n_probes: int = 16, n_iter: int = 64, seed: int = 0, grid: int | torch.Tensor = 512,
                sigma: float | None = None, reorth: str = "full", *, confidence: float = 0.95,
                probes=()) -> SLQResult:
    r"""The spectral density of a symmetric operator ``A`` ``(n, n)`` by stochastic Lanczos quadrature
    (Lin, Saad & Yang 2016; Ubaru, Chen & Saad 2017): an :class:`SLQResult`.

    ``n_probes >= 2`` Rademacher probes :math:`v = z/\sqrt n`, each run through ``n_iter`` Lanczos steps
    (all probes multiplied as one ``(n, n_probes)`` block; ``n_iter`` capped at ``n``). Each gives the
    Gauss rule :math:`\{(\theta_j, \tau_j)\}` of :math:`v^\top f(A) v = \int f\,d\mu_v`, exact for
    polynomials of degree ``<= 2 n_iter − 1``; :math:`E[\mu_v] = \frac1n\sum_i\delta_{\lambda_i}`. The density is
    that average broadened by a Gaussian of width ``sigma`` (default: the nodes' spread ``/ n_iter``;
    where every node is one value ``λ``, ``|λ| / n_iter``, and ``1 / n_iter`` for the zero operator;
    stated in the result) on ``grid`` (a number of points over the nodes' range ``± 5σ``, or a tensor).
    Errors stated per grid point: ``stderr`` (the sampling error: :math:`\sqrt{2 s^2(t)/(nP-2)}` from the
    Gauss rules of :math:`(g_\sigma(t - \lambda) - \phi(t))^2`, an estimate of a bound on the Rademacher
    probes' variance, which is at most a Gaussian probe's; not their sample standard deviation, which a few
    heavily weighted outliers make small exactly where the estimate is far off), ``quadrature_error``
    (the ``m``- vs ``(m−1)``-node rule) and the interval ``[ci_low, ci_high]`` at ``confidence``
    (``density ± max(t_{P−1} · stderr + quadrature_error, rounding)``; pointwise; its rule and coverage:
    docs/derivations.md §17, "Stated errors and intervals"). ``reorth``: ``"full"`` (each Lanczos vector orthogonalised against its probe's
    basis, again where the first pass cancelled more than 1/√2 of its norm (DGKS); memory
    ``n_probes · n_iter · n``) or ``"none"`` (the three-term recurrence only,
    memory ``3 · n_probes · n``; finite-precision Lanczos still gives a Gauss rule of a nearby measure,
    Greenbaum 1989, with spurious copies of converged nodes).

    ``probes``: :class:`KrylovProbe` runs already made on ``A`` (an :class:`EigResult`'s ``probes``: its first
    run from a random start, its checks), each with at least ``n_iter`` steps, count as probes (the first
    ``n_iter`` steps of each: the same Gauss rule a probe from its start would give; the first
    ``n_probes`` of them); Rademacher probes are drawn and run only for the rest. Their starts are uniform
    on a sphere (the whole space's, or the complement's of the found vectors, whose values then carry
    weight ``1/n`` each: :meth:`KrylovProbe.rule`), so the average stays an unbiased estimate, of the
    spectrum of a matrix within the found pairs' residual norm of ``A`` for a deflated one. ``matvecs``
    counts the new products only. Shorter runs are not used (:meth:`KrylovProbe.covers`).

    Raises ``ValueError`` for an ``A`` that is not symmetric (an off-diagonal view ``A[a, b]``, named; a
    dense tensor with ``‖A − Aᵀ‖_F > n ε ‖A‖_F``; before any product), ``n_probes < 2``, ``n_iter < 2``, a bad
    ``seed``, ``grid``, ``sigma``, ``reorth``, ``confidence`` (a float in ``[0.5, 1)``) or ``probes`` (not
    :class:`KrylovProbe` runs of an operator of ``A``'s dimension); ``InsufficientMemoryError`` when the basis
    does not fit.
    """
    n, _ = check_operator(A, symmetric=True, who="slq_density")
    P = check_int("n_probes", n_probes, 2)
    confidence = _check_confidence(confidence)
    m = min(check_int("n_iter", n_iter, 2), n)
    if reorth not in ("full", "none"):
        raise ValueError(f"reorth must be 'full' or 'none', got {reorth!r}")
    if not (isinstance(grid, torch.Tensor) and grid.ndim == 1) and not (isinstance(grid, numbers.Integral)
                                                                       and not isinstance(grid, bool) and grid >= 2):
        raise ValueError(f"grid must be an int >= 2 (points) or a 1-d tensor, got {grid!r}")
    if isinstance(grid, torch.Tensor):
        _check_grid(grid)  # before the Lanczos work; broadening checks again for SLQResult.broaden's grids
    if isinstance(probes, (KrylovProbe, torch.Tensor)) or not all(isinstance(r, KrylovProbe) for r in probes):
        raise ValueError("probes must be a sequence of KrylovProbe (an EigResult's probes)")
    if any(r.n != n for r in probes):
        raise ValueError(f"probes must be runs on an operator of dimension n = {n}, got "
                         f"{sorted({r.n for r in probes})}")
    kept = [r for r in probes if r.covers(m)][:P]
    rules, matvecs = [r.rule(m) for r in kept], 0
    P_all, P = P, P - len(kept)
    if P:
        fresh, matvecs = _slq_rules(A, n, P, m, seed, reorth)
        rules += fresh
    M = max([m] + [len(r[0]) for r in rules])  # (m, or m + k for a deflated rule; zero weights past a rule's end)

    def stack(i):
        out = torch.zeros(P_all, M, dtype=A.dtype, device=A.device)
        for p_, r in enumerate(rules):
            out[p_, : len(r[i])] = r[i].to(out)
        return out
    nodes, weights, nodes_prev, weights_prev = (stack(i) for i in range(4))
    return _slq_result(A, n, m, P_all, nodes, weights, nodes_prev, weights_prev, grid, sigma, reorth, confidence,
                       matvecs)


def _slq_rules(A, n: int, P: int, m: int, seed, reorth: str) -> list:
    """:func:`slq_density`'s ``P`` Rademacher probes through ``m`` Lanczos steps: ``(rules, matvecs)``, each
    probe's rule ``(nodes, weights, nodes_prev, weights_prev)``."""
    gen = _generator(seed)
    check_fits(slq_bytes(n, A.dtype, P, m, reorth), f"the Lanczos bases ({P} probes x {m} x {n})", A.device)
    eps = torch.finfo(A.dtype).eps
    q = _rademacher(gen, (n, P), A) / math.sqrt(n)
    q_prev = torch.zeros_like(q)
    # each probe's basis contiguous, (P, m, n): its projections are batched matrix-vector products, no copy
    basis = torch.zeros(P, m, n, dtype=A.dtype, device=A.device) if reorth == "full" else None
    alpha = torch.zeros(P, m, dtype=A.dtype, device=A.device)
    beta = torch.zeros(P, m, dtype=A.dtype, device=A.device)
    length = torch.full((P,), m, dtype=torch.long)
    alive = torch.ones(P, dtype=torch.bool, device=A.device)
    scale = 0.0
    matvecs = 0
    for j in range(m):
        if bool(alive.all()):
            W = _mm(A, q)
        else:  # probes whose Krylov space is invariant are done: only the others are multiplied
            W = torch.zeros_like(q)
            W[:, alive] = _mm(A, q[:, alive])
        matvecs += int(alive.sum())
        a = (q * W).sum(0)
        W = torch.addcmul(W, q, a, value=-1)  # a fresh tensor (A's product may be A's own): the rest in place on it
        if j:
            W.addcmul_(q_prev, beta[:, j - 1], value=-1)
        if basis is not None:
            basis[:, j] = q.T
            Q, Wt = basis[:, : j + 1], W.T.contiguous()[:, :, None]  # (P, j+1, n), (P, n, 1)
            before = _norms(Wt, 1)
            Wt = Wt - torch.bmm(Q.transpose(1, 2), torch.bmm(Q, Wt))
            if bool((_norms(Wt, 1) < before / math.sqrt(2)).any()):  # a second pass where the first cancelled
                Wt = Wt - torch.bmm(Q.transpose(1, 2), torch.bmm(Q, Wt))  # (DGKS: "twice is enough", Kahan)
            W = Wt[:, :, 0].T
        bn = _norms(W)
        alpha[:, j] = a * alive
        scale = max(scale, float(a.abs().max()), float(bn.max()))
        # a breakdown (an invariant subspace) below the rounding of a length-n inner product, typically √n ε (not
        # n ε: for W_E's 38.6M float32 rows n ε = 4.6, every probe then 'broke down' after one step)
        dead = alive & (bn <= math.sqrt(n) * eps * scale)
        length[dead.cpu()] = j + 1
        alive = alive & ~dead
        beta[:, j] = bn * alive
        q_prev, q = q, W.div_(bn.clamp_min(torch.finfo(A.dtype).tiny))  # W's storage, n x P, reused as the next q
        if not bool(alive.all()):
            q[:, ~alive] = 0
        if not bool(alive.any()) or j == m - 1:
            break
    rules = []
    for p in range(P):
        L = int(length[p])
        Tp = torch.diag(alpha[p, :L]) + torch.diag(beta[p, : L - 1], 1) + torch.diag(beta[p, : L - 1], -1)
        theta, Y = linalg.eigh(Tp)
        if L == m and L < n:  # a full-length rule: compare with the one node fewer
            theta_p, Y_p = linalg.eigh(Tp[: L - 1, : L - 1])
        else:  # the Krylov space is invariant: the rule is exact
            theta_p, Y_p = theta, Y
        rules.append((theta, Y[0] ** 2, theta_p, Y_p[0] ** 2))
    return rules, matvecs


def _slq_result(A, n, m, P, nodes, weights, nodes_prev, weights_prev, grid, sigma, reorth, confidence, matvecs):
    """:func:`slq_density`'s result from its probes' Gauss rules ``(P, M)`` (zero weights past a rule's end)."""
    used = weights > 0
    lo, hi = float(nodes[used].min()), float(nodes[used].max())
    spread = hi - lo if hi > lo else (abs(hi) if hi != 0 else 1.0)  # one node value: its size (zero: no scale)
    if sigma is None:
        sigma = spread / m
    if not isinstance(grid, torch.Tensor):
        s = float(sigma) if isinstance(sigma, numbers.Real) and not isinstance(sigma, bool) else 0.0
        grid = torch.linspace(lo - 5 * s, hi + 5 * s, int(grid), dtype=A.dtype, device=A.device)
    density, stderr, quad, rounding = _broaden(nodes, weights, nodes_prev, weights_prev, grid, sigma, n)
    half = torch.maximum(_t_quantile(confidence, P - 1) * stderr + quad, rounding)
    return SLQResult(grid.to(dtype=A.dtype, device=A.device), density, stderr, quad, float(sigma), nodes, weights,
                     nodes_prev, weights_prev, P, m, matvecs, reorth, n, (density - half).clamp_min(0), density + half,
                     confidence)


# ----------------------------------------------------------------------------- trace, norm, diagonal


def hutchpp_trace(A, n_matvecs: int = 30, seed: int = 0, *, confidence: float = 0.95) -> Estimate:
    r"""The trace of a symmetric operator ``A`` ``(n, n)`` by Hutch++ (Meyer, Musco, Musco & Woodruff,
    SOSA 2021): an :class:`Estimate` with a ``confidence`` interval.

    With ``s = n_matvecs // 3`` Rademacher columns ``S`` and ``g = n_matvecs − 2·s`` more ``G``:
    :math:`Q = \mathrm{orth}(AS)`, :math:`t = \mathrm{tr}(Q^\top A Q) + \frac1g\sum_i x_i`,
    :math:`x_i = (P g_i)^\top A (P g_i)`, :math:`P = I - QQ^\top`; given ``Q`` the :math:`x_i` are independent
    with mean :math:`\mathrm{tr}(PAP)`, so ``t`` is unbiased for every sketch. ``stderr``
    :math:`= \sqrt{2\bar y / g}`, :math:`\bar y = \frac1g\sum_i \|P A P g_i\|^2` (unbiased for
    :math:`\|PAP\|_F^2`, from the same products): the Gaussian probe's variance :math:`2\|PAP\|_F^2/g`, at
    least the Rademacher probe's :math:`2(\|PAP\|_F^2 - \sum_i (PAP)_{ii}^2)/g`; not the :math:`x_i`'s sample
    standard deviation, which a residual of a few large eigenvalues makes small exactly when the estimate is
    far off. The interval is ``value ± q · stderr``, ``q`` Student's t quantile with ``g − 1`` degrees of
    freedom (``2.262`` for the default ``g = 10`` at 95 %); ``value ± 1.96 stderr`` covers less. The rule is
    empirical (calibrated on adversarial spectra: docs/derivations.md §17, "Stated errors and intervals";
    conservative where the residual is nearly diagonal). ``n_matvecs >= n``: the exact trace from ``A``'s columns
    (``exact=True``, ``stderr = 0``, the interval the value).

    Raises ``ValueError`` for an ``A`` that is not symmetric (an off-diagonal view ``A[a, b]``, named; a dense
    tensor with ``‖A − Aᵀ‖_F > n ε ‖A‖_F``; before any product), ``n_matvecs < 4``, a bad ``seed`` or
    ``confidence`` (a float in ``[0.5, 1)``).
    """
    n, _ = check_operator(A, symmetric=True, who="hutchpp_trace")
    N = check_int("n_matvecs", n_matvecs, 4)
    confidence = _check_confidence(confidence)
    gen = _generator(seed)
    if N >= n:
        tr = sum(float(torch.diagonal(cols[j : j + cols.shape[1]]).sum()) for j, cols in _columns(A, n))
        return Estimate(tr, 0.0, n, True, tr, tr, confidence)
    s = N // 3
    g = N - 2 * s
    Q = torch.linalg.qr(_mm(A, _rademacher(gen, (n, s), A))).Q
    AQ = _mm(A, Q)
    exact_part = float((Q * AQ).sum())
    G = _rademacher(gen, (n, g), A)
    PG = G - Q @ (Q.T @ G)
    W = _mm(A, PG)
    x = (PG * W).sum(0)
    PW = (W - Q @ (Q.T @ W)).to(torch.float64)
    y = float((PW * PW).sum()) / g
    value = exact_part + float(x.mean())
    se = math.sqrt(2 * y / g)
    # the rounding of the sums (|fl(uᵀv) − uᵀv| <= n ε ‖u‖‖v‖ per product), below which no interval is narrower
    eps = torch.finfo(A.dtype).eps
    rounding = n * eps * (float(AQ.norm(dim=0).sum()) + float((PG.norm(dim=0) * W.norm(dim=0)).mean()))
    half = max(_t_quantile(confidence, g - 1) * se, rounding)
    return Estimate(value, se, N, False, value - half, value + half, confidence)


def frobenius_norm(A, n_matvecs: int | None = None, seed: int = 0, *, confidence: float = 0.95) -> Estimate:
    r"""The Frobenius norm :math:`\|A\|_F` of an operator ``A`` ``(n_out, n_in)`` (a symmetric one, or any
    other: an off-diagonal view ``A[a, b]``, square or not): an :class:`Estimate` of the norm.

    ``n_matvecs`` ``None`` or ``>= n_in``: exact, :math:`\sum_j \|A e_j\|^2` over the columns
    (``exact=True``). Otherwise the Hutch++ split of :math:`\|A\|_F^2 = \|AQ\|_F^2 + \|A(I-QQ^\top)\|_F^2`
    (any orthonormal ``Q``): ``Q = orth(Aᵀ S)`` from ``s = n_matvecs // 3`` Rademacher columns (``Aᵀ = A``
    for a symmetric ``A``; ``A.T`` for one that is not, :attr:`HessianOperator.is_symmetric`), the first term
    exact, the second :math:`\bar x = \frac1g\sum_i x_i`, :math:`x_i = \|A P g_i\|^2` over the other
    ``g = n_matvecs − 2·s`` (unbiased: :math:`x_i = (Pg_i)^\top C (Pg_i)`, :math:`C = PA^\top AP` positive
    semi-definite). Its distribution is taken as Satterthwaite's :math:`\mathrm{tr}(C)\,\chi^2_\nu/\nu` with
    :math:`\nu = \max(g,\; g\,\bar x^2 / \hat U)`, :math:`\hat U = \frac1{g^2}\sum_{i,j}(w_i^\top w_j)^2`
    (:math:`w_i = A P g_i`; its mean is :math:`\|C\|_F^2(1 + \frac1g) + \mathrm{tr}(C)^2/g`, above
    :math:`\|C\|_F^2`, so :math:`\nu` errs low: ``g <= ν <= g²``, ``ν = g`` the rank-one residual, the least
    averaged): the interval is :math:`\sqrt{\|AQ\|_F^2 + \bar x\,\nu/\chi^2_{\nu}(\cdot)}` at the
    chi-square quantiles ``(1 ± confidence)/2``, and ``stderr`` :math:`= \bar x\sqrt{2/\nu} / (2\,\|A\|_F)` (the
    delta method). Conservative by construction of ν (docs/derivations.md §17, "Stated errors
    and intervals").

    Raises ``ValueError`` for ``n_matvecs < 4``, a bad ``seed`` or ``confidence`` (a float in ``[0.5, 1)``).
    """
    n_out, n_in = check_operator(A, square=False)
    confidence = _check_confidence(confidence)
    gen = _generator(seed)
    if n_matvecs is None or check_int("n_matvecs", n_matvecs, 4) >= n_in:
        sq = sum(float((cols.to(torch.float64) ** 2).sum()) for _, cols in _columns(A, n_in))
        return Estimate(math.sqrt(sq), 0.0, n_in, True, math.sqrt(sq), math.sqrt(sq), confidence)
    N = n_matvecs
    s = N // 3
    g = N - 2 * s
    if n_out == n_in and asymmetry(A) is None:
        Q = torch.linalg.qr(_mm(A, _rademacher(gen, (n_in, s), A))).Q
    else:
        At = A.T
        Q = torch.linalg.qr(_mm(At, _rademacher(gen, (n_out, s), A))).Q
    exact_part = float((_mm(A, Q).to(torch.float64) ** 2).sum())
    G = _rademacher(gen, (n_in, g), A)
    W = _mm(A, G - Q @ (Q.T @ G)).to(torch.float64)
    gram = W.T @ W
    x = torch.diagonal(gram)
    xm = float(x.mean())
    value = math.sqrt(exact_part + xm)
    # the rounding of the squared sums (relative n ε), below which no interval is narrower
    rounding = max(n_out, n_in) * torch.finfo(A.dtype).eps * (exact_part + xm)
    if not xm > 0:  # A P = 0: the sketch holds the whole row space; nothing was sampled
        return Estimate(value, 0.0, N, False, math.sqrt(max(exact_part - rounding, 0.0)),
                        math.sqrt(exact_part + rounding), confidence)
    U = float((gram * gram).sum()) / g**2
    nu = max(float(g), g * xm * xm / U)
    lo = xm * nu / _chi2_quantile((1 + confidence) / 2, nu)
    hi = xm * nu / _chi2_quantile((1 - confidence) / 2, nu)
    lo, hi = math.sqrt(max(exact_part + min(lo, xm - rounding), 0.0)), math.sqrt(exact_part + max(hi, xm + rounding))
    return Estimate(value, xm * math.sqrt(2 / nu) / (2 * value), N, False, lo, hi, confidence)


def hutchinson_diagonal(A, n_matvecs: int = 30, seed: int = 0, *, confidence: float = 0.95) -> Estimate:
    r"""An estimate of the diagonal ``(n,)`` of a square operator (symmetric or not) by Hutchinson's method
    (Bekas, Kokiopoulou & Saad 2007): :math:`\hat d = \frac1N\sum_i g_i \odot A g_i` over ``N = n_matvecs``
    Rademacher vectors, unbiased, ``stderr`` ``(n,)`` the per-entry sample standard deviation ``/ √N``
    (each entry's samples :math:`A_{jj} + \sum_{l \ne j} A_{jl} g_j g_l` are symmetric about the mean), the
    interval ``(n,)`` each ``value ± q · stderr`` with ``q`` Student's t quantile with ``N − 1`` degrees of
    freedom (per entry, not simultaneous), never narrower than the mean's rounding ``(N + 1) ε max_i |x_i|``. A sampled estimate, never the exact diagonal (that is
    :func:`diagonal`).

    Raises ``ValueError`` for ``n_matvecs < 2``, a bad ``seed`` or ``confidence`` (a float in ``[0.5, 1)``).
    """
    n, _ = check_operator(A)
    N = check_int("n_matvecs", n_matvecs, 2)
    confidence = _check_confidence(confidence)
    G = _rademacher(_generator(seed), (n, N), A)
    x = G * _mm(A, G)
    value, se = x.mean(1), x.std(1, correction=1) / math.sqrt(N)
    # never narrower than the rounding of the mean of N samples: an exactly diagonal A gives equal samples,
    # a zero spread, and a point interval its rounded mean misses by an ulp
    floor = (N + 1) * torch.finfo(x.dtype).eps * x.abs().amax(1)
    half = torch.maximum(_t_quantile(confidence, N - 1) * se, floor)
    return Estimate(value, se, N, False, value - half, value + half, confidence)


def diagonal(A) -> torch.Tensor:
    """The exact diagonal ``(n,)`` of a square operator from its engine's closed form: ``A.diagonal()``
    (a :class:`~blockhess.operators.HessianOperator` or a view ``A[a, a]``; a dense tensor's own
    diagonal). Never sampled: raises ``NotImplementedError`` for an operator with no closed-form
    diagonal (:func:`hutchinson_diagonal` estimates one), ``ValueError`` for a non-square one."""
    n_out, n_in = check_operator(A, square=False)
    if n_out != n_in:
        raise ValueError(f"the diagonal is defined for a square operator, got shape {tuple(A.shape)}")
    if isinstance(A, torch.Tensor):
        return torch.diagonal(A).clone()
    fn = getattr(A, "diagonal", None)
    if not callable(fn):
        raise NotImplementedError(f"{type(A).__name__} offers no closed-form diagonal; hutchinson_diagonal estimates "
                                  "it by sampling")
    return fn()


def per_block(A, estimator: Callable, blocks=None, pairs: bool = False, **kwargs) -> dict:
    """``estimator(A[b, b], **kwargs)`` for every block ``b`` of ``blocks`` (default ``A.names``; each a
    variable name, a head's ``W_Q#h``, or a tuple of names; a single name for one block), as ``{b: result}``; with ``pairs=True``
    ``estimator(A[a, b], **kwargs)`` for every unordered pair, ``a`` not after ``b`` in ``blocks``, as
    ``{(a, b): result}`` (for estimators of rectangular operators, e.g. :func:`frobenius_norm`).
    Each view's products touch only its block (:class:`~blockhess.operators.HessianOperator`).
    For the estimators that assume a symmetric operator (:func:`lanczos_eigs`, :func:`slq_density`,
    :func:`hutchpp_trace`, or a ``functools.partial`` of one) every view is checked before the first
    product: ``pairs=True`` with them raises ``ValueError`` naming the first off-diagonal view.

    E.g. ``per_block(A, lanczos_eigs, k=3, dense_below=1024)``: the top eigenpairs of every block, the
    small ones by the dense eigendecomposition. Raises ``ValueError`` for an ``A`` without views, a
    ``KeyError`` for an unknown block; the estimator's errors otherwise.
    """
    if not (hasattr(A, "__getitem__") and hasattr(A, "names")):
        raise ValueError(f"per_block needs an operator with named views A[a, b] (a HessianOperator), got {type(A).__name__}")
    if not callable(estimator):
        raise ValueError(f"estimator must be callable, got {type(estimator).__name__}")
    blocks = list(A.names if blocks is None else [blocks] if isinstance(blocks, str) else blocks)  # a str: one block
    keys = [b if isinstance(b, str) else tuple(b) for b in blocks]
    views = ({(a, b): A[a, b] for i, a in enumerate(keys) for b in keys[i:]} if pairs else
             {b: A[b, b] for b in keys})
    base = getattr(estimator, "func", estimator)  # a functools.partial of one
    if base in (lanczos_eigs, slq_density, hutchpp_trace):  # every view checked before any product
        for view in views.values():
            check_symmetric(view, f"{base.__name__} (per_block{', pairs=True' if pairs else ''})")
    return {key: estimator(view, **kwargs) for key, view in views.items()}
