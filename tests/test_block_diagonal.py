"""The exact diagonal of a block's loss Hessian (``blockhess.block.diagonal``, ``A.diagonal()`` of
``bh.hessian_operator``) against the diagonal of autograd's dense Hessian (``blockhess.reference``) and of
the dense closed form, every part, over the block options' design, the bare attention layer, per-head
views, float32, and its errors."""

from __future__ import annotations

import psutil
import pytest
import torch

import blockhess as bh
from blockhess import losses, validation
from blockhess.block import adjoints, forward_cache
from blockhess.block import diagonal as diag_mod
from blockhess.config import ModelConfig

from conftest import assert_close, assert_float32_close, autograd_defect, fro, make_case, randomize_vectors, to_dtype
from settings import NAMED_CONFIGS, OPTION_CASES, OPTION_IDS, make_target

PARTS = ("full", "outer", "functional")
# the bare attention layer's options (the block design above covers the block's): one head, several,
# biases, W_O, causal; one sequence of one token among them
ATTENTION_CASES = [
    (dict(kind="attention"), (3, 4, 2, 5, None, 1.0), "mse"),
    (dict(kind="attention", n_heads=2, bias=True, out_proj=True, causal=True), (4, 6, 3, 5, 2, 1.0), "ce"),
    (dict(kind="attention", bias=True, out_proj=True), (1, 4, 3, 5, 1, 1.0), "mse"),
    (dict(NAMED_CONFIGS["attention"], causal=True), (3, 4, 2, 5, 3, 2.0), "mse"),
]
ATTENTION_IDS = ["paper", "H2-bias-out_proj-causal-ce", "L1-B1", "named-causal"]


def _case(row, sizes, loss, seed=0):
    L, d, dk, ff, B, scale = sizes
    cfg, p, X, g = make_case(L, d, dk, ff, B, scale, seed=seed, **row)
    return cfg, randomize_vectors(p, seed), X, make_target(loss, X, g, d)


def _parts(H):
    return {"full": H, "outer": H.outer, "functional": H.functional}


def _check_against(cfg, p, X, loss, T):
    R = bh.reference.hessian(p, X, cfg, loss=loss, target=T)
    H = bh.hessian(p, X, cfg, loss=loss, target=T)
    whole = fro(torch.diagonal(R.dense()))
    got = {}
    for part in PARTS:
        A = bh.hessian_operator(p, X, cfg, loss=loss, target=T, part=part)
        d = A.diagonal()
        got[part] = d
        ref = _parts(R)[part].dense()
        # autograd's own error (its asymmetry, conftest.autograd_defect) bounds what it can judge
        assert_close(d, torch.diagonal(ref), scale=whole, allow=autograd_defect(ref), what=f"{part} vs autograd")
        assert_close(d, torch.diagonal(_parts(H)[part].dense()), scale=whole, what=f"{part} vs the dense closed form")
    eps = torch.finfo(X.dtype).eps
    n = got["full"].numel()
    assert fro(got["outer"] + got["functional"] - got["full"]) <= n * eps * (fro(got["outer"]) + fro(got["functional"]))
    # MSE and CE are convex in Z: the Gauss–Newton term is PSD, so its diagonal is >= 0 (to rounding)
    assert float(got["outer"].min()) >= -n * eps * float(got["outer"].abs().max())
    return got


@pytest.mark.parametrize("case", OPTION_CASES, ids=OPTION_IDS)
def test_diagonal_over_the_design(case):
    """Every option of a block (the shared 3-wise design: heads, biases, W_O, affine LN, eps,
    activations, pre/post-LN, causal; L = 1, B = 1, unbatched), MSE and CE, each part."""
    cfg, p, X, T = _case(*case)
    _check_against(cfg, p, X, case[2], T)


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=ATTENTION_IDS)
def test_diagonal_of_the_attention_layer(case):
    cfg, p, X, T = _case(*case)
    got = _check_against(cfg, p, X, case[2], T)
    if cfg.bias:
        A = bh.hessian_operator(p, X, cfg, loss=case[2], target=T)
        assert torch.equal(A["b_K", "b_K"].diagonal(), torch.zeros(A["b_K", "b_K"].shape[0], dtype=X.dtype))
    assert got["full"].dtype == X.dtype


@pytest.mark.parametrize("loss", ["mse", "ce"])
@pytest.mark.parametrize("name", ["pre, all options", "post, all options"])
def test_diagonal_is_the_operators_own(name, loss):
    """``A.diagonal()`` is the diagonal of ``A @ I`` (the products), and per-head and mixed views
    take their slices of it."""
    cfg, p, X, T = _case(NAMED_CONFIGS[name], (4, 6, 3, 5, 2, 1.0), loss, seed=3)
    for part in PARTS:
        A = bh.hessian_operator(p, X, cfg, loss=loss, target=T, part=part)
        whole = A.diagonal()
        M = A.dense()
        assert_close(whole, torch.diagonal(M), scale=fro(torch.diagonal(M)), what=f"{part} A.diagonal() vs A @ I")
        for view in (("W_Q#1",), ("W_K#0", "b_Q#1", "gamma_1"), ("W_V#1", "W_2")):
            V = A[view, view]
            assert_close(V.diagonal(), torch.diagonal(V.dense()), scale=fro(whole), what=f"{part} view {view}")


@pytest.mark.parametrize("name", ["pre, all options", "post, all options"])
def test_float32_within_autograds_own_error(name):
    cfg, p, X, T = _case(NAMED_CONFIGS[name], (4, 6, 3, 5, 2, 1.0), "mse", seed=5)
    p32, X32, T32 = to_dtype(p, torch.float32), X.float(), T.float()
    A32 = bh.reference.hessian(p32, X32, cfg, loss="mse", target=T32)
    R = bh.reference.hessian(to_dtype(p32, torch.float64), X32.double(), cfg, loss="mse", target=T32.double())
    for part in PARTS:
        d = bh.hessian_operator(p32, X32, cfg, loss="mse", target=T32, part=part).diagonal()
        assert d.dtype == torch.float32
        assert_float32_close(d, torch.diagonal(_parts(A32)[part].dense()), torch.diagonal(_parts(R)[part].dense()),
                             scale=fro(torch.diagonal(R.dense())), what=f"float32 {part}")


def test_kernel_diagonal_wanted_subset_and_outer_alone():
    """The kernel asked for some weights returns those only, the numbers asked for all (to rounding:
    without ``gamma_1`` wanted, ``W_K``'s ``V^T S_t X`` is formed from ``X`` itself, not from ``n_1``); the
    Gauss–Newton part needs no adjoints."""
    cfg, p, X, T = _case(NAMED_CONFIGS["pre, all options"], (3, 6, 3, 5, 2, 1.0), "ce", seed=1)
    c = forward_cache(p, X, cfg, plain=True)
    g, _ = losses.directional("ce", T, c.out)
    a = adjoints(c, g)
    every = diag_mod.block_diagonal(c, a, "ce", T, tuple(p))
    some = diag_mod.block_diagonal(c, a, "ce", T, ("W_K", "gamma_2"))
    assert set(some) == {"W_K", "gamma_2"}
    for k in some:
        assert_close(some[k], every[k], what=k)
    outer = diag_mod.block_diagonal(c, None, "ce", T, tuple(p), functional=False)
    func = diag_mod.block_diagonal(c, a, "ce", T, tuple(p), outer=False)
    for k in p:
        assert_close(outer[k] + func[k], every[k], scale=fro(every[k]) + 1.0, what=k)


def test_not_available_raises_named_error():
    cfg, p, X, T = _case(NAMED_CONFIGS["pre, all options"], (3, 6, 3, 5, 2, 1.0), "mse")

    def coupled(Z, target):
        return ((Z - target) ** 2).sum() + Z.sum() ** 2

    with pytest.raises(NotImplementedError, match="callable loss"):
        bh.hessian_operator(p, X, cfg, loss=coupled, target=T).diagonal()
    mcfg = ModelConfig(blocks=(cfg,), embedding="token", vocab=5, positions="learned", n_positions=4, head=5)
    mp = bh.init_params(mcfg, 0)
    x = torch.randint(0, 5, (2, 3), generator=torch.Generator().manual_seed(0))
    with pytest.raises(NotImplementedError, match="a model's operator has no closed-form diagonal: attention"):
        bh.hessian_operator(mp, x, mcfg, loss="ce", target=x).diagonal()


def test_bad_arguments():
    cfg, p, X, T = _case(NAMED_CONFIGS["paper"], (3, 4, 2, 5, 2, 1.0), "mse")
    c = forward_cache(p, X, cfg, plain=True)
    a = adjoints(c, losses.directional("mse", T, c.out)[0])
    with pytest.raises(ValueError, match="wanted must hold names"):
        diag_mod.diagonal(c, a, 1.0, ("W_Q", "X"))
    with pytest.raises(ValueError, match="both False"):
        diag_mod.diagonal(c, a, 1.0, ("W_Q",), outer=False, functional=False)
    with pytest.raises(ValueError, match="adjoints"):
        diag_mod.diagonal(c, None, 1.0, ("W_Q",))
    with pytest.raises(ValueError, match="omega must be"):
        diag_mod.diagonal(c, a, "mse", ("W_Q",))


def test_memory_is_checked_before_any_work(monkeypatch):
    cfg = bh.BlockConfig(d_model=4, d_ff=5)
    p = bh.init_params(cfg, seed=0)
    X = torch.randn(1, 64, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    c = forward_cache(p, X, cfg, plain=True)
    a = adjoints(c, torch.zeros_like(X))
    need = diag_mod.work_entries(cfg, 64, 64) * 8

    class Memory:
        available = need // 2

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Memory)
    monkeypatch.setattr(diag_mod, "_attention_stage", lambda *args: pytest.fail("work before the memory check"))
    monkeypatch.setattr(validation, "SMALL_BYTES", 0)  # a request this small is otherwise not checked
    with pytest.raises(bh.InsufficientMemoryError, match="the exact diagonal's per-token matrices"):
        diag_mod.diagonal(c, a, 1.0, ("W_Q",))


def test_mean_over_batches_has_the_exact_diagonal():
    """``mean_operator`` of block operators takes their closed-form diagonals: the diagonal of the
    whole batch's operator."""
    cfg, p, X, T = _case(NAMED_CONFIGS["pre, all options"], (3, 6, 3, 5, 3, 1.0), "mse", seed=2)
    whole = bh.hessian_operator(p, X, cfg, loss="mse", target=T).diagonal()
    parts = [bh.hessian_operator(p, X[i:i + 1], cfg, loss="mse", target=T[i:i + 1]) for i in range(3)]
    assert_close(bh.operators.mean_operator(parts).diagonal(), whole, what="mean of batches")
