"""Loss-landscape convergence (Theorem 7): running-mean and Taylor identities, per-sample
closed-form Hessians against blockhess.hessian / torch.func, spectral norms, smoothing and
fits, and the ``blockhess convergence`` driver on a tiny synthetic model."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

import blockhess as bh
from blockhess import convergence as cv
from blockhess import losses as bl

DT = torch.float64


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------- identities


def test_running_mean_and_difference_identity():
    l = torch.rand(50, generator=_gen(), dtype=DT) * 3
    L = cv.running_mean(l)
    explicit = torch.tensor([l[: k + 1].mean() for k in range(50)], dtype=DT)
    torch.testing.assert_close(L, explicit, rtol=1e-14, atol=1e-14)  # prefix means of 50 numbers in [0, 3]: rounding, 50 ε
    d = cv.loss_differences(l)
    assert d.shape == (49,)
    torch.testing.assert_close(d, L[1:] - L[:-1], rtol=1e-12, atol=1e-15)  # definition; a difference of two means: their rounding
    k = torch.arange(1, 50, dtype=DT)
    torch.testing.assert_close(d, (l[1:] - L[:-1]) / (k + 1), rtol=0, atol=0)  # the identity, computed so: bitwise


def test_hessian_running_mean_identity():
    H = torch.randn(12, 5, 5, generator=_gen(1), dtype=DT)
    Hk = cv.running_mean(H, dim=0)
    for k in range(1, 12):  # H^(k+1) - H^(k) = (H_{k+1} - mean_{i<=k} H_i)/(k+1)
        rhs = (H[k] - H[:k].mean(0)) / (k + 1)
        torch.testing.assert_close(Hk[k] - Hk[k - 1], rhs, rtol=1e-12, atol=1e-14)  # a difference of running means: rounding


def _quadratic_problem(N=40, n=6, seed=2):
    g = _gen(seed)
    A = torch.randn(N, n, n, generator=g, dtype=DT)
    A = A @ A.transpose(1, 2) / n + 0.1 * torch.eye(n, dtype=DT)  # per-sample Hessians
    a = torch.randn(N, n, generator=g, dtype=DT)  # per-sample minimisers
    c = torch.rand(N, generator=g, dtype=DT)

    def losses_at(w):  # l_i(w) = c_i + (w - a_i)^T A_i (w - a_i) / 2
        r = w[None] - a
        return c + 0.5 * torch.einsum("ni,nij,nj->n", r, A, r)

    # w*: minimiser of the mean loss
    w_star = torch.linalg.solve(A.sum(0), torch.einsum("nij,nj->i", A, a))
    grads = torch.einsum("nij,nj->ni", A, w_star[None] - a)
    return losses_at, w_star, grads, A


def test_taylor_difference_exact_for_quadratic_loss():
    losses_at, w_star, grads, A = _quadratic_problem()
    N, n = grads.shape
    order = cv.random_orderings(N, 7, seed=3)
    for scale in (1e-3, 0.3, 3.0):
        delta = scale * torch.randn(n, generator=_gen(4), dtype=DT)
        actual = cv.ordering_differences(losses_at(w_star + delta), order)
        l0 = losses_at(w_star)
        pred = cv.ordering_differences(
            cv.taylor_losses(l0, grads @ delta, torch.einsum("i,nij,j->n", delta, A, delta)), order
        )
        # exact for a quadratic loss: the rule; atol: differences that cancel to ~0, to the losses' (O(1)) rounding
        torch.testing.assert_close(pred, actual, rtol=1e-10, atol=1e-12)
        # the paper's literal form (running mean of the Hessian matrices) agrees, in one order
        o = order[0]
        paper = cv.taylor_difference_paper(l0[o], A[o], delta, grads[o])
        torch.testing.assert_close(paper, actual[0], rtol=1e-10, atol=1e-12)
        # without the gradient term (Assumption 1) it misses exactly (g_{k+1} - gbar_k)^T delta/(k+1)
        no_grad = cv.taylor_difference_paper(l0[o], A[o], delta)
        torch.testing.assert_close(actual[0] - no_grad, cv.loss_differences(grads[o] @ delta), rtol=1e-10, atol=1e-12)


def test_theorem7_bound_holds_for_quadratic_losses_and_is_tight_in_k():
    losses_at, w_star, grads, A = _quadratic_problem(N=60)
    N, n = grads.shape
    l0 = losses_at(w_star)
    M = float(torch.linalg.matrix_norm(A, ord=2).max())
    order = cv.random_orderings(N, 20, seed=5)
    k = torch.arange(1, N, dtype=DT)
    for scale in (0.0, 0.1, 1.0):
        delta = scale * torch.randn(n, generator=_gen(6), dtype=DT)
        d = cv.ordering_differences(losses_at(w_star + delta), order).abs()
        bound = cv.theorem7_bound(k, float(l0.max()), M, float(delta.norm()))
        assert (d <= bound).all()
    torch.testing.assert_close(cv.theorem7_bound(torch.tensor([1.0, 3.0]), 2.0, 4.0, 0.5), torch.tensor([2.5, 1.25], dtype=DT))
    with pytest.raises(ValueError):
        cv.theorem7_bound(torch.tensor([0.0]), 1.0, 1.0)
    with pytest.raises(ValueError):
        cv.theorem7_bound(torch.tensor([1.0]), -1.0, 1.0)


def test_batch_running_mean_matches_paper_procedure():
    l = torch.rand(37, generator=_gen(7), dtype=DT)
    n, delta = cv.batch_running_mean(l, batch_size=1, epochs=1, seed=0)
    perm = torch.randperm(37, generator=_gen(0))
    torch.testing.assert_close(delta, cv.loss_differences(l[perm]).abs(), rtol=1e-12, atol=1e-15)  # the same sums: rounding
    torch.testing.assert_close(n, torch.arange(2, 38, dtype=DT))
    n, delta = cv.batch_running_mean(l, batch_size=10, epochs=3, seed=1)
    assert n.tolist() == [20, 30, 37, 47, 57, 67, 74, 84, 94, 104, 111]  # last short batch kept
    assert delta.shape == n.shape and (delta >= 0).all()
    with pytest.raises(ValueError):
        cv.batch_running_mean(l, 0)


def test_ema_and_slope_fits():
    x = torch.tensor([1.0, 0.0, 0.0, 4.0], dtype=DT)
    torch.testing.assert_close(cv.ema(x, 0.5), torch.tensor([1.0, 0.5, 0.25, 2.125], dtype=DT))
    k = torch.arange(1, 5001, dtype=DT)
    y = 3.0 * k**-1.0
    fit = cv.loglog_slope(k, y, 10, 5000)
    assert abs(fit["slope"] + 1) < 1e-12 and abs(fit["intercept"] - math.log(3.0)) < 1e-10  # an exact power law: the fit's rounding
    kb, ys = cv.log_ema(k, y, alpha=0.5)
    assert abs(cv.loglog_slope(kb, ys, 10, 5000)["slope"] + 1) < 0.02  # log-grid EMA keeps the slope
    # an index EMA does not (the reason for log_ema): it bends c/k where k ~ 1/alpha
    assert abs(cv.loglog_slope(k, cv.ema(y, 0.02), 10, 5000)["slope"] + 1) > 0.1
    with pytest.raises(ValueError):
        cv.ema(x, 0.0)
    with pytest.raises(ValueError):
        cv.loglog_slope(k[:2], y[:2])


def test_ordered_differences_of_random_losses_scale_as_one_over_k():
    # the 1/k law follows from the running-mean identity for ANY losses in random order
    l = torch.distributions.Exponential(3.0).sample((400,)) ** 2
    d = cv.ordering_differences(l, cv.random_orderings(400, 300, seed=0)).abs().mean(0)
    k = torch.arange(1, 400, dtype=DT)
    kb, ys = cv.log_ema(k, d)
    assert -1.15 < cv.loglog_slope(kb, ys, 10, 399)["slope"] < -0.85


def test_gradient_norms_running_mean():
    g = torch.randn(30, 4, generator=_gen(8), dtype=DT)
    o = cv.random_orderings(30, 2, seed=1)
    out = cv.gradient_norms(g, o)
    assert out.shape == (2, 30)
    torch.testing.assert_close(out[1, 9], g[o[1, :10]].mean(0).norm())
    torch.testing.assert_close(out[0, -1], g.mean(0).norm())


# --------------------------------------------------------------------------- closed form per sample


def _small(seed=0, L=5, B=4):
    cfg = bh.BlockConfig(d_model=4, d_ff=6, d_k=3)
    p = bh.init_params(cfg, seed=seed)
    X = torch.randn(B, L, 4, generator=_gen(seed + 10), dtype=DT)
    Wh = torch.randn(4, 3, generator=_gen(seed + 11), dtype=DT)

    def head(Z, y):
        return torch.nn.functional.cross_entropy((Z.mean(0) @ Wh)[None], y[None])

    return cfg, p, X, head


@pytest.mark.parametrize("kind", ["mse", "ce", "head"])
def test_per_sample_hessians_match_batch_of_one(kind):
    cfg, p, X, head = _small()
    B, L, d = X.shape
    if kind == "mse":
        loss, tgt = "mse", torch.randn(B, L, d, generator=_gen(3), dtype=DT)
    elif kind == "ce":
        loss, tgt = "ce", torch.randint(0, d, (B, L), generator=_gen(3))
    else:
        loss, tgt = head, torch.tensor([0, 2, 1, 1])
    H = cv.per_sample_hessians(p, X, cfg, loss=loss, target=tgt)
    G = cv.per_sample_gradients(p, X, cfg, loss=loss, target=tgt)
    ls = cv.per_sample_losses(p, X, cfg, loss=loss, target=tgt)
    n = sum(v.numel() for v in p.values())
    assert H.shape == (B, n, n) and G.shape == (B, n) and ls.shape == (B,)
    for i in range(B):
        ref = bh.reference.hessian(p, X[i], cfg, loss=loss, target=tgt[i]).dense()
        assert (H[i] - ref).norm() / ref.norm() < 1e-10
        closed = bh.hessian(p, X[i], cfg, loss=loss, target=tgt[i]).dense()
        assert (H[i] - closed).norm() / closed.norm() < 1e-10

        def li(flat, i=i):
            Z = bh.reference.forward(cv.perturb(p, flat, cfg), X[i : i + 1], cfg)
            return bl.value(loss, tgt[i : i + 1], Z)

        zero = torch.zeros(n, dtype=DT)
        g_ref = torch.func.grad(li)(zero)
        assert (G[i] - g_ref).norm() / g_ref.norm() < 1e-10
        assert abs(float(ls[i] - li(zero))) <= 1e-10 * abs(float(li(zero)))
    # the batch Hessian is the mean of the per-sample ones
    batch = bh.reference.hessian(p, X, cfg, loss=loss, target=tgt).dense()
    assert (H.mean(0) - batch).norm() / batch.norm() < 1e-10


@pytest.mark.parametrize("cfg", [
    bh.BlockConfig(d_model=4, d_ff=6, n_heads=2, bias=True, out_proj=True, ln_affine=True, ln_eps=1e-5,
                   activation="gelu", norm="pre", causal=True),
    bh.BlockConfig(d_model=4, d_k=3, kind="attention"),
], ids=["pre-ln-extended", "attention"])
def test_per_sample_hessians_other_configs(cfg):
    p = bh.init_params(cfg, seed=1)
    X = torch.randn(3, 5, 4, generator=_gen(12), dtype=DT)
    y = torch.randint(0, 4, (3, 5), generator=_gen(13))
    H = cv.per_sample_hessians(p, X, cfg, loss="ce", target=y)
    for i in range(3):
        ref = bh.reference.hessian(p, X[i], cfg, loss="ce", target=y[i]).dense()
        assert (H[i] - ref).norm() / ref.norm() < 1e-10
    # the flat layout of perturb/unit_directions is blockhess.hessian's, whatever the dict order
    shuffled = dict(reversed(list(p.items())))
    U = cv.unit_directions(shuffled, cfg, 1)[0]
    q = cv.perturb(shuffled, U, cfg)
    flat = torch.cat([(q[k] - p[k]).reshape(-1) for k in bh.param_shapes(cfg)])
    torch.testing.assert_close(flat, U)


def test_per_sample_hessians_name_the_sequence_with_a_bad_loss_derivative():
    """A callable loss whose derivatives are Inf for one sequence: the error names that
    sequence, as blockhess.hessian does (the derivatives are taken for the whole batch)."""
    cfg, p, X, _ = _small()

    def loss(Z, t):
        return Z.sum() / t

    t = torch.tensor([1.0, 1.0, 0.0, 1.0], dtype=DT)
    for f in (cv.per_sample_hessians, bh.hessian):
        with pytest.raises(ValueError, match="NaN or Inf value, gradient or Hessian w.r.t. Z at sequence 2"):
            f(p, X, cfg, loss=loss, target=t)


def test_per_sample_statistics_and_taylor_on_a_block():
    cfg, p, X, head = _small(seed=1, B=6)
    y = torch.tensor([0, 1, 2, 0, 1, 2])
    U = cv.unit_directions(p, cfg, 2, seed=0)
    st = cv.per_sample_statistics(p, X, cfg, loss=head, target=y, directions=U, chunk_size=4, keep_grads=True)
    H = cv.per_sample_hessians(p, X, cfg, loss=head, target=y)
    # the rule; atol: quadratic forms that cancel to ~0, to the rounding of the Hessians' scale
    torch.testing.assert_close(st.spectral, torch.linalg.eigvalsh(H).abs().amax(-1), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(st.quad, torch.einsum("dj,bjk,dk->bd", U, H, U), rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(st.grad_dot, st.grads @ U.T)
    # the quadratic model's error is third order: halving delta divides it by ~8
    errs = []
    for eps in (1e-2, 5e-3):
        actual = cv.per_sample_losses(cv.perturb(p, eps * U[0], cfg), X, cfg, loss=head, target=y)
        pred = cv.taylor_losses(st.loss, eps * st.grad_dot[:, 0], eps**2 * st.quad[:, 0])
        errs.append(float((pred - actual).abs().max()))
    assert 5 < errs[0] / errs[1] < 11


def test_spectral_norm_lanczos():
    g = _gen(9)
    Qm, _ = torch.linalg.qr(torch.randn(300, 300, generator=g, dtype=DT))
    ev = torch.linspace(-3, 2, 300, dtype=DT)
    A = torch.stack([Qm @ torch.diag(ev) @ Qm.T, Qm @ torch.diag(ev.flip(0) * 0.5) @ Qm.T])
    sn = cv.spectral_norm(A, iters=80)
    torch.testing.assert_close(sn.norm, torch.tensor([3.0, 1.5], dtype=DT), rtol=1e-10, atol=0)  # 80 steps: measured 2e-11
    # a rank-2 matrix: the Krylov space closes after 2 steps (breakdown path)
    v = torch.randn(300, 2, generator=g, dtype=DT)
    R = v @ torch.diag(torch.tensor([5.0, -7.0], dtype=DT)) @ v.T
    exact = torch.linalg.eigvalsh(R).abs().max()
    torch.testing.assert_close(cv.spectral_norm(R, iters=20).norm, exact, rtol=1e-10, atol=0)
    with pytest.raises(ValueError):
        cv.spectral_norm(torch.zeros(3, 4))
    with pytest.raises(ValueError, match="iters must be an int >= 1"):
        cv.spectral_norm(A, iters=0)


def test_spectral_norm_ritz_value_is_a_lower_bound():
    """A Ritz value never exceeds ||H||_2, at any number of steps; its residual bounds the distance to
    some eigenvalue only, so with few steps norm + residual can fall short of ||H||_2 (documented)."""
    short = 0
    for seed in range(6):
        A = torch.randn(100, 100, generator=_gen(seed), dtype=DT)
        A = A + A.T - 30 * torch.eye(100, dtype=DT)
        exact = torch.linalg.eigvalsh(A).abs().max()
        for iters in (3, 6, 12):
            sn = cv.spectral_norm(A, iters=iters)
            assert sn.norm <= exact * (1 + 1e-12)
            short += bool(sn.norm + sn.residual < exact)
    assert short > 0


# --------------------------------------------------------------------------- the driver


def _fake_vit(N=60):
    cfg = bh.BlockConfig(d_model=4, d_ff=6)
    p = bh.init_params(cfg, seed=3)
    g = _gen(5)
    imgs = torch.randn(N, 5, 4, generator=g, dtype=DT)
    Wh = torch.randn(4, 3, generator=g, dtype=DT)

    def head(Z, y):
        return torch.nn.functional.cross_entropy((Z.mean(0) @ Wh.to(Z.dtype))[None], y[None])

    labels = torch.randint(0, 3, (N,), generator=g)
    return SimpleNamespace(
        cfg=cfg,
        block_params=lambda dtype=DT: {k: v.to(dtype) for k, v in p.items()},
        embed=lambda images, dtype=DT: images.to(dtype),
        head_loss=head,
        train_images=imgs,
        train_labels=labels,
        test_accuracy=float("nan"),
    )


def test_driver_writes_json_and_figures(tmp_path):
    from blockhess_lab import convergence as exp

    out = tmp_path / "conv"
    settings = exp.Settings(
        orderings=50, hessian_samples=24, directions=2, deltas=(1e-3, 1e-2), batch_size=4, epochs=3,
        chunk_size=8, gradient_seeds=(1, 2), k_min=5,
    )
    res = exp.run_experiment(_fake_vit(), out, settings, quiet=True)
    data = json.loads((out / "convergence.json").read_text())
    assert data["slope"] == res["slope"] and -1.5 < data["slope"] < -0.5
    assert isinstance(data["bound_holds"], bool) and data["bound_holds"]
    for key in ("taylor", "theorem7", "assumption1", "series", "batch"):
        assert key in data
    assert {p.name for p in out.glob("*.png")} >= {"differences.png", "bound.png", "taylor.png", "assumption1.png",
                                                    "spectra.png"}
    assert not list(tmp_path.glob(".conv*"))  # no temporary folder left behind
    # the delta-0 row is on the Hessian set (its L_max), the all-sample margin separate; the note says so
    t7 = data["theorem7"]
    assert t7["hessian_samples"] == 24 and "rows[0]" in t7["note"] and "24 of the 60" in t7["note"]
    assert t7["rows"][0]["bound_times_k_plus_1"]["exact"] == pytest.approx(2 * t7["loss_max_hessian_set"])
    assert data["run"]["preset"] in ("quick", "full") and data["run"]["overrides"]
    # the markdown carries the key numbers of the JSON
    md = (out / "convergence.md").read_text()
    assert md.startswith("# Loss-landscape convergence")
    for number in (f"{data['slope']:.3f}", f"{t7['M_exact']:.4g}", f"{t7['margin_w_star_all_samples']:.5g}",
                   "24 of the 60 training images", "`--quick`"):
        assert number in md, number
    assert md.count("\n| ") >= len(t7["rows"]) + len(data["taylor"]["rows"])


def test_describe_run_names_the_preset():
    from blockhess_lab import convergence as exp

    assert exp.describe_run(exp.QUICK) == {"preset": "quick", "overrides": {}}
    assert exp.describe_run(exp.Settings()) == {"preset": "full", "overrides": {}}
    r = exp.describe_run(exp.replace(exp.QUICK, orderings=7))
    assert r == {"preset": "quick", "overrides": {"orderings": 7}}


def test_cli_bad_input_exits_2(tmp_path, capsys, monkeypatch):
    from blockhess_lab import cli

    assert cli.COMMANDS.get("convergence") == "convergence"
    monkeypatch.setattr(cli, "COMMANDS", {"convergence": "convergence"})  # only this command's module
    rc = cli.main(["convergence", "--out", str(tmp_path / "x"), "--orderings", "0"])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("blockhess convergence: error:")


def test_module_doctest():
    import doctest

    assert doctest.testmod(cv).failed == 0


def test_argument_checks():
    with pytest.raises(ValueError, match="ascending"):
        cv.loglog_slope(torch.tensor([3.0, 1.0, 2.0, 4.0]), torch.ones(4))
    with pytest.raises(ValueError, match="n_samples must be an int >= 1, got 2.5"):
        cv.random_orderings(2.5, 3)
    for call in (lambda: cv.random_orderings(4, 3, seed=0.5), lambda: cv.batch_running_mean(torch.ones(4), 2, seed=-1),
                 lambda: cv.unit_directions(bh.init_params(bh.BlockConfig(d_model=4, d_ff=6)), bh.BlockConfig(d_model=4, d_ff=6), 2, seed=0.5)):
        with pytest.raises(ValueError, match="seed must be an int >= 0"):
            call()
    cfg = bh.BlockConfig(d_model=4, d_ff=6)
    p = bh.init_params(cfg, seed=0)
    with pytest.raises(ValueError, match="delta contains NaN"):
        cv.perturb(p, torch.full((96,), float("nan"), dtype=torch.float64), cfg)
    X = torch.randn(2, 3, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="lanczos_iters must be an int >= 1"):
        cv.per_sample_statistics(p, X, cfg, loss="mse", target=torch.zeros_like(X), lanczos_iters=0)


@pytest.mark.parametrize("per_sample", [True, False])  # the CPU's way, and the GPU's (one bmm), both run here
def test_lanczos_products_either_way(per_sample):
    from blockhess.linalg import batched_matvec

    A = torch.randn(3, 7, 7, dtype=DT)
    q = torch.randn(3, 7, dtype=DT)
    assert torch.allclose(batched_matvec(A, q, per_sample), torch.einsum("bij,bj->bi", A, q), rtol=1e-14, atol=1e-14)  # sums of 7: rounding
