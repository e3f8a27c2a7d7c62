"""``lanczos_eigs`` against the dense eigendecomposition (``torch.linalg.eigvalsh``, float64) of symmetric
matrices of chosen spectrum, wrapped as operators, and of a real block's Hessian operator.

The rule for eigenvalues: for orthonormal ``X`` (``n × k``) and ``Θ = XᵀAX``, the eigenvalues of ``Θ``
lie within ``‖AX − XΘ‖₂ <= ‖R‖_F`` of ``k`` eigenvalues of ``A`` (Kahan; Parlett, *The Symmetric
Eigenvalue Problem*, Thm 11.5.1); the dense eigendecomposition adds its own rounding, ``n ε ‖A‖₂``.
So the ``k`` wanted eigenvalues, in order, must match the returned ones to ``‖R‖_F + n ε ‖A‖₂``;
a wrong set (a missed copy of a multiple eigenvalue) is off by a gap and fails. With ``tol = 1e-10``
that is within ``1e-8 |λ|`` for every value here.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import blockhess as bh
from blockhess.operators import HessianOperator, NotConvergedError, estimators, lanczos_eigs, slq_density

DT = torch.float64
EPS = torch.finfo(DT).eps
TOL = 1e-10


def _matrix(lam: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """A symmetric matrix with eigenvalues ``lam`` and random (Haar) eigenvectors."""
    n = lam.numel()
    Q, _ = torch.linalg.qr(torch.randn(n, n, generator=torch.Generator().manual_seed(seed), dtype=DT))
    M = (Q * lam.to(DT)) @ Q.T
    return (M + M.T) / 2


def _wanted(lam: torch.Tensor, k: int, which: str) -> torch.Tensor:
    lam = lam.sort().values
    return {"LA": lam.flip(0)[:k], "SA": lam[:k], "LM": lam[lam.abs().argsort(descending=True, stable=True)][:k]}[which]


def _assert_extreme(res, M: torch.Tensor, k: int, which: str, tol: float = TOL):
    """``res`` holds the ``k`` wanted eigenpairs of ``M``, each residual within its bound (the rule above)."""
    lam = torch.linalg.eigvalsh(M)
    norm = float(lam.abs().max())
    assert res.converged and res.eigenvalues.shape == (k,) and res.eigenvectors.shape == (M.shape[0], k)
    assert bool((res.residuals <= res.bounds).all())
    s = res.scale
    assert s <= norm * (1 + 1e-12)  # a Ritz value never exceeds ‖A‖₂
    a = res.eigenvalues.abs()
    want_bounds = torch.where(a >= tol * s, tol * a, torch.full_like(a, tol * s)) if res.rel == "each" else \
        torch.full_like(a, tol * s)
    assert torch.equal(res.bounds, want_bounds)
    slack = float(res.residuals.norm()) + M.shape[0] * EPS * norm
    want = _wanted(lam, k, which)
    got = res.eigenvalues
    if which == "LM":  # ties of magnitude between signs: either is an answer
        got, want = got.abs(), want.abs()
    assert float((got.sort().values - want.sort().values).abs().max()) <= slack
    if tol <= TOL:  # the brief's figure for these spectra: eigenvalues to 1e-8
        assert float((got.sort().values - want.sort().values).abs().max()) <= 1e-8 * norm
    X = res.eigenvectors
    assert float((X.T @ X - torch.eye(k, dtype=DT)).abs().max()) <= 1e-10


def _bulk(n: int, lo: float, hi: float, seed: int) -> torch.Tensor:
    return lo + (hi - lo) * torch.rand(n, generator=torch.Generator().manual_seed(seed), dtype=DT)


# ----------------------------------------------------------------------------- which, clusters, ties


@pytest.mark.parametrize("which", ["LA", "SA", "LM"])
@pytest.mark.parametrize("block_size", [1, 2])
def test_the_extreme_eigenpairs_of_a_clustered_spectrum(which, block_size):
    """Five values within 4e-4 of each other at each end, above a bulk reaching 0.95 of them."""
    top = 1 - 1e-4 * torch.arange(5, dtype=DT)
    lam = torch.cat([top, -0.9 * top, _bulk(250, -0.85, 0.95, 1)])
    M = _matrix(lam)
    res = lanczos_eigs(M, k=5, which=which, tol=TOL, block_size=block_size)
    _assert_extreme(res, M, 5, which)


@pytest.mark.parametrize("which, top, k", [("LM", (5.0, -5.0, 4.0, -4.0, 3.5), 3), ("LA", (5.0, 4.0, 4.0, 3.0), 2),
                                           ("SA", (-5.0, -4.0, -4.0, -3.0), 3)])
def test_ties_at_the_kth_value(which, top, k):
    lam = torch.cat([torch.tensor(top, dtype=DT), _bulk(150, -2.0, 2.0, 2)])
    M = _matrix(lam, seed=1)
    _assert_extreme(lanczos_eigs(M, k=k, which=which, tol=TOL), M, k, which)


def test_the_old_criterion_stays_available():
    lam = torch.cat([torch.tensor([3.0, 2.0, 0.5], dtype=DT), _bulk(150, -0.1, 0.1, 3)])
    M = _matrix(lam, seed=2)
    res = lanczos_eigs(M, k=3, tol=1e-8, rel="scale")
    assert res.rel == "scale" and bool((res.residuals <= 1e-8 * res.scale).all())
    _assert_extreme(res, M, 3, "LA", tol=1e-8)
    each = lanczos_eigs(M, k=3, tol=1e-8)  # the third bound is 1e-8 · 0.5, six times tighter
    assert each.rel == "each" and float(each.residuals[2]) <= 1e-8 * float(each.eigenvalues[2])


def test_eigenvalues_at_zero_fall_back_to_the_scale():
    """The bottom of a PSD matrix: two exact zeros and 1e-13, where ``tol · |λ|`` could never be met;
    their bounds are ``tol · s``, the next value's its own."""
    lam = torch.cat([torch.tensor([0.0, 0.0, 1e-13, 0.5], dtype=DT), _bulk(150, 1.0, 2.0, 4)])
    M = _matrix(lam, seed=3)
    res = lanczos_eigs(M, k=4, which="SA", tol=1e-8)
    _assert_extreme(res, M, 4, "SA", tol=1e-8)
    assert torch.equal(res.bounds[:3], torch.full((3,), 1e-8 * res.scale, dtype=DT))
    assert float(res.bounds[3]) == 1e-8 * abs(float(res.eigenvalues[3]))


# ----------------------------------------------------------------------------- multiplicity


@pytest.mark.parametrize("block_size", [1, 2])
def test_a_multiplicity_above_the_block_size(block_size):
    """``(hᵀh/t) ⊗ I_8``, as W_2's block under MSE: every eigenvalue 8 times; the top 5 are one value."""
    g = torch.Generator().manual_seed(4)
    h = torch.randn(12, 10, generator=g, dtype=DT)
    M = torch.kron(h.T @ h / 12, torch.eye(8, dtype=DT))
    res = lanczos_eigs(M, k=5, tol=TOL, block_size=block_size)
    _assert_extreme(res, M, 5, "LA")
    assert res.check_matvecs > 0 and res.check_value is not None


def test_the_check_finds_what_the_krylov_space_cannot_see():
    """``diag(G, G)`` from a start supported on the first half: every product keeps the second half exactly
    zero, so the iteration alone finds the top 5 of ``G`` (one copy each), a set of eigenpairs with
    small residuals that is not the top 5 of ``diag(G, G)``. The check, from a fresh random block, sees
    the second copies and takes them in."""
    G = _matrix(torch.cat([torch.tensor([4.0, 3.5, 3.0, 2.8, 2.6], dtype=DT), _bulk(95, -1.0, 1.0, 5)]), seed=4)
    n = G.shape[0]
    M = torch.block_diag(G, G)
    v0 = torch.cat([torch.randn(n, generator=torch.Generator().manual_seed(6), dtype=DT), torch.zeros(n, dtype=DT)])
    blind = lanczos_eigs(M, k=5, tol=TOL, v0=v0, check=0, allow_unconverged=True)
    assert not blind.converged and bool((blind.residuals <= blind.bounds).all())  # pairs, not claimed extreme
    assert torch.allclose(blind.eigenvalues, torch.tensor([4.0, 3.5, 3.0, 2.8, 2.6], dtype=DT))
    res = lanczos_eigs(M, k=5, tol=TOL, v0=v0)
    _assert_extreme(res, M, 5, "LA")  # 4, 4, 3.5, 3.5, 3
    assert res.check_matvecs >= 2 * 10  # one check that found the copies, one that found nothing beyond


@pytest.mark.parametrize("seed", range(6))
def test_the_check_keeps_its_columns_with_the_smallest_basis(seed):
    """``ncv = k + 2·block_size`` (the smallest allowed) leaves room for only 2 more vectors in the
    iteration's basis; the check still runs its own ``check`` columns on the complement (its storage is
    ``k + check`` wide), so a multiplicity of 7 in the top 8 is found, never returned as fewer copies.
    So small a basis may also spend the budget taking the copies in one at a time: then it raises."""
    lam = torch.cat([torch.full((7,), 10.0, dtype=DT), _bulk(193, 0.0, 5.0, seed)])
    M = _matrix(lam, seed=seed)
    try:
        res = lanczos_eigs(M, k=8, tol=TOL, ncv=10, seed=seed, max_matvecs=3000)
    except NotConvergedError as e:
        assert not e.result.converged and e.result.matvecs <= 3000
        return
    _assert_extreme(res, M, 8, "LA")
    assert res.ncv == 10 and res.check_matvecs >= 10


def _twelve_decades(n: int):
    lam = torch.logspace(-8, 4, n, dtype=DT)
    Q, _ = torch.linalg.qr(torch.randn(n, n, generator=torch.Generator().manual_seed(0), dtype=DT))
    M = (Q * lam) @ Q.T
    return (M + M.T) / 2, Q


def test_twelve_decades_the_bottom_from_its_eigenvector_is_certified_by_spanning_the_complement():
    """Eigenvalues over twelve decades, the smallest asked for to ``1e-10`` of the scale from its exact
    eigenvector, ``n = 200``: the complement's smallest eigenvalue must be resolved to ``1e-6`` against a
    spread of ``1e4``; the check's basis, grown past ``ncv`` without restarts, certifies it before it spans
    the complement (at the latest it would, its Ritz values then the restriction's eigenvalues)."""
    M, Q = _twelve_decades(200)
    res = lanczos_eigs(M, k=1, which="SA", tol=1e-10, rel="scale", v0=Q[:, 0].clone())
    _assert_extreme(res, M, 1, "SA", tol=1e-10)
    assert res.miss_probability <= 1e-6 and res.check_matvecs < 199


def test_a_growing_check_asks_only_for_its_new_piece(monkeypatch):
    """The check of the twelve decades above grows its basis by pieces (the capacity doubles, nothing is
    copied): each growth's memory check asks for the new piece alone, ``n`` × the capacity so far, and the
    result is certified as there."""
    from blockhess.operators import estimators

    M, Q = _twelve_decades(200)
    asked = []
    real = estimators.check_fits

    def spy(nbytes, what, device="cpu"):
        asked.append((nbytes, what))
        return real(nbytes, what, device)

    monkeypatch.setattr(estimators, "check_fits", spy)
    res = lanczos_eigs(M, k=1, which="SA", tol=1e-10, rel="scale", v0=Q[:, 0].clone())
    grown = [b for b, w in asked if w.startswith("the check's Lanczos basis")]
    width = max(estimators.NCV_DEFAULT, 1 + estimators.CHECK_COLUMNS)
    assert len(grown) >= 1 and grown == [200 * width * 2**i * 8 for i in range(len(grown))]
    _assert_extreme(res, M, 1, "SA", tol=1e-10)


def test_long_float32_norms_and_inner_products_are_accumulated_in_float64():
    """Over 2^24 + 1 float32 entries (past ``DOT_ROWS``) the norms Lanczos divides by are within a few ε of
    float64's, and the inner products it projects by within their blocks' rounding: a float32 running sum of 2^24
    squares is off by about 1e-3."""
    from blockhess.operators import estimators

    g = torch.Generator().manual_seed(0)
    n = 2**24 + 1
    X = torch.randn(n, 2, generator=g, dtype=torch.float32)
    Xd = X.double()
    rel = lambda got, want: float(((got.double() - want) / want).abs().max())  # noqa: E731
    few = 8 * torch.finfo(torch.float32).eps  # within a few ε of float64's (4 ε the worst over 200 random cases)
    assert rel(estimators._norms(X), Xd.norm(dim=0)) < few
    assert rel(estimators._norms(X.T.contiguous(), 1), Xd.norm(dim=0)) < few
    assert rel(estimators._norms(X[: n - 5, :1]), Xd[: n - 5, :1].norm(dim=0)) < few
    m = estimators.DOT_ROWS + 1  # just past the blocked path's start: 16 blocks and a tail of one
    assert rel(estimators._norms(X[:m]), Xd[:m].norm(dim=0)) < few
    P = X[:m].T.contiguous()[:, :, None]  # (P, n, 1) over dim 1, as slq_density's reorthogonalised probes
    assert rel(estimators._norms(P, 1)[:, 0], Xd[:m].norm(dim=0)) < few
    assert abs(estimators._fro(X) / float(Xd.norm()) - 1) < 1e-6
    # inner products by blocks of DOT_ROWS rows: within _dots' stated √DOT_ROWS · ε of ‖x‖‖y‖ (sums of squares, no
    # cancellation, the hardest case; a block's rows are summed by the BLAS in float32, in an order of its own)
    bound = math.sqrt(estimators.DOT_ROWS) * torch.finfo(torch.float32).eps
    assert rel(estimators._dots(X, X).diagonal(), (Xd * Xd).sum(0)) < bound


def test_blocked_inner_products_and_rotation_give_the_same_eigenpairs(monkeypatch):
    """The blocked paths (inner products by blocks of rows, a restart's rotation in place by blocks), forced on
    with tiny blocks, give the unblocked run's eigenpairs in float64 to rounding, through restarts and the
    check; the rotation alone equals ``V[:, :m] @ Y`` exactly."""
    from blockhess.operators import estimators

    g = torch.Generator().manual_seed(1)
    V = torch.randn(9, 1000, generator=g, dtype=DT).T
    Y = torch.randn(9, 4, generator=g, dtype=DT)
    want = V @ Y
    monkeypatch.setattr(estimators, "ROTATE_ENTRIES", 50)
    estimators._rotate(V, 9, Y)
    assert torch.equal(V[:, :4], want)
    M = _matrix(torch.cat([torch.tensor([5.0, 4.0, 3.9], dtype=DT), _bulk(297, 0.0, 3.0, 7)]))
    plain = lanczos_eigs(M, k=3, tol=1e-10, ncv=12, seed=3)
    monkeypatch.setattr(estimators, "DOT_ROWS", 37)
    blocked = lanczos_eigs(M, k=3, tol=1e-10, ncv=12, seed=3)
    assert plain.restarts >= 1 and blocked.check_matvecs >= 1
    torch.testing.assert_close(blocked.eigenvalues, plain.eigenvalues, rtol=1e-12, atol=0)
    _assert_extreme(blocked, M, 3, "LA")


def test_twelve_decades_a_check_whose_bound_falls_too_slowly_stops_before_the_budget():
    """The same at ``n = 800``: the check's bound has not moved from 1 when its basis fills for the second
    time (119 products), and the complement is far from spanned: ``NotConvergedError`` a hundred-odd
    products in, naming the bound, instead of spending the budget of 5,000."""
    M, Q = _twelve_decades(800)
    with pytest.raises(NotConvergedError, match="could not rule out an eigenvalue .* fell too slowly") as err:
        lanczos_eigs(M, k=1, which="SA", tol=1e-10, rel="scale", v0=Q[:, 0].clone())
    assert err.value.result.matvecs < 1000 and not err.value.result.converged


def _spectrum_below(top: float, mid: float, cluster: float, copies: int = 20, n: int = 100) -> torch.Tensor:
    """``top``, then ``mid`` (where a warm start points), then ``copies`` of ``cluster``, then a bulk in [0, 0.8]."""
    return torch.cat([torch.tensor([top, mid] + [cluster] * copies, dtype=DT), _bulk(n - 2 - copies, 0.0, 0.8, 123)])


@pytest.mark.parametrize("top, cluster, tol", [(1.05, 0.9, 1e-4), (1.0001, 0.999, 1e-8)])
@pytest.mark.parametrize("seed", range(20))
def test_a_warm_start_at_a_non_extreme_eigenvector(top, cluster, tol, seed):
    """``v0`` the eigenvector of 1.0, the second largest; above it ``top``, below it 20 copies of ``cluster``.
    The start is orthogonal to the top eigenvector by construction, so only the check's own random start
    sees it: its Ritz value settling on the cluster (an eigenvalue on the found side) is no proof that nothing
    lies beyond, and returned 1.0 as converged on 4 of 20 seeds (1.05) and on 19 of 20 (1.0001, tol 1e-8).
    The check goes on until its miss bound is below ``failure_probability``: ``top`` is found."""
    M = _matrix(_spectrum_below(top, 1.0, cluster), seed=seed)
    v0 = torch.linalg.eigh(M).eigenvectors[:, -2].contiguous()
    res = lanczos_eigs(M, k=1, tol=tol, v0=v0, seed=seed)
    _assert_extreme(res, M, 1, "LA", tol=tol)
    assert res.miss_probability <= 1e-6


@pytest.mark.parametrize("seed", range(10))
def test_a_check_of_one_product_still_finds_a_multiplicity_above_k(seed):
    """A 4-fold top eigenvalue 3 over 1.5 and a bulk, ``k = 4``, ``check=1``: a check stopped after its first
    settled Ritz value returned ``[3, 3, 3, 1.5]`` as converged on every seed; ``check`` is the fewest
    products of the check, which then runs until its bound is met."""
    M = _matrix(torch.cat([torch.full((4,), 3.0, dtype=DT), torch.tensor([1.5], dtype=DT),
                           torch.linspace(0, 1, 95, dtype=DT)]), seed=seed)
    _assert_extreme(lanczos_eigs(M, k=4, check=1, tol=TOL, seed=seed), M, 4, "LA")


def test_the_miss_probability_reported():
    """With a check, a converged result's ``miss_probability`` is at most ``failure_probability``; without
    one (``check=0``) it is 1 and the result is not converged (nothing beyond the residuals is claimed); the
    dense path's is 0; a smaller
    ``failure_probability`` costs the check more products."""
    M = _matrix(torch.cat([torch.tensor([2.0, 1.9], dtype=DT), _bulk(300, -1.0, 1.5, 3)]), seed=4)
    loose = lanczos_eigs(M, k=2, tol=TOL, failure_probability=1e-2)
    tight = lanczos_eigs(M, k=2, tol=TOL, failure_probability=1e-12)
    assert loose.miss_probability <= 1e-2 and tight.miss_probability <= 1e-12
    assert tight.check_matvecs > loose.check_matvecs
    _assert_extreme(tight, M, 2, "LA")
    with pytest.raises(NotConvergedError, match="check=0: the residuals are met, but nothing rules out") as err:
        lanczos_eigs(M, k=2, tol=TOL, check=0)
    blind = err.value.result
    assert blind.miss_probability == 1.0 and not blind.converged and bool((blind.residuals <= blind.bounds).all())
    assert lanczos_eigs(M, k=2, tol=TOL, dense_below=400).miss_probability == 0.0


# ----------------------------------------------------------------------------- warm starts, the true residuals


def test_a_warm_start_from_near_eigenvectors_at_a_tighter_tolerance():
    """The eigenvectors at ``tol = 1e-4`` as the start of a run at ``7.8e-5`` with a block of 5."""
    top = 1 - 1e-3 * torch.arange(5, dtype=DT)
    M = _matrix(torch.cat([top, _bulk(300, -0.2, 0.97, 7)]), seed=5)
    first = lanczos_eigs(M, k=5, tol=1e-4)
    warm = lanczos_eigs(M, k=5, block_size=5, tol=7.8e-5, v0=first.eigenvectors)
    _assert_extreme(warm, M, 5, "LA", tol=7.8e-5)
    _assert_extreme(lanczos_eigs(M, k=5, block_size=5, tol=TOL, v0=first.eigenvectors), M, 5, "LA")


@pytest.mark.parametrize("k, block_size", [(1, 2), (2, 3), (1, 4)])
def test_a_start_block_holding_exact_eigenvectors_stops_after_its_first_block(k, block_size):
    """``v0`` the top ``k`` eigenvectors, completed to the block by random columns: the first block's Ritz
    pairs are eigenpairs to rounding, and the recurrence's estimates ``‖W y_b‖`` must say so, although ``W``
    is then nearly of rank ``block_size − k`` with ``y_b`` along its null directions (a cancellation that
    ``y_bᵀ (WᵀW) y_b`` resolves only to about ``√ε ‖W‖``, above the bounds ``1e-10 |λ|``)."""
    lam = torch.cat([torch.tensor([10.0, 9.0, 8.0], dtype=DT), _bulk(300, 0.0, 5.0, 12)])
    M = _matrix(lam, seed=9)
    v0 = torch.linalg.eigh(M).eigenvectors[:, -k:].flip(1).contiguous()
    for seed in range(4):  # the random columns
        res = lanczos_eigs(M, k=k, block_size=block_size, tol=TOL, v0=v0, seed=seed)
        _assert_extreme(res, M, k, "LA")
        # one block, its residual product, the check
        assert res.iterations == 1 and res.matvecs == block_size + k + res.check_matvecs


class _Drifting:
    """``M + E`` until the first product of ``k`` columns (the first true-residual product), ``M`` from then
    on: the first run converges on ``M + E``, and its residuals against ``M`` miss the bounds."""

    def __init__(self, M, E, k):
        self.M, self.E, self.k, self.exact = M, E, k, False
        self.shape, self.dtype, self.device = M.shape, M.dtype, M.device

    def __matmul__(self, X):
        self.exact = self.exact or X.shape[1] == self.k
        return (self.M if self.exact else self.M + self.E) @ X


def test_a_run_whose_true_residuals_miss_goes_on_from_its_ritz_vectors():
    lam = torch.cat([torch.tensor([3.0, 2.0, 1.5], dtype=DT), _bulk(200, -1.0, 1.0, 8)])
    M = _matrix(lam, seed=6)
    E = torch.randn(M.shape, generator=torch.Generator().manual_seed(9), dtype=DT)
    op = _Drifting(M, 1e-6 * (E + E.T), k=3)
    res = lanczos_eigs(op, k=3, tol=TOL)
    assert op.exact and res.restarts >= 1  # the first run's residual product (k columns) found the miss
    _assert_extreme(res, M, 3, "LA")


# ----------------------------------------------------------------------------- the budget


def test_residuals_that_stop_improving_end_the_run_before_the_budget():
    """``S + δK`` with ``K`` antisymmetric: no pair of the symmetric method gets its residual below about ``δ‖K‖``
    (above the bounds ``1e-10 |λ|``); after two residual products without progress the run stops."""
    n = 80
    lam = torch.cat([torch.tensor([3.0, 2.0, 1.5], dtype=DT), _bulk(n - 3, -1.0, 1.0, 11)])
    K = torch.randn(n, n, generator=torch.Generator().manual_seed(12), dtype=DT)
    M = _matrix(lam, seed=8) + 1e-9 * (K - K.T)
    with pytest.raises(ValueError, match="lanczos_eigs assumes a symmetric operator"):  # a dense tensor is checked
        lanczos_eigs(M, k=3, tol=TOL)

    class Foreign:  # an operator without SELF_ADJOINT is taken as symmetric: the stall must still end the run
        shape, dtype, device = M.shape, M.dtype, M.device

        def __matmul__(self, X):
            return M @ X

    with pytest.raises(NotConvergedError, match="stopped improving") as err:
        lanczos_eigs(Foreign(), k=3, tol=TOL)
    assert err.value.result.matvecs < 5000 // 10  # well inside the default budget: the stall, not the budget, ended it


def test_too_small_a_budget_raises():
    lam = torch.cat([torch.tensor([3.0, 2.9, 2.8], dtype=DT), _bulk(200, -1.0, 2.7, 10)])
    M = _matrix(lam, seed=7)
    with pytest.raises(NotConvergedError, match="residual / bound .* > 1; the budget max_matvecs=25 is spent") as err:
        lanczos_eigs(M, k=3, tol=TOL, max_matvecs=25)
    assert not err.value.result.converged and err.value.result.matvecs <= 25
    with pytest.raises(NotConvergedError, match="the budget max_matvecs=5 ran out with [0-2] Ritz values for k = 3"):
        lanczos_eigs(M, k=3, tol=TOL, max_matvecs=5)  # too few products for k Ritz values: the budget, not rounding
    full = lanczos_eigs(M, k=3, tol=TOL)
    with pytest.raises(NotConvergedError, match="no room for the check") as err:
        lanczos_eigs(M, k=3, tol=TOL, max_matvecs=full.matvecs - full.check_matvecs)
    assert bool((err.value.result.residuals <= err.value.result.bounds).all())  # met, but unchecked: not converged
    res = lanczos_eigs(M, k=3, tol=TOL, max_matvecs=25, allow_unconverged=True)
    assert not res.converged and bool((res.residuals > res.bounds).any())


@pytest.mark.parametrize("kwargs, match", [({"rel": "max"}, "rel"), ({"check": -1}, "check"),
                                           ({"failure_probability": 0}, "failure_probability"),
                                           ({"failure_probability": 1.0}, "failure_probability"),
                                           ({"failure_probability": True}, "failure_probability"),
                                           ({"allow_unconverged": 1}, "allow_unconverged")])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        lanczos_eigs(torch.eye(40, dtype=DT), k=2, **kwargs)


# ----------------------------------------------------------------------------- a block's Hessian operator


@pytest.mark.parametrize("which", ["LA", "SA"])
def test_a_block_hessian_operator_against_the_dense_hessian(which):
    """``bh.hessian_operator``'s matrix-free products against the dense closed form ``bh.hessian``."""
    cfg = bh.BlockConfig(d_model=4, d_ff=6, n_heads=2, bias=True, ln_affine=True, ln_eps=1e-5)
    g = torch.Generator().manual_seed(1)
    params = bh.init_params(cfg, seed=1)
    X = torch.randn(2, 5, 4, generator=g, dtype=DT)
    T = torch.randn(2, 5, 4, generator=g, dtype=DT)
    A = bh.hessian_operator(params, X, cfg, loss="mse", target=T)
    dense = HessianOperator.from_dense(bh.hessian(params, X, cfg, loss="mse", target=T))
    _assert_extreme(lanczos_eigs(A, k=4, which=which, tol=TOL), dense.dense(), 4, which)
    _assert_extreme(lanczos_eigs(A["W_1", "W_1"], k=3, which=which, tol=TOL), dense["W_1", "W_1"].dense(), 3, which)


@pytest.mark.parametrize("seed", range(3))
def test_the_bottom_of_a_gauss_newton_part_with_its_null_space(seed):
    """``part="outer"`` of a pre-LN block under CE has rank at most B·L·(C−1) = 75 of n = 328: 253 zero
    eigenvalues. A single-vector Krylov space sees one of them; the next smallest (about 1e-4 of the
    spread) have true residuals, and ten fixed check steps do not resolve that gap. The check runs on
    until its Ritz value settles, and takes the zeros in."""
    cfg = bh.BlockConfig(d_model=6, d_ff=10, n_heads=2, norm="pre", bias=True, out_proj=True, ln_affine=True,
                         ln_eps=1e-5, activation="gelu", causal=True)
    params = bh.init_params(cfg, seed=3)
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(3, 5, 6, dtype=DT, generator=g)
    y = torch.randint(0, 6, (3, 5), generator=g)
    A = bh.hessian_operator(params, X, cfg, loss="ce", target=y, part="outer")
    M = bh.hessian(params, X, cfg, loss="ce", target=y).outer.dense()
    assert int((torch.linalg.eigvalsh(M).abs() < 1e-10).sum()) == 253
    res = lanczos_eigs(A, k=3, which="SA", tol=1e-8)
    _assert_extreme(res, M, 3, "SA", tol=1e-8)
    assert res.check_matvecs > 10


@pytest.mark.parametrize("which", ["LA", "SA", "LM"])
@pytest.mark.parametrize("n, k, block_size", [(8, 1, 2), (8, 3, 2), (8, 3, 4), (12, 3, 4)])
def test_a_check_that_spans_the_whole_complement(n, k, block_size, which):
    """``n < k + check``: the check's basis reaches every dimension of the found vectors' complement and
    stops there, its Ritz values the restriction's eigenvalues. A block wider than the dimensions left
    would be completed by rounding, not orthogonal to the basis: Ritz values outside the spectrum."""
    M = _matrix(torch.linspace(-1, 1, n, dtype=DT) + 0.1, seed=n)
    lam = torch.linalg.eigvalsh(M)
    res = lanczos_eigs(M, k=k, which=which, tol=TOL, block_size=block_size)
    _assert_extreme(res, M, k, which)
    assert float(lam[0]) - n * EPS <= res.check_value <= float(lam[-1]) + n * EPS  # a Rayleigh quotient


@pytest.mark.parametrize("seed", range(4))
def test_for_the_largest_magnitude_the_check_watches_both_ends(seed):
    """``which="LM"`` from a warm start at the 9.9 eigenvector, the largest magnitude −10 at the edge of a
    bulk in [−10, 0] (its Ritz values move in slowly): the check's positive end (9.7, isolated) settles
    within a few products while its negative end is still below 9.9 in magnitude and moving. The check
    goes on until both ends have settled or one beats: −10 is found."""
    lam = torch.cat([torch.tensor([9.9, 9.7], dtype=DT), torch.linspace(-10, 0, 98, dtype=DT)])
    M = _matrix(lam, seed=100)
    v0 = torch.linalg.eigh(M).eigenvectors[:, -1:].contiguous()
    _assert_extreme(lanczos_eigs(M, k=1, which="LM", tol=TOL, block_size=2, seed=seed, v0=v0), M, 1, "LM")


# ----------------------------------------------------------------------------- any spectrum


@st.composite
def spectra(draw, most: int = 4):
    """Distinct values 0.04 apart in [-2, 2], each 1 to ``most`` times, over a bulk in [-0.3, 0.3] with ``n``
    above the default basis of 60; and a seed for the eigenvectors."""
    values = draw(st.lists(st.integers(-50, 50), min_size=3, max_size=12, unique=True))
    mult = draw(st.lists(st.integers(1, most), min_size=len(values), max_size=len(values)))
    n = draw(st.integers(70, 140))
    top = torch.tensor([v / 25 for v, c in zip(values, mult) for _ in range(c)], dtype=DT)
    return torch.cat([top, _bulk(n, -0.3, 0.3, draw(st.integers(0, 2**16)))]), draw(st.integers(0, 2**16))


@given(st.integers(1, 3).flatmap(lambda p: st.tuples(st.just(p), spectra(most=p))), st.integers(1, 6),
       st.sampled_from(["LA", "SA", "LM"]))
def test_any_spectrum_with_multiplicities_up_to_the_block_size(case, k, which):
    """A start block of ``p`` random columns has components along every copy of an eigenvalue of multiplicity
    at most ``p`` (with probability one): the extreme ``k`` are found."""
    p, (lam, seed) = case
    M = _matrix(lam, seed=seed)
    _assert_extreme(lanczos_eigs(M, k=k, which=which, tol=TOL, block_size=p, seed=seed % 97), M, k, which)


@st.composite
def adversarial(draw):
    """A spectrum family the check must not be fooled by, and the run's settings: a top value with a cluster
    just below the found one (gaps from 1e-6 to 0.1 of the spread), a multiplicity above ``k`` (up to 8
    copies), twelve decades, or both signs at the ends; mirrored for ``"SA"``; a cold start, a warm start at
    a non-extreme eigenvector or at the wanted ones; ``check`` from 1 to 10."""
    n = draw(st.integers(60, 140))
    family = draw(st.sampled_from(["cluster-below", "multiplicity", "decades", "both-signs"]))
    bulk = _bulk(n, 0.0, 0.8, draw(st.integers(0, 2**16)))
    if family == "cluster-below":
        gap = 10.0 ** draw(st.integers(-6, -1))
        lam = torch.cat([torch.tensor([1.0 + gap, 1.0] + [1.0 - gap] * draw(st.integers(1, 20)), dtype=DT), bulk])
    elif family == "multiplicity":
        lam = torch.cat([torch.full((draw(st.integers(2, 8)),), 2.0, dtype=DT), torch.tensor([1.5], dtype=DT), bulk])
    elif family == "decades":
        lam = torch.logspace(-8, 4, n, dtype=DT)
    else:
        lam = torch.cat([torch.tensor([1.2, -1.2 - 10.0 ** draw(st.integers(-6, -1)), 1.1], dtype=DT), 2 * bulk - 0.8])
    which = draw(st.sampled_from(["LA", "SA", "LM"]))
    if which == "SA":
        lam = -lam
    start = draw(st.sampled_from(["cold", "non-extreme", "wanted"]))
    return lam, which, start, draw(st.integers(1, 6)), draw(st.integers(1, 10)), draw(st.integers(0, 2**16))


@given(adversarial())
def test_adversarial_spectra_are_found_or_refused(case):
    """Over the families above, a converged result holds the extreme ``k`` (each value within its residual
    bound of its place in the sorted spectrum), whatever the start; ``NotConvergedError`` is the only other
    outcome. Before the miss bound, warm starts at a non-extreme eigenvector and one-product checks returned
    wrong values marked converged."""
    lam, which, start, k, check, seed = case
    M = _matrix(lam, seed=seed)
    k = min(k, lam.numel())
    v0 = None
    if start != "cold":
        vals, vecs = torch.linalg.eigh(M)
        order = _order_of(vals, which)
        v0 = vecs[:, order[k : k + 1]] if start == "non-extreme" else vecs[:, order[:k]]
        v0 = v0.contiguous()
    try:
        res = lanczos_eigs(M, k=k, which=which, tol=TOL, check=check, seed=seed % 97, v0=v0)
    except NotConvergedError as e:
        assert not e.result.converged
        return
    _assert_extreme(res, M, k, which)
    assert res.miss_probability <= 1e-6


def _order_of(vals: torch.Tensor, which: str) -> torch.Tensor:
    return {"LA": vals.argsort(descending=True), "SA": vals.argsort(),
            "LM": vals.abs().argsort(descending=True, stable=True)}[which]


# ----------------------------------------------------------------------------- a Kronecker view


def _pre_ln_case(loss: str = "mse", norm: str = "pre"):
    cfg = bh.BlockConfig(d_model=6, d_ff=10, n_heads=2, norm=norm, bias=True, ln_affine=True, ln_eps=1e-5)
    p = bh.init_params(cfg, seed=3)
    g = torch.Generator().manual_seed(4)
    X = torch.randn(3, 5, 6, generator=g, dtype=DT)
    T = torch.randint(0, 6, (3, 5), generator=g) if loss == "ce" else torch.randn(3, 5, 6, generator=g, dtype=DT)
    return cfg, p, X, T


@pytest.mark.parametrize("part", ["full", "outer"])
@pytest.mark.parametrize("k", [3, 6, 9])
def test_a_kronecker_view_has_its_spectrum_from_the_factors(part, k):
    """A pre-LN block's ``W_2`` under MSE is ``(2/BLd) Σ hᵀh ⊗ I_6`` exactly: ``lanczos_eigs`` takes its
    pairs from the ``10 × 10`` factor, each value 6 times (``k = 9``: the top value's 6 copies, then 3 of
    the next), against the dense Hessian's eigenvalues, with true residuals at rounding."""
    cfg, p, X, T = _pre_ln_case()
    A = bh.hessian_operator(p, X, cfg, loss="mse", target=T, part=part)
    view = A["W_2", "W_2"]
    M, d = view.kronecker_factors()
    assert d == 6 and M.shape == (10, 10)
    H = bh.hessian(p, X, cfg, loss="mse", target=T, wrt=["W_2"])
    D = (H if part == "full" else H.outer)["W_2", "W_2"]
    assert torch.allclose(torch.kron(M, torch.eye(6, dtype=DT)), D, rtol=0, atol=1e-14 * float(D.abs().max()))
    res = lanczos_eigs(view, k=k, tol=TOL)
    assert res.method == "kronecker" and res.matvecs == k and res.miss_probability == 0.0 and res.multiplicity == 6
    _assert_extreme(res, D, k, "LA")
    dense_mult = int((torch.linalg.eigvalsh(D) - res.eigenvalues[0]).abs().le(1e-12 * float(D.abs().max())).sum())
    assert dense_mult == res.multiplicity  # M's top value is simple here: A's is exactly d
    mu = torch.linalg.eigvalsh(M).flip(0)
    top, lam = min(k, 6), res.eigenvalues
    assert torch.equal(lam[:top], lam[0].expand(top)) and torch.equal(lam[top:], lam[-1].expand(k - top))  # exact copies
    assert torch.allclose(lam, torch.cat([mu[0].expand(top), mu[1].expand(k - top)]), rtol=1e-13, atol=0)


@pytest.mark.parametrize("case", ["post-LN", "ce", "functional", "W_1", "W_2 and b_2"])
def test_no_kronecker_factors_where_the_closed_form_has_none(case):
    """The rule holds only where ``Z`` is affine in ``W_2`` with nothing after it and the loss Hessian is a
    multiple of the identity: post-LN (LN_2 after ``W_2``), CE, the functional part (zero there), another
    weight, a view of ``W_2`` with ``b_2`` (``b_2``'s rows are not ``⊗ I`` of the same factor) — none, and
    ``lanczos_eigs`` runs Lanczos."""
    cfg, p, X, T = _pre_ln_case("ce" if case == "ce" else "mse", "post" if case == "post-LN" else "pre")
    A = bh.hessian_operator(p, X, cfg, loss="ce" if case == "ce" else "mse", target=T,
                            part="functional" if case == "functional" else "full")
    view = {"W_1": A["W_1", "W_1"], "W_2 and b_2": A[("W_2", "b_2"), ("W_2", "b_2")]}.get(case, A["W_2", "W_2"])
    assert view.kronecker_factors() is None
    res = lanczos_eigs(view, k=2, tol=1e-8)
    assert res.method == "lanczos" and res.multiplicity is None


@pytest.mark.parametrize("dtype, scale", [(torch.float64, 1e-200), (torch.float64, 1e-300), (torch.float64, 1e300),
                                          (torch.float32, 1e-25), (torch.float32, 1e30)])
def test_an_operator_at_the_edge_of_the_dtype(dtype, scale):
    """``scale · M``: squared norms of its products would underflow (``1e-200`` in float64, ``1e-25`` in float32)
    or overflow, and a zero residual certified a wrong value. The iteration runs on the operator scaled by a
    power of two (exact) and scales the result back: the eigenvalues are ``scale`` times ``M``'s."""
    lam = torch.cat([torch.tensor([3.0, 2.0], dtype=DT), _bulk(38, -1.0, 1.0, 21)])
    M = _matrix(lam, seed=22)
    A = (M * scale).to(dtype)
    res = lanczos_eigs(A, k=2, tol=1e-5 if dtype == torch.float32 else 1e-10)
    want = torch.tensor([3.0, 2.0], dtype=DT) * scale
    assert res.converged and torch.allclose(res.eigenvalues.double(), want, rtol=1e-4 if dtype == torch.float32 else 1e-9)
    assert bool((res.residuals <= res.bounds).all()) and bool((res.residuals > 0).any())
    assert res.scale == pytest.approx(3.0 * scale, rel=1e-4)


# ----------------------------------------------------------------------------- several checks, the runs kept as probes


def test_several_checks_multiply_their_bounds_by_the_gamma_tail():
    """``check_runs`` independent checks certify together where the product of their bounds is at most the
    level whose tail under a product of uniforms is ``failure_probability``: the tail formula against
    sampling, the level against the tail, one run the old rule."""
    tail, level = estimators._product_tail, estimators._product_level
    assert tail(1e-3, 1) == 1e-3 and level(1e-6, 1) == 1e-6 and tail(1.5, 3) == 1.0 and tail(0.0, 3) == 0.0
    for r in (2, 3, 5):
        lv = level(1e-6, r)
        assert lv < 1e-6 and tail(lv, r) <= 1e-6 and tail(lv * (1 + 1e-9), r) > 1e-6 * (1 - 1e-6)
    U = torch.rand(400_000, 3, generator=torch.Generator().manual_seed(0), dtype=DT).prod(1)
    for d in (1e-3, 1e-2, 0.1):
        p, t = float((U <= d).double().mean()), tail(d, 3)
        assert abs(p - t) <= 5 * math.sqrt(t * (1 - t) / U.numel()), (d, p, t)


def test_the_first_run_is_kept_as_the_probe_of_its_start():
    """The first run from a random start, up to its first restart, is the Lanczos run of that start (the
    solver's first Gaussian draw): its projected matrix equals the one a plain Lanczos with full
    reorthogonalisation builds from the same start, in ``A``'s scale (the operator is scaled by a power of
    two inside); a warm start or a wider block keeps no such run."""
    M = _matrix(torch.cat([torch.tensor([3.0, 2.9, 2.8], dtype=DT), _bulk(297, -1.0, 2.0, 2)]), seed=3) * 2.0**40
    n, m = M.shape[0], 24
    res = lanczos_eigs(M, k=3, tol=TOL, ncv=m, seed=7)
    main = res.probes[0]
    assert res.restarts > 0 and main.steps == m and main.deflated.numel() == 0 and main.n == n
    q = estimators._gaussian(estimators._generator(7), (n, 1), M)[:, 0]
    Q = torch.zeros(n, m, dtype=DT)
    Q[:, 0] = q / q.norm()
    for j in range(1, m):
        w = M @ Q[:, j - 1]
        for _ in range(2):
            w = w - Q[:, :j] @ (Q[:, :j].T @ w)
        Q[:, j] = w / w.norm()
    T = Q.T @ M @ Q
    assert float((main.T - T).norm() / T.norm()) < 1e-10
    nodes, weights, _, _ = main.rule(m)
    for j in range(4):  # the Gauss rule of the start's measure: its moments
        moment = float(q @ torch.linalg.matrix_power(M / 2.0**40, j) @ q / (q @ q))
        assert abs(float((weights * (nodes / 2.0**40) ** j).sum()) - moment) < 1e-10 * max(1.0, abs(moment))
    assert all(p.deflated.numel() for p in lanczos_eigs(M, k=3, tol=TOL, ncv=m, v0=q).probes)
    assert all(p.deflated.numel() for p in lanczos_eigs(M, k=3, tol=TOL, ncv=m, block_size=2).probes)


def test_several_checks_are_kept_as_probes_of_the_complement():
    """``check_runs=3``: three checks of at least ``check`` products each, the miss bound at most
    ``failure_probability``, each kept as a run on the complement of the found vectors (their values its
    ``deflated``); its Ritz values lie in the complement's spectrum, below the found ones."""
    lam = torch.cat([torch.tensor([5.0, 4.0, 3.5], dtype=DT), _bulk(397, -1.0, 2.0, 4)])
    M = _matrix(lam, seed=5)
    res = lanczos_eigs(M, k=3, tol=TOL, check=20, check_runs=3, ncv=40)
    _assert_extreme(res, M, 3, "LA")
    assert res.miss_probability <= 1e-6 and res.check_matvecs >= 60
    checks = [p for p in res.probes if p.deflated.numel()]
    assert len(checks) == 3 and len(res.probes) == 4
    for p in checks:
        assert p.steps >= 20 and torch.equal(p.deflated, res.eigenvalues)
        ritz = torch.linalg.eigvalsh(p.T)
        assert float(ritz.max()) <= 2.0 + 1e-8 and float(ritz.min()) >= -1.0 - 1e-8
        nodes, weights, _, _ = p.rule(20)
        assert abs(float(weights.sum()) - 1) < 1e-12 and bool((weights[:3] == 1 / 400).all())
    one = lanczos_eigs(M, k=3, tol=TOL, check=20)
    assert one.miss_probability <= 1e-6 and len([p for p in one.probes if p.deflated.numel()]) == 1


def test_the_kept_probes_average_to_the_spectral_measure():
    """Over seeds, the density from the kept runs alone (no new product) integrates ``x`` and ``x²`` to
    ``tr A / n`` and ``tr A² / n`` within sampling error; the checks' rules without the found values'
    weight would miss the first by far (the test sees that weight)."""
    lam = torch.cat([torch.tensor([20.0, 15.0, 12.0], dtype=DT), _bulk(77, -1.0, 1.0, 6)])
    M = _matrix(lam, seed=8)
    first, second, blind = [], [], []
    for seed in range(150):
        res = lanczos_eigs(M, k=3, tol=1e-10, ncv=20, check=8, check_runs=2, seed=seed)
        S = slq_density(M, n_probes=3, n_iter=8, probes=res.probes)
        assert S.matvecs == 0 and S.n_probes == 3
        first.append(S.integral(lambda x: x).value)
        second.append(S.integral(lambda x: x * x).value)
        for p in res.probes[1:]:
            nodes, w, _, _ = p.rule(8)
            blind.append(float((w[3:] * nodes[3:]).sum() / w[3:].sum()))
    for got, exact in ((first, float(lam.mean())), (second, float((lam**2).mean()))):
        g = torch.tensor(got, dtype=DT)
        assert abs(float(g.mean()) - exact) <= 4 * float(g.std()) / math.sqrt(g.numel()), (float(g.mean()), exact)
    b = torch.tensor(blind, dtype=DT)
    assert abs(float(b.mean()) - float(lam.mean())) > 8 * float(b.std()) / math.sqrt(b.numel())


def test_slq_takes_the_kept_runs_long_enough_and_draws_the_rest():
    """Runs shorter than ``n_iter`` are not used (the probes are drawn and multiplied instead); more runs
    than ``n_probes``: the first ones; bad ``probes`` are refused by name."""
    M = _matrix(torch.cat([torch.tensor([3.0, 2.5], dtype=DT), _bulk(118, -1.0, 1.0, 9)]), seed=9)
    res = lanczos_eigs(M, k=2, tol=1e-10, ncv=30, check=10, check_runs=3)
    assert len(res.probes) == 4 and min(p.steps for p in res.probes) >= 10
    assert slq_density(M, n_probes=2, n_iter=10, probes=res.probes).matvecs == 0
    assert slq_density(M, n_probes=6, n_iter=10, probes=res.probes).matvecs == 2 * 10
    long = max(p.steps for p in res.probes) + 1
    assert slq_density(M, n_probes=2, n_iter=long, probes=res.probes).matvecs == 2 * long
    with pytest.raises(ValueError, match="probes must be a sequence of KrylovProbe"):
        slq_density(M, n_probes=2, n_iter=10, probes=res.probes[0])
    with pytest.raises(ValueError, match="probes must be a sequence of KrylovProbe"):
        slq_density(M, n_probes=2, n_iter=10, probes=[res.eigenvectors])
    with pytest.raises(ValueError, match=r"probes must be runs on an operator of dimension n = 60"):
        slq_density(M[:60, :60], n_probes=2, n_iter=10, probes=res.probes)
    with pytest.raises(ValueError, match="check_runs must be"):
        lanczos_eigs(M, k=2, check_runs=0)


def test_the_last_columns_first_then_one_pass_over_the_basis(monkeypatch):
    """``_project_out(B, W, recent)``: the same projection and coefficients as without ``recent`` (float64,
    a basis in two pieces), and where ``W`` lies mostly along the last two columns (a Lanczos product) one
    pass over the whole basis instead of two; with ``out`` the same numbers, computed in that tensor."""
    g = torch.Generator().manual_seed(3)
    Q = torch.linalg.qr(torch.randn(500, 30, generator=g, dtype=DT))[0]
    pieces = [Q[:, :20], Q[:, 20:]]
    W = 3.0 * Q[:, -1:] + 2.0 * Q[:, -2:-1] + 1e-3 * torch.randn(500, 1, generator=g, dtype=DT)
    calls = []
    dots = estimators._dots
    monkeypatch.setattr(estimators, "_dots", lambda B, X: calls.append(B.shape[1]) or dots(B, X))
    plain, C, _ = estimators._project_out(pieces, W)
    passes_plain = calls.count(20)
    calls.clear()
    first, C2, _ = estimators._project_out(pieces, W, 2)
    assert calls.count(20) == 1 < passes_plain == 2
    assert float((first - plain).norm() / plain.norm()) < 1e-12 and float((C2 - C).norm() / C.norm()) < 1e-12
    assert float((Q.T @ first).abs().max()) < 1e-15
    work, before = torch.empty_like(W), W.clone()
    inplace, C3, _ = estimators._project_out(pieces, W, 2, work)  # in the caller's work space, W untouched
    assert inplace.data_ptr() == work.data_ptr() and torch.equal(W, before)
    assert torch.equal(inplace, first) and torch.equal(C3, C2)


def test_several_checks_cut_short_by_the_budget_are_not_converged():
    """A budget that runs out before the third check has certified: ``NotConvergedError`` naming the
    check, the result holding the bound of the runs made (a run not made counts as 1), above
    ``failure_probability``, and no more products than the budget."""
    M = _matrix(torch.cat([torch.tensor([3.0, 2.5], dtype=DT), _bulk(298, -1.0, 2.0, 11)]), seed=12)
    full = lanczos_eigs(M, k=2, tol=1e-8, check=10, check_runs=3)
    assert full.converged and full.miss_probability <= 1e-6
    budget = full.matvecs - 1
    with pytest.raises(NotConvergedError, match="check") as err:
        lanczos_eigs(M, k=2, tol=1e-8, check=10, check_runs=3, max_matvecs=budget)
    cut = err.value.result
    assert 1e-6 < cut.miss_probability <= 1.0 and cut.matvecs <= budget and not cut.converged
    assert not [p for p in cut.probes if p.deflated.numel()]  # no check kept from an uncertified round
