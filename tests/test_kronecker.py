"""Per-token Kronecker factors (kronecker.py) and the dense accumulator (result.py) against
dense Jacobians: every side combination, with and without Ω and an extra core, written
straight into a buffer (one chunk or one core row at a time), accumulated, and mirrored; many
rows through several factors at once (shared per-token matrices, heads, zero), in chunks, into
views of a buffer."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from blockhess.result import BlockSum
from blockhess import kronecker
from blockhess.kronecker import (SplitKron, TokenKron, ZeroKron, choose_method, sandwich, sandwich_into, token_rows,
                                 vjp_rows, workspace_need)

from conftest import assert_close, fro

T, R = 5, 3  # tokens, rows per token
SHAPES = {"left": (4, 6), "right": (7, 2), "vector": (5,)}


def factor(side: str, gen: torch.Generator) -> TokenKron:
    shape = SHAPES[side]
    x = shape[-1] if side != "right" else shape[0]
    vec = None if side == "vector" else torch.randn(T, shape[0] if side == "left" else shape[1], generator=gen, dtype=torch.float64)
    return TokenKron(side, vec, torch.randn(T, R, x, generator=gen, dtype=torch.float64))


def core_dims(F: TokenKron) -> int:
    return F.mat.shape[-1]


def dense_sandwich(F1, F2, omega, core):
    """``Σ_t J_1tᵀ Ω_t J_2t`` from dense per-token Jacobians (``core`` spread like Ω's term)."""
    J1, J2 = F1.dense(), F2.dense()
    out = 0 if omega is False else torch.einsum("tri,trs,tsj->ij", J1, torch.eye(R, dtype=J1.dtype).expand(T, R, R) if omega is None else omega, J2)
    if core is not None:  # the core's term has J = w ⊗ (core row/col unit vectors)
        E1 = TokenKron(F1.side, F1.vec, torch.eye(core_dims(F1), dtype=J1.dtype).expand(T, -1, -1)).dense()
        E2 = TokenKron(F2.side, F2.vec, torch.eye(core_dims(F2), dtype=J1.dtype).expand(T, -1, -1)).dense()
        out = out + torch.einsum("txi,txy,tyj->ij", E1, core, E2)
    return out


PAIRS = list(itertools.product(SHAPES, SHAPES))
MODES = ["identity", "omega", "omega+core", "core"]


@pytest.mark.parametrize("s1,s2", PAIRS)
@pytest.mark.parametrize("mode", MODES)
def test_sandwich_and_into(s1, s2, mode):
    gen = torch.Generator().manual_seed(10 * PAIRS.index((s1, s2)) + MODES.index(mode))
    F1, F2 = factor(s1, gen), factor(s2, gen)
    omega = {"identity": None, "core": False}.get(mode, torch.randn(T, R, R, generator=gen, dtype=torch.float64))
    core = torch.randn(T, core_dims(F1), core_dims(F2), generator=gen, dtype=torch.float64) if "core" in mode else None
    ref = dense_sandwich(F1, F2, omega, core)
    assert_close(sandwich(F1, F2, omega, core).reshape(ref.shape), ref, what="sandwich")
    n1, n2 = ref.shape
    for method in ("rows", "khatri_rao"):
        need = workspace_need(F1, F2, method)  # one core row per GEMM / one entry of F1's vector per GEMM
        for room in (None, need, 3 * need):  # default chunk, one at a time, chunks of 3 (partial last: 7, 5 rows; 4 entries)
            buf = torch.full((n1 + 3, n2 + 5), float("nan"), dtype=torch.float64)
            out = buf[1 : 1 + n1, 2 : 2 + n2]  # a strided view, as a block of the Hessian is
            ws = None if room is None else torch.empty(room, dtype=torch.float64)
            sandwich_into(out, F1, F2, omega, core, workspace=ws, method=method)
            assert_close(out, ref, what=f"sandwich_into {method} (room {room})")
            sandwich_into(out, F1, F2, omega, core, accumulate=True, workspace=ws, method=method)
            assert_close(out, 2 * ref, what=f"sandwich_into {method} accumulate (room {room})")
            assert torch.isnan(buf[0]).all() and torch.isnan(buf[:, 0]).all() and torch.isnan(buf[-1]).all(), "wrote outside the block"


@pytest.mark.parametrize("s1,s2", PAIRS)
@pytest.mark.parametrize("method", ["rows", "khatri_rao"])
def test_sandwich_into_a_heads_rows(s1, s2, method):
    """``out`` shaped ``F1.shape + F2.shape`` with the rows of one head inside a wider weight
    (strided rows, as ``W_Q#h``'s rows of a ``(W_Q, W_1)`` block), accumulated."""
    gen = torch.Generator().manual_seed(40 + PAIRS.index((s1, s2)))
    F1, F2 = factor(s1, gen), factor(s2, gen)
    omega = torch.randn(T, R, R, generator=gen, dtype=torch.float64)
    ref = dense_sandwich(F1, F2, omega, None).reshape(*F1.shape, *F2.shape)
    wide = torch.full((*F1.shape[:-1], 3, F1.shape[-1], *F2.shape), float("nan"), dtype=torch.float64)
    out = wide.select(len(F1.shape) - 1, 1)  # head 1 of 3
    out.zero_()
    sandwich_into(out, F1, F2, omega, accumulate=True, workspace=torch.empty(workspace_need(F1, F2, method), dtype=torch.float64), method=method)
    assert_close(out, ref, what="head rows")
    assert torch.isnan(wide.select(len(F1.shape) - 1, 0)).all() and torch.isnan(wide.select(len(F1.shape) - 1, 2)).all()


@pytest.mark.parametrize("s1,s2", PAIRS)
def test_sandwich_into_a_head_by_head_sub_block(s1, s2):
    """Columns of two strides (head × head, as ``(W_Q#h, W_K#g)``): written by the Khatri–Rao
    way, which the default picks there, and refused by ``"rows"``."""
    gen = torch.Generator().manual_seed(60 + PAIRS.index((s1, s2)))
    F1, F2 = factor(s1, gen), factor(s2, gen)
    omega = torch.randn(T, R, R, generator=gen, dtype=torch.float64)
    ref = dense_sandwich(F1, F2, omega, None).reshape(*F1.shape, *F2.shape)
    k1, k2 = len(F1.shape), len(F2.shape)
    wide = torch.full((*F1.shape[:-1], 2, F1.shape[-1], *F2.shape[:-1], 3, F2.shape[-1]), float("nan"), dtype=torch.float64)
    out = wide.select(k1 - 1, 1).select(k1 + k2 - 1, 2)
    sandwich_into(out, F1, F2, omega)
    assert_close(out, ref, what="head x head sub-block")
    assert torch.isnan(wide.select(k1 - 1, 0)).all() and torch.isnan(wide.select(k1 + k2, 0)).all()
    if k2 == 2:  # a vector's column group is one run either way
        with pytest.raises(ValueError, match="method='rows' the columns of out"):
            sandwich_into(out, F1, F2, omega, method="rows")


def test_choose_method():
    """Many tokens per row of the block (a batch): Khatri–Rao; few (one sequence): rows
    written in place."""
    gen = torch.Generator().manual_seed(7)

    def factor_(side, T, p, q):
        vec = None if side == "vector" else torch.randn(T, p, generator=gen, dtype=torch.float64)
        return TokenKron(side, vec, torch.randn(T, 2, q, generator=gen, dtype=torch.float64))

    assert choose_method(factor_("left", 32, 64, 16), factor_("left", 32, 64, 16)) == "rows"  # T = rows / 2
    assert choose_method(factor_("left", 255, 64, 16), factor_("left", 255, 64, 16)) == "rows"
    assert choose_method(factor_("left", 256, 64, 16), factor_("right", 256, 64, 16)) == "khatri_rao"  # T = 4 rows
    assert choose_method(factor_("right", 32, 8, 64), factor_("left", 32, 64, 16)) == "khatri_rao"  # rows: v's length
    assert choose_method(factor_("vector", 4, 0, 8), factor_("left", 4, 64, 16)) == "khatri_rao"  # one row


def test_sandwich_into_follows_choose_method():
    """The default way is :func:`choose_method`'s: given a workspace that holds only that way's
    need (less than the other's), the call succeeds and is exact."""
    gen = torch.Generator().manual_seed(8)
    for T, p in ((16, 2), (3, 4)):  # T >= 4 rows: Khatri–Rao; T < 4 rows: rows
        F1 = TokenKron("left", torch.randn(T, p, generator=gen, dtype=torch.float64), torch.randn(T, R, 9, generator=gen, dtype=torch.float64))
        F2 = TokenKron("right", torch.randn(T, 2, generator=gen, dtype=torch.float64), torch.randn(T, R, 30, generator=gen, dtype=torch.float64))
        chosen = choose_method(F1, F2)
        other = "rows" if chosen == "khatri_rao" else "khatri_rao"
        need = workspace_need(F1, F2, chosen)
        assert need < workspace_need(F1, F2, other), "the case must tell the two ways apart"
        omega = torch.randn(T, R, R, generator=gen, dtype=torch.float64)
        out = torch.empty(F1.numel, F2.numel, dtype=torch.float64)
        sandwich_into(out, F1, F2, omega, workspace=torch.empty(need, dtype=torch.float64))
        assert_close(out, dense_sandwich(F1, F2, omega, None), what=f"default way ({chosen})")
        with pytest.raises(ValueError, match=f"workspace_need for '{other}'"):
            sandwich_into(out, F1, F2, omega, workspace=torch.empty(need, dtype=torch.float64), method=other)


def test_blocksum_dense_matches_blocks():
    """Out-of-order pairs (factors, Ω and core transposed), several contributions per pair,
    the tiled mirror: the dense buffer equals the dict accumulator's blocks and the sum of
    dense sandwiches; off-diagonal blocks are exact transposes. Ω is not symmetric, so a
    missing transpose on the swapped path shows."""
    gen = torch.Generator().manual_seed(3)
    F = {"a": factor("left", gen), "b": factor("vector", gen), "c": factor("right", gen)}
    names = tuple(F)
    shapes = {k: v.shape for k, v in F.items()}
    size = {k: math.prod(v) for k, v in shapes.items()}
    terms = []  # (x, y, omega, core)
    for x, y in [("a", "a"), ("c", "a"), ("a", "b"), ("b", "b"), ("c", "b"), ("c", "c"), ("a", "c")]:
        omega = torch.randn(T, R, R, generator=gen, dtype=torch.float64)
        core = torch.randn(T, core_dims(F[x]), core_dims(F[y]), generator=gen, dtype=torch.float64) if (x, y) in (("c", "a"), ("c", "b")) else None
        terms.append((x, y, omega, core))
    dense = BlockSum(names, shapes, dense=True, dtype=torch.float64, device="cpu")
    dense.MIRROR_TILE = 5  # tiles that do not divide the block sizes
    blocks = BlockSum(names, shapes)
    for acc in (dense, blocks):
        for x, y, omega, core in terms:
            acc.add_sandwich(x, y, F[x], F[y], omega, core)
    H = dense.result(F["a"].mat).dense()
    ref = blocks.result(F["a"].mat)
    expect = {}
    for x, y, omega, core in terms:  # each term lands in the upper block, transposed if out of order
        val = dense_sandwich(F[x], F[y], omega, core)
        if names.index(x) > names.index(y):
            x, y, val = y, x, val.T
        expect[(x, y)] = expect.get((x, y), 0) + val
    whole = fro(H)
    for x, y in itertools.product(names, names):
        blk = H[dense.slices[x], dense.slices[y]]
        assert_close(blk, ref[x, y], what=f"dense vs blocks {x},{y}")
        want = expect.get((x, y)) if names.index(x) <= names.index(y) else expect.get((y, x))
        want = torch.zeros(size[x], size[y], dtype=torch.float64) if want is None else want
        # scale: a pair no term reaches is zero, to the whole's rounding
        assert_close(blk, want if names.index(x) <= names.index(y) else want.T, scale=whole, what=f"dense vs sum of sandwiches {x},{y}")
    for x, y in itertools.combinations(names, 2):  # mirrored: exact transposes
        assert torch.equal(H[dense.slices[y], dense.slices[x]], H[dense.slices[x], dense.slices[y]].T)


def test_sandwich_into_refuses_bad_arguments():
    gen = torch.Generator().manual_seed(5)
    F1, F2 = factor("left", gen), factor("right", gen)
    n1, n2 = F1.numel, F2.numel
    with pytest.raises(ValueError, match=r"out must be \(24, 14\) or \(4, 6, 7, 2\), got shape \(24, 15\)"):
        sandwich_into(torch.zeros(n1, n2 + 1, dtype=torch.float64), F1, F2)
    with pytest.raises(ValueError, match="method='rows' the columns of out"):
        sandwich_into(torch.zeros(n2, n1, dtype=torch.float64).T, F1, F2, method="rows")
    with pytest.raises(ValueError, match="out is torch.float32"):
        sandwich_into(torch.zeros(n1, n2), F1, F2)
    for method, need in (("rows", T * n2), ("khatri_rao", 2 * (T + 6 * 7))):
        with pytest.raises(ValueError, match=f"workspace must hold at least {need} entries of torch.float64 \\(workspace_need for '{method}'\\)"):
            sandwich_into(torch.zeros(n1, n2, dtype=torch.float64), F1, F2, workspace=torch.empty(need - 1, dtype=torch.float64), method=method)
    with pytest.raises(ValueError, match="method must be 'rows', 'khatri_rao' or None"):
        sandwich_into(torch.zeros(n1, n2, dtype=torch.float64), F1, F2, method="dense")
    with pytest.raises(ValueError, match="TokenKron factors"):
        sandwich_into(torch.zeros(n1, n2, dtype=torch.float64), F1, "F2")


@pytest.mark.parametrize("tiled", [True, False])  # the CPU's way, and the GPU's (one copy), both run here
def test_mirror_either_way(tiled):
    acc = BlockSum(("a", "b"), {"a": (70,), "b": (45,)}, dense=True, dtype=torch.float64, device="cpu")
    upper = torch.randn(70, 45, dtype=torch.float64)
    lower = torch.empty(45, 70, dtype=torch.float64)
    acc._mirror(upper, lower, tiled=tiled)
    assert torch.equal(lower, upper.T)


@pytest.mark.parametrize("summed", [True, False], ids=["summed", "per sequence"])
@pytest.mark.parametrize("chunk", [1, 7, 1 << 16], ids=["a row per chunk", "some rows per chunk", "one chunk"])
def test_vjp_rows_against_dense(summed, chunk, monkeypatch):
    """kronecker.vjp_rows against the dense Jacobians' products: every side, a weight and its
    bias sharing their per-token matrix, a two-head weight, a zero factor; fresh, written into
    views of a buffer, and added to them; in chunks of any size."""
    monkeypatch.setattr(kronecker, "ROWS_CHUNK_ENTRIES", chunk)
    gen = torch.Generator().manual_seed(5)
    Bq, L, K = 2, 3, 4  # sequences, tokens each, rows per sequence
    T = Bq * L
    rn = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    W = TokenKron("left", rn(T, 4), rn(T, R, 6))
    factors = [W, TokenKron("vector", None, W.mat), TokenKron("right", rn(T, 2), rn(T, R, 7)),
               SplitKron((TokenKron("left", rn(T, 3), rn(T, R, 2)), TokenKron("left", rn(T, 3), rn(T, R, 2))), (3, 4)),
               ZeroKron((5,), T, R, W.mat)]
    w = rn(Bq, K, L, R)
    want = []
    for F in factors:
        J = F.dense().reshape(Bq, L * R, -1)  # per sequence (L·R, numel)
        v = torch.einsum("bkm,bmn->bkn", w.reshape(Bq, K, L * R), J)
        want.append(v.sum(0) if summed else v)
    got = vjp_rows(factors, token_rows(w), Bq, summed)
    for g, v in zip(got, want):
        assert_close(g, v, what="fresh")
    lead = (K,) if summed else (Bq, K)
    offs = [0]
    for F in factors:
        offs.append(offs[-1] + F.numel + 1)
    buf = rn(*lead, offs[-1])  # the factors' values side by side in a larger buffer, as in the dense Hessian
    views = [buf[..., o:o + F.numel] for o, F in zip(offs, factors)]
    before = [v.clone() for v in views]
    vjp_rows(factors, token_rows(w), Bq, summed, [(v, True) for v in views])
    for v, b, x in zip(views, before, want):
        assert_close(v, b + x, what="added")
    vjp_rows(factors, token_rows(w), Bq, summed, [(v, False) for v in views])
    for v, x in zip(views, want):
        assert_close(v, x, what="written")
