"""Property-based tests of whole models: random :class:`~blockhess.ModelConfig` options (every one of
:data:`settings.MODEL_OPTIONS`: embedding, cls token, positions, token types, both LayerNorms and
their ``gamma``, ``beta`` and eps, pooling, head none / linear / tied, its bias, the loss), 1–3
blocks each with its own options (every one of :data:`settings.BLOCK_OPTIONS`), tokens ``L >= 1``,
batches of 1–3 sequences, an input scale, the seed of the weights, the parameters asked for
(all, or a random subset), and a padded batch (a key padding mask, position ids, token types, CE targets
of -100) where the model takes one. The closed form is checked against :func:`blockhess.reference.hessian`
in float64 by the suite's rules (conftest.py): the full Hessian to ``1e-10`` of its norm, each of
its blocks to its own, the outer and functional parts in units of the whole, each allowed
autograd's own measured error (:func:`conftest.autograd_defect`); and the identities (symmetry,
``outer + functional = full``, a PSD outer term for CE and MSE). Profiles: conftest.py.
"""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

import blockhess as bh

from conftest import (assert_close, assert_identities, assert_part_close, autograd_defect, fro, make_model_case)
from settings import BLOCK_OPTIONS, MODEL_OPTIONS, model_valid

# the sizes the draws take beyond MODEL_OPTIONS' (kept small: 100 examples in the fast profile)
DRAWN_SIZES = {"n_blocks": [1, 2, 3], "d_model": [4, 4, 6], "tokens": [1, 2, 3], "batch": [1, 2]}
LN_EPS = [0.0, 1e-12, 1e-5, 1e-2]  # a block's ln_eps (BLOCK_OPTIONS has two)


@st.composite
def model_cases(draw):
    options = {k: st.sampled_from(DRAWN_SIZES.get(k, v)) for k, v in MODEL_OPTIONS.items()}
    row = draw(st.fixed_dictionaries(options).filter(model_valid))
    block = st.fixed_dictionaries({**{k: st.sampled_from(v) for k, v in BLOCK_OPTIONS.items()},
                                   "ln_eps": st.sampled_from(LN_EPS)})
    blocks = draw(st.lists(block, min_size=row["n_blocks"], max_size=row["n_blocks"]))
    seed = draw(st.integers(0, 2**16))
    scale = 10.0 ** draw(st.floats(-0.5, 0.5))
    names = list(make_model_case(row, blocks)[1])
    wrt = draw(st.one_of(st.none(), st.lists(st.sampled_from(names), min_size=1, max_size=4, unique=True)))
    # a padded batch (where the model takes a mask: ids or features, no cls token): its mask's seed, or None
    takes = row["embedding"] in ("token", "linear", "none") and not row["cls_token"]
    padded = draw(st.one_of(st.none(), st.integers(0, 2**16))) if takes else None
    return dict(row=row, blocks=blocks, seed=seed, scale=scale, wrt=wrt, padded=padded)


def pad(cfg: bh.ModelConfig, x, loss, T, seed: int):
    """The batch ``x`` as the forward's keyword arguments with a random key padding mask (each sequence
    keeps at least one key; its first where the loss counts every output, so that no counted row attends
    to nothing), random position ids and token types where the model has them, and a CE target per token
    with -100 at the padding and at random tokens (one counted at least)."""
    g = torch.Generator().manual_seed(seed)
    B, n = x.shape[:2]
    mask = torch.rand(B, n, generator=g) < 0.6
    per_token_ce = loss == "ce" and cfg.pool == "none"
    mask[torch.arange(B), 0 if not per_token_ce else torch.randint(0, n, (B,), generator=g)] = True
    token = cfg.embedding == "token"
    inputs = {"input_ids": x, "attention_mask": mask.long()} if token else {"src": x, "src_key_padding_mask": ~mask}
    if token and cfg.positions == "learned":
        inputs["position_ids"] = torch.randint(0, cfg.n_positions, (B, n), generator=g)
    if token and cfg.token_types:
        inputs["token_type_ids"] = torch.randint(0, cfg.token_types, (B, n), generator=g)
    if per_token_ce:
        keep = mask & (torch.rand(B, n, generator=g) < 0.8)
        keep.view(-1)[int(mask.reshape(-1).nonzero()[0])] = True
        T = T.masked_fill(~keep, -100)
    return inputs, T


@given(model_cases())
def test_closed_form_against_autograd(case):
    cfg, p, x, loss, T = make_model_case(case["row"], case["blocks"], seed=case["seed"], scale=case["scale"])
    if case["padded"] is not None:
        x, T = pad(cfg, x, loss, T, case["padded"])
    wrt = case["wrt"]
    H = bh.hessian(p, x, cfg, loss=loss, target=T, wrt=wrt)
    R = bh.reference.hessian(p, x, cfg, loss=loss, target=T, wrt=wrt)
    assert H.names == R.names
    D, defect = R.dense(), autograd_defect(R.dense())  # allow: autograd's own (measured) error
    # the whole for the rounding of a block that is zero (a key bias: softmax ignores it) is the model's
    # whole Hessian, whatever wrt selects
    s = fro(D) if wrt is None else fro(bh.reference.hessian(p, x, cfg, loss=loss, target=T).dense())
    assert_close(H.dense(), D, scale=s, what="full", allow=defect)
    for a in H.names:  # every block, cross-layer ones included, to its own norm (or the whole's rounding)
        for b in H.names:
            assert_close(H[a, b], R[a, b], scale=s, what=f"block ({a}, {b})", allow=defect)
    # the parts in units of the whole: the reference's functional term is full − outer
    assert_part_close(H.outer.dense(), R.outer.dense(), s, what="outer", allow=defect)
    assert_part_close(H.functional.dense(), R.functional.dense(), s, what="functional", allow=defect)
    assert_identities(H, convex=case["row"]["loss"] in ("ce", "mse"), reference=R, what="closed form")
