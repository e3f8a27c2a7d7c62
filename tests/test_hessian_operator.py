"""``bh.hessian_operator``: the closed-form matrix-free Hessian of a block or a model against the dense
closed form (itself checked against autograd), its parts, views (each restricted to what it needs,
and equal to the full product's rows), ``wrt`` subsets, and the estimators and SciPy running on it."""

from __future__ import annotations

import re

import pytest
import torch

import blockhess as bh
from blockhess import heap
from blockhess.config import ModelConfig
from blockhess.layers import attention
from blockhess.model import directional as model_directional
from blockhess.model import stages
from blockhess.operators import HessianOperator, engines, head_views, lanczos_eigs

from conftest import assert_close, make_model_case, spy_calls
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
    # one column: the engine writes the rows into the output's slices (the tied head's and the token
    # embedding's into W_E's, added there; an untied head's in its own layout)
    assert_close(A @ V[:, 0], D @ V[:, 0], what=f"{name} {part} A @ v")
    assert_close(A["W_E", "W_E"] @ V[: p["W_E"].numel(), 0], D[: p["W_E"].numel(), : p["W_E"].numel()]
                 @ V[: p["W_E"].numel(), 0], what=f"{name} {part} A[W_E, W_E] @ v")


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


# ----------------------------------------------------------------------------- restricted views

VIEW_TOL = 1e-12  # a view against the full product's rows and the dense block: float64, a few roundings per entry
VIEW_BLOCKS = {
    "pre": (PRE, "ce"),
    "post-heads": (bh.BlockConfig(d_model=6, d_ff=7, d_k=2, n_heads=3, bias=True, out_proj=True, ln_affine=True,
                                  ln_eps=1e-5, activation="gelu"), "mse"),
    "post": (POST, "mse"),
    "paper": (PAPER, "ce"),
    "attention": (bh.BlockConfig(d_model=6, d_k=3, n_heads=2, kind="attention", bias=True, out_proj=True,
                                 causal=True), "mse"),
}


def _variables(A, cfg) -> list:
    """The operator's parameters and their heads' column groups (``W_Q#h``...)."""
    return list(A.names) + [v for v, (param, _, _) in head_views(cfg).items() if param in A.names]


class _Layout:
    """A whole operator's vector layout: a variable's entries put into / read from an ``(n, k)`` vector."""

    def __init__(self, A, cfg):
        self.A, self.split, self.off, off = A, head_views(cfg), {}, 0
        for n, size in zip(A.names, A.sizes):
            self.off[n] = off
            off += size

    def _where(self, var):
        return self.split[var] if var in self.split else (var, self.A.shapes[var], None)

    def embed(self, var, v):
        param, ref, idx = self._where(var)
        block = torch.zeros(*ref, v.shape[1], dtype=v.dtype)
        if idx is None:
            block = v.reshape(*ref, -1)
        else:
            block[idx] = v.reshape(*block[idx].shape)
        full = torch.zeros(self.A.shape[1], v.shape[1], dtype=v.dtype)
        size = block[..., 0].numel()
        full[self.off[param]:self.off[param] + size] = block.reshape(size, -1)
        return full

    def rows(self, var, y):
        param, ref, idx = self._where(var)
        size = torch.Size(self.A.shapes[param]).numel()
        block = y[self.off[param]:self.off[param] + size].reshape(*ref, -1)
        return (block if idx is None else block[idx]).reshape(-1, y.shape[1])


def _check_views(A, R, cfg, rows_vars, cols_vars, what, seed=0):
    """``A[a, b] @ v`` for each ``a`` of ``rows_vars``, ``b`` of ``cols_vars`` against the rows ``a`` of
    ``A @ w`` (``w``: ``v`` on ``b``'s columns, zero elsewhere) and against the dense ``R[a, b] @ v``; each
    to its own norm and to the rounding of the whole product ``A @ w`` (a block can be zero)."""
    lay, gen = _Layout(A, cfg), torch.Generator().manual_seed(seed)
    for b in cols_vars:
        v = torch.randn(A[b, b].shape[1], 2, dtype=torch.float64, generator=gen)
        full = A @ lay.embed(b, v)
        whole = float(torch.linalg.matrix_norm(full))
        for a in rows_vars:
            got = A[a, b] @ v
            assert_close(got, lay.rows(a, full), scale=whole, tol=VIEW_TOL, what=f"{what} A[{a}, {b}] vs A @ w")
            assert_close(got, R[a, b] @ v, scale=whole, tol=VIEW_TOL, what=f"{what} A[{a}, {b}] vs dense")


@pytest.mark.parametrize("part", ["full", "outer", "functional"])
@pytest.mark.parametrize("name", list(VIEW_BLOCKS))
def test_block_views_are_the_full_products_rows(name, part):
    """Every view ``A[a, b]`` of a block, heads' column groups included, diagonal and off-diagonal,
    and views over several variables."""
    cfg, loss = VIEW_BLOCKS[name]
    p, X, T = _block_case(cfg, loss)
    H = bh.hessian(p, X, cfg, loss=loss, target=T)
    R = HessianOperator.from_dense({"full": H, "outer": H.outer, "functional": H.functional}[part])
    A = bh.hessian_operator(p, X, cfg, loss=loss, target=T, part=part)
    every = _variables(A, cfg)
    _check_views(A, R, cfg, every, every, f"{name} {part}")
    heads = [v for v in every if "#" in v]
    rows, cols = tuple(every[-1:] + heads[:1]), tuple(every[:2] + heads[-1:])
    v = torch.randn(A[rows, cols].shape[1], 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    assert_close(A[rows, cols] @ v, R[rows, cols] @ v, tol=VIEW_TOL, what=f"{name} {part} A[{rows}, {cols}]")


@pytest.mark.parametrize("part", ["full", "outer", "functional"])
@pytest.mark.parametrize("name", list(MODELS))
def test_model_views_are_the_full_products_rows(name, part):
    """A model's views: every diagonal one, and every variable against a few spread over the stages
    (the embedding, a head of the first block, the last block's W_2 and b_K, the top variable), both ways."""
    cfg, p, x, loss, T = _model_case(name)
    H = bh.hessian(p, x, cfg, loss=loss, target=T)
    R = HessianOperator.from_dense({"full": H, "outer": H.outer, "functional": H.functional}[part])
    A = bh.hessian_operator(p, x, cfg, loss=loss, target=T, part=part)
    every = _variables(A, cfg)
    last = f"blocks.{len(cfg.blocks) - 1}."
    some = [every[0], next((v for v in every if v.startswith("blocks.0.") and "#" in v), "blocks.0.W_Q"),
            last + "W_2", *([last + "b_K"] if last + "b_K" in every else []), A.names[-1]]
    for v in every:
        _check_views(A, R, cfg, [v], [v], f"{name} {part}")
    _check_views(A, R, cfg, every, some, f"{name} {part}", seed=1)
    _check_views(A, R, cfg, some, every, f"{name} {part}", seed=2)


def test_model_views_run_only_the_stages_they_need(monkeypatch):
    """The restriction is real in a model (two blocks): a view runs no block below its lowest
    direction on the way up, none below its lowest row on the way down, and each block forms only
    its wanted rows (the attention's pass only where a row or an input adjoint below needs it)."""
    block_hvp = spy_calls(monkeypatch, engines, "hvp")
    cfg, p, x, loss, T = _model_case("gpt")
    A = bh.hessian_operator(p, x, cfg, loss=loss, target=T)
    down = spy_calls(monkeypatch, model_directional, "vjp")
    att = spy_calls(monkeypatch, attention, "second_adjoint")
    for a, b, ups, downs, n_att in (("blocks.1.W_2", "blocks.1.W_2", [({"W_2"}, False)], [], 0),
                                    ("blocks.0.W_1", "blocks.1.W_2", [(set(), True)], [{"W_1"}], 1),
                                    ("blocks.1.W_2", "blocks.0.W_1", [(set(), False), ({"W_2"}, False)], [], 0),
                                    ("blocks.0.W_Q", "blocks.0.W_Q", [({"W_Q"}, False), (set(), True)], [], 2)):
        block_hvp.clear(), down.clear(), att.clear()
        A[a, b] @ torch.randn(A[a, b].shape[1], dtype=torch.float64)
        assert sorted((set(kw["wanted"]), kw["input_adjoint"]) for kw in block_hvp) == sorted(ups), (a, b)
        assert [set(kw["wanted"]) for kw in down] == downs and len(att) == n_att, (a, b)


@pytest.mark.parametrize("name", list(MODELS))
def test_a_non_finite_direction_is_named_by_its_variable(name):
    """A NaN or Inf anywhere in ``V`` (the head's, the final LayerNorm's, the embedding's or a block's
    entries; flat, batched or as a list) raises before any work, naming the variable it lies in."""
    cfg, p, x, loss, T = _model_case(name)
    A = bh.hessian_operator(p, x, cfg, loss=loss, target=T)
    off = 0
    for var, size in zip(A.in_names, A.in_sizes):
        for bad in (float("nan"), float("inf")):
            v = torch.zeros(A.shape[1], 2, dtype=torch.float64)
            v[off + size - 1, 1] = bad
            with pytest.raises(ValueError, match=re.escape(f"V contains NaN or Inf (in the entries of {var!r})")):
                A @ v
            with pytest.raises(ValueError, match=re.escape(f"(in the entries of {var!r})")):
                A @ [t.reshape(s) for t, s in zip(v[:, 1].split(list(A.in_sizes)), A.in_shapes.values())]
        off += size


def _assembled(op, v):
    """``op @ v`` by the path of several columns (``v`` twice): rows assembled from the engine's own tensors,
    none written into an output, no pooled memory; the reference of the one-vector paths."""
    return (op @ torch.stack([v, v], 1))[:, 0]


@pytest.mark.parametrize("name", ["gpt", "vit"])
@pytest.mark.parametrize("head_stack", [0, stages.HEAD_STACK_MAX_ROWS], ids=["head-two-products", "head-stacked"])
def test_a_dropped_output_is_recycled_and_overwritten(name, head_stack, monkeypatch):
    """With every output pooled (``heap.POOL_MIN_BYTES`` 0): a product's output the caller dropped, its entries
    set to NaN first, is the next product's memory, and that product overwrites every entry (the numbers of
    ``matvec`` into a fresh tensor); an output the caller keeps is left as it was; for the whole model, a view,
    a head's view, a block-diagonal part, and a mean over batches (whose rows are assembled, not written in
    place), the head's rows by either rule. A product of several columns lets the pool's memory go."""
    monkeypatch.setattr(heap, "POOL_MIN_BYTES", 0)
    monkeypatch.setattr(stages, "HEAD_STACK_MAX_ROWS", head_stack)
    cfg, p, x, loss, T = _model_case(name)
    A = bh.hessian_operator(p, x, cfg, loss=loss, target=T)
    halves = [bh.hessian_operator(p, x[i : i + 2], cfg, loss=loss, target=T[i : i + 2]) for i in (0, 2)]
    heads = [n for n in A.in_names if "#" in n][:1]
    ops = [A, A["blocks.0.W_Q", "blocks.0.W_Q"], A.block_diagonal(["W_E" if name == "gpt" else "blocks.0.W_1",
                                                                    ("blocks.0.W_V", "blocks.0.W_2")]),
           bh.operators.mean_operator(halves, counts=[2, 1])]
    if heads:
        ops.append(A[heads[0], heads[0]])
    gen = torch.Generator().manual_seed(10)
    for op in ops:
        v = torch.randn(op.shape[1], dtype=torch.float64, generator=gen)
        ref = _assembled(op, v)
        y = op @ v
        ptr = y.data_ptr()
        y.fill_(float("nan"))
        del y
        y = op @ v
        assert y.data_ptr() == ptr and float((y - ref).norm()) <= 1e-14 * float(ref.norm())
        kept = y.clone()
        z = op @ torch.randn(op.shape[1], dtype=torch.float64, generator=gen)
        assert z.data_ptr() != y.data_ptr() and torch.equal(y, kept)
        del z
        assert op._outputs._free is not None
        op @ torch.randn(op.shape[1], 2, dtype=torch.float64, generator=gen)
        assert op._outputs._free is None


def test_pooled_outputs_on_another_default_device_and_deep_copies(monkeypatch):
    """A CPU operator's pooled output is a CPU tensor whatever torch's default device; a deep copy of an
    operator has a pool of its own, empty."""
    import copy

    monkeypatch.setattr(heap, "POOL_MIN_BYTES", 0)
    cfg, p, x, loss, T = _model_case("gpt")
    A = bh.hessian_operator(p, x, cfg, loss=loss, target=T)
    v = torch.randn(A.shape[1], dtype=torch.float64)
    ref = A @ v
    with torch.device("meta"):
        y = A @ v
    assert y.device.type == "cpu" and float((y - ref).norm()) <= 1e-14 * float(ref.norm())
    del y
    B = copy.deepcopy(A)
    assert B._outputs is not A._outputs and B._outputs._free is None and A._outputs._free is not None
    assert float((B @ v - ref).norm()) <= 1e-14 * float(ref.norm())


@pytest.mark.parametrize("name", ["gpt", "vit"])
@pytest.mark.parametrize("head_stack", [0, stages.HEAD_STACK_MAX_ROWS], ids=["head-two-products", "head-stacked"])
def test_matvec_into_a_kept_output(name, head_stack, monkeypatch):
    """``A.matvec(v, out=y)``: the numbers of ``A @ v`` (to rounding: BLAS rounds by the operands' alignment),
    written into ``y`` (returned), for the
    whole model, a view, a head's view and a block-diagonal part, twice into the same output (the second
    product overwrites every entry: ``y`` starts as NaN); into the next column of a column-major basis (a
    strided ``v`` beside it); refusals before any product."""
    monkeypatch.setattr(stages, "HEAD_STACK_MAX_ROWS", head_stack)
    cfg, p, x, loss, T = _model_case(name)
    A = bh.hessian_operator(p, x, cfg, loss=loss, target=T)
    heads = [n for n in A.in_names if "#" in n][:1]
    ops = [A, A["blocks.0.W_Q", "blocks.0.W_Q"], A.block_diagonal(["W_E" if name == "gpt" else "blocks.0.W_1",
                                                                    ("blocks.0.W_V", "blocks.0.W_2")])]
    if heads:
        ops.append(A[heads[0], heads[0]])
    gen = torch.Generator().manual_seed(9)
    for op in ops:
        y = torch.full((op.shape[0],), float("nan"), dtype=torch.float64)
        for _ in range(2):
            v = torch.randn(op.shape[1], dtype=torch.float64, generator=gen)
            got, ref = op.matvec(v, out=y), _assembled(op, v)
            assert got is y and float((y - ref).norm()) <= 1e-14 * float(ref.norm())
        ref = _assembled(op, v)
        assert float((op.matvec(v) - ref).norm()) <= 1e-14 * float(ref.norm())
        basis = torch.zeros(3, op.shape[0], dtype=torch.float64).T  # column-major: each column contiguous
        basis[:, 0] = torch.randn(op.shape[0], dtype=torch.float64, generator=gen)
        op.matvec(basis[:, 0], out=basis[:, 1])
        ref = _assembled(op, basis[:, 0].contiguous())
        assert float((basis[:, 1] - ref).norm()) <= 1e-14 * float(ref.norm())
    n = A.shape[0]
    v = torch.randn(n, dtype=torch.float64, generator=gen)
    for out, words in [(torch.zeros(n + 1, dtype=torch.float64), f"out must be a contiguous tensor of shape \\({n},\\)"),
                       (torch.zeros(2 * n, dtype=torch.float64)[::2], "out must be a contiguous tensor"),
                       (torch.zeros(n, dtype=torch.float32), "out must be torch.float64"),
                       (torch.zeros(n, dtype=torch.float64, requires_grad=True), "out must not require grad"),
                       (v, "out must not overlap v")]:
        with pytest.raises(ValueError, match=words):
            A.matvec(v, out=out)
    both = torch.randn(2 * n - 1, dtype=torch.float64, generator=gen)
    with pytest.raises(ValueError, match="out must not overlap v"):
        A.matvec(both[: n], out=both[n - 1:])  # one shared entry
    with pytest.raises(ValueError, match=f"v must be a tensor of shape \\({n},\\)"):
        A.matvec(torch.zeros(n, 1, dtype=torch.float64))
