"""Every block's own product at once (``A.block_diagonal(blocks)``, ``BlockDiagonalOperator``, a model's in one
pass of ``ModelProduct.columns``) against the per-block views, the dense Hessian's diagonal blocks and autograd
on a real module; the lock-step estimators (``blockwise_eigs``, ``blockwise_slq``) against the per-block ones
and dense ``eigh``; the Jensen–Shannon distance's properties."""

from __future__ import annotations

import math

import pytest
import torch

import blockhess as bh
from blockhess.operators import (BlockDiagonalOperator, NotConvergedError, blockwise_eigs, blockwise_slq, js_distance,
                                 lanczos_eigs, slq_density)

from conftest import assert_close
from test_model_products import _case

DT = torch.float64
PARTS = ("full", "outer", "functional")
# per model case: names, heads, tuples across stages (a tied W_E among them for the language model)
BLOCKS = {
    "lm-tied": ["W_E", "blocks.0.W_Q#1", "blocks.0.W_Q#0", ("blocks.0.W_2", "blocks.1.W_K"), "blocks.1.W_1",
                ("gamma_F", "blocks.1.b_2"), "W_P"],
    "vit": ["W_H", ("W_E", "blocks.0.W_V"), "blocks.0.W_K#1", "blocks.0.gamma_1", "b_H"],
    "bert-mse": [("blocks.1.W_Q", "W_E"), "blocks.0.W_V", "blocks.0.W_1", "blocks.1.gamma_2", "gamma_E"],
}


def _dense_blocks(H: torch.Tensor, A, blocks) -> torch.Tensor:
    """The dense Hessian's diagonal blocks over ``blocks`` (each block's entries as its view lays them out),
    as one block-diagonal matrix: columns of the identity through the per-entry positions."""
    pos = _positions(A)
    idx = [torch.cat([pos[v] for v in A[b, b].names]) for b in blocks]
    out = torch.zeros(sum(len(i) for i in idx), sum(len(i) for i in idx), dtype=H.dtype)
    o = 0
    for i in idx:
        out[o:o + len(i), o:o + len(i)] = H[i][:, i]
        o += len(i)
    return out


def _positions(A) -> dict:
    """Each variable's entries' positions in the operator's flat layout (a head's by probing its view)."""
    n = A.shape[0]
    probe = torch.arange(n, dtype=DT)
    out = {}
    for v in A._vars:
        # the view A[v, v]'s columns embedded into the parameters: which flat entries they are
        E = torch.eye(A[v, v].shape[0], dtype=DT)
        V = A[v, v]._columns_to_params(E)
        flat = torch.cat([V[p].reshape(E.shape[0], -1) if p in V else torch.zeros(E.shape[0], math.prod(A.param_shapes[p]),
                                                                                  dtype=DT) for p in A.params], 1)
        out[v] = (flat @ probe).round().long()
    return out


@pytest.mark.parametrize("name", list(BLOCKS))
def test_block_diagonal_equals_views_and_dense(name):
    cfg, params, x, loss, target = _case(name)
    H = bh.hessian(params, x, cfg, loss=loss, target=target)
    gen = torch.Generator().manual_seed(2)
    for part in PARTS:
        A = bh.hessian_operator(params, x, cfg, loss=loss, target=target, part=part)
        dense = {"full": H, "outer": H.outer, "functional": H.functional}[part].dense()
        D = A.block_diagonal(BLOCKS[name])
        assert isinstance(D, BlockDiagonalOperator) and D.shape[0] == sum(A[b, b].shape[0] for b in D.blocks)
        V = torch.randn(D.shape[0], 3, generator=gen, dtype=DT)
        Y = D @ V
        per = torch.cat([A[b, b] @ V[o:o + s] for b, o, s in zip(D.blocks, D.offsets, D.sizes)])
        assert_close(Y, per, tol=1e-12, what=f"{name} {part} D @ V vs the views")
        assert_close(Y, _dense_blocks(dense, A, D.blocks) @ V, tol=1e-12, what=f"{name} {part} D @ V vs dense")
        assert_close(D @ V[:, 1], Y[:, 1], tol=1e-12, what=f"{name} {part} D @ v (n,)")
        M = D.to_scipy() @ V.numpy()
        assert_close(torch.as_tensor(M), Y, tol=1e-12, what="to_scipy")


def test_block_diagonal_of_a_block_and_of_a_mean():
    cfg = bh.BlockConfig(d_model=4, d_ff=6, n_heads=2, norm="pre", causal=True)
    gen = torch.Generator().manual_seed(0)
    p = {k: v + 0.1 * torch.randn(v.shape, generator=gen, dtype=DT) for k, v in bh.init_params(cfg, 1).items()}
    X, T = torch.randn(2, 3, 4, generator=gen, dtype=DT), torch.randn(2, 3, 4, generator=gen, dtype=DT)
    blocks = ["W_Q#1", ("W_2", "W_K"), "W_1", "W_V#0"]
    A = bh.hessian_operator(p, X, cfg, target=T)
    D = A.block_diagonal(blocks)
    dense = _dense_blocks(bh.hessian(p, X, cfg, target=T).dense(), A, D.blocks)
    V = torch.randn(D.shape[0], 2, generator=gen, dtype=DT)
    assert_close(D @ V, dense @ V, tol=1e-12, what="block D @ V vs dense")
    parts = [bh.hessian_operator(p, X[i:i + 1], cfg, target=T[i:i + 1]) for i in range(2)]
    Dm = bh.operators.mean_operator(parts).block_diagonal(blocks)
    assert_close(Dm @ V, D @ V, tol=1e-12, what="mean of the batch's halves")


def test_real_gpt2_module_against_autograd():
    """A Hugging Face GPT-2 read by from_torch: D @ v over c_attn's Q, K column blocks, c_fc and the tied wte
    against autograd's Hessian of each module tensor (double backward), float64."""
    from torch.func import functional_call
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers import GPT2Config, GPT2LMHeadModel

    conf = GPT2Config(vocab_size=7, n_positions=8, n_embd=4, n_layer=2, n_head=2, n_inner=6, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0, eos_token_id=0, bos_token_id=0)
    conf._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = GPT2LMHeadModel(conf).double().eval()
    gen = torch.Generator().manual_seed(1)
    ids, y = torch.randint(0, 7, (2, 3), generator=gen), torch.randint(0, 7, (2, 3), generator=gen)
    cfg, params = bh.from_torch(model)
    A = bh.hessian_operator(params, ids, cfg, loss="ce", target=y)
    blocks = ["W_E", "blocks.1.W_Q", "blocks.0.W_K", "blocks.0.W_1"]
    D = A.block_diagonal(blocks)
    v = torch.randn(D.shape[0], generator=gen, dtype=DT)
    got = D @ v
    named = dict(model.named_parameters())
    tf = "transformer"
    where = {"W_E": (f"{tf}.wte.weight", None), "blocks.1.W_Q": (f"{tf}.h.1.attn.c_attn.weight", slice(0, 4)),
             "blocks.0.W_K": (f"{tf}.h.0.attn.c_attn.weight", slice(4, 8)), "blocks.0.W_1": (f"{tf}.h.0.mlp.c_fc.weight", None)}
    for b, o, s in zip(D.blocks, D.offsets, D.sizes):
        key, cols = where[b]
        w0 = named[key].detach()

        def loss(w, key=key):
            with sdpa_kernel(SDPBackend.MATH):
                logits = functional_call(model, {key: w}, (ids,)).logits
            return torch.nn.functional.cross_entropy(logits.reshape(-1, 7), y.reshape(-1))

        Hw = torch.autograd.functional.hessian(loss, w0, vectorize=True).reshape(w0.numel(), w0.numel())
        idx = torch.arange(w0.numel()).reshape(w0.shape)
        idx = (idx if cols is None else idx[:, cols]).reshape(-1)
        assert_close(got[o:o + s], Hw[idx][:, idx] @ v[o:o + s], tol=1e-10, what=f"GPT-2 {b} vs autograd")


def test_block_diagonal_default_blocks_and_refusals():
    cfg, params, x, loss, target = _case("lm-tied")
    A = bh.hessian_operator(params, x, cfg, loss=loss, target=target)
    D = A.block_diagonal()
    assert D.blocks == A.names and D.shape == A.shape and D.T is D and D.is_symmetric
    with pytest.raises(KeyError, match="unknown variable"):
        A.block_diagonal(["W_E", "nope"])
    with pytest.raises(ValueError, match="overlaps an earlier block in 'blocks.0.W_Q'"):
        A.block_diagonal(["blocks.0.W_Q#0", "blocks.0.W_Q"])
    with pytest.raises(KeyError, match="overlapping"):
        A.block_diagonal([("blocks.0.W_Q", "blocks.0.W_Q#1")])
    D = A.block_diagonal(["W_E", "W_P"])
    with pytest.raises(ValueError, match="float64"):
        D @ torch.zeros(D.shape[0])
    with pytest.raises(ValueError, match=r"in the entries of block 'W_P'"):
        D @ torch.cat([torch.zeros(D.sizes[0], dtype=DT), torch.full((D.sizes[1],), float("inf"), dtype=DT)])


def _lm():
    cfg, params, x, loss, target = _case("lm-tied")
    A = bh.hessian_operator(params, x, cfg, loss=loss, target=target)
    return A, A.block_diagonal(["W_E", "blocks.0.W_Q", ("blocks.0.W_2", "blocks.1.W_K"), "blocks.1.W_V#0",
                                "blocks.1.b_2"])


def test_blockwise_eigs_names_the_block_a_k_exceeds():
    """``k`` above a block's size (a NumPy integer as well as an int): refused naming the block, before any
    product."""
    np = pytest.importorskip("numpy")
    A, D = _lm()
    small = min(range(len(D.blocks)), key=lambda j: D.views[j].shape[0])
    n = D.views[small].shape[0]
    for k in (n + 1, np.int64(n + 1)):
        with pytest.raises(ValueError, match=f"block {D.blocks[small]!r} has n = {n}, got k = {n + 1}"):
            blockwise_eigs(D, k=k)


def test_blockwise_eigs_equals_per_block_and_dense():
    A, D = _lm()
    R = blockwise_eigs(D, k=2, tol=1e-9)
    assert list(R) == list(D.blocks) and len(R) == len(D.blocks)
    for b in D.blocks:
        one = lanczos_eigs(A[b, b], k=2, tol=1e-9)
        exact = torch.linalg.eigvalsh(A[b, b].dense()).flip(0)[:2]
        assert R[b].converged and R[b].matvecs == R.matvecs[b] == one.matvecs
        assert_close(R[b].eigenvalues, one.eigenvalues, tol=1e-12, what=f"{b} lock-step vs per-block")
        assert_close(R[b].eigenvalues, exact, tol=1e-8, what=f"{b} lock-step vs eigh")
        r = A[b, b] @ R[b].eigenvectors - R[b].eigenvectors * R[b].eigenvalues
        assert bool((r.norm(dim=0) <= R[b].bounds).all())
    assert R.products == max(R.calls.values()) < sum(R.calls.values())  # one D product per step of the longest
    warm = blockwise_eigs(D, k=2, tol=1e-9, v0=R)  # warm starts from the eigenvectors: the same pairs
    for b in D.blocks:
        assert_close(warm[b].eigenvalues, R[b].eigenvalues, tol=1e-8, what=f"{b} warm")


def test_blockwise_eigs_raises_a_blocks_error_by_name():
    _, D = _lm()
    with pytest.raises(NotConvergedError) as e:
        blockwise_eigs(D, k=2, tol=1e-12, max_matvecs=4)
    assert "in the lock-step estimator of block 'W_E'" in "".join(getattr(e.value, "__notes__", []))


def test_blockwise_slq_equals_per_block():
    A, D = _lm()
    S = blockwise_slq(D, n_probes=3, n_iter=8, seed=5)
    for b in D.blocks:
        one = slq_density(A[b, b], n_probes=3, n_iter=8, seed=5)
        assert S[b].matvecs == one.matvecs == S.matvecs[b] and S.calls[b] <= min(8, D.sizes[D.blocks.index(b)])
        assert_close(S[b].nodes, one.nodes, tol=1e-10, what=f"{b} SLQ nodes")
        assert_close(S[b].density, one.density, tol=1e-10, what=f"{b} SLQ density")
    assert S.products == max(S.calls.values()) == 8


def test_blockwise_slq_takes_the_eigensolvers_runs_as_probes():
    """``blockwise_slq(D, probes=E)``: every block's density is the per-block ``slq_density`` with that block's
    kept runs (the same nodes and density), and a block whose runs are enough (a check that spans its
    complement included) multiplies nothing. Bad ``probes`` are refused by name."""
    A, D = _lm()
    E = blockwise_eigs(D, k=2, tol=1e-9, ncv=12, check=6, check_runs=2)
    S = blockwise_slq(D, n_probes=3, n_iter=6, seed=5, probes=E)
    for b in D.blocks:
        one = slq_density(A[b, b], n_probes=3, n_iter=6, seed=5, probes=E[b].probes)
        m = min(6, D.sizes[D.blocks.index(b)])
        kept = sum(1 for p in E[b].probes if p.steps >= min(m, p.n - p.deflated.numel()))
        assert S[b].matvecs == one.matvecs == S.matvecs[b] == max(0, 3 - kept) * m
        assert_close(S[b].nodes, one.nodes, tol=1e-10, what=f"{b} SLQ nodes")
        assert_close(S[b].density, one.density, tol=1e-10, what=f"{b} SLQ density")
    assert any(S.matvecs[b] == 0 for b in D.blocks)
    assert S.products == max(S.calls.values())
    with pytest.raises(ValueError, match="probes names a block 'nope' that D does not have"):
        blockwise_slq(D, n_probes=3, n_iter=6, probes={"nope": E["W_E"]})
    with pytest.raises(ValueError, match=r"probes\['W_E'\] must be an EigResult or a sequence of KrylovProbe"):
        blockwise_slq(D, n_probes=3, n_iter=6, probes={"W_E": 3})


def test_lockstep_estimators_tell_the_head_their_plan(monkeypatch):
    """Before the first product each lock-step estimator gives ``D`` the columns it means to multiply; the
    model's head hears those of the blocks without a direction of its own (the tied ``W_E``'s are not
    counted), no more than then cross it, and the results equal those of a run whose head hears nothing."""
    from blockhess.model import stages
    from blockhess.operators.estimators import CHECK_COLUMNS

    real = stages.SoftmaxHead.expect
    monkeypatch.setattr(stages.SoftmaxHead, "expect", lambda self, c: None)
    _, D = _lm()
    deaf = blockwise_slq(D, n_probes=3, n_iter=8, seed=5)
    deaf_eigs = blockwise_eigs(D, k=2, tol=1e-9)
    heard, crossed = [], []
    through = stages.SoftmaxHead.through
    monkeypatch.setattr(stages.SoftmaxHead, "expect", lambda self, c: heard.append(c) or real(self, c))
    monkeypatch.setattr(stages.SoftmaxHead, "through", lambda self, dx: crossed.append(dx.shape[0]) or through(self, dx))
    _, D = _lm()
    S = blockwise_slq(D, n_probes=3, n_iter=8, seed=5)
    others = [n for b, n in zip(D.blocks, D.sizes) if b != "W_E"]
    assert heard == [sum(3 * min(8, n) for n in others)] and heard[0] <= sum(crossed)
    crossed.clear()
    _, D = _lm()
    R = blockwise_eigs(D, k=2, tol=1e-9)
    assert heard[1] == sum(2 * min(2, n) + (min(CHECK_COLUMNS, n - 2) if n > 2 else 0) for n in others) <= sum(crossed)
    for b in D.blocks:
        assert_close(S[b].density, deaf[b].density, tol=1e-10, what=f"{b} SLQ with and without the plan")
        assert_close(R[b].eigenvalues, deaf_eigs[b].eigenvalues, tol=1e-10, what=f"{b} top-k with and without")


def test_expect_columns_refusals():
    A, D = _lm()
    with pytest.raises(ValueError, match="columns"):
        A.expect_columns(-1)
    with pytest.raises(ValueError, match="block indices"):
        D.expect_columns({len(D.blocks): 3})
    with pytest.raises(ValueError, match=r"columns\[0\]"):
        D.expect_columns({0: 2.5})
    with pytest.raises(ValueError, match="dict"):
        D.expect_columns([3])
    A.expect_columns(0), D.expect_columns({})  # nothing to say: accepted


def test_lockstep_memory_checked_for_every_block_before_any_product(monkeypatch):
    from blockhess.operators import lockstep
    from blockhess.operators.estimators import lanczos_bytes, slq_bytes
    from blockhess.validation import InsufficientMemoryError

    A, D = _lm()
    asked = []

    def refuse(nbytes, what, device="cpu"):
        asked.append(nbytes)
        raise InsufficientMemoryError(f"{what} would need {nbytes} bytes")

    monkeypatch.setattr(lockstep, "check_fits", refuse)
    monkeypatch.setattr(D, "products", lambda X, out=None: pytest.fail("a product before the memory check"))
    with pytest.raises(InsufficientMemoryError, match="lock-step estimators' bases"):
        blockwise_slq(D, n_probes=3, n_iter=8)
    assert asked[-1] == sum(slq_bytes(n, DT, 3, 8) for n in D.sizes)
    with pytest.raises(InsufficientMemoryError, match="lock-step estimators' bases"):
        blockwise_eigs(D, k=2, ncv=6)
    assert asked[-1] == sum(lanczos_bytes(n, DT, 2, 6) for n in D.sizes)
    assert slq_bytes(10, DT, 3, 8) == 3 * 8 * 10 * 8 and slq_bytes(10, DT, 3, 8, "none") == 3 * 3 * 10 * 8
    assert lanczos_bytes(100, torch.float32, 5) == 100 * (60 + 10) * 4  # the default ncv, 60 columns


def test_js_distance():
    p = torch.tensor([0.2, 0.5, 0.3, 0.0], dtype=DT)
    q = torch.tensor([0.1, 0.1, 0.4, 0.4], dtype=DT)
    assert js_distance(p, p) == 0.0
    assert js_distance(p, q) == pytest.approx(js_distance(q, p), rel=1e-15)
    assert 0 < js_distance(p, q) <= 1
    assert js_distance(torch.tensor([1.0, 0.0], dtype=DT), torch.tensor([0.0, 1.0], dtype=DT)) == pytest.approx(1, rel=1e-15)
    # [1, 0] against [1/2, 1/2]: m = [3/4, 1/4], JSD = (log2(4/3) + (log2(2/3) + 1) / 2) / 2
    known = math.sqrt((math.log2(4 / 3) + (math.log2(2 / 3) + 1) / 2) / 2)
    assert js_distance(torch.tensor([1.0, 0.0], dtype=DT), torch.tensor([0.5, 0.5], dtype=DT)) == pytest.approx(known,
                                                                                                               rel=1e-14)
    scipy = pytest.importorskip("scipy.spatial.distance")
    assert js_distance(p, q) == pytest.approx(float(scipy.jensenshannon(p.numpy(), q.numpy(), base=2)), rel=1e-12)
    assert js_distance(p, q, base=math.e) == pytest.approx(float(scipy.jensenshannon(p.numpy(), q.numpy())), rel=1e-12)
    _, D = _lm()
    S = blockwise_slq(D, n_probes=2, n_iter=4, seed=1)
    a, b = S["W_E"], S["blocks.0.W_Q"]
    assert js_distance(a, a) == pytest.approx(0, abs=1e-7) and 0 < js_distance(a, b) <= 1
    assert js_distance(a, b) == pytest.approx(js_distance(b, a), rel=1e-12)


def test_js_distance_of_densities_at_scales_1e4_apart():
    """Two densities of one spectrum scaled by 1e-4 and 1: the narrow one, at its own width, would vanish on the
    pair's grid; the default takes the wider width for both (equal to giving it), and the distance is that of
    a point mass at 0 beside the wide density (in (0, 1)). A width far below the grid's spacing is refused."""
    gen = torch.Generator().manual_seed(3)
    M = torch.randn(60, 60, dtype=DT, generator=gen)
    M = (M + M.T) / 2
    wide, narrow = slq_density(M, n_probes=3, n_iter=12, seed=1), slq_density(1e-4 * M, n_probes=3, n_iter=12, seed=1)
    assert narrow.sigma < 1e-3 * wide.sigma
    d = js_distance(narrow, wide)
    assert 0 < d < 1 and d == js_distance(wide, narrow)
    assert d == js_distance(narrow, wide, sigma=wide.sigma)
    assert js_distance(wide, wide) == 0.0  # one density twice: 2a / (a + a) = 1 exactly
    with pytest.raises(ValueError, match="density vanishes on every point of the grid at sigma = .*smallest spacing"):
        js_distance(narrow, wide, sigma=narrow.sigma)
    with pytest.raises(ValueError, match="density vanishes on every point of the grid at sigma = [^(]*: give"):
        js_distance(narrow, wide, grid=torch.tensor([5.0], dtype=DT), sigma=1e-3)  # one point: no spacing to name


def test_js_distance_of_weights_at_the_least_subnormal():
    """``m = (p + q)/2`` rounds to 0 at the least subnormal: the distance stays finite, in [0, 1]."""
    tiny = torch.tensor([1.0, 5e-324], dtype=DT)
    d = js_distance(tiny, torch.tensor([1.0, 0.0], dtype=DT))
    assert math.isfinite(d) and 0 <= d <= 1


def test_lockstep_estimators_keep_the_products_memory_free(monkeypatch):
    """Every estimator's own memory checks run keeping free what the products needed at most so far (by the
    products' own checks: ``R.product_bytes``), so that a basis that grows cannot take the products' work
    space; the results are those of the run without any check."""
    from blockhess import validation
    from blockhess.operators import estimators

    A, D = _lm()
    plain = blockwise_eigs(D, k=2, tol=1e-9)
    monkeypatch.setattr(validation, "SMALL_BYTES", 0)  # every request checked and recorded
    seen = []
    real = estimators.check_fits

    def spy(nbytes, what, device="cpu"):
        room = getattr(validation._scope, "headroom", None)
        seen.append(None if room is None else room.bytes)
        return real(nbytes, what, device)

    monkeypatch.setattr(estimators, "check_fits", spy)
    R = blockwise_eigs(D, k=2, tol=1e-9)
    assert plain.product_bytes == 0 < R.product_bytes  # below SMALL_BYTES nothing is recorded
    assert len(seen) == len(D.blocks) and None not in seen  # each block's basis, in its thread, with the headroom
    for b in D.blocks:
        assert_close(R[b].eigenvalues, plain[b].eigenvalues, tol=0.0, what=b)
