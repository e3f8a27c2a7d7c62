r"""Lock-step estimators: every block's top-k and spectral density advancing together on a block-diagonal
operator (:class:`~.operator.BlockDiagonalOperator`), and the Jensen–Shannon distance between densities.

Each block runs the package's own estimator, unchanged (:func:`~.estimators.lanczos_eigs`, its residuals and
its check, or :func:`~.estimators.slq_density`), in its own Krylov space, on a stand-in for its block whose
products are gathered: once every block still running has asked for its next product, one call
:meth:`~.operator.BlockDiagonalOperator.products` multiplies them all (each block its own columns; a block
that has finished asks for nothing and drops out). A block's result is therefore the result of the estimator
on ``A[b, b]`` with the same arguments, up to the rounding of the products (docs/derivations.md §17,
"Lock-step estimators"). Each block's estimator runs in a thread of its own that only waits for its products;
the products themselves run in the calling thread.
"""

from __future__ import annotations

import math
import numbers
import threading
from dataclasses import dataclass
from typing import Callable

import torch

from ..heap import release_free
from ..validation import Headroom, check_fits, keeping_free, recording_needs
from .estimators import CHECK_COLUMNS, EigResult, SLQResult, lanczos_bytes, lanczos_eigs, slq_bytes, slq_density
from .operator import BlockDiagonalOperator

__all__ = ["Blockwise", "blockwise_eigs", "blockwise_slq", "js_distance"]


@dataclass
class Blockwise:
    """The lock-step results: ``results`` ``{block: result}`` in ``D.blocks``' order (an :class:`EigResult`
    or :class:`SLQResult` each), ``matvecs`` ``{block: columns of that block multiplied}``, ``products`` the
    number of calls of ``D.products`` (each one pass for all the blocks then running), ``product_bytes``
    the most memory one of them needed at once by its own checks (:class:`~blockhess.validation.Needs`;
    ``0`` where every request was below the checked size), which the estimators' own allocations kept free.
    ``R[b]`` is ``R.results[b]``; iterating gives the blocks."""

    results: dict
    matvecs: dict
    calls: dict
    products: int
    product_bytes: int = 0

    def __getitem__(self, block):
        return self.results[block]

    def __iter__(self):
        return iter(self.results)

    def __len__(self) -> int:
        return len(self.results)


class _Stand:
    """Block ``j`` of ``D`` for its estimator: ``shape``, ``dtype``, ``device``, symmetric, the view's
    ``kronecker_factors``; ``@`` waits for the lock-step product."""

    def __init__(self, step: "_Step", j: int):
        view = step.D.views[j]
        self.step, self.j = step, j
        self.shape, self.dtype, self.device = view.shape, view.dtype, view.device
        self.names = view.names
        self.is_symmetric = self.SELF_ADJOINT = True
        self.kronecker_factors = view.kronecker_factors
        self.matvecs = self.calls = 0

    def __matmul__(self, X):
        if not isinstance(X, torch.Tensor) or X.ndim not in (1, 2) or X.shape[0] != self.shape[1]:
            raise ValueError(f"X must be a tensor ({self.shape[1]},) or ({self.shape[1]}, k), got "
                             f"{tuple(X.shape) if isinstance(X, torch.Tensor) else type(X).__name__}")
        one = X.ndim == 1
        X = X[:, None] if one else X
        if X.shape[1] == 0:
            return X.new_zeros(self.shape[0], 0)
        self.matvecs += X.shape[1]
        self.calls += 1
        Y = self.step.request(self.j, X)
        return Y[:, 0] if one else Y


class _Step:
    """The gathering of products: each estimator's thread posts its block's ``X`` and waits; when every block
    still running has posted, :meth:`serve` (the caller's thread) multiplies them in one ``D.products``."""

    def __init__(self, D: BlockDiagonalOperator, running, room: Headroom):
        self.D, self.cv, self.room = D, threading.Condition(), room
        self.posted: dict = {}
        self.ready: dict = {}
        self.running = set(running)
        self.products = 0

    def request(self, j: int, X: torch.Tensor) -> torch.Tensor:
        with self.cv:
            self.posted[j] = X
            self.cv.notify_all()
            while j not in self.ready:
                self.cv.wait()
            Y = self.ready.pop(j)
        if isinstance(Y, BaseException):
            raise Y
        return Y

    def finish(self, j: int) -> None:
        with self.cv:
            self.running.discard(j)
            self.cv.notify_all()

    def serve(self) -> None:
        while True:
            with self.cv:
                while self.running and len(self.posted) < len(self.running):
                    self.cv.wait()
                if not self.running:
                    return
                batch, self.posted = self.posted, {}
            try:
                with recording_needs() as need:
                    Y = self.D.products(batch)
                self.room.bytes = max(self.room.bytes, need.peak)  # the estimators' allocations leave it free
            except BaseException as e:  # each waiting estimator raises it in its thread
                Y = {j: e for j in batch}
            with self.cv:
                self.ready.update(Y)
                self.products += 1
                self.cv.notify_all()


def _lockstep(D, estimator: Callable, kwargs: dict, per_block: dict, nbytes: Callable, plan: Callable) -> Blockwise:
    """``estimator(block j, **kwargs, **per_block[j])`` for every block of ``D``, in lock-step; ``nbytes(j,
    view)`` the memory block ``j``'s estimator allocates, the sum over the blocks checked before any work (the
    blocks' estimators then allocate at once, each checking only its own); ``plan(j, view)`` the columns it means to
    multiply (fewer where it stops early), given to ``D`` before the first product
    (:meth:`~.operator.BlockDiagonalOperator.expect_columns`). Later, each estimator's own memory checks
    (a check's basis growing) keep free what the products needed at most so far, by the products' own checks
    (:class:`~blockhess.validation.Headroom`): a block that cannot grow stops by name (its check's reason),
    the products go on."""
    if not isinstance(D, BlockDiagonalOperator):
        raise ValueError(f"D must be a BlockDiagonalOperator (A.block_diagonal(blocks)), got {type(D).__name__}")
    m = len(D.blocks)
    try:
        need = sum(nbytes(j, v) for j, v in enumerate(D.views))
    except (TypeError, ValueError):  # arguments the estimator refuses by name, in every block's thread below
        need = 0
    check_fits(need, f"the lock-step estimators' bases ({m} blocks, n = {D.shape[0]})", D.device)
    try:
        columns = {j: int(plan(j, v)) for j, v in enumerate(D.views)}
    except (TypeError, ValueError):  # arguments the estimator refuses by name, in every block's thread below
        columns = {}
    D.expect_columns(columns)
    room = Headroom(f"the lock-step products of the {m} blocks (the most their own checks asked for)")
    step = _Step(D, range(m), room)
    stands = [_Stand(step, j) for j in range(m)]
    results, errors = {}, {}

    def work(j):
        try:
            with keeping_free(room):
                results[j] = estimator(stands[j], **kwargs, **per_block.get(j, {}))
        except BaseException as e:  # re-raised in the caller's thread below
            errors[j] = e
        finally:
            step.finish(j)

    threads = [threading.Thread(target=work, args=(j,), daemon=True) for j in range(m)]
    for t in threads:
        t.start()
    step.serve()
    for t in threads:
        t.join()
    release_free()  # what the blocks' threads freed stays in their C heaps' arenas otherwise (GBs: the bases)
    if errors:
        j = min(errors)
        e = errors[j]
        e.add_note(f"(in the lock-step estimator of block {D.blocks[j]!r})")
        raise e
    return Blockwise({D.blocks[j]: results[j] for j in range(m)}, {D.blocks[j]: stands[j].matvecs for j in range(m)},
                     {D.blocks[j]: stands[j].calls for j in range(m)}, step.products, room.bytes)


def _per_block(D: BlockDiagonalOperator, given, name: str, what: str, take: Callable) -> dict:
    """``given`` (``None``, a :class:`Blockwise`, or ``{block: value}``) as ``{j: {name: take(value)}}``;
    ``take`` returns ``None`` for a value it refuses (``ValueError`` naming ``name``, ``what`` it expected)."""
    if given is None:
        return {}
    if isinstance(given, Blockwise):
        given = given.results
    if not isinstance(given, dict):
        raise ValueError(f"{name} must be None, a Blockwise, or a dict block -> {what}, got {type(given).__name__}")
    index = {b: j for j, b in enumerate(D.blocks)}
    out = {}
    for b, v in given.items():
        key = b if isinstance(b, str) else tuple(b)
        if key not in index:
            raise ValueError(f"{name} names a block {b!r} that D does not have; D's blocks are {list(D.blocks)}")
        got = take(v)
        if got is None:
            raise ValueError(f"{name}[{b!r}] must be {what}, got {type(v).__name__}")
        out[index[key]] = {name: got}
    return out


def _warm_starts(D: BlockDiagonalOperator, v0) -> dict:
    """``v0`` (``None``, ``{block: (n_b,) or (n_b, j) tensor}``, or a :class:`Blockwise` / dict of
    :class:`EigResult`, whose eigenvectors are taken) as ``{j: {"v0": tensor}}``."""
    def take(v):
        v = v.eigenvectors if isinstance(v, EigResult) else v
        return v if isinstance(v, torch.Tensor) else None
    return _per_block(D, v0, "v0", "a tensor or an EigResult", take)


def _kept_probes(D: BlockDiagonalOperator, probes) -> dict:
    """``probes`` (``None``, a :class:`Blockwise` of :class:`EigResult`, or ``{block: EigResult or sequence of
    KrylovProbe}``) as ``{j: {"probes": tuple}}``."""
    def take(r):
        return tuple(r.probes) if isinstance(r, EigResult) else tuple(r) if isinstance(r, (list, tuple)) else None
    return _per_block(D, probes, "probes", "an EigResult or a sequence of KrylovProbe", take)


def blockwise_eigs(D: BlockDiagonalOperator, k: int = 1, *, v0=None, **kwargs) -> Blockwise:
    r"""Every block's ``k`` extreme eigenpairs in lock-step: for each block ``b`` of ``D``
    (:meth:`~.operator.HessianOperator.block_diagonal`), :func:`~.estimators.lanczos_eigs` on ``A[b, b]``
    with ``k`` and ``kwargs`` (``which``, ``tol``, ``rel``, ``check``, ``failure_probability``, ``seed``, ...:
    the same for every block), its guarantees unchanged (the residuals from products, the check run per
    block: a block's converged answer is right with probability at least ``1 − miss_probability``), every
    block's products gathered into one ``D.products`` per step. ``v0``: warm starts, ``{block: (n_b,) or
    (n_b, j) tensor}`` or the previous call's :class:`Blockwise` (each block's eigenvectors: a checkpoint's
    spectra from the one before). Returns a :class:`Blockwise` of :class:`EigResult` (its ``matvecs`` equal
    each result's). Raises ``ValueError`` for a ``D`` that is not a
    :class:`~.operator.BlockDiagonalOperator`, a bad ``v0`` or a ``k`` above a block's size (the block
    named, before any product); every block's errors as
    :func:`~.estimators.lanczos_eigs` (the first block's that raised, after every block has finished; its
    :class:`~.estimators.NotConvergedError` holds that block's result)."""
    def nbytes(j, view):
        n = view.shape[0]
        if n <= kwargs.get("dense_below", 0):
            return 2 * n * n * view.dtype.itemsize
        if view.kronecker_factors() is not None:
            return 0
        return lanczos_bytes(n, view.dtype, k, kwargs.get("ncv"), kwargs.get("block_size"),
                             kwargs.get("check", CHECK_COLUMNS))

    def plan(j, view):  # a converged run's fewest: k Ritz vectors, their residual product, the checks' first products
        n = view.shape[0]
        if n <= kwargs.get("dense_below", 0) or view.kronecker_factors() is not None:
            return 0
        runs = kwargs.get("check_runs", 1)
        return 2 * min(k, n) + (runs * min(kwargs.get("check", CHECK_COLUMNS), n - k) if n > k else 0)

    if isinstance(D, BlockDiagonalOperator) and isinstance(k, numbers.Integral) and not isinstance(k, bool):
        for b, view in zip(D.blocks, D.views):
            if k > view.shape[0]:
                raise ValueError(f"k must be at most every block's size: block {b!r} has n = {view.shape[0]}, got k = {k}")
    return _lockstep(D, lanczos_eigs, dict(kwargs, k=k), _warm_starts(D, v0), nbytes, plan)


def blockwise_slq(D: BlockDiagonalOperator, *, probes=None, **kwargs) -> Blockwise:
    r"""Every block's spectral density in lock-step: for each block ``b`` of ``D``,
    :func:`~.estimators.slq_density` on ``A[b, b]`` with ``kwargs`` (``n_probes``, ``n_iter``, ``seed``,
    ``grid``, ``sigma``, ``reorth``, ``confidence``: the same for every block, so each block gets the probes
    the per-block call draws), every block's probes multiplied in one ``D.products`` per Lanczos step.
    ``probes``: the runs :func:`blockwise_eigs` already made (its :class:`Blockwise`, or ``{block:
    EigResult or sequence of KrylovProbe}``), taken as each block's ``probes=``: a block whose runs are long
    enough makes no product. Returns a :class:`Blockwise` of :class:`SLQResult`. Raises ``ValueError`` for a
    ``D`` that is not a :class:`~.operator.BlockDiagonalOperator` or bad ``probes``; every block's errors as
    :func:`~.estimators.slq_density`."""
    kept = _kept_probes(D, probes)
    P, m = kwargs.get("n_probes", 16), kwargs.get("n_iter", 64)

    def fresh(j, view):  # the probes block j still draws
        runs = kept.get(j, {}).get("probes", ())
        return max(0, P - sum(1 for r in runs if r.covers(min(m, view.shape[0]))))

    return _lockstep(D, slq_density, kwargs, kept, lambda j, view: slq_bytes(
        view.shape[0], view.dtype, fresh(j, view), m, kwargs.get("reorth", "full")),
        lambda j, view: fresh(j, view) * min(m, view.shape[0]))  # (fewer on a breakdown)


def _probabilities(p, what: str) -> torch.Tensor:
    if not isinstance(p, torch.Tensor) or p.ndim != 1 or p.numel() < 1 or not p.dtype.is_floating_point:
        raise ValueError(f"{what} must be an SLQResult or a 1-d float tensor of weights, got "
                         f"{tuple(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__}")
    if not bool(torch.isfinite(p).all()) or bool((p < 0).any()) or not float(p.sum()) > 0:
        raise ValueError(f"{what} must hold finite non-negative weights with a positive sum")
    return p / p.sum()


def js_distance(p, q, *, grid: int | torch.Tensor = 512, sigma: float | None = None, base: float = 2.0) -> float:
    r"""The Jensen–Shannon distance between two spectral densities (Zhang et al., NeurIPS 2024, "Why
    Transformers need Adam: a Hessian perspective": their measure of how the blocks' Hessian spectra differ):
    :math:`\mathrm{JS}(p, q) = \sqrt{\tfrac12 \mathrm{KL}(p\,\|\,m) + \tfrac12 \mathrm{KL}(q\,\|\,m)}`,
    :math:`m = (p + q)/2`, :math:`\mathrm{KL}(p\,\|\,m) = \sum_i p_i \log_{\mathrm{base}}(p_i / m_i)` (terms with
    :math:`p_i = 0` are 0). In base 2 (default) it lies in ``[0, 1]``; 0 exactly for equal densities, 1 for
    disjoint supports; symmetric; a metric (Endres & Schindelin 2003).

    ``p``, ``q``: two :class:`SLQResult` (each discretised as its broadened density evaluated on one common
    grid, :meth:`SLQResult.broaden`, with one Gaussian width for both: ``sigma``, by default the wider of
    the two densities' own, then divided by its sum over the grid: the probabilities of the grid's cells;
    ``grid``: a number of equally spaced points from the lower of the two densities' grids' first points to
    the higher of their last, or a 1-d tensor of points) or two 1-d tensors of non-negative weights on one
    grid (normalised to sum 1). One width for both: a block whose spectrum spans ``1e-4`` beside one spanning
    1 would, with its own width, fall between the common grid's points (all zero there); and two densities
    compared at different widths differ by the broadening as well as by their spectra. The distance depends
    on that width and so, through each density's default width (its nodes' spread over its steps), on the
    number of Lanczos steps:
    compare distances computed alike (docs/guide/estimators.md). Float (the sums in float64). Raises
    ``ValueError`` for other inputs, weights of unequal lengths, negative or non-finite weights or a zero sum
    (for ``SLQResult``\ s: a density that vanishes on every grid point, ``sigma`` given far below the grid's
    spacing), ``base`` not a float > 1, ``sigma`` not positive."""
    if isinstance(base, bool) or not isinstance(base, (int, float)) or not base > 1:
        raise ValueError(f"base must be a float > 1, got {base!r}")
    if isinstance(p, SLQResult) and isinstance(q, SLQResult):
        if sigma is not None and (isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or not sigma > 0):
            raise ValueError(f"sigma must be None or a float > 0, got {sigma!r}")
        if not isinstance(grid, torch.Tensor):
            if isinstance(grid, bool) or not isinstance(grid, int) or grid < 2:
                raise ValueError(f"grid must be an int >= 2 (points) or a 1-d tensor, got {grid!r}")
            lo = min(float(p.grid[0]), float(q.grid[0]))
            hi = max(float(p.grid[-1]), float(q.grid[-1]))
            grid = torch.linspace(lo, hi, grid, dtype=torch.float64)
        width = max(p.sigma, q.sigma) if sigma is None else float(sigma)
        p, q = p.broaden(grid.to(p.nodes.dtype), width)[0], q.broaden(grid.to(q.nodes.dtype), width)[0]
        for name, dens in (("p", p), ("q", q)):
            if not bool(dens.sum() > 0):
                gap = f" (the grid's smallest spacing {float(grid.diff().abs().min()):.3g})" if grid.numel() > 1 else ""
                raise ValueError(f"{name}'s density vanishes on every point of the grid at sigma = {width:.3g}{gap}: "
                                 "give a wider sigma or a finer grid")
    elif isinstance(p, SLQResult) or isinstance(q, SLQResult):
        raise ValueError("p and q must both be SLQResults or both tensors of weights")
    p, q = _probabilities(p, "p").double().cpu(), _probabilities(q, "q").double().cpu()
    if p.shape != q.shape:
        raise ValueError(f"p and q must have equal lengths, got {p.numel()} and {q.numel()}")
    p, q = p / p.sum(), q / q.sum()
    s = p + q  # a / m taken as 2a / s: m = s / 2 rounds to 0 where s is the least subnormal (a / m would be inf)

    def kl(a):
        used = a > 0
        return float((a[used] * torch.log(2 * a[used] / s[used])).sum())

    jsd = (kl(p) + kl(q)) / (2 * math.log(base))
    return math.sqrt(max(jsd, 0.0))
