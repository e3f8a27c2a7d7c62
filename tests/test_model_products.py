"""A model's matrix-free Hessian–vector products (``blockhess.model.directional``, each stage's tangent
and second-order adjoint, the blocks' by ``blockhess.block.hvp``) against its dense closed-form Hessian."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import blockhess as bh
from blockhess.block.directional import hvp
from blockhess.config import ModelConfig, model_param_shapes
from blockhess.model.directional import ModelProduct, fold_tied, unfold_tied
from blockhess.model.forward_pass import trace
from blockhess.model import stages
from blockhess.model.stages import TIED_HEAD
from blockhess.model.walk import stages_of
from blockhess import losses
from blockhess.model.forward_pass import sequence_loss

from conftest import assert_close


def product(params, inputs, cfg, loss, target):
    inputs = inputs
    t = trace(params, inputs, cfg, derivatives=False)
    loss3, target3 = sequence_loss(cfg, loss, target, t.z)
    target3 = losses.check(loss3, target3, t.z)
    st, top = stages_of(t, loss3, target3, inputs.shape[0], 0, dense=False)
    return ModelProduct(st, top, cfg.d_model, hvp)


BLK = bh.BlockConfig(d_model=4, d_ff=6, n_heads=2, norm="pre", bias=True, out_proj=True, ln_affine=True, ln_eps=1e-5,
                     activation="gelu", causal=True)
POST = bh.BlockConfig(d_model=4, d_ff=5, d_k=3, bias=True, ln_affine=True, ln_eps=1e-5)
CASES = {
    "lm-tied": (ModelConfig(blocks=(BLK, BLK), embedding="token", vocab=5, positions="learned", n_positions=4,
                            final_norm=True, head=5, tied=True, head_bias=False), "tokens", "ce-token"),
    # d = 16 wider than the tokens' 6 rows (a tied head whose rows have more columns than the tokens)
    "lm-tied-wide": (ModelConfig(blocks=(dataclasses.replace(BLK, d_model=16),), embedding="token", vocab=5,
                                 positions="learned", n_positions=4, final_norm=True, head=5, tied=True,
                                 head_bias=False), "tokens", "ce-token"),
    "vit": (ModelConfig(blocks=(BLK,), embedding="patch", image=(1, 4, 4), patch=2, cls_token=True, positions="learned",
                        n_positions=5, final_norm=True, pool="first", head=3), "images", "ce"),
    "bert-mse": (ModelConfig(blocks=(POST, POST), embedding="token", vocab=6, positions="learned", n_positions=4,
                             token_types=2, embed_norm=True), "tokens", "mse"),
    "linear-mean-callable": (ModelConfig(blocks=(POST,), embedding="linear", d_in=3, positions="sinusoidal",
                                         pool="mean", head=3), "features", "callable"),
}


def _case(name):
    cfg, kind, loss = CASES[name]
    gen = torch.Generator().manual_seed(0)
    B, L = 2, 3
    params = {k: v + 0.1 * torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in bh.init_params(cfg, 1).items()}
    if kind == "tokens":
        x = torch.randint(0, cfg.vocab, (B, L), generator=gen)
    elif kind == "images":
        x = torch.rand(B, *cfg.image, generator=gen, dtype=torch.float64)
    else:
        x = torch.randn(B, L, cfg.d_in, generator=gen, dtype=torch.float64)
    P = 1 if cfg.pool != "none" else L + int(cfg.cls_token)
    if loss == "ce":
        target = torch.randint(0, cfg.n_out, (B,), generator=gen)
    elif loss == "ce-token":
        loss, target = "ce", torch.randint(0, cfg.n_out, (B, P), generator=gen)
    elif loss == "mse":
        target = torch.randn(B, P, cfg.n_out, generator=gen, dtype=torch.float64)
    else:
        loss, target = (lambda z, t: (z.softmax(-1) * t).sum() ** 2), torch.randn(B, cfg.n_out, generator=gen,
                                                                                    dtype=torch.float64)
    return cfg, params, x, loss, target


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("part", ["full", "outer", "functional"])
def test_products_equal_dense_hessian(name, part):
    _check_products(name, part, 3)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("stack_max_rows", [0, 10**6])
@pytest.mark.parametrize("k", [1, 3])
def test_head_rows_by_either_rule_equal_dense_hessian(name, stack_max_rows, k, monkeypatch):
    """The head's weight rows ``ġᵀh + gᵀḣ`` as two products into one result (``HEAD_STACK_MAX_ROWS`` 0) and
    as one product over the rows stacked twice (any row count)."""
    monkeypatch.setattr(stages, "HEAD_STACK_MAX_ROWS", stack_max_rows)
    _check_products(name, "full", k)


def _check_products(name, part, k):
    cfg, params, x, loss, target = _case(name)
    H = bh.hessian(params, x, cfg, loss=loss, target=target)
    D = {"full": H, "outer": H.outer, "functional": H.functional}[part].dense()
    shapes = model_param_shapes(cfg)
    gen = torch.Generator().manual_seed(1)
    Vflat = torch.randn(D.shape[0], k, generator=gen, dtype=torch.float64)
    V, off = {}, 0
    for n, s in shapes.items():
        size = math.prod(s)
        V[n] = Vflat[off:off + size].T.reshape(k, *s)
        off += size
    prod = product(params, x, cfg, loss, target)
    names = tuple(shapes) + ((TIED_HEAD,) if cfg.tied else ())
    internal = dict(shapes, **({TIED_HEAD: shapes["W_E"][::-1]} if cfg.tied else {}))
    HV = unfold_tied(prod(fold_tied(V, internal), names, outer=part != "functional", functional=part != "outer"))
    got = torch.cat([HV[n].reshape(k, -1) for n in shapes], 1).T
    assert_close(got, D @ Vflat, what=f"{name} {part} H @ V")


def _head_case(dtype=torch.float64):
    from blockhess.model.stages import SoftmaxHead

    gen = torch.Generator().manual_seed(3)
    B, P, d, C = 2, 3, 6, 11
    h = torch.randn(B, P, d, generator=gen, dtype=dtype)
    W = torch.randn(d, C, generator=gen, dtype=dtype)
    y = torch.randint(0, C, (B, P), generator=gen)
    y[1, 0] = losses.IGNORE
    return SoftmaxHead(h, W, None, y, 5, ("W_H",)), gen


def _head_reference(top, dx):
    """The head's plain pass the long way: the logit tangents, the softmax Hessian per row, back by ``Wᵀ``."""
    k = dx.shape[0]
    stage = top.head()
    dz = stage.tangent(dx, {}, k)
    dg, _ = stage.adjoint2(top.g, dx, {}, top.omega(dz), [], True)
    return dg


def test_head_pass_equals_the_logit_path_before_and_after_its_matrices(monkeypatch):
    from blockhess.model import stages

    top, gen = _head_case()
    d = top.W.shape[0]
    formed = []
    real = stages.SoftmaxHead.gram
    monkeypatch.setattr(stages.SoftmaxHead, "gram", lambda self: formed.append(1) or real(self))
    monkeypatch.setattr(stages, "THROUGH_CHUNK_BYTES", 1)  # chunks of 256 columns: one here; below, several
    for k in (1, d // 2 - 1, 2):  # below the break-even, then past it
        dx = torch.randn(k, *top.h.shape, generator=gen, dtype=top.h.dtype)
        assert_close(top.through(dx), _head_reference(top, dx), what=f"head pass k={k}")
    assert len(formed) == 1
    # the matrices themselves: W Ω_t Wᵀ per row, zero for an ignored row
    p = top.p.reshape(-1, top.W.shape[1])
    ref = torch.stack([top.W @ (torch.diag(pt) - torch.outer(pt, pt)) @ top.W.T for pt in p]) / top.N
    M = top.gram()
    assert_close(M, ref, what="per-row head matrices")
    assert float(M[3].abs().max()) == 0.0  # the row of target -100
    assert_close(M, M.transpose(1, 2), what="symmetry")


def test_head_matrices_formed_at_the_first_pass_a_plan_pays_for(monkeypatch):
    """``expect``: a promise below the break-even changes nothing; one past it forms the per-row matrices at the
    next pass, long before the columns through would have (2 of the 5 at d = 16); the passes stay exact."""
    from blockhess.model import stages

    gen = torch.Generator().manual_seed(8)
    B, P, d, C = 1, 3, 16, 9
    h = torch.randn(B, P, d, generator=gen, dtype=torch.float64)
    W = torch.randn(d, C, generator=gen, dtype=torch.float64)
    top = stages.SoftmaxHead(h, W, None, torch.randint(0, C, (B, P), generator=gen), 3, ("W_H",))
    assert stages._gram_share(d) * d / 2 == 5.0
    formed = []
    real = stages.SoftmaxHead.gram
    monkeypatch.setattr(stages.SoftmaxHead, "gram", lambda self: formed.append(1) or real(self))
    top.expect(1)
    dx = torch.randn(1, B, P, d, generator=gen, dtype=torch.float64)
    assert_close(top.through(dx), _head_reference(top, dx), what="head pass, a small plan")
    assert formed == []
    top.expect(d)
    dx = torch.randn(1, B, P, d, generator=gen, dtype=torch.float64)
    assert_close(top.through(dx), _head_reference(top, dx), what="head pass, the matrices formed on the plan")
    assert formed == [1] and top._through_columns == 2


@pytest.mark.parametrize("d, C", [(1, 7), (3, 7), (4, 7), (5, 7), (9, 7), (17, 7), (6, 600)])
def test_head_matrices_by_block_triangle_at_every_width(d, C, monkeypatch):
    """The per-row matrices formed by their upper block triangle (``GRAM_BLOCKS`` block rows, the last one
    short where ``d`` does not divide; over several vocabulary chunks at ``C`` = 600) equal ``W Ω_t Wᵀ`` formed
    whole, and are symmetric (the mirrored blocks exactly, the diagonal blocks to rounding)."""
    from blockhess.model import stages
    from blockhess.model.stages import SoftmaxHead

    monkeypatch.setattr(stages, "THROUGH_CHUNK_BYTES", 1)  # chunks of 256 columns
    gen = torch.Generator().manual_seed(d)
    B, P = 1, 3
    h = torch.randn(B, P, d, generator=gen, dtype=torch.float64)
    W = torch.randn(d, C, generator=gen, dtype=torch.float64)
    top = SoftmaxHead(h, W, None, torch.randint(0, C, (B, P), generator=gen), 3, ("W_H",))
    p = top.p.reshape(-1, C)
    ref = torch.stack([W @ (torch.diag(pt) - torch.outer(pt, pt)) @ W.T for pt in p]) / top.N
    M = top.gram()
    assert_close(M, ref, what=f"per-row head matrices, d={d}")
    assert_close(M, M.transpose(1, 2), what="symmetry")
    b = -(-d // stages.GRAM_BLOCKS)
    assert torch.equal(M[:, b:, :b], M[:, :b, b:].transpose(1, 2))  # the first block column: the first block row's


def test_head_pass_in_vocabulary_chunks_and_without_memory(monkeypatch):
    from blockhess.model import stages
    from blockhess.validation import InsufficientMemoryError

    gen = torch.Generator().manual_seed(4)
    B, P, d, C = 1, 2, 4, 600  # 600 columns: chunks of 256, 256, 88
    h = torch.randn(B, P, d, generator=gen, dtype=torch.float64)
    W = torch.randn(d, C, generator=gen, dtype=torch.float64)
    top = stages.SoftmaxHead(h, W, None, torch.randint(0, C, (B, P), generator=gen), 2, ("W_H",))
    monkeypatch.setattr(stages, "THROUGH_CHUNK_BYTES", 1)

    def refuse(nbytes, what, device="cpu"):
        raise InsufficientMemoryError(f"{what}: {nbytes}")

    monkeypatch.setattr(stages, "check_fits", refuse)
    monkeypatch.setattr(stages.SoftmaxHead, "gram", lambda self: pytest.fail("formed without the memory"))
    for _ in range(4):  # 4 × 3 columns, past d/2, but the matrices do not fit: the chunked pass every time
        dx = torch.randn(3, B, P, d, generator=gen, dtype=torch.float64)
        assert_close(top.through(dx), _head_reference(top, dx), what="chunked head pass")


@pytest.mark.parametrize("k", [1, 3])
def test_head_products_in_float32(k, monkeypatch):
    """The head's products on float32's path (oneDNN where torch has it): the pass for plain tangents in
    three chunks, and the second-order adjoint ``ġ_h = ġ Wᵀ + g Ẇᵀ`` with the weight's rows ``hᵀ ġ + ḣᵀ g``,
    against float64 on the same float32 inputs, judged by the same formulas in plain float32 torch."""
    from conftest import assert_float32_close

    from blockhess import gemm
    from blockhess.model.stages import SoftmaxHead

    gen = torch.Generator().manual_seed(3)
    h, W = torch.randn(2, 3, 6, generator=gen).float(), torch.randn(6, 600, generator=gen).float()
    y = torch.randint(0, 600, (2, 3), generator=gen)
    y[1, 0] = losses.IGNORE
    top32 = SoftmaxHead(h, W, None, y, 5, ("W_H",))
    top64 = SoftmaxHead(h.double(), W.double(), None, y, 5, ("W_H",))  # the same numbers in float64
    B, P, d = top32.h.shape
    C = top32.W.shape[1]
    monkeypatch.setattr(stages, "THROUGH_CHUNK_BYTES", 256 * k * B * P * 4)  # chunks of 256, 256 and 88 columns
    monkeypatch.setattr(stages.SoftmaxHead, "_gram_due", lambda self, k: False)
    chunks, mm = [], gemm.mm
    monkeypatch.setattr(gemm, "mm", lambda a, b: chunks.append(b.shape[1]) or mm(a, b))
    dx = torch.randn(k, B, P, d, generator=gen)

    def parts(top, dx):  # the pass's two terms, which cancel: (p ⊙ ż / N) Wᵀ and the rank-one (p·ż / N) W p
        dz = dx @ top.W
        return ((top.p * dz) / top.N) @ top.W.T, ((top.p * dz).sum(-1, keepdim=True) / top.N) * (top.p @ top.W.T)

    got = top32.through(dx)
    monkeypatch.setattr(gemm, "mm", mm)
    assert chunks == [256, 256, 88]
    (first, rank), (first64, rank64) = parts(top32, dx), parts(top64, dx.double())
    assert_float32_close(got, first - rank, _head_reference(top64, dx.double()),
                         terms=[(first, first64), (rank, rank64)], what="the head's pass")

    dW = torch.randn(k, d, C, generator=gen)
    dg = torch.randn(k, B, P, C, generator=gen)
    gh, rows = top32.head().adjoint2(top32.g, dx, {"W_H": dW}, dg, ["W_H"], True)
    gh64, rows64 = top64.head().adjoint2(top64.g, dx.double(), {"W_H": dW.double()}, dg.double(), ["W_H"], True)
    g, h = top32.g.reshape(B * P, C), top32.h.reshape(B * P, d)
    gh_plain = dg.reshape(k, B * P, C) @ top32.W.T + g @ dW.mT
    rows_plain = h.T @ dg.reshape(k, B * P, C) + dx.reshape(k, B * P, d).mT @ g
    assert_float32_close(gh.reshape(k, B * P, d), gh_plain, gh64.reshape(k, B * P, d), what="ġ_h")
    assert_float32_close(rows["W_H"], rows_plain, rows64["W_H"], what="the weight's rows")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_head_pass_chunks_are_whole_cache_lines(dtype, monkeypatch):
    """A column chunk the byte budget would make 300 wide is cut to whole cache lines (296 float64, 288
    float32 columns), the last chunk the remainder; the pass stays exact (checked in float64)."""
    from blockhess import gemm, heap
    from blockhess.model import stages

    gen = torch.Generator().manual_seed(5)
    B, P, d, C, k = 1, 2, 8, 600, 1  # one column, below the matrices' break-even
    h = torch.randn(B, P, d, generator=gen, dtype=dtype)
    W = torch.randn(d, C, generator=gen, dtype=dtype)
    top = stages.SoftmaxHead(h, W, None, torch.randint(0, C, (B, P), generator=gen), 2, ("W_H",))
    size = torch.empty((), dtype=dtype).element_size()
    monkeypatch.setattr(stages, "THROUGH_CHUNK_BYTES", 300 * k * B * P * size)
    monkeypatch.setattr(stages.SoftmaxHead, "gram", lambda self: pytest.fail("matrices formed"))
    widths, mm = [], gemm.mm

    def spy(a, b):
        widths.append(b.shape[1])
        return mm(a, b)

    dx = torch.randn(k, B, P, d, generator=gen, dtype=dtype)
    monkeypatch.setattr(gemm, "mm", spy)
    got = top.through(dx)
    monkeypatch.setattr(gemm, "mm", mm)
    line = heap.ROW_ALIGN_BYTES // size
    step = 300 - 300 % line
    assert widths == [step, step, C - 2 * step] and (step * size) % heap.ROW_ALIGN_BYTES == 0
    if dtype == torch.float64:
        assert_close(got, _head_reference(top, dx), what="chunked head pass")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("tied, bias, moved", [(True, False, True), (False, True, True), (False, True, False)])
def test_head_tangent_rows_and_values(dtype, tied, bias, moved):
    """The head's logit tangents ``ż = ḣ W + h Ẇ + ḃ`` ``(k, B, P, C)`` at an odd vocabulary (C = 13), several
    directions and sequences, tied or not, with a bias, with and without an input tangent: rows a whole number
    of cache lines apart where torch's GEMM writes them (float64; float32 without oneDNN), contiguous where
    oneDNN does, values those of the formula (float32 judged by the same formula in float32)."""
    from blockhess import gemm, heap
    from blockhess.model.stages import TIED_HEAD, HeadStage

    from conftest import assert_float32_close

    gen = torch.Generator().manual_seed(0)
    k, B, P, d, C = 3, 2, 3, 8, 13
    h = torch.randn(B, P, d, generator=gen, dtype=torch.float64)
    W = torch.randn(C, d, generator=gen, dtype=torch.float64).T  # the tied head's W_Eᵀ, a transposed view
    W = W if tied else W.contiguous()
    names = (TIED_HEAD if tied else "W_H",) + (("b_H",) if bias else ())
    dW = torch.randn(k, d, C, generator=gen, dtype=torch.float64)
    V = {names[0]: dW.transpose(1, 2).contiguous() if tied else dW}  # the tied head's direction as Ẇᵀ
    if bias:
        V["b_H"] = torch.randn(k, C, generator=gen, dtype=torch.float64)
    dx = torch.randn(k, B, P, d, generator=gen, dtype=torch.float64) if moved else None

    def formula(h, W, V, dx):
        z = torch.einsum("bpi,kic->kbpc", h, V[names[0]].transpose(1, 2) if tied else V[names[0]])
        return z + (0 if dx is None else dx @ W) + (V["b_H"][:, None, None] if bias else 0)

    def cast(t):
        return None if t is None else t.to(dtype)

    got = HeadStage(cast(h), cast(W), names).tangent(cast(dx), {m: cast(t) for m, t in V.items()}, k)
    assert got.shape == (k, B, P, C) and got.dtype == dtype
    if gemm.onednn(cast(h)):  # oneDNN's products: fresh contiguous results
        assert got.is_contiguous()
    else:
        assert got.stride(-1) == 1 and (got.stride(-2) * got.element_size()) % heap.ROW_ALIGN_BYTES == 0
    want = formula(cast(h).double(), cast(W).double(), {m: cast(t).double() for m, t in V.items()},
                   None if dx is None else cast(dx).double())
    if dtype == torch.float64:
        assert_close(got, want, what="logit tangents")
    else:
        A32 = formula(cast(h), cast(W), {m: cast(t) for m, t in V.items()}, cast(dx))
        assert_float32_close(got, A32, want, what="logit tangents, float32")


@pytest.mark.parametrize("name, wrt", [("lm-tied", None), ("vit", None), ("lm-tied-wide", ["blocks.0.W_1"])])
def test_a_tracked_direction_through_the_head(name, wrt):
    """``A @ V`` with ``V`` requiring grad (the operator's tracked path, no ``out=``), with the head's own
    directions (its logit tangents) and without (a block's alone at d = 16: the head's pass in chunks): the
    product as untracked, and its gradient ``d(1ᵀ A V)/dV = A 1`` in each column (A symmetric)."""
    cfg, params, x, loss, target = _case(name)
    A = bh.hessian_operator(params, x, cfg, loss=loss, target=target, wrt=wrt)
    V = torch.randn(A.shape[1], 2, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    Vg = V.clone().requires_grad_()
    Y = A @ Vg
    Y.sum().backward()
    assert_close(Y.detach(), A @ V, what="tracked product")
    assert_close(Vg.grad, (A @ torch.ones(A.shape[1], 1, dtype=torch.float64)).expand(-1, 2), what="its gradient")


def test_restricted_products_through_the_head_equal_dense_rows():
    # directions on one block only, one column a call: the head's plain pass, its matrices formed on the way
    cfg, params, x, loss, target = _case("lm-tied")
    target = target.clone()
    target[0, 1] = losses.IGNORE
    H = bh.hessian(params, x, cfg, loss=loss, target=target)
    for part in ("full", "outer"):
        V = bh.hessian_operator(params, x, cfg, loss=loss, target=target, part=part)["blocks.0.W_1", "blocks.0.W_1"]
        ref = (H if part == "full" else H.outer)["blocks.0.W_1", "blocks.0.W_1"]
        E = torch.eye(V.shape[0], dtype=torch.float64)
        cols = torch.cat([V @ E[:, i:i + 1] for i in range(V.shape[0])], 1)  # 24 calls, past d/2 = 2 columns
        assert_close(cols, ref, what=f"{part}: one column a call")


def test_a_product_leaves_no_reference_cycle_holding_tensors():
    """After a product and its result are dropped, nothing is left for the cyclic garbage collector: the
    pass's recursive closures (``run``/``up``, ``nest``) are broken when it ends, so the directions, the
    rows and every stage's tangents are freed at once, not when the collector next runs (over a lock-step
    run the uncollected ones held GBs)."""
    import gc

    cfg, params, x, loss, target = _case("lm-tied")
    prod = product(params, x, cfg, loss, target)
    shapes = model_param_shapes(cfg)
    V = fold_tied({n: torch.randn(2, *s, dtype=torch.float64) for n, s in shapes.items()},
                  dict(shapes, **{TIED_HEAD: shapes["W_E"][::-1]}))
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        HV = prod(V, tuple(shapes) + (TIED_HEAD,))
        assert HV
        del HV
        gc.collect()
        cyclic = [o for o in gc.garbage if isinstance(o, torch.Tensor)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert cyclic == []



@pytest.mark.parametrize("center", [True, False])
@pytest.mark.parametrize("scaled", [True, False])
def test_norm_stage_passes_in_closed_form_equal_its_jacobians(center, scaled):
    """A norm stage's ``fwd`` (``J_x G``) and ``back`` (``J_xᵀ w``), taken per token in closed form, equal the
    products with its per-token Jacobians ``diag(γ) J_n`` (Theorem 2) formed whole: LayerNorm and RMSNorm, with
    and without ``γ``."""
    from blockhess.model.stages import NormStage

    gen = torch.Generator().manual_seed(2 * center + scaled)
    B, L, d, n = 2, 3, 5, 4
    x = torch.randn(B, L, d, generator=gen, dtype=torch.float64)
    gamma = torch.randn(d, generator=gen, dtype=torch.float64) if scaled else None
    st = NormStage(x, 1e-5, gamma, None, ("gamma_F",), center=center)
    J = st.Jn if gamma is None else gamma[:, None] * st.Jn
    G = torch.randn(B, L * d, n, generator=gen, dtype=torch.float64)
    W = torch.randn(B, n, L * d, generator=gen, dtype=torch.float64)
    assert_close(st.fwd(G), torch.einsum("blij,bljn->blin", J, G.reshape(B, L, d, n)).reshape(B, L * d, n),
                 what="fwd")
    assert_close(st.back(W), torch.einsum("blij,brli->brlj", J, W.reshape(B, n, L, d)).reshape(B, n, -1),
                 what="back")
