"""Whole models (:class:`blockhess.ModelConfig`): the closed-form Hessian of the loss w.r.t. every
parameter against ``torch.func`` in float64, each of its blocks (cross-layer ones included) and its
outer and functional parts by the suite's rule, its identities, the forward pass, subsets of the
parameters, float32, and one sequence without the batch axis.

The grid is :data:`settings.MODEL_CASES`: a pairwise covering of every option of a model
(embedding, cls token, positions, token types, the two LayerNorms with and without ``gamma`` /
``beta`` and their eps, pooling, head: none, linear or the tied embedding, its bias, the loss, the
number of blocks 1–4, ``d_model``, tokens per sequence with ``L = 1``, ``B`` = 1 and 3), whose
blocks take the rows of :data:`settings.OPTION_DESIGN` in turn, and :data:`settings.NAMED_MODELS`.
"""

import itertools

import pytest
import torch

import blockhess as bh

from conftest import (assert_blocks_close, assert_close, assert_float32_hessian, assert_identities, blocks_of, fro,
                      make_model_case)
from settings import (MODEL_CASES, MODEL_DESIGN, MODEL_IDS, MODEL_OPTIONS, NAMED_MODELS, OPTION_DESIGN, covered,
                      model_row, model_valid)

CONVEX = ("ce", "mse")  # the built-in losses are convex in the output: a PSD outer term


def check_against_reference(cfg, p, x, loss, target, wrt=None):
    """The closed form (full, outer, functional; every block to its own norm) against
    :func:`blockhess.reference.hessian` on the same inputs, and its identities. Returns both."""
    H = bh.hessian(p, x, cfg, loss=loss, target=target, wrt=wrt)
    R = bh.reference.hessian(p, x, cfg, loss=loss, target=target, wrt=wrt)
    assert H.names == R.names
    s = fro(R.dense())
    assert_close(H.dense(), R.dense(), what="full")
    # a part in units of the whole: the reference's functional term is full - outer (its rounding is the whole's)
    assert_close(H.outer.dense(), R.outer.dense(), scale=s, what="outer")
    assert_close(H.functional.dense(), R.functional.dense(), scale=s, what="functional")
    assert_blocks_close(blocks_of(H, R), what="full")  # each block, cross-layer ones included, to its own norm
    assert_identities(H, convex=isinstance(loss, str) and loss in CONVEX, reference=R, what="closed form")
    return H, R


@pytest.mark.parametrize("case", MODEL_CASES, ids=MODEL_IDS)
def test_against_autograd(case):
    cfg, p, x, loss, T = make_model_case(*case)
    H, _ = check_against_reference(cfg, p, x, loss, T)
    assert H.names == tuple(p) and H.dense().shape == (sum(v.numel() for v in p.values()),) * 2
    if cfg.n_layers > 1:  # the walk couples the layers: the first and last blocks' cross-layer blocks are not all zero
        first, last = (tuple(n for n in H.names if n.startswith(f"blocks.{i}.")) for i in (0, cfg.n_layers - 1))
        assert any(fro(H[a, b]) > 0 for a in first for b in last)


@pytest.mark.parametrize("name", list(NAMED_MODELS))
def test_named_models_against_autograd(name):
    check_against_reference(*make_model_case(*NAMED_MODELS[name]))


def test_design_covers_every_pair():
    """Every two option values that make a model together appear in a model of the grid; its
    blocks take every row of OPTION_DESIGN; the cases the brief names are there."""
    need = set()
    for ks in itertools.combinations(MODEL_OPTIONS, 2):
        for vs in itertools.product(*(MODEL_OPTIONS[k] for k in ks)):
            if model_valid(dict(zip(ks, vs))):
                need.add(tuple((k, repr(v)) for k, v in zip(ks, vs)))
    assert need <= set().union(*(covered(r, 2, MODEL_OPTIONS) for r in MODEL_DESIGN))
    assert all(model_valid(r) for r in MODEL_DESIGN)
    used = [b for _, blocks in MODEL_CASES for b in blocks]
    assert all(row in used for row in OPTION_DESIGN)
    has = lambda **kw: any(all(r[k] == v for k, v in kw.items()) for r in MODEL_DESIGN)  # noqa: E731
    for pool in ("mean", "first"):
        assert has(loss="ce", pool=pool)  # pooled CE
    assert has(loss="ce", pool="none", head="none") and has(loss="ce", pool="none", head="tied")  # per token
    assert has(tokens=1, cls_token=False, batch=1)  # L = 1, B = 1
    for affine, bias in itertools.product((True, False), repeat=2):
        assert has(final_norm=True, norm_affine=affine, norm_bias=bias)


@pytest.mark.parametrize("case", MODEL_CASES + list(NAMED_MODELS.values()),
                         ids=MODEL_IDS + [f"named-{n}" for n in NAMED_MODELS])
def test_forward_matches_reference(case):
    cfg, p, x, _, _ = make_model_case(*case)
    z = bh.forward(p, x, cfg)
    r = bh.reference.forward(p, x, cfg)  # (B, P, n_out): P = 1 pooled
    B, L = x.shape[0], r.shape[1]
    assert z.shape == ((B, cfg.n_out) if cfg.pool != "none" else (B, L, cfg.n_out)) and z.dtype == torch.float64
    assert_close(z, r[:, 0] if cfg.pool != "none" else r, what="forward")
    assert_close(bh.forward(p, x[0], cfg), z[0], what="one sequence")  # no batch axis in, none out


# ----------------------------------------------------------------------------- subsets of the parameters
# (model, wrt): the models these selections need (three blocks with biases; the tied head; a cls
# token and learned positions)
_THREE = model_row(embedding="linear", final_norm=True, pool="mean", head="linear", loss="ce", n_blocks=3,
                   tokens=3, batch=3)
_TIED = model_row(embedding="token", positions="learned", final_norm=True, head="tied", loss="ce", n_blocks=2,
                  tokens=3, batch=3)
_CLS = model_row(embedding="patch", cls_token=True, positions="learned", pool="first", head="linear", loss="mse",
                 n_blocks=2, tokens=2, batch=3)
WRT_CASES = {
    "one block's weight with another's": (_THREE, ["blocks.2.W_1", "blocks.0.W_Q"]),
    "cross-layer pairs": (_THREE, ["W_E", "blocks.1.W_V", "blocks.1.b_2", "gamma_F", "W_H"]),
    "W_E alone, tied": (_TIED, "W_E"),
    "W_E with a block, tied": (_TIED, ["blocks.1.W_2", "W_E"]),
    "the head alone": (_THREE, ["b_H", "W_H"]),
    "cls, positions and the first block": (_CLS, ["blocks.0.W_K", "W_P", "cls"]),
}


@pytest.mark.parametrize("name", list(WRT_CASES))
def test_wrt_subset(name):
    row, wrt = WRT_CASES[name]
    cfg, p, x, loss, T = make_model_case(row, [OPTION_DESIGN[1]] * row["n_blocks"])  # every block option on
    H, _ = check_against_reference(cfg, p, x, loss, T, wrt=wrt)
    wanted = [wrt] if isinstance(wrt, str) else wrt
    assert list(H.names) == [n for n in p if n in wanted]  # canonical order, whatever the order given
    full = bh.hessian(p, x, cfg, loss=loss, target=T)
    assert_blocks_close(blocks_of(H, full), what="subset of the full Hessian")
    assert_blocks_close(blocks_of(H.outer, full.outer), what="subset of the outer part")


@pytest.mark.parametrize("name", ["gpt", "vit"])
def test_one_part_alone(name):
    """``blockhess.model.walk.hessian(part=...)``: the outer or functional part by its own passes, without the
    full Hessian's, equal to the full result's ``.outer`` / ``.functional``; a result without parts."""
    from blockhess.model import walk

    cfg, p, x, loss, T = make_model_case(*NAMED_MODELS[name])
    H = bh.hessian(p, x, cfg, loss=loss, target=T)
    for part in ("outer", "functional"):
        P = walk.hessian(p, x, cfg, loss, T, part=part)
        assert not P.has_parts and P.names == H.names
        assert_close(P.dense(), getattr(H, part).dense(), tol=1e-14, scale=fro(H.dense()), what=part)
    with pytest.raises(ValueError, match="part must be one of"):
        walk.hessian(p, x, cfg, loss, T, part="ggn")


# ----------------------------------------------------------------------------- float32, one sequence, batches

@pytest.mark.parametrize("row", [
    model_row(embedding="linear", embed_norm=True, final_norm=True, pool="mean", head="linear", loss="ce", n_blocks=2,
              tokens=3, batch=3),
    model_row(embedding="patch", cls_token=True, positions="sinusoidal", loss="mse", n_blocks=2, tokens=2, batch=3),
], ids=["linear-pooled-ce", "patch-per-token-mse"])
def test_float32_against_float32_autograd(row):
    cfg, p, x, loss, T = make_model_case(row, OPTION_DESIGN[:2])
    assert_float32_hessian(p, x, cfg, loss=loss, target=T)


# one sequence of each kind of input, each loss: token ids (L,) with a pooled CE class (0-dim), features
# (L, d_in) with a per-token MSE target (L, n_out), an image (C, H, W) with a pooled MSE target (n_out,)
SINGLE = {
    "token-pooled-ce": model_row(embedding="token", cls_token=True, positions="learned", pool="first", head="linear",
                                 loss="ce", n_blocks=2, tokens=3),
    "linear-per-token-mse": model_row(embedding="linear", final_norm=True, head="linear", loss="mse", n_blocks=2, tokens=3),
    "patch-pooled-mse": model_row(embedding="patch", pool="mean", loss="mse", n_blocks=1, tokens=3),
    "none-per-token-ce": model_row(embedding="none", loss="ce", n_blocks=2, tokens=2),
}


@pytest.mark.parametrize("name", list(SINGLE))
def test_one_sequence_without_batch_axis(name):
    cfg, p, x, loss, T = make_model_case(SINGLE[name], OPTION_DESIGN[2:2 + SINGLE[name]["n_blocks"]])
    H, _ = check_against_reference(cfg, p, x[0], loss, T[0])
    batched = bh.hessian(p, x, cfg, loss=loss, target=T)  # the same sequence as a batch of one
    for part in (lambda h: h, lambda h: h.outer, lambda h: h.functional):
        assert_close(part(H).dense(), part(batched).dense(), scale=fro(batched.dense()), what="one sequence vs batch of one")


def test_one_sequence_callable_target():
    """One sequence's target gets the batch axis for a callable loss too (its entry of a batch of one)."""
    row = model_row(embedding="linear", pool="mean", head="linear", loss="custom", n_blocks=1, tokens=3)
    cfg, p, x, loss, T = make_model_case(row, OPTION_DESIGN[:1])
    check_against_reference(cfg, p, x[0], loss, T[0])


def test_batch_is_mean_of_sequences():
    row = model_row(embedding="token", positions="learned", final_norm=True, pool="mean", head="linear", loss="ce",
                    n_blocks=2, tokens=3, batch=3)
    cfg, p, x, loss, T = make_model_case(row, OPTION_DESIGN[3:5])
    H = bh.hessian(p, x, cfg, loss=loss, target=T).dense()
    per = sum(bh.hessian(p, x[b:b + 1], cfg, loss=loss, target=T[b:b + 1]).dense() for b in range(3)) / 3
    assert_close(H, per, what="batch mean")


# how the walk's passes and the blocks' weight pairs' take the batch's 3 sequences (model.walk._chunks)
PASS_LAYOUTS = {
    "one pass, pairs in it": ([slice(0, 3)], []),
    "a pass per sequence, pairs in them": ([slice(0, 1), slice(1, 2), slice(2, 3)], []),
    "a pass per sequence, pairs in one pass": ([slice(0, 1), slice(1, 2), slice(2, 3)], [slice(0, 3)]),
    "two passes, pairs in two others": ([slice(0, 2), slice(2, 3)], [slice(0, 1), slice(1, 3)]),
}


@pytest.mark.parametrize("layout", list(PASS_LAYOUTS))
@pytest.mark.parametrize("name", ["vit", "gpt", "encoder"])
def test_any_split_into_passes(name, layout, monkeypatch):
    """Every split of the batch into the walk's passes, and of the blocks' weight pairs into passes
    of their own or into the walk's, gives the reference's Hessian and parts (also for a subset)."""
    from blockhess.model import walk

    monkeypatch.setattr(walk, "_chunks", lambda *args: PASS_LAYOUTS[layout])
    cfg, p, x, loss, T = make_model_case(*NAMED_MODELS[name])
    assert x.shape[0] == 3
    check_against_reference(cfg, p, x, loss, T)
    blocks = [n for n in p if n.startswith("blocks.")]
    check_against_reference(cfg, p, x, loss, T, wrt=[blocks[0], blocks[-1], list(p)[-1]])


# the bottom variables (W_E, b_E, gamma_E, beta_E of a linear embedding with its LayerNorm: 6 d entries)
# against a level's L d entries: tangents carried up where fewer (L = 7), rows taken down where not (L = 3)
BOTTOM_WAYS = {"tangents carried up": 7, "rows taken down": 3}


@pytest.mark.parametrize("way", list(BOTTOM_WAYS))
def test_bottom_variables_either_way(way, monkeypatch):
    """The embedding's variables' blocks with every later one, both ways of the walk (model.walk
    _bottom_tangents: tangents up where the bottom variables are fewer than a level's entries, else
    the later variables' rows down), against the reference, full and parts, alone and with a block."""
    from blockhess.model import walk

    used = []
    bottom = walk._bottom_tangents
    monkeypatch.setattr(walk, "_bottom_tangents", lambda *a: used.append(bottom(*a)) or used[-1])
    row = model_row(embedding="linear", embed_norm=True, final_norm=True, head="linear", loss="ce", n_blocks=2,
                    tokens=BOTTOM_WAYS[way], batch=2)
    cfg, p, x, loss, T = make_model_case(row, [OPTION_DESIGN[1]] * 2)
    check_against_reference(cfg, p, x, loss, T)
    check_against_reference(cfg, p, x, loss, T, wrt=["W_E", "gamma_E", "blocks.1.W_1"])
    assert used and all(bool(u[2]) == (way == "tangents carried up") for u in used)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8], ids=str)
def test_token_ids_of_any_integer_dtype(dtype):
    """Token ids in any integer dtype are the int64 ids (indexing takes no other; uint8 would be a mask)."""
    row = model_row(embedding="token", pool="mean", head="linear", loss="ce", n_blocks=1, tokens=3, batch=3)
    cfg, p, x, loss, T = make_model_case(row, OPTION_DESIGN[:1])
    H = bh.hessian(p, x.to(dtype), cfg, loss=loss, target=T)
    assert torch.equal(H.dense(), bh.hessian(p, x, cfg, loss=loss, target=T).dense())
    assert torch.equal(bh.forward(p, x.to(dtype), cfg), bh.forward(p, x, cfg))


def test_ce_classes_as_a_list_and_one_sequence_as_a_number():
    row = model_row(embedding="token", pool="mean", head="linear", loss="ce", n_blocks=1, tokens=3, batch=3)
    cfg, p, x, loss, T = make_model_case(row, OPTION_DESIGN[:1])
    H = bh.hessian(p, x, cfg, loss=loss, target=T).dense()
    assert torch.equal(bh.hessian(p, x, cfg, loss=loss, target=T.tolist()).dense(), H)
    one = bh.hessian(p, x[0], cfg, loss=loss, target=int(T[0])).dense()
    assert torch.equal(one, bh.hessian(p, x[:1], cfg, loss=loss, target=T[:1]).dense())
