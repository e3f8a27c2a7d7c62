"""The matrix-free operator's bookkeeping and the estimators, on dense Hessians of small blocks
(``bh.hessian``, float64, through ``HessianOperator.from_dense``) and on symmetric matrices of known
spectrum.

Products, views and the dense and diagonal forms are the same matrix products as the dense
Hessian's, so they agree to rounding (``<= 1e-12`` relative: ``n ε`` for sums of ``n <= 300``
terms). Eigenvalues are judged by their residuals: a unit ``v`` with ``‖Av − λv‖ = r`` has an
eigenvalue of symmetric ``A`` within ``r`` (Weyl), so ``tol = 1e-10`` relative residuals give the
eigenvalues to ``1e-10 ‖A‖``. Random estimates are judged by their own stated standard errors over
several seeds (at most ``Z_MAX`` standard errors each, and their z-scores' root mean square near 1),
with at least 14 samples behind each standard error (a sample standard deviation of fewer
understates a skewed distribution's).
"""

from __future__ import annotations

import dataclasses
import math
import os

import numpy as np
import pytest
import torch

import blockhess as bh
from blockhess.linalg import eigvalsh, rel_error
from blockhess.operators import (HessianOperator, NotConvergedError, diagonal, frobenius_norm, hutchinson_diagonal,
                                 hutchpp_trace, lanczos_eigs, mean_operator, per_block, slq_density)

DT = torch.float64
EXACT = 1e-12  # the same products in another order: rounding of sums of at most a few hundred terms
Z_MAX = 4.5  # a Gaussian beyond 4.5 standard deviations: probability 7e-6 per check
SEEDS = range(12)
#: the device of the CUDA test; BLOCKHESS_TEST_DEVICE=cpu runs it CPU against CPU (to check the test itself)
DEVICE = os.environ.get("BLOCKHESS_TEST_DEVICE", "cuda")


def _block(n_heads=2, B=2, L=3, seed=0):
    cfg = bh.BlockConfig(d_model=4, d_ff=5, n_heads=n_heads, bias=True, ln_affine=True, ln_eps=1e-5)
    g = torch.Generator().manual_seed(seed)
    params = bh.init_params(cfg, seed=seed)
    X = torch.randn(B, L, 4, generator=g, dtype=DT)
    T = torch.randn(B, L, 4, generator=g, dtype=DT)
    return cfg, params, X, T


@pytest.fixture(scope="module")
def hess():
    cfg, params, X, T = _block()
    return bh.hessian(params, X, cfg, loss="mse", target=T)


@pytest.fixture(scope="module")
def op(hess):
    return HessianOperator.from_dense(hess)


def _known(n=240, top=(6.0, 5.0, 4.0, 3.0, 2.5), bottom=(-3.5, -2.0), seed=0):
    """A symmetric ``(n, n)`` matrix with eigenvalues ``top``, ``bottom`` (no two of one magnitude: "LM" is
    then one set) and a bulk in ``[-1, 1]``,
    random eigenvectors; and its eigenvalues (ascending)."""
    g = torch.Generator().manual_seed(seed)
    bulk = torch.rand(n - len(top) - len(bottom), generator=g, dtype=DT) * 2 - 1
    lam = torch.cat([bulk, torch.tensor(top + bottom, dtype=DT)]).sort().values
    Q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=DT))
    M = (Q * lam) @ Q.T
    return (M + M.T) / 2, lam


def _index(op, var):
    """Flat indices of variable ``var`` (a parameter or a head's column group) in ``op``'s vector."""
    param, ref, idx = op._vars[var]
    off = sum(s for n, s in zip(op.params, [math.prod(op.param_shapes[p]) for p in op.params])
              if op.params.index(n) < op.params.index(param))
    return off + torch.arange(math.prod(ref)).reshape(ref)[idx].reshape(-1)


def _rows(op, names):
    return torch.cat([_index(op, n) for n in names])


# ----------------------------------------------------------------------------- the operator


def test_products_are_the_dense_hessians(op, hess):
    H = hess.dense()
    n = H.shape[0]
    assert op.shape == (n, n) and op.names == hess.names and op.sizes == hess.sizes and op.dtype == DT
    assert op.shapes == hess.shapes and op.device == torch.device("cpu") and op.T is op and op.adjoint() is op
    g = torch.Generator().manual_seed(1)
    V = torch.randn(n, 7, generator=g, dtype=DT)
    assert rel_error(op @ V, H @ V) <= EXACT
    assert rel_error(op @ V[:, 0], H @ V[:, 0]) <= EXACT
    assert (op @ V[:, :0]).shape == (n, 0)
    out = op @ V.numpy()
    assert isinstance(out, np.ndarray) and rel_error(torch.from_numpy(out), H @ V) <= EXACT
    assert rel_error(op.dense(), H) <= EXACT


def test_tensor_lists_as_curvlinops_passes_them(op, hess):
    H = hess.dense()
    g = torch.Generator().manual_seed(2)
    V = torch.randn(H.shape[0], 3, generator=g, dtype=DT)
    parts = list(V.split(list(op.sizes)))
    as_list = [p.reshape(*op.shapes[n], 3) for p, n in zip(parts, op.names)]
    got = op @ as_list
    assert [tuple(t.shape) for t in got] == [(*op.shapes[n], 3) for n in op.names]
    assert rel_error(torch.cat([t.reshape(-1, 3) for t in got]), H @ V) <= EXACT
    got1 = op @ [p[:, 0].reshape(op.shapes[n]) for p, n in zip(parts, op.names)]
    assert rel_error(torch.cat([t.reshape(-1) for t in got1]), H @ V[:, 0]) <= EXACT


@pytest.mark.parametrize("rows, cols", [("W_Q", "W_K"), ("W_1", "W_1"), (("W_V", "b_1"), ("W_Q", "gamma_2", "W_2")),
                                        ("W_Q#0", "W_K#1"), ("W_V#1", "W_V#1"), (("W_Q#1", "W_1"), "W_Q#0"),
                                        ("b_Q#0", ("W_K", "W_V#0"))])
def test_views_are_the_dense_sub_blocks(op, hess, rows, cols):
    H = hess.dense()
    A = op[rows, cols]
    r = _rows(op, (rows,) if isinstance(rows, str) else rows)
    c = _rows(op, (cols,) if isinstance(cols, str) else cols)
    assert A.shape == (r.numel(), c.numel())
    g = torch.Generator().manual_seed(3)
    V = torch.randn(c.numel(), 4, generator=g, dtype=DT)
    assert rel_error(A @ V, H[r][:, c] @ V) <= EXACT
    assert rel_error(A.dense(), H[r][:, c]) <= EXACT
    W = torch.randn(r.numel(), 2, generator=g, dtype=DT)
    assert A.T.shape == (c.numel(), r.numel()) and rel_error(A.T @ W, H[c][:, r] @ W) <= EXACT
    assert (A.T is A) == (A.names == A.in_names)


def test_a_view_asks_the_engine_only_for_what_it_needs(op, hess):
    calls = []
    H = HessianOperator.from_dense(hess)

    def spy(V, wanted_out):
        calls.append((set(V), wanted_out))
        return H._product(V, wanted_out)

    A = HessianOperator(spy, hess.names, hess.shapes, DT, "cpu", split=op._vars and
                        {v: t for v, t in op._vars.items() if v != t[0]})
    A[("W_1", "W_Q#1"), "W_K#0"] @ torch.ones(A["W_K#0", "W_K#0"].shape[0], dtype=DT)
    assert calls == [({"W_K"}, ("W_1", "W_Q"))]


def test_a_models_operator_has_every_blocks_heads():
    blocks = tuple(bh.BlockConfig(d_model=4, d_ff=5, n_heads=2) for _ in range(2))
    cfg = bh.ModelConfig(blocks=blocks, embedding="none", pool="mean", head=3)
    g = torch.Generator().manual_seed(8)
    H = bh.hessian(bh.init_params(cfg, seed=0), torch.randn(2, 3, 4, generator=g, dtype=DT), cfg, loss="ce",
                   target=torch.tensor([0, 2]))
    A = HessianOperator.from_dense(H)
    assert {"blocks.0.W_Q#1", "blocks.1.W_V#0"} <= set(A._vars)
    D = H.dense()
    r, c = _rows(A, ("blocks.1.W_Q#0", "W_H")), _rows(A, ("blocks.0.W_K#1",))
    V = torch.randn(c.numel(), 3, generator=g, dtype=DT)
    assert rel_error(A[("blocks.1.W_Q#0", "W_H"), "blocks.0.W_K#1"] @ V, D[r][:, c] @ V) <= EXACT
    # a Transformer block's own Hessian: its parameters as one view
    first = tuple(n for n in A.names if n.startswith("blocks.0."))
    res = per_block(A, lanczos_eigs, blocks=[first], k=2, tol=1e-10)[first]
    _check_eigs(res, eigvalsh(D[_rows(A, first)][:, _rows(A, first)]), 2, "LA", 1e-10)


def test_columns_are_passed_in_chunks_of_max_columns(hess):
    dense = HessianOperator.from_dense(hess)
    widths = []

    def counting(V, wanted_out):
        widths.append(next(iter(V.values())).shape[0])
        return dense._product(V, wanted_out)

    A = HessianOperator(counting, hess.names, hess.shapes, DT, "cpu", max_columns=4)
    V = torch.randn(A.shape[0], 10, dtype=DT)
    assert rel_error(A @ V, hess.dense() @ V) <= EXACT and widths == [4, 4, 2]


def test_views_of_views_and_bad_keys(op):
    sub = op[("W_Q", "W_K"), ("W_Q", "W_K")]
    assert sub["W_Q#0", "W_K"].shape == op["W_Q#0", "W_K"].shape
    with pytest.raises(KeyError, match="not among this view's rows"):
        sub["W_1", "W_Q"]
    with pytest.raises(KeyError, match="unknown variable"):
        op["W_Z", "W_Q"]
    with pytest.raises(KeyError, match="overlapping"):
        op[("W_Q", "W_Q#0"), "W_K"]
    with pytest.raises(KeyError, match="overlapping"):
        op[("W_Q#0", "W_Q#0"), "W_K"]
    with pytest.raises(KeyError, match="pair"):
        op["W_Q"]


def test_bad_products_are_refused(op):
    n = op.shape[0]
    with pytest.raises(ValueError, match="shape"):
        op @ torch.ones(n + 1, dtype=DT)
    with pytest.raises(ValueError, match="float64"):
        op @ torch.ones(n, dtype=torch.float32)
    with pytest.raises(ValueError, match="tensors of shapes"):
        op @ ([torch.ones(2, dtype=DT)] * len(op.names))
    bad = HessianOperator(lambda V, w: {a: torch.zeros(1, dtype=DT) for a in w}, ("x",), {"x": (3,)}, DT, "cpu")
    with pytest.raises(RuntimeError, match="expected a tensor of shape"):
        bad @ torch.ones(3, dtype=DT)
    with pytest.raises(ValueError, match="dtype"):
        HessianOperator(lambda V, w: V, ("x",), {"x": (3,)}, torch.int64, "cpu")
    with pytest.raises(ValueError, match="symmetric"):
        HessianOperator.from_dense(torch.arange(9, dtype=DT).reshape(3, 3))


def test_the_diagonal_is_the_engines_exact_one(op, hess):
    H = hess.dense()
    assert torch.equal(op.diagonal(), torch.diagonal(H)) and torch.equal(diagonal(op), torch.diagonal(H))
    idx = _rows(op, ("W_V#1", "b_1"))
    assert torch.equal(op[("W_V#1", "b_1"), ("W_V#1", "b_1")].diagonal(), torch.diagonal(H)[idx])
    with pytest.raises(ValueError, match="square view"):
        op["W_Q", "W_K"].diagonal()
    plain = HessianOperator(op._product, op.params, op.param_shapes, DT, "cpu")
    with pytest.raises(NotImplementedError, match="no closed-form diagonal"):
        diagonal(plain)
    assert torch.equal(diagonal(H), torch.diagonal(H))


def test_to_scipy_runs_eigsh(op, hess):
    from scipy.sparse.linalg import eigsh

    S = op.to_scipy()
    lam = eigvalsh(hess.dense())
    top = np.sort(eigsh(S, k=3, which="LA", tol=1e-12)[0])
    assert np.allclose(top, lam[-3:].numpy(), rtol=0, atol=1e-10 * float(lam.abs().max()))
    x = np.ones(op.shape[0])
    assert np.allclose(S.rmatvec(x), S.matvec(x)) and S.dtype == np.float64
    R = op["W_Q", "W_1"].to_scipy(dtype=np.float32)
    y = R.rmatvec(np.ones(R.shape[0], dtype=np.float32))
    assert y.dtype == np.float32 and y.shape == (R.shape[1],)
    with pytest.raises(ValueError, match="x must be real"):  # not its real part, silently
        S.matvec(x + 1j * x)


def test_curvlinops_estimators_run_on_it(op, hess):
    curvlinops = pytest.importorskip("curvlinops")
    H = hess.dense()
    n = H.shape[0]
    torch.manual_seed(0)
    assert math.isfinite(float(curvlinops.hutchpp_trace(op, 30)))
    assert math.isfinite(float(curvlinops.hutchinson_squared_fro(op, 10)))
    assert curvlinops.hutchinson_diag(op, 10).shape == (n,)
    grid, density = curvlinops.lanczos_approximate_spectrum(op, ncv=30, num_points=200)
    assert float(torch.trapezoid(density, grid)) == pytest.approx(1.0, abs=0.05)  # a density: unit mass


# ----------------------------------------------------------------------------- the mean over batches


def test_the_mean_over_sequences_is_the_batch_hessian():
    cfg, params, X, T = _block(B=3)
    whole = bh.hessian(params, X, cfg, loss="mse", target=T).dense()
    ops = [HessianOperator.from_dense(bh.hessian(params, X[i], cfg, loss="mse", target=T[i])) for i in range(3)]
    A = mean_operator(ops, counts=[1, 1, 1])
    g = torch.Generator().manual_seed(4)
    V = torch.randn(whole.shape[0], 3, generator=g, dtype=DT)
    assert rel_error(A @ V, whole @ V) <= EXACT and A.count == 3
    assert rel_error(A.diagonal(), torch.diagonal(whole)) <= EXACT
    # batches of 2 and 1 sequences, weighted by their counts, lazily built, with a progress bar
    first = bh.hessian(params, X[:2], cfg, loss="mse", target=T[:2])
    lazy = mean_operator([lambda: HessianOperator.from_dense(first), lambda: ops[2]], counts=[2, 1], progress=True)
    assert rel_error(lazy @ V, whole @ V) <= EXACT
    r, c = _rows(ops[0], ("W_Q#1",)), _rows(ops[0], ("W_2", "b_K"))
    assert rel_error(lazy["W_Q#1", ("W_2", "b_K")] @ V[: c.numel()], whole[r][:, c] @ V[: c.numel()]) <= EXACT


def test_the_mean_refuses_mismatched_parts(op):
    with pytest.raises(ValueError, match="counts must be given"):
        mean_operator([op, op])
    with pytest.raises(ValueError, match="one entry per part"):
        mean_operator([op, op], counts=[1])
    with pytest.raises(ValueError, match=r"counts\[1\]"):
        mean_operator([op, op], counts=[1, 0])
    with pytest.raises(ValueError, match=r"parts\[1\]"):
        mean_operator([op, op["W_Q", "W_Q"]], counts=[1, 1])
    other = HessianOperator.from_dense(torch.eye(3, dtype=DT))
    with pytest.raises(ValueError, match=r"parts\[1\]"):
        mean_operator([op, lambda: other], counts=[1, 1]) @ torch.ones(op.shape[0], dtype=DT)
    with pytest.raises(ValueError, match="at least one"):
        mean_operator([])


# ----------------------------------------------------------------------------- eigenpairs


def _check_eigs(res, lam, k, which, tol):
    assert res.converged and res.eigenvalues.shape == (k,) and res.eigenvectors.shape == (lam.numel(), k)
    norm = float(lam.abs().max())
    want = {"LA": lam.flip(0)[:k], "SA": lam[:k], "LM": lam[lam.abs().argsort(descending=True)][:k]}[which]
    assert (res.residuals <= tol * res.scale).all() and res.scale <= norm * (1 + 1e-12)
    assert float((res.eigenvalues - want).abs().max()) <= tol * norm  # Weyl: within the residual
    X = res.eigenvectors
    assert rel_error(X.T @ X, torch.eye(k, dtype=DT), scale=1.0) <= 1e-10


@pytest.mark.parametrize("which", ["LA", "SA", "LM"])
@pytest.mark.parametrize("block_size", [1, 3])
def test_lanczos_finds_the_extreme_eigenpairs_of_a_known_spectrum(which, block_size):
    M, lam = _known()
    res = lanczos_eigs(M, k=4, which=which, tol=1e-10, block_size=block_size)
    _check_eigs(res, lam, 4, which, 1e-10)
    assert res.method == "lanczos" and res.matvecs < 1000


@pytest.mark.parametrize("which", ["LA", "SA"])
def test_lanczos_on_a_block_hessian(op, hess, which):
    lam = eigvalsh(hess.dense())
    res = lanczos_eigs(op, k=3, which=which, tol=1e-10)
    _check_eigs(res, lam, 3, which, 1e-10)
    A = op["W_1", "W_1"]
    sub = lanczos_eigs(A, k=2, which=which, tol=1e-10)
    _check_eigs(sub, eigvalsh(A.dense()), 2, which, 1e-10)


def test_restarts_keep_converging_and_a_repeated_eigenvalue_is_found():
    M, lam = _known(top=(5.0, 5.0, 5.0, 4.0))
    res = lanczos_eigs(M, k=4, which="LA", tol=1e-10, ncv=12, block_size=3)
    assert res.restarts > 0
    _check_eigs(res, lam, 4, "LA", 1e-10)


def test_unconverged_raises_unless_asked():
    M, lam = _known()
    with pytest.raises(NotConvergedError, match="did not converge") as err:
        lanczos_eigs(M, k=3, which="SA", tol=1e-10, max_matvecs=20)
    assert not err.value.result.converged and err.value.result.residuals.shape == (3,)
    res = lanczos_eigs(M, k=3, which="SA", tol=1e-10, max_matvecs=20, allow_unconverged=True)
    assert not res.converged and bool((res.residuals > 1e-10 * res.scale).any())


def test_a_warm_start_takes_fewer_products():
    """The iteration's products, the check's apart: the check starts from its own random vector whatever
    ``v0`` is (its guarantee needs one), so a warm start saves only on the iteration."""
    M, _ = _known()
    g = torch.Generator().manual_seed(5)
    E = torch.randn(M.shape, generator=g, dtype=DT)
    M2 = M + 1e-6 * (E + E.T)
    lam2 = eigvalsh(M2)
    first = lanczos_eigs(M, k=4, which="SA", tol=1e-10)
    cold = lanczos_eigs(M2, k=4, which="SA", tol=1e-10)
    warm = lanczos_eigs(M2, k=4, which="SA", tol=1e-10, v0=first.eigenvectors)
    _check_eigs(warm, lam2, 4, "SA", 1e-10)
    assert warm.matvecs - warm.check_matvecs <= 0.75 * (cold.matvecs - cold.check_matvecs)


def test_dense_below_takes_the_dense_eigendecomposition(op, hess):
    lam = eigvalsh(hess.dense())
    res = lanczos_eigs(op, k=5, which="SA", tol=1e-10, dense_below=op.shape[0])
    assert res.method == "dense" and res.matvecs == op.shape[0] + 5
    _check_eigs(res, lam, 5, "SA", 1e-10)


def test_float32_converges_to_its_own_tolerance():
    M, lam = _known()
    res = lanczos_eigs(M.float(), k=3, which="LA", tol=1e-5)
    assert res.converged and res.eigenvalues.dtype == torch.float32
    # the float32 matrix differs from M by its rounding: ‖M32 − M‖₂ <= ε₃₂ ‖M‖_F
    slack = torch.finfo(torch.float32).eps * float(torch.linalg.matrix_norm(M))
    assert float((res.eigenvalues.double() - lam.flip(0)[:3]).abs().max()) <= 1e-5 * res.scale + slack


@pytest.mark.parametrize("kwargs, match", [({"k": 0}, "k must be"), ({"k": 300}, "at most n"), ({"which": "BE"}, "which"),
                                           ({"tol": 1e-20}, "tol"), ({"tol": 1.5}, "tol"), ({"ncv": 3}, "ncv"),
                                           ({"v0": torch.ones(5)}, "v0"), ({"seed": -1}, "seed")])
def test_lanczos_refuses_bad_arguments(kwargs, match):
    M, _ = _known()
    with pytest.raises(ValueError, match=match):
        lanczos_eigs(M, **{"k": 2, **kwargs})


# ----------------------------------------------------------------------------- density, trace, norms


def _exact_density(lam, grid, sigma):
    z = (grid[:, None] - lam[None, :]) / sigma
    return torch.exp(-0.5 * z * z).sum(1) / (lam.numel() * sigma * math.sqrt(2 * math.pi))


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("reorth", ["full", "none"])
def test_slq_density_is_the_broadened_spectrum_within_its_errors(seed, reorth):
    M, lam = _known()
    res = slq_density(M, n_probes=16, n_iter=40, seed=seed, reorth=reorth)
    assert res.n_probes == 16 and res.n_iter == 40 and res.reorth == reorth and res.matvecs <= 16 * 40
    assert rel_error(res.weights.sum(1), torch.ones(16, dtype=DT), scale=1.0) <= 1e-12
    exact = _exact_density(lam, res.grid, res.sigma)
    err = (res.density - exact).abs()
    bound = Z_MAX * res.stderr + res.quadrature_error + 1e-12
    assert bool((err <= bound).all()), float((err / bound).max())
    z = err / res.stderr.clamp_min(1e-300)
    inside = res.stderr > 1e-3 * float(res.stderr.max())
    assert float(z[inside].pow(2).mean().sqrt()) <= 2.0  # the stated error is not a loose envelope
    # a narrower broadening of the same rules: the quadrature error now shows
    d, se, qe = res.broaden(res.grid, res.sigma / 4)
    assert float(qe.max()) > float(res.quadrature_error.max())
    assert bool(((d - _exact_density(lam, res.grid, res.sigma / 4)).abs() <= Z_MAX * se + qe + 1e-12).all())


def test_slq_with_a_full_krylov_space_is_exact_per_probe():
    lam = torch.tensor([-1.0, 0.5, 0.5, 2.0, 3.0], dtype=DT)
    res = slq_density(torch.diag(lam), n_probes=3, n_iter=10)
    assert res.n_iter == 5 and float(res.quadrature_error.max()) == 0.0
    # a Rademacher probe z/√n weighs every eigenvalue of a diagonal matrix by 1/n: the exact density
    assert rel_error(res.density, _exact_density(lam, res.grid, res.sigma)) <= 1e-12


@pytest.mark.parametrize("scale", [1e-6, 1.0, 1e4])
def test_slq_width_of_a_single_eigenvalue_follows_its_size(scale):
    """Every node one value ``λ`` (a multiple of the identity): the default width is ``|λ| / n_iter``, so
    the point mass is as sharp at 1e-6 as at 1e4; the zero operator, which has no scale, gets ``1 / n_iter``."""
    res = slq_density(scale * torch.eye(50, dtype=DT), n_probes=2, n_iter=8)
    assert res.sigma == pytest.approx(scale / res.n_iter, rel=1e-12)
    assert float(res.grid[res.density.argmax()]) == pytest.approx(scale, rel=0.05)
    zero = slq_density(torch.zeros(50, 50, dtype=DT), n_probes=2, n_iter=8)
    assert zero.sigma == pytest.approx(1 / zero.n_iter)


def _outliers(n=120, seed=0):
    """Three large outliers (1e3, 8e2, 5e2) over a bulk in [0, 1], random eigenvectors: a probe weighs an outlier by
    ``(u_iᵀv)²``, so the probes' densities and first moments have heavy right tails."""
    g = torch.Generator().manual_seed(seed)
    lam = torch.cat([torch.tensor([1e3, 8e2, 5e2], dtype=DT), torch.rand(n - 3, generator=g, dtype=DT)])
    Q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=DT))
    M = (Q * lam) @ Q.T
    return (M + M.T) / 2, lam


def test_slq_intervals_cover_at_their_rate_on_heavy_tailed_probes():
    """On the outliers family the probes' sample standard deviation, even with Student's t, covers the broadened
    spectrum at 89 % of grid points and the first moment in 91 % of these 300 seeds (the test asserts both below
    92 %: the family is hard for it); the stated intervals must cover at the nominal 95 % (95.2 % and 95.3 % here;
    94 % leaves room for 300 seeds' noise)."""
    M, lam = _outliers()
    n, P = M.shape[0], 16
    q = 2.1314  # t_15's 0.975 quantile
    seeds = range(300)
    inside = inside_sample = points = m1_in = m1_sample = 0
    for s in seeds:
        r = slq_density(M, n_probes=P, n_iter=24, seed=s)
        assert r.n == n and r.confidence == 0.95
        exact = _exact_density(lam, r.grid, r.sigma)
        live = exact > 1e-3 * float(exact.max())
        inside += int(((r.ci_low <= exact) & (exact <= r.ci_high))[live].sum())
        z = (r.grid[None, None, :] - r.nodes[:, :, None]) / r.sigma
        per = (r.weights[:, :, None] * torch.exp(-0.5 * z * z)).sum(1) / (r.sigma * math.sqrt(2 * math.pi))
        old = q * per.std(0) / math.sqrt(P) + r.quadrature_error  # the old stated error, with t_15
        inside_sample += int(((r.density - exact).abs() <= old)[live].sum())
        points += int(live.sum())
        e = r.integral(lambda x: x)
        m1_in += e.ci_low <= float(lam.mean()) <= e.ci_high
        p1 = (r.weights * r.nodes).sum(1)
        m1_sample += abs(float(p1.mean()) - float(lam.mean())) <= q * float(p1.std()) / math.sqrt(P)
    assert inside_sample / points < 0.92 and m1_sample / len(seeds) < 0.92  # the family is hard for a sample estimate
    assert inside / points >= 0.94 and m1_in / len(seeds) >= 0.94, (inside / points, m1_in / len(seeds))


def test_slq_stderr_is_the_gauss_rules_bound_on_the_variance():
    """With ``n_iter = n`` every probe's rule is exact (its Krylov space is the whole space): ``s²(t)`` is then
    ``mean_p ‖(F − φ I) v_p‖²`` for ``F = g_σ(tI − A)`` and the seed's own Rademacher probes, to rounding; and its
    mean over seeds bounds the Rademacher variance ``2(‖F‖_F² − Σ F_ii²) / (n² P)`` of the density from above."""
    n, P = 12, 4
    g = torch.Generator().manual_seed(2)
    lam = torch.cat([torch.tensor([9.0, -4.0], dtype=DT), torch.rand(n - 2, generator=g, dtype=DT)])
    Q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=DT))
    M = (Q * lam) @ Q.T
    M = (M + M.T) / 2
    grid = torch.linspace(-5, 10, 31, dtype=DT)
    means = torch.zeros(31, dtype=DT)
    for seed in range(200):
        r = slq_density(M, n_probes=P, n_iter=n, seed=seed, grid=grid, sigma=0.7)
        V = (torch.randint(0, 2, (n, P), generator=torch.Generator().manual_seed(seed)) * 2 - 1).to(DT) / math.sqrt(n)
        for i, t in enumerate(grid):
            F = (Q * (torch.exp(-0.5 * ((t - lam) / 0.7) ** 2) / (0.7 * math.sqrt(2 * math.pi)))) @ Q.T
            phi = (V * (F @ V)).sum(0)
            assert float(r.density[i]) == pytest.approx(float(phi.mean()), rel=1e-10, abs=1e-14)
            s2 = float(((F - r.density[i] * torch.eye(n, dtype=DT)) @ V).pow(2).sum(0).mean())
            assert float(r.stderr[i]) ** 2 == pytest.approx(2 * s2 / (n * P - 2), rel=1e-8, abs=1e-28)
        means += r.stderr**2 / 200
    for i, t in enumerate(grid):
        F = (Q * (torch.exp(-0.5 * ((t - lam) / 0.7) ** 2) / (0.7 * math.sqrt(2 * math.pi)))) @ Q.T
        var = 2 * float(F.pow(2).sum() - torch.diagonal(F).pow(2).sum()) / (n * n * P)
        assert float(means[i]) >= 0.9 * var  # a bound in expectation; 200 seeds' mean within 10 %


def test_slq_interval_is_stated_by_its_rule():
    M, lam = _known()
    r = slq_density(M, n_probes=8, n_iter=30, seed=1)
    q = 2.364624  # t_7's 0.975 quantile
    assert r.n == 240 and bool((r.ci_low >= 0).all()) and bool((r.ci_low <= r.density).all())
    assert bool((r.density <= r.ci_high).all())
    assert bool((r.ci_high - r.density >= q * r.stderr + r.quadrature_error - 1e-15).all())
    body = r.stderr > 1e-3 * float(r.stderr.max())  # where sampling, not rounding, sets the width
    assert rel_error((r.ci_high - r.density)[body], (q * r.stderr + r.quadrature_error)[body]) <= 1e-4
    half = slq_density(M, n_probes=8, n_iter=30, seed=1, confidence=0.5)
    assert half.confidence == 0.5
    assert rel_error((half.ci_high - half.density)[body], (0.711142 * r.stderr + r.quadrature_error)[body]) <= 1e-3
    d, se, qe = r.broaden(r.grid, r.sigma)
    assert torch.equal(d, r.density) and torch.equal(se, r.stderr) and torch.equal(qe, r.quadrature_error)
    # the first moment: exact per probe (degree 1), its interval by the same rule
    e = r.integral(lambda x: x)
    assert e.value == pytest.approx(float((r.weights * r.nodes).sum(1).mean()), rel=1e-12) and not e.exact
    assert e.ci_high - e.value == pytest.approx(q * e.stderr, rel=1e-6) and e.matvecs == r.matvecs
    s2 = float((r.weights * (r.nodes - e.value) ** 2).sum(1).mean())
    assert e.stderr == pytest.approx(math.sqrt(2 * s2 / (240 * 8 - 2)), rel=1e-12)
    assert r.integral(lambda x: x, confidence=0.5).confidence == 0.5
    with pytest.raises(ValueError, match="same shape"):
        r.integral(lambda x: x.sum())
    with pytest.raises(ValueError, match="NaN or Inf"):
        r.integral(lambda x: x.log())  # negative nodes
    # a probe whose Krylov space is invariant has unused nodes (zero weight, value 0): f is judged at the used ones
    small = slq_density(torch.diag(torch.tensor([1.0, 2.0, 4.0, 4.0], dtype=DT)), n_probes=2, n_iter=4)
    assert small.n_iter == 4 and bool((small.weights[:, 3] == 0).all())  # three distinct values: a 3-d Krylov space
    log_mean = small.integral(lambda x: x.log())
    assert log_mean.value == pytest.approx(5 * math.log(2) / 4, rel=1e-12)  # diagonal A: each probe the exact measure
    with pytest.raises(ValueError, match="confidence"):
        slq_density(M, confidence=1.0)


@pytest.mark.parametrize("kwargs, match", [({"n_probes": 1}, "n_probes"), ({"n_iter": 1}, "n_iter"),
                                           ({"reorth": "partial"}, "reorth"), ({"grid": 1}, "grid"),
                                           ({"sigma": 0.0}, "sigma"),
                                           ({"grid": torch.tensor([0.0, float("nan")], dtype=DT)}, "grid contains NaN")])
def test_slq_refuses_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        slq_density(torch.eye(4, dtype=DT), **kwargs)


def _z_scores(estimates, exact):
    return torch.tensor([(e.value - exact) / e.stderr for e in estimates], dtype=DT)


def test_hutchpp_trace_within_its_stated_error():
    M, lam = _known()
    z = _z_scores([hutchpp_trace(M, 60, seed=s) for s in SEEDS], float(lam.sum()))
    assert float(z.abs().max()) <= Z_MAX and 0.3 <= float(z.pow(2).mean().sqrt()) <= 2.0
    exact = hutchpp_trace(M, M.shape[0])
    assert exact.exact and exact.stderr == 0.0 and exact.value == pytest.approx(float(lam.sum()), rel=EXACT)
    # rank 6 <= the sketch's 10 columns: Q spans the range, the sampled part is zero
    g = torch.Generator().manual_seed(6)
    F = torch.randn(M.shape[0], 6, generator=g, dtype=DT)
    low = hutchpp_trace(F @ F.T, 30)
    assert low.value == pytest.approx(float((F * F).sum()), rel=1e-10) and low.stderr <= 1e-10 * low.value


def test_frobenius_norm_exact_and_estimated(op, hess):
    H = hess.dense()
    assert frobenius_norm(op).value == pytest.approx(float(torch.linalg.matrix_norm(H)), rel=EXACT)
    r, c = _rows(op, ("W_Q", "W_K")), _rows(op, ("W_1", "b_1", "W_2"))
    block = op[("W_Q", "W_K"), ("W_1", "b_1", "W_2")]
    exact = float(torch.linalg.matrix_norm(H[r][:, c]))
    assert frobenius_norm(block).exact and frobenius_norm(block).value == pytest.approx(exact, rel=EXACT)
    M, lam = _known()
    z = _z_scores([frobenius_norm(M, 60, seed=s) for s in SEEDS], float(lam.norm()))
    assert float(z.abs().max()) <= Z_MAX and 0.3 <= float(z.pow(2).mean().sqrt()) <= 2.0
    z = _z_scores([frobenius_norm(block, 42, seed=s) for s in SEEDS], exact)  # rectangular: Q from A.T
    assert float(z.abs().max()) <= Z_MAX


def test_hutchinson_diagonal_within_its_stated_error():
    M, _ = _known()
    est = hutchinson_diagonal(M, 40, seed=0)
    z = (est.value - torch.diagonal(M)) / est.stderr
    assert float(z.abs().max()) <= Z_MAX and 0.5 <= float(z.pow(2).mean().sqrt()) <= 1.5 and not est.exact


def test_quantiles_are_the_tables():
    from blockhess.operators.estimators import _chi2_quantile, _t_quantile
    # Student's t, two-sided 95 % and 99 % (the tables' 0.975 and 0.995 quantiles), and the chi-square's
    for dof, q95, q99 in [(1, 12.7062, 63.6567), (2, 4.3027, 9.9248), (9, 2.2622, 3.2498), (10, 2.2281, 3.1693),
                          (29, 2.0452, 2.7564), (1000, 1.9623, 2.5808)]:
        assert _t_quantile(0.95, dof) == pytest.approx(q95, abs=1e-4) and _t_quantile(0.99, dof) == pytest.approx(q99, abs=1e-4)
    for nu, lo, hi in [(1, 0.000982, 5.0239), (10, 3.2470, 20.4832), (100, 74.2219, 129.5612)]:
        assert _chi2_quantile(0.025, nu) == pytest.approx(lo, rel=1e-3) and _chi2_quantile(0.975, nu) == pytest.approx(hi, rel=1e-4)


def _past_sketch(n=150, seed=3):
    """12 eigenvalues near 10 (just past the default sketch's 10 columns) over a bulk of 1e-2 noise: the residual
    Hutch++ samples keeps a few large eigenvalues, its samples a heavy right tail."""
    g = torch.Generator().manual_seed(seed)
    lam = torch.cat([10 + torch.rand(12, generator=g, dtype=DT), 1e-2 * torch.randn(n - 12, generator=g, dtype=DT)])
    Q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=DT))
    M = (Q * lam) @ Q.T
    return (M + M.T) / 2, lam


def test_intervals_cover_at_their_rate_on_a_heavy_tailed_residual():
    """At the default budget the sample standard deviation of 10 skewed samples made ``value ± 1.96 stderr`` cover
    the truth in 91 % of these 300 seeds (|z| up to 11); the stated intervals must cover at 95 %."""
    M, lam = _past_sketch()
    seeds = range(300)
    tr, fro = float(lam.sum()), float(lam.norm())
    for est, exact in ((hutchpp_trace(M, seed=s) for s in seeds), tr), ((frobenius_norm(M, 30, seed=s) for s in seeds), fro):
        inside = [e.ci_low <= exact <= e.ci_high and e.confidence == 0.95 and e.ci_low <= e.value <= e.ci_high for e in est]
        assert sum(inside) / len(inside) >= 0.94, sum(inside) / len(inside)
    e = hutchpp_trace(M, seed=0, confidence=0.5)
    assert e.ci_high - e.value == pytest.approx(0.7027 * e.stderr, rel=1e-3)  # t_9's 0.75 quantile
    exact = frobenius_norm(M)
    assert exact.exact and exact.ci_low == exact.ci_high == exact.value


def test_hutchinson_diagonal_interval_per_entry():
    M, _ = _known()
    d = torch.diagonal(M)
    hits = torch.stack([(e.ci_low <= d) & (d <= e.ci_high) for e in (hutchinson_diagonal(M, 30, seed=s) for s in range(40))])
    assert 0.93 <= float(hits.double().mean()) <= 0.97  # per entry, not simultaneous
    e = hutchinson_diagonal(M, 30, seed=0)
    assert rel_error(e.ci_high - e.value, 2.0452 * e.stderr) <= 1e-4  # t_29


def test_per_block_runs_an_estimator_on_every_block(op, hess):
    eigs = per_block(op, lanczos_eigs, k=2, tol=1e-10, dense_below=30)
    assert list(eigs) == list(op.names)
    for name, res in eigs.items():
        lam = eigvalsh(hess[name, name])
        assert res.method == ("dense" if lam.numel() <= 30 else "lanczos")
        want = lam.flip(0)[: res.eigenvalues.numel()]
        assert float((res.eigenvalues - want).abs().max()) <= 1e-10 * max(float(lam.abs().max()), 1e-300) + 1e-15
    assert list(per_block(op, diagonal, blocks="W_Q")) == ["W_Q"]  # one name: one block, not its characters
    heads = per_block(op, diagonal, blocks=["W_Q#0", "W_Q#1"])
    assert all(torch.equal(d, torch.diagonal(hess.dense())[_rows(op, (h,))]) for h, d in heads.items())
    norms = per_block(op, frobenius_norm, blocks=["W_Q", ("W_1", "b_1")], pairs=True)
    assert list(norms) == [("W_Q", "W_Q"), ("W_Q", ("W_1", "b_1")), (("W_1", "b_1"), ("W_1", "b_1"))]
    block = torch.cat([hess["W_Q", "W_1"], hess["W_Q", "b_1"]], 1)
    assert norms[("W_Q", ("W_1", "b_1"))].value == pytest.approx(float(torch.linalg.matrix_norm(block)), rel=EXACT)
    with pytest.raises(ValueError, match="named views"):
        per_block(hess.dense(), frobenius_norm)


# ----------------------------------------------------------------------------- symmetric operators only


def _counted(view):
    """``view`` with its engine's products counted in ``view.calls`` (a list of the columns multiplied)."""
    view = view[view.names, view.in_names]
    calls, product = [], view._product

    def counting(V, wanted):
        calls.append(next(iter(V.values())).shape[0])
        return product(V, wanted)

    view._product, view.calls = counting, calls
    return view


def test_views_say_whether_they_are_symmetric(op):
    assert op.is_symmetric and op.SELF_ADJOINT and op["W_Q", "W_Q"].is_symmetric and op["W_Q#1", "W_Q#1"].is_symmetric
    assert op[("W_Q", "W_K"), ("W_Q", "W_K")].is_symmetric
    assert op["W_Q", "W_K"].shape == (16, 16)  # square, and not symmetric
    for view in (op["W_Q", "W_K"], op[("W_Q", "W_K"), ("W_K", "W_Q")], op["W_Q#0", "W_Q#1"], op["W_Q", "W_1"]):
        assert not view.is_symmetric and not view.SELF_ADJOINT
    assert not op["W_Q", "W_K"].T.is_symmetric and op["W_K", "W_K"].T.is_symmetric


@pytest.mark.parametrize("estimator", [slq_density, hutchpp_trace])
def test_symmetric_estimators_refuse_a_square_off_diagonal_view_before_any_product(op, estimator):
    view = _counted(op["W_Q", "W_K"])
    with pytest.raises(ValueError, match=rf"{estimator.__name__} assumes a symmetric operator, but A is not symmetric: "
                                         r"the off-diagonal view A\['W_Q', 'W_K'\] \(rows \['W_Q'\], columns \['W_K'\]\)"):
        estimator(view)
    with pytest.raises(ValueError, match=r"A\[\('W_Q', 'W_K'\), \('W_K', 'W_Q'\)\]"):
        estimator(op[("W_Q", "W_K"), ("W_K", "W_Q")])
    assert view.calls == []
    # per_block with pairs checks every view first: no product, not even the diagonal blocks'
    counted = _counted(op)
    with pytest.raises(ValueError, match=r"per_block, pairs=True.*A\['W_Q', 'W_K'\]"):
        per_block(counted, estimator, blocks=["W_Q", "W_K"], pairs=True)
    assert counted.calls == []


def test_dense_tensors_are_checked_for_symmetry_and_foreign_operators_trusted():
    M, lam = _known(n=60)
    g = torch.Generator().manual_seed(1)
    K = torch.randn(60, 60, generator=g, dtype=DT)
    with pytest.raises(ValueError, match=r"hutchpp_trace .* a dense tensor with \|\|A - A\^T\|\|_F = "):
        hutchpp_trace(M + 1e-6 * K, 30)
    with pytest.raises(ValueError, match="slq_density assumes a symmetric operator"):
        slq_density(M + 1e-6 * K)
    near = M + 1e-15 * (K + K.T)  # symmetric exactly; asymmetric rounding of a product is inside n·eps
    near = near + torch.triu(torch.full_like(M, 1e-17), 1)
    assert hutchpp_trace(near, 60).exact and slq_density(near, 2, 4).n_probes == 2
    # the diagonal's estimators take any square operator, symmetric or not
    assert hutchinson_diagonal(M + K, 4).value.shape == (60,) and diagonal(M + K).shape == (60,)

    class Foreign:  # an operator without is_symmetric / SELF_ADJOINT: taken as symmetric, as documented
        shape, dtype, device = (60, 60), DT, torch.device("cpu")

        def __matmul__(self, X):
            return (M + K) @ X

    assert hutchpp_trace(Foreign(), 30).matvecs == 30
    Foreign.SELF_ADJOINT = False  # curvlinops' attribute, when it says no
    with pytest.raises(ValueError, match="Foreign says it is not"):
        hutchpp_trace(Foreign(), 30)


def test_frobenius_norm_of_a_square_off_diagonal_view_sketches_its_row_space():
    """``‖A‖_F`` of ``A = U Vᵀ`` (rank 3, square, not symmetric): the sketch ``orth(Aᵀ S)`` spans ``V``, so
    ``A (I − QQᵀ) = 0`` and 12 products give the norm exactly; a sketch of ``A S`` spans ``U`` instead."""
    g = torch.Generator().manual_seed(2)
    U, V = torch.randn(20, 3, generator=g, dtype=DT), torch.randn(20, 3, generator=g, dtype=DT)
    B = U @ V.T
    H = torch.cat([torch.cat([torch.zeros(20, 20, dtype=DT), B], 1), torch.cat([B.T, torch.zeros(20, 20, dtype=DT)], 1)])
    A = HessianOperator.from_dense(H, names=("a", "b"), shapes={"a": (20,), "b": (20,)})
    exact = float(torch.linalg.matrix_norm(B))
    for square in (A["a", "b"], B):
        est = frobenius_norm(square, 12, seed=0)
        assert not est.exact and est.value == pytest.approx(exact, rel=1e-12) and est.stderr <= 1e-12 * exact


def test_lanczos_refuses_a_square_off_diagonal_view(op):
    view = _counted(op["W_Q", "W_K"])
    with pytest.raises(ValueError, match=r"lanczos_eigs assumes a symmetric operator.*A\['W_Q', 'W_K'\]"):
        lanczos_eigs(view, k=2)
    assert view.calls == []


# ----------------------------------------------------------------------------- on a GPU


@pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="no CUDA device")
def test_on_cuda_the_operator_and_estimators_give_the_cpus_numbers(op, hess):
    blocks = bh.HessianBlocks(hess.names, hess.shapes, {k: v.to(DEVICE) for k, v in hess.items()},
                                     hess.dense().to(DEVICE), cfg=hess.cfg)
    A = HessianOperator.from_dense(blocks)
    assert A.device.type == DEVICE and A._vars == op._vars
    g = torch.Generator().manual_seed(7)
    V = torch.randn(op.shape[0], 5, generator=g, dtype=DT)
    assert rel_error((A @ V.to(DEVICE)).cpu(), op @ V) <= EXACT
    c = _rows(op, ("W_1",))
    assert rel_error((A["W_Q#1", "W_1"] @ V[c].to(DEVICE)).cpu(), op["W_Q#1", "W_1"] @ V[c]) <= EXACT
    assert rel_error(A.diagonal().cpu(), op.diagonal()) <= EXACT
    mean = mean_operator([A, A], counts=[1, 3])
    assert rel_error((mean @ V.to(DEVICE)).cpu(), op @ V) <= EXACT
    assert np.allclose(A.to_scipy().matvec(V[:, 0].numpy()), (op @ V[:, 0]).numpy(), rtol=1e-12, atol=0)
    lam = eigvalsh(hess.dense())
    for which in ("LA", "SA"):
        res = lanczos_eigs(A, k=3, which=which, tol=1e-10)
        assert res.eigenvectors.device.type == DEVICE
        _check_eigs(_on_cpu(res), lam, 3, which, 1e-10)
    # the same draws on every device: the same estimates, to the rounding of their sums
    for est in (hutchpp_trace, frobenius_norm, hutchinson_diagonal):
        a, b = est(A, 30, seed=3), est(op, 30, seed=3)
        assert rel_error(torch.as_tensor(a.value).cpu(), torch.as_tensor(b.value)) <= 1e-10
    s_gpu, s_cpu = slq_density(A, 8, 30, seed=2), slq_density(op, 8, 30, seed=2)
    # Lanczos nodes from two orders of summation agree to the rounding of the recurrence
    assert rel_error(s_gpu.density.cpu(), s_cpu.density) <= 1e-8


def _on_cpu(res):
    """``res`` with its tensors on the CPU (for :func:`_check_eigs`)."""
    return dataclasses.replace(res, **{f.name: getattr(res, f.name).cpu() for f in dataclasses.fields(res)
                                       if isinstance(getattr(res, f.name), torch.Tensor)})


def test_hutchinson_intervals_of_an_exactly_diagonal_operator_hold_its_entries():
    """Every sample of a diagonal operator's entry is the entry itself: zero spread, and a point interval
    that the rounded mean of 30 equal samples missed by an ulp on about half the entries. The interval is
    never narrower than that rounding."""
    d = torch.linspace(-3.0, 7.0, 200, dtype=torch.float64) * math.pi
    est = hutchinson_diagonal(torch.diag(d), 30)
    assert bool(((est.ci_low <= d) & (d <= est.ci_high)).all())
    assert float((est.ci_high - est.ci_low).max()) <= 64 * torch.finfo(torch.float64).eps * float(d.abs().max())


def test_slq_on_a_long_float32_operator_runs_every_step():
    """On 2^24 float32 rows ``n ε = 2``: a breakdown test at ``n ε · scale`` took every probe for broken down
    after one step (a one-node density, as if exact); at the rounding of a length-n inner product the probes
    run their ``n_iter`` steps, the Ritz values inside the spectrum."""
    n = 2**24
    d = torch.linspace(0.5, 2.0, n, dtype=torch.float32)

    class Diag:
        shape, dtype, device = (n, n), torch.float32, torch.device("cpu")

        def __matmul__(self, X):
            return d[:, None] * X

    from blockhess.operators import slq_density

    res = slq_density(Diag(), n_probes=2, n_iter=5, seed=0, reorth="none")
    assert res.matvecs == 2 * 5
    assert float(res.nodes.min()) >= 0.5 - 1e-3 and float(res.nodes.max()) <= 2.0 + 1e-3
