"""``blockhess.operators.solve`` and ``influence``: exact damped inverse-Hessian products by CG and MINRES
on the closed-form operator, against ``torch.linalg.solve`` of the dense damped Hessian (float64). The
error is bounded by the condition number times the true relative residual the solver reports
(``‖x − x*‖/‖x*‖ <= κ(A + λI) · ‖r‖/‖b‖``), and every test asks for both that bound and 1e-8."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import blockhess as bh
from blockhess.operators import IndefiniteError, NotConvergedError, influence, solve

DT = torch.float64
ERR = 1e-8  # the solution's relative error asked of every solve here (tol 1e-10 or 1e-11, κ below 100 or 1000)


def block(part="full", seed=0):
    cfg = bh.BlockConfig(d_model=4, d_ff=6, n_heads=2)
    p = bh.init_params(cfg, seed=0, dtype=DT)
    g = torch.Generator().manual_seed(seed)
    X, T = torch.randn(2, 3, 4, generator=g, dtype=DT), torch.randn(2, 3, 4, generator=g, dtype=DT)
    return bh.hessian_operator(p, X, cfg, target=T, part=part)


def rhs(n, k=None, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g, dtype=DT) if k is None else torch.randn(n, k, generator=g, dtype=DT)


def rel(a, b):
    return float((a - b).norm() / b.norm())


def check(r, H, lam, b, tol):
    """The solution against the dense solve, within κ · (reported residual) and ERR, and the reported
    residual the true one."""
    n = H.shape[0]
    Hd = H + lam * torch.eye(n, dtype=DT)
    ref = torch.linalg.solve(Hd, b)
    ev = torch.linalg.eigvalsh(Hd).abs()
    kappa = float(ev.max() / ev.min())
    res = (b - Hd @ r.x).norm(dim=0)
    assert torch.allclose(torch.as_tensor(r.residual_norm, dtype=DT), res, rtol=1e-6, atol=1e-14 * float(b.norm()))
    assert r.converged and float(torch.as_tensor(r.relative_residual).max()) <= tol
    err = rel(r.x, ref)
    assert err <= kappa * tol * 1.01 and err <= ERR, (err, kappa)
    return err


@pytest.mark.parametrize("method", ["minres", "auto"])
def test_minres_on_the_indefinite_full_hessian(method):
    A = block()
    H = A.dense()
    ev = torch.linalg.eigvalsh(H)
    assert ev.min() < -0.1 and ev.max() > 0.1  # indefinite
    lam = damping_between(ev)
    assert float((ev + lam).abs().min()) > 0.01 and float((ev + lam).min()) < -0.1  # still indefinite
    b = rhs(H.shape[0])
    r = solve(A, b, damping=lam, tol=1e-11, method=method)
    assert r.method == "minres" and isinstance(r.x, torch.Tensor) and r.x.shape == b.shape
    assert isinstance(r.residual_norm, float) and r.matvecs >= r.iterations + 1
    check(r, H, lam, b, 1e-11)


def damping_between(ev) -> float:
    """The damping in [0.02, 0.3] (a grid of 281) farthest from making A + λI singular: max min |λ_i + λ|."""
    grid = torch.linspace(0.02, 0.3, 281, dtype=DT)
    return float(grid[(ev[None, :] + grid[:, None]).abs().min(1).values.argmax()])


def test_cg_breaks_down_on_the_indefinite_hessian_and_says_so():
    A = block()
    with pytest.raises(IndefiniteError, match=r"breakdown, p\^T \(A \+ damping I\) p <= 0.*use method='minres'") as e:
        solve(A, rhs(A.shape[0]), damping=damping_between(torch.linalg.eigvalsh(A.dense())), tol=1e-10, method="cg")
    assert isinstance(e.value, NotConvergedError) and not e.value.result.converged


@pytest.mark.parametrize("method", ["cg", "minres"])
def test_both_methods_on_the_damped_gauss_newton_part(method):
    A = block("outer")
    H = A.dense()
    assert float(torch.linalg.eigvalsh(H).min()) > -1e-12  # PSD (and singular)
    b = rhs(H.shape[0], 3)
    r = solve(A, b, damping=0.1, tol=1e-10, method=method)
    assert r.method == method and r.x.shape == (H.shape[0], 3) and r.residual_norm.shape == (3,)
    check(r, H, 0.1, b, 1e-10)
    # the columns are independent recurrences: each the solve of its column alone
    for j in range(3):
        one = solve(A, b[:, j], damping=0.1, tol=1e-10, method=method)
        assert rel(r.x[:, j], one.x) <= 1e-9


def test_singular_gauss_newton_part_without_damping():
    """λ = 0 on a rank-deficient Gauss–Newton part: for b in the range MINRES gives the minimum-norm
    solution (pinv(H) b); for b outside it, NotConvergedError (nothing is promised of the iterate, which is
    not a least-squares solution in general), and allow_unconverged returns it."""
    A = block("outer")
    H = A.dense()
    n = H.shape[0]
    ev, U = torch.linalg.eigh(H)
    rank = int((ev > 1e-10 * ev.max()).sum())
    assert rank < n
    b = H @ rhs(n)  # in the range
    r = solve(A, b, damping=0.0, tol=1e-10)
    ref = torch.linalg.pinv(H, hermitian=True, rtol=1e-10) @ b
    pos = ev[ev > 1e-10 * ev.max()]
    assert r.converged and rel(r.x, ref) <= min(ERR, float(pos.max() / pos.min()) * 1e-10 * 1.01)
    null = U[:, ev <= 1e-10 * ev.max()]
    assert float((null.T @ r.x).norm()) <= 1e-8 * float(r.x.norm())  # no component in the null space
    c = b + null[:, 0]  # outside the range
    with pytest.raises(NotConvergedError, match=r"solve \(minres\) did not reach tol=1e-10") as e:
        solve(A, c, tol=1e-10, max_matvecs=4 * n)
    got = e.value.result
    assert not got.converged and got.relative_residual > 1e-10 and got.matvecs <= 4 * n
    # no x has a residual below the part of c off the range
    assert got.residual_norm >= float((null.T @ c).norm()) * (1 - 1e-12)
    back = solve(A, c, tol=1e-10, max_matvecs=4 * n, allow_unconverged=True)
    assert not back.converged and back.residual_norm == got.residual_norm


def test_warm_start():
    A = block("outer")
    H = A.dense()
    n = H.shape[0]
    b = rhs(n, 2)
    cold = solve(A, b, damping=0.1, tol=1e-10, method="cg")
    exact = torch.linalg.solve(H + 0.1 * torch.eye(n, dtype=DT), b)
    done = solve(A, b, damping=0.1, tol=1e-10, method="cg", x0=exact)
    assert done.matvecs == 2 and done.iterations == 0 and torch.equal(done.x, exact)  # one residual product
    assert cold.converged and cold.matvecs > 2
    # MINRES on the indefinite full Hessian from near the solution: fewer products than from zero
    F_ = block()
    Hf = F_.dense()
    lam = damping_between(torch.linalg.eigvalsh(Hf))
    exact = torch.linalg.solve(Hf + lam * torch.eye(n, dtype=DT), b)
    far = solve(F_, b, damping=lam, tol=1e-11)
    near = solve(F_, b, damping=lam, tol=1e-11, x0=exact + 1e-6 * rhs(n, 2, seed=3))
    assert near.converged and near.matvecs < far.matvecs
    check(near, Hf, lam, b, 1e-11)


def test_a_budget_that_cannot_converge():
    A = block()
    b = rhs(A.shape[0])
    with pytest.raises(NotConvergedError, match=r"after \d+ products \(max_matvecs=10") as e:
        solve(A, b, damping=0.05, tol=1e-10, max_matvecs=10)
    assert e.value.result.matvecs <= 10 and not e.value.result.converged
    r = solve(A, b, damping=0.05, tol=1e-10, max_matvecs=10, allow_unconverged=True)
    H = A.dense() + 0.05 * torch.eye(A.shape[0], dtype=DT)
    assert abs(r.residual_norm - float((b - H @ r.x).norm())) <= 1e-12 * float(b.norm())


def test_zero_column_and_a_dense_tensor():
    A = block("outer")
    H = A.dense()
    b = rhs(H.shape[0], 2)
    b[:, 1] = 0
    r = solve(H, b, damping=0.2, tol=1e-10)  # a dense symmetric tensor is an operator too
    assert not r.x[:, 1].any() and float(r.relative_residual[1]) == 0.0
    ref = torch.linalg.solve(H + 0.2 * torch.eye(H.shape[0], dtype=DT), b[:, 0])
    assert rel(r.x[:, 0], ref) <= ERR


def test_a_budget_counts_only_the_columns_that_run():
    """A zero column (converged at the start) is never multiplied again: the count stays within the budget,
    and the count is every column multiplied."""
    A = block()
    b = rhs(A.shape[0], 2)
    b[:, 1] = 0
    for budget in (7, 10, 13):
        r = solve(A, b, damping=0.05, tol=1e-12, max_matvecs=budget, allow_unconverged=True)
        assert r.matvecs <= budget and not r.x[:, 1].any()


def test_a_model_in_module_layout():
    """GPT-2 tiny: b a list shaped like model.parameters() (as autograd gives a gradient), x a list back;
    against the dense Hessian in the module's names."""
    tf = pytest.importorskip("transformers")
    from test_adapters_models import gpt2_config, randomise, token_ids
    model = randomise(tf.GPT2LMHeadModel(gpt2_config(n_embd=8, n_inner=16, vocab_size=16, n_layer=1)), seed=21)
    cfg, p = bh.from_torch(model)
    ids, y = token_ids(cfg), token_ids(cfg, seed=2)
    M = bh.hessian_operator(p, ids, cfg, loss="ce", target=y).to_module(model)
    params = list(model.parameters())
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        grads = list(torch.autograd.grad(F.cross_entropy(model(ids).logits.reshape(-1, 16), y.reshape(-1)), params))
    lam = 0.5
    r = solve(M, grads, damping=lam, tol=1e-10)
    assert isinstance(r.x, list) and [t.shape for t in r.x] == [t.shape for t in params]
    Hm = bh.hessian(p, ids, cfg, loss="ce", target=y).to_module(model).dense()
    flat = torch.nn.utils.parameters_to_vector(grads)
    check(r.__class__(**{**r.__dict__, "x": torch.nn.utils.parameters_to_vector(r.x)}), Hm, lam, flat, 1e-10)
    # influence in the same layout: one solve, then a product with each training gradient
    G = torch.stack([flat, rhs(flat.numel())], 1)
    inf = influence(M, G, flat, damping=lam, tol=1e-10)
    dense = G.T @ torch.linalg.solve(Hm + lam * torch.eye(Hm.shape[0], dtype=DT), flat)
    assert inf.scores.shape == (2,) and rel(inf.scores, dense) <= ERR and inf.solution.converged


def test_influence_against_the_dense_form():
    A = block()
    H = A.dense()
    n = H.shape[0]
    G, g = rhs(n, 5, seed=4), rhs(n, seed=5)
    lam = damping_between(torch.linalg.eigvalsh(H))
    r = influence(A, G, g, damping=lam, tol=1e-11)
    dense = G.T @ torch.linalg.solve(H + lam * torch.eye(n, dtype=DT), g)
    assert r.scores.shape == (5,) and rel(r.scores, dense) <= ERR
    assert torch.equal(r.scores, G.T @ r.solution.x)


class Counting:
    """An operator that counts its products (to check that refusals come before any)."""

    def __init__(self, A):
        self.A, self.calls = A, 0
        self.shape, self.dtype, self.device = A.shape, A.dtype, A.device
        self.names, self.in_names, self.in_shapes = A.names, A.in_names, A.in_shapes
        self.is_symmetric = A.is_symmetric

    def __matmul__(self, X):
        self.calls += 1
        return self.A @ X


BAD = {
    "b of another length": (lambda n: dict(b=torch.zeros(n + 1, dtype=DT)), r"b must have shape \(\d+,\) or \(\d+, k\)"),
    "b with no columns": (lambda n: dict(b=torch.zeros(n, 0, dtype=DT)), r"with k >= 1, got \(\d+, 0\)"),
    "b float32": (lambda n: dict(b=torch.zeros(n, dtype=torch.float32)), r"b must have A's dtype torch.float64"),
    "b with NaN": (lambda n: dict(b=torch.full((n,), float("nan"), dtype=DT)), "b contains NaN or Inf"),
    "b a list of the wrong shapes": (lambda n: dict(b=[torch.zeros(3, dtype=DT)]), "b as a list must hold"),
    "negative damping": (lambda n: dict(b=torch.ones(n, dtype=DT), damping=-1e-3),
                         r"damping must be a finite real number in \[0, inf\), got -0.001"),
    "NaN damping": (lambda n: dict(b=torch.ones(n, dtype=DT), damping=float("nan")), "damping must be a finite real"),
    "tol 0": (lambda n: dict(b=torch.ones(n, dtype=DT), tol=0.0), r"tol must be a finite real number in \(0, 1\)"),
    "unknown method": (lambda n: dict(b=torch.ones(n, dtype=DT), method="gmres"), "method must be one of"),
    "max_matvecs 0": (lambda n: dict(b=torch.ones(n, dtype=DT), max_matvecs=0), "max_matvecs must be an int >= 1"),
    "x0 of another shape": (lambda n: dict(b=torch.ones(n, dtype=DT), x0=torch.ones(n, 1, dtype=DT)),
                            r"x0 must be of b's kind and shape \(a tensor \(\d+,\)\), got a tensor \(\d+, 1\)"),
    "x0 with Inf": (lambda n: dict(b=torch.ones(n, dtype=DT), x0=torch.full((n,), float("inf"), dtype=DT)),
                    "x0 contains NaN or Inf"),
}


@pytest.mark.parametrize("case", BAD.values(), ids=BAD.keys())
def test_bad_inputs_are_refused_before_any_product(case):
    make, says = case
    A = Counting(block())
    kw = make(A.shape[0])
    with pytest.raises(ValueError, match=says):
        solve(A, kw.pop("b"), **kw)
    assert A.calls == 0


def test_a_non_symmetric_view_is_refused():
    A = block()
    with pytest.raises(ValueError, match=r"solve assumes a symmetric operator, but A is not symmetric: the off-diagonal "
                                         r"view A\['W_Q', 'W_K'\]"):
        solve(A["W_Q", "W_K"], torch.ones(16, dtype=DT))
    with pytest.raises(ValueError, match="influence assumes a symmetric operator"):
        influence(A["W_Q", "W_K"], torch.ones(16, 1, dtype=DT), torch.ones(16, dtype=DT), 0.1)
    # a symmetric view is solved on its block alone
    V = A["W_Q", "W_Q"]
    b = rhs(16)
    lam = damping_between(torch.linalg.eigvalsh(V.dense()))
    r = solve(V, b, damping=lam, tol=1e-11)
    check(r, V.dense(), lam, b, 1e-11)


def test_influence_refusals():
    A = block()
    n = A.shape[0]
    with pytest.raises(ValueError, match=rf"train_grads must be a tensor \({n}, m\) with m >= 1"):
        influence(A, torch.ones(n, dtype=DT), torch.ones(n, dtype=DT), 0.1)
    with pytest.raises(ValueError, match=rf"test_grad must be a tensor \({n},\)"):
        influence(A, torch.ones(n, 2, dtype=DT), torch.ones(n, 1, dtype=DT), 0.1)
    with pytest.raises(ValueError, match="train_grads contains NaN or Inf"):
        influence(A, torch.full((n, 2), float("nan"), dtype=DT), torch.ones(n, dtype=DT), 0.1)


@pytest.mark.parametrize("method", ["minres", "cg"])
@pytest.mark.parametrize("scale", [1e-200, 1e-310, 1e200, 1e307])
def test_a_right_hand_side_at_the_edge_of_the_dtype(method, scale):
    """``b`` scaled to ``1e-200`` (its squared norm underflows to zero) or ``1e307`` (overflows) came back as
    ``x = 0`` marked converged, with a relative residual of 0 or NaN. Each column is scaled by a power of two
    first (exact): the solution is ``scale`` times the unscaled one, its true residual finite."""
    g = torch.Generator().manual_seed(0)
    M = torch.randn(40, 40, generator=g, dtype=torch.float64)
    A = M @ M.T + 40 * torch.eye(40, dtype=torch.float64)
    b = torch.randn(40, generator=g, dtype=torch.float64)
    r = solve(A, scale * b, tol=1e-10, method=method)
    want = torch.linalg.solve(A, b)
    assert r.converged and 0 < r.relative_residual <= 1e-10 and math.isfinite(r.residual_norm)
    assert float((r.x / scale - want).norm() / want.norm()) <= 1e-9
