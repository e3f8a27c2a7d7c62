"""The loss Hessian (eq. 10): closed form against torch.func in float64, and its identities."""

import importlib

import pytest
import torch

import blockhess as bh

from conftest import (assert_blocks_close, assert_close, assert_float32_hessian, assert_identities, blocks_of, make_case,
                      rounding)
from settings import KINDS, LOSSES, make_target


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("loss", list(LOSSES))
def test_against_autograd(grid_case, kind, loss):
    L, d, dk, dff, batch, scale = grid_case
    cfg, p, X, g = make_case(L, d, dk, dff, batch, scale, kind=kind)
    T = make_target(loss, X, g, d)
    H = bh.hessian(p, X, cfg, loss=LOSSES[loss], target=T)
    R = bh.reference.hessian(p, X, cfg, loss=LOSSES[loss], target=T)
    n = sum(v.numel() for v in p.values())
    assert H.names == tuple(p) and H.dense().shape == (n, n)
    s = R.dense().norm().item()
    assert_close(H.dense(), R.dense(), what="full")
    assert_close(H.outer.dense(), R.outer.dense(), scale=s, what="outer")  # scale: a part is zero only to the whole's rounding
    assert_close(H.functional.dense(), R.functional.dense(), scale=s, what="functional")
    for a in p:  # block access, both orders
        for b in p:
            assert torch.equal(H[a, b], H.dense()[_sl(H, a), _sl(H, b)])
    stored = dict(H.items())  # each unordered pair once, in names order
    assert list(stored) == H.pairs() == [(a, b) for i, a in enumerate(H.names) for b in H.names[i:]]
    assert all(torch.equal(block, H[a, b]) for (a, b), block in stored.items())


def _sl(H, name):
    i = H.names.index(name)
    start = sum(H.sizes[:i])
    return slice(start, start + H.sizes[i])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("loss", list(LOSSES))
def test_identities(kind, loss):
    cfg, p, X, g = make_case(4, 5, 3, 6, 3, 1.0, kind=kind)
    H = bh.hessian(p, X, cfg, loss=LOSSES[loss], target=make_target(loss, X, g, 5))
    D = H.dense()
    # symmetric; outer + functional (separate passes) == full (fused pass); MSE and CE are convex
    # in Z: the Gauss-Newton term is PSD
    assert_identities(H, convex=loss != "custom")
    if kind == "attention":
        assert torch.count_nonzero(H.functional["W_V", "W_V"]) == 0  # F is linear in W_V
    else:
        assert torch.linalg.eigvalsh(D).min() < 0 or loss == "ce"  # the functional term breaks convexity


@pytest.mark.parametrize("wrt", [["W_V"], ["W_2", "W_Q"], "W_1"])
def test_wrt_selects_blocks(wrt):
    cfg, p, X, g = make_case(3, 4, 2, 5, 2, 1.0)
    T = torch.randn(X.shape, generator=g, dtype=torch.float64)
    full = bh.hessian(p, X, cfg, loss="mse", target=T)
    part = bh.hessian(p, X, cfg, loss="mse", target=T, wrt=wrt)
    names = [n for n in p if n in ([wrt] if isinstance(wrt, str) else wrt)]
    assert list(part.names) == names
    assert_blocks_close(blocks_of(part, full), what="wrt")  # zero blocks (none here): the whole's rounding
    assert_blocks_close(blocks_of(part.outer, full.outer), what="wrt outer")


def test_batch_is_mean_of_sequences():
    cfg, p, X, g = make_case(3, 4, 2, 5, 3, 1.0)
    T = torch.randn(X.shape, generator=g, dtype=torch.float64)
    H = bh.hessian(p, X, cfg, loss="mse", target=T).dense()
    per = sum(bh.hessian(p, X[b], cfg, loss="mse", target=T[b]).dense() for b in range(3)) / 3
    assert_close(H, per, what="batch mean")


@pytest.mark.parametrize("loss", list(LOSSES))
def test_batch_in_passes(loss, monkeypatch):
    """A batch too large for one pass is summed over passes of a few sequences (7 = 3 + 3 + 1):
    the same Hessian and parts as one pass, against autograd; errors still name the batch's
    own sequence and row."""
    hess_mod = importlib.import_module("blockhess.hessian")  # the module (bh.hessian is the function)
    cfg, p, X, g = make_case(3, 4, 2, 5, 7, 1.0, ln_eps=1e-5)
    T = make_target(loss, X, g, 4)
    whole = bh.hessian(p, X, cfg, loss=LOSSES[loss], target=T)
    n = sum(v.numel() for v in p.values())
    names = tuple(p)
    per_sequence = 8 * hess_mod._sequence_entries(cfg, X, LOSSES[loss], names)
    monkeypatch.setattr(hess_mod, "PASS_BYTES", 3 * per_sequence)
    assert hess_mod._chunks(cfg, X, LOSSES[loss], names) == [slice(0, 3), slice(3, 6), slice(6, 7)]
    assert hess_mod._chunks(cfg, X, LOSSES[loss], ("X",) + names) == [slice(None)]  # X blocks span the batch
    H = bh.hessian(p, X, cfg, loss=LOSSES[loss], target=T)
    R = bh.reference.hessian(p, X, cfg, loss=LOSSES[loss], target=T)
    s = R.dense().norm().item()
    for part in (lambda h: h, lambda h: h.outer, lambda h: h.functional):
        # the same sums split over passes: only their order differs (tol: conftest.rounding)
        assert_close(part(H).dense(), part(whole).dense(), scale=s, tol=rounding(whole.dense()), what="passes vs one pass")
        assert_close(part(H).dense(), part(R).dense(), scale=s, what="passes vs autograd")
    Xbad = X.clone()
    Xbad[5, 1] = Xbad[5, 1].mean()  # a zero-variance LayerNorm-1 row, in the second pass, with eps 0
    cfg0 = bh.BlockConfig(d_model=4, d_ff=5, d_k=2)
    p0 = {**p, "W_V": torch.zeros_like(p["W_V"])}  # X + SA(X) = X: the row stays constant
    out = torch.full((n, n), 7.0, dtype=X.dtype)
    with pytest.raises(ValueError, match=r"row \(5, 1\) has zero variance"):
        bh.hessian(p0, Xbad, cfg0, loss=LOSSES[loss], target=T, out=out)
    assert bool((out == 7.0).all())  # every pass is checked before anything is written
    if loss == "custom":
        Tbad = T.clone()
        Tbad[4] = float("nan")
        with pytest.raises(ValueError, match="at sequence 4"):
            bh.hessian(p, X, cfg, loss=LOSSES[loss], target=Tbad, out=out)
        assert bool((out == 7.0).all())
    # wrt as an iterator (read once), over passes and in the parts
    Hw = bh.hessian(p, X, cfg, loss=LOSSES[loss], target=T, wrt=(w for w in ("W_1", "W_Q")))
    assert Hw.names == ("W_Q", "W_1") and Hw.outer.names == Hw.names
    assert_close(Hw.outer.dense() + Hw.functional.dense(), Hw.dense(), scale=s, tol=rounding(Hw.dense()), what="wrt iterator parts")


@pytest.mark.parametrize("loss", list(LOSSES))
def test_float32_as_close_as_float32_autograd(loss):
    """float32: the full Hessian and both parts within 3x of float32 torch.func's error on the same
    inputs, against the float64 reference (conftest.assert_float32_close)."""
    cfg, p, X, g = make_case(4, 6, 3, 8, 2, 1.0)
    assert_float32_hessian(p, X, cfg, loss=LOSSES[loss], target=make_target(loss, X, g, 6))


def test_custom_loss_per_sequence_target():
    """A callable gets one sequence and its own target; pooled-head CE has a rank-deficient Z-Hessian."""
    cfg, p, X, g = make_case(4, 5, 2, 6, 3, 1.0)
    W_h = torch.randn(5, 3, generator=g, dtype=torch.float64)

    def head(Z, y):
        return torch.nn.functional.cross_entropy((Z.mean(0) @ W_h)[None], y[None])

    y = torch.tensor([0, 2, 1])
    H = bh.hessian(p, X, cfg, loss=head, target=y)
    R = bh.reference.hessian(p, X, cfg, loss=head, target=y)
    assert_close(H.dense(), R.dense(), what="head CE")
    assert_close(H.outer.dense(), R.outer.dense(), what="head CE outer")


@pytest.mark.parametrize("kind", ["pooled-head", "confident-head", "full-rank"])
def test_custom_loss_long_sequences(kind, monkeypatch):
    """L·d = 64: a callable loss's 64 × 64 Hessians w.r.t. the block output, of rank 3 (a pooled head
    over 4 classes; one sequence classified at p = 1 - 5e-11, its curvature far below the others')
    or full rank. Their eigen-directions above rounding are found by a sketch of the range or by
    the whole eigendecomposition (docs/derivations.md §7); which one a call takes may depend on
    rounding noise at the cut (the Jacobian-scaled cut of these heads has eigenvalues at 0.98 and
    1.02 of it), so of the machine's BLAS, and is not asserted. Asserted: the Hessian and both parts
    equal the reference, either way (the sketch also turned off: the whole eigendecomposition, to
    rounding of the default); a pooled head's Gauss–Newton part has the loss's rank, 3 per sequence."""
    import blockhess.linalg as linalg

    cfg, p, X, g = make_case(8, 8, 3, 5, 3, 1.0)
    W_h = torch.randn(8, 4, generator=g, dtype=torch.float64) * (8.0 if kind == "confident-head" else 1.0)  # 8: one sequence at p = 1 - 5e-11

    def loss(Z, y):
        if kind == "full-rank":
            return torch.log1p(Z**2).sum() + (Z[:, :1] * Z).sum()
        return torch.nn.functional.cross_entropy((Z.mean(0) @ W_h)[None], y[None])

    y = torch.tensor([0, 3, 1])
    H = bh.hessian(p, X, cfg, loss=loss, target=y)
    R = bh.reference.hessian(p, X, cfg, loss=loss, target=y)
    s = R.dense().norm().item()
    assert_close(H.dense(), R.dense(), what=kind)
    assert_close(H.outer.dense(), R.outer.dense(), what=f"{kind} outer")
    assert_close(H.functional.dense(), R.functional.dense(), scale=s, what=f"{kind} functional")
    monkeypatch.setattr(linalg, "RANGE_PROBE", 64)  # 2p > L·d: no sketch, the whole 64 × 64 eigendecomposition
    W = bh.hessian(p, X, cfg, loss=loss, target=y)
    for part in (lambda h: h, lambda h: h.outer, lambda h: h.functional):
        assert_close(part(W).dense(), part(R).dense(), scale=s, what=f"{kind}, whole eigendecomposition")
        assert_close(part(W).dense(), part(H).dense(), scale=s, tol=rounding(H.dense()), what=f"{kind}, either way")
    if kind == "pooled-head":  # Σ_b J_bᵀ Ω_b J_b with rank(Ω_b) = 3: rank 9, the rest at rounding
        lam = torch.linalg.eigvalsh(H.outer.dense()).abs().sort(descending=True).values
        assert float(lam[9]) <= rounding(H.dense()) * float(lam[0]) < float(lam[8]), lam[:10]


def test_custom_loss_input_blocks_per_sequence():
    """With X a variable each sequence's (X, X) block is its own: a sequence whose loss is
    weighted by 1e-13 keeps its curvature to its own rounding, not the batch's."""
    cfg, p, X, g = make_case(8, 8, 3, 5, 2, 1.0)
    W_h = torch.randn(8, 4, generator=g, dtype=torch.float64)

    def loss(Z, w):
        return w * torch.nn.functional.cross_entropy((Z.mean(0) @ W_h)[None], torch.tensor([2]))

    w = torch.tensor([1.0, 1e-13], dtype=torch.float64)
    H = bh.hessian(p, X, cfg, loss=loss, target=w, wrt_input=True)
    R = bh.reference.hessian(p, X, cfg, loss=loss, target=w, wrt_input=True)
    for b in range(2):
        assert_close(H["X", "X"].reshape(2, 64, 2, 64)[b, :, b], R["X", "X"].reshape(2, 64, 2, 64)[b, :, b],
                     what=f"(X, X) block of sequence {b}")
    assert_close(H.dense(), R.dense(), what="all blocks")


def _unequal_sequences(scales, dtype):
    """The bare attention layer (d = 4, L = 3) on two sequences at input ``scales``; the loss
    ``w_b ||Z||²`` weights them by a per-sequence target."""
    cfg = bh.BlockConfig(kind="attention", d_model=4)
    p = bh.init_params(cfg, seed=0)
    X = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    X = X * torch.tensor(scales, dtype=torch.float64)[:, None, None]
    return cfg, p, X, lambda Z, w: w * (Z**2).sum()


def test_custom_loss_batch_of_unequal_jacobians_float64():
    """Sequences whose loss Hessians are of very different sizes (weights 1 and 1e-16) and whose
    Jacobians are too (inputs at 1e-5 and 1e5): the small loss Hessian's sequence dominates the
    batch Hessian, so its eigen-directions are judged at its own scale, not the batch's."""
    cfg, p, X, loss = _unequal_sequences((1e-5, 1e5), torch.float64)
    w = torch.tensor([1.0, 1e-16], dtype=torch.float64)
    H, R = (f(p, X, cfg, loss=loss, target=w) for f in (bh.hessian, bh.reference.hessian))
    assert_close(H.dense(), R.dense(), what="batch")
    assert_close(H.outer.dense(), R.outer.dense(), what="outer")
    single = sum(bh.hessian(p, X[b], cfg, loss=loss, target=w[b]).dense() for b in range(2)) / 2
    assert_close(H.dense(), single, what="batch vs the mean of its sequences")


def test_custom_loss_batch_of_unequal_jacobians_float32():
    """float32, inputs at scales 1 and 3, weights 1 and 1e-7: within 3x of the error float32
    torch.func makes on the same inputs against the float64 reference."""
    cfg, p, X, loss = _unequal_sequences((1.0, 3.0), torch.float64)
    w = torch.tensor([1.0, 1e-7], dtype=torch.float64)
    R = bh.reference.hessian(p, X, cfg, loss=loss, target=w).dense()
    p32, X32, w32 = {k: v.float() for k, v in p.items()}, X.float(), w.float()
    H = bh.hessian(p32, X32, cfg, loss=loss, target=w32).dense().double()
    R32 = bh.reference.hessian(p32, X32, cfg, loss=loss, target=w32).dense().double()
    err, own = float((H - R).norm() / R.norm()), float((R32 - R).norm() / R.norm())
    assert err <= 3 * own, f"closed form {err:.2e} vs float32 torch.func {own:.2e}"


@pytest.mark.parametrize("rank", [5, 32, 33, 100])
def test_loss_hessian_factorisation(rank, monkeypatch):
    """``Ω_b = Σ λ w wᵀ`` to rounding; low rank goes through a 16-column range, 33 through 64
    columns, full rank through an m × m eigh; a sequence at 1e-12 of the batch's scale keeps its
    directions to its own rounding, rounding-level noise adds none."""
    from blockhess.linalg import eig_lowrank

    B, m = 4, 160
    g = torch.Generator().manual_seed(rank)
    A = torch.randn(B, m, rank, generator=g, dtype=torch.float64)
    hess = (A * torch.randn(rank, generator=g, dtype=torch.float64)) @ A.mT  # indefinite
    hess[1] *= 1e-12
    sizes, eigh = [], torch.linalg.eigh
    monkeypatch.setattr(torch.linalg, "eigh", lambda M: sizes.append(M.shape[-1]) or eigh(M))
    lam, W = eig_lowrank(hess)
    # rank 32 fills a 32-column sketch (no slack left), so it is taken at 64
    assert sizes in {5: ([16],), 32: ([32, 64], [64]), 33: ([64],), 100: ([m],)}[rank]
    assert lam.shape[1] == rank
    rebuilt = (W * lam[:, None, :]) @ W.mT
    assert_close(rebuilt, hess, tol=1e-13, what="batch")  # dropping the 1e-12 sequence would show
    assert_close(rebuilt[1], hess[1], tol=1e-12, what="the 1e-12 sequence")  # to its own rounding
    noise = torch.randn(B, m, m, generator=g, dtype=torch.float64)
    noisy = hess + 1e-15 * torch.linalg.matrix_norm(hess)[:, None, None] / m * (noise + noise.mT)
    assert eig_lowrank(noisy)[0].shape[1] == rank  # noise eigenvalues ~1e-15 ||Ω_b||, kept above eps


def test_loss_hessian_factorisation_keeps_small_real_directions_float32():
    """float32: directions of a confidently classified sequence, a few 1e-6 of the batch's largest
    eigenvalue, are kept, each sequence rebuilt to its own rounding (a cut at m eps of the
    batch's largest, 8e-6 here, dropped them, and the report's float32 batch came out 1e-4 off)."""
    from blockhess.linalg import eig_lowrank

    B, m, r = 4, 64, 3
    g = torch.Generator().manual_seed(5)
    Q = torch.linalg.qr(torch.randn(B, m, r, generator=g, dtype=torch.float64)).Q
    ev = torch.tensor([[1.0, 0.6, 0.3]] + [[6e-6, 4e-6, 2e-6]] * (B - 1), dtype=torch.float64)
    hess = ((Q * ev[:, None, :]) @ Q.mT).float()
    lam, W = eig_lowrank(hess)
    assert lam.shape[1] == r and bool((lam != 0).all())
    rebuilt = (W * lam[:, None, :]) @ W.mT
    for b in range(B):  # the cut's sqrt(m) eps s_b, twice: plus the float32 rounding of hess and of the product
        assert float((rebuilt[b] - hess[b]).norm() / hess[b].norm()) <= 2 * m**0.5 * torch.finfo(torch.float32).eps, b


def test_loss_hessian_factorisation_rank_above_the_first_sketch_float32():
    """Rank 24 > the first sketch's 16 columns, half of it small (2e-5 of the largest): the probe
    residuals (noise ~ m eps) cannot see the small half, the count of kept directions must."""
    from blockhess.linalg import eig_lowrank

    B, m = 2, 1024
    g = torch.Generator().manual_seed(6)
    Q = torch.linalg.qr(torch.randn(B, m, 24, generator=g, dtype=torch.float64)).Q
    ev = torch.cat([torch.ones(12), torch.full((12,), 2e-5)]).to(torch.float64).expand(B, 24).clone()
    ev[1, 2:] = 0  # the second sequence has rank 2: the batch's largest count decides
    hess = ((Q * ev[:, None, :]) @ Q.mT).float()
    lam, W = eig_lowrank(hess)
    assert lam.shape[1] == 24 and bool((lam[0] != 0).all())
    rebuilt = (W * lam[:, None, :]) @ W.mT
    assert float((rebuilt[0] - hess[0]).norm() / hess[0].norm()) < 1e-5  # the cut, sqrt(m) ε32 = 3.8e-6, kept the small half


@pytest.mark.parametrize("wrt, wrt_input", [(None, False), (["W_K", "W_1"], False), (None, True)])
def test_out_buffer_is_filled_and_returned(wrt, wrt_input):
    """``out=``: the same matrix as a fresh assembly, written into the given buffer (stale
    contents overwritten), ``.dense()`` is that buffer; reusable across calls."""
    cfg, p, X, g = make_case(3, 4, 3, 5, 2, 1.0)
    T = torch.randn(X.shape, generator=g, dtype=X.dtype)
    H = bh.hessian(p, X, cfg, target=T, wrt=wrt, wrt_input=wrt_input).dense()
    out = torch.full_like(H, float("nan"))
    for _ in range(2):
        got = bh.hessian(p, X, cfg, target=T, wrt=wrt, wrt_input=wrt_input, out=out)
        assert got.dense() is out
        assert torch.equal(out, H)
        out.fill_(1e300)


def test_out_buffer_errors():
    cfg, p, X, g = make_case(3, 4, 3, 5, None, 1.0)
    T = torch.randn(X.shape, generator=g, dtype=X.dtype)
    n = bh.hessian(p, X, cfg, target=T).dense().shape[0]
    with pytest.raises(ValueError, match=rf"out must be a contiguous \({n}, {n}\) tensor .* got shape \({n}, {n + 1}\)"):
        bh.hessian(p, X, cfg, target=T, out=torch.empty(n, n + 1, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous=False"):
        bh.hessian(p, X, cfg, target=T, out=torch.empty(n, n, dtype=torch.float64).T)
    with pytest.raises(ValueError, match="out must be torch.float64 on cpu like X, got torch.float32"):
        bh.hessian(p, X, cfg, target=T, out=torch.empty(n, n))
    with pytest.raises(ValueError, match="out must be a torch.Tensor, got ndarray"):
        bh.hessian(p, X, cfg, target=T, out=torch.empty(n, n, dtype=torch.float64).numpy())
    out = torch.empty(n, n, dtype=torch.float64, requires_grad=True)
    with pytest.raises(ValueError, match="out must not require grad"):
        bh.hessian(p, X, cfg, target=T, out=out)
    big = torch.empty(n * n + X.numel(), dtype=torch.float64)  # X lives in the same memory as out
    Xs = big[n * n :].view(X.shape).copy_(X)
    with pytest.raises(ValueError, match="out shares memory with X"):
        bh.hessian(p, Xs, cfg, target=T, out=big[: n * n].view(n, n))


def test_parts_do_not_follow_a_loss_or_target_changed_after_the_call():
    """The parts reuse the loss derivatives taken at the call: a callable's closed-over weights
    or an array target changed in place afterwards do not reach them."""
    import numpy as np

    cfg, p, X, g = make_case(3, 4, 2, 5, 3, 1.0)
    head = torch.randn(4, 3, generator=g, dtype=X.dtype)
    y = np.array([0, 2, 1])

    def loss(Z, t):
        return torch.nn.functional.cross_entropy((Z.mean(0) @ head)[None], t[None])

    H = bh.hessian(p, X, cfg, loss=loss, target=y)
    full = H.dense().clone()
    head.mul_(3.0)
    y[:] = [1, 1, 1]
    assert_close(H.outer.dense() + H.functional.dense(), full, what="parts after the head and target changed")
    Yce = np.zeros((3, 3), dtype=np.int64)
    Hce = bh.hessian(p, X, cfg, loss="ce", target=Yce)
    full = Hce.dense().clone()
    Yce[:] = 2
    assert_close(Hce.outer.dense() + Hce.functional.dense(), full, what="CE parts after the array target changed")


def test_parts_do_not_follow_later_in_place_changes():
    """``.outer`` / ``.functional`` are computed on first access, from the inputs as they were at the call."""
    cfg, p, X, g = make_case(3, 4, 3, 5, 2, 1.0)
    T = torch.randn(X.shape, generator=g, dtype=X.dtype)
    H = bh.hessian(p, X, cfg, target=T)
    full = H.dense().clone()
    p["W_Q"].add_(1.0)
    X.mul_(2.0)
    T.mul_(-3.0)  # the parts recompute the loss derivatives: from the target as it was
    assert_close(H.outer.dense() + H.functional.dense(), full, what="outer + functional after in-place changes")


def test_inputs_that_require_grad_are_used_detached():
    """Weights of a live module or an X built by autograd: the same result as plain tensors,
    with no autograd history and no warning (the closed forms write into buffers autograd
    cannot record)."""
    import warnings

    from blockhess import bounds, convergence

    cfg = bh.BlockConfig(d_model=4, d_ff=6)
    p = bh.init_params(cfg, seed=0)
    gen = torch.Generator().manual_seed(1)
    X, T = torch.randn(2, 3, 4, generator=gen, dtype=torch.float64), torch.randn(2, 3, 4, generator=gen, dtype=torch.float64)
    pg = {k: v.clone().requires_grad_() for k, v in p.items()}
    Xg, Tg = X.clone().requires_grad_(), T.clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        H = bh.hessian(pg, Xg, cfg, loss="mse", target=Tg)
        for part in ("dense", "outer", "functional"):
            got = H.dense() if part == "dense" else getattr(H, part).dense()
            want = bh.hessian(p, X, cfg, loss="mse", target=T)
            want = want.dense() if part == "dense" else getattr(want, part).dense()
            assert not got.requires_grad and torch.equal(got, want), part
        Hs = convergence.per_sample_hessians(pg, Xg, cfg, loss="mse", target=Tg)
        assert not Hs.requires_grad and torch.equal(Hs, convergence.per_sample_hessians(p, X, cfg, loss="mse", target=T))
        rows = bounds.spectral_bounds(pg, Xg[0], cfg, "mse", Tg[0])
        assert rows == bounds.spectral_bounds(p, X[0], cfg, "mse", T[0])


def test_ce_target_complex_is_refused():
    cfg = bh.BlockConfig(d_model=4, d_ff=6)
    X = torch.randn(2, 3, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="integer tensor of class indices"):
        bh.hessian(bh.init_params(cfg), X, cfg, loss="ce", target=torch.zeros(2, 3, dtype=torch.complex64))
    huge = torch.full((2, 3), 2**63, dtype=torch.uint64)  # wraps to a negative int64
    with pytest.raises(ValueError, match=r"classes must lie in \[0, 3\] .* got a class of 2\*\*63 or more"):
        bh.hessian(bh.init_params(cfg), X, cfg, loss="ce", target=huge)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8, torch.uint16, torch.uint64])
def test_ce_targets_of_any_integer_dtype(dtype):
    """Class indices as int32/int16/uint8 give the int64 results everywhere a CE target is taken."""
    cfg = bh.BlockConfig(d_model=4, d_ff=6)
    p = bh.init_params(cfg, seed=1)
    X = torch.randn(2, 3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    T = torch.tensor([[0, 1, 2], [3, 0, 1]])
    Tn = T.to(dtype)
    assert torch.equal(bh.hessian(p, X, cfg, loss="ce", target=Tn).dense(), bh.hessian(p, X, cfg, loss="ce", target=T).dense())
    assert torch.equal(bh.reference.hessian(p, X, cfg, loss="ce", target=Tn).dense(),
                       bh.reference.hessian(p, X, cfg, loss="ce", target=T).dense())
    assert torch.equal(bh.convergence.per_sample_losses(p, X, cfg, loss="ce", target=Tn),
                       bh.convergence.per_sample_losses(p, X, cfg, loss="ce", target=T))
    assert bh.bounds.block_bounds(p, X[0], cfg, loss="ce", target=Tn[0]) == bh.bounds.block_bounds(p, X[0], cfg, loss="ce", target=T[0])


def test_callable_loss_batch_target_is_split_per_sequence():
    """A list or NumPy target of a batch gives each sequence its own entry (it used to reach every
    sequence whole); a target that cannot be a tensor is refused, naming the batch size."""
    cfg = bh.BlockConfig(d_model=4, d_ff=6)
    p = bh.init_params(cfg, seed=2)
    X = torch.randn(3, 2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    y = torch.tensor([0, 3, 1])

    def loss(Z, label):
        return torch.nn.functional.cross_entropy(Z.mean(0, keepdim=True), label.reshape(1))

    ref = bh.hessian(p, X, cfg, loss=loss, target=y).dense()
    for t in (y.tolist(), y.numpy()):
        assert torch.equal(bh.hessian(p, X, cfg, loss=loss, target=t).dense(), ref)
    per_seq = [bh.hessian(p, X[b], cfg, loss=loss, target=y[b]).dense() for b in range(3)]
    assert_close(ref, sum(per_seq) / 3, what="batch = mean of sequences")
    w = [0.5, 1.0 / 3.0, 0.25]  # floats: made float64 like Z, not torch's default float32

    def weighted(Z, a):
        return a * (Z**2).sum()

    assert torch.equal(bh.hessian(p, X, cfg, loss=weighted, target=w).dense(),
                       bh.hessian(p, X, cfg, loss=weighted, target=torch.tensor(w, dtype=torch.float64)).dense())
    with pytest.raises(ValueError, match="leading axis of size 3, one entry per sequence; got tuple"):
        bh.hessian(p, X, cfg, loss=loss, target=(y, torch.ones(3, 5)))


def test_callable_loss_single_sequence_target_is_passed_whole():
    """For one sequence the callable gets its target as given (a dict, a list of floats)."""
    cfg = bh.BlockConfig(d_model=4, d_ff=6)
    p = bh.init_params(cfg, seed=0)
    X = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))

    def shifted(Z, t):
        return ((Z - t["shift"]) ** 2).sum()

    def scaled(Z, t):
        return ((Z - t[0]) ** 2).sum() * t[1]

    ref = bh.hessian(p, X, cfg, loss=lambda Z, t: ((Z - 0.5) ** 2).sum()).dense()
    assert torch.equal(bh.hessian(p, X, cfg, loss=shifted, target={"shift": 0.5}).dense(), ref)
    assert_close(bh.hessian(p, X, cfg, loss=scaled, target=[0.5, 2.0]).dense(), 2 * ref, what="list target")
    assert bh.reference.hessian(p, X, cfg, loss=shifted, target={"shift": 0.5}).cfg == cfg


def test_loss_hessian_factorisation_scales_and_slack():
    """The full eigh keeps each sequence to its own scale; a rank of p - 3 takes the next width,
    p - 4 not."""
    from blockhess.linalg import eig_lowrank

    m = 160
    g = torch.Generator().manual_seed(7)

    def low_rank(B, rank, scale=1.0):
        A = torch.randn(B, m, rank, generator=g, dtype=torch.float64)
        return scale * A @ A.mT

    for rank, widths in ((12, [16]), (13, [16, 32])):
        sizes, eigh = [], torch.linalg.eigh
        torch.linalg.eigh = lambda M: sizes.append(M.shape[-1]) or eigh(M)
        try:
            eig_lowrank(low_rank(2, rank))
        finally:
            torch.linalg.eigh = eigh
        assert sizes == widths, rank
    full = low_rank(2, m)  # full rank: the m x m eigh
    full[1] *= 1e-16
    lam, W = eig_lowrank(full)
    rebuilt = (W * lam[:, None, :]) @ W.mT
    assert_close(rebuilt[1], full[1], tol=1e-12, what="the 1e-16 sequence, full eigh")


def test_ce_target_as_list_or_array():
    """CE classes given as a list or NumPy array: the tensor's results, batch and one sequence."""
    cfg = bh.BlockConfig(d_model=4, d_ff=6)
    p = bh.init_params(cfg, seed=1)
    X = torch.randn(2, 3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    T = torch.tensor([[0, 1, 2], [3, 0, 1]])
    want = bh.hessian(p, X, cfg, loss="ce", target=T).dense()
    for given in (T.tolist(), T.numpy()):
        assert torch.equal(bh.hessian(p, X, cfg, loss="ce", target=given).dense(), want)
    assert torch.equal(bh.hessian(p, X[1], cfg, loss="ce", target=[3, 0, 1]).dense(),
                       bh.hessian(p, X[1], cfg, loss="ce", target=T[1]).dense())
    assert bh.bounds.block_bounds(p, X[0], cfg, loss="ce", target=[0, 1, 2]) == bh.bounds.block_bounds(p, X[0], cfg, loss="ce", target=T[0])
    with pytest.raises(ValueError, match="integer tensor of class indices"):
        bh.hessian(p, X, cfg, loss="ce", target=[[0.5, 1, 2], [3, 0, 1]])
    for bad in ("cat", [[0, 1, 2], [3, 0]], [None, 1, 2]):  # torch's TypeError, ValueError, RuntimeError
        with pytest.raises(ValueError, match=r"integer tensor \(or array\) of class indices for loss='ce', got (str|list)"):
            bh.hessian(p, X, cfg, loss="ce", target=bad)


def test_custom_loss_small_curvature_that_the_jacobian_amplifies():
    """One sequence: the loss weights an output direction by 1e-16 that W_O = diag(1, 1e8, 1, 1)
    amplifies by 1e16 in the weights' Hessian. A cut relative to the loss Hessian's own largest
    eigenvalue dropped it (the (W_V, W_V) block 50 % off); the cut scaled by the Jacobian's
    amplification keeps it (docs/derivations.md §7)."""
    cfg = bh.BlockConfig(d_model=4, kind="attention", out_proj=True)
    p = bh.init_params(cfg, seed=0)
    p["W_O"] = torch.diag(torch.tensor([1.0, 1e8, 1.0, 1.0], dtype=torch.float64))
    X = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    c = torch.tensor([1.0, 1e-16, 1.0, 1.0], dtype=torch.float64)

    def loss(Z, t):
        return (c * Z**2).sum()

    for wrt_input in (False, True):
        H = bh.hessian(p, X, cfg, loss=loss, wrt_input=wrt_input)
        R = bh.reference.hessian(p, X, cfg, loss=loss, wrt_input=wrt_input)
        assert_close(H.dense(), R.dense(), what="full")
        assert_close(H.outer.dense(), R.outer.dense(), what="outer")
        assert_close(H["W_V", "W_V"], R["W_V", "W_V"], what="(W_V, W_V)")
