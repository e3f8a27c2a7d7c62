"""``bh.hessian_operator``: the closed-form matrix-free Hessian of a block or a model against the dense
closed form (itself checked against autograd), its parts, views, ``wrt`` subsets, and the estimators
and SciPy running on it."""

from __future__ import annotations

import pytest
import torch

import blockhess as bh
from blockhess.config import ModelConfig
from blockhess.operators import lanczos_eigs

from conftest import assert_close, make_model_case
from settings import MODEL_CASES, MODEL_IDS, OPTION_CASES, OPTION_IDS

PRE = bh.BlockConfig(d_model=8, d_ff=12, n_heads=2, norm="pre", bias=True, out_proj=True, ln_affine=True,
                     ln_eps=1e-5, activation="gelu_tanh", causal=True)
POST = bh.BlockConfig(d_model=6, d_ff=7, d_k=4, bias=True, ln_affine=True, ln_eps=1e-5)
PAPER = bh.BlockConfig(d_model=6, d_ff=8, ln_eps=1e-5)


def _block_case(cfg, loss):
    gen = torch.Generator().manual_seed(0)
    p = {k: v + 0.1 * torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in bh.init_params(cfg, 2).items()}
    X = torch.randn(3, 4, cfg.d_model, generator=gen, dtype=torch.float64)
    T = (torch.randint(0, cfg.d_model, (3, 4), generator=gen) if loss == "ce"
         else torch.randn(3, 4, cfg.d_model, generator=gen, dtype=torch.float64))
    return p, X, T


MODELS = {
    "gpt": ModelConfig(blocks=(PRE, PRE), embedding="token", vocab=11, positions="learned", n_positions=6,
                       final_norm=True, head=11, tied=True, head_bias=False),
    "vit": ModelConfig(blocks=(PAPER,), embedding="patch", image=(1, 4, 4), patch=2, positions="sinusoidal",
                       pool="mean", head=3),
    "bert": ModelConfig(blocks=(POST, POST), embedding="token", vocab=7, positions="learned", n_positions=5,
                        token_types=2, embed_norm=True),
}


def _model_case(name):
    cfg = MODELS[name]
    gen = torch.Generator().manual_seed(1)
    p = {k: v + 0.1 * torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in bh.init_params(cfg, 3).items()}
    if name == "vit":
        x, loss, T = torch.rand(3, 1, 4, 4, generator=gen, dtype=torch.float64), "ce", torch.tensor([0, 2, 1])
    elif name == "gpt":
        x = torch.randint(0, cfg.vocab, (3, 5), generator=gen)
        loss, T = "ce", torch.randint(0, cfg.vocab, (3, 5), generator=gen)
    else:
        x = torch.randint(0, cfg.vocab, (3, 4), generator=gen)
        loss, T = "mse", torch.randn(3, 4, cfg.d_model, generator=gen, dtype=torch.float64)
    return cfg, p, x, loss, T


def _dense(H, part):
    return {"full": H, "outer": H.outer, "functional": H.functional}[part].dense()


@pytest.mark.parametrize("part", ["full", "outer", "functional"])
@pytest.mark.parametrize("cfg,loss", [(PRE, "ce"), (POST, "mse"), (PAPER, "ce"),
                                      (bh.BlockConfig(d_model=6, d_k=3, n_heads=2, kind="attention", bias=True,
                                                      out_proj=True, causal=True), "mse")],
                         ids=["pre-ce", "post-mse", "paper-ce", "attention-mse"])
def test_block_operator_equals_dense(cfg, loss, part):
    p, X, T = _block_case(cfg, loss)
    D = _dense(bh.hessian(p, X, cfg, loss=loss, target=T), part)
    A = bh.hessian_operator(p, X, cfg, loss=loss, target=T, part=part)
    V = torch.randn(D.shape[0], 3, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    assert A.shape == D.shape and A.count == 3
    assert_close(A @ V, D @ V, what=f"block {part} A @ V")
    assert_close(A @ V[:, 0], D @ V[:, 0], what="one vector")


@pytest.mark.parametrize("case", MODEL_CASES, ids=MODEL_IDS)
def test_model_operator_over_the_design(case):
    """Every option of a model (the shared pairwise design), each part, against the dense closed form."""
    cfg, p, x, loss, T = make_model_case(*case)
    H = bh.hessian(p, x, cfg, loss=loss, target=T)
    V = torch.randn(H.dense().shape[0], 2, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    for part in ("full", "outer", "functional"):
        A = bh.hessian_operator(p, x, cfg, loss=loss, target=T, part=part)
        assert_close(A @ V, _dense(H, part) @ V, what=f"{part} A @ V")


@pytest.mark.parametrize("case", OPTION_CASES[::3], ids=OPTION_IDS[::3])
def test_block_operator_over_the_design(case):
    """A third of the block options' design (the products' own tests cover all of it), full part."""
    row, (L, d, dk, ff, B, scale), loss = case
    cfg = bh.BlockConfig(d_model=d, d_ff=ff, d_k=dk, **row)
    p, X, T = _block_case(cfg, loss)
    D = bh.hessian(p, X, cfg, loss=loss, target=T).dense()
    V = torch.randn(D.shape[0], 2, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    assert_close(bh.hessian_operator(p, X, cfg, loss=loss, target=T) @ V, D @ V, what="A @ V")


@pytest.mark.parametrize("part", ["full", "outer", "functional"])
@pytest.mark.parametrize("name", list(MODELS))
def test_model_operator_equals_dense(name, part):
    cfg, p, x, loss, T = _model_case(name)
    D = _dense(bh.hessian(p, x, cfg, loss=loss, target=T), part)
    A = bh.hessian_operator(p, x, cfg, loss=loss, target=T, part=part)
    V = torch.randn(D.shape[0], 2, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    assert_close(A @ V, D @ V, what=f"{name} {part} A @ V")


def test_views_and_wrt():
    cfg, p, x, loss, T = _model_case("gpt")
    H = bh.hessian(p, x, cfg, loss=loss, target=T)
    A = bh.hessian_operator(p, x, cfg, loss=loss, target=T)
    gen = torch.Generator().manual_seed(7)
    for a, b in (("blocks.0.W_Q", "blocks.1.W_2"), ("W_E", "W_E"), ("gamma_F", "blocks.0.W_1")):
        S = A[a, b]
        v = torch.randn(S.shape[1], dtype=torch.float64, generator=gen)
        assert_close(S @ v, H[a, b] @ v, what=f"view {a}, {b}")
    wrt = ["W_P", "blocks.1.W_1", "blocks.0.b_V"]
    D = bh.hessian(p, x, cfg, loss=loss, target=T, wrt=wrt).dense()
    Aw = bh.hessian_operator(p, x, cfg, loss=loss, target=T, wrt=wrt)
    V = torch.randn(D.shape[0], 2, dtype=torch.float64, generator=gen)
    assert_close(Aw @ V, D @ V, what="wrt subset")


def test_symmetric_and_estimators_on_it():
    cfg, p, x, loss, T = _model_case("vit")
    A = bh.hessian_operator(p, x, cfg, loss=loss, target=T)
    D = bh.hessian(p, x, cfg, loss=loss, target=T).dense()
    gen = torch.Generator().manual_seed(8)
    u, v = (torch.randn(A.shape[0], dtype=torch.float64, generator=gen) for _ in range(2))
    assert abs(float(u @ (A @ v) - v @ (A @ u))) <= 1e-12 * float((A @ u).norm() * v.norm())
    exact = torch.linalg.eigvalsh(D)
    top = lanczos_eigs(A, 3, which="LA", tol=1e-10)
    assert_close(top.eigenvalues.sort().values, exact[-3:], tol=1e-8, what="top-3 eigenvalues (the issue: 1e-8)")
    scipy = pytest.importorskip("scipy.sparse.linalg")
    vals = scipy.eigsh(A.to_scipy(), k=2, which="LA", tol=1e-12)[0]
    assert_close(torch.as_tensor(vals).sort().values, exact[-2:], tol=1e-8, what="scipy eigsh on the operator")


def test_bad_part():
    p, X, T = _block_case(PAPER, "mse")
    with pytest.raises(ValueError, match="part must be one of"):
        bh.hessian_operator(p, X, PAPER, loss="mse", target=T, part="gauss-newton")
